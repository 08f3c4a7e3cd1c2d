"""CPU tests of the sampler (dsv_ext.app.sample): a tiny trained checkpoint (configs/tiny.yaml, a few
steps, stage 2 forced so the sparse path is used) -> GIF / PNG / npy of the configured shape,
determinism, full attention vs DSV with K = S, and the flow-matching solver on a known answer."""
import json
import os

import numpy as np
import pytest
import torch

from dsv_ext.app.models import dsv_attention_available
from dsv_ext.app.train import load_config, train
from dsv_ext.app.checkpoint import load_checkpoint, save_checkpoint

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import dsv_ext.modules.attention as attention_mod  # noqa: E402
from dsv_ext.app.sample import (latents_to_frames, load_for_sampling, main, sample,  # noqa: E402
                            sample_latents, timestep_grid)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_dsv = pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")

STEPS = 3  # sampling steps in these tests


def tiny_config(**dsv_kw):
    """configs/tiny.yaml (latents 4 x 8 x 16 x 16, 512 tokens, 4 blocks of 4 heads), trained for
    4 steps at batch 1; stage 2 forced at step 2 and every block dispatched sparse."""
    ov = ["train.steps=4", "train.batch_size=1", "train.warmup_steps=1", "train.log_every=1",
          "train.val_every=0", "train.val_videos=1", "train.val_timesteps=[0.5]", "train.threads=1",
          "dsv.profile_every=1", "dsv.switch_check_every=1", "dsv.force_stage2_step=2",
          "dsv.dispatch_threshold=0.0"]
    # the theta K rule: predictors trained for 4 steps reach no recall target below K = S
    dsv_kw = {"k_rule": "theta", **dsv_kw}
    ov += [f"dsv.{k}={v}" for k, v in dsv_kw.items()]
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ov)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    if not dsv_attention_available():
        pytest.skip("DSVAttention not importable")
    out = tmp_path_factory.mktemp("tiny_run")
    old = torch.get_num_threads()
    try:
        res = train(tiny_config(), out_dir=str(out), attention="dsv", device="cpu", progress=False)
    finally:
        torch.set_num_threads(old)
    assert res["summary"]["dsv_stage"] == 2
    return str(out / "ckpt_last.pt")


@pytest.fixture(scope="module")
def active_ckpt(ckpt, tmp_path_factory):
    """The trained checkpoint with its adaLN-zero layers (still ~0 after 4 steps) set to random
    values, so attention changes the output at O(1) and a sparse approximation shows."""
    ck = load_checkpoint(ckpt, map_location="cpu")
    g = torch.Generator().manual_seed(0)
    for name, v in ck["model"].items():
        if name.endswith(("ada.1.weight", "final.linear.weight")):
            v.copy_(torch.randn(v.shape, generator=g) * 0.2)
    path = str(tmp_path_factory.mktemp("active") / "ckpt_active.pt")
    save_checkpoint(ck, path)
    return path


def _run(ckpt, out, **kw):
    kw.setdefault("steps", STEPS)
    kw.setdefault("num_samples", 2)
    kw.setdefault("threads", 1)
    kw.setdefault("progress", False)
    kw.setdefault("log", lambda s: None)
    return sample(ckpt, str(out), device="cpu", **kw)


class _CountSparse:
    """Counts the calls of the stage-2 sparse core (the model's attention looks it up in
    dsv_ext.modules.attention at call time) and how many of them estimated a fresh index (index=None)."""

    def __init__(self, monkeypatch):
        self.calls = self.estimates = 0
        real = attention_mod.sparse_core

        def wrapped(*a, **k):
            self.calls += 1
            self.estimates += k.get("index") is None
            return real(*a, **k)

        monkeypatch.setattr(attention_mod, "sparse_core", wrapped)


# ---------------------------------------------------------------------------------------------

