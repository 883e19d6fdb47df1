"""gpumem as PyTorch's (and CuPy's) GPU memory allocator.

    import gpumem_torch
    gpumem_torch.install()          # before anything touches CUDA
    ...
    gpumem_torch.memory_stats()     # torch.cuda.memory_stats() key names
    print(gpumem_torch.memory_summary())
    gpumem_torch.empty_cache()

Configuration: the GPUMEM_CONF environment variable (see gpumem's README), read when a
device is first used. The shared library is found at $GPUMEM_TORCH_LIB, next to this file
(where scripts/build-python puts it), or in the repository's target/release.
"""

import ctypes
import json
import os
import pathlib

__all__ = [
    "install",
    "library_path",
    "memory_stats",
    "memory_summary",
    "empty_cache",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "leak_report",
    "cupy_allocator",
]

_NAMES = ("libgpumem_torch.so", "libgpumem_torch.dylib")
_lib = None


def library_path() -> str:
    """Where the gpumem shared library is."""
    env = os.environ.get("GPUMEM_TORCH_LIB")
    if env:
        return env
    here = pathlib.Path(__file__).resolve().parent
    candidates = [here / n for n in _NAMES]
    # as pip installs it (setuptools-rust names the library with the platform's suffix)
    candidates += sorted(here.glob("libgpumem_torch*.so"))
    for up in (here.parent.parent.parent, pathlib.Path.cwd()):
        candidates += [up / "target" / "release" / n for n in _NAMES]
    for c in candidates:
        if c.exists():
            return str(c)
    raise FileNotFoundError(
        "gpumem shared library not found: build it with `cargo build --release -p gpumem-torch` "
        "(scripts/build-python copies it here) or set GPUMEM_TORCH_LIB"
    )


def _load():
    global _lib
    if _lib is None:
        # RTLD_GLOBAL: the native allocator extension resolves gpumem's C ABI from it
        lib = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
        lib.gpumem_alloc.restype = ctypes.c_void_p
        lib.gpumem_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpumem_free.restype = None
        lib.gpumem_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpumem_empty_cache.restype = ctypes.c_uint64
        lib.gpumem_set_memory_fraction.restype = ctypes.c_int
        lib.gpumem_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        lib.gpumem_set_allocator_settings.restype = ctypes.c_int
        lib.gpumem_set_allocator_settings.argtypes = [ctypes.c_char_p]
        lib.gpumem_record_stream.restype = ctypes.c_int
        lib.gpumem_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.gpumem_reset_peak.argtypes = [ctypes.c_int]
        for f in ("gpumem_stats_json", "gpumem_memory_summary", "gpumem_leak_report"):
            getattr(lib, f).restype = ctypes.c_void_p
            getattr(lib, f).argtypes = [ctypes.c_int]
        lib.gpumem_free_string.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _string(ptr) -> str:
    if not ptr:
        return ""
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        _load().gpumem_free_string(ptr)


def _device(device) -> int:
    if device is None:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    return device.index if hasattr(device, "index") and device.index is not None else int(device)


