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
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <array>
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
uint64_t gpumem_empty_cache();
int gpumem_set_memory_fraction(double fraction, int device);
int gpumem_record_stream(void* ptr, int device, void* stream);
void gpumem_reset_peak(int device);
void gpumem_reset_accumulated(int device);
int gpumem_stats_values(int device, const char* const* keys, int64_t* out, size_t n);
uint64_t gpumem_largest_free_block(int device);
size_t gpumem_segments_flat(int device, uint64_t* out, size_t cap);
void gpumem_record_history(int on, size_t max_entries);
int gpumem_history_enabled();
size_t gpumem_history_flat(int device, uint64_t* out, size_t cap);
}

namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

void gpumem_delete(void* ptr) {
  gpumem_free_ptr(ptr);
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
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex dev = c10::cuda::current_device();
    void* p = alloc_or_throw(n, dev, c10::cuda::getCurrentCUDAStream(dev).stream());
    return {p, p, &gpumem_delete, c10::Device(c10::DeviceType::CUDA, dev)};
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
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    gpumem_empty_cache();
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get()) return;
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
    c10::DeviceIndex dev = c10::cuda::current_device();
    return alloc_or_throw(n, dev, c10::cuda::getCurrentCUDAStream(dev).stream());
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
    return alloc_or_throw(n, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    gpumem_free_ptr(ptr);
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
  void cacheInfo(c10::DeviceIndex dev, size_t* largest) override {
    *largest = static_cast<size_t>(gpumem_largest_free_block(dev));
  }
  void* getBaseAllocation(void* /*ptr*/, size_t* /*size*/) override {
    TORCH_CHECK(false, "gpumem: getBaseAllocation (CUDA IPC of tensors) is not supported yet");
  }
  CCA::SnapshotInfo snapshot(c10::MempoolId_t /*mempool_id*/, bool /*include_traces*/) override {
    // the segments of every device in use (an expandable segment as one segment per mapped
    // run of pages); no traces yet (gpumem records its own: see gpumem_torch)
    CCA::SnapshotInfo info;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return info;
    }
    for (int dev = 0; dev < count; ++dev) {
      std::vector<uint64_t> flat(gpumem_segments_flat(dev, nullptr, 0));
      if (flat.empty()) continue;
      flat.resize(gpumem_segments_flat(dev, flat.data(), flat.size()));
      size_t i = 0;
      while (i + 6 <= flat.size()) {
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(dev);
        seg.address = flat[i];
        seg.total_size = flat[i + 1];
        seg.stream = reinterpret_cast<void*>(flat[i + 2]);
        seg.is_large = flat[i + 3] != 0;
        seg.is_expandable = flat[i + 4] != 0;
        size_t blocks = flat[i + 5];
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
          seg.blocks.push_back(block);
        }
        info.segments.push_back(std::move(seg));
      }
    }
    info.device_traces.resize(static_cast<size_t>(count));
    if (gpumem_history_enabled()) {
      using Entry = c10::CachingDeviceAllocator::TraceEntry;
      for (int dev = 0; dev < count; ++dev) {
        std::vector<uint64_t> flat(gpumem_history_flat(dev, nullptr, 0));
        if (flat.empty()) continue;
        flat.resize(gpumem_history_flat(dev, flat.data(), flat.size()));
        for (size_t i = 0; i + 5 <= flat.size(); i += 5) {
          info.device_traces[dev].emplace_back(
              static_cast<Entry::Action>(flat[i]), static_cast<c10::DeviceIndex>(dev),
              static_cast<size_t>(flat[i + 1]), static_cast<size_t>(flat[i + 2]),
              reinterpret_cast<void*>(flat[i + 3]), c10::MempoolId_t{0, 0},
              static_cast<c10::approx_time_t>(flat[i + 4]));
        }
      }
    }
    return info;
  }
  // CUDA graphs: no private pools yet; allocations during capture come from the shared pool,
  // as through the pluggable path
  void beginAllocateToPool(c10::DeviceIndex, c10::MempoolId_t,
                           std::function<bool(cudaStream_t)>) override {}
  void endAllocateToPool(c10::DeviceIndex, c10::MempoolId_t) override {}
  void releasePool(c10::DeviceIndex, c10::MempoolId_t) override {}
  CCA::ShareableHandle shareIpcHandle(void* /*ptr*/) override {
    TORCH_CHECK(false,
                "gpumem: sharing CUDA tensors between processes is not supported yet");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override {
    TORCH_CHECK(false,
                "gpumem: opening CUDA tensors of another process is not supported yet");
  }
  bool isHistoryEnabled() override {
    return gpumem_history_enabled() != 0;
  }
  // allocation history without stack contexts (gpumem records no Python or C++ stacks)
  void recordHistory(bool enabled, CCA::CreateContextFn /*context_recorder*/,
                     size_t alloc_trace_max_entries, CCA::RecordContext /*when*/,
                     bool /*clearHistory*/,
                     const std::vector<std::string>& /*skip_actions*/) override {
    gpumem_record_history(enabled ? 1 : 0, alloc_trace_max_entries);
  }
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> l(mu_);
    observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker /*tracker*/) override {}
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
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex,
                                                          c10::MempoolId_t) override {
    TORCH_CHECK(false, "gpumem: allocator checkpoints (CUDA graph trees) are not supported yet");
  }
  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex,
                                              std::shared_ptr<CCA::AllocatorState>) override {
    TORCH_CHECK(false, "gpumem: allocator checkpoints (CUDA graph trees) are not supported yet");
  }
  std::string name() override {
    return "gpumem";
  }

 private:
  void* alloc_or_throw(size_t n, c10::DeviceIndex dev, cudaStream_t stream) {
    if (n == 0) return nullptr;
    char err[1024] = {0};
    int oom = 0;
    void* p = gpumem_alloc_checked(static_cast<ssize_t>(n), dev, stream, err, sizeof err, &oom);
    if (p) return p;
    if (oom) {
      size_t free_bytes = 0, total = 0;
      {
        c10::cuda::CUDAGuard g(dev);
        if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) (void)cudaGetLastError();
      }
      std::vector<CCA::OutOfMemoryObserver> observers;
      {
        std::lock_guard<std::mutex> l(mu_);
        observers = observers_;
      }
      int64_t allocated = 0;
      const char* key = "allocated_bytes.all.current";
      gpumem_stats_values(dev, &key, &allocated, 1);
      for (auto& o : observers) o(dev, static_cast<size_t>(allocated), total, free_bytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false,
                       "CUDA out of memory (gpumem) on device " + std::to_string(dev) + ": " +
                           std::string(err));
    }
    TORCH_CHECK(false, "gpumem: allocation of " + std::to_string(n) + " bytes on device " +
                           std::to_string(dev) + " failed: " + std::string(err));
  }

  std::mutex mu_;
  std::vector<CCA::OutOfMemoryObserver> observers_;
  std::vector<double> fractions_;
  bool enabled_ = true;
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
