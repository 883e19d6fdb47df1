"""Per-allocation cost through torch's allocator interface, under whichever allocator is
current: C++ loops of `allocate` + DataPtr release (what every tensor does) and of
`raw_alloc` + `raw_delete` (4 KiB and 1 MiB, on the current stream) through
c10::cuda::CUDACachingAllocator::get(), a repeating step of 32 or 256 blocks of 2-32 MiB
(which gpumem serves from a planned layout; `GPUMEM_CONF=planned_layout:False` for its
dynamic pool), and `torch.empty` + `del` from Python.
`python alloc_loop.py gpumem` installs gpumem first (native); `python alloc_loop.py native`
measures PyTorch's own. Prints ns per alloc + free (best of 5 rounds)."""
import os
import sys
import time

if sys.argv[-1] == "gpumem":
    import gpumem_torch

    gpumem_torch.install(native=True)
import torch
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
#include <cuda_runtime_api.h>
#include <vector>
double raw_loop(int64_t n, int64_t bytes) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  for (int i = 0; i < 1000; ++i) a->raw_delete(a->raw_alloc(bytes));
  auto t = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) a->raw_delete(a->raw_alloc(bytes));
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / n;
}
double dataptr_loop(int64_t n, int64_t bytes) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  for (int i = 0; i < 1000; ++i) { auto p = a->allocate(bytes); }
  auto t = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) { auto p = a->allocate(bytes); }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / n;
}
// a repeating step: `k` blocks of 2-32 MiB allocated in order, released in reverse, `n` times
// (a job that repeats: gpumem serves it from a planned layout once it has seen it twice);
// ns per allocate + release over the second half
double step_loop(int64_t n, int64_t k) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  std::vector<c10::DataPtr> held;
  held.reserve(k);
  double ns = 0;
  for (int64_t s = 0; s < n; ++s) {
    auto t = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < k; ++i) held.push_back(a->allocate(size_t(2 + (i * 7) % 31) << 20));
    while (!held.empty()) held.pop_back();
    if (s >= n / 2)
      ns += std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  }
  return ns / double((n - n / 2) * k);
}
// the pieces: torch's device and stream lookups, and gpumem's C ABI alone (function addresses)
double lookups(int64_t n) {
  auto t = std::chrono::steady_clock::now();
  int64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto dev = c10::cuda::current_device();
    sum += reinterpret_cast<int64_t>(c10::cuda::getCurrentCUDAStream(dev).stream()) + dev;
  }
  auto ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  return sum == 42 ? 0 : ns / n;
}
double lookup_part(int64_t n, int64_t which) {
  auto t = std::chrono::steady_clock::now();
  int64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (which == 0) {
      sum += c10::cuda::current_device();
    } else if (which == 1) {
      sum += reinterpret_cast<int64_t>(c10::cuda::getCurrentCUDAStream(0).stream());
    } else {
      int d = 0;
      cudaGetDevice(&d);
      sum += d;
    }
  }
  auto ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  return sum == 42 ? 0 : ns / n;
}
using AllocFn = void* (*)(ssize_t, int, void*, char*, size_t, int*, uint64_t*);
using FreeFn = int (*)(uint64_t);
double abi_loop(int64_t n, int64_t bytes, int64_t alloc_fn, int64_t free_fn) {
  auto al = reinterpret_cast<AllocFn>(alloc_fn);
  auto fr = reinterpret_cast<FreeFn>(free_fn);
  char err[256];
  int oom = 0;
  uint64_t tok = 0;
  void* s = c10::cuda::getCurrentCUDAStream().stream();
  for (int i = 0; i < 1000; ++i) { al(bytes, 0, s, err, 256, &oom, &tok); fr(tok); }
  auto t = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) { al(bytes, 0, s, err, 256, &oom, &tok); fr(tok); }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / n;
}
"""
m = load_inline("gpumem_alloc_loop2", cpp_sources=src, functions=["raw_loop", "dataptr_loop", "step_loop", "lookups", "lookup_part", "abi_loop"],
                with_cuda=True, extra_cflags=["-O2"])
torch.empty(1, device="cuda")
who = sys.argv[-1] + (f" ({os.environ['GPUMEM_CONF']})" if sys.argv[-1] == "gpumem" and os.environ.get("GPUMEM_CONF") else "")
for bytes_ in (4096, 1 << 20):
    best = min(m.dataptr_loop(1_000_000, bytes_) for _ in range(5))
    print(f"{who}: {bytes_} B allocate + DataPtr release: {best:.0f} ns (best of 5 x 1e6)")
    best = min(m.raw_loop(1_000_000, bytes_) for _ in range(5))
    print(f"{who}: {bytes_} B raw_alloc + raw_delete: {best:.0f} ns (best of 5 x 1e6)")
KEYS = ("num_checkpoints", "vmm_calls_foreground", "vmm_calls_background", "num_plan_allocs",
        "num_plan_misses", "num_sync_all_streams", "num_device_alloc", "num_pressure_releases")
for k in (32, 256):
    before = gpumem_torch.memory_stats() if who.startswith("gpumem") else {}
    best = min(m.step_loop(20_000 if k == 32 else 4_000, k) for _ in range(3))
    print(f"{who}: a repeating step of {k} blocks of 2-32 MiB, allocate + DataPtr release: {best:.0f} ns (best of 3)")
    if before:
        after = gpumem_torch.memory_stats()
        print(f"{who}:   over those rounds: " + ", ".join(f"{key} {after.get(key, 0) - before.get(key, 0)}" for key in KEYS))
best = min(m.lookups(1_000_000) for _ in range(5))
print(f"{who}: current_device + getCurrentCUDAStream: {best:.1f} ns")
for i, name in enumerate(["c10 current_device", "getCurrentCUDAStream(0)", "cudaGetDevice"]):
    best = min(m.lookup_part(1_000_000, i) for _ in range(5))
    print(f"{who}: {name}: {best:.1f} ns")
if who.startswith("gpumem"):
    import ctypes

    lib = ctypes.CDLL(gpumem_torch.library_path())
    fa = ctypes.cast(lib.gpumem_alloc_token, ctypes.c_void_p).value
    ff = ctypes.cast(lib.gpumem_free_token, ctypes.c_void_p).value
    best = min(m.abi_loop(1_000_000, 4096, fa, ff) for _ in range(5))
    print(f"{who}: C ABI alone (gpumem_alloc_token + gpumem_free_token): {best:.0f} ns")
n = 200_000
for _ in range(1000):
    torch.empty(1024, device="cuda")
rounds = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
        y = torch.empty(1024, device="cuda")
        del y
    rounds.append((time.perf_counter() - t) / n * 1e9)
print(f"{who}: torch.empty(1024) + del from Python: {min(rounds):.0f} ns (best of 5 x {n})")