def install(native=None) -> None:
    """Make gpumem PyTorch's CUDA allocator. Call it before anything uses CUDA.

    By default gpumem becomes a torch CUDAAllocator built from csrc/allocator.cpp against the
    installed torch (see gpumem_torch.native: built into the wheel where torch was there at
    build time, else compiled on first use, ~30 s, then cached): out of
    memory raises torch.OutOfMemoryError and torch.cuda.memory_* report gpumem's figures.
    Where that extension cannot be built (no C++ compiler or CUDA headers) it falls back, with
    a warning, to torch's CUDAPluggableAllocator, which lacks those. `native=False` (or
    GPUMEM_TORCH_NATIVE=0) asks for the pluggable path, `native=True` (or =1) insists on the
    native one.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "gpumem_torch.install(): PyTorch sees no CUDA GPU here (torch.cuda.is_available() "
            "is False), so there is no GPU memory for gpumem to manage"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "gpumem_torch.install() must run before CUDA is used: PyTorch cannot change its "
            "allocator once it has allocated (call install() first thing in the program)"
        )
    if native is None:
        env = os.environ.get("GPUMEM_TORCH_NATIVE", "")
        native = None if env == "" else env != "0"
    path = library_path()
    _load()
    _hook_settings(torch)
    if native is not False:
        from . import native as _native

        try:
            _native.install(path)
            return
        except Exception as e:  # noqa: BLE001 - any build failure falls back
            if native:
                raise
            import warnings

            warnings.warn(
                f"gpumem_torch: the native allocator could not be built ({type(e).__name__}: "
                f"{str(e)[:200]}); using torch's CUDAPluggableAllocator, where out of memory "
                "gives no exception and torch.cuda.memory_* raise",
                RuntimeWarning,
            )
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gpumem_alloc", "gpumem_free")
    torch.cuda.memory.change_current_allocator(alloc)


# the settings PyTorch's allocator takes at run time (the others apply when it is built)
_RUNTIME_KEYS = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold")


def _runtime_settings(env: str) -> str:
    """The run-time keys of an allocator settings string (commas inside [...] kept)."""
    parts, depth, cur = [], 0, ""
    for ch in env:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return ",".join(p.strip() for p in parts if p.split(":", 1)[0].strip() in _RUNTIME_KEYS)


def _hook_settings(torch) -> None:
    """torch.cuda.memory._set_allocator_settings reaches gpumem too, as it reaches PyTorch's
    allocator: rounding, max split size and the garbage collection threshold at run time."""
    mem = torch.cuda.memory
    orig = getattr(mem, "_set_allocator_settings", None)
    if orig is None or getattr(orig, "_gpumem", False):
        return

    def _set_allocator_settings(env: str):
        result = orig(env)  # PyTorch's parser first: its errors stay its own
        if _load().gpumem_set_allocator_settings(_runtime_settings(env).encode()) != 0:
            raise RuntimeError(f"gpumem: cannot apply the allocator settings {env!r}")
        return result

    _set_allocator_settings._gpumem = True
    mem._set_allocator_settings = _set_allocator_settings


def memory_stats(device=None) -> dict:
    """Statistics with torch.cuda.memory_stats() key names, plus gpumem's own."""
    return json.loads(_string(_load().gpumem_stats_json(_device(device))))


def memory_summary(device=None) -> str:
    """A table like torch.cuda.memory_summary()."""
    return _string(_load().gpumem_memory_summary(_device(device)))


def empty_cache() -> int:
    """Release every cached block (torch.cuda.empty_cache()); returns the bytes released."""
    return int(_load().gpumem_empty_cache())


def reset_peak_memory_stats(device=None) -> None:
    _load().gpumem_reset_peak(_device(device))


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    if _load().gpumem_set_memory_fraction(float(fraction), _device(device)) != 0:
        raise ValueError(f"cannot set the memory fraction to {fraction}")


def leak_report(device=None) -> dict:
    """Live allocations: count, bytes and the 20 largest."""
    return json.loads(_string(_load().gpumem_leak_report(_device(device))))


def record_stream(tensor, stream) -> None:
    """Tell gpumem that `stream` uses `tensor`'s memory (Tensor.record_stream has no hook for
    pluggable allocators)."""
    if _load().gpumem_record_stream(tensor.data_ptr(), tensor.device.index or 0, stream.cuda_stream) != 0:
        raise ValueError("not a block gpumem handed out")


class _Block:
    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr, size, device, stream):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream

    def __del__(self):
        _lib.gpumem_free(self.ptr, self.size, self.device, self.stream)


def cupy_allocator():
    """An allocator for cupy.cuda.set_allocator(gpumem_torch.cupy_allocator())."""
    import cupy

    lib = _load()

    def alloc(size):
        dev = cupy.cuda.Device().id
        stream = cupy.cuda.get_current_stream().ptr
        if size == 0:
            return cupy.cuda.memory.MemoryPointer(cupy.cuda.memory.UnownedMemory(0, 0, None, dev), 0)
        ptr = lib.gpumem_alloc(size, dev, stream)
        if not ptr:
            raise cupy.cuda.memory.OutOfMemoryError(size, 0, 0)
        mem = cupy.cuda.memory.UnownedMemory(ptr, size, _Block(ptr, size, dev, stream), dev)
        return cupy.cuda.memory.MemoryPointer(mem, 0)

    return alloc
