// Does page work on another thread slow the allocating thread's own CUDA calls? A design
// that moves page maps, set-access and unmaps off the allocating thread (a background
// compactor) is worth having only if the driver does not make that thread's launches,
// memsets and event records wait behind them. The main thread queues a short kernel, a
// small cudaMemsetAsync and an event record per iteration (the GPU kept busy, the queue
// bounded) and times each call on the host, while a second thread does nothing, or cycles
// map + set access + unmap over 2 MiB handles, or over one 20 MiB handle, or creates and
// releases 2 MiB handles. Last, the main thread's own map + set access + unmap of one 2 MiB
// handle, alone and while the other thread cycles pages.
// Build: nvcc -O2 -o vmm_launch_contention vmm_launch_contention.cu -lcuda -lpthread
#include "vmm_probe.h"
#include <atomic>
#include <chrono>
#include <thread>

__global__ void spin_us(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}

using Clock = std::chrono::steady_clock;
static double us_since(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}
static double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * v.size()))];
}

static std::atomic<bool> stop_bg;
static std::atomic<long> bg_cycles;

// the other thread's page work, in its own reserved range
static void background(int mode, CUcontext ctx) {
  CK(cuCtxSetCurrent(ctx));
  const size_t P = 2 << 20;
  CUmemAllocationProp p = prop();
  if (mode == 0) return;
  if (mode == 3) {
    while (!stop_bg.load()) {
      CUmemGenericAllocationHandle h;
      CK(cuMemCreate(&h, P, &p, 0));
      CK(cuMemRelease(h));
      bg_cycles++;
    }
    return;
  }
  const size_t chunk = mode == 1 ? P : 10 * P;
  const int n = mode == 1 ? 10 : 1;  // 20 MiB either way
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, 10 * P, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> hs(n);
  for (auto& h : hs) CK(cuMemCreate(&h, chunk, &p, 0));
  while (!stop_bg.load()) {
    for (int i = 0; i < n; i++) CK(cuMemMap(va + i * chunk, chunk, 0, hs[i], 0));
    for (int i = 0; i < n; i++) set_access(va + i * chunk, chunk);
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * chunk, chunk));
    bg_cycles += n;
  }
  for (auto h : hs) CK(cuMemRelease(h));
  CK(cuMemAddressFree(va, 10 * P));
}

struct Lat { std::vector<double> launch, memset, record; };

static Lat run_main(cudaStream_t s, void* small, int iters, long long spin_cycles) {
  Lat l;
  cudaEvent_t ev;
  RK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  for (int i = 0; i < iters; i++) {
    auto t = Clock::now();
    spin_us<<<1, 32, 0, s>>>(spin_cycles);
    l.launch.push_back(us_since(t));
    t = Clock::now();
    RK(cudaMemsetAsync(small, i & 0xff, 4096, s));
    l.memset.push_back(us_since(t));
    t = Clock::now();
    RK(cudaEventRecord(ev, s));
    l.record.push_back(us_since(t));
    if (i % 64 == 63) RK(cudaEventSynchronize(ev));  // bound the queue
  }
  RK(cudaStreamSynchronize(s));
  RK(cudaEventDestroy(ev));
  return l;
}

static void own_page_calls(std::vector<double>& out, int reps) {
  const size_t P = 2 << 20;
  CUmemAllocationProp p = prop();
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, P, 0, 0, 0));
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, P, &p, 0));
  for (int i = 0; i < reps; i++) {
    auto t = Clock::now();
    CK(cuMemMap(va, P, 0, h, 0));
    set_access(va, P);
    CK(cuMemUnmap(va, P));
    out.push_back(us_since(t));
  }
  CK(cuMemRelease(h));
  CK(cuMemAddressFree(va, P));
}

int main() {
  RK(cudaSetDevice(0));
  RK(cudaFree(0));
  CUcontext ctx;
  CK(cuCtxGetCurrent(&ctx));
  cudaStream_t s;
  RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* small;
  RK(cudaMalloc(&small, 4096));
  long long spin = 40000;  // ~20 us a kernel at ~2 GHz
  const char* names[] = {"idle", "map+access+unmap, 10 x 2 MiB", "map+access+unmap, 1 x 20 MiB",
                         "create+release 2 MiB"};
  run_main(s, small, 2000, spin);  // warm
  for (int round = 0; round < 2; round++) {
    for (int mode = 0; mode < 4; mode++) {
      stop_bg = false;
      bg_cycles = 0;
      std::thread bg(background, mode, ctx);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      long c0 = bg_cycles.load();
      auto t = Clock::now();
      Lat l = run_main(s, small, 20000, spin);
      double wall = us_since(t);
      long c1 = bg_cycles.load();
      stop_bg = true;
      bg.join();
      printf("round %d, other thread %-32s: %6.0f mappings/s there; here per call (us) "
             "launch p50 %.2f p90 %.2f p99 %.1f max %.0f | memset p50 %.2f p99 %.1f | "
             "record p50 %.2f p99 %.1f | wall %.1f ms for 20000 iterations\n",
             round, names[mode], (c1 - c0) / (wall / 1e6), pct(l.launch, 0.5),
             pct(l.launch, 0.9), pct(l.launch, 0.99), pct(l.launch, 1.0), pct(l.memset, 0.5),
             pct(l.memset, 0.99), pct(l.record, 0.5), pct(l.record, 0.99), wall / 1e3);
      fflush(stdout);
    }
    for (int mode : {0, 1}) {
      stop_bg = false;
      std::thread bg(background, mode, ctx);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::vector<double> own;
      own_page_calls(own, 300);
      stop_bg = true;
      bg.join();
      printf("round %d, this thread's map+access+unmap of one 2 MiB handle, other thread %s: "
             "p50 %.1f us p90 %.1f p99 %.1f\n",
             round, names[mode], pct(own, 0.5), pct(own, 0.9), pct(own, 0.99));
      fflush(stdout);
    }
  }
  return 0;
}
