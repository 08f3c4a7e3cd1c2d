"""Run-to-run spread of repeated training runs of one configuration (same seed, data and init):
validation loss per step across the runs, and the first logged step whose training losses
differ. On a GPU, kernels whose floating-point sums are not ordered (atomics in attention
backwards and reductions) make repeats of the same seed diverge; this measures how far, which
bounds what a single-run comparison (``python -m dsv_ext.app.compare``) can resolve.

    python benchmarks/repeat_spread.py RUN_DIR [RUN_DIR ...] --out benchmarks/results/NAME

RUN_DIR: a training run's folder (``metrics.jsonl``; ``meta.json`` beside it or one level up,
as benchmarks/compare_long.sh writes, gives its date, commit and card). Writes NAME.json and
NAME.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv_ext.app.compare import _read_metrics  # noqa: E402


def read_run(path):
    hist, vals = _read_metrics(path)  # a step logged twice (resumed runs): the last record
    meta = {}
    for m in (os.path.join(path, "meta.json"), os.path.join(os.path.dirname(os.path.normpath(path)), "meta.json")):
        if os.path.exists(m):
            meta = json.load(open(m))
            break
    return {"path": path, "meta": meta,
            "val": {r["step"]: r["val_loss"] for r in vals},
            "train": {r["step"]: r["last_loss"] for r in hist if r.get("kind") == "train"}}


def spread(runs):
    steps = sorted(set().union(*(r["val"] for r in runs)))
    table = []
    for s in steps:
        vals = [r["val"].get(s) for r in runs]
        have = [v for v in vals if v is not None]
        row = {"step": s, "val_loss": vals, "runs": len(have)}
        if len(have) >= 2:
            mean = statistics.fmean(have)
            row.update(mean=mean, spread_pct=100 * (max(have) - min(have)) / mean)
        table.append(row)
    common = sorted(set.intersection(*(set(r["train"]) for r in runs)))
    rel = {}  # the relative spread of the logged training losses (each the step's own loss)
    for s in common:
        xs = [r["train"][s] for r in runs]
        rel[s] = (max(xs) - min(xs)) / abs(statistics.fmean(xs))
    first = {f"{t:g}": next((s for s in common if rel[s] > t), None) for t in (0, 1e-3, 1e-2)}
    return {"val": table, "train_rel_spread": rel, "first_train_step_spread_above": first,
            "runs": [{"path": r["path"], **r["meta"]} for r in runs]}


def fmt(step, rel):
    return "-" if step is None else f"{step} ({rel[step]:.1e})"


def markdown(res, title):
    n = len(res["runs"])
    first, rel = res["first_train_step_spread_above"], res["train_rel_spread"]
    lines = [f"# {title}", "",
             f"{n} runs of the same configuration, seed, data and initialisation. The logged "
             "training losses (each that step's batch) first differ at step "
             f"{fmt(first['0'], rel)}; their relative spread passes 0.1% at step "
             f"{fmt(first['0.001'], rel)} and 1% at step {fmt(first['0.01'], rel)}: the runs' "
             "unordered floating-point sums make them drift apart.", "",
             "| step | " + " | ".join(f"run {i + 1}" for i in range(n)) + " | mean | spread (max - min) / mean |",
             "|---|" + "---|" * n + "---|---|"]
    for row in res["val"]:
        cells = ["-" if v is None else f"{v:.4f}" for v in row["val_loss"]]
        tail = (f"{row['mean']:.4f} | {row['spread_pct']:.1f}%" if "mean" in row else "- | -")
        lines.append(f"| {row['step']} | " + " | ".join(cells) + f" | {tail} |")
    lines += ["", "Runs (validation loss of the moving-average weights at each step):", ""]
    for i, r in enumerate(res["runs"]):
        lines.append(f"- run {i + 1}: `{r['path']}`, {r.get('date_utc', '?')} UTC, commit "
                     f"{(r.get('commit') or '?')[:7]}, {r.get('card', '?')}, torch {r.get('torch', '?')}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training run folders (metrics.jsonl)")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--title", default="Run-to-run spread of repeated runs")
    a = p.parse_args(argv)
    if len(a.runs) < 2:
        p.error("runs: give at least two run folders")
    for r in a.runs:
        if not os.path.exists(os.path.join(r, "metrics.jsonl")):
            p.error(f"runs: {r} has no metrics.jsonl")
    res = spread([read_run(r) for r in a.runs])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res, a.title)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
