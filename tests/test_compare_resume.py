"""CPU tests of dsv_ext.app.compare in time-limited chunks (--time-limit / --resume) and of its
report: validation at equal steps, throughput before / after the switch, time to full
attention's final validation loss, and the sample strip."""
import json
import os

import pytest
import yaml

from dsv_ext.app.models import dsv_attention_available
from test_train import micro_config

needs_dsv = pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")


@needs_dsv
def test_compare_in_chunks_equals_one_go(tmp_path):
    from dsv_ext.app.compare import compare

    cfg = micro_config(steps=4, log_every=1, val_every=2)
    one = compare(cfg, str(tmp_path / "one"), device="cpu", progress=False, samples=1,
                  sample_steps=2)
    assert one["complete"]
    # a limit that ends every chunk after one step: one call per step and run
    calls, res = 0, {"complete": False}
    while not res["complete"]:
        res = compare(cfg, str(tmp_path / "chunks"), device="cpu", progress=False, resume=True,
                      time_limit_s=1e-3, min_chunk_s=0.0, samples=0)
        calls += 1
        assert calls < 20
        if not res["complete"]:
            assert os.path.exists(tmp_path / "chunks" / "dense" / "ckpt_last.pt")
            assert not os.path.exists(tmp_path / "chunks" / "compare.md")
    assert calls >= 8  # 4 steps of each run, one step per call
    for key in ("val_at_equal_steps",):
        assert res[key] == one[key]
    assert [e["step"] for e in one["val_at_equal_steps"]] == [2, 4]
    for att in ("dense", "dsv"):
        assert [r["loss"] for r in res["history"][att]] == [r["loss"] for r in one["history"][att]]
        assert [r["step"] for r in res["history"][att]] == [1, 2, 3, 4]
    assert res["switch_step"] == one["switch_step"] == 3
    assert not os.path.exists(tmp_path / "chunks" / "dsv" / "ckpt_last.pt")  # deleted at the end
    # a finished comparison called again with --resume trains nothing and reports the same
    # (its checkpoints are gone: the sample strip of the finished run is kept, not redone)
    again = compare(cfg, str(tmp_path / "one"), device="cpu", progress=False, resume=True, samples=1)
    assert again["val_at_equal_steps"] == one["val_at_equal_steps"]
    assert again["samples"] == one["samples"]
    assert [r["loss"] for r in again["history"]["dsv"]] == [r["loss"] for r in one["history"]["dsv"]]


@needs_dsv
def test_arms_one_process_each(tmp_path, capsys):
    """--arms: each arm trained by its own call on the same --out (as two processes on two GPUs
    would); the call that finds both finished writes the same report as one call for both; a
    call that finds the other process's report lock reports nothing; bad arms are refused."""
    from dsv_ext.app.compare import compare, main

    cfg = micro_config(steps=4, log_every=1, val_every=2)
    one = compare(cfg, str(tmp_path / "one"), device="cpu", progress=False, samples=1, sample_steps=2)
    out = str(tmp_path / "arms")
    res = compare(cfg, out, device="cpu", progress=False, samples=1, sample_steps=2, arms=("dsv",))
    assert not res["complete"] and res["progress"] == {"dense": 0, "dsv": 4}
    assert "other arm is not finished" in capsys.readouterr().err
    assert os.path.exists(os.path.join(out, "dsv", "ckpt_last.pt"))  # kept for the sample strip
    assert not os.path.exists(os.path.join(out, "compare.md"))
    open(os.path.join(out, ".report.lock"), "w").close()  # the other process is reporting
    res = compare(cfg, out, device="cpu", progress=False, samples=1, sample_steps=2, arms=("dense",))
    assert not res["complete"] and "other arm's process writes the report" in res["note"]
    assert not os.path.exists(os.path.join(out, "compare.md"))
    # both done: a --resume call for both arms trains nothing, reports, removes the lock
    res = compare(cfg, out, device="cpu", progress=False, resume=True, samples=1, sample_steps=2)
    assert res["complete"] is not False and os.path.exists(os.path.join(out, "compare.md"))
    assert not os.path.exists(os.path.join(out, ".report.lock"))
    assert res["val_at_equal_steps"] == one["val_at_equal_steps"]
    for att in ("dense", "dsv"):
        assert [r["loss"] for r in res["history"][att]] == [r["loss"] for r in one["history"][att]]
    assert res["samples"]["path"] == "compare_samples.png"
    assert not os.path.exists(os.path.join(out, "dsv", "ckpt_last.pt"))
    with pytest.raises(ValueError, match="arms"):
        compare(cfg, out, device="cpu", arms=("sparse",))
    cfg_path = tmp_path / "micro.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(cfg_path), "--out", out, "--arms", "dsv", "--seeds", "3"]) != 0
    assert "--arms" in capsys.readouterr().err


