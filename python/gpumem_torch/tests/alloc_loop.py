"""Per-allocation cost through torch's allocator interface: a C++ loop of raw_alloc + raw_delete
(4 KiB, on the current stream) through c10::cuda::CUDACachingAllocator::get(), under whichever
allocator is current. `python alloc_loop.py gpumem` installs gpumem first (native);
`python alloc_loop.py native` measures PyTorch's own. Prints ns per alloc + free."""
import sys

if sys.argv[-1] == "gpumem":
    import gpumem_torch

    gpumem_torch.install(native=True)
import torch
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
double loop(int64_t n, int64_t bytes) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  for (int i = 0; i < 1000; ++i) a->raw_delete(a->raw_alloc(bytes));
  auto t = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) a->raw_delete(a->raw_alloc(bytes));
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / n;
}
"""
m = load_inline("gpumem_alloc_loop", cpp_sources=src, functions=["loop"], with_cuda=True,
                extra_cflags=["-O2"])
torch.empty(1, device="cuda")
for bytes_ in (4096, 1 << 20):
    best = min(m.loop(1_000_000, bytes_) for _ in range(5))
    print(f"{sys.argv[-1]}: {bytes_} B raw_alloc + raw_delete: {best:.0f} ns (best of 5 x 1e6)")
