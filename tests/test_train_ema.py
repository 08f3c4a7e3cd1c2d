"""CPU tests of the learning-rate schedule and the weight average (train.lr_schedule,
train.ema_decay): the numbers, exact resume, and that validation, sampling and the paired
evaluation use the averaged weights."""
import math

import pytest
import torch

from dsv_ext.train import TrainConfig, WeightEMA, _lr_at, inference_state_dict, train
from test_train import micro_config


def test_cosine_schedule_values():
    c = TrainConfig(steps=101, warmup_steps=10, lr=2.0, lr_schedule="cosine", lr_min_ratio=0.1)
    assert _lr_at(0, c) == pytest.approx(0.2) and _lr_at(9, c) == pytest.approx(2.0)
    assert _lr_at(10, c) == pytest.approx(2.0)
    mid = 10 + 45  # halfway through the 90 decay steps: the mean of lr and the floor
    assert _lr_at(mid, c) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert _lr_at(100, c) == pytest.approx(0.2)
    lrs = [_lr_at(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay
    const = TrainConfig(steps=101, warmup_steps=10, lr=2.0)
    assert _lr_at(100, const) == 2.0


@pytest.mark.parametrize("kw, msg", [({"lr_schedule": "linear"}, "train.lr_schedule"),
                                     ({"lr_min_ratio": 1.5}, "train.lr_min_ratio"),
                                     ({"ema_decay": 1.0}, "train.ema_decay"),
                                     ({"ema_decay": -0.1}, "train.ema_decay"),
                                     ({"ema_decay": "x"}, "train.ema_decay")])
def test_bad_values_name_the_key(kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        TrainConfig(**kw)


def test_weight_ema_matches_the_formula_and_swaps_back():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    ema = WeightEMA(m, list(m.parameters()), decay=0.9)
    ref = [p.detach().double().clone() for p in m.parameters()]
    for n in range(5):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        d = min(0.9, (1 + n) / (10 + n))
        ref = [d * r + (1 - d) * p.detach().double() for r, p in zip(ref, m.parameters())]
    for s, r in zip(ema.shadow, ref):
        torch.testing.assert_close(s.double(), r, rtol=1e-6, atol=1e-6)
    live = [p.detach().clone() for p in m.parameters()]
    with ema.applied():
        for p, s in zip(m.parameters(), ema.shadow):
            assert torch.equal(p.detach(), s)
    for p, l in zip(m.parameters(), live):  # bit-exact restore
        assert torch.equal(p.detach(), l)


def test_validation_uses_the_average_and_resume_is_exact(tmp_path):
    kw = dict(ema_decay=0.8, lr_schedule="cosine", val_every=3)
    full = train(micro_config(**kw), out_dir=str(tmp_path / "full"), attention="dense",
                 device="cpu", progress=False)
    assert full["summary"]["val_weights"] == "ema"
    train(micro_config(**{**kw, "steps": 3}), out_dir=str(tmp_path / "part"), attention="dense",
          device="cpu", progress=False)
    res = train(micro_config(**kw), out_dir=str(tmp_path / "part"), attention="dense",
                device="cpu", progress=False, resume=str(tmp_path / "part" / "ckpt_last.pt"))
    assert res["summary"]["final_val_loss"] == full["summary"]["final_val_loss"]
    ck = torch.load(tmp_path / "full" / "ckpt_last.pt", weights_only=False)
    cb = torch.load(tmp_path / "part" / "ckpt_last.pt", weights_only=False)
    assert ck["ema"]["count"] == cb["ema"]["count"] == 6
    for n, t in ck["ema"]["params"].items():
        assert torch.equal(t, cb["ema"]["params"][n]), n
        assert not torch.equal(t, ck["model"][n].float()), n  # an average, not the live weights
    # the checkpoint's inference weights are the averages; without an average, the live ones
    sd = inference_state_dict(ck)
    assert all(torch.equal(sd[n].float(), t) for n, t in ck["ema"]["params"].items())
    assert inference_state_dict({**ck, "ema": None}) is not ck["model"]
    assert all(torch.equal(a, ck["model"][n]) for n, a in inference_state_dict({**ck, "ema": None}).items())
    # validating the averaged weights by hand gives the logged number
    from dsv_ext.train import _ValSet, TrainConfig as TC, build_model, validation_loss

    cfg = micro_config(**kw)
    model, _ = build_model(cfg, "dense", torch.device("cpu"))
    model.load_state_dict(sd)
    v = validation_loss(model, _ValSet(cfg, TC.from_dict(cfg["train"])), torch.device("cpu"), "fp32")
    assert math.isclose(v, full["summary"]["final_val_loss"], rel_tol=1e-6)


def test_resume_without_an_average_starts_it_from_the_resumed_weights(tmp_path, capsys):
    train(micro_config(steps=3), out_dir=str(tmp_path), attention="dense", device="cpu", progress=False)
    res = train(micro_config(ema_decay=0.9), out_dir=str(tmp_path), attention="dense", device="cpu",
                progress=False, resume=str(tmp_path / "ckpt_last.pt"))
    assert res["summary"]["val_weights"] == "ema"
    assert "holds no weight average" in capsys.readouterr().err
