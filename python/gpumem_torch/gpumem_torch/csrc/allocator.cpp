// gpumem as PyTorch's own CUDA allocator: a thin c10::cuda::CUDACachingAllocator::CUDAAllocator
// over gpumem's C ABI (crates/gpumem-torch), installed the way
// torch.cuda.memory.change_current_allocator installs one. Policy stays in Rust; this file
// translates: pointers and streams in, torch's errors, statistics and hooks out.
//
// Built against the installed torch by gpumem_torch.native (torch.utils.cpp_extension).
// Error messages are built as one std::string: formatting numbers through c10::str's ostream
// crashed in this extension with torch 2.11 (libstdc++'s locale facets; H100 machine).

#include <torch/extension.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <csignal>
#include <execinfo.h>
#include <unistd.h>
#include <mutex>
#include <string>
#include <vector>

extern "C" {
void* gpumem_alloc_checked(ssize_t size, int device, void* stream, char* err, size_t errlen,
                           int* oom);
int gpumem_free_ptr(void* ptr);
void* gpumem_alloc_token(ssize_t size, int device, void* stream, char* err, size_t errlen,
                         int* oom, uint64_t* token);
int gpumem_free_token(uint64_t token);
int gpumem_record_stream_token(uint64_t token, void* stream);
int gpumem_current_device();
uint64_t gpumem_empty_cache();
int gpumem_set_memory_fraction(double fraction, int device);
int gpumem_record_stream(void* ptr, int device, void* stream);
void gpumem_reset_peak(int device);
void gpumem_reset_accumulated(int device);
int gpumem_stats_values(int device, const char* const* keys, int64_t* out, size_t n);
uint64_t gpumem_largest_free_block(int device);
uint64_t gpumem_largest_available_block(int device);
size_t gpumem_segments_flat(int device, uint64_t* out, size_t cap);
void gpumem_record_history(int on, size_t max_entries, int clear);
uint64_t gpumem_history_set_tag(uint64_t tag);
int gpumem_history_enabled();
size_t gpumem_history_flat(int device, uint64_t* out, size_t cap);
uint64_t gpumem_history_count(int device);
int gpumem_pool_begin(int device, uint64_t a, uint64_t b);
int gpumem_pool_end(int device, uint64_t a, uint64_t b);
int gpumem_pool_incref(int device, uint64_t a, uint64_t b);
int gpumem_pool_release(int device, uint64_t a, uint64_t b);
int gpumem_pool_use_count(int device, uint64_t a, uint64_t b);
int gpumem_pool_set_no_split(int device, uint64_t a, uint64_t b);
int gpumem_pool_incref_external(int device, uint64_t a, uint64_t b, void* ctx,
                                void* (*alloc)(void*, size_t, void*),
                                void (*free)(void*, void*, size_t, void*),
                                void (*drop)(void*), const char* name);
void* gpumem_pool_alloc_checked(int device, uint64_t a, uint64_t b, ssize_t size, void* stream,
                                char* err, size_t errlen, int* oom);
ssize_t gpumem_pool_live(int device, uint64_t a, uint64_t b, uint64_t* out, size_t cap);
uint64_t gpumem_pool_empty_cache(uint64_t a, uint64_t b);
size_t gpumem_pool_segments_flat(int device, uint64_t a, uint64_t b, uint64_t* out, size_t cap);
size_t gpumem_pool_ids(int device, uint64_t* out, size_t cap);
void* gpumem_pool_checkpoint(int device, uint64_t a, uint64_t b);
size_t gpumem_checkpoint_allocated(const void* ckpt);
void gpumem_checkpoint_free(void* ckpt);
ssize_t gpumem_ipc_share(uint64_t ptr, uint8_t* out, size_t cap, int64_t* offset);
int gpumem_ipc_open(int device, const uint8_t* handle, size_t len, uint64_t* out);
int gpumem_ipc_close(uint64_t ptr);
size_t gpumem_ipc_last_error(char* buf, size_t cap);
uint64_t gpumem_base_allocation(uint64_t ptr, uint64_t* size);
int gpumem_set_segment_listener(void (*f)(void*, int, int, uint64_t, uint64_t, uint64_t, uint64_t,
                                          uint64_t),
                                void* ctx);
int gpumem_pool_restore(int device, uint64_t a, uint64_t b, const void* ckpt, uint64_t* freed,
                        size_t freed_cap, uint64_t* allocd, size_t allocd_cap, size_t* counts);
}

namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

// CUDA-graph captures (and MemPool contexts) under way: while any is, allocations are routed
// by torch's filters and gpumem's calls run in relaxed capture mode (a capture in global mode
// forbids other threads' event queries and device allocations, as PyTorch's own allocator
// knows: it does the same around cudaMalloc).
std::atomic<int> g_captures{0};
// blocks from cudaMalloc while the caching allocator was disabled (see uncached_alloc)
std::atomic<int> g_uncached{0};

// Stack traces for torch.cuda.memory._record_memory_history (PyTorch's RecordContext: 0 none,
// 1 live blocks only ("state"), 2 also allocations in the trace ("alloc"), 3 also frees and
// emptying the cache ("all")). gpumem records the events; this side gathers the traces with
// PyTorch's recorder and ties them to the events a call records through a tag
// (gpumem_history_set_tag), and to the live blocks by address.
using Ctx = std::invoke_result_t<CCA::CreateContextFn>;
std::atomic<int> g_ctx{0};

struct Contexts {
  std::mutex mu;
  CCA::CreateContextFn recorder = nullptr;
  std::unordered_map<void*, Ctx> live;
  std::unordered_map<uint64_t, Ctx> tags;
  std::deque<uint64_t> order;
  uint64_t next = 1;
  size_t cap = 100000;
};

