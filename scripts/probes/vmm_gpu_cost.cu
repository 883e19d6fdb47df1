// What virtual-memory page work costs the GPU (not the driver): kernels timed over memory
// laid out as one cudaMalloc, as 2 MiB handles mapped side by side, as 20 MiB handles, and
// while another thread maps, sets access on and unmaps pages elsewhere.
// Build: nvcc -O2 -o vmm_gpu_cost vmm_gpu_cost.cu -lcuda -lpthread
#include "vmm_probe.h"
#include <atomic>
#include <chrono>
#include <thread>

__global__ void stream_sum(const float4* p, size_t n, float* out) {
  float acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float4 v = p[i]; acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 12345.f) *out = acc;
}

// `bytes` mapped from handles of `chunk` bytes side by side
static CUdeviceptr vmm_buffer(size_t bytes, size_t chunk) {
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, bytes, 0, 0, 0));
  CUmemAllocationProp p = prop();
  for (size_t off = 0; off < bytes; off += chunk) {
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, chunk, &p, 0));
    CK(cuMemMap(va + off, chunk, 0, h, 0));
    CK(cuMemRelease(h));
  }
  CUmemAccessDesc d = {};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE; d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (cuMemSetAccess(va, bytes, &d, 1) != CUDA_SUCCESS) {
    printf("(one cuMemSetAccess over %zu mappings refused: set per mapping)\n", bytes / chunk);
    for (size_t off = 0; off < bytes; off += chunk) set_access(va + off, chunk);
  }
  return va;
}

static float* out_;
static double time_kernel(int which, void* buf, size_t bytes, cudaStream_t s) {
  cudaEvent_t a, b; RK(cudaEventCreate(&a)); RK(cudaEventCreate(&b));
  RK(cudaEventRecord(a, s));
  if (which == 0) stream_sum<<<1056, 512, 0, s>>>((const float4*)buf, bytes / 16, out_);
  else gather<<<1056, 512, 0, s>>>((const float*)buf, bytes / 4, 1ull << 26, out_);
  RK(cudaEventRecord(b, s)); RK(cudaEventSynchronize(b));
  float ms; RK(cudaEventElapsedTime(&ms, a, b));
  RK(cudaEventDestroy(a)); RK(cudaEventDestroy(b));
  return ms;
}

