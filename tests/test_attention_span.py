"""benchmarks/attention_span.py: a head's mass by spatial radius and frame distance against a
direct float64 sum, and a CPU run end to end."""
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("attention_span", os.path.join(ROOT, "benchmarks", "attention_span.py"))
AS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(AS)


def test_head_span_against_a_direct_sum():
    g = torch.Generator().manual_seed(0)
    grid = (3, 4, 5)
    S, D = 60, 8
    q = torch.randn(S, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(S, D, generator=g, dtype=torch.float64) * 2
    rows = torch.tensor([0, 7, 23, 41, 59])
    radii, frames = [0, 1, 3], [0, 1, 2]
    got = AS.head_span(q, k, grid, rows, radii, frames)
    T, H, W = grid
    want_s, want_t = [0.0] * len(radii), [0.0] * len(frames)
    for r in rows.tolist():
        p = torch.softmax(q[r] @ k.T / math.sqrt(D), -1)
        rt, rh, rw = r // (H * W), (r // W) % H, r % W
        for j in range(S):
            jt, jh, jw = j // (H * W), (j // W) % H, j % W
            for i, rad in enumerate(radii):
                if max(abs(jh - rh), abs(jw - rw)) <= rad:
                    want_s[i] += float(p[j]) / len(rows)
            for i, f in enumerate(frames):
                if abs(jt - rt) <= f:
                    want_t[i] += float(p[j]) / len(rows)
    # float32 softmax inside head_span: ~1e-7 relative per term
    assert got["space"] == pytest.approx(want_s, abs=1e-5)
    assert got["time"] == pytest.approx(want_t, abs=1e-5)
    assert got["time"][-1] == pytest.approx(1.0, abs=1e-6)  # +-2 frames of 3: every key


def test_end_to_end_on_the_cpu(tmp_path):
    from dsv_ext.app.train import load_config, train
    from test_train import micro_dict

    run = tmp_path / "run"
    train(load_config(base=micro_dict(steps=2, val_videos=1)), out_dir=str(run), attention="dsv", device="cpu",
          progress=False)
    out = tmp_path / "span"
    assert AS.main(["--checkpoint", str(run / "ckpt_last.pt"), "--frames", "8", "--rows", "16",
                    "--radii", "0", "1", "3", "--frames-within", "0", "2", "7", "--out", str(out)]) == 0
    res = json.load(open(out / "span.json"))
    assert res["grid"] == [8, 4, 4] and len(res["heads"]) == 4  # 2 blocks x 2 heads
    for v in res["heads"].values():
        for part in ("space", "time"):
            assert all(0 <= a <= b + 1e-6 for a, b in zip(v[part], v[part][1:])), part  # nondecreasing
        assert v["space"][-1] == pytest.approx(1.0, abs=1e-5)  # radius 3 covers the 4 x 4 frame
        assert v["time"][-1] == pytest.approx(1.0, abs=1e-5)  # +-7 of 8 frames
    assert "| blocks.0.attn.attn_core:0 |" in (out / "span.md").read_text()
    with pytest.raises(SystemExit):
        AS.main(["--checkpoint", str(run / "ckpt_last.pt"), "--rows", "0", "--out", str(out)])