Contexts& contexts() {
  static Contexts* c = new Contexts();  // never destroyed: traces may outlive Python's exit
  return *c;
}

Ctx gather_context() {
  CCA::CreateContextFn f = nullptr;
  {
    std::lock_guard<std::mutex> l(contexts().mu);
    f = contexts().recorder;
  }
  return f ? f() : nullptr;
}

// a tag for the events of one call, remembered with its trace (the oldest go beyond the cap)
uint64_t tag_for(const Ctx& ctx) {
  if (!ctx) return 0;
  auto& c = contexts();
  std::lock_guard<std::mutex> l(c.mu);
  uint64_t id = c.next++;
  c.tags.emplace(id, ctx);
  c.order.push_back(id);
  while (c.order.size() > c.cap) {
    c.tags.erase(c.order.front());
    c.order.pop_front();
  }
  return id;
}

// the events this thread records while it lives carry `tag`
struct TagScope {
  explicit TagScope(uint64_t tag) : on_(tag != 0) {
    if (on_) prev_ = gpumem_history_set_tag(tag);
  }
  ~TagScope() {
    if (on_) (void)gpumem_history_set_tag(prev_);
  }
  TagScope(const TagScope&) = delete;
  TagScope& operator=(const TagScope&) = delete;

 private:
  bool on_;
  uint64_t prev_ = 0;
};

// a block is freed: its trace goes; with "all", the free's own trace tags its events
uint64_t on_free_context(void* ptr) {
  int mode = g_ctx.load(std::memory_order_relaxed);
  if (ptr) {
    std::lock_guard<std::mutex> l(contexts().mu);
    contexts().live.erase(ptr);
  }
  return mode >= 3 ? tag_for(gather_context()) : 0;
}

