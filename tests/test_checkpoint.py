"""Checkpoints (dsv_ext.app.checkpoint), signals during training, resume with a changed config, and
the commands' handling of bad configs and arguments: every failure is one line, no traceback."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from dsv_ext.app import checkpoint as ckpt_mod
from dsv_ext.app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from dsv_ext.app.train import load_config, main as train_main, train
from test_train import micro_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def micro_cfg(**train_kw):
    """The micro config of test_train (64 tokens, 2 blocks of width 32), 4 steps, as a dict."""
    return micro_dict(**{"steps": 4, **train_kw})


def _state(gen):
    return {"step": 3, "model": {"w": torch.randn(64, 33, generator=gen)},
            "config": {"name": "x", "train": {"lr": 0.1}}, "log": [1.0, None, "a"]}


def _one_line(err: str) -> str:
    """The error line of a command's stderr; asserts there is no traceback."""
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if ": error: " in l]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The file format
# ---------------------------------------------------------------------------------------------

def test_roundtrip_header_and_atomic_write(tmp_path, gen, monkeypatch):
    path = str(tmp_path / "c.pt")
    st = _state(gen)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    digest = save_checkpoint(st, path)
    assert len(synced) == 2  # the file, then its folder
    import zipfile

    comment = zipfile.ZipFile(path).comment  # the checksum trailer is the zip comment
    assert comment.startswith(ckpt_mod.MAGIC) and json.loads(comment[len(ckpt_mod.MAGIC):])["sha256"] == digest
    got = load_checkpoint(path)
    assert torch.equal(got["model"]["w"], st["model"]["w"]) and got["log"] == st["log"]
    plain = torch.load(path, weights_only=True)  # still an ordinary torch.save file
    assert torch.equal(plain["model"]["w"], st["model"]["w"])
    assert verify_checkpoint(path)["verified"] is True
    assert os.listdir(tmp_path) == ["c.pt"]  # no temporary left behind

    # A failure while writing leaves the previous checkpoint intact and no temporary file.
    def boom(a, b):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"step": 9, "model": {}, "config": {}}, path)
    assert os.listdir(tmp_path) == ["c.pt"] and load_checkpoint(path)["step"] == 3


def _flip(data: bytes, offsets) -> bytes:
    b = bytearray(data)
    for o in offsets:
        b[o] ^= 0xFF
    return bytes(b)


@pytest.mark.parametrize("case", ["flip64", "flip1", "flip_first", "flip_trailer", "flip_length", "truncated",
                                  "truncated_tail", "extra_bytes", "empty", "text", "random", "tensor_file",
                                  "other_dict", "missing", "folder"])
def test_every_load_failure_is_one_line_naming_the_file(tmp_path, gen, case):
    good = str(tmp_path / "good.pt")
    save_checkpoint(_state(gen), good)
    data = open(good, "rb").read()
    n = data.rindex(ckpt_mod.MAGIC)  # payload bytes; the trailer follows
    bad = str(tmp_path / f"{case}.pt")
    idx = torch.randperm(n - 2, generator=gen)[:64]
    content = {
        "flip64": lambda: _flip(data, idx.tolist()),
        "flip1": lambda: _flip(data, [int(torch.randint(n - 2, (1,), generator=gen))]),
        "flip_first": lambda: _flip(data, [0]),  # the zip signature: still a checksum mismatch
        "flip_trailer": lambda: _flip(data, [len(data) - 3]),
        "flip_length": lambda: _flip(data, [n - 1]),
        "truncated": lambda: data[:n // 2],
        "truncated_tail": lambda: data[:-5],
        "extra_bytes": lambda: data + b"\0" * 10,
        "empty": lambda: b"",
        "text": lambda: b"model:\n  hidden: 3\n",
        "random": lambda: bytes(torch.randint(256, (4096,), generator=gen, dtype=torch.uint8).tolist()),
    }
    want = {"flip64": "checksum mismatch", "flip1": "checksum mismatch", "flip_first": "checksum mismatch",
            "flip_trailer": "damaged checksum trailer", "flip_length": "damaged checksum trailer",
            "truncated": "truncated or damaged", "truncated_tail": "damaged checksum trailer",
            "extra_bytes": "unexpected bytes", "empty": "empty file", "text": "not a dsv_ext checkpoint",
            "random": "not a dsv_ext checkpoint", "tensor_file": "holds a Tensor",
            "other_dict": "no 'step', 'model', 'config' entry", "missing": "no such file",
            "folder": "is a folder"}[case]
    if case in content:
        with open(bad, "wb") as f:
            f.write(content[case]())
    elif case == "tensor_file":
        save_checkpoint(torch.zeros(3), bad)
    elif case == "other_dict":
        save_checkpoint({"weights": torch.zeros(3)}, bad)
    elif case == "folder":
        os.mkdir(bad)
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(bad)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint: {bad}: ") and want in msg, msg
    # The commands: one line on stderr, exit status 2.
    r = subprocess.run([sys.executable, "-m", "dsv_ext.app.sample", "--checkpoint", bad, "--out",
                        str(tmp_path / "s")], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}) if case in ("flip64", "truncated") else None
    if r is not None:
        assert r.returncode == 2 and want in _one_line(r.stderr), r.stderr


