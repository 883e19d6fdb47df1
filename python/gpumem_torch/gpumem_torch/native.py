"""gpumem as PyTorch's own CUDA allocator (not the pluggable wrapper).

A small C++ extension (csrc/allocator.cpp) implements torch's
c10::cuda::CUDACachingAllocator::CUDAAllocator over gpumem's C ABI and is installed the way
torch.cuda.memory.change_current_allocator installs one: out-of-memory raises
torch.OutOfMemoryError with gpumem's explanation, torch.cuda.memory_* report gpumem's figures,
and allocations skip the pluggable wrapper's global lock and hash map.

A wheel built where torch and the CUDA headers were present holds the extension compiled
against that torch (gpumem_torch._native, with the torch version beside it); it is used when the
installed torch is that version. Otherwise the extension is compiled against the installed torch
on first use (torch.utils.cpp_extension, cached under TORCH_EXTENSIONS_DIR); that needs a C++
compiler and the CUDA headers.
"""

import os
import pathlib

_ext = None
# where the extension in use came from: "wheel" (built with the package) or "compiled" (on
# first use, against the installed torch)
source = None


def _cuda_include():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (pathlib.Path(root) / "include" / "cuda_runtime_api.h").exists():
            return str(pathlib.Path(root) / "include")
    return None


def _prebuilt():
    """The extension built into the wheel, if it was built for the installed torch."""
    import torch

    here = pathlib.Path(__file__).resolve().parent
    try:
        built_for = (here / "_native_torch_version.txt").read_text().strip()
    except OSError:
        return None
    if built_for != torch.__version__:
        return None
    try:
        from . import _native
    except ImportError:
        return None
    return _native


def load(lib_path: str, verbose: bool = False):
    """Import the extension built into the wheel for this torch, else build it (once) against
    the installed torch, linked against gpumem's library at `lib_path`. The library is loaded
    first (with RTLD_GLOBAL) by the caller."""
    global _ext, source
    if _ext is None and not os.environ.get("GPUMEM_TORCH_REBUILD"):
        _ext = _prebuilt()
        source = "wheel" if _ext is not None else None
    if _ext is None:
        source = "compiled"
        from torch.utils.cpp_extension import load as build

        src = pathlib.Path(__file__).resolve().parent / "csrc" / "allocator.cpp"
        lib = str(pathlib.Path(lib_path).resolve())
        inc = _cuda_include()
        _ext = build(
            name="gpumem_torch_native",
            sources=[str(src)],
            extra_include_paths=[inc] if inc else [],
            # the library by its full path: the extension and the ctypes handle are one copy
            extra_ldflags=[lib, f"-Wl,-rpath,{pathlib.Path(lib).parent}"],
            extra_cflags=["-O2"],
            # links c10_cuda and torch_cuda (the allocator slot and changeCurrentAllocator)
            with_cuda=True,
            verbose=verbose,
        )
    return _ext


def install(lib_path: str, verbose: bool = False):
    """Make gpumem PyTorch's CUDA allocator (before anything allocates CUDA memory)."""
    ext = load(lib_path, verbose)
    ext.install()
    return ext
