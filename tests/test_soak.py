"""benchmarks/soak.py: the flatness rule on synthetic series, and a short run on the CPU."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "benchmarks", "soak.py"))
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def _records(n1, n2, alloc):
    return [{"step": i + 1, "stage": 1 if i < n1 else 2, "alloc": alloc(i), "peak": alloc(i) + 50,
             "reserved": 512.0, "rss": 1000.0} for i in range(n1 + n2)]


def test_flatness_rule():
    tol = dict(soak.DEFAULT_TOL)
    # flat with periodic spikes (a profiler every 25 steps) and a jump at the switch: passes
    flat = _records(300, 700, lambda i: 100.0 + (20.0 if i % 25 == 0 else 0.0) + (40.0 if i >= 300 else 0))
    v = soak.judge(flat, warmup=50, window=100, tol=tol)
    assert [x["stage"] for x in v] == [1, 2] and all(x[m]["ok"] for x in v for m in soak.JUDGED)
    assert v[1]["alloc"]["baseline_mib"] == 160.0 and v[1]["alloc"]["growth_mib"] == 0.0
    # a leak of 128 KiB a step in stage 2 (~69 MiB over the judged 550 steps): fails on alloc
    leak = _records(300, 700, lambda i: 100.0 + (max(0, i - 300) / 8.0))
    v = soak.judge(leak, warmup=50, window=100, tol=tol)
    assert v[0]["alloc"]["ok"] and not v[1]["alloc"]["ok"]
    assert v[1]["peak"]["ok"] is None and v[1]["peak"]["growth_mib"] > 68  # reported, not judged
    assert v[1]["reserved"]["ok"] and v[1]["rss"]["ok"]
    assert 68 < v[1]["alloc"]["growth_mib"] < 69.5
    # a slow leak of 32 KiB a step (17 MiB): still caught
    v = soak.judge(_records(300, 700, lambda i: 100.0 + (max(0, i - 300) / 32.0)), 50, 100, tol)
    assert not v[1]["alloc"]["ok"] and 17 < v[1]["alloc"]["growth_mib"] < 17.5
    # a stage shorter than warm-up + window is not judged; missing metrics are not judged
    v = soak.judge(_records(100, 10, lambda i: 1.0), warmup=50, window=100, tol=tol)
    assert not v[0]["judged"] and v[0]["alloc"]["ok"] is None
    recs = [{**r, "alloc": None} for r in flat]
    assert soak.judge(recs, 50, 100, tol)[1]["alloc"]["ok"] is None


def test_soak_runs_on_the_cpu(tmp_path):
    out = tmp_path / "soak"
    sets = ["model.depth=2", "model.hidden=32", "model.heads=2", "data.frames=4", "data.height=8",
            "data.width=8", "train.batch_size=1", "train.val_videos=1", "train.val_timesteps=[0.5]"]
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--config",
           os.path.join(ROOT, "configs", "tiny.yaml"), "--device", "cpu", "--steps", "14",
           "--switch-step", "4", "--warmup", "2", "--window", "3", "--out", str(out), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.load(open(out / "soak.json"))
    assert res["passed"] and res["steps_run"] == 14 and res["switch_step"] == 4
    assert res["card"].startswith("CPU") and res["provenance"]["date"]
    assert [v["stage"] for v in res["verdicts"]] == [1, 2] and res["verdicts"][1]["rss"]["ok"]
    assert len(res["series"]["rss"]) == 14 and all(x > 0 for x in res["series"]["rss"])
    assert "PASS" in open(out / "soak.md").read()
    # nothing to judge: an error (status 2), not a pass
    r = subprocess.run(cmd + ["--steps", "6"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert r.returncode == 2 and "--steps: the last stage ran" in r.stderr, r.stderr
