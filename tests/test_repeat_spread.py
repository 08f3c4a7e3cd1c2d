"""benchmarks/repeat_spread.py: the run-to-run spread of repeated training runs."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("repeat_spread", os.path.join(ROOT, "benchmarks", "repeat_spread.py"))
rs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rs)


def _run(tmp_path, name, train, val, meta=None):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for step, loss in train.items():
            f.write(json.dumps({"kind": "train", "step": step, "loss": loss, "last_loss": loss}) + "\n")
        for step, loss in val.items():
            f.write(json.dumps({"kind": "val", "step": step, "val_loss": loss}) + "\n")
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


def test_errors_name_the_argument(tmp_path, capsys):
    a = _run(tmp_path, "a", {10: 1.0}, {})
    with pytest.raises(SystemExit):
        rs.main([a, "--out", str(tmp_path / "o")])
    assert "at least two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rs.main([a, str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert "has no metrics.jsonl" in capsys.readouterr().err