@needs_dsv
def test_report_only_of_unfinished_runs(tmp_path, capsys):
    """--report-only writes the report of the runs as they stand: an unfinished pair is compared at
    the last step both validated, marked unfinished; a missing run is an error naming --out."""
    from dsv_ext.app.compare import compare, main

    cfg = micro_config(steps=4, log_every=1, val_every=2)
    # full attention stops after two one-step chunks (validated at step 2, a checkpoint)
    for _ in range(2):
        res = compare(cfg, str(tmp_path), device="cpu", progress=False, resume=True, time_limit_s=1e-3,
                      min_chunk_s=0.0, samples=0)
        assert not res["complete"]
    cfg_path = tmp_path / "micro.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    rc = main(["--config", str(cfg_path), "--out", str(tmp_path), "--device", "cpu", "--report-only"])
    out = capsys.readouterr()
    assert rc != 0 and "--out" in out.err and "dsv" in out.err  # the DSV run does not exist yet
    from dsv_ext.app.train import train
    train(cfg, out_dir=str(tmp_path / "dsv"), steps=4, attention="dsv", device="cpu", progress=False)
    assert main(["--config", str(cfg_path), "--out", str(tmp_path), "--device", "cpu", "--report-only"]) == 0
    rep = json.load(open(tmp_path / "compare.json"))
    assert not rep["complete"] and rep["last_steps"]["dsv"] == 4 and rep["last_steps"]["dense"] < 4
    assert rep["val_loss_gap_step"] == 2 and [e["step"] for e in rep["val_at_equal_steps"]] == [2]
    e = rep["val_at_equal_steps"][0]
    assert rep["val_loss_rel_gap"] == pytest.approx(e["dsv"] / e["dense"] - 1)
    md = open(tmp_path / "compare.md").read()
    assert "Unfinished runs: full attention at step" in md and "validation loss at step 2" in md
    assert os.path.exists(tmp_path / "dense" / "ckpt_last.pt")  # kept: the run can still resume
    # each run records the commit it trained at; runs of different commits are reported as such
    from dsv_ext._buildcheck import source_commit
    assert rep["commits"] == {"dense": source_commit(), "dsv": source_commit()}
    assert f"trained at commit {source_commit()}." in md
    summary = json.load(open(tmp_path / "dense" / "summary.json"))
    summary["commit"] = "0000000"
    json.dump(summary, open(tmp_path / "dense" / "summary.json", "w"))
    assert main(["--config", str(cfg_path), "--out", str(tmp_path), "--device", "cpu", "--report-only"]) == 0
    md = open(tmp_path / "compare.md").read()
    assert f"trained at commit 0000000 (full attention) and {source_commit()} (DSV): the tokens/s compare two trees" in md


