// What the virtual-memory probes share: error checks, the page property and access
// descriptor of device 0, a random-gather kernel (reads spread over every page), a median.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
#define RK(x) do { cudaError_t r = (x); if (r != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(r)); exit(1); } } while (0)

__global__ void gather(const float* p, size_t n, size_t reads, float* out) {
  float acc = 0;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  unsigned long long h = i * 0x9E3779B97F4A7C15ull + 1;
  for (size_t k = i; k < reads; k += (size_t)gridDim.x * blockDim.x) {
    h ^= h >> 33; h *= 0xff51afd7ed558ccdull; h ^= h >> 33;
    acc += p[h % n];
  }
  if (acc == 12345.f) *out = acc;
}
static inline CUmemAllocationProp prop() {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  return p;
}
static inline void set_access(CUdeviceptr va, size_t bytes) {
  CUmemAccessDesc d = {};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE; d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(va, bytes, &d, 1));
}
static inline double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
