"""benchmarks/predictor_rank.py: the closed-form low-rank fit against its optimum (the singular
value tail, float64) and a CPU run end to end."""
import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("predictor_rank", os.path.join(ROOT, "benchmarks", "predictor_rank.py"))
PR = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(PR)


@pytest.mark.parametrize("rank", [1, 3, 8, 16])
def test_fit_reaches_the_least_squares_optimum(rank):
    """Correlated q and k (float64, D 16): the fitted form's mean squared logit error over every
    query / key pair equals the tail of the whitened singular values (the optimum of rank r),
    any perturbation of it is worse, and full rank gives scale * identity."""
    g = torch.Generator().manual_seed(rank)
    D, n, scale = 16, 3000, 0.25
    q = torch.randn(n, D, generator=g, dtype=torch.float64) @ torch.randn(D, D, generator=g, dtype=torch.float64)
    k = torch.randn(n, D, generator=g, dtype=torch.float64) @ torch.randn(D, D, generator=g, dtype=torch.float64)
    cq, ck = q.T @ q / n, k.T @ k / n
    wq, wk = PR.fit_low_rank(cq, ck, rank, scale)
    assert wq.shape == wk.shape == (D, rank)

    def err(a, b):
        return float(((q @ a @ b.T @ k.T - scale * q @ k.T) ** 2).mean())

    tail = torch.linalg.svdvals(scale * torch.linalg.cholesky(cq).T @ torch.linalg.cholesky(ck))[rank:]
    e = err(wq, wk)
    assert e == pytest.approx(float((tail ** 2).sum()), rel=1e-6, abs=1e-12)
    for _ in range(3):
        d = 1e-3 * torch.randn(wq.shape, generator=g, dtype=torch.float64)
        assert err(wq + d, wk) > e and err(wq, wk + d) > e
    if rank == D:
        torch.testing.assert_close(wq @ wk.T, scale * torch.eye(D, dtype=torch.float64), rtol=0, atol=1e-9)


def test_end_to_end_on_the_cpu(tmp_path):
    """A tiny DSV run's checkpoint: densities per head for exact lists, the trained predictors and
    each fitted rank, each in (0, 1], rising with the target, the exact lists the sparsest."""
    from dsv_ext.app.train import load_config, train
    from test_train import micro_dict

    d = micro_dict(steps=4, val_videos=1)
    d["data"].update(frames=4, height=16, width=16)  # 4 x 8 x 8 = 256 tokens
    ck = tmp_path / "run"
    train(load_config(base=d), out_dir=str(ck), attention="dsv", device="cpu", progress=False)
    out = tmp_path / "pr"
    assert PR.main(["--checkpoint", str(ck / "ckpt_last.pt"), "--timesteps", "0.3", "0.7", "--ranks", "2", "8",
                    "--group", "32", "--rows", "64", "--targets", "0.8", "0.95", "--cube", "2", "4", "4",
                    "--out", str(out)]) == 0
    res = json.load(open(out / "predictor_rank.json"))
    dens = res["densities"]
    assert set(dens) == {"exact", "trained r=4", "fit r=2", "fit r=8"}
    assert len(res["heads"]) == 4  # 2 blocks x 2 heads
    for m, per in dens.items():
        lo, hi = per["0.8"], per["0.95"]
        assert len(lo) == len(hi) == 4
        assert all(0 < a <= b <= 1 for a, b in zip(lo, hi)), m
        if m != "exact":  # a predictor's lists cover at most what the exact ones do (16-key steps)
            assert all(e <= x + 16 / 256 for e, x in zip(dens["exact"]["0.95"], hi)), m
    assert "| head | exact | trained r=4 | fit r=2 | fit r=8 |" in (out / "predictor_rank.md").read_text()
    # out of sample: fitted on the timestep 0.3 captures, measured on those at 0.7 only
    out2 = tmp_path / "pr2"
    args = ["--checkpoint", str(ck / "ckpt_last.pt"), "--timesteps", "0.3", "0.7", "--ranks", "8", "--group", "32",
            "--rows", "64", "--cube", "2", "4", "4", "--out", str(out2)]
    assert PR.main(args + ["--fit-timesteps", "0.3"]) == 0
    res2 = json.load(open(out2 / "predictor_rank.json"))
    assert res2["fit_timesteps"] == [0.3] and len(res2["heads"]) == 4
    assert "out of sample" in (out2 / "predictor_rank.md").read_text()
    assert res2["densities"]["trained r=4"] != dens["trained r=4"]  # the 0.7 captures alone
    for bad in (["0.3", "0.7"], ["0.5"]):
        with pytest.raises(SystemExit):
            PR.main(args + ["--fit-timesteps", *bad])
