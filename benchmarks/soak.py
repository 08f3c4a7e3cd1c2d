"""Soak test: a long DSV training run through the stage switch, memory recorded every step.

    python benchmarks/soak.py --device cuda                       # small config, 1000 steps (GPU)
    python benchmarks/soak.py --config configs/tiny.yaml --device cpu --steps 40 --switch-step 15 \\
        --warmup 5 --window 5 --set model.depth=2                   # quick CPU check

Runs ``dsv_ext.app.train.train`` (the real training loop: DSV attention, predictor training, the
profiler, the switch to stage 2 at ``--switch-step`` at the latest, then sparse attention) and
records after every optimizer step: CUDA memory allocated (``alloc``), the step's peak allocated
(``peak``), reserved by the caching allocator (``reserved``) and the host resident set size
(``rss``), in MiB.

Flatness (the pass/fail rule): the run is cut into its DSV stages; in each stage the first
``--warmup`` steps are warm-up, the maximum over the next ``--window`` steps is the baseline
(a window spanning several profiler / predictor-training periods, so periodic spikes are in
it), and the maximum over every later step of the stage may exceed the baseline by at most the
tolerance (``--tol-alloc`` 16, ``--tol-reserved`` 256, ``--tol-rss`` 256 MiB; ``reserved`` may
also grow by as much as ``peak`` grew: the caching allocator keeps what the largest step needed,
so only reserved memory beyond the working set's growth counts as fragmentation). A leak of 30 KiB
per step shows up in ``alloc`` over the 550 judged steps of stage 2; one-off allocations (the
stage switch, the first sparse step) fall into the warm-up. ``peak`` is reported with the sum
of the per-head K of the sparse blocks (``k_total``), not judged: the profiler keeps adjusting
K in stage 2, and the step's working set follows it. A stage too short to judge is reported
as such; the last stage must be judged (else the run is an error).

Writes ``OUT/soak.json`` (date, commit, card, settings, per-stage verdicts and the per-step
series) and ``OUT/soak.md``; exit status 0 when memory is flat, 1 when it grew, 2 on errors.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

METRICS = ("alloc", "peak", "reserved", "rss")
JUDGED = ("alloc", "reserved", "rss")
"""``peak`` (the step's working set) follows the per-head K that the profiler keeps adjusting in
stage 2, so it is reported (with the K total) but not part of the verdict; memory that leaks
persists across steps and shows in ``alloc`` (and ``reserved`` / ``rss``)."""
DEFAULT_TOL = {"alloc": 16.0, "peak": 64.0, "reserved": 256.0, "rss": 256.0}


def rss_mib() -> Optional[float]:
    """Current resident set size of this process (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        try:
            import resource

            r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return r / 2**20 if sys.platform == "darwin" else r / 1024
        except Exception:  # noqa: BLE001
            return None


def stages(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Contiguous runs of one DSV stage: [{"stage", "first", "last"}] (indices into records)."""
    out: List[Dict[str, Any]] = []
    for i, r in enumerate(records):
        if out and out[-1]["stage"] == r["stage"]:
            out[-1]["last"] = i
        else:
            out.append({"stage": r["stage"], "first": i, "last": i})
    return out


def judge(records: List[Dict[str, Any]], warmup: int, window: int,
          tol: Dict[str, float]) -> List[Dict[str, Any]]:
    """Per stage and metric: baseline (max over the window after warm-up), max after it,
    growth and whether growth <= tolerance (``ok`` None: too short, or metric not measured)."""
    verdicts = []
    for seg in stages(records):
        n = seg["last"] - seg["first"] + 1
        v: Dict[str, Any] = {"stage": seg["stage"], "first_step": records[seg["first"]]["step"],
                             "last_step": records[seg["last"]]["step"], "steps": n}
        b0 = seg["first"] + warmup
        b1 = b0 + window
        judged = n > warmup + window
        for m in METRICS:
            vals = [r.get(m) for r in records[seg["first"]:seg["last"] + 1]]
            if not judged or any(x is None for x in vals):
                v[m] = {"ok": None}
                continue
            base = max(r[m] for r in records[b0:b1])
            after = max(r[m] for r in records[b1:seg["last"] + 1])
            growth = after - base
            v[m] = {"baseline_mib": round(base, 3), "max_after_mib": round(after, 3),
                    "growth_mib": round(growth, 3), "tol_mib": tol[m],
                    "ok": growth <= tol[m] if m in JUDGED else None}
            if m == "reserved" and "baseline_mib" in v.get("peak", {}):
                # the caching allocator keeps what the largest step needed: reserved memory may
                # follow the step's peak (K grows in stage 2); only growth beyond it is judged
                allowed = max(0.0, v["peak"]["growth_mib"]) + tol[m]
                v[m].update(allowed_mib=round(allowed, 3), ok=growth <= allowed)
        ks = [r.get("k_total") for r in records[seg["first"]:seg["last"] + 1]]
        if judged and all(k is not None for k in ks):
            v["k_total"] = {"baseline": max(ks[warmup:warmup + window]), "max_after": max(ks[warmup + window:])}
        v["judged"] = judged
        verdicts.append(v)
    return verdicts


def card(device) -> str:
    import torch

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {name} ({os.cpu_count()} cores)"


def write_markdown(res: Dict[str, Any], path: str) -> None:
    s = res["settings"]
    lines = [f"# Soak: {s['config']} ({res['steps_run']} DSV training steps)", "",
             f"{res['provenance']['date']}, commit {res['provenance']['commit']}, {res['card']}, "
             f"torch {res['torch']}. Stage switch at step {res['switch_step']} "
             f"(forced at {s['switch_step']} at the latest). Warm-up {s['warmup']} steps per stage, "
             f"baseline = max over the next {s['window']} steps; pass when the max over the rest of "
             "the stage is within the tolerance of the baseline (reserved: plus the growth of the step's "
             "peak).", "",
             f"**Result: {'PASS (memory flat)' if res['passed'] else 'FAIL (memory grew)'}**; "
             f"{res['wall_time_s']:.0f} s, median step {res['median_step_ms']:.1f} ms.", "",
             "| stage | steps | metric | baseline MiB | max after MiB | growth MiB | tol MiB | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for v in res["verdicts"]:
        if not v["judged"]:
            lines.append(f"| {v['stage']} | {v['first_step']}-{v['last_step']} | all | too short to judge "
                         "| | | | |")
            continue
        for m in METRICS:
            d = v[m]
            if "baseline_mib" not in d:
                continue  # not measured here (CUDA metrics on the CPU)
            ok = "info" if d["ok"] is None else ("yes" if d["ok"] else "**no**")
            lines.append(f"| {v['stage']} | {v['first_step']}-{v['last_step']} | {m} | "
                         f"{d['baseline_mib']:.1f} | {d['max_after_mib']:.1f} | {d['growth_mib']:+.2f} | "
                         f"{d['tol_mib']:.0f}{' + peak growth' if 'allowed_mib' in d else ''} | {ok} |")
    ks = [(v["stage"], v["k_total"]) for v in res["verdicts"] if v.get("k_total") and v["stage"] == 2]
    if ks:
        lines += ["", f"Sum of the per-head K of the sparse blocks (stage 2): {ks[0][1]['baseline']} in the "
                      f"baseline window, up to {ks[0][1]['max_after']} after it (`peak` follows K; it is "
                      "reported, not judged)."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/soak.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs", "small.yaml"))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--switch-step", type=int, default=300,
                   help="switch to DSV stage 2 at this step at the latest (dsv.force_stage2_step)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps at the start of each stage")
    p.add_argument("--window", type=int, default=100, help="baseline window after the warm-up")
    for m in METRICS:
        p.add_argument(f"--tol-{m}", type=float, default=DEFAULT_TOL[m], metavar="MIB",
                       help=f"allowed growth of {m} (default {DEFAULT_TOL[m]:g} MiB)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SEC.KEY=VALUE")
    p.add_argument("--out", default=None, help="folder for soak.json / soak.md "
                                               "(default benchmarks/results/soak_<config>)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    import torch

    from bench_common import provenance
    from dsv_ext.app.cli import check_numeric_args, run_command
    from dsv_ext.app.common import load_config, resolve_device
    from dsv_ext.app.train import train

    def body() -> int:
        check_numeric_args(a, ints={"steps": 1, "switch_step": 0, "warmup": 0, "window": 1})
        for m in METRICS:
            v = getattr(a, f"tol_{m}")
            if not v >= 0 or v == float("inf"):
                raise ValueError(f"--tol-{m}: expected a finite number >= 0, got {v}")
        cfg = load_config(a.config, ["train.val_every=0", "train.ckpt_every=0",
                                     f"dsv.force_stage2_step={a.switch_step}", *a.overrides])
        dev = resolve_device(a.device)
        name = cfg.get("name", "run")
        out = a.out or os.path.join(HERE, "results", f"soak_{name}")
        os.makedirs(out, exist_ok=True)
        cuda = dev.type == "cuda"
        records: List[Dict[str, Any]] = []

        def on_step(step: int, info: Dict[str, Any]) -> None:
            ctl = info.get("controller")
            rec = {"step": step, "stage": info["stage"], "loss": info["loss"],
                   "step_ms": 1000 * info["step_time_s"], "rss": rss_mib(),
                   # sum of the per-head K of the sparse blocks (the sparse path's working set)
                   "k_total": sum(sum(m.head_k) for _, m in ctl.modules if m.use_sparse)
                   if ctl is not None and info["stage"] == 2 else 0}
            if cuda:
                rec["alloc"] = torch.cuda.memory_allocated(dev) / 2**20
                rec["reserved"] = torch.cuda.memory_reserved(dev) / 2**20
                rec["peak"] = torch.cuda.max_memory_allocated(dev) / 2**20
                torch.cuda.reset_peak_memory_stats(dev)
            records.append(rec)

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="soak_run_") as run_dir:  # checkpoints, metrics
            res = train(cfg, out_dir=run_dir, steps=a.steps, attention="dsv", device=str(dev),
                        progress=not a.no_progress, on_step=on_step)
        wall = time.perf_counter() - t0
        tol = {m: getattr(a, f"tol_{m}") for m in METRICS}
        verdicts = judge(records, a.warmup, a.window, tol)
        if not verdicts[-1]["judged"]:
            raise ValueError(f"--steps: the last stage ran {verdicts[-1]['steps']} steps, fewer than "
                             f"--warmup + --window + 1 = {a.warmup + a.window + 1}: nothing to judge")
        oks = [v[m]["ok"] for v in verdicts for m in JUDGED if v[m]["ok"] is not None]
        switch = next((r["step"] for r in records if r["stage"] == 2), None)
        times = sorted(r["step_ms"] for r in records)
        result = {
            "provenance": {**provenance(), **({"commit": os.environ["DSV_COMMIT"]}
                                              if os.environ.get("DSV_COMMIT") else {})},
            "card": card(dev), "torch": torch.__version__, "device": str(dev),
            "settings": {"config": a.config, "overrides": a.overrides, "steps": a.steps,
                         "switch_step": a.switch_step, "warmup": a.warmup, "window": a.window, "tol_mib": tol},
            "steps_run": len(records), "switch_step": switch, "passed": all(oks) and bool(oks),
            "verdicts": verdicts, "wall_time_s": wall, "median_step_ms": times[len(times) // 2],
            "final_val_loss": res["summary"].get("final_val_loss"),
            "series": {k: [r.get(k) for r in records]
                       for k in ("step", "stage", "loss", "step_ms", "k_total", *METRICS)},
        }
        with open(os.path.join(out, "soak.json"), "w") as f:
            json.dump(result, f, indent=1)
        write_markdown(result, os.path.join(out, "soak.md"))
        print(open(os.path.join(out, "soak.md")).read())
        print(f"wrote {out}/soak.json and soak.md")
        return 0 if result["passed"] else 1

    return run_command(p.prog, body)


if __name__ == "__main__":
    sys.exit(main())
