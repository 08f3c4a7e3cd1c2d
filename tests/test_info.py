"""The installation report: python -m dsv_ext.info / dsv_ext.build_info()."""
import json
import subprocess
import sys

import dsv_ext
from dsv_ext import info


def test_build_info_matches_the_loaded_library():
    b = dsv_ext.build_info()
    assert set(b) >= {"cuda_kernels", "cuda_arch", "wgmma", "torch", "torch_cuda"}
    assert b["cuda_kernels"] == dsv_ext.has_cuda_kernels()
    if not b["cuda_kernels"]:
        assert b["wgmma"] is False
    elif b["cuda_arch"] is not None:  # a build record exists: wgmma follows the nvcc targets
        assert b["wgmma"] == ("90a" in b["cuda_arch"])


def test_forward_kernel_choice():
    b = {"cuda_kernels": True, "wgmma": True}
    assert info._forward_kernel(b, (9, 0)).startswith("wgmma")
    assert info._forward_kernel(b, (8, 0)) == "mma.sync"
    assert info._forward_kernel(dict(b, wgmma=False), (9, 0)) == "mma.sync"
    assert info._forward_kernel(dict(b, cuda_kernels=False), (9, 0)).startswith("none")


def test_report_runs_and_prints_json():
    out = subprocess.run([sys.executable, "-m", "dsv_ext.info", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert env["dsv_ext"] == dsv_ext.__version__
    assert env["build"]["cuda_kernels"] == dsv_ext.has_cuda_kernels()
    text = subprocess.run([sys.executable, "-m", "dsv_ext"], capture_output=True, text=True,
                          timeout=300)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("dsv-ext ") and "build: CUDA kernels" in text.stdout
