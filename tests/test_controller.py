"""DSVController (training, profiling, switching, checkpoints), the op dispatcher and DSVConfig."""
import json
import math
import os

import pytest
import torch

from dsv_ext import reference as ref
from dsv_ext.modules.attention import DSVAttention, SparseAttention
from dsv_ext.config import DSVConfig
from dsv_ext.control.controller import DSVController
from dsv_ext.control.dispatch import Dispatcher
from dsv_ext.grouping import cube_permutation

GRID = (2, 4, 6)
S, DIM, H = 48, 32, 2


class Tiny(torch.nn.Module):
    def __init__(self, cfg, depth=2, checkpointing=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(DSVAttention(DIM, H, grid=GRID, config=cfg, qk_norm=True)
                                          for _ in range(depth))
        self.checkpointing = checkpointing

    def forward(self, x):
        for b in self.blocks:
            if self.checkpointing:
                x = x + torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = x + b(x)
        return x


def _cfg(**kw):
    base = dict(group_size=8, k_multiple=8, row_sample_stride=4, profile_every=2, switch_check_every=1,
                loss_ema_alpha=0.0, predictor_lr=3e-2, switch_loss=0.0, use_calibration=False)
    base.update(kw)
    return DSVConfig(**base)


def _x(seed=1, batch=2):
    return torch.randn(batch, S, DIM, generator=torch.Generator().manual_seed(seed))


def _train(model, ctl, opt, steps, x):
    outs = []
    for _ in range(steps):
        y = model(x)
        loss = y.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctl.step()
        outs.append(y.detach())
    return outs


def test_controller_trains_predictors_loss_falls():
    cfg = _cfg()
    model = Tiny(cfg)
    ctl = DSVController(model)
    assert [n for n, _ in ctl.modules] == ["blocks.0.attn_core", "blocks.1.attn_core"]
    x = _x()
    losses = []  # the model's weights stay fixed: only the predictors learn
    for _ in range(10):
        model(x)
        ctl.step()
        losses.append(ctl.mean_loss())
    assert ctl.stage == 1
    assert losses[-1] < 0.5 * losses[0], losses
    # the DiT parameters were not touched by the controller, the predictors were
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("cast", ["bf16", "half", "double"])
def test_predictors_stay_fp32_when_the_model_is_cast(cast):
    """Casting the model to 16 bits keeps the predictor weights float32 (bf16 weights would round
    away the controller's small updates; float64 is kept); the predictors train on the model."""
    cfg = _cfg(predictor_lr=1e-2)
    model = Tiny(cfg)
    model = {"bf16": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half(),
             "double": lambda m: m.double()}[cast](model)
    cores = [b.attn_core for b in model.blocks]
    want = torch.float64 if cast == "double" else torch.float32
    assert all(c.predictor.wq.dtype == want and c.predictor.wk.dtype == want for c in cores)
    assert model.blocks[0].qkv.weight.dtype != torch.float32  # the model itself was cast
    ctl = DSVController(model)
    x = _x().to(model.blocks[0].qkv.weight.dtype)
    w0 = cores[0].predictor.wq.detach().clone()
    losses = []
    for _ in range(10):
        model(x)
        ctl.step()
        losses.append(ctl.mean_loss())
    assert cores[0].predictor.wq.dtype == want
    assert not torch.equal(cores[0].predictor.wq, w0)
    assert losses[-1] < 0.7 * losses[0], losses


def test_profiler_reports_sparsity_and_ema():
    cfg = _cfg(ema_alpha=0.9, profile_every=3)
    model = Tiny(cfg, depth=1)
    ctl = DSVController(model)
    seen = []
    h = model.blocks[0].attn_core.register_forward_pre_hook(lambda m, a: seen.append((a[0].detach(), a[1].detach())))
    x = _x()
    model(x)
    ctl.step()  # step 0: profiled (schedule: 0, 3, 6, ...)
    q, k = seen[-1]
    rows = torch.arange(0, S, 4)  # offset (0 * 7) % 4; positions of the cube-ordered queries
    perm, _ = cube_permutation(GRID, cfg.cube, S)
    s0 = ref.profile_ref(q[:, perm], k, rows, 0.9).sparsity.mean(0)
    torch.testing.assert_close(torch.tensor(ctl.sparsity_ema[0], dtype=torch.float64), s0, rtol=1e-5, atol=1e-6)
    assert 0.0 < ctl.mean_sparsity() < 1.0
    for _ in range(2):  # steps 1, 2: not profiled
        model(x)
        ctl.step()
    assert torch.allclose(torch.tensor(ctl.sparsity_ema[0], dtype=torch.float64), s0, atol=1e-6)
    model(x)
    ctl.step()  # step 3: profiled, rows offset (3 * 7) % 4 = 1
    q, k = seen[-1]
    # with a sparsity estimate the profile also measures recall, on the cube-ordered queries
    perm, _ = cube_permutation(GRID, cfg.cube, S)
    s3 = ref.profile_ref(q[:, perm], k, torch.arange(1, S, 4), 0.9).sparsity.mean(0)
    torch.testing.assert_close(torch.tensor(ctl.sparsity_ema[0], dtype=torch.float64), 0.9 * s0 + 0.1 * s3,
                               rtol=1e-5, atol=1e-6)
    assert "dsv/recall" in ctl.summary()  # measured once an estimate existed
    h.remove()


def test_switch_forced_by_config_and_sparse_dispatch():
    cfg = _cfg(force_stage2_step=3, dispatch_threshold=0.0, profile_every=100, k_rule="theta")
    model = Tiny(cfg)
    ctl = DSVController(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = _x()
    _train(model, ctl, opt, 2, x)
    assert ctl.stage == 1
    _train(model, ctl, opt, 1, x)
    assert ctl.stage == 2 and ctl.switch_step == 3
    assert all(m.stage == 2 and m.use_sparse for _, m in ctl.modules)
    assert ctl.optimizer.param_groups[0]["lr"] == cfg.finetune_lr
    # the sparse path is really taken: the output equals a dense model's only at K = S
    core = ctl.modules[0][1]
    assert 0 < core.kmax < S and core.kv_count.tolist() == core.head_k
    y_sparse = model(x)
    core.use_sparse = False
    assert not torch.allclose(model(x), y_sparse)
    core.use_sparse = True
    s = ctl.summary()
    assert s["dsv/stage"] == 2 and s["dsv/sparse_blocks"] == 2
    ctl.set_sparsity([0.5, [0.9, 0.95]], force_sparse=True)
    assert ctl.modules[0][1].head_k == [24] * 2 and ctl.modules[1][1].head_k == [8, 8]
    assert all(m.use_sparse for _, m in ctl.modules)
    with pytest.raises(ValueError, match="^sparsity"):
        ctl.set_sparsity([0.5])
    bs = ctl.block_stats()
    assert [b["name"] for b in bs] == [n for n, _ in ctl.modules]
    assert all(b["use_sparse"] and b["head_k"] == m.head_k and b["loss"] > 0 for b, (_, m) in zip(bs, ctl.modules))


def test_switch_on_loss_criterion_and_threshold_dispatch():
    cfg = _cfg(switch_loss=0.2, switch_check_every=1, dispatch_threshold=0.99)
    model = Tiny(cfg)
    ctl = DSVController(model)
    x = _x()
    switched_at = None
    for i in range(60):
        model(x)
        before = ctl.mean_loss()
        ctl.step()
        if ctl.stage == 2:
            switched_at = i
            break
    assert switched_at is not None
    assert ctl.mean_loss(sync=False) < 0.2  # the loss that triggered the switch
    # threshold 0.99 > measured sparsity: the dispatcher keeps every block dense
    assert all(m.stage == 2 and not m.use_sparse for _, m in ctl.modules)
    # never switches when the criterion cannot hold
    cfg2 = _cfg(switch_loss=0.0)
    model2 = Tiny(cfg2)
    ctl2 = DSVController(model2)
    for _ in range(5):
        model2(x)
        ctl2.step()
    assert ctl2.stage == 1


@pytest.mark.parametrize("threshold", [0.0, 0.99])
def test_switch_when_the_dispatcher_would_run_a_block_sparse(threshold):
    """switch_rule "dispatch": stage 2 begins at the first check step at which the dispatcher,
    at the K's the recall rule measured, runs some block sparse; never while every head needs
    more than recall_max_density of the keys (lists of about half the keys against a cap of
    0.4), whatever the predictor loss (switch_loss 10 would switch at once), nor while the
    dispatcher keeps every block dense (threshold 0.99)."""
    from dataclasses import replace

    cfg = _cfg(switch_rule="dispatch", switch_loss=10.0, dispatch_threshold=threshold, recall_target=0.6,
               recall_max_density=0.4, profile_every=1)
    model = Tiny(cfg)
    ctl = DSVController(model)
    x = _x()
    for _ in range(6):
        model(x)
        ctl.step()
        assert ctl.stage == 1 and ctl.mean_loss() < 10.0
        assert all(m.head_k == [S] * H for _, m in ctl.modules)  # every head on all keys
    # the same lists under a cap of 0.6: some heads run on part of the keys
    ctl.config = replace(ctl.config, recall_max_density=0.6)
    for _, m in ctl.modules:
        m.config = ctl.config
    model(x)
    ctl.step()
    if threshold == 0.0:
        assert ctl.stage == 2 and ctl.switch_step == 7
        assert any(m.use_sparse and min(m.head_k) < S for _, m in ctl.modules)
    else:
        assert ctl.stage == 1 and any(min(m.head_k) < S for _, m in ctl.modules)


def test_switch_rule_config():
    assert DSVConfig().switch_rule == "loss"
    for bad in ("Loss", "recall", None, 1):
        with pytest.raises(ValueError, match=r"^switch_rule: expected 'loss' or 'dispatch'"):
            DSVConfig(switch_rule=bad)
    with pytest.raises(ValueError, match=r"^switch_rule: 'dispatch' .* needs k_rule='recall'"):
        DSVConfig(switch_rule="dispatch", k_rule="theta")


def test_stage2_training_schedule_and_profile_rate():
    cfg = _cfg(force_stage2_step=1, train_every_stage2=3, profile_every=2, dispatch_threshold=0.0)
    model = Tiny(cfg, depth=1)
    ctl = DSVController(model)
    core = ctl.modules[0][1]
    x = _x()
    model(x)
    ctl.step()
    assert ctl.stage == 2
    armed = []
    for _ in range(6):
        armed.append((ctl.step_count, core.plan.train, core.plan.profile))
        model(x)
        ctl.step()
    assert armed == [(s, s % 3 == 0, s % 2 == 0) for s in range(1, 7)]


def test_checkpointed_model_trains_predictor_once_per_forward():
    cfg = _cfg()
    model = Tiny(cfg, checkpointing=True)
    ctl = DSVController(model)
    calls = []
    for _, m in ctl.modules:
        m.register_forward_hook(lambda mod, a, o: calls.append(mod.peek_stats().trained))
    y = model(_x())
    y.square().mean().backward()  # recomputes each block's forward
    assert len(calls) == 4 and max(calls) == 1
    ctl.step()


@pytest.mark.parametrize("checkpoint_stage", [1, 2])
def test_checkpoint_round_trip_resumes_identically(tmp_path, checkpoint_stage):
    cfg = _cfg(force_stage2_step=4, dispatch_threshold=0.0, train_every_stage2=2, profile_every=3)
    # B*H >= CPU threads: the CPU sparse backward then splits work by (batch, head), which is
    # deterministic (with fewer pairs than threads it spreads groups over threads dynamically and
    # sums per-thread dK/dV buffers, so the last bits vary from run to run)
    x = _x(batch=max(2, -(-(os.cpu_count() or 1) // H)))

    def make(seed):
        model = Tiny(cfg, seed=seed)
        ctl = DSVController(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        return model, ctl, opt

    model, ctl, opt = make(0)
    _train(model, ctl, opt, 2 if checkpoint_stage == 1 else 5, x)
    assert ctl.stage == checkpoint_stage
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "dsv": ctl.state_dict()}, path)
    ref_outs = _train(model, ctl, opt, 4, x)
    ref_sum = ctl.summary()
    ref_pred = [m.predictor.wq.detach().clone() for _, m in ctl.modules]

    model2, ctl2, opt2 = make(123)  # different init: everything must come from the checkpoint
    sd = torch.load(path, weights_only=False)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    ctl2.load_state_dict(sd["dsv"])
    assert ctl2.stage == checkpoint_stage and ctl2.step_count == sd["dsv"]["step"]
    outs = _train(model2, ctl2, opt2, 4, x)
    for a, b in zip(outs, ref_outs):
        assert torch.equal(a, b)
    assert ctl2.summary() == ref_sum
    for (_, m), w in zip(ctl2.modules, ref_pred):
        assert torch.equal(m.predictor.wq, w)


def test_controller_errors():
    with pytest.raises(ValueError, match="^model"):
        DSVController(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="^config"):
        DSVController(Tiny(_cfg()), config=3)
    ctl = DSVController(Tiny(_cfg(), depth=1))
    sd = ctl.state_dict()
    sd["names"] = ["other"]
    with pytest.raises(ValueError, match="^state_dict"):
        DSVController(Tiny(_cfg())).load_state_dict(sd)


# ------------------------------------------------------------------------------------------------
# dispatcher

def _table(device="cpu"):
    # dense ~ S^2; sparse ~ density * S^2 / 4 + 0.3 * dense (fixed cost): pays from density < 0.7
    es = []
    for S_ in (1024, 4096):
        d = S_ * S_ / 1e6
        es.append({"device": device, "dtype": "float32", "heads": 2, "head_dim": 16, "group_size": 8,
                   "seq_len": S_, "dense_ms": d,
                   "sparse_ms": {str(s): (1 - s) * d + 0.3 * d for s in (0.5, 0.8, 0.9, 0.95)}})
    return {"version": 1, "entries": es}


def test_dispatcher_cost_model_and_threshold(tmp_path):
    cfg = _cfg(use_calibration=True, calibration_path=str(tmp_path / "cal.json"), dispatch_margin=0.0)
    d = Dispatcher(cfg, table=_table())
    p = d.predict_ms(2048, 4, 16, 0.1, "cpu", torch.float32)
    dense = 2048 ** 2 / 1e6 * 2  # per-head time x 4 heads
    assert math.isclose(p["dense"], dense, rel_tol=1e-9)
    assert math.isclose(p["sparse"], dense * 0.4, rel_tol=1e-9)
    assert d.has_entry("cpu", torch.float32, 2, 16, 1024) and not d.has_entry("cpu", torch.float32, 2, 16, 2048)
    assert d.decide([0.9, 0.9], 2048, 2, 16, "cpu", torch.float32)          # 0.4 x dense
    assert not d.decide([0.2, 0.2], 2048, 2, 16, "cpu", torch.float32)      # 1.1 x dense
    # per-head K / S (the recall rule): each head at its own density, a head at K = S at the dense
    # time (it runs dense): (0.8 + 1.0) / 2 = 0.9 x dense pays; costed at the mean density 0.75
    # it would not (1.05 x); (1.1 + 1.0) / 2 does not
    assert d.decide([0.5, 0.0], 2048, 2, 16, "cpu", torch.float32, density=[0.5, 1.0])
    assert not d.decide([0.2, 0.0], 2048, 2, 16, "cpu", torch.float32, density=[0.8, 1.0])
    assert not d.decide([0.0, 0.0], 2048, 2, 16, "cpu", torch.float32, density=[1.0, 1.0])
    b = d.block_ms([0.5, 1.0], 2048, 2, 16, "cpu", torch.float32)
    assert math.isclose(b["dense"], 2048 ** 2 / 1e6, rel_tol=1e-9)
    assert math.isclose(b["sparse"], 0.9 * b["dense"], rel_tol=1e-9)
    assert d.block_ms([0.5, 1.0], 2048, 2, 16, "cpu", torch.bfloat16) is None  # no entry
    # the same per head from the sparsities alone (theta rule, set_sparsity): head_k gives K = S
    # for the head at sparsity 0, which runs dense, so the block pays as above
    assert d.decide([0.5, 0.0], 2048, 2, 16, "cpu", torch.float32)
    assert not d.decide([0.2, 0.0], 2048, 2, 16, "cpu", torch.float32)
    # save / load through JSON
    d.save()
    d2 = Dispatcher(cfg)
    assert d2.table == json.loads(json.dumps(_table()))
    # no entry for this dtype -> threshold rule (0.8)
    assert d.predict_ms(2048, 2, 16, 0.1, "cpu", torch.bfloat16) is None
    assert d.decide([0.85, 0.8], 2048, 2, 16, "cpu", torch.bfloat16)
    assert not d.decide([0.85, 0.7], 2048, 2, 16, "cpu", torch.bfloat16)
    # missing / corrupt file -> no table
    (tmp_path / "bad.json").write_text("{not json")
    assert Dispatcher(_cfg(use_calibration=True, calibration_path=str(tmp_path / "bad.json"))).table is None
    assert Dispatcher.load(str(tmp_path / "missing.json")) is None


def test_pinned_mixed_block_runs_sparse_where_its_heads_pay(tmp_path):
    """set_sparsity (the theta rule) with one head at sparsity 0 (K = S: it runs dense) and one at
    0.5: the calibrated dispatcher prices the block per head ((0.8 + 1.0) / 2 of dense in the
    table), so the block runs sparse; priced at the mean density 0.75 it would have stayed dense.
    A block whose sparse head does not pay stays dense."""
    (tmp_path / "cal.json").write_text(json.dumps(_table()))
    cfg = _cfg(use_calibration=True, calibration_path=str(tmp_path / "cal.json"), dispatch_margin=0.0,
               force_stage2_step=1, profile_every=100, k_rule="theta")
    model = Tiny(cfg)
    ctl = DSVController(model)
    _train(model, ctl, torch.optim.AdamW(model.parameters(), lr=1e-3), 1, _x())
    assert ctl.stage == 2
    ctl.set_sparsity([[0.5, 0.0], [0.2, 0.0]])
    (_, m0), (_, m1) = ctl.modules
    assert m0.head_k == [S // 2, S] and m1.head_k == [40, S]
    assert [b["use_sparse"] for b in ctl.block_stats()] == [True, False]


def test_dispatcher_uses_entries_of_its_group_size():
    """Entries measured with the config's group size win; else the nearest group size measured."""
    t = _table()
    slow = json.loads(json.dumps(t))
    for e in slow["entries"]:
        e["group_size"] = 32
        e["sparse_ms"] = {k: 10 * v for k, v in e["sparse_ms"].items()}  # G = 32 ten times slower
    both = {"version": 1, "entries": t["entries"] + slow["entries"]}
    fast = Dispatcher(_cfg(use_calibration=True, group_size=8, dispatch_margin=0.0), table=both)
    slow_d = Dispatcher(_cfg(use_calibration=True, group_size=32, dispatch_margin=0.0), table=both)
    near = Dispatcher(_cfg(use_calibration=True, group_size=16, dispatch_margin=0.0), table=both)
    args = (2048, 4, 16, 0.1, "cpu", torch.float32)
    assert math.isclose(slow_d.predict_ms(*args)["sparse"], 10 * fast.predict_ms(*args)["sparse"], rel_tol=1e-9)
    assert near.predict_ms(*args)["sparse"] == fast.predict_ms(*args)["sparse"]  # 16: nearest tie -> 8
    assert fast.decide([0.9, 0.9], 2048, 2, 16, "cpu", torch.float32)
    assert not slow_d.decide([0.9, 0.9], 2048, 2, 16, "cpu", torch.float32)


def test_builtin_h200_table_is_used_where_the_user_has_none(tmp_path, monkeypatch):
    """With no user table, an H200 gets the shipped table (G-aware); other devices fall back to
    the threshold rule; the user's measurements for a device take precedence and calibrate()
    writes only them."""
    import dsv_ext.control.dispatch as dd
    assert dd.builtin_table() is not None
    cfg64 = _cfg(use_calibration=True, calibration_path=str(tmp_path / "none.json"), group_size=64,
                 k_multiple=64, dispatch_margin=0.0)
    cfg32 = _cfg(use_calibration=True, calibration_path=str(tmp_path / "none.json"), group_size=32,
                 k_multiple=64, dispatch_margin=0.0)
    d64, d32 = Dispatcher(cfg64), Dispatcher(cfg32)
    assert d64.table is None and d64.builtin is not None
    assert d64.predict_ms(65536, 16, 128, 0.1, "cpu", torch.bfloat16) is None  # no cpu entries
    monkeypatch.setattr(dd, "_device_name", lambda device: "NVIDIA H200")
    p64 = d64.predict_ms(65536, 16, 128, 0.1, "cuda", torch.bfloat16)
    p32 = d32.predict_ms(65536, 16, 128, 0.1, "cuda", torch.bfloat16)
    assert p64["sparse"] < p64["dense"] and p32["sparse"] > 1.5 * p64["sparse"]
    assert d64.decide([0.85] * 16, 65536, 16, 128, "cuda", torch.bfloat16)      # pays with G = 64
    assert not d32.decide([0.8] * 16, 65536, 16, 128, "cuda", torch.bfloat16)   # not with G = 32
    # the user's own entries for the device win
    user = {"version": 1, "entries": [dict(e, dense_ms=1e-3) for e in dd.builtin_table()["entries"]]}
    (tmp_path / "user.json").write_text(json.dumps(user))
    du = Dispatcher(_cfg(use_calibration=True, calibration_path=str(tmp_path / "user.json"), group_size=64,
                         k_multiple=64, dispatch_margin=0.0))
    assert not du.decide([0.95] * 16, 65536, 16, 128, "cuda", torch.bfloat16)
    # an explicit table disables the shipped one; use_calibration=False disables both
    assert Dispatcher(cfg64, table={"version": 1, "entries": []}).builtin is None
    assert Dispatcher(_cfg(use_calibration=False)).builtin is None


def test_dispatcher_calibrate_on_cpu(tmp_path):
    """Calibration times backward passes; the controller calls it from step(), under no_grad."""
    cfg = _cfg(use_calibration=True, calibration_path=str(tmp_path / "c.json"))
    with torch.no_grad():
        t = Dispatcher(cfg, table=None).calibrate("cpu", seq_lens=(64,), sparsities=(0.5, 0.9), heads=2,
                                                  head_dim=16, dtype=torch.float32, repeats=1)
    (e,) = t["entries"]
    assert e["seq_len"] == 64 and set(e["sparse_ms"]) == {"0.5", "0.9"} and e["dense_ms"] > 0
    assert json.loads((tmp_path / "c.json").read_text()) == t


def test_calibration_cli_keeps_other_group_sizes(tmp_path, capsys):
    """python -m dsv_ext.control.dispatch measures one group size and merges it into the table file:
    a second group size adds entries instead of replacing the first one's."""
    from dsv_ext.control.dispatch import main
    path = str(tmp_path / "cal.json")
    args = ["--device", "cpu", "--seq-lens", "64", "--sparsities", "0.5", "0.9", "--heads", "2",
            "--head-dim", "16", "--repeats", "1", "--out", path]
    assert main(args + ["--group-size", "8"]) == 0
    assert main(args + ["--group-size", "16"]) == 0
    es = json.loads(open(path).read())["entries"]
    assert sorted(e["group_size"] for e in es) == [8, 16]
    out = capsys.readouterr().out
    assert "S=64: dense" in out and ("sparse pays from" in out or "sparse never pays" in out)
    for bad, name in ((["--seq-lens", "0"], "--seq-lens"), (["--sparsities", "1.0"], "--sparsities"),
                      (["--device", "nonsense"], "--device")):
        with pytest.raises(SystemExit):
            main(["--device", "cpu", "--out", path] + bad)
        assert name in capsys.readouterr().err
    d16 = Dispatcher(_cfg(use_calibration=True, group_size=16, calibration_path=path))
    assert d16.has_entry("cpu", torch.float32, 2, 16, 64)
    assert not Dispatcher(_cfg(use_calibration=True, group_size=32, calibration_path=path)).has_entry(
        "cpu", torch.float32, 2, 16, 64)


# ------------------------------------------------------------------------------------------------
# config

def test_config_yaml_defaults_and_rules(tmp_path):
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    assert DSVConfig.from_yaml(str(root / "configs" / "dsv_default.yaml")) == DSVConfig()
    c = DSVConfig()
    assert (c.rank, c.theta, c.ema_alpha, c.switch_loss, c.row_sample_stride, c.min_density, c.k_multiple,
            c.dispatch_threshold, c.cube, c.group_size, c.predictor_lr) == \
        (16, 0.9, 0.9, 0.01, 16, 0.02, 64, 0.8, (4, 4, 4), 128, 1e-4)
    assert [s for s in range(0, 2301) if c.profile_due(s)] == list(range(0, 2000, 25)) + [2000, 2100, 2200, 2300]
    # K = max(ceil((1 - s) S), 0.02 S) rounded up to 64, capped at S
    assert c.head_k(0.9, 4096) == 448 and c.head_k(0.999, 4096) == 128 and c.head_k(0.0, 100) == 100
    p = tmp_path / "x.yaml"
    p.write_text("dsv:\n  rank: 8\n  cube: [1, 2, 2]\n  force_stage2_step: 10\n")
    c2 = DSVConfig.from_yaml(str(p))
    assert (c2.rank, c2.cube, c2.force_stage2_step) == (8, (1, 2, 2), 10)
    assert DSVConfig.from_dict(c2.to_dict()) == c2
    p.write_text("rankk: 8\n")
    with pytest.raises(ValueError, match="rankk"):
        DSVConfig.from_yaml(str(p))
    with pytest.raises(ValueError, match="^theta"):
        DSVConfig(theta=1.5)
    with pytest.raises(ValueError, match="^group_size"):
        DSVConfig(group_size=0)


# ------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA or without the CUDA kernels)

import dsv_ext  # noqa: E402

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dsv_ext.has_cuda_kernels()),
                                reason="needs a GPU and the CUDA kernels")


@needs_cuda
def test_cuda_controller_trains_switches_and_dispatches():
    cfg = DSVConfig(force_stage2_step=6, dispatch_threshold=0.0, use_calibration=False, predictor_lr=3e-3,
                    profile_every=2, k_rule="theta")  # predictors trained 6 steps: the theta rule's K < S
    torch.manual_seed(0)
    grid = (4, 8, 8)
    model = torch.nn.Sequential(*[DSVAttention(256, 2, grid=grid, config=cfg, qk_norm=True) for _ in range(2)]).cuda()
    ctl = DSVController(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(2, 256, 256, device="cuda")
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
        losses.append(ctl.mean_loss())
    assert losses[5] < 0.95 * losses[0]
    assert ctl.stage == 2 and all(m.use_sparse for _, m in ctl.modules)
    s = ctl.summary()
    assert 0 < s["dsv/sparsity"] < 1 and 0 < s["dsv/recall"] <= 1.0 + 1e-6
    # the memory check keeps blocks dense when the budget is tiny
    ctl.dispatcher.config.memory_fraction = 1e-12
    ctl._update_dispatch()
    assert not any(m.use_sparse for _, m in ctl.modules)


# ------------------------------------------------------------------------------------------------
# review regressions

def test_blocks_with_different_head_counts():
    """Profiled statistics of blocks with different head counts (any `.attn_core` model may mix
    them) are gathered in one transfer without assuming equal shapes."""
    cfg = _cfg(profile_every=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(DSVAttention(DIM, 2, grid=GRID, config=cfg), DSVAttention(DIM, 4, grid=GRID, config=cfg))
    ctl = DSVController(model)
    x = _x()
    for _ in range(3):  # step 0 profiles without an estimate, steps 1-2 also measure recall
        model(x)
        ctl.step()
    assert [len(e) for e in ctl.sparsity_ema] == [2, 4] and [len(r) for r in ctl.recall] == [2, 4]
    assert all(0.0 < s < 1.0 for e in ctl.sparsity_ema for s in e)


def test_load_state_dict_discards_work_from_before_the_load():
    """A forward run before load_state_dict (a warm-up, a smoke test) leaves predictor gradients
    behind; the resumed run must not apply them."""
    cfg = _cfg(force_stage2_step=4, dispatch_threshold=0.0, train_every_stage2=2, profile_every=3)
    x = _x()

    def make(seed):
        model = Tiny(cfg, seed=seed)
        return model, DSVController(model), torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-3)

    model, ctl, opt = make(0)
    _train(model, ctl, opt, 2, x)
    sd = {"model": model.state_dict(), "opt": opt.state_dict(), "dsv": ctl.state_dict()}
    sd = {k: __import__("copy").deepcopy(v) for k, v in sd.items()}
    _train(model, ctl, opt, 1, x)
    model2, ctl2, opt2 = make(1)
    model2(_x(seed=5))  # armed step 0 of the fresh controller: accumulates predictor grads
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    ctl2.load_state_dict(sd["dsv"])
    _train(model2, ctl2, opt2, 1, x)
    for (_, a), (_, b) in zip(ctl.modules, ctl2.modules):
        assert torch.equal(a.predictor.wq, b.predictor.wq) and torch.equal(a.predictor.wk, b.predictor.wk)


def test_controller_config_rank_must_match_the_predictors():
    model = Tiny(_cfg(rank=16), depth=1)
    with pytest.raises(ValueError, match="^config"):
        DSVController(model, config=_cfg(rank=8))
    DSVController(model, config=_cfg(rank=16))


@pytest.mark.parametrize("kw", [dict(cube=(2.5, 4, 4)), dict(cube=5), dict(cube=("a", 4, 4)),
                                dict(predictor_betas=0.9), dict(predictor_betas=("x", 0.999))])
def test_config_sequences_name_the_field(kw):
    """cube=(2.5, 4, 4) used to become (2, 4, 4) silently; non-sequences raised messages that
    did not name the field."""
    with pytest.raises(ValueError, match=f"^{next(iter(kw))}"):
        DSVConfig(**kw)