@needs_dsv
def test_compare_report_fields_and_sample_strip(tmp_path):
    from PIL import Image

    from dsv_ext.app.compare import compare

    cfg = micro_config(steps=6, log_every=1, val_every=2)
    res = compare(cfg, str(tmp_path), device="cpu", progress=False, samples=2, sample_steps=2)
    md = open(tmp_path / "compare.md").read()
    for text in ("throughput before the switch", "training time to full attention's final validation loss",
                 "Validation loss at equal steps", "| 2 |", "| 4 |", "| 6 |", "runs sparse",
                 "compare_samples.png"):
        assert text in md, text
    # full attention reaches its own final validation loss at the end at the latest
    r = res["time_to_dense_final_val"]["dense"]
    assert r is not None and r["step"] <= 6 and 0 < r["time_s"] <= res["dense"]["train_time_s"] + 1e-9
    assert res["dense_tokens_per_s_before_switch"] > 0 and res["dsv_tokens_per_s_before_switch"] > 0
    assert res["dsv_tokens_per_s_after_switch"] > 0
    assert len(res["blocks"]) == 2 and all("sparse" in b for b in res["blocks"])
    im = Image.open(tmp_path / "compare_samples.png")
    # 2 noises x (data, full, DSV) rows of 4 frames of 8x8 latents shown at >= 128 px
    assert im.size[1] >= 6 * 128 and im.size[0] >= 4 * 128
    assert res["samples"]["dsv_mode"] in ("dsv", "dense")
    saved = json.load(open(tmp_path / "compare.json"))
    assert saved["samples"]["path"] == "compare_samples.png"
    # the paired difference at the last step: the videos' differences average to the gap
    pg = res["val_loss_paired"]
    assert pg["step"] == 6 and pg["videos"] == 2
    gap = res["dsv"]["final_val_loss"] - res["dense"]["final_val_loss"]
    assert abs(pg["diff"] - gap) < 1e-6 and abs(pg["rel"] - pg["diff"] / res["dense"]["final_val_loss"]) < 1e-9
    assert "video by video (step 6, 2 videos)" in md
    # the last tenth of the steps: tokens/s of those windows alone, in each arm
    assert res["end_steps"] == [6, 6]
    for a in ("dense", "dsv"):
        w = [r for r in res["history"][a] if r["step"] == 6]
        assert res[f"{a}_tokens_per_s_end"] == pytest.approx(w[0]["tokens_per_s"])
    assert "last tenth of the steps (tokens/s; steps 6-6)" in md
    # each run records what it trained on; a report made again (elsewhere) keeps them and the strip
    import torch

    from dsv_ext.app.compare import report_runs
    assert res["dense"]["torch"] == torch.__version__ and res["dense"]["card"] is None and res["card"] is None
    for a in ("dense", "dsv"):
        sm = json.load(open(tmp_path / a / "summary.json"))
        sm["torch"] = "9.9.9"
        json.dump(sm, open(tmp_path / a / "summary.json", "w"))
    again = report_runs(cfg, str(tmp_path))
    assert again["torch"] == "9.9.9" and again["samples"] == res["samples"]
    assert "compare_samples.png" in open(tmp_path / "compare.md").read()


def test_paired_gap_of_per_video_losses():
    """compare's paired difference: mean and standard error of DSV minus full attention over the
    videos, relative to full attention's loss; none without per-video losses or with one video."""
    from dsv_ext.app.compare import _paired_gap

    val = {"dense": [{"step": 5, "val_loss_per_video": [1.0, 2.0, 3.0]}],
           "dsv": [{"step": 5, "val_loss_per_video": [1.1, 2.0, 3.2]}]}
    pg = _paired_gap(val, 5)
    d = [0.1, 0.0, 0.2]
    m = sum(d) / 3
    se = (sum((x - m) ** 2 for x in d) / 2 / 3) ** 0.5
    assert pg["videos"] == 3 and abs(pg["diff"] - m) < 1e-12 and abs(pg["diff_se"] - se) < 1e-12
    assert abs(pg["rel"] - m / 2.0) < 1e-12 and abs(pg["rel_se"] - se / 2.0) < 1e-12
    assert _paired_gap(val, 4) is None and _paired_gap(val, None) is None
    one = {a: [{"step": 5, "val_loss_per_video": [1.0]}] for a in ("dense", "dsv")}
    assert _paired_gap(one, 5) is None
    old = {a: [{"step": 5, "val_loss": 1.0}] for a in ("dense", "dsv")}  # runs before the field
    assert _paired_gap(old, 5) is None


