"""CPU tests of the training loop (dsv_ext.app.train) and the comparison (dsv_ext.app.compare)."""
import json
import os

import pytest
import torch
import yaml

from dsv_ext.app.models import dsv_attention_available
from dsv_ext.app.train import load_config, main, train

needs_dsv = pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")


def micro_dict(**train_kw):
    """64 tokens (latents 4 x 4 x 8 x 8, patch 1x2x2), 2 blocks of width 32: milliseconds a step
    (the config as a plain dict, as a YAML file would hold it)."""
    cfg = {
        "name": "micro",
        "model": {"hidden": 32, "depth": 2, "heads": 2, "patch": [1, 2, 2]},
        "data": {"source": "procedural", "frames": 4, "height": 8, "width": 8, "channels": 4},
        "train": {"steps": 6, "batch_size": 2, "lr": 1e-3, "warmup_steps": 2, "log_every": 1,
                  "val_every": 0, "val_videos": 2, "val_timesteps": [0.25, 0.75],
                  "precision": "fp32", "seed": 0},
        "dsv": {"rank": 4, "group_size": 32, "cube": [2, 4, 4], "k_multiple": 16,
                "min_density": 0.25, "profile_every": 1, "switch_check_every": 1,
                "force_stage2_step": 3, "dispatch_threshold": 0.0, "predictor_lr": 1e-3,
                # the theta K rule: predictors trained for a few steps reach no recall target
                # below K = S (the recall rule in training: tests/test_quality.py)
                "k_rule": "theta"},
    }
    cfg["train"].update(train_kw)
    return cfg


def micro_config(**train_kw):
    """micro_dict, resolved (defaults filled in)."""
    return load_config(base=micro_dict(**train_kw))


def _read(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def test_short_dense_run(tmp_path):
    res = train(micro_config(), out_dir=str(tmp_path), attention="dense", device="cpu",
                progress=False)
    s = res["summary"]
    assert s["steps"] == 6 and s["attention"] == "dense"
    recs = _read(tmp_path / "metrics.jsonl")
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_recs)
    assert 0.5 < train_recs[0]["loss"] < 4  # velocity target e - x0 has variance ~2
    assert train_recs[0]["tokens_per_s"] > 0
    vals = [r for r in recs if r["kind"] == "val"]
    assert len(vals) == 1 and vals[0]["val_loss"] == s["final_val_loss"]
    for f in ("config.yaml", "ckpt_last.pt", "summary.json"):
        assert os.path.exists(tmp_path / f)
    # The validation loss is deterministic: the same weights give the same number.
    res2 = train(micro_config(steps=6), out_dir=str(tmp_path / "again"), attention="dense",
                 device="cpu", progress=False)
    assert res2["summary"]["final_val_loss"] == s["final_val_loss"]


def test_training_reduces_loss(tmp_path):
    res = train(micro_config(steps=80, log_every=20, lr=3e-3, batch_size=4, warmup_steps=5),
                out_dir=str(tmp_path), attention="dense", device="cpu", progress=False)
    h = res["history"]
    # The zero-initialised model scores E|e - x0|^2 = 2; 80 steps learn part of the structure.
    assert h[-1]["loss"] < 0.96 * h[0]["loss"], [r["loss"] for r in h]
    assert res["summary"]["final_val_loss"] < 1.9


