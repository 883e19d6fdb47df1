// Whether page calls cost per physical handle or per mapping: 20 MiB mapped as 10 handles of
// 2 MiB, as one 20 MiB handle mapped whole, and as one 20 MiB (or 64 MiB) handle mapped in
// 2 MiB pieces (cuMemMap with an offset into the handle), access set in one call or one per
// piece, unmapped in one call or piece by piece; GPU idle and busy.
// Build: nvcc -O2 -o vmm_sub_map vmm_sub_map.cu -lcuda
// Seen on the H100 (driver 580): ten 2 MiB handles, idle GPU: map 5.4-5.8 us, set access
// 208-217 us, unmap 145-149 us (one call or one per piece alike); one 20 MiB handle mapped
// whole: 0.7 / 33.7 / 21.4 us; mapping a piece of a handle (a non-zero offset) is refused with
// CUDA_ERROR_NOT_SUPPORTED, where the probe stops.
#include "vmm_probe.h"
#include <chrono>

using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

int main() {
  RK(cudaSetDevice(0)); RK(cudaFree(0));
  float* out; RK(cudaMalloc(&out, 4));
  size_t bytes = 4000ull << 20; void* plain; RK(cudaMalloc(&plain, bytes)); RK(cudaMemset(plain, 0, bytes));
  cudaStream_t bs; RK(cudaStreamCreateWithFlags(&bs, cudaStreamNonBlocking));
  const size_t P = 2 << 20, span = 20 << 20;
  CUdeviceptr va; CK(cuMemAddressReserve(&va, 64 * P, 0, 0, 0));
  CUmemAllocationProp p = prop();
  std::vector<CUmemGenericAllocationHandle> small(32);
  for (auto& h : small) CK(cuMemCreate(&h, P, &p, 0));
  CUmemGenericAllocationHandle big, huge;
  CK(cuMemCreate(&big, span, &p, 0));
  CK(cuMemCreate(&huge, 64 * P, &p, 0));
  // layouts: 0 ten 2 MiB handles; 1 one 20 MiB handle whole; 2 one 20 MiB handle in 10 pieces;
  // 3 one 128 MiB handle, 10 pieces from its middle; access: one call (a) or per piece (p);
  // unmap: one call (a) or per piece (p)
  const char* names[] = {"10 handles of 2 MiB", "1 handle of 20 MiB, whole", "1 handle of 20 MiB, 10 pieces",
                         "1 handle of 128 MiB, 10 pieces"};
  printf("%-32s %-5s %-6s %-6s %9s %9s %9s\n", "layout", "busy", "access", "unmap", "map us", "access us", "unmap us");
  for (int busy = 0; busy < 2; busy++)
    for (int l = 0; l < 4; l++)
      for (int per_access = 0; per_access < 2; per_access++)
        for (int per_unmap = 0; per_unmap < 2; per_unmap++) {
          if (l == 1 && (per_access || per_unmap)) continue;
          std::vector<double> tm, ta, tu;
          for (int rep = 0; rep < 21; rep++) {
            if (busy) for (int i = 0; i < 3; i++) gather<<<1056, 512, 0, bs>>>((const float*)plain, bytes / 4, 1ull << 26, out);
            auto t0 = clk::now();
            if (l == 0) for (int i = 0; i < 10; i++) CK(cuMemMap(va + i * P, P, 0, small[i], 0));
            else if (l == 1) CK(cuMemMap(va, span, 0, big, 0));
            else if (l == 2) for (int i = 0; i < 10; i++) CK(cuMemMap(va + i * P, P, i * P, big, 0));
            else for (int i = 0; i < 10; i++) CK(cuMemMap(va + i * P, P, (20 + i) * P, huge, 0));
            auto t1 = clk::now();
            if (per_access) for (int i = 0; i < 10; i++) set_access(va + i * P, P);
            else set_access(va, span);
            auto t2 = clk::now();
            if (per_unmap) for (int i = 0; i < 10; i++) CK(cuMemUnmap(va + i * P, P));
            else CK(cuMemUnmap(va, span));
            auto t3 = clk::now();
            if (rep) { tm.push_back(us(t0, t1)); ta.push_back(us(t1, t2)); tu.push_back(us(t2, t3)); }
            RK(cudaStreamSynchronize(bs));
          }
          printf("%-32s %-5s %-6s %-6s %9.1f %9.1f %9.1f\n", names[l], busy ? "busy" : "idle",
                 per_access ? "piece" : "one", per_unmap ? "piece" : "one", median(tm), median(ta), median(tu));
        }
  // a page moved inside a big handle's mapping: 10 pieces mapped, then one piece unmapped and
  // mapped again elsewhere with access set, the rest staying (what a page move would be)
  printf("== one 2 MiB piece moved (unmap, map elsewhere, access), 9 others staying mapped\n");
  for (int busy = 0; busy < 2; busy++)
    for (int l : {0, 3}) {
      for (int i = 0; i < 10; i++) {
        if (l == 0) CK(cuMemMap(va + i * P, P, 0, small[i], 0));
        else CK(cuMemMap(va + i * P, P, (20 + i) * P, huge, 0));
      }
      set_access(va, span);
      std::vector<double> tu, tm, ta;
      for (int rep = 0; rep < 21; rep++) {
        if (busy) for (int i = 0; i < 3; i++) gather<<<1056, 512, 0, bs>>>((const float*)plain, bytes / 4, 1ull << 26, out);
        size_t from = (rep % 2) ? 40 : 5, to = (rep % 2) ? 5 : 40;  // piece 5 <-> page 40
        auto t0 = clk::now();
        CK(cuMemUnmap(va + from * P, P));
        auto t1 = clk::now();
        if (l == 0) CK(cuMemMap(va + to * P, P, 0, small[5], 0));
        else CK(cuMemMap(va + to * P, P, 25 * P, huge, 0));
        auto t2 = clk::now();
        set_access(va + to * P, P);
        auto t3 = clk::now();
        if (rep) { tu.push_back(us(t0, t1)); tm.push_back(us(t1, t2)); ta.push_back(us(t2, t3)); }
        RK(cudaStreamSynchronize(bs));
      }
      printf("%-32s %-5s unmap %7.1f map %7.1f access %7.1f us\n", names[l], busy ? "busy" : "idle", median(tu), median(tm), median(ta));
      CK(cuMemUnmap(va + 40 * P, P));  // (rep 20 moved it to page 40)
      for (int i = 0; i < 10; i++) if (i != 5) CK(cuMemUnmap(va + i * P, P));
    }
  printf("done\n");
  return 0;
}
