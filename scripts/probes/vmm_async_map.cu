// Page maps off the allocating thread: the allocating thread queues the map (map + set access)
// for a worker thread and makes its stream wait (cuStreamWaitValue32 on a pinned host word)
// until the worker has done it; kernels queued after the wait use the pages. Compared with
// mapping on the allocating thread: that thread's time per allocation, the wall time, and a
// pattern written and checked through the pages (any fault or wrong word is reported).
// Build: nvcc -O2 -o vmm_async_map vmm_async_map.cu -lcuda -lpthread
// Seen on the H100 (driver 580), 400 allocations of 1-8 pages, two rounds: allocating thread
// 212-245 us per map on it, 1.6-3.0 us off it; wall 88-97 ms off it against 103-176 ms on
// it; no wrong word either way. But a memset queued right after the wait is refused
// (CUDA_ERROR_INVALID_VALUE, 400 of 400) whenever the pages are not mapped with access yet,
// also when the map is made on the allocating thread and only access is set off it (mode 2),
// whose maps then take 80-120 us: the driver serialises page calls across threads. So maps
// cannot be left to a worker under PyTorch, which queues memsets and copies at once.
#include "vmm_probe.h"
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

__global__ void fill(unsigned* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = seed ^ (unsigned)i;
}
__global__ void check(const unsigned* p, size_t n, unsigned seed, unsigned* bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    if (p[i] != (seed ^ (unsigned)i)) atomicAdd(bad, 1);
}
__global__ void spin(long long ns) {
  long long t0 = clock64();
  while (clock64() - t0 < ns * 2) {}
}

const size_t P = 2 << 20;
struct Job { int map; CUdeviceptr addr; int n; std::vector<int> hs; CUevent ev; unsigned ticket; };
static std::mutex mu; static std::condition_variable cv; static std::deque<Job> q;
static std::vector<CUmemGenericAllocationHandle> handles; static std::vector<int> free_hs;
static std::mutex hmu;
static std::atomic<bool> slot_free[16];
static volatile unsigned* flag; static std::atomic<bool> stop{false};

static void map_only(CUdeviceptr a, const std::vector<int>& hs) {
  for (size_t i = 0; i < hs.size(); i++) CK(cuMemMap(a + i * P, P, 0, handles[hs[i]], 0));
}
static void do_map(CUdeviceptr a, const std::vector<int>& hs) {
  map_only(a, hs);
  set_access(a, hs.size() * P);
}
static int memset_ok = 0, memset_bad = 0;
static void worker(CUcontext ctx) {
  CK(cuCtxSetCurrent(ctx));
  for (;;) {
    Job j;
    {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [] { return !q.empty() || stop; });
      if (q.empty()) return;
      j = q.front(); q.pop_front();
    }
    if (j.map) {
      if (j.map == 2) set_access(j.addr, j.hs.size() * P); else do_map(j.addr, j.hs);
      __atomic_store_n(flag, j.ticket, __ATOMIC_RELEASE);
    } else {
      CK(cuEventSynchronize(j.ev));
      CK(cuEventDestroy(j.ev));
      CK(cuMemUnmap(j.addr, j.n * P));
      slot_free[j.ticket] = true;
      std::lock_guard<std::mutex> l(hmu);
      for (int h : j.hs) free_hs.push_back(h);
    }
  }
}
static void push(Job j) { { std::lock_guard<std::mutex> l(mu); q.push_back(std::move(j)); } cv.notify_one(); }