def test_train_resume_from_a_bad_checkpoint_is_one_line(tmp_path, capsys):
    cfgp = tmp_path / "c.yaml"
    cfgp.write_text(yaml.safe_dump(micro_cfg()))
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(b"")
    assert train_main(["--config", str(cfgp), "--out", str(tmp_path / "o"), "--resume", str(bad),
                       "--device", "cpu", "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"error: checkpoint: {bad}: empty file" in line


def test_older_checkpoints_without_header_load_with_a_warning(tmp_path, gen):
    path = str(tmp_path / "old.pt")
    st = _state(gen)
    torch.save(st, path)
    with pytest.warns(UserWarning, match="without a checksum"):
        got = load_checkpoint(path)
    assert torch.equal(got["model"]["w"], st["model"]["w"])
    with open(path, "r+b") as f:  # damaged zip: still one line
        f.seek(200)
        f.write(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path)


def test_checkpoint_command(tmp_path, gen, capsys):
    path = str(tmp_path / "c.pt")
    save_checkpoint(_state(gen), path)
    assert ckpt_mod.main([path]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["ok"] and rec["step"] == 3 and len(rec["checksum"]) == 64
    with open(path, "ab") as f:
        f.write(b"x")
    assert ckpt_mod.main([path]) == 2
    assert "1 unexpected bytes after the checksum trailer" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_slim_copy_samples_as_the_checkpoint(tmp_path, capsys, ema):
    """The weights-only copy: a quarter of the file (bf16, no optimizer), the evaluation weights
    (moving average where kept), the predictors; sampling from it matches the full checkpoint to
    bf16 rounding of the weights, and float32 copies match exactly."""
    from dsv_ext.app.sample import load_for_sampling

    out = str(tmp_path / "run")
    train(load_config(base=micro_cfg(steps=5, ema_decay=ema)), out_dir=out, attention="dsv", progress=False)
    src = os.path.join(out, "ckpt_last.pt")
    dst16, dst32 = str(tmp_path / "slim16.pt"), str(tmp_path / "slim32.pt")
    assert ckpt_mod.main([src, "--slim", dst16]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["step"] == 5 and rec["bytes"] == os.path.getsize(dst16) < 0.5 * rec["source_bytes"]
    ckpt_mod.slim_checkpoint(src, dst32, dtype=None)
    slim = load_checkpoint(dst16)
    assert slim["slim"] and "optimizer" not in slim and slim["controller"] is not None
    assert all(t.dtype == torch.bfloat16 for t in slim["model"].values() if t.is_floating_point())
    x = torch.randn(2, 4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.3, 0.7])
    outs = {}
    for name, path in (("full", src), ("bf16", dst16), ("fp32", dst32)):
        sm = load_for_sampling(path, device="cpu")
        assert sm.step == 5 and sm.controller.stage == 2
        with torch.no_grad():
            outs[name] = sm.model(x, t).double()
    torch.testing.assert_close(outs["fp32"], outs["full"], rtol=0, atol=0)
    # bf16 weights: 8 bits of mantissa (relative 2^-9 per weight) through two blocks
    err = (outs["bf16"] - outs["full"]).abs().max() / outs["full"].abs().max()
    assert 0 < err < 0.05, err
    with pytest.raises(ValueError, match="dtype"):
        ckpt_mod.slim_checkpoint(src, dst16, dtype=torch.int8)
    with pytest.raises(SystemExit):
        ckpt_mod.main([src, src, "--slim", dst16])
    assert "--slim: takes one CKPT, got 2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Signals: finish the step, save, exit 130 / 143; resume continues exactly
# ---------------------------------------------------------------------------------------------

def _start(tmp_path, cfg, out, *extra):
    cfgp = tmp_path / "run.yaml"
    cfgp.write_text(yaml.safe_dump(cfg))
    return subprocess.Popen(
        [sys.executable, "-m", "dsv_ext.app.train", "--config", str(cfgp), "--out", str(out),
         "--device", "cpu", "--no-progress", *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True), str(cfgp)


def _wait_for_steps(out, n, proc, timeout=180.0):
    path = os.path.join(out, "metrics.jsonl")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path):
            with open(path) as f:
                if sum(1 for l in f if l.endswith("\n")) >= n:
                    return
        time.sleep(0.02)
    raise AssertionError("the training run did not start in time")


def _train_losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if r["kind"] == "train"]


def test_sigint_saves_and_resume_continues_exactly(tmp_path):
    out = tmp_path / "run"
    proc, cfgp = _start(tmp_path, micro_cfg(), out, "--steps", "100000")
    _wait_for_steps(str(out), 3, proc)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "SIGINT: stopped after step" in stderr, stderr
    ck = load_checkpoint(out / "ckpt_last.pt")
    k = ck["step"]
    assert 3 <= k < 100000
    summ = json.load(open(out / "summary.json"))
    assert summ["stopped_by"] == "SIGINT" and summ["stopped_at_step"] == k
    assert [s for s, _ in _train_losses(out)] == list(range(1, k + 1))

    # resume to k + 3 steps; an uninterrupted run of k + 3 steps gives the same numbers
    # (one CPU thread, as in the subprocess: float sums split over another thread count differ
    # in the last bits)
    cfg = load_config(cfgp)
    logs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = train(cfg, out_dir=str(out), steps=k + 3, resume=str(out / "ckpt_last.pt"), device="cpu",
                    progress=False, log=logs.append)
        ref = train(cfg, out_dir=str(tmp_path / "ref"), steps=k + 3, device="cpu", progress=False,
                    log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    assert not any("warning" in l for l in logs), logs  # train.steps differs: that is expected
    assert _train_losses(out) == _train_losses(tmp_path / "ref")
    assert res["summary"]["final_val_loss"] == ref["summary"]["final_val_loss"]
    a, b = load_checkpoint(out / "ckpt_last.pt"), load_checkpoint(tmp_path / "ref" / "ckpt_last.pt")
    assert a["step"] == b["step"] == k + 3
    for name, v in b["model"].items():
        assert torch.equal(v, a["model"][name]), name
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[x], sb[x]) for x in sb)


def test_sigterm_saves_and_exits_143(tmp_path):
    out = tmp_path / "run"
    proc, _ = _start(tmp_path, micro_cfg(), out, "--steps", "100000", "--attention", "dsv")
    _wait_for_steps(str(out), 4, proc)  # past the switch to stage 2 (step 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "SIGTERM: stopped after step" in stderr and "Traceback" not in stderr, stderr
    ck = load_checkpoint(out / "ckpt_last.pt")
    assert ck["step"] >= 4 and ck["controller"]["stage"] == 2
    assert json.load(open(out / "summary.json"))["stopped_by"] == "SIGTERM"


def test_second_sigint_aborts_at_once(tmp_path):
    # 2048 tokens a sample: steps long enough (~0.1-1 s) for the second signal to land mid-step
    cfg = micro_cfg()
    cfg["data"].update(frames=8, height=32, width=32)
    out = tmp_path / "run"
    proc, _ = _start(tmp_path, cfg, out, "--steps", "100000")
    _wait_for_steps(str(out), 1, proc)
    proc.send_signal(signal.SIGINT)
    first = proc.stderr.readline()
    assert first.startswith("SIGINT: finishing the current step"), first
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "second SIGINT: aborted without saving" in stderr and "Traceback" not in stderr, stderr
    assert not (out / "summary.json").exists() and not (out / "ckpt_last.pt").exists()
    assert [f for f in os.listdir(out) if ".tmp" in f] == []


# ---------------------------------------------------------------------------------------------
# Resume with a different config
# ---------------------------------------------------------------------------------------------

def test_resume_with_a_changed_config_warns_or_refuses(tmp_path):
    cfg = load_config(base=micro_cfg())
    train(cfg, out_dir=str(tmp_path), steps=2, device="cpu", progress=False, log=lambda s: None)
    ckpt = str(tmp_path / "ckpt_last.pt")
    logs = []
    cfg2 = load_config(base=cfg, overrides=["train.lr=0.002", "train.grad_clip=0.5"])
    res = train(cfg2, out_dir=str(tmp_path), steps=3, resume=ckpt, device="cpu", progress=False,
                log=logs.append)
    assert res["summary"]["resumed_from"] == 2
    warn = [l for l in logs if l.startswith("warning: resuming")]
    assert len(warn) == 1 and "train.grad_clip: 1.0 -> 0.5" in warn[0] and \
        "train.lr: 0.001 -> 0.002" in warn[0] and "train.steps" not in warn[0], logs
    # a change of the model's shape cannot resume: one line listing what differs
    cfg3 = load_config(base=cfg2, overrides=["model.hidden=16"])
    with pytest.raises(CheckpointError, match=r"^resume: .* does not fit this model: the config "
                                              r"differs \(model.hidden: 32 -> 16\)$"):
        train(cfg3, out_dir=str(tmp_path / "x"), steps=4, resume=ckpt, device="cpu", progress=False,
              log=lambda s: None)


# ---------------------------------------------------------------------------------------------
# Configs and command-line arguments
# ---------------------------------------------------------------------------------------------

def test_strict_data_section():
    for data, msg in (({"frmes": 4}, r"^data: unknown key\(s\) \['frmes'\]"),
                      ({"path": "/videos"}, r"^data.path: not a key of data.source 'procedural'"),
                      ({"frames": 0}, r"^data.frames: expected an integer >= 1"),
                      ({"frames": "4"}, r"^data.frames: expected an integer >= 1"),
                      ({"seed": -1}, r"^data.seed: expected an integer >= 0"),
                      ({"source": "folder", "path": "/v", "val_fraction": 1.5}, r"^data.val_fraction"),
                      ({"source": "folder", "path": "/v", "mode": "latent"}, r"^data.mode: not a key")):
        cfg = micro_cfg()
        cfg["data"].update(data)
        with pytest.raises(ValueError, match=msg):
            load_config(base=cfg)
    cfg = micro_cfg()
    cfg["data"] = [1, 2]
    with pytest.raises(ValueError, match="^data: expected a mapping"):
        load_config(base=cfg)
    with pytest.raises(ValueError, match=r"^data: unknown key"):
        load_config(base=micro_cfg(), overrides=["data.colour=3"])
    from dsv_ext.app.data import make_dataset  # the library entry point checks too
    with pytest.raises(ValueError, match=r"^data: unknown key"):
        make_dataset({"frames": 4, "height": 8, "width": 8, "max_object": 2})


@pytest.mark.parametrize("text,where,what", [
    ("model:\n  hidden: 32\n  patch: [1, 2\ndata: {}\n", ":4:5:", "expected ',' or ']'"),
    ("model:\n\thidden: 32\n", ":2:1:", "cannot start any token"),
    ("train: {lr: 1e-3\n", ":2:1:", "expected ',' or '}'"),
])
def test_yaml_errors_are_one_line_with_the_position(tmp_path, capsys, text, where, what):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    assert train_main(["--config", str(p), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"error: {p}{where} invalid YAML:" in line and what in line, line
    with pytest.raises(ValueError, match=r"^--set: 'train.lr=\[1': invalid YAML"):
        load_config(base=micro_cfg(), overrides=["train.lr=[1"])


def test_numeric_cli_arguments_are_range_checked(tmp_path, capsys):
    cfgp = tmp_path / "c.yaml"
    cfgp.write_text(yaml.safe_dump(micro_cfg()))
    from dsv_ext.app.compare import main as compare_main
    from dsv_ext.app.sample import main as sample_main

    base = ["--config", str(cfgp), "--out", str(tmp_path / "o"), "--no-progress"]
    cases = [(train_main, base + ["--steps", "-1"], "--steps: expected an integer >= 1, got -1"),
             (train_main, base + ["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
             (compare_main, base + ["--steps", "-5"], "--steps: expected an integer >= 1, got -5"),
             (train_main, base + ["--time-limit", "0"], "--time-limit: expected a finite number > 0, got 0"),
             (compare_main, base + ["--time-limit", "inf"], "--time-limit: expected a finite number > 0"),
             (compare_main, base + ["--samples", "-1"], "--samples: expected an integer >= 0, got -1")]
    sbase = ["--checkpoint", str(tmp_path / "none.pt"), "--out", str(tmp_path / "s")]
    for arg, val, msg in (("--steps", "-1", "integer >= 1"), ("--num-samples", "0", "integer >= 1"),
                          ("--seed", "-3", "integer >= 0"), ("--batch-size", "0", "integer >= 1"),
                          ("--shift", "0", "finite number > 0"), ("--shift", "nan", "finite number > 0"),
                          ("--fps", "-8", "finite number > 0"), ("--scale", "0", "integer >= 1"),
                          ("--show-data", "-1", "integer >= 0"), ("--index-refresh", "0", "integer >= 1"),
                          ("--threads", "0", "integer >= 1")):
        cases.append((sample_main, sbase + [arg, val], f"{arg}: expected a {msg}".replace("a integer",
                                                                                          "an integer")))
    for fn, argv, msg in cases:
        assert fn(argv) == 2, argv
        line = _one_line(capsys.readouterr().err)
        assert msg in line, (argv, line)
    assert not (tmp_path / "o").exists()  # nothing ran


def test_config_file_that_is_not_yaml(tmp_path, capsys):
    p = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1, "model": {"w": torch.randn(300)}, "config": {}}, str(p))
    assert train_main(["--config", str(p)]) == 2  # e.g. a checkpoint given as the config
    line = _one_line(capsys.readouterr().err)
    assert str(p) in line and ("not a text (YAML) file" in line or "invalid YAML" in line), line
    assert train_main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "No such file" in _one_line(capsys.readouterr().err)


def test_compare_stops_after_a_signalled_run(tmp_path, capsys, monkeypatch):
    import dsv_ext.app.compare as cmp

    calls = []

    def fake_train(cfg, out_dir, attention, **kw):
        calls.append(attention)
        return {"summary": {"stopped_by": "SIGTERM", "stopped_at_step": 3}, "history": [], "val": []}

    monkeypatch.setattr(cmp, "train", fake_train)
    cfgp = tmp_path / "c.yaml"
    cfgp.write_text(yaml.safe_dump(micro_cfg()))
    assert cmp.main(["--config", str(cfgp), "--out", str(tmp_path / "o"), "--no-progress"]) == 143
    err = capsys.readouterr().err
    assert calls == ["dense"]  # the DSV run does not start
    assert "interrupted: SIGTERM: the dense run stopped at step 3" in err and "Traceback" not in err
