"""benchmarks/bench_equal_recall.py: the recall curves of each granularity against a brute-force
float64 count, their ordering, the density rule, and a CPU run end to end."""
import importlib.util
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("bench_equal_recall",
                                               os.path.join(ROOT, "benchmarks", "bench_equal_recall.py"))
ER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ER)

from dsv_ext.grouping import cube_permutation  # noqa: E402


def _inputs(grid=(4, 8, 8), D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = grid[0] * grid[1] * grid[2]
    q = torch.randn(S, D, generator=g) * 1.5
    k = torch.randn(S, D, generator=g) * 1.5
    return q, k, cube_permutation(grid, (2, 4, 4))[0], 1.0 / math.sqrt(D)


def _brute(p, rows_per_list, key_block, n_items):
    """float64 mean over rows of the mass covered by each list's top n_items key blocks."""
    R, S = p.shape
    tot = 0.0
    for g0 in range(0, R, rows_per_list):
        rows = p[g0:g0 + rows_per_list]
        blk = rows.sum(0).view(S // key_block, key_block).sum(-1)
        keep = blk.argsort(descending=True)[:n_items]
        mask = torch.zeros(S // key_block, dtype=torch.bool)
        mask[keep] = True
        tot += float(rows[:, mask.repeat_interleave(key_block)].sum())
    return tot / R


def test_curves_match_a_brute_force_count():
    q, k, perm, scale = _inputs()
    S = q.shape[0]
    cur = ER.head_curves(q, k, perm, scale, groups=(32, 64), blocks=(16, 64), chunk=128)
    qd, kd = q.double(), k.double()
    pc = torch.softmax(scale * qd[perm] @ kd[perm].T, -1)   # cube order
    pr = torch.softmax(scale * qd @ kd.T, -1)               # raster order
    for name, p, rows, blk in (("token G=32", pc, 32, 1), ("token G=64", pc, 64, 1),
                               ("block b=16", pc, 64, 16), ("block b=64", pc, 64, 64),
                               ("flex 128x128", pr, 128, 128)):
        kpi, c = cur[name]
        assert kpi == blk and c.numel() == S // blk
        for n in (1, 2, max(1, c.numel() // 3), c.numel()):
            assert c[n - 1].item() == pytest.approx(_brute(p, rows, blk, n), abs=2e-5), (name, n)
    kpi, c = cur["token"]  # per-query oracle: each row its own top keys
    for n in (1, 7, S // 2):
        want = float(pc.sort(-1, descending=True).values[:, :n].sum(1).mean())
        assert c[n - 1].item() == pytest.approx(want, abs=2e-5)


def test_curves_are_ordered_and_reach_one():
    q, k, perm, scale = _inputs(seed=1)
    S = q.shape[0]
    cur = ER.head_curves(q, k, perm, scale, chunk=256)
    for name, (kpi, c) in cur.items():
        assert torch.all(c[1:] >= c[:-1] - 1e-9), name
        assert c[-1].item() == pytest.approx(1.0, abs=1e-5), name
    # at equal keys: the per-query oracle >= one list per 32 queries >= per 64 >= 64-key blocks
    tok, g32, g64 = cur["token"][1], cur["token G=32"][1], cur["token G=64"][1]
    b64 = cur["block b=64"][1]
    assert torch.all(tok >= g32 - 1e-7) and torch.all(g32 >= g64 - 1e-7)
    keys = torch.arange(1, b64.numel() + 1) * 64
    assert torch.all(g64[keys - 1] >= b64 - 1e-7)


def test_g32_curves_are_the_same_in_both_cube_orders():
    """With 4x4x4 cubes a group of 32 is half a cube: the same 2x4x4 regions as the 2x4x4 cube
    order's groups (in another order), so the G = 32 curve does not change (nor the per-query and
    raster ones); groups of 64 (token G=64, the key-block lists) become 4x4x4 cubes instead of two
    neighbouring 2x4x4 cubes."""
    q, k, _, scale = _inputs(grid=(4, 8, 8), seed=2)
    a = ER.head_curves(q, k, cube_permutation((4, 8, 8), (2, 4, 4))[0], scale, chunk=128)
    b = ER.head_curves(q, k, cube_permutation((4, 8, 8), (4, 4, 4))[0], scale, chunk=128)
    for name in ("token", "token G=32", "flex 128x128"):
        # float32 probabilities summed in another row order: ~1e-9 apart
        torch.testing.assert_close(a[name][1], b[name][1], rtol=0, atol=1e-6)
    for name in ("token G=64", "block b=16", "block b=64"):
        assert (a[name][1] - b[name][1]).abs().max() > 1e-3, name


def test_density_rule():
    c = torch.tensor([0.5, 0.8, 0.9, 0.97, 1.0], dtype=torch.float64)
    assert ER.density_for(c, 16, 80, 0.9) == pytest.approx(3 * 16 / 80)
    assert ER.density_for(c, 16, 80, 0.95) == pytest.approx(4 * 16 / 80)
    assert ER.density_for(c, 16, 80, 0.4) == pytest.approx(16 / 80)
    assert ER.density_for(c[:3], 16, 80, 0.99) == 1.0


def test_dense_head_split():
    """SparseAttention's rule at the long shape: heads above the density limit run dense."""
    assert ER.dense_head_split([0.2, 0.4, 0.6, 0.9], 24, 0.5) == (12, 12, pytest.approx(0.3))
    assert ER.dense_head_split([0.2, 0.4, 0.45, 0.9], 24, 0.5) == (18, 6, pytest.approx(1.05 / 3))
    assert ER.dense_head_split([0.1, 0.3], 8, 0.5) == (8, 0, pytest.approx(0.2))
    assert ER.dense_head_split([0.6, 0.9], 8, 0.5) == (0, 8, 0.0)
    with pytest.raises(ValueError, match="densities"):
        ER.dense_head_split([], 8, 0.5)


def test_auto_choice():
    """kv_block="auto" per head: the cheapest granularity (block_cost_ratio x density; G = 128:
    tokens 1.0, b=16 1.07, b=64 1.12; G = 64: b=64 0.85) among those within the density limit,
    else dense (0)."""
    dens = {1: [0.30, 0.30, 0.45, 0.60, 0.40], 16: [0.35, 0.20, 0.50, 0.70, 0.45],
            64: [0.40, 0.40, 0.38, 0.55, 0.37]}
    # G = 128: head 0: 0.30 / 0.375 / 0.448 -> tokens; head 1: b=16 0.214 < 0.30; head 2: b=64
    # 0.4256 < 0.45; head 3: nothing within 0.5 -> dense; head 4: tokens 0.40 < b=64 0.4144
    assert ER.auto_choice(dens, 0.5, 128) == [1, 16, 64, 0, 1]
    assert ER.auto_choice(dens, 1.0, 128)[3] == 1  # 0.60 < 0.616 (b=64) once allowed
    # G = 64: b=64 at 0.85 of the token cost per key: head 4 too (0.3145 < 0.40), not head 0
    # (0.34 > 0.30)
    assert ER.auto_choice(dens, 0.5, 64) == [1, 16, 64, 0, 64]
    with pytest.raises(ValueError, match="densities"):
        ER.auto_choice({1: [0.1], 64: [0.1, 0.2]}, 0.5, 128)


def test_sampled_rows_match_a_brute_force_count():
    """head_curves(sample=N): the curves over N evenly spaced runs of 128 rows (here runs 0 and
    3 of 4) equal a float64 count over those rows alone; sample=all runs gives the full curves."""
    q, k, perm, scale = _inputs(grid=(4, 8, 16))  # S = 512: 4 runs of 128 rows
    S = q.shape[0]
    cur = ER.head_curves(q, k, perm, scale, groups=(32, 128), blocks=(16,), sample=2)
    rows = torch.cat([torch.arange(0, 128), torch.arange(384, 512)])
    qd, kd = q.double(), k.double()
    pc = torch.softmax(scale * qd[perm][rows] @ kd[perm].T, -1)   # cube order, sampled rows
    pr = torch.softmax(scale * qd[rows] @ kd.T, -1)               # raster order, same positions
    for name, p, per, blk in (("token G=32", pc, 32, 1), ("token G=128", pc, 128, 1),
                              ("block b=16", pc, 64, 16), ("flex 128x128", pr, 128, 128)):
        kpi, c = cur[name]
        for n in (1, 3, c.numel() // 2, c.numel()):
            assert c[n - 1].item() == pytest.approx(_brute(p, per, blk, n), abs=2e-5), (name, n)
    kpi, c = cur["token"]
    for n in (1, 9, S // 3):
        assert c[n - 1].item() == pytest.approx(float(pc.sort(-1, descending=True).values[:, :n].sum(1).mean()),
                                                abs=2e-5)
    full = ER.head_curves(q, k, perm, scale, groups=(32, 128), blocks=(16,))
    every = ER.head_curves(q, k, perm, scale, groups=(32, 128), blocks=(16,), sample=99)
    for name in full:
        assert torch.allclose(full[name][1], every[name][1], atol=1e-9), name
    with pytest.raises(ValueError, match="sample"):
        ER.head_curves(q, k, perm, scale, sample=-1)


def test_sizes_that_do_not_divide_are_refused():
    q, k, perm, scale = _inputs(grid=(2, 4, 12))  # S = 96: no 64-query groups, no 128 tiles
    with pytest.raises(ValueError, match="does not divide"):
        ER.head_curves(q, k, perm, scale)


def test_end_to_end_on_the_cpu(tmp_path):
    from dsv_ext.app.train import load_config, train
    from test_train import micro_dict

    d = micro_dict(steps=4, val_videos=1)
    d["data"].update(frames=4, height=16, width=16)  # 4 x 8 x 8 = 256 tokens
    ck_dir = tmp_path / "run"
    train(load_config(base=d), out_dir=str(ck_dir), attention="dsv", device="cpu", progress=False)
    out = tmp_path / "er"
    assert ER.main(["--checkpoint", str(ck_dir / "ckpt_last.pt"), "--videos", "1", "--timesteps", "0.5",
                    "--device", "cpu", "--out", str(out), "--cube", "4", "4", "4"]) == 0
    import json

    res = json.load(open(out / "equal_recall.json"))
    m = res["analysis"]["methods"]
    assert {"token", "token G=32", "token G=64", "block b=16", "block b=64", "flex 128x128",
            "predictor G=32", "predictor G=64", "block b=16 G=128", "block b=64 G=128"} <= set(m)
    for name, per_t in m.items():
        dens = [per_t[str(t)]["mean_density"] for t in res["analysis"]["targets"]]
        assert all(0 < x <= 1 for x in dens) and dens == sorted(dens), name
        assert per_t["0.9"]["heads"] == 2 * 2  # 2 blocks x 2 heads, one capture
        assert len(per_t["0.9"]["densities"]) == 4
        assert sum(per_t["0.9"]["densities"]) / 4 == pytest.approx(per_t["0.9"]["mean_density"])
    assert res["analysis"]["cube"] == [4, 4, 4]  # --cube over the checkpoint's [2, 4, 4]
    assert "cube 4x4x4" in (out / "equal_recall.md").read_text()
    assert [n.split(":")[1] for n in res["analysis"]["head_names"]] == ["0", "1", "0", "1"]
    # --locality: per timestep, G = 128 lists and per-query lists on sampled rows (here all 2 runs)
    out_l = tmp_path / "loc"
    assert ER.main(["--checkpoint", str(ck_dir / "ckpt_last.pt"), "--videos", "1", "--timesteps", "0.3", "0.7",
                    "--device", "cpu", "--out", str(out_l), "--cube", "4", "4", "4", "--locality", "2"]) == 0
    loc = json.load(open(out_l / "locality.json"))
    assert sorted(loc["timesteps"]) == ["0.3", "0.7"] and loc["sample_rows"] == 256
    for t, an in loc["timesteps"].items():
        assert set(an["methods"]) == {"token", "token G=128", "flex 128x128"}
        for meth in ("token", "token G=128"):
            d9 = an["methods"][meth]["0.9"]["densities"]
            assert len(d9) == 4 and all(0 < x <= 1 for x in d9)
        # a query's own list never needs more keys than its group's
        assert all(a <= b + 1e-9 for a, b in zip(an["methods"]["token"]["0.9"]["densities"],
                                                 an["methods"]["token G=128"]["0.9"]["densities"]))
    md = (out_l / "locality.md").read_text()
    assert "| t = 0.3 | t = 0.7 |" in md and md.count("\n| blocks.") == 4
    with pytest.raises(SystemExit):
        ER.main(["--analysis", str(out / "equal_recall.json"), "--locality", "2", "--out", str(out_l)])
    # the slim copy (bf16 weights, the predictors): the same methods, densities within the bf16
    # rounding of the weights (a few keys of 256)
    from dsv_ext.app.checkpoint import slim_checkpoint

    slim_checkpoint(str(ck_dir / "ckpt_last.pt"), str(tmp_path / "slim.pt"))
    out_s = tmp_path / "er_slim"
    assert ER.main(["--checkpoint", str(tmp_path / "slim.pt"), "--videos", "1", "--timesteps", "0.5",
                    "--device", "cpu", "--out", str(out_s), "--cube", "4", "4", "4", "--no-per-query"]) == 0
    ms = json.load(open(out_s / "equal_recall.json"))["analysis"]["methods"]
    assert set(ms) == set(m) - {"token"}
    for name, per_t in ms.items():
        assert abs(per_t["0.9"]["mean_density"] - m[name]["0.9"]["mean_density"]) <= 0.05, name
    # a model trained with full attention: the same capture, no trained-predictor rows
    dn_dir = tmp_path / "dense"
    train(load_config(base=d), out_dir=str(dn_dir), attention="dense", device="cpu", progress=False)
    out_d = tmp_path / "er_dense"
    assert ER.main(["--checkpoint", str(dn_dir / "ckpt_last.pt"), "--videos", "1", "--timesteps", "0.5",
                    "--device", "cpu", "--out", str(out_d), "--cube", "4", "4", "4", "--no-per-query"]) == 0
    md_ = json.load(open(out_d / "equal_recall.json"))["analysis"]["methods"]
    assert set(md_) == set(m) - {"token"} - {x for x in m if x.startswith("predictor")}
    assert md_["token G=128"]["0.9"]["heads"] == 4
    # --analysis: a later run reuses the curves (e.g. to time them) without the checkpoint
    out2 = tmp_path / "er2"
    assert ER.main(["--analysis", str(out / "equal_recall.json"), "--device", "cpu", "--out", str(out2)]) == 0
    res2 = json.load(open(out2 / "equal_recall.json"))
    assert res2["analysis"] == res["analysis"] and res2["source"] == res["source"]
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit):
        ER.main(["--analysis", str(tmp_path / "other.json"), "--device", "cpu", "--out", str(out2)])


def test_timing_rows_with_a_model_of_the_kernels(monkeypatch):
    """time_methods' arithmetic on a stand-in for bench_kernels whose every kernel takes
    100 ms x density x (heads / 24) and cuDNN 100 ms: the `+ dense heads` row (heads above the
    density limit on cuDNN, the rest at their mean density) and the `auto G=128` row (each
    granularity's heads at their mean density, scaled by their share)."""
    import types

    H = 24
    fake = types.SimpleNamespace(
        estimate_fn=lambda: ("fake", None),
        dense_times=lambda B, S, H_, D, dt, reps, which: {"cudnn_fwdbwd_ms": 100.0},
        flex_times=lambda B, S, H_, D, dt, d, reps, gen: {"flex_fwdbwd_ms": 150.0 * d * H_ / H, "flex_fwd_ms": 0.0},
        run_shape=lambda B, S, H_, D, G, sp, dist, dt, reps, gen, en, e, c: {
            "total_ms": 100.0 * (1.0 - sp) * H_ / H, "fwd_ms": 0.0, "bwd_ms": 0.0, "est_ms": 0.0, "K": 1},
        block_lib=lambda: (None, None),
        block_buffers=lambda S, H_, D, dt: None,
        block_case=lambda lib, M, bufs, G, sp, b, reps, gen, token: {
            "fwd_ms": 0.0, "fwdbwd_ms": 100.0 * (1.0 - sp), "token_fwd_ms": 0.0,
            "token_fwdbwd_ms": 100.0 * (1.0 - sp), "K_blocks": 1},
        block_estimate_ms=lambda S, H_, G, b, K, reps, gen=None: 0.0)
    monkeypatch.setitem(sys.modules, "bench_kernels", fake)
    dens = {"token G=128": [0.2, 0.4, 0.8, 0.9], "block b=16 G=128": [0.1, 0.5, 0.9, 0.9],
            "block b=64 G=128": [0.3, 0.35, 0.45, 0.9], "flex 128x128": [0.3, 0.5, 0.95, 1.0]}
    analysis = {"targets": [0.9], "methods": {
        m: {"0.9": {"mean_density": sum(d) / 4, "heads": 4, "min": min(d), "max": max(d), "densities": d}}
        for m, d in dens.items()}}
    rows = {r["method"]: r for r in ER.time_methods(analysis, 4096, H, 128, 1, log=lambda *a: None)}
    # tokens: heads 2, 3 above 0.5 -> 12 of 24 heads dense; the others at (0.2 + 0.4) / 2
    mix = rows["token G=128 + dense heads"]
    assert mix["dense_heads"] == 12 and mix["total_ms"] == pytest.approx(50.0 + 100.0 * 0.3 * 12 / 24)
    # auto: head 0 b=16 (0.107 < 0.2, 0.276), head 1 b=64 (0.322 < 0.4), head 2 b=64 (0.414),
    # head 3 dense: 1/4 x 100 x 0.1 + 2/4 x 100 x 0.4 + 1/4 x 100
    auto = rows["auto G=128"]
    assert auto["heads_by_kv_block"] == {"dense": 1, "16": 1, "64": 2}
    assert auto["total_ms"] == pytest.approx(2.5 + 20.0 + 25.0)
    assert rows["token G=128"]["total_ms"] == pytest.approx(100.0 * 2.3 / 4)
    # FlexAttention at 150 ms x density: uniform at the mean 0.6875; with dense heads above its
    # crossover 2/3 (150 x 2/3 = cuDNN's 100): heads 2, 3 dense, the others at 0.4
    assert rows["flex 128x128"]["total_ms"] == pytest.approx(150.0 * 0.6875)
    fmix = rows["flex 128x128 + dense heads"]
    assert fmix["dense_above"] == pytest.approx(2 / 3) and fmix["dense_heads"] == 12
    assert fmix["total_ms"] == pytest.approx(50.0 + 150.0 * 0.4 * 12 / 24)


def test_flex_crossover():
    assert ER.flex_crossover(0.5, 75.0, 100.0) == pytest.approx(2 / 3)
    assert ER.flex_crossover(0.5, 25.0, 100.0) == 1.0  # cheaper than cuDNN at every density
    for bad in ((0.0, 1.0, 1.0), (1.5, 1.0, 1.0), (0.5, 0.0, 1.0), (0.5, 1.0, -1.0)):
        with pytest.raises(ValueError, match="flex_crossover"):
            ER.flex_crossover(*bad)