int main() {
  RK(cudaSetDevice(0)); RK(cudaFree(0));
  CUcontext ctx; CK(cuCtxGetCurrent(&ctx));
  CUdevice dev; CK(cuCtxGetDevice(&dev));
  int memops = 0; CK(cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, dev));
  printf("stream memory operations: %d\n", memops);
  void* hflag; CK(cuMemHostAlloc(&hflag, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  flag = (volatile unsigned*)hflag; *flag = 0;
  CUdeviceptr dflag; CK(cuMemHostGetDevicePointer(&dflag, hflag, 0));
  unsigned* bad; RK(cudaMalloc(&bad, 4)); RK(cudaMemset(bad, 0, 4));
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED; p.location.type = CU_MEM_LOCATION_TYPE_DEVICE; p.location.id = 0;
  handles.resize(64);
  for (int i = 0; i < 64; i++) { CK(cuMemCreate(&handles[i], P, &p, 0)); free_hs.push_back(i); }
  const int SLOTS = 16, PER = 8;  // 16 address slots of 8 pages
  CUdeviceptr va; CK(cuMemAddressReserve(&va, SLOTS * PER * P, 0, 0, 0));
  cudaStream_t s; RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& f : slot_free) f = true;
  std::thread w(worker, ctx);
  unsigned ticket = 0;
  for (int round = 0; round < 2; round++)
  for (int mode = 0; mode < 3; mode++)       // 0: map on this thread, 1: off it, 2: map here, access off it
  for (int syncs = 0; syncs < 2; syncs++) {  // 1: the host waits for the stream each iteration
    const int iters = 400;
    double host_us = 0;
    RK(cudaStreamSynchronize(s));
    auto w0 = std::chrono::steady_clock::now();
    unsigned seed = 1234;
    for (int it = 0; it < iters; it++) {
      int n = 1 + (it * 7) % PER;
      CUdeviceptr a = va + (size_t)(it % SLOTS) * PER * P;
      std::vector<int> hs;
      for (;;) {
        { std::lock_guard<std::mutex> l(hmu); if ((int)free_hs.size() >= n) { hs.assign(free_hs.end() - n, free_hs.end()); free_hs.resize(free_hs.size() - n); break; } }
        std::this_thread::yield();
      }
      // (a slot is reused only after its unmap: slots go round, 16 iterations apart)
      while (!slot_free[it % SLOTS]) std::this_thread::yield();
      slot_free[it % SLOTS] = false;
      auto t0 = std::chrono::steady_clock::now();
      if (mode == 0) do_map(a, hs);
      else {
        if (mode == 2) map_only(a, hs);
        Job j{mode == 2 ? 2 : 1, a, n, hs, nullptr, ++ticket};
        push(j);
        CK(cuStreamWaitValue32((CUstream)s, dflag, ticket, CU_STREAM_WAIT_VALUE_GEQ));
      }
      host_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (cuMemsetD8Async(a, 0, 4096, (CUstream)s) == CUDA_SUCCESS) memset_ok++; else memset_bad++;
      spin<<<1, 1, 0, s>>>(20000);  // 20 us of other work
      fill<<<264, 256, 0, s>>>((unsigned*)a, n * P / 4, seed + it);
      check<<<264, 256, 0, s>>>((const unsigned*)a, n * P / 4, seed + it, bad);
      CUevent ev; CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING)); CK(cuEventRecord(ev, (CUstream)s));
      push(Job{0, a, n, hs, ev, (unsigned)(it % SLOTS)});
      if (syncs) RK(cudaStreamSynchronize(s));
    }
    RK(cudaStreamSynchronize(s));
    double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count();
    // wait for the worker's queue to drain (unmaps)
    for (;;) { { std::lock_guard<std::mutex> l(mu); if (q.empty()) break; } std::this_thread::sleep_for(std::chrono::milliseconds(1)); }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    unsigned nbad; RK(cudaMemcpy(&nbad, bad, 4, cudaMemcpyDeviceToHost));
    printf("round %d %-20s %-14s host us/alloc %7.1f  wall ms %8.1f  bad words %u\n", round,
           mode == 2 ? "access off-thread" : mode ? "map off-thread" : "map on-thread", syncs ? "sync each" : "no sync", host_us / iters, wall, nbad);
    printf("   memsets accepted %d refused %d\n", memset_ok, memset_bad); memset_ok = memset_bad = 0;
  }
  stop = true; cv.notify_all(); w.join();
  RK(cudaDeviceSynchronize());
  printf("done\n");
  return 0;
}
