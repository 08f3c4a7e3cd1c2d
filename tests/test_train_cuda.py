"""GPU checks of the training loop and of benchmarks/bench_train.py (skipped without CUDA)."""
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cfg(steps=8):
    from dsv_ext.app.train import load_config

    return load_config(base={
        "name": "micro-cuda",
        # 512 tokens (grid 8 x 8 x 8), head dim 64 (the CUDA kernels take 64/96/128/256)
        "model": {"hidden": 128, "depth": 2, "heads": 2, "patch": [1, 2, 2]},
        "data": {"frames": 8, "height": 16, "width": 16, "channels": 4},
        "train": {"steps": steps, "batch_size": 2, "lr": 1e-3, "warmup_steps": 2, "log_every": 1,
                  "val_every": 0, "val_videos": 2, "val_timesteps": [0.3, 0.7], "seed": 0,
                  "precision": "bf16"},
        "dsv": {"force_stage2_step": 4, "profile_every": 1, "switch_check_every": 1,
                "dispatch_threshold": 0.0, "use_calibration": False, "group_size": 32,
                "k_multiple": 64, "min_density": 0.25, "k_rule": "theta"},  # a few steps: K < S
    })


@pytest.mark.parametrize("attention", ["dense", "dsv"])
def test_cuda_training_run_and_resume(tmp_path, attention):
    import dsv_ext
    from dsv_ext.app.train import train

    if attention == "dsv" and not dsv_ext.has_cuda_kernels():
        pytest.skip("extension built without CUDA kernels")
    full = train(_cfg(), out_dir=str(tmp_path / "full"), attention=attention, device="cuda",
                 progress=False)
    s = full["summary"]
    assert s["device"].startswith("cuda") and s["final_val_loss"] > 0
    losses = [r["loss"] for r in full["history"]]
    assert all(0 < l < 10 for l in losses)
    if attention == "dsv":
        assert [r["stage"] for r in full["history"]][-1] == 2
        assert all(b["sparse"] for b in full["history"][-1]["blocks"])
        assert 0 < full["history"][-1]["recall"] <= 1.0 + 1e-3
    train(_cfg(steps=4), out_dir=str(tmp_path / "part"), attention=attention, device="cuda",
          progress=False)
    res = train(_cfg(), out_dir=str(tmp_path / "part"), attention=attention, device="cuda",
                progress=False, resume=str(tmp_path / "part" / "ckpt_last.pt"))
    again = [r["loss"] for r in res["history"]]
    # GPU kernels (cuDNN, atomics) need not be bitwise deterministic: close, not equal.
    torch.testing.assert_close(again, losses[4:], rtol=2e-2, atol=2e-2)


def test_bench_train_smoke(tmp_path):
    import dsv_ext

    if not dsv_ext.has_cuda_kernels():
        pytest.skip("extension built without CUDA kernels")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_train

    rc = bench_train.main(["--seq", "4096", "--layers", "1", "--hidden", "512", "--heads", "4",
                           "--warmup", "1", "--iters", "2", "--modes", "dense", "dsv_stage1",
                           "dsv_0.9", "--out", str(tmp_path), "--tag", "smoke"])
    assert rc == 0
    res = json.load(open(tmp_path / "bench_train_smoke.json"))
    rows = res["runs"]["4096"]
    assert [r["mode"] for r in rows] == ["dense", "dsv_stage1", "dsv_0.9"]
    assert all("median_ms" in r for r in rows), rows
    assert os.path.exists(tmp_path / "bench_train_smoke.md")