@needs_dsv
def test_sample_writes_gif_png_npy(ckpt, tmp_path, monkeypatch):
    spy = _CountSparse(monkeypatch)
    rec = _run(ckpt, tmp_path, show_data=1)
    C, T, H, W = 4, 8, 16, 16  # tiny.yaml: channels 4, frames 8, 16 x 16 latents
    depth = 4
    assert rec["mode"] == "dsv" and rec["dsv_stage"] == 2 and rec["sparse_blocks"] == depth
    assert spy.calls == STEPS * depth  # one batch of 2: every block sparse at every step
    for b in rec["blocks"]:
        assert b["sparse"] and b["seq_len"] == 512
        assert len(b["head_k"]) == 4 and all(16 <= k <= 512 and k % 16 == 0 for k in b["head_k"])
    s = 8  # default scale: 16-pixel-high latents -> at least 128 pixels
    lat = rec["latents"]
    assert lat.shape == (2, C, T, H, W)
    for i in range(2):
        z = np.load(tmp_path / f"sample_{i:03d}.npy")
        assert z.shape == (C, T, H, W) and z.dtype == np.float32 and np.isfinite(z).all()
        assert np.array_equal(z, lat[i].numpy())
        gif = Image.open(tmp_path / f"sample_{i:03d}.gif")
        assert gif.format == "GIF" and gif.n_frames == T and gif.size == (W * s, H * s)
        assert gif.info.get("loop") == 0
        frames = []
        for f in range(T):
            gif.seek(f)
            frames.append(np.asarray(gif.convert("RGB")))
        assert not all(np.array_equal(frames[0], fr) for fr in frames[1:])  # it moves
        png = Image.open(tmp_path / f"sample_{i:03d}.png")
        assert png.format == "PNG" and png.mode == "RGB"
        assert png.size == (T * W * s + (T - 1), H * s)  # frames in a row, 1-pixel gaps
        grid = np.asarray(png)
        first = latents_to_frames(lat[i])[0]
        assert np.array_equal(grid[:, :W * s], first)  # the grid holds the mapped frames
    assert Image.open(tmp_path / "data_000.gif").n_frames == T
    js = json.load(open(tmp_path / "sampling.json"))
    assert js["steps"] == STEPS and js["frame_size"] == [H * s, W * s]
    assert js["latent_shape"] == [C, T, H, W] and len(js["samples"]) == 2
    assert "latents" not in js and "sample_001.gif" in js["files"]


