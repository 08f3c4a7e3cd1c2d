"""The kernel tuning report: torch.ops.dsv.kernel_tuning, dsv_ext.ops.kernel_tuning, the
DSV_KERNEL_TUNING override (read once per process, so the GPU checks run in child processes)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import dsv_ext
from dsv_ext import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and dsv_ext.has_cuda_kernels()),
                         reason="needs a CUDA GPU and the CUDA kernels")


def _child(code, tuning=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DSV_KERNEL_TUNING", None)
    if tuning is not None:
        env["DSV_KERNEL_TUNING"] = tuning
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def test_without_cuda_kernels_or_gpu():
    t = ops.kernel_tuning()
    if not dsv_ext.has_cuda_kernels():
        assert t == {"cuda_kernels": 0}
        assert bytes(torch.ops.dsv.kernel_tuning(0).tolist()) == b"cuda_kernels=0"
    elif not torch.cuda.is_available():
        assert t == {"cuda_kernels": 1, "devices": 0}
    else:
        assert t["sm_count"] >= 1


def test_bad_device():
    if not dsv_ext.has_cuda_kernels():
        pytest.skip("a CPU-only build reports no tuning for any device")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=r"^device: no CUDA device"):
        ops.kernel_tuning(n)
    with pytest.raises(ValueError, match=r"^device: expected a CUDA device"):
        ops.kernel_tuning("cpu")
    with pytest.raises(TypeError, match=r"^device: "):
        ops.kernel_tuning(1.5)
    with pytest.raises(RuntimeError, match="device: expected a CUDA device index"):
        torch.ops.dsv.kernel_tuning(-1)


@pytest.mark.parametrize("spec,msg", [("foo=1", "unknown key 'foo'"), ("km_ratio", "expected key=value"),
                                      ("km_ratio=fast", "km_ratio must be a number")])
def test_malformed_override_is_named(monkeypatch, spec, msg):
    monkeypatch.setenv("DSV_KERNEL_TUNING", spec)
    with pytest.raises(ValueError, match=r"^DSV_KERNEL_TUNING: " + msg):
        ops._check_tuning_env()
    monkeypatch.setenv("DSV_KERNEL_TUNING", "km_ratio=0,bwd_ranges=3,")
    ops._check_tuning_env()
    monkeypatch.setenv("DSV_KERNEL_TUNING", "km_wgmma=0")
    ops._check_tuning_env()


def test_info_reports_tuning():
    out = _child("import dsv_ext.info as i; i.main(['--json'])")
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert "kernel_tuning" in env
    for g in env["gpus"]:
        assert "kernel_tuning" in g
    text = _child("import dsv_ext.info as i; i.main([])")
    assert "kernel tuning" in text.stdout


@gpu
def test_defaults_from_the_device():
    t = ops.kernel_tuning(0)
    props = torch.cuda.get_device_properties(0)
    assert t["sm_count"] == props.multi_processor_count
    assert t["cc"] == props.major * 10 + props.minor
    assert t["l2_bytes"] == props.L2_cache_size
    assert t["wgmma"] in (0, 1) and (t["wgmma"] == 0 or t["cc"] == 90)
    assert t["km_ratio"] == pytest.approx(1.15) and t["bwd_ranges"] == 0 and t["bwd_rmax"] == 0
    assert t["merge"] == pytest.approx(0.75) and t["merge_window"] == 0  # merged groups (v26)
    assert t["km_wgmma"] == 1  # the wgmma key-major pass by default (PERF_LOG kernels v14)
    assert t["g128"] == 1  # the 128-row kernels by default (PERF_LOG kernels v15)
    assert t["qm_wgmma"] == 1  # the 64-row wgmma pass with reductions by default (v34)
    assert t["wg256"] == 1  # the forward at D 256 on the wgmma kernel (v44)
    # top-K estimation: groups per warp automatic (v16), the sampled band (v17), clusters
    # automatic (v18)
    assert t["tk_gpw"] == 0 and t["tk_sample"] == 1 and t["tk_split"] == 0
    assert t["tk_band"] == 1  # the band pass without its histogram where it fits (v40)
    assert t["tk_compact"] == 1  # the compaction from masks (v41)


@gpu
def test_override_is_reported_and_read_once():
    code = ("import os, json, dsv_ext.ops as o; a = o.kernel_tuning(0); "
            "os.environ['DSV_KERNEL_TUNING'] = 'km_ratio=5'; b = o.kernel_tuning(0); "
            "print(json.dumps([a, b]))")
    out = _child(code, "km_ratio=0,bwd_ranges=3,wgmma=0,sm_count=7,km_wgmma=2,g128=0,merge=1,"
                       "merge_window=64,qm_wgmma=0,wg256=0")
    assert out.returncode == 0, out.stderr
    a, b = json.loads(out.stdout)
    assert a["km_ratio"] == 0 and a["bwd_ranges"] == 3 and a["wgmma"] == 0 and a["sm_count"] == 7
    assert a["km_wgmma"] == 2 and a["g128"] == 0 and a["merge"] == 1 and a["merge_window"] == 64
    assert a["qm_wgmma"] == 0 and a["wg256"] == 0
    assert b["km_ratio"] == 0  # the kernels keep the tuning they started with


@gpu
@pytest.mark.parametrize("spec", ["bwd_ranges=99", "km_wgmma=3", "g128=2", "qm_wgmma=2", "wg256=2",
                                  "merge=1.5", "merge_window=33", "tk_band=3",
                                  "tk_compact=2"])
def test_malformed_override_fails_the_kernels(spec):
    code = ("import torch, dsv_ext\n"
            "q = torch.randn(1, 64, 1, 64, device='cuda', dtype=torch.bfloat16)\n"
            "idx = torch.zeros(1, 1, 1, 4, dtype=torch.int32, device='cuda')\n"
            "cnt = torch.full((1, 1), 4, dtype=torch.int32, device='cuda')\n"
            "try:\n    torch.ops.dsv.sparse_attention_fwd(q, q, q, idx, cnt, 64, 0.1)\n"
            "except RuntimeError as e:\n    print('ERR', e)\n")
    out = _child(code, spec)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "DSV_KERNEL_TUNING is malformed" in out.stdout
