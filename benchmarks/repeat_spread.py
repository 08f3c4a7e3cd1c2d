"""Run-to-run spread of repeated training runs of one configuration (same seed, data and init):
validation loss per step across the runs, and the first logged step whose training losses
differ. On a GPU, kernels whose floating-point sums are not ordered (atomics in attention
backwards and reductions) make repeats of the same seed diverge; this measures how far, which
bounds what a single-run comparison (``python -m dsv_ext.app.compare``) can resolve.

    python benchmarks/repeat_spread.py RUN_DIR [RUN_DIR ...] --out benchmarks/results/NAME \
        [--versus OTHER_RUN [OTHER_RUN ...]]

RUN_DIR: a training run's folder (``metrics.jsonl``; ``meta.json`` beside it or one level up,
as benchmarks/compare_long.sh writes, gives its date, commit and card). Writes NAME.json and
NAME.md. ``--versus``: runs of another arm on the same validation clips (e.g. DSV runs beside
repeated full-attention runs), each set against every repeated run at their last common
validation step, paired over the clips as ``dsv_ext.app.compare`` does, so that a gap can be
read against the repeats' own spread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from dsv_ext.app.compare import _read_metrics  # noqa: E402
from dsv_ext.app.evaluate import paired_stats  # noqa: E402


def read_run(path):
    hist, vals = _read_metrics(path)  # a step logged twice (resumed runs): the last record
    meta = {}
    for m in (os.path.join(path, "meta.json"), os.path.join(os.path.dirname(os.path.normpath(path)), "meta.json")):
        if os.path.exists(m):
            meta = json.load(open(m))
            break
    return {"path": path, "meta": meta,
            "val": {r["step"]: r["val_loss"] for r in vals},
            "per_video": {r["step"]: r["val_loss_per_video"] for r in vals if r.get("val_loss_per_video")},
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


def versus(runs, others):
    """Each run of `others` against each repeated run: both runs' validation losses at their last
    common step, and the difference paired over the clips (relative to the repeated run's loss,
    with its standard error over the clips; None without per-clip losses)."""
    out = []
    for o in others:
        rows = []
        for i, r in enumerate(runs):
            common = sorted(set(o["val"]) & set(r["val"]))
            if not common:
                rows.append({"against": i, "step": None})
                continue
            step = common[-1]
            row = {"against": i, "step": step, "val_loss": o["val"][step], "base": r["val"][step],
                   "rel": o["val"][step] / r["val"][step] - 1, "paired": None}
            a, b = r["per_video"].get(step), o["per_video"].get(step)
            if a and b and len(a) == len(b) >= 2:
                st = paired_stats(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), 1)
                row["paired"] = {k: st[k] for k in ("videos", "rel", "rel_se")}
            rows.append(row)
        out.append({"path": o["path"], **o["meta"], "val": o["val"], "against": rows})
    return out


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
        lines.append(f"- run {i + 1}: {_who(r)}")
    if res.get("versus"):
        lines += ["", "Other runs against each repeated run (validation loss at the last common step; paired over the "
                  "clips: mean difference +- its standard error, relative to the repeated run):", "",
                  "| run | " + " | ".join(f"vs run {i + 1}" for i in range(n)) + " |", "|---|" + "---|" * n]
        for j, o in enumerate(res["versus"]):
            cells = []
            for c in o["against"]:
                if c["step"] is None:
                    cells.append("-")
                    continue
                pr = c["paired"]
                cells.append(f"{c['val_loss']:.4f} vs {c['base']:.4f} at step {c['step']}: "
                             + (f"{100 * pr['rel']:+.2f}% +- {100 * pr['rel_se']:.2f}%" if pr else f"{100 * c['rel']:+.2f}%"))
            lines.append(f"| other {j + 1} | " + " | ".join(cells) + " |")
        lines += [""] + [f"- other {j + 1}: {_who(o)}" for j, o in enumerate(res["versus"])]
    return "\n".join(lines) + "\n"


def _who(r):
    return (f"`{r['path']}`, {r.get('date_utc', '?')} UTC, commit {(r.get('commit') or '?')[:7]}, "
            f"{r.get('card', '?')}, torch {r.get('torch', '?')}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training run folders (metrics.jsonl)")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--title", default="Run-to-run spread of repeated runs")
    p.add_argument("--versus", nargs="+", default=[], metavar="RUN",
                   help="runs of another arm, each set against every repeated run (paired over the clips)")
    a = p.parse_args(argv)
    if len(a.runs) < 2:
        p.error("runs: give at least two run folders")
    for name, paths in (("runs", a.runs), ("--versus", a.versus)):
        for r in paths:
            if not os.path.exists(os.path.join(r, "metrics.jsonl")):
                p.error(f"{name}: {r} has no metrics.jsonl")
    runs = [read_run(r) for r in a.runs]
    res = spread(runs)
    if a.versus:
        res["versus"] = versus(runs, [read_run(r) for r in a.versus])
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