@needs_dsv
def test_sample_strip_of_arms_finished_apart(tmp_path):
    """Each arm keeps its rows of the sample strip (samples.npz) when it finishes, so that an
    arm trained on another machine, its folder copied back without checkpoints, still has its
    samples in the strip: the same strip, pixel for pixel, as one call for both arms."""
    import numpy as np
    from PIL import Image

    from dsv_ext.app.compare import compare

    cfg = micro_config(steps=4, log_every=1, val_every=2)
    one = compare(cfg, str(tmp_path / "one"), device="cpu", progress=False, samples=2, sample_steps=2)
    out = tmp_path / "apart"
    res = compare(cfg, str(out), device="cpu", progress=False, samples=2, sample_steps=2, arms=("dense",))
    assert not res["complete"] and (out / "dense" / "samples.npz").exists()
    os.remove(out / "dense" / "ckpt_last.pt")  # as the folder comes back from a machine
    res = compare(cfg, str(out), device="cpu", progress=False, resume=True, samples=2, sample_steps=2)
    assert res["complete"] is not False and res["samples"] == one["samples"]
    assert res["val_at_equal_steps"] == one["val_at_equal_steps"]
    strip = lambda d: np.asarray(Image.open(d / "compare_samples.png"))  # noqa: E731
    assert np.array_equal(strip(tmp_path / "one"), strip(out))
    # without an arm's samples or checkpoint the strip cannot be drawn: the report says none
    os.remove(out / "dsv" / "samples.npz")
    os.remove(out / "compare_samples.png")
    res = compare(cfg, str(out), device="cpu", progress=False, resume=True, samples=2, sample_steps=3)
    assert res.get("samples") is None and not (out / "compare_samples.png").exists()
    assert "compare_samples.png" not in open(out / "compare.md").read()


def test_train_time_limit_stops_with_a_checkpoint_and_resumes_exactly(tmp_path):
    from dsv_ext.app.train import train
    from test_train import _read

    cfg = micro_config(steps=5, log_every=2, val_every=2)
    full = train(cfg, out_dir=str(tmp_path / "full"), attention="dense", device="cpu", progress=False)
    part = train(cfg, out_dir=str(tmp_path / "part"), attention="dense", device="cpu", progress=False,
                 time_limit_s=0.0)
    s = part["summary"]
    assert not s["complete"] and s["last_step"] == 1 and s["steps"] == 5
    assert not [r for r in _read(tmp_path / "part" / "metrics.jsonl") if r["kind"] == "val"]
    rest = train(cfg, out_dir=str(tmp_path / "part"), attention="dense", device="cpu", progress=False,
                 resume=str(tmp_path / "part" / "ckpt_last.pt"))
    assert rest["summary"]["complete"] and rest["summary"]["final_val_loss"] == full["summary"]["final_val_loss"]
    a, b = _read(tmp_path / "full" / "metrics.jsonl"), _read(tmp_path / "part" / "metrics.jsonl")
    key = lambda r: (r["kind"], r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
    assert [key(r) for r in a] == [key(r) for r in b]


def test_card_and_torch_of_the_runs(tmp_path):
    """The report names the card and torch the runs trained with: their summaries' (both, when
    they differ), else the run folder's meta.json, else an earlier report's; never the
    reporting machine's card for CPU runs."""
    from dsv_ext.app.compare import _trained_on

    a, b = {"device": "cuda", "card": "H200", "torch": "2.11"}, {"device": "cuda", "card": "H100", "torch": "2.11"}
    assert _trained_on(str(tmp_path), a, b, "card") == "H100 / H200"
    assert _trained_on(str(tmp_path), a, b, "torch") == "2.11"
    old = {"device": "cuda"}  # runs written before the fields
    json.dump({"card": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}, open(tmp_path / "compare.json", "w"))
    assert _trained_on(str(tmp_path), old, old, "card") == "NVIDIA H100 80GB HBM3"
    json.dump({"card": "NVIDIA H200"}, open(tmp_path / "meta.json", "w"))
    assert _trained_on(str(tmp_path), old, old, "card") == "NVIDIA H200"  # meta.json first
    assert _trained_on(str(tmp_path), old, old, "torch") == "2.11.0+cu130"
    assert _trained_on(str(tmp_path), {"device": "cpu"}, {"device": "cpu"}, "card") is None