@pytest.mark.parametrize("attention", ["dense", pytest.param("dsv", marks=needs_dsv)])
def test_resume_continues_identically(tmp_path, attention):
    full = train(micro_config(), out_dir=str(tmp_path / "full"), attention=attention,
                 device="cpu", progress=False)
    train(micro_config(steps=3), out_dir=str(tmp_path / "part"), attention=attention,
          device="cpu", progress=False)
    res = train(micro_config(), out_dir=str(tmp_path / "part"), attention=attention,
                device="cpu", progress=False, resume=str(tmp_path / "part" / "ckpt_last.pt"))
    assert res["summary"]["resumed_from"] == 3
    a = [r for r in _read(tmp_path / "full" / "metrics.jsonl") if r["kind"] == "train"]
    b = [r for r in _read(tmp_path / "part" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # the resumed run appends to the log
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    if attention == "dsv":
        assert [r["stage"] for r in b] == [1, 1, 2, 2, 2, 2]
        assert [r["sparsity"] for r in a] == [r["sparsity"] for r in b]
        assert all(blk["sparse"] for blk in b[-1]["blocks"])
    ca = torch.load(tmp_path / "full" / "ckpt_last.pt", weights_only=False)
    cb = torch.load(tmp_path / "part" / "ckpt_last.pt", weights_only=False)
    assert ca["step"] == cb["step"] == 6
    for k, v in ca["model"].items():
        assert torch.equal(v, cb["model"][k]), k
    assert res["summary"]["final_val_loss"] == full["summary"]["final_val_loss"]


@needs_dsv
def test_dsv_run_reaches_stage2_and_reports(tmp_path):
    res = train(micro_config(), out_dir=str(tmp_path), attention="dsv", device="cpu",
                progress=False)
    s = res["summary"]
    assert s["dsv_stage"] == 2 and s["dsv_switch_step"] == 3 and s["stage2_steps"] == 3
    last = res["history"][-1]
    assert 0.0 <= last["sparsity"] <= 1.0 and last["pred_loss"] > 0
    assert len(last["blocks"]) == 2 and all(b["sparse"] for b in last["blocks"])
    assert all(0.0 < b["recall"] <= 1.0 + 1e-6 for b in last["blocks"])
    with pytest.raises(ValueError, match="^resume"):  # a dense checkpoint has no controller
        train(micro_config(steps=1), out_dir=str(tmp_path / "d"), attention="dense",
              device="cpu", progress=False)
        train(micro_config(steps=2), out_dir=str(tmp_path / "d"), attention="dsv", device="cpu",
              progress=False, resume=str(tmp_path / "d" / "ckpt_last.pt"))


@needs_dsv
def test_init_starts_a_new_run_from_trained_weights_on_longer_clips(tmp_path, capsys):
    """--init: the checkpoint's evaluation weights (moving average) and DSV predictors, a fresh
    optimizer, step count and stage; the clips may be longer than the checkpoint's (8 frames
    after 4: twice the tokens, the position embedding follows the shape)."""
    from dsv_ext.app.checkpoint import CheckpointError, load_checkpoint, slim_checkpoint
    from dsv_ext.app.common import build_model, inference_state_dict
    from dsv_ext.app.train import _init_from
    from dsv_ext.control.controller import DSVController

    src = str(tmp_path / "a" / "ckpt_last.pt")
    train(micro_config(ema_decay=0.9), out_dir=str(tmp_path / "a"), attention="dsv", device="cpu",
          progress=False)
    ck = load_checkpoint(src)
    longer = micro_config(steps=4)
    longer["data"]["frames"] = 8
    model, dsv_cfg = build_model(longer, "dsv", torch.device("cpu"))
    assert model.cfg.num_tokens == 128
    ctl = DSVController(model, dsv_cfg)
    _init_from(src, torch.device("cpu"), model, ctl, log=lambda s: None)
    want = inference_state_dict(ck)
    assert any(not torch.equal(want[n], ck["model"][n]) for n in want)  # the average, not the live weights
    for n, t in model.state_dict().items():
        assert torch.equal(t, want[n]), n
    for n, m in ctl.modules:
        for k, t in m.predictor.state_dict().items():
            assert torch.equal(t, ck["controller"]["predictors"][n][k]), (n, k)
    assert ctl.stage == 1 and ctl.step_count == 0
    # the run: 4 steps from step 0 on the longer clips, recorded; resuming ignores --init
    slim = str(tmp_path / "slim.pt")
    slim_checkpoint(src, slim)
    cfgp = tmp_path / "longer.yaml"
    cfgp.write_text(yaml.safe_dump(micro_dict(steps=4)))
    assert main(["--config", str(cfgp), "--out", str(tmp_path / "b"), "--attention", "dsv", "--device", "cpu",
                 "--no-progress", "--init", slim, "--set", "data.frames=8"]) == 0
    err = capsys.readouterr().err
    assert f"init: weights and DSV predictors of {slim} (step 6)" in err
    summ = json.load(open(tmp_path / "b" / "summary.json"))
    assert summ["init_from"] == slim and summ["last_step"] == 4 and summ["resumed_from"] is None
    assert summ["tokens_per_sample"] == 128
    # compare --init: both arms from the same weights
    from dsv_ext.app.compare import main as compare_main

    assert compare_main(["--config", str(cfgp), "--out", str(tmp_path / "cmp"), "--device", "cpu", "--no-progress",
                         "--samples", "0", "--steps", "2", "--init", slim, "--set", "data.frames=8"]) == 0
    assert "same model init (the weights of `slim.pt`)" in open(tmp_path / "cmp" / "compare.md").read()
    for arm in ("dense", "dsv"):
        assert json.load(open(tmp_path / "cmp" / arm / "summary.json"))["init_from"] == slim
    # a model of another width does not fit: one line naming the file
    wide = micro_config()
    wide["model"]["hidden"] = 64
    with pytest.raises(CheckpointError, match=r"^init: .*slim.pt does not fit this model"):
        train(wide, out_dir=str(tmp_path / "c"), attention="dense", device="cpu", progress=False, init=slim)
    # a dense checkpoint: weights only, the predictors start untrained (a note)
    train(micro_config(steps=1), out_dir=str(tmp_path / "d"), attention="dense", device="cpu", progress=False)
    notes = []
    res = train(micro_config(steps=1), out_dir=str(tmp_path / "e"), attention="dsv", device="cpu",
                progress=False, init=str(tmp_path / "d" / "ckpt_last.pt"), log=notes.append)
    assert any("predictors start untrained" in n for n in notes) and res["summary"]["last_step"] == 1


def test_cli_and_overrides(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    cfg = micro_config()
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    rc = main(["--config", str(path), "--steps", "2", "--out", str(tmp_path / "o"),
               "--attention", "dense", "--device", "cpu", "--no-progress",
               "--set", "train.batch_size=1", "--set", "data.mode=pixels"])
    assert rc == 0
    s = json.load(open(tmp_path / "o" / "summary.json"))
    assert s["batch_size"] == 1 and s["steps"] == 2
    assert "final_val_loss" in capsys.readouterr().out
    with pytest.raises(ValueError, match="^--set"):
        load_config(str(path), ["train.lr"])
    with pytest.raises(ValueError, match="^train: unknown keys"):
        train(load_config(str(path), ["train.lrr=1"]), out_dir=str(tmp_path / "x"),
              progress=False)
    # config values of the wrong type or range: one line naming section.key, exit status 2
    for ov, msg in (("train.steps=-1", "train.steps: expected an integer >= 0"),
                    ("train.batch_size=0", "train.batch_size: expected an integer >= 1"),
                    ("train.lr=abc", "train.lr: expected a number"),
                    ("train.precision=fp16", "train.precision: expected one of"),
                    ("train.betas=[0.9]", "train.betas: expected 2 numbers"),
                    ("model.hidden=abc", "model.hidden: expected an integer >= 1"),
                    ("model.patch=[1,2]", "model.patch: expected one or three positive integers"),
                    ("model.qk_norm=3", "model.qk_norm: expected true or false")):
        capsys.readouterr()
        assert main(["--config", str(path), "--out", str(tmp_path / "y"), "--device", "cpu",
                     "--no-progress", "--set", ov]) == 2, ov
        err = capsys.readouterr().err
        assert f"python -m dsv_ext.app.train: error: {msg}" in err and "Traceback" not in err, err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_train_on_npy_folder(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / "videos")
    for i in range(3):
        np.save(tmp_path / "videos" / f"v{i}.npy", rng.integers(0, 256, (5, 40, 40, 3), dtype=np.uint8))
    cfg = micro_config(steps=3)
    cfg["data"] = {"source": "folder", "path": str(tmp_path / "videos"), "frames": 4,
                   "height": 8, "width": 8, "channels": 4, "val_fraction": 0.34}
    res = train(cfg, out_dir=str(tmp_path / "run"), attention="dense", device="cpu",
                progress=False)
    assert res["summary"]["final_val_loss"] > 0 and len(res["history"]) == 3


@needs_dsv
def test_compare_writes_table_and_plot(tmp_path):
    from dsv_ext.app.compare import compare

    res = compare(micro_config(steps=4, log_every=1), str(tmp_path), device="cpu", progress=False)
    md = open(tmp_path / "compare.md").read()
    assert "| validation loss |" in md and "predictor recall" in md and "| block |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the plot is optional; the table is not
        assert not os.path.exists(tmp_path / "compare.png")
    else:
        assert os.path.getsize(tmp_path / "compare.png") > 1000
    assert res["switch_step"] == 3
    assert res["dense"]["final_val_loss"] > 0 and res["dsv"]["final_val_loss"] > 0
    assert json.load(open(tmp_path / "compare.json"))["steps"] == 4
    assert os.path.exists(tmp_path / "dsv" / "metrics.jsonl")
    assert not os.path.exists(tmp_path / "dsv" / "ckpt_last.pt")  # small enough to commit
    # a config that forces blocks sparse by the threshold rule says so under the table
    from dsv_ext.app.compare import write_table
    assert "Dispatch:" not in md
    res["dispatch"] = {"use_calibration": False, "dispatch_threshold": 0.5}
    write_table(res, str(tmp_path / "forced.md"))
    assert "sparsity is at least 0.50" in open(tmp_path / "forced.md").read()


def test_resume_mid_log_window_logs_the_same_means(tmp_path):
    # A checkpoint taken between two train lines (ckpt_every=3, log_every=2): the resumed run's
    # line at step 4 must average steps 3-4 like the uninterrupted run, not step 4 alone.
    kw = dict(steps=6, log_every=2, ckpt_every=3)
    train(micro_config(**kw), out_dir=str(tmp_path / "full"), attention="dense", device="cpu",
          progress=False)
    train(micro_config(**kw), out_dir=str(tmp_path / "res"), attention="dense", device="cpu",
          progress=False, resume=str(tmp_path / "full" / "ckpt_3.pt"))
    a = {r["step"]: r for r in _read(tmp_path / "full" / "metrics.jsonl") if r["kind"] == "train"}
    b = {r["step"]: r for r in _read(tmp_path / "res" / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(b) == [4, 6]
    for s in (4, 6):
        assert b[s]["last_loss"] == a[s]["last_loss"]
        assert b[s]["loss"] == a[s]["loss"], s


@needs_dsv
def test_compare_reports_the_actual_switch_step(tmp_path):
    # log_every=2: the first logged stage-2 line is step 4, but the switch happened at step 3
    from dsv_ext.app.compare import compare

    res = compare(micro_config(steps=4, log_every=2), str(tmp_path), device="cpu", progress=False)
    assert res["dsv"]["dsv_switch_step"] == 3
    assert res["switch_step"] == 3
    assert "stage 2 at step 3." in open(tmp_path / "compare.md").read()


def _cp_train_worker(rank, world, init_file, out_root, result_file, position="sincos"):
    import importlib

    import torch.distributed as dist

    importlib.import_module("torch._dynamo")  # before init_process_group (docs/PARALLEL.md)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = train(_micro_position(position), out_dir=os.path.join(out_root, f"rank{rank}"), attention="dsv",
                    device="cpu", progress=False, context_parallel=True)
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump({"history": res["history"], "summary": res["summary"]}, f)
    finally:
        from dsv_ext.parallel import clear_group_cache

        clear_group_cache()
        dist.destroy_process_group()


def _micro_position(position):
    d = micro_dict(steps=6)
    d["model"]["position"] = position
    return load_config(base=d)


@needs_dsv
@pytest.mark.parametrize("position", ["sincos", "rope"])
def test_context_parallel_training_matches_single_process(tmp_path, position):
    """train(context_parallel=True) on 2 gloo ranks (each sequence split in two) logs the losses,
    stage switch and validation loss of the single-process run; only rank 0 writes files. With
    the rotary embedding each rank turns its shard's tokens by their own positions."""
    import torch.multiprocessing as mp

    ref = train(_micro_position(position), out_dir=str(tmp_path / "single"), attention="dsv", device="cpu",
                progress=False)
    out = tmp_path / "cp"
    result = tmp_path / "cp.json"
    mp.spawn(_cp_train_worker, args=(2, str(tmp_path / "init"), str(out), str(result), position), nprocs=2,
             join=True)
    with open(result) as f:
        got = json.load(f)
    assert got["summary"]["context_parallel_ranks"] == 2
    for a, b in zip(ref["history"], got["history"]):
        assert a["step"] == b["step"] and a["stage"] == b["stage"], (a, b)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (a, b)
    assert got["summary"]["dsv_stage"] == 2 == ref["summary"]["dsv_stage"]
    assert got["summary"]["final_val_loss"] == pytest.approx(ref["summary"]["final_val_loss"], rel=1e-5)
    assert os.path.exists(out / "rank0" / "metrics.jsonl") and not os.path.exists(out / "rank1")


def test_context_parallel_needs_a_process_group(tmp_path, capsys, monkeypatch):
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        train(micro_config(), out_dir=str(tmp_path), attention="dsv", device="cpu", progress=False,
              context_parallel=True)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(micro_config()))
    assert main(["--config", str(cfg), "--context-parallel", "--out", str(tmp_path / "o")]) == 2
    assert "launch with torchrun" in capsys.readouterr().err