@needs_dsv
def test_sample_is_deterministic(ckpt, tmp_path):
    a = _run(ckpt, tmp_path / "a", seed=3)["latents"]
    b = _run(ckpt, tmp_path / "b", seed=3)["latents"]
    assert torch.equal(a, b)
    for name in ("sample_000.gif", "sample_001.png", "sample_001.npy"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    c = _run(ckpt, tmp_path / "c", seed=4)["latents"]
    assert (a - c).abs().max() > 0.1  # another seed, another sample
    # sample i's noise does not depend on how many samples are drawn nor on the batching
    one = _run(ckpt, tmp_path / "d", seed=3, num_samples=1)["latents"]
    split = _run(ckpt, tmp_path / "e", seed=3, batch_size=1)["latents"]
    torch.testing.assert_close(one[0], a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, a, atol=1e-5, rtol=1e-5)


@needs_dsv
def test_full_and_dsv_agree_when_k_equals_s(active_ckpt, tmp_path, monkeypatch):
    ckpt = active_ckpt
    spy = _CountSparse(monkeypatch)
    full = _run(ckpt, tmp_path / "full", full_attention=True, seed=1)
    assert full["mode"] == "dense" and full["sparse_blocks"] == 0 and spy.calls == 0
    # K = S: min_density 1 gives every head all 512 keys, and such heads run dense attention
    dsv_all = _run(ckpt, tmp_path / "all", seed=1, dsv_overrides={"min_density": 1.0})
    assert dsv_all["mode"] == "dsv" and spy.calls == 0
    assert all(b["head_k"] == [512] * 4 for b in dsv_all["blocks"])
    # fp32 sums in another order, through STEPS Euler steps: round-off level
    torch.testing.assert_close(dsv_all["latents"], full["latents"], atol=2e-5, rtol=2e-5)
    # with the trained K < S the sparse path really drops keys: the samples move away
    dsv = _run(ckpt, tmp_path / "dsv", seed=1)
    assert all(max(b["head_k"]) < 512 for b in dsv["blocks"])
    assert (dsv["latents"] - full["latents"]).abs().max() > 1e-3  # (measured: 5e-3 vs 1e-6)


@needs_dsv
def test_sampling_with_the_default_groups(active_ckpt, tmp_path, monkeypatch):
    """The tiny checkpoint (trained with G = 8 in 2x2x2 cubes) samples with the library's default
    groups, 64 queries in 4x4x4 cubes (8 groups on its 8x8x8 grid): with K = S as full attention,
    with the trained K differently from its own groups."""
    spy = _CountSparse(monkeypatch)
    ov = {"group_size": 64, "cube": [4, 4, 4]}
    full = _run(active_ckpt, tmp_path / "full", full_attention=True, seed=1)
    allk = _run(active_ckpt, tmp_path / "all", seed=1, dsv_overrides={**ov, "min_density": 1.0})
    assert allk["mode"] == "dsv" and spy.calls == 0  # heads at K = S run dense attention
    torch.testing.assert_close(allk["latents"], full["latents"], atol=2e-5, rtol=2e-5)
    g64 = _run(active_ckpt, tmp_path / "g64", seed=1, dsv_overrides=ov)
    g8 = _run(active_ckpt, tmp_path / "g8", seed=1)
    assert g64["sparse_blocks"] == g8["sparse_blocks"] == 4 and spy.calls == 2 * STEPS * 4
    assert torch.isfinite(g64["latents"]).all()
    assert (g64["latents"] - g8["latents"]).abs().max() > 1e-3  # (measured: 5.6e-3)


@needs_dsv
def test_load_for_sampling_restores_controller(ckpt):
    sm = load_for_sampling(ckpt, "cpu")
    ck = load_checkpoint(ckpt, map_location="cpu")
    assert not sm.model.training and sm.controller.stage == 2 and sm.step == 4
    assert sm.controller.step_count == ck["controller"]["step"]
    for (name, m), saved in zip(sm.controller.modules, ck["controller"]["blocks"]):
        assert m.use_sparse == saved["use_sparse"]
        assert not m.plan.train and not m.plan.profile
        for k, v in ck["controller"]["predictors"][name].items():
            assert torch.equal(getattr(m.predictor, k), v)
    # sampling leaves the controller and predictors as they were
    before = {n: m.predictor.wq.clone() for n, m in sm.controller.modules}
    sample_latents(sm.model, torch.randn(1, 4, 8, 16, 16), 1)
    assert sm.controller.step_count == ck["controller"]["step"]
    for n, m in sm.controller.modules:
        assert torch.equal(m.predictor.wq, before[n])
        st = m.take_stats()
        assert (st.loss, st.sparsity, st.recall, st.grads) == (None, None, None, None)


def test_dense_checkpoint_samples_dense(tmp_path):
    cfg = load_config(base={
        "name": "micro", "model": {"hidden": 32, "depth": 1, "heads": 2, "patch": [1, 2, 2]},
        "data": {"frames": 2, "height": 8, "width": 8, "channels": 1},
        "train": {"steps": 1, "batch_size": 1, "val_videos": 1, "val_timesteps": [0.5],
                  "precision": "fp32"}})
    train(cfg, out_dir=str(tmp_path), attention="dense", device="cpu", progress=False)
    notes = []
    rec = sample(str(tmp_path / "ckpt_last.pt"), str(tmp_path / "s"), steps=2, num_samples=1,
                 device="cpu", progress=False, log=notes.append, scale=3, fps=4)
    assert rec["mode"] == "dense" and rec["trained_attention"] == "dense" and rec["blocks"] == []
    assert any("full attention" in n for n in notes)
    gif = Image.open(tmp_path / "s" / "sample_000.gif")
    assert gif.n_frames == 2 and gif.size == (24, 24) and gif.info["duration"] == 250
    arr = np.asarray(Image.open(tmp_path / "s" / "sample_000.png"))
    assert arr.shape == (24, 49, 3)
    assert np.array_equal(arr[:, :24, 0], arr[:, :24, 2])  # one channel: grey


# ---------------------------------------------------------------------------------------------
# The solver and the picture mapping (no checkpoint)

class _DeltaVelocity(torch.nn.Module):
    """The exact flow-matching velocity when the data is a single point c: x_t = (1-t) c + t e,
    v = e - c = (x - c) / t. Every solver lands on c exactly (the flow is linear in x)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.ts = []

    def forward(self, x, t):
        self.ts.append(float(t[0]))
        assert (t > 0).all()
        return (x - self.c) / t.view(-1, 1, 1, 1, 1)


@pytest.mark.parametrize("solver,shift", [("euler", 1.0), ("heun", 1.0), ("euler", 3.0)])
def test_solver_reaches_the_data_point(solver, shift):
    g = torch.Generator().manual_seed(0)
    c = torch.randn(1, 2, 2, 3, 3, generator=g)
    noise = torch.randn(2, 2, 2, 3, 3, generator=g)
    m = _DeltaVelocity(c)
    x = sample_latents(m, noise, 4, solver=solver, shift=shift)
    torch.testing.assert_close(x, c.expand_as(x), atol=1e-5, rtol=0)
    assert len(m.ts) == (4 if solver == "euler" else 7)
    assert m.ts[0] == 1.0  # starts at pure noise
    # the sign convention matters: integrating the wrong way does not reach c
    bad = sample_latents(lambda x, t: -m(x, t), noise, 4, solver=solver, shift=shift)
    assert (bad - c).abs().max() > 0.5


def test_timestep_grid():
    torch.testing.assert_close(timestep_grid(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0],
                                                              dtype=torch.float64))
    t = timestep_grid(4, shift=3.0)
    assert t[0] == 1.0 and t[-1] == 0.0 and (t[1:] < t[:-1]).all()
    assert t[2] == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    with pytest.raises(ValueError, match="^steps"):
        timestep_grid(0)
    with pytest.raises(ValueError, match="^shift"):
        timestep_grid(4, shift=0.0)


def test_latents_to_frames():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 3, 4, 6, generator=g)
    f = latents_to_frames(z, scale=2)
    assert f.shape == (3, 8, 12, 3) and f.dtype == np.uint8
    assert np.array_equal(f[:, ::2, ::2], f[:, 1::2, 1::2])  # nearest-neighbour blocks
    assert f.min() == 0 and f.max() == 255  # percentile stretch uses the whole range
    # first3 shows channels 0-2: channel 3, 4 do not matter
    z2 = z.clone()
    z2[3:] = 0
    assert np.array_equal(latents_to_frames(z2, scale=2), f)
    # monotone in each channel: a brighter latent is a brighter pixel
    r = f[..., 0].astype(int).ravel()
    zr = z[0].repeat_interleave(2, 1).repeat_interleave(2, 2).numpy().ravel()
    order = np.argsort(zr)
    assert (np.diff(r[order]) >= 0).all()
    p = latents_to_frames(z, view="pca", normalize="joint")
    assert p.shape == (3, 4 * 32, 6 * 32, 3)  # default scale: at least 128 pixels high
    assert latents_to_frames(z[:1], scale=1).shape == (3, 4, 6, 3)
    bad = z.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="^latents"):
        latents_to_frames(bad)
    with pytest.raises(ValueError, match="^view"):
        latents_to_frames(z, view="rgb")
    with pytest.raises(ValueError, match="^latents"):
        latents_to_frames(z[0])


@needs_dsv
def test_cli(ckpt, tmp_path, capsys, monkeypatch):
    rc = main(["--checkpoint", ckpt, "--steps", "2", "--out", str(tmp_path), "--num-samples", "1",
               "--seed", "5", "--device", "cpu", "--solver", "heun", "--threads", "1",
               "--set", "dsv.k_margin=0.1", "--view", "pca"])
    assert rc == 0
    out = capsys.readouterr()
    assert '"mode": "dsv"' in out.out and "sampling (dsv, heun)" in out.err  # the tqdm bar
    js = json.load(open(tmp_path / "sampling.json"))
    assert js["solver"] == "heun" and js["model_evaluations_per_sample"] == 3
    assert js["dsv_overrides"] == {"k_margin": 0.1} and js["view"] == "pca"
    assert sorted(os.listdir(tmp_path)) == ["sample_000.gif", "sample_000.npy",
                                            "sample_000.png", "sampling.json"]
    # bad arguments: one line naming the argument on stderr, exit status 2 (no traceback)
    for args, msg in ((["--set", "k=1"], "error: --set"), (["--steps", "0"], "error: --steps"),
                      (["--index-refresh", "0"], "error: --index-refresh"),
                      (["--checkpoint", str(tmp_path / "nope.pt")],
                       f"error: checkpoint: {tmp_path / 'nope.pt'}: no such file")):
        argv = ["--checkpoint", ckpt, "--steps", "1", "--out", str(tmp_path)] + args
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"python -m dsv_ext.app.sample: {msg}" in err and "Traceback" not in err, err
    monkeypatch.setenv("DSV_TRACEBACK", "1")  # the traceback on request
    with pytest.raises(ValueError, match="^--set"):
        main(["--checkpoint", ckpt, "--steps", "1", "--out", str(tmp_path), "--set", "k=1"])
    with pytest.raises(ValueError, match="^config: unknown key"):
        sample(ckpt, str(tmp_path), steps=1, device="cpu", dsv_overrides={"nope": 1},
               progress=False)



@needs_dsv
def test_bench_inference_helpers_cpu(tmp_path, monkeypatch):
    """benchmarks/bench_inference.py's model, modes and report on a small CPU model (the timing
    itself needs CUDA events: it runs on the GPU only)."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_inference", os.path.join(ROOT, "benchmarks", "bench_inference.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(channels=4, hidden=64, heads=2, group_size=32, rank=4,
                              k_multiple=16, cube=[2, 4, 4])
    model = bench.build_model(512, (8, 8, 8), 2, args, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    spy = _CountSparse(monkeypatch)
    noise = torch.randn(1, 4, 8, 16, 16, generator=torch.Generator().manual_seed(0))
    outs = {}
    for mode in ("full", "dsv_0.9", "dsv_0.5"):
        info = bench.set_mode(model, mode, 512)
        before = spy.calls
        outs[mode] = sample_latents(model, noise, 1, precision="bf16")
        assert torch.isfinite(outs[mode]).all()
        if mode == "full":
            assert info["head_k"] is None and spy.calls == before
        else:
            # K = (1 - s) * 512 rounded up to a multiple of 16: 51.2 -> 64, 256 -> 256
            assert info["head_k"] == [{"dsv_0.9": 64, "dsv_0.5": 256}[mode]] * 2
            assert spy.calls == before + 2  # both blocks sparse
    assert (outs["full"] - outs["dsv_0.9"]).abs().max() > 0  # the modes really differ
    assert bench.set_mode(model, "dsv_0.9_r2", 512)["index_refresh"] == 2
    assert all(m.index_refresh == 2 for m in bench.attention_modules(model))
    assert bench.set_mode(model, "full", 512)["index_refresh"] is None
    assert all(m.index_refresh == 1 for m in bench.attention_modules(model))
    with pytest.raises(ValueError, match="--modes"):
        bench.set_mode(model, "dsv_0.9_x2", 512)
    res = {"device": "cpu", "torch": torch.__version__, "hidden": 64, "heads": 2, "head_dim": 32,
           "layers": 2, "channels": 4, "group_size": 32, "rank": 4, "k_multiple": 16,
           "cube": [2, 4, 4], "steps": 3, "warmup": 1, "core_iters": 2, "breakdown": [],
           "runs": {"512": [
               {"mode": "full", "grid": [8, 8, 8], "median_step_ms": 10.0, "min_step_ms": 9.0,
                "max_step_ms": 11.0, "latency_s": 0.03, "peak_gb": 1.0},
               {"mode": "dsv_0.9", "grid": [8, 8, 8], "kmax": 64, "median_step_ms": 4.0,
                "min_step_ms": 4.0, "max_step_ms": 5.0, "latency_s": 0.012, "peak_gb": 1.0},
               {"mode": "dsv_0.95", "grid": [8, 8, 8], "error": "RuntimeError: no kernels"}]}}
    bench.write_markdown(res, str(tmp_path / "r.md"))
    md = open(tmp_path / "r.md").read()
    assert "| 512 | 8x8x8 | dsv_0.9 | 0.125 | 4.0 | 4.0-5.0 | 0.012 | 2.50x | 1.0 |" in md
    assert "error: RuntimeError: no kernels" in md


@needs_dsv
def test_index_refresh_reuses_estimates(active_ckpt, tmp_path, monkeypatch):
    ckpt = active_ckpt
    spy = _CountSparse(monkeypatch)
    base = _run(ckpt, tmp_path / "r1", seed=1, batch_size=1)
    assert (spy.calls, spy.estimates) == (2 * STEPS * 4, 2 * STEPS * 4) and base["index_refresh"] == 1
    spy.calls = spy.estimates = 0
    r2 = _run(ckpt, tmp_path / "r2", seed=1, batch_size=1, index_refresh=2)
    # per batch (2 batches of 1) and block (4): steps 0 and 2 of 3 estimate, step 1 reuses
    assert (spy.calls, spy.estimates) == (2 * STEPS * 4, 2 * 2 * 4) and r2["index_refresh"] == 2
    # a reused index changes the samples, but far less than dropping DSV for full attention
    full = _run(ckpt, tmp_path / "full", seed=1, batch_size=1, full_attention=True)
    d_reuse = (r2["latents"] - base["latents"]).abs().max().item()
    d_full = (full["latents"] - base["latents"]).abs().max().item()
    print(f"max |reuse - per-step| {d_reuse:.2e}, max |full - per-step| {d_full:.2e}")
    assert 0 < d_reuse < d_full, (d_reuse, d_full)
    # K = S: the heads run dense attention, nothing is estimated or reused
    spy.calls = spy.estimates = 0
    a = _run(ckpt, tmp_path / "a", seed=1, dsv_overrides={"min_density": 1.0})
    b = _run(ckpt, tmp_path / "b", seed=1, dsv_overrides={"min_density": 1.0}, index_refresh=STEPS)
    assert spy.calls == spy.estimates == 0
    torch.testing.assert_close(a["latents"], b["latents"], atol=0, rtol=0)


@needs_dsv
def test_index_refresh_arguments_and_training_mode(ckpt):
    import dsv_ext
    from dsv_ext.modules.attention import SparseAttention

    sm = load_for_sampling(ckpt, "cpu")
    with pytest.raises(ValueError, match="index_refresh"):
        sample(ckpt, "unused", index_refresh=0, device="cpu", progress=False)
    with pytest.raises(ValueError, match="every"):
        dsv_ext.set_index_refresh(sm.model, 0)
    with pytest.raises(TypeError, match="model"):
        dsv_ext.set_index_refresh("not a model", 2)
    assert dsv_ext.set_index_refresh(sm.model, 3) == 4
    mods = [m for m in sm.model.modules() if isinstance(m, SparseAttention)]
    m = next(x for x in mods if x.stage == 2 and x.use_sparse)
    H, D = m.num_heads, m.head_dim
    S = 512  # configs/tiny.yaml: token grid 8 x 8 x 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    m.train()  # training never reuses an index: every call estimates
    for _ in range(3):
        m(q, k, v)
    assert m._index_cache is None
    m.eval()
    o1 = m(q, k, v)
    assert m._index_cache is not None
    o2 = m(q, k, v)  # reused: same inputs, same index, same output
    torch.testing.assert_close(o1, o2, atol=0, rtol=0)
    m(q[:, :256], k[:, :256], v[:, :256], grid=(4, 8, 8))  # another length: estimated again
    assert m._index_cache[0][0][1] == 256


def _cp_sample_worker(rank, world, init_file, ckpt_path, out_root, result_file):
    import importlib

    import torch.distributed as dist

    importlib.import_module("torch._dynamo")  # before init_process_group (docs/PARALLEL.md)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rec = _run(ckpt_path, os.path.join(out_root, f"rank{rank}"), context_parallel=True)
        torch.save(rec["latents"], result_file + f".{rank}")
    finally:
        from dsv_ext.parallel import clear_group_cache

        clear_group_cache()
        dist.destroy_process_group()


@needs_dsv
def test_context_parallel_sampling_matches(active_ckpt, tmp_path):
    """sample(context_parallel=True) on 2 gloo ranks (each clip's 512 tokens split in two, sparse
    blocks through the plan solver's CP) gives the single-process latents on every rank; rank 0
    writes the files."""
    import torch.multiprocessing as mp

    ref = _run(active_ckpt, tmp_path / "single")
    assert ref["mode"] == "dsv" and ref["sparse_blocks"] > 0
    res = str(tmp_path / "lat")
    mp.spawn(_cp_sample_worker, args=(2, str(tmp_path / "init"), active_ckpt, str(tmp_path / "cp"), res),
             nprocs=2, join=True)
    for r in range(2):
        got = torch.load(res + f".{r}")
        assert got.shape == ref["latents"].shape
        # float32 on the CPU; the CP path sums keys in cube order: differences at rounding level
        assert float((got - ref["latents"]).abs().max()) <= 1e-5 * float(ref["latents"].abs().max())
    assert (tmp_path / "cp" / "rank0" / "sampling.json").exists() and not (tmp_path / "cp" / "rank1").exists()


def test_context_parallel_sampling_needs_a_process_group(ckpt, tmp_path):
    with pytest.raises(RuntimeError, match="not initialised"):
        _run(ckpt, tmp_path, context_parallel=True)
