// Does a kernel launch, a memset or an event record cost the host more when the context
// holds many virtual-memory mappings? A gpumem process runs its training step's host work
// (queueing ~1,600 kernels) a few ms slower than native PyTorch's (scripts/probes/
// step_levels.py), more than its allocator's own time; native holds ~150 cudaMalloc
// segments, gpumem hundreds to thousands of mappings of 2-64 MiB handles. Here one thread
// queues a small kernel (taking a pointer into the memory), a 4 KiB cudaMemsetAsync and an
// event record, 20,000 times, timing each call on the host; first with the context holding
// one cudaMalloc allocation, then N more cudaMalloc allocations of 2 MiB, then N handles of
// 2 MiB mapped one by one side by side in one reserved range (access set once over it), for
// N = 1,000 and 5,000 (the freed memory of each round given back before the next).
// Build: nvcc -O2 -o vmm_launch_mappings vmm_launch_mappings.cu -lcuda
#include "vmm_probe.h"
#include <chrono>

__global__ void touch(float* p, int n) {
  if (threadIdx.x < n) p[threadIdx.x] += 1.f;
}

using Clock = std::chrono::steady_clock;
static double us_since(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

// per-call host time (median, µs) of launch, memset and event record, pointing at `p`
static void calls(const char* what, float* p, cudaStream_t s, cudaEvent_t ev) {
  const int iters = 20000;
  std::vector<double> launch, memset, record;
  launch.reserve(iters); memset.reserve(iters); record.reserve(iters);
  for (int i = 0; i < 1000; ++i) touch<<<1, 32, 0, s>>>(p, 32);
  RK(cudaStreamSynchronize(s));
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    auto t = Clock::now();
    touch<<<1, 32, 0, s>>>(p, 32);
    launch.push_back(us_since(t));
    t = Clock::now();
    RK(cudaMemsetAsync(p, 0, 4096, s));
    memset.push_back(us_since(t));
    t = Clock::now();
    RK(cudaEventRecord(ev, s));
    record.push_back(us_since(t));
    if (i % 256 == 255) RK(cudaEventSynchronize(ev));  // the queue bounded
  }
  RK(cudaStreamSynchronize(s));
  printf("%-44s launch %6.2f  memset %6.2f  record %6.2f us (median); %8.1f ms all\n", what,
         median(launch), median(memset), median(record), us_since(t0) / 1e3);
  fflush(stdout);
}

int main() {
  RK(cudaFree(0));
  cudaStream_t s;
  RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev;
  RK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  float* base;
  RK(cudaMalloc(&base, 2 << 20));
  calls("one cudaMalloc allocation", base, s, ev);
  const size_t P = 2 << 20;
  for (int n : {1000, 5000}) {
    std::vector<void*> many(n);
    for (auto& m : many) RK(cudaMalloc(&m, P));
    char buf[96];
    snprintf(buf, sizeof buf, "+ %d cudaMalloc allocations of 2 MiB", n);
    calls(buf, (float*)many[n / 2], s, ev);
    for (auto m : many) RK(cudaFree(m));

    CUmemAllocationProp pr = prop();
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, n * P, 0, 0, 0));
    std::vector<CUmemGenericAllocationHandle> hs(n);
    for (int i = 0; i < n; ++i) {
      CK(cuMemCreate(&hs[i], P, &pr, 0));
      CK(cuMemMap(va + i * P, P, 0, hs[i], 0));
    }
    set_access(va, n * P);
    snprintf(buf, sizeof buf, "+ %d mappings of 2 MiB handles (one range)", n);
    calls(buf, (float*)(va + (n / 2) * P), s, ev);
    snprintf(buf, sizeof buf, "  the same, kernel on the cudaMalloc block");
    calls(buf, base, s, ev);
    RK(cudaDeviceSynchronize());
    for (int i = 0; i < n; ++i) {
      CK(cuMemUnmap(va + i * P, P));
      CK(cuMemRelease(hs[i]));
    }
    CK(cuMemAddressFree(va, n * P));
  }
  {
    // as gpumem's expandable segments: a reservation of twice the device's memory, 5,000
    // handles mapped at its start
    size_t free_b, total;
    RK(cudaMemGetInfo(&free_b, &total));
    const size_t big = (2 * total + P - 1) / P * P;
    const int n = 5000;
    CUmemAllocationProp pr = prop();
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, big, 0, 0, 0));
    std::vector<CUmemGenericAllocationHandle> hs(n);
    for (int i = 0; i < n; ++i) {
      CK(cuMemCreate(&hs[i], P, &pr, 0));
      CK(cuMemMap(va + i * P, P, 0, hs[i], 0));
    }
    set_access(va, n * P);
    calls("+ 5000 mappings in a reservation of 2x memory", (float*)(va + (n / 2) * P), s, ev);
    RK(cudaDeviceSynchronize());
    for (int i = 0; i < n; ++i) {
      CK(cuMemUnmap(va + i * P, P));
      CK(cuMemRelease(hs[i]));
    }
    CK(cuMemAddressFree(va, big));
  }
  calls("one cudaMalloc allocation, again", base, s, ev);
  return 0;
}
