"""Build script of dsv-ext.

The C reference kernels (csrc/cpu/*.c, C11 + OpenMP) are built into a static library with the C
compiler; the one C++ file (csrc/dsv_ops.cpp, PyTorch stable ABI, TORCH_TARGET_VERSION 2.10) and,
when CUDA is available, the CUDA kernels (csrc/cuda/*.cu) are linked into dsv_ext/_C.

Environment:
  DSV_BUILD_CUDA   "auto" (default): build the CUDA kernels when torch has CUDA and nvcc exists;
                   "1" forces them (an error if impossible); "0" builds the CPU kernels only.
  DSV_CUDA_ARCH    nvcc target flags, default "-gencode=arch=compute_90a,code=sm_90a" (H100/H200);
                   the wgmma kernels are used only when these name an sm_90a target.
  MAX_JOBS         parallel compile jobs (ninja), as for any PyTorch extension.
"""
import glob
import importlib.util
import json
import logging
import os
import shutil
import sys
import time

from setuptools import find_packages, setup

# torch guesses CUDA_HOME from the nvcc on PATH; where that nvcc is a wrapper script (as on
# machines with /usr/local/bin/nvcc -> /usr/local/cuda-X/bin/nvcc) the guess lacks the libraries.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402


class _NoGPUNote(logging.Filter):
    """Building the CUDA kernels on a machine without a GPU is intended (CI does): drop torch's
    "No CUDA runtime is found, using CUDA_HOME=..." warning."""

    def filter(self, record):
        return not record.getMessage().startswith("No CUDA runtime is found")


logging.getLogger("torch.utils.cpp_extension").addFilter(_NoGPUNote())
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_TARGET_VERSION = "0x020a000000000000"  # the stable ABI of PyTorch 2.10


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


# the build record and the CUDA decision, shared with .ci/install's up-to-date check
_spec = importlib.util.spec_from_file_location("_dsv_buildcheck", os.path.join(ROOT, "dsv_ext", "_buildcheck.py"))
buildcheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(buildcheck)


def want_cuda():
    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    return buildcheck.want_cuda(os.environ.get("DSV_BUILD_CUDA"), torch.version.cuda, CUDA_HOME, bool(nvcc))


with_cuda = want_cuda()
c_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.c")))
cu_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))) if with_cuda else []

define_macros = [("TORCH_TARGET_VERSION", TORCH_TARGET_VERSION), ("TORCH_STABLE_ONLY", None)]
cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
cuda_arch = os.environ.get("DSV_CUDA_ARCH", buildcheck.DEFAULT_CUDA_ARCH).split()
nvcc_flags = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", *cuda_arch]
if any("90a" in f for f in cuda_arch):
    nvcc_flags.append("-DDSV_WGMMA")  # Hopper wgmma kernels (sm_90a code) are built
if with_cuda:
    define_macros += [("DSV_WITH_CUDA", None), ("USE_CUDA", None)]
    # the kernels use the half / bfloat16 intrinsics and operators directly
    nvcc_flags += ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                   "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]

Extension = CUDAExtension if with_cuda else CppExtension
ext = Extension(
    name="dsv_ext._C",
    sources=["csrc/dsv_ops.cpp", *cu_sources],
    include_dirs=[os.path.join(ROOT, "csrc")],
    define_macros=define_macros,
    extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    extra_link_args=["-fopenmp"],
    libraries=["dsv_cpu"],
    py_limited_api=True,
)

class BuildExtensionWithCLib(BuildExtension):
    """Build the C kernels' static library first, also for a bare `setup.py build_ext`; after a
    successful build, record what was built next to the library (dsv_ext/_build_info.json, read
    by `python -m dsv_ext.info` and by .ci/install's up-to-date check)."""

    def run(self):
        t0 = time.time()
        digest = buildcheck.source_digest(ROOT)  # what this build compiles
        if self.distribution.has_c_libraries():
            self.run_command("build_clib")
        print("dsv-ext: compiling csrc/dsv_ops.cpp" + (f" and {len(cu_sources)} CUDA files" if cu_sources else "")
              + f" (DSV_BUILD_CUDA={'1' if with_cuda else '0'}, MAX_JOBS={os.environ.get('MAX_JOBS', 'ninja default')})",
              file=sys.stderr, flush=True)
        super().run()
        record = buildcheck.build_record(
            digest, with_cuda, " ".join(cuda_arch),
            "-DDSV_WGMMA" in nvcc_flags, torch.__version__, torch.version.cuda)
        # inplace (also pip's editable mode): the library was copied into dsv_ext/
        pkg_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        for d in {pkg_dir, os.path.join(ROOT, "dsv_ext")} if self.inplace else {pkg_dir}:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, buildcheck.BUILD_INFO), "w") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
        print(f"dsv-ext: extension built in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


setup(
    # calibration/ holds data only (no __init__.py): named here so that setuptools ships it quietly
    packages=[*find_packages(include=["dsv_ext", "dsv_ext.*"]), "dsv_ext.control.calibration"],
    libraries=[("dsv_cpu", {
        "sources": c_sources,
        "include_dirs": ["csrc"],
        "cflags": ["-std=c11", "-O3", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter",
                   "-fvisibility=hidden"],
    })],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtensionWithCLib},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},  # torch compiles with Py_LIMITED_API 3.10
)
