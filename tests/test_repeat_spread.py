"""benchmarks/repeat_spread.py: the run-to-run spread of repeated training runs."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("repeat_spread", os.path.join(ROOT, "benchmarks", "repeat_spread.py"))
rs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rs)


def _run(tmp_path, name, train, val, meta=None, per_video=None):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for step, loss in train.items():
            f.write(json.dumps({"kind": "train", "step": step, "loss": loss, "last_loss": loss}) + "\n")
        for step, loss in val.items():
            rec = {"kind": "val", "step": step, "val_loss": loss}
            if per_video and step in per_video:
                rec["val_loss_per_video"] = per_video[step]
            f.write(json.dumps(rec) + "\n")
    if meta:
        (d / "meta.json").write_text(json.dumps(meta))
    return str(d)


def test_spread_and_first_differing_steps(tmp_path):
    a = _run(tmp_path, "a", {10: 2.0, 20: 1.5, 30: 1.2}, {100: 1.00, 200: 0.80},
             {"date_utc": "2026-01-01 00:00", "commit": "abcdef0123", "card": "X"})
    b = _run(tmp_path, "b", {10: 2.0, 20: 1.5003, 30: 1.26}, {100: 1.10})
    out = str(tmp_path / "res" / "spread")
    assert rs.main([a, b, "--out", out]) == 0
    res = json.load(open(out + ".json"))
    v = {e["step"]: e for e in res["val"]}
    assert v[100]["spread_pct"] == pytest.approx(100 * 0.1 / 1.05)
    assert v[200]["runs"] == 1 and "spread_pct" not in v[200] and v[200]["val_loss"] == [0.8, None]
    assert res["first_train_step_spread_above"] == {"0": 20, "0.001": 30, "0.01": 30}
    md = open(out + ".md").read()
    assert "| 100 | 1.0000 | 1.1000 | 1.0500 | 9.5% |" in md and "| 200 | 0.8000 | - | - | - |" in md
    assert "commit abcdef0" in md and "first differ at step 20" in md


def test_versus_pairs_other_runs_with_every_repeat(tmp_path):
    a = _run(tmp_path, "a", {10: 1.0}, {100: 1.0, 200: 0.80}, per_video={200: [0.7, 0.9]})
    b = _run(tmp_path, "b", {10: 1.0}, {100: 1.1, 200: 0.75}, per_video={200: [0.6, 0.9]})
    o = _run(tmp_path, "o", {10: 1.0}, {100: 1.2, 200: 0.84}, per_video={200: [0.76, 0.92]})
    late = _run(tmp_path, "late", {10: 1.0}, {300: 0.5})
    out = str(tmp_path / "spread")
    assert rs.main([a, b, "--out", out, "--versus", o, late]) == 0
    res = json.load(open(out + ".json"))
    va, vb = res["versus"][0]["against"]
    # the last common step, paired over the clips: (0.06 + 0.02) / 2 against a's mean 0.8
    assert va["step"] == 200 and va["rel"] == pytest.approx(0.84 / 0.80 - 1)
    assert va["paired"]["rel"] == pytest.approx(0.04 / 0.8)
    assert va["paired"]["rel_se"] == pytest.approx(0.02 / 0.8)  # std of (0.06, 0.02) / sqrt(2)
    assert vb["paired"]["rel"] == pytest.approx(((0.16 + 0.02) / 2) / 0.75)
    assert [c["step"] for c in res["versus"][1]["against"]] == [None, None]  # no common step
    md = open(out + ".md").read()
    assert "| other 1 | 0.8400 vs 0.8000 at step 200: +5.00% +- 2.50% |" in md and "| other 2 | - | - |" in md


def test_errors_name_the_argument(tmp_path, capsys):
    a = _run(tmp_path, "a", {10: 1.0}, {})
    with pytest.raises(SystemExit):
        rs.main([a, "--out", str(tmp_path / "o")])
    assert "at least two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rs.main([a, str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert "has no metrics.jsonl" in capsys.readouterr().err
    b = _run(tmp_path, "b", {10: 1.0}, {})
    with pytest.raises(SystemExit):
        rs.main([a, b, "--out", str(tmp_path / "o"), "--versus", str(tmp_path / "missing")])
    assert "--versus:" in capsys.readouterr().err