int main(int argc, char** argv) {
  size_t bytes = 4000ull << 20;  // a multiple of 2 and of 20 MiB
  RK(cudaSetDevice(0)); RK(cudaFree(0));
  RK(cudaMalloc(&out_, 4));
  cudaStream_t s; RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* plain; RK(cudaMalloc(&plain, bytes)); RK(cudaMemset(plain, 0, bytes));
  CUdeviceptr v2 = vmm_buffer(bytes, 2 << 20), v20 = vmm_buffer(bytes, 20 << 20);
  RK(cudaMemset((void*)v2, 0, bytes)); RK(cudaMemset((void*)v20, 0, bytes));
  RK(cudaDeviceSynchronize());
  const char* names[] = {"stream 4000 MiB", "gather 64M x 4 B"};
  void* bufs[] = {plain, (void*)v2, (void*)v20};
  const char* lay[] = {"cudaMalloc", "2 MiB handles", "20 MiB handles"};
  printf("== layout (median of 15, ms)\n");
  for (int k = 0; k < 2; k++)
    for (int l = 0; l < 3; l++) {
      std::vector<double> t;
      for (int i = 0; i < 16; i++) { double x = time_kernel(k, bufs[l], bytes, s); if (i) t.push_back(x); }
      printf("%-18s %-16s %8.3f\n", names[k], lay[l], median(t));
    }
  // page work on another thread, on a range of its own
  std::atomic<int> mode{0}; std::atomic<long> cycles{0}; std::atomic<bool> stop{false};
  CUcontext ctx; CK(cuCtxGetCurrent(&ctx));
  std::thread worker([&] {
    CK(cuCtxSetCurrent(ctx));
    CUdeviceptr va; size_t n = 64, page = 2 << 20;
    CK(cuMemAddressReserve(&va, n * page, 0, 0, 0));
    CUmemAllocationProp p = prop();
    std::vector<CUmemGenericAllocationHandle> hs(n);
    for (auto& h : hs) CK(cuMemCreate(&h, page, &p, 0));
    size_t i = 0;
    CUevent ev; CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CUstream ws; CK(cuStreamCreate(&ws, CU_STREAM_NON_BLOCKING));
    CK(cuEventRecord(ev, ws));
    while (!stop) {
      int m = mode;
      if (m == 0) { std::this_thread::sleep_for(std::chrono::microseconds(200)); continue; }
      if (m == 3) { cuEventQuery(ev); cycles++; std::this_thread::sleep_for(std::chrono::microseconds(50)); continue; }
      CUdeviceptr a = va + (i % n) * page;
      CK(cuMemMap(a, page, 0, hs[i % n], 0));
      set_access(a, page);
      CK(cuMemUnmap(a, page));
      i++; cycles++;
      if (m == 1) std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    for (auto& h : hs) CK(cuMemRelease(h));
    CK(cuMemAddressFree(va, n * page));
  });
  const char* modes[] = {"idle", "~1.5k page cycles/s", "page cycles flat out", "event query / 50 us"};
  printf("== kernels while another thread maps + sets access + unmaps (median of 40, ms; cycles/s)\n");
  for (int round = 0; round < 2; round++)
    for (int m = 0; m < 4; m++) {
      mode = m;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      for (int k = 0; k < 2; k++) {
        std::vector<double> t; long c0 = cycles; auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 40; i++) t.push_back(time_kernel(k, plain, bytes, s));
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("%-18s %-22s %8.3f  %8.0f\n", names[k], modes[m], median(t), (cycles - c0) / sec);
      }
    }
  // short kernels launched back to back (a launch-bound job), with and without page work
  printf("== 2000 short kernels back to back, wall ms\n");
  for (int round = 0; round < 2; round++)
    for (int m = 0; m < 4; m++) {
      mode = m;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 2000; i++) stream_sum<<<132, 256, 0, s>>>((const float4*)plain, 1 << 16, out_);
      RK(cudaStreamSynchronize(s));
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      printf("%-22s %8.3f\n", modes[m], ms);
    }
  // launch, then synchronise with a device-to-host copy (what nonzero() does), 500 times
  printf("== 500 x (20 kernels + 4-byte copy to host), wall ms\n");
  float host;
  for (int round = 0; round < 2; round++)
    for (int m = 0; m < 4; m++) {
      mode = m;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 500; i++) {
        for (int j = 0; j < 20; j++) stream_sum<<<132, 256, 0, s>>>((const float4*)plain, 1 << 16, out_);
        RK(cudaMemcpyAsync(&host, out_, 4, cudaMemcpyDeviceToHost, s));
        RK(cudaStreamSynchronize(s));
      }
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      printf("%-22s %8.3f\n", modes[m], ms);
    }
  // 20 MiB moved as 10 handles of 2 MiB or as 1 handle of 20 MiB: the cost of each call,
  // GPU idle and GPU busy (a queue of gather kernels on another stream)
  printf("== 20 MiB mapped, access set (one call), unmapped (one call): us per phase, median of 30\n");
  mode = 0;
  {
    CUdeviceptr va; size_t span = 20 << 20;
    CK(cuMemAddressReserve(&va, span, 0, 0, 0));
    CUmemAllocationProp p = prop();
    std::vector<CUmemGenericAllocationHandle> small(10); CUmemGenericAllocationHandle big;
    for (auto& h : small) CK(cuMemCreate(&h, 2 << 20, &p, 0));
    CK(cuMemCreate(&big, span, &p, 0));
    cudaStream_t busy_s; RK(cudaStreamCreateWithFlags(&busy_s, cudaStreamNonBlocking));
    for (int busy = 0; busy < 2; busy++)
      for (int k : {10, 1}) {
        std::vector<double> tm, ta, tu;
        for (int rep = 0; rep < 31; rep++) {
          if (busy) for (int i = 0; i < 3; i++) gather<<<1056, 512, 0, busy_s>>>((const float*)plain, bytes / 4, 1ull << 26, out_);
          auto t0 = std::chrono::steady_clock::now();
          if (k == 10) for (int i = 0; i < 10; i++) CK(cuMemMap(va + i * (2 << 20), 2 << 20, 0, small[i], 0));
          else CK(cuMemMap(va, span, 0, big, 0));
          auto t1 = std::chrono::steady_clock::now();
          set_access(va, span);
          auto t2 = std::chrono::steady_clock::now();
          CK(cuMemUnmap(va, span));
          auto t3 = std::chrono::steady_clock::now();
          if (rep) {
            tm.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            ta.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
            tu.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
          }
          if (busy) RK(cudaStreamSynchronize(busy_s));
        }
        printf("%-5s %2d handle(s): map %8.1f  set access %8.1f  unmap %8.1f\n", busy ? "busy" : "idle", k,
               median(tm), median(ta), median(tu));
      }
    for (auto& h : small) CK(cuMemRelease(h));
    CK(cuMemRelease(big));
    CK(cuMemAddressFree(va, span));
  }
  stop = true; worker.join();
  printf("done\n");
  return 0;
}