struct RelaxedCaptureMode {
  explicit RelaxedCaptureMode(bool on) : on_(on) {
    if (on_) {
      mode_ = cudaStreamCaptureModeRelaxed;
      if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) {
        (void)cudaGetLastError();
        on_ = false;
      }
    }
  }
  ~RelaxedCaptureMode() {
    if (on_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  bool on_;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

void gpumem_delete(void* ptr) {
  RelaxedCaptureMode relaxed(g_captures.load(std::memory_order_relaxed) > 0);
  TagScope tag(C10_UNLIKELY(g_ctx.load(std::memory_order_relaxed) > 0) ? on_free_context(ptr)
                                                                       : 0);
  gpumem_free_ptr(ptr);
}

std::string ipc_error() {
  std::string e(gpumem_ipc_last_error(nullptr, 0) + 1, '\0');
  gpumem_ipc_last_error(e.data(), e.size());
  e.resize(e.size() - 1);
  return e;
}

// the deleter of tensors' memory: the DataPtr's context is gpumem's token for the block, so
// freeing needs no address lookup
void gpumem_delete_token(void* ctx) {
  RelaxedCaptureMode relaxed(g_captures.load(std::memory_order_relaxed) > 0);
  // (a block handed out by token was allocated while traces were off: none to forget)
  TagScope tag(C10_UNLIKELY(g_ctx.load(std::memory_order_relaxed) > 0)
                   ? on_free_context(nullptr)
                   : 0);
  gpumem_free_token(reinterpret_cast<uint64_t>(ctx));
}

// torch's current device: the device of the thread's current CUDA context, read by one driver
// call (c10::cuda::current_device() costs 54 ns on the H100 host, this a fraction), else
// (no context on this thread yet) torch's own lookup
c10::DeviceIndex current_device() {
  int d = gpumem_current_device();
  return d >= 0 ? static_cast<c10::DeviceIndex>(d) : c10::cuda::current_device();
}

bool is_pool(c10::MempoolId_t id) {
  return id.first != 0 || id.second != 0;
}

std::string pool_name(c10::MempoolId_t id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

// A size as PyTorch's out-of-memory message writes it (bytes, KiB, MiB, GiB, two decimals);
// snprintf, not an ostream (see the note at the top)
std::string format_size(uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    snprintf(buf, sizeof buf, "%.2f KiB", size / 1024.0);
  } else if (size <= 1073741824ULL) {
    snprintf(buf, sizeof buf, "%.2f MiB", size / 1048576.0);
  } else {
    snprintf(buf, sizeof buf, "%.2f GiB", size / 1073741824.0);
  }
  return buf;
}

// A checkpoint of a private pool (CUDA graph trees): gpumem's saved layout.
struct GpumemState final : CCA::AllocatorState {
  GpumemState(c10::DeviceIndex dev, c10::MempoolId_t id, void* ckpt)
      : dev(dev), id(id), ckpt(ckpt) {}
  ~GpumemState() override {
    gpumem_checkpoint_free(ckpt);
  }
  c10::DeviceIndex dev;
  c10::MempoolId_t id;
  void* ckpt;
};

// the segments of a flat answer (gpumem_segments_flat's layout) into a snapshot
void add_segments(CCA::SnapshotInfo& info, int dev, const std::vector<uint64_t>& flat,
                  c10::MempoolId_t owner,
                  const std::unordered_map<void*, Ctx>* live_ctx = nullptr) {
  size_t i = 0;
  while (i + 6 <= flat.size()) {
    c10::CachingDeviceAllocator::SegmentInfo seg;
    seg.device = static_cast<c10::DeviceIndex>(dev);
    seg.address = flat[i];
    seg.total_size = flat[i + 1];
    seg.stream = reinterpret_cast<void*>(flat[i + 2]);
    seg.is_large = flat[i + 3] != 0;
    seg.is_expandable = flat[i + 4] != 0;
    seg.owner_private_pool_id = owner;
    size_t blocks = flat[i + 5];
    uint64_t addr = flat[i];
    i += 6;
    for (size_t b = 0; b < blocks && i + 4 <= flat.size(); ++b, i += 4) {
      c10::CachingDeviceAllocator::BlockInfo block;
      block.size = flat[i];
      block.requested_size = flat[i + 1];
      block.allocated = flat[i + 2] != 0;
      block.active = flat[i + 3] != 0;
      if (block.allocated) {
        seg.allocated_size += block.size;
        seg.requested_size += block.requested_size;
      }
      if (block.active) seg.active_size += block.size;
      if (block.allocated && live_ctx) {
        auto it = live_ctx->find(reinterpret_cast<void*>(addr));
        if (it != live_ctx->end()) block.context_when_allocated = it->second;
      }
      addr += block.size;
      seg.blocks.push_back(block);
    }
    info.segments.push_back(std::move(seg));
  }
}

// torch.cuda.memory_stats() names, in the order getDeviceStats reads them back
const char* const kArrays[] = {"allocation",   "segment",        "active",
                               "inactive_split", "allocated_bytes", "reserved_bytes",
                               "active_bytes", "inactive_split_bytes", "requested_bytes"};
const char* const kPools[] = {"all", "small_pool", "large_pool"};
const char* const kFields[] = {"current", "peak", "allocated", "freed"};
const char* const kScalars[] = {"num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                "num_device_alloc", "num_device_free"};

const std::vector<std::string>& stat_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (auto a : kArrays)
      for (auto p : kPools)
        for (auto f : kFields) v.push_back(std::string(a) + "." + p + "." + f);
    for (auto s : kScalars) v.emplace_back(s);
    return v;
  }();
  return names;
}

class GpumemAllocator final : public CCA::CUDAAllocator {
 public:
  // tensors' memory: freed by token (no address lookup) unless a capture or MemPool context
  // routes allocations, where blocks are freed by address (torch swaps and compares the
  // deleters of graph pools' storages with raw_deleter())
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex dev = current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
    c10::Device device(c10::DeviceType::CUDA, dev);
    if (C10_UNLIKELY(n == 0 || g_captures.load(std::memory_order_relaxed) > 0 ||
                     g_ctx.load(std::memory_order_relaxed) > 0)) {
      void* p = alloc_traced(n, dev, stream);
      return {p, p, &gpumem_delete, device};
    }
    char err[1024];
    err[0] = 0;
    int oom = 0;
    uint64_t token = 0;
    void* p = gpumem_alloc_token(static_cast<ssize_t>(n), dev, stream, err, sizeof err, &oom,
                                 &token);
    if (C10_UNLIKELY(!p)) {
      // the slow path says why (and lends from use_on_oom pools)
      p = alloc_or_throw(n, dev, stream);
      return {p, p, &gpumem_delete, device};
    }
    return {p, reinterpret_cast<void*>(token), &gpumem_delete_token, device};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &gpumem_delete;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    RelaxedCaptureMode relaxed(g_captures.load(std::memory_order_relaxed) > 0);
    // with "all", the segments given back carry the trace of this call
    TagScope tag(g_ctx.load(std::memory_order_relaxed) >= 3 ? tag_for(gather_context()) : 0);
    if (is_pool(mempool_id)) {
      gpumem_pool_empty_cache(mempool_id.first, mempool_id.second);
    } else {
      gpumem_empty_cache();
    }
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get()) return;
    RelaxedCaptureMode relaxed(g_captures.load(std::memory_order_relaxed) > 0);
    if (ptr.get_deleter() == &gpumem_delete_token) {
      gpumem_record_stream_token(reinterpret_cast<uint64_t>(ptr.get_context()), stream.stream());
      return;
    }
    gpumem_record_stream(ptr.get(), ptr.device().index(), stream.stream());
  }
  DeviceStats getDeviceStats(c10::DeviceIndex dev) override {
    const auto& names = stat_names();
    std::vector<const char*> keys;
    keys.reserve(names.size());
    for (const auto& n : names) keys.push_back(n.c_str());
    std::vector<int64_t> v(names.size(), 0);
    if (gpumem_stats_values(dev, keys.data(), v.data(), v.size()) != 0) {
      TORCH_CHECK(false, "gpumem: no statistics for device " + std::to_string(dev) +
                             " (it could not be initialised)");
    }
    DeviceStats s;
    StatArray* arrays[] = {&s.allocation,     &s.segment,        &s.active,
                           &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                           &s.active_bytes,   &s.inactive_split_bytes, &s.requested_bytes};
    size_t i = 0;
    for (auto* a : arrays) {
      for (size_t p = 0; p < 3; ++p) {
        Stat& st = (*a)[p];
        st.current = v[i++];
        st.peak = v[i++];
        st.allocated = v[i++];
        st.freed = v[i++];
      }
    }
    s.num_alloc_retries = v[i++];
    s.num_ooms = v[i++];
    s.num_sync_all_streams = v[i++];
    s.num_device_alloc = v[i++];
    s.num_device_free = v[i++];
    return s;
  }
  void resetAccumulatedStats(c10::DeviceIndex dev) override {
    gpumem_reset_accumulated(dev);
  }
  void resetPeakStats(c10::DeviceIndex dev) override {
    gpumem_reset_peak(dev);
  }
  void* raw_alloc(size_t n) override {
    c10::DeviceIndex dev = current_device();
    if (!enabled_) return uncached_alloc(n, dev);
    return alloc_traced(n, dev, c10::cuda::getCurrentCUDAStream(dev).stream());
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
    if (!enabled_) return uncached_alloc(n, current_device());
    return alloc_traced(n, current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    if (C10_UNLIKELY(g_uncached.load(std::memory_order_relaxed) > 0) && uncached_free(ptr)) return;
    gpumem_delete(ptr);
  }
  void init(int device_count) override {
    std::lock_guard<std::mutex> l(mu_);
    fractions_.assign(static_cast<size_t>(device_count), 1.0);
  }
  double getMemoryFraction(c10::DeviceIndex dev) override {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<size_t>(dev) < fractions_.size() ? fractions_[dev] : 1.0;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex dev) override {
    if (gpumem_set_memory_fraction(fraction, dev) != 0) {
      TORCH_CHECK(false, "gpumem: cannot set memory fraction " + std::to_string(fraction) +
                             " on device " + std::to_string(dev));
    }
    std::lock_guard<std::mutex> l(mu_);
    if (static_cast<size_t>(dev) >= fractions_.size()) fractions_.resize(dev + 1, 1.0);
    fractions_[dev] = fraction;
  }
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    return {};
  }
  void enable(bool value) override {
    enabled_ = value;
  }
  bool isEnabled() const override {
    return enabled_;
  }
  // As PyTorch's own allocator answers it: a zero `*largest` asks for a first guess, the
  // device's free memory (here within gpumem's budget); then the largest cached block, where
  // that is more. cuDNN's convolutions size their workspace by the answer (the cache alone
  // would hold them to slower algorithms whenever it runs tight).
  void cacheInfo(c10::DeviceIndex dev, size_t* largest) override {
    // (the available block already counts the largest cached one)
    const uint64_t ours = *largest == 0 ? gpumem_largest_available_block(dev)
                                        : gpumem_largest_free_block(dev);
    *largest = std::max(*largest, static_cast<size_t>(ours));
  }
  // the classic segment that holds `ptr` (a block in virtual-memory pages has none, as with
  // PyTorch's expandable segments)
  void* getBaseAllocation(void* ptr, size_t* size) override {
    uint64_t bytes = 0;
    uint64_t base = gpumem_base_allocation(reinterpret_cast<uint64_t>(ptr), &bytes);
    TORCH_CHECK(base != 0, "gpumem: getBaseAllocation: " + ipc_error());
    if (size) *size = static_cast<size_t>(bytes);
    return reinterpret_cast<void*>(base);
  }
  CCA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool /*include_traces*/) override {
    // the segments of every device in use (an expandable segment as one segment per mapped
    // run of pages), and the recorded history
    CCA::SnapshotInfo info;
    // the traces of live blocks and of recorded events, copied under the lock
    std::unordered_map<void*, Ctx> live_ctx;
    std::unordered_map<uint64_t, Ctx> tag_ctx;
    if (g_ctx.load(std::memory_order_relaxed) > 0) {
      std::lock_guard<std::mutex> l(contexts().mu);
      live_ctx = contexts().live;
      tag_ctx = contexts().tags;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return info;
    }
    for (int dev = 0; dev < count; ++dev) {
      std::vector<uint64_t> flat;
      if (is_pool(mempool_id)) {
        flat.resize(gpumem_pool_segments_flat(dev, mempool_id.first, mempool_id.second,
                                              nullptr, 0));
        if (flat.empty()) continue;
        flat.resize(gpumem_pool_segments_flat(dev, mempool_id.first, mempool_id.second,
                                              flat.data(), flat.size()));
      } else {
        // every segment, each with the pool it belongs to (as PyTorch's snapshot lists them)
        flat.resize(gpumem_segments_flat(dev, nullptr, 0));
        flat.resize(gpumem_segments_flat(dev, flat.data(), flat.size()));
        std::vector<uint64_t> ids(gpumem_pool_ids(dev, nullptr, 0));
        ids.resize(gpumem_pool_ids(dev, ids.data(), ids.size()));
        for (size_t k = 0; k + 2 <= ids.size(); k += 2) {
          std::vector<uint64_t> pf(gpumem_pool_segments_flat(dev, ids[k], ids[k + 1], nullptr, 0));
          if (pf.empty()) continue;
          pf.resize(gpumem_pool_segments_flat(dev, ids[k], ids[k + 1], pf.data(), pf.size()));
          add_segments(info, dev, pf,
                       c10::MempoolId_t{static_cast<decltype(c10::MempoolId_t{}.first)>(ids[k]),
                                        static_cast<decltype(c10::MempoolId_t{}.second)>(ids[k + 1])},
                       &live_ctx);
        }
      }
      add_segments(info, dev, flat, mempool_id, &live_ctx);
    }
    info.device_traces.resize(static_cast<size_t>(count));
    if (gpumem_history_enabled()) {
      using Entry = c10::CachingDeviceAllocator::TraceEntry;
      std::vector<std::string> skip;
      {
        std::lock_guard<std::mutex> l(mu_);
        skip = skip_actions_;
      }
      for (int dev = 0; dev < count; ++dev) {
        std::vector<uint64_t> flat(gpumem_history_flat(dev, nullptr, 0));
        if (flat.empty()) continue;
        flat.resize(gpumem_history_flat(dev, flat.data(), flat.size()));
        // event numbers (gpumem_history_count) of the entries, for their user metadata
        uint64_t first = gpumem_history_count(dev) - flat.size() / 6;
        std::vector<std::pair<uint64_t, std::string>> marks;
        {
          std::lock_guard<std::mutex> l(mu_);
          if (static_cast<size_t>(dev) < metadata_marks_.size()) marks = metadata_marks_[dev];
        }
        size_t mark = 0;
        std::string metadata;
        for (size_t i = 0; i + 6 <= flat.size(); i += 6) {
          for (uint64_t number = first + i / 6; mark < marks.size() && marks[mark].first <= number;
               ++mark) {
            metadata = marks[mark].second;
          }
          if (!skip.empty() && skipped(static_cast<Entry::Action>(flat[i]), skip)) continue;
          Ctx ctx;
          if (flat[i + 5] != 0) {
            auto it = tag_ctx.find(flat[i + 5]);
            if (it != tag_ctx.end()) ctx = it->second;
          }
          info.device_traces[dev].emplace_back(
              static_cast<Entry::Action>(flat[i]), static_cast<c10::DeviceIndex>(dev),
              static_cast<size_t>(flat[i + 1]), static_cast<size_t>(flat[i + 2]),
              reinterpret_cast<void*>(flat[i + 3]), c10::MempoolId_t{0, 0},
              static_cast<c10::approx_time_t>(flat[i + 4]), std::move(ctx), "", metadata);
        }
      }
    }
    return info;
  }
  // CUDA graphs and MemPool: private pools. Allocations on a stream a capture's filter accepts
  // go to its pool (the newest capture first, as in PyTorch); frees go back to the pool the
  // block came from.
  void beginAllocateToPool(c10::DeviceIndex dev, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (const auto& c : captures_) {
        TORCH_CHECK(!(c.dev == dev && c.id == id),
                    "gpumem: beginAllocateToPool: already recording to pool " + pool_name(id));
      }
    }
    TORCH_CHECK(gpumem_pool_begin(dev, id.first, id.second) == 0,
                "gpumem: cannot start allocating to pool " + pool_name(id) + " on device " +
                    std::to_string(dev));
    std::lock_guard<std::mutex> l(mu_);
    captures_.push_back(Capture{dev, id, std::move(filter)});
    g_captures.fetch_add(1);
  }
  void endAllocateToPool(c10::DeviceIndex dev, c10::MempoolId_t id) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = std::find_if(captures_.begin(), captures_.end(),
                             [&](const Capture& c) { return c.dev == dev && c.id == id; });
      TORCH_CHECK(it != captures_.end(),
                  "gpumem: endAllocateToPool: not recording to pool " + pool_name(id));
      captures_.erase(it);
      g_captures.fetch_sub(1);
    }
    gpumem_pool_end(dev, id.first, id.second);
  }
  // called from CUDAGraph's destructor: never throws
  void releasePool(c10::DeviceIndex dev, c10::MempoolId_t id) override {
    RelaxedCaptureMode relaxed(g_captures.load(std::memory_order_relaxed) > 0);
    if (gpumem_pool_release(dev, id.first, id.second) != 0) {
      TORCH_WARN(std::string("gpumem: releasePool: pool ") + pool_name(id) +
                 " has no users to release");
    }
    // a pool nobody holds any more lends nothing on out-of-memory (as in PyTorch)
    if (gpumem_pool_use_count(dev, id.first, id.second) <= 0) setUseOnOOM(dev, id, false);
  }
  int getPoolUseCount(c10::DeviceIndex dev, c10::MempoolId_t id) override {
    int n = gpumem_pool_use_count(dev, id.first, id.second);
    return n < 0 ? 0 : n;
  }
  // MemPool(allocator): the pool's segments come from that allocator (a
  // CUDAPluggableAllocator, NCCL's) and go back to it, as in PyTorch's own pools; gpumem
  // caches them and counts them against the memory fraction
  void createOrIncrefPool(c10::DeviceIndex dev, c10::MempoolId_t id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    int r = 0;
    if (allocator && allocator.get() != this) {
      auto* ctx = new std::shared_ptr<CCA::CUDAAllocator>(std::move(allocator));
      std::string name = (*ctx)->name();
      r = gpumem_pool_incref_external(dev, id.first, id.second, ctx, &external_alloc,
                                      &external_free, &external_drop, name.c_str());
    } else {
      r = gpumem_pool_incref(dev, id.first, id.second);
    }
    TORCH_CHECK(r == 0, "gpumem: cannot create pool " + pool_name(id) + " on device " +
                            std::to_string(dev));
  }
  // the other allocator's calls, as gpumem makes them (never throwing across it)
  static void* external_alloc(void* ctx, size_t n, void* stream) noexcept {
    try {
      auto& a = *static_cast<std::shared_ptr<CCA::CUDAAllocator>*>(ctx);
      return a->raw_alloc_with_stream(n, static_cast<cudaStream_t>(stream));
    } catch (const std::exception& e) {
      warn_quietly(std::string("gpumem: the MemPool's allocator failed: ") + e.what());
      return nullptr;
    } catch (...) {
      warn_quietly("gpumem: the MemPool's allocator failed");
      return nullptr;
    }
  }
  static void external_free(void* ctx, void* p, size_t, void*) noexcept {
    try {
      auto& a = *static_cast<std::shared_ptr<CCA::CUDAAllocator>*>(ctx);
      a->raw_delete(p);
    } catch (const std::exception& e) {
      warn_quietly(std::string("gpumem: the MemPool's allocator could not free its memory: ") +
                   e.what());
    } catch (...) {
      warn_quietly("gpumem: the MemPool's allocator could not free its memory");
    }
  }
  // a warning that cannot throw (Python may turn warnings into errors)
  static void warn_quietly(const std::string& what) noexcept {
    try {
      TORCH_WARN(what);
    } catch (...) {
    }
  }
  static void external_drop(void* ctx) noexcept {
    delete static_cast<std::shared_ptr<CCA::CUDAAllocator>*>(ctx);
  }
  void setUseOnOOM(c10::DeviceIndex dev, c10::MempoolId_t id, bool use_on_oom) override {
    std::lock_guard<std::mutex> l(mu_);
    auto key = std::make_pair(dev, id);
    auto it = std::find(use_on_oom_.begin(), use_on_oom_.end(), key);
    if (use_on_oom && it == use_on_oom_.end()) use_on_oom_.push_back(key);
    if (!use_on_oom && it != use_on_oom_.end()) use_on_oom_.erase(it);
  }
  // MemPool(no_split=True): the pool's blocks are never split (each allocation takes a whole
  // free block or a segment of its own)
  void setNoSplit(c10::DeviceIndex dev, c10::MempoolId_t id) override {
    TORCH_CHECK(gpumem_pool_set_no_split(dev, id.first, id.second) == 0,
                "gpumem: no private pool " + pool_name(id) + " on device " + std::to_string(dev) +
                    " to set no_split on");
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex dev, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    ssize_t n = gpumem_pool_live(dev, id.first, id.second, nullptr, 0);
    if (n < 0) return expected.empty();
    std::vector<uint64_t> live(static_cast<size_t>(n));
    n = gpumem_pool_live(dev, id.first, id.second, live.data(), live.size());
    if (static_cast<size_t>(n) != expected.size()) return false;
    for (uint64_t p : live) {
      if (!expected.count(reinterpret_cast<void*>(p))) return false;
    }
    return true;
  }
  // torch.multiprocessing: a block in a classic segment is shared with the driver's IPC handle
  // in PyTorch's own layout (a receiver running PyTorch's allocator opens it too); a block in
  // virtual-memory pages as exported page descriptors (the receiver must run gpumem)
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    int64_t offset = 0;
    ssize_t n = gpumem_ipc_share(reinterpret_cast<uint64_t>(ptr), nullptr, 0, &offset);
    TORCH_CHECK(n > 0, "gpumem: " + ipc_error());
    std::string handle(static_cast<size_t>(n), '\0');
    n = gpumem_ipc_share(reinterpret_cast<uint64_t>(ptr),
                         reinterpret_cast<uint8_t*>(handle.data()), handle.size(), &offset);
    TORCH_CHECK(n == static_cast<ssize_t>(handle.size()), "gpumem: " + ipc_error());
    return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), handle};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    c10::DeviceIndex dev = c10::cuda::current_device();
    uint64_t p = 0;
    int r = gpumem_ipc_open(dev, reinterpret_cast<const uint8_t*>(handle.data()), handle.size(),
                            &p);
    TORCH_CHECK(r == 0, "gpumem: " + ipc_error());
    return std::shared_ptr<void>(reinterpret_cast<void*>(p), [](void* q) {
      gpumem_ipc_close(reinterpret_cast<uint64_t>(q));
    });
  }
  // torch.cuda.memory._set_memory_metadata: the history's entries from now on carry it (each
  // device's event number at the call marks where it starts)
  void setUserMetadata(const std::string& metadata) override {
    int n = c10::cuda::device_count();
    std::vector<uint64_t> at(n);
    for (int dev = 0; dev < n; ++dev) at[dev] = gpumem_history_count(dev);
    std::lock_guard<std::mutex> l(mu_);
    user_metadata_ = metadata;
    if (metadata_marks_.size() < static_cast<size_t>(n)) metadata_marks_.resize(n);
    for (int dev = 0; dev < n; ++dev) {
      auto& marks = metadata_marks_[dev];
      // (a bounded list: the oldest marks go first; a mark at the same event replaces it)
      if (!marks.empty() && marks.back().first == at[dev]) marks.pop_back();
      if (marks.size() >= 4096) marks.erase(marks.begin(), marks.begin() + 2048);
      marks.emplace_back(at[dev], metadata);
    }
  }
  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> l(mu_);
    return user_metadata_;
  }
  bool isHistoryEnabled() override {
    return gpumem_history_enabled() != 0;
  }
  // allocation history, with PyTorch's stack traces where it asks for them (see Contexts)
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when,
                     bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      skip_actions_ = skip_actions;
    }
    int mode = enabled && context_recorder ? static_cast<int>(when) : 0;
    {
      auto& c = contexts();
      std::lock_guard<std::mutex> l(c.mu);
      c.recorder = mode > 0 ? context_recorder : nullptr;
      c.cap = alloc_trace_max_entries > 0 ? alloc_trace_max_entries : 100000;
      if (!enabled || clearHistory) {
        c.tags.clear();
        c.order.clear();
      }
      if (mode == 0) c.live.clear();
    }
    g_ctx.store(mode, std::memory_order_relaxed);
    gpumem_record_history(enabled ? 1 : 0, alloc_trace_max_entries, clearHistory ? 1 : 0);
  }
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> l(mu_);
    observers_.push_back(std::move(observer));
  }
  // PyTorch's allocator trace trackers, through which ProcessGroupNCCL registers memory with
  // NCCL (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1): each range a registering user may
  // hold (a classic segment, or the pages one map made) is told as SEGMENT_ALLOC once it
  // exists and as SEGMENT_FREE before any of its memory is unmapped or freed (see
  // trackers.rs: PyTorch's NCCL hooks act on those two actions only)
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    {
      std::lock_guard<std::mutex> l(trackers_mu());
      trackers().push_back(std::move(tracker));
    }
    static std::once_flag once;
    std::call_once(once, [] { gpumem_set_segment_listener(&GpumemAllocator::on_segment, nullptr); });
  }
  static std::mutex& trackers_mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<CCA::AllocatorTraceTracker>& trackers() {
    static std::vector<CCA::AllocatorTraceTracker> t;
    return t;
  }
  // called by gpumem on the allocating thread, a pool's lock held: never throws
  static void on_segment(void*, int dev, int reg, uint64_t addr, uint64_t bytes, uint64_t stream,
                         uint64_t pool_a, uint64_t pool_b) {
    using Entry = c10::CachingDeviceAllocator::TraceEntry;
    try {
      Entry te(reg ? Entry::SEGMENT_ALLOC : Entry::SEGMENT_FREE, static_cast<c10::DeviceIndex>(dev),
               static_cast<size_t>(addr), static_cast<size_t>(bytes),
               reinterpret_cast<cudaStream_t>(stream),
               c10::MempoolId_t{static_cast<decltype(c10::MempoolId_t{}.first)>(pool_a),
                                static_cast<decltype(c10::MempoolId_t{}.second)>(pool_b)},
               c10::getApproximateTime());
      std::vector<CCA::AllocatorTraceTracker> ts;
      {
        std::lock_guard<std::mutex> l(trackers_mu());
        ts = trackers();
      }
      for (auto& t : ts) {
        try {
          t(te);
        } catch (const std::exception& e) {
          TORCH_WARN("gpumem: an allocator trace tracker failed: ", e.what());
        } catch (...) {
          TORCH_WARN("gpumem: an allocator trace tracker failed");
        }
      }
    } catch (...) {
    }
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard g(dev);
    cudaError_t e = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(e);
  }
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex dev,
                                                          c10::MempoolId_t id) override {
    void* ckpt = gpumem_pool_checkpoint(dev, id.first, id.second);
    TORCH_CHECK(ckpt, "gpumem: no private pool " + pool_name(id) + " on device " +
                          std::to_string(dev) + " to checkpoint");
    return std::make_shared<GpumemState>(dev, id, ckpt);
  }
  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex dev,
                                              std::shared_ptr<CCA::AllocatorState> pps) override {
    auto st = std::dynamic_pointer_cast<GpumemState>(pps);
    TORCH_CHECK(st, "gpumem: this checkpoint was not taken by gpumem");
    TORCH_CHECK(st->dev == dev, "gpumem: checkpoint of device " + std::to_string(st->dev) +
                                    " restored on device " + std::to_string(dev));
    RelaxedCaptureMode relaxed(g_captures.load(std::memory_order_relaxed) > 0);
    ssize_t live = gpumem_pool_live(dev, st->id.first, st->id.second, nullptr, 0);
    TORCH_CHECK(live >= 0, "gpumem: pool " + pool_name(st->id) + " is gone");
    std::vector<uint64_t> freed(static_cast<size_t>(live));
    std::vector<uint64_t> allocd(gpumem_checkpoint_allocated(st->ckpt));
    size_t counts[2] = {0, 0};
    int r = gpumem_pool_restore(dev, st->id.first, st->id.second, st->ckpt, freed.data(),
                                freed.size(), allocd.data(), allocd.size(), counts);
    TORCH_CHECK(r == 0, "gpumem: cannot restore pool " + pool_name(st->id) +
                            " to its checkpoint (its segments changed)");
    CCA::CheckpointDelta delta;
    for (size_t i = 0; i < counts[0] && i < freed.size(); ++i)
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(freed[i]));
    for (size_t i = 0; i < counts[1] && i < allocd.size(); ++i) {
      void* p = reinterpret_cast<void*>(allocd[i]);
      delta.dataptrs_allocd.emplace_back(p, p, &gpumem_delete,
                                         c10::Device(c10::DeviceType::CUDA, dev));
    }
    return delta;
  }
  std::string name() override {
    return "gpumem";
  }

 private:
  // alloc_or_throw, gathering the stack trace where history asks for it: the events of the
  // allocation carry it ("alloc", "all"), and the block keeps it while it lives
  void* alloc_traced(size_t n, c10::DeviceIndex dev, cudaStream_t stream) {
    int mode = g_ctx.load(std::memory_order_relaxed);
    if (C10_LIKELY(mode == 0)) return alloc_or_throw(n, dev, stream);
    Ctx ctx = gather_context();
    void* p = nullptr;
    {
      TagScope tag(mode >= 2 ? tag_for(ctx) : 0);
      p = alloc_or_throw(n, dev, stream);
    }
    if (p && ctx) {
      std::lock_guard<std::mutex> l(contexts().mu);
      contexts().live[p] = std::move(ctx);
    }
    return p;
  }
  // torch.cuda.caching_allocator_enable(False): raw allocations go straight to cudaMalloc,
  // outside gpumem's cache and statistics, as PyTorch's own allocator does
  void* uncached_alloc(size_t n, c10::DeviceIndex dev) {
    if (n == 0) return nullptr;
    c10::cuda::CUDAGuard g(dev);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, n);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      TORCH_CHECK_WITH(OutOfMemoryError, false,
                       "CUDA out of memory. Tried to allocate " + format_size(n) +
                           " with the caching allocator disabled (cudaMalloc)");
    }
    C10_CUDA_CHECK(e);
    std::lock_guard<std::mutex> l(mu_);
    uncached_.insert(p);
    g_uncached.fetch_add(1);
    return p;
  }
  bool uncached_free(void* p) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!uncached_.erase(p)) return false;
      g_uncached.fetch_sub(1);
    }
    C10_CUDA_CHECK(cudaFree(p));
    return true;
  }
  static bool skipped(c10::CachingDeviceAllocator::TraceEntry::Action a,
                      const std::vector<std::string>& skip) {
    using A = c10::CachingDeviceAllocator::TraceEntry::Action;
    const char* name = "";
    switch (a) {
      case A::ALLOC: name = "alloc"; break;
      case A::FREE_REQUESTED: name = "free_requested"; break;
      case A::FREE_COMPLETED: name = "free_completed"; break;
      case A::SEGMENT_ALLOC: name = "segment_alloc"; break;
      case A::SEGMENT_FREE: name = "segment_free"; break;
      case A::SEGMENT_MAP: name = "segment_map"; break;
      case A::SEGMENT_UNMAP: name = "segment_unmap"; break;
      case A::SNAPSHOT: name = "snapshot"; break;
      case A::OOM: name = "oom"; break;
      default: break;
    }
    return std::find(skip.begin(), skip.end(), name) != skip.end();
  }

  struct Capture {
    c10::DeviceIndex dev;
    c10::MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };

  // the pool a capture's filter routes this allocation to, if any (newest capture first)
  bool route(c10::DeviceIndex dev, cudaStream_t stream, c10::MempoolId_t* id) {
    std::lock_guard<std::mutex> l(mu_);
    for (auto it = captures_.rbegin(); it != captures_.rend(); ++it) {
      if (it->dev == dev && it->filter(stream)) {
        *id = it->id;
        return true;
      }
    }
    return false;
  }

  void* alloc_or_throw(size_t n, c10::DeviceIndex dev, cudaStream_t stream) {
    if (n == 0) return nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, n < (1ULL << 60),
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    char err[1024] = {0};
    int oom = 0;
    void* p = nullptr;
    if (C10_UNLIKELY(g_captures.load(std::memory_order_relaxed) > 0)) {
      RelaxedCaptureMode relaxed(true);
      c10::MempoolId_t id{0, 0};
      if (route(dev, stream, &id)) {
        p = gpumem_pool_alloc_checked(dev, id.first, id.second, static_cast<ssize_t>(n), stream,
                                      err, sizeof err, &oom);
      } else {
        p = gpumem_alloc_checked(static_cast<ssize_t>(n), dev, stream, err, sizeof err, &oom);
      }
    } else {
      p = gpumem_alloc_checked(static_cast<ssize_t>(n), dev, stream, err, sizeof err, &oom);
    }
    if (p) return p;
    size_t free_bytes = 0, total = 0;
    {
      c10::cuda::CUDAGuard g(dev);
      if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) (void)cudaGetLastError();
    }
    // more than gpumem accepts (1 PiB) and more than the device has: out of memory, as
    // PyTorch says it
    if (!oom && total > 0 && n > total) oom = 1;
    if (oom) {
      // pools marked use_on_oom (MemPool(use_on_oom=True)) lend their memory
      std::vector<c10::MempoolId_t> lenders;
      {
        std::lock_guard<std::mutex> l(mu_);
        for (const auto& k : use_on_oom_)
          if (k.first == dev) lenders.push_back(k.second);
      }
      for (const auto& id : lenders) {
        char e2[16];
        int o2 = 0;
        p = gpumem_pool_alloc_checked(dev, id.first, id.second, static_cast<ssize_t>(n), stream,
                                      e2, sizeof e2, &o2);
        if (p) return p;
      }
      std::vector<CCA::OutOfMemoryObserver> observers;
      {
        std::lock_guard<std::mutex> l(mu_);
        observers = observers_;
      }
      int64_t vals[2] = {0, 0};
      const char* keys[2] = {"allocated_bytes.all.current", "reserved_bytes.all.current"};
      gpumem_stats_values(dev, keys, vals, 2);
      for (auto& o : observers) o(dev, static_cast<size_t>(vals[0]), total, free_bytes);
      // PyTorch's sentences first (programs match them: "CUDA out of memory.", "Tried to
      // allocate"), then gpumem's own account
      uint64_t unallocated = vals[1] > vals[0] ? static_cast<uint64_t>(vals[1] - vals[0]) : 0;
      TORCH_CHECK_WITH(OutOfMemoryError, false,
                       "CUDA out of memory. Tried to allocate " + format_size(n) + ". GPU " +
                           std::to_string(dev) + " has a total capacity of " +
                           format_size(total) + " of which " + format_size(free_bytes) +
                           " is free. Of the allocated memory " +
                           format_size(static_cast<uint64_t>(vals[0])) +
                           " is allocated by PyTorch (gpumem), and " + format_size(unallocated) +
                           " is reserved by PyTorch (gpumem) but unallocated. gpumem: " +
                           std::string(err));
    }
    TORCH_CHECK(false, "gpumem: allocation of " + std::to_string(n) + " bytes on device " +
                           std::to_string(dev) + " failed: " + std::string(err));
  }

  std::vector<Capture> captures_;
  std::vector<std::pair<c10::DeviceIndex, c10::MempoolId_t>> use_on_oom_;
  std::mutex mu_;
  std::vector<CCA::OutOfMemoryObserver> observers_;
  std::vector<double> fractions_;
  std::vector<std::string> skip_actions_;
  // _set_memory_metadata: the current string, and per device (event number, string) marks
  std::string user_metadata_;
  std::vector<std::vector<std::pair<uint64_t, std::string>>> metadata_marks_;
  std::unordered_set<void*> uncached_;
  std::atomic<bool> enabled_{true};
};

std::shared_ptr<GpumemAllocator>& instance() {
  static std::shared_ptr<GpumemAllocator> a;
  return a;
}

void on_segv(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install() {
  if (std::getenv("GPUMEM_TORCH_SEGV_TRACE")) std::signal(SIGSEGV, on_segv);
  if (instance()) return;
  instance() = std::make_shared<GpumemAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(instance());
  // torch.accelerator.* reaches the CUDA allocator through c10's allocator registry
  c10::SetAllocator(c10::DeviceType::CUDA, instance().get(), UINT8_MAX);
}

bool installed() {
  return static_cast<bool>(instance()) && CCA::get() == instance().get();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gpumem as PyTorch's CUDA allocator (a CUDAAllocator over gpumem's C ABI)";
  m.def("install", &install, "make gpumem the CUDA allocator (before any CUDA allocation)");
  m.def("installed", &installed, "whether gpumem is the current CUDA allocator");
}
