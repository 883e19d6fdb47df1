"""Build of gpumem-torch. The Rust library (crates/gpumem-torch) is built by setuptools-rust
(configured in pyproject.toml). Where torch (with CUDA) and the CUDA headers are importable at
build time, as with `pip install --no-build-isolation ./python/gpumem_torch`, the native torch
allocator (gpumem_torch/csrc/allocator.cpp) is compiled against that torch into the wheel too
(a wheel for this CPython), with the torch version it was built for beside it. Otherwise the
wheel holds the library alone (one abi3 wheel for every CPython) and the extension is compiled
against the installed torch on first use. GPUMEM_TORCH_BUILD_NATIVE=0 skips it."""
import os

from setuptools import setup


def native_extension():
    if os.environ.get("GPUMEM_TORCH_BUILD_NATIVE", "auto") == "0":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as e:  # noqa: BLE001
        print(f"gpumem-torch: no torch at build time ({e}): the native allocator will be "
              "compiled on first use")
        return None
    if torch.version.cuda is None or CUDA_HOME is None:
        print("gpumem-torch: torch without CUDA or no CUDA headers (CUDA_HOME): the native "
              "allocator will be compiled on first use")
        return None

    class Build(BuildExtension):
        def run(self):
            super().run()
            # the torch this extension was compiled against: gpumem_torch.native loads it
            # only under the same torch, and compiles a fresh one otherwise
            for root in {self.build_lib, os.path.dirname(os.path.abspath(__file__))}:
                d = os.path.join(root, "gpumem_torch")
                if os.path.isdir(d) and (root == self.build_lib or self.inplace):
                    with open(os.path.join(d, "_native_torch_version.txt"), "w") as f:
                        f.write(torch.__version__)

    ext = CUDAExtension(
        "gpumem_torch._native",
        ["gpumem_torch/csrc/allocator.cpp"],
        # gpumem's C ABI is resolved at load time from the library, which gpumem_torch loads
        # first with RTLD_GLOBAL
        extra_compile_args={"cxx": ["-O2", "-g0"]},
    )
    return ext, Build


native = native_extension()
if native:
    setup(ext_modules=[native[0]], cmdclass={"build_ext": native[1]})
else:
    setup(options={"bdist_wheel": {"py_limited_api": "cp39"}})
