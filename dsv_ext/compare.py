"""Full attention vs DSV on the same model, data, seed and steps.

    python -m dsv_ext.compare --config configs/small.yaml [--out DIR] [--steps N] [--device cuda]

Trains the config twice with :func:`dsv_ext.train.train` (``attention=dense``: plain SDPA, and
``attention=dsv``: DSVAttention under a DSVController), then writes into ``--out`` (default
``runs/compare-<config name>``):

- ``compare.md``: validation loss of both runs and their relative gap, throughput (tokens/s over
  the whole run, and over DSV's stage-2 steps against the dense run's steps after the same step),
  per-block sparsity, predictor loss and predictor recall of the DSV run;
- ``compare.png``: training loss (and validation points) of both runs, and DSV's per-block
  sparsity and predictor recall over the steps, with the stage-2 switch marked;
- ``compare.json``: the numbers behind the table; ``dense/`` and ``dsv/``: the two runs
  (metrics, config, summary; their checkpoints are deleted unless ``--keep-checkpoints``).

With ``--seeds N`` (N >= 2; 3 or more for a usable interval) the pair is trained N times, seed
``train.seed + i`` for run i (model init, data order, noise), each pair into ``seed<i>/`` as
above, and ``compare_seeds.md`` / ``compare_seeds.json`` report per arm the mean, standard
deviation and 95% confidence interval of the final validation loss over the seeds, the paired
relative gap (DSV / full - 1 per seed) with its interval, the validation set's own standard error
(``train.val_videos`` x ``train.val_timesteps`` samples; raise ``--val-videos`` until it is small
against the seed spread), and whether the gap is resolved relative to 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .cli import run_command
from .train import load_config, train

__all__ = ["compare", "compare_seeds", "seed_stats", "write_table", "write_seeds_table", "write_plot", "main"]


def _fmt(v, nd=4):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _switch_step(history: List[Dict[str, Any]]) -> Optional[int]:
    for r in history:
        if r.get("stage", 1) == 2:
            return r["step"]
    return None


def _tps_after(history: List[Dict[str, Any]], step: Optional[int]) -> Optional[float]:
    """Mean tokens/s of the logged windows after ``step`` (time-weighted)."""
    if step is None:
        return None
    rows = [r for r in history if r["step"] > step and r.get("tokens_per_s")]
    if not rows:
        return None
    # windows are equal-length, so tokens/time == harmonic mean of the window rates
    return len(rows) / sum(1.0 / r["tokens_per_s"] for r in rows)


def compare(cfg: Dict[str, Any], out_dir: str, steps: Optional[int] = None,
            device: Optional[str] = None, progress: bool = True,
            keep_checkpoints: bool = False) -> Dict[str, Any]:
    os.makedirs(out_dir, exist_ok=True)
    runs = {}
    for att in ("dense", "dsv"):
        runs[att] = train(cfg, out_dir=os.path.join(out_dir, att), steps=steps, attention=att,
                          device=device, progress=progress)
        if not keep_checkpoints:  # keep the folder small enough to commit
            for f in os.listdir(os.path.join(out_dir, att)):
                if f.startswith("ckpt_") and f.endswith(".pt"):
                    os.remove(os.path.join(out_dir, att, f))
    d, s = runs["dense"], runs["dsv"]
    sw = _switch_step(s["history"])  # first logged stage-2 line: windows after it are all stage 2
    switch = s["summary"].get("dsv_switch_step")  # the controller's actual switch step
    res = {
        "config": cfg.get("name"),
        "steps": d["summary"]["steps"],
        "device": d["summary"]["device"],
        "tokens_per_sample": d["summary"]["tokens_per_sample"],
        "dense": d["summary"],
        "dsv": s["summary"],
        "switch_step": switch if switch is not None else sw,
        "val_loss_rel_gap": (None if not d["summary"]["final_val_loss"] else
                             s["summary"]["final_val_loss"] / d["summary"]["final_val_loss"] - 1),
        "dense_tokens_per_s_after_switch": _tps_after(d["history"], sw),
        "dsv_tokens_per_s_after_switch": _tps_after(s["history"], sw),
        "blocks": (s["history"][-1].get("blocks") if s["history"] else None) or [],
        "dispatch": {k: (cfg.get("dsv") or {}).get(k) for k in ("use_calibration", "dispatch_threshold")},
        "history": {"dense": d["history"], "dsv": s["history"]},
        "val": {"dense": d["val"], "dsv": s["val"]},
    }
    write_table(res, os.path.join(out_dir, "compare.md"))
    try:
        write_plot(res, os.path.join(out_dir, "compare.png"))
    except ImportError as e:  # matplotlib missing: the table is still written
        print(f"compare: no plot ({e}); pip install matplotlib", file=sys.stderr)
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


# two-sided 95% quantiles of Student's t by degrees of freedom (larger df: the next lower entry)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def _t975(df: int) -> float:
    return _T975[max(k for k in _T975 if k <= df)] if df >= 1 else float("nan")


def seed_stats(xs: Sequence[float]) -> Dict[str, Any]:
    """Mean, sample standard deviation and 95% t confidence interval of the mean of ``xs``
    (std and interval None for fewer than two values)."""
    xs = [float(x) for x in xs]
    n = len(xs)
    if n == 0:
        raise ValueError("xs: expected at least one value")
    m = sum(xs) / n
    if n < 2:
        return {"n": n, "mean": m, "std": None, "ci95": None, "values": xs}
    sd = (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5
    h = _t975(n - 1) * sd / n ** 0.5
    return {"n": n, "mean": m, "std": sd, "ci95": [m - h, m + h], "values": xs}


def gap_verdict(ci, bound: float = 0.01) -> str:
    """Plain-words verdict on a relative gap's 95% interval against +-``bound``."""
    if ci is None:
        return "not resolved: one seed gives no interval (use --seeds 3 or more)"
    lo, hi = ci
    pct = f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%]"
    if hi < bound:
        return (f"resolved: the 95% interval of the gap {pct} lies below +{100 * bound:.0f}%, so DSV is "
                f"within {100 * bound:.0f}% of full attention")
    if lo > bound:
        return f"resolved: the 95% interval of the gap {pct} lies above +{100 * bound:.0f}%: DSV is worse by more than that"
    return (f"not resolved: the 95% interval of the gap {pct} includes +{100 * bound:.0f}% "
            "(more seeds, longer runs or more validation videos needed)")


def compare_seeds(cfg: Dict[str, Any], out_dir: str, seeds: int, steps: Optional[int] = None,
                  device: Optional[str] = None, progress: bool = True,
                  keep_checkpoints: bool = False) -> Dict[str, Any]:
    """:func:`compare` for ``seeds`` consecutive seeds (``train.seed + i``) into ``out_dir/seed<i>``,
    then mean, spread and 95% intervals per arm and of the paired gap (``compare_seeds.md/json``)."""
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds: expected an integer >= 1, got {seeds!r}")
    import copy

    base = int((cfg.get("train") or {}).get("seed", 0))
    runs = []
    for i in range(seeds):
        c = copy.deepcopy(cfg)
        c["train"]["seed"] = base + i
        r = compare(c, os.path.join(out_dir, f"seed{base + i}"), steps=steps, device=device,
                    progress=progress, keep_checkpoints=keep_checkpoints)
        runs.append(r)
        r.pop("history", None)
        r.pop("val", None)
    arms = {}
    for att in ("dense", "dsv"):
        arms[att] = seed_stats([r[att]["final_val_loss"] for r in runs])
        ses = [r[att].get("final_val_loss_se") for r in runs]
        arms[att]["eval_se"] = (sum(ses) / len(ses)) if all(x is not None for x in ses) else None
    gaps = [r["val_loss_rel_gap"] for r in runs]
    gap = seed_stats(gaps)
    dsv = [r["dsv"] for r in runs]
    res = {
        "config": cfg.get("name"), "seeds": [base + i for i in range(seeds)], "steps": runs[0]["steps"],
        "device": runs[0]["device"], "tokens_per_sample": runs[0]["tokens_per_sample"],
        "val_videos": (cfg.get("train") or {}).get("val_videos"),
        "val_timesteps": (cfg.get("train") or {}).get("val_timesteps"),
        "arms": arms, "rel_gap": gap, "verdict": gap_verdict(gap["ci95"]),
        "switch_steps": [r["switch_step"] for r in runs],
        "speedup_after_switch": seed_stats([r["dsv_tokens_per_s_after_switch"] / r["dense_tokens_per_s_after_switch"]
                                            for r in runs if r["dsv_tokens_per_s_after_switch"]
                                            and r["dense_tokens_per_s_after_switch"]] or [float("nan")]),
        "dsv_sparsity": [_scalar(d.get("dsv_sparsity")) for d in dsv],
        "dsv_recall": [_scalar(d.get("dsv_recall")) for d in dsv],
        "runs": runs,
    }
    from .evaluate import provenance

    res["provenance"] = provenance(runs[0]["device"])
    write_seeds_table(res, os.path.join(out_dir, "compare_seeds.md"))
    with open(os.path.join(out_dir, "compare_seeds.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def write_seeds_table(res: Dict[str, Any], path: str) -> None:
    def ci(st, nd=4, pct=False):
        if st.get("ci95") is None:
            return "-"
        f = (lambda v: f"{100 * v:+.2f}%") if pct else (lambda v: f"{v:.{nd}f}")
        return f"[{f(st['ci95'][0])}, {f(st['ci95'][1])}]"

    d, s, g = res["arms"]["dense"], res["arms"]["dsv"], res["rel_gap"]
    L = [f"# Full attention vs DSV over {len(res['seeds'])} seeds: `{res['config']}`", "",
         f"Seeds {', '.join(map(str, res['seeds']))} (each: model init, data order, noise); {res['steps']} steps, "
         f"{res['tokens_per_sample']} tokens per video, device `{res['device']}`; validation on "
         f"{_fmt(res['val_videos'])} videos x {len(res['val_timesteps'] or [])} timesteps."
         + (" Measured {date}, commit {commit}, {device_name}.".format(**res["provenance"])
            if res.get("provenance") else ""), "",
         "| | full attention | DSV |", "|---|---|---|",
         f"| validation loss, mean over seeds | {_fmt(d['mean'])} | {_fmt(s['mean'])} |",
         f"| standard deviation over seeds | {_fmt(d['std'])} | {_fmt(s['std'])} |",
         f"| 95% interval of the mean | {ci(d)} | {ci(s)} |",
         f"| evaluation's own standard error (mean over seeds) | {_fmt(d['eval_se'])} | {_fmt(s['eval_se'])} |",
         f"| per seed | {', '.join(_fmt(x) for x in d['values'])} | {', '.join(_fmt(x) for x in s['values'])} |",
         "",
         f"Relative gap DSV / full - 1 (paired by seed): mean {100 * g['mean']:+.2f}%"
         + (f", standard deviation {100 * g['std']:.2f}%, 95% interval {ci(g, pct=True)}" if g["std"] is not None else "")
         + f"; per seed {', '.join(f'{100 * x:+.2f}%' for x in g['values'])}.", "",
         f"**Gap against 1%: {res['verdict']}.**", ""]
    sp = res.get("speedup_after_switch") or {}
    if sp.get("mean") == sp.get("mean"):  # not NaN
        L += [f"DSV speed after its switch: {sp['mean']:.2f}x full attention (mean over seeds); mean sparsity "
              f"{', '.join(_fmt(x, 3) for x in res['dsv_sparsity'])}, recall "
              f"{', '.join(_fmt(x, 3) for x in res['dsv_recall'])} per seed.", ""]
    ev = max([x for x in (d["eval_se"], s["eval_se"]) if x is not None], default=None)
    spread = max([x for x in (d["std"], s["std"]) if x is not None], default=None)
    if ev is not None and spread is not None and ev > 0.5 * spread:
        L += [f"Note: the evaluation's standard error ({ev:.4f}) is not small against the spread over "
              f"seeds ({spread:.4f}): raise --val-videos.", ""]
    L += ["Each seed's own table: `seed<N>/compare.md`.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def write_table(res: Dict[str, Any], path: str) -> None:
    d, s = res["dense"], res["dsv"]
    L = [f"# Full attention vs DSV: `{res['config']}`", "",
         f"{res['steps']} steps, {res['tokens_per_sample']} tokens per video, "
         f"batch {d['batch_size']}, device `{res['device']}`; same model init, data, noise "
         f"and seed. DSV switched to stage 2 at step {_fmt(res['switch_step'])}.", "",
         "| | full attention | DSV |", "|---|---|---|",
         f"| validation loss | {_fmt(d['final_val_loss'])} | {_fmt(s['final_val_loss'])} "
         f"({_fmt(100 * res['val_loss_rel_gap'] if res['val_loss_rel_gap'] is not None else None, 2)}% vs full) |",
         f"| final training loss (last log window) | {_fmt(d['final_train_loss'])} | {_fmt(s['final_train_loss'])} |",
         f"| throughput, whole run (tokens/s) | {_fmt(d['tokens_per_s'], 0)} | {_fmt(s['tokens_per_s'], 0)} |",
         f"| throughput after the switch (tokens/s) | {_fmt(res['dense_tokens_per_s_after_switch'], 0)} "
         f"| {_fmt(res['dsv_tokens_per_s_after_switch'], 0)} |",
         f"| speed-up after the switch | 1.00x | "
         + (f"{res['dsv_tokens_per_s_after_switch'] / res['dense_tokens_per_s_after_switch']:.2f}x |"
            if res["dsv_tokens_per_s_after_switch"] and res["dense_tokens_per_s_after_switch"] else "- |"),
         f"| training time (s) | {_fmt(d['train_time_s'], 1)} | {_fmt(s['train_time_s'], 1)} |",
         f"| validation loss standard error (over videos) | {_fmt(d.get('final_val_loss_se'))} "
         f"| {_fmt(s.get('final_val_loss_se'))} |",
         f"| mean sparsity (EMA, theta=0.9) | - | {_fmt(_scalar(s.get('dsv_sparsity')), 3)} |",
         f"| predictor recall | - | {_fmt(_scalar(s.get('dsv_recall')), 3)} |",
         ""]
    blocks = res.get("blocks") or []
    if blocks:
        L += ["Per block (DSV run, end of training):", "",
              "| block | sparsity | predictor loss | recall | runs sparse |", "|---|---|---|---|---|"]
        for i, b in enumerate(blocks):
            L.append(f"| {i} (`{b.get('name', '')}`) | {_fmt(b.get('sparsity'), 3)} | "
                     f"{_fmt(b.get('pred_loss'), 4)} | {_fmt(b.get('recall'), 3)} | "
                     f"{_fmt(b.get('sparse'))} |")
        L.append("")
    disp = res.get("dispatch") or {}
    if disp.get("use_calibration") is False:
        thr = disp.get("dispatch_threshold")
        L += [f"Dispatch: this config turns the calibrated speed model off and runs a block sparse "
              f"whenever its measured sparsity is at least {_fmt(thr if thr is not None else 0.8, 2)}, "
              "so the speed-up above shows that rule (chosen to test quality), not what the "
              "dispatcher would pick for speed.", ""]
    L += ["Throughput counts forward + backward + optimizer + DSV controller work per step; "
          "stage 1 of DSV includes predictor training and profiling on top of dense attention.",
          "Sparsity: fraction of keys outside the critical set (softmax mass 0.9) from the profiler's "
          "sampled rows; recall: exact attention mass covered by the predicted top-K index.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def _scalar(v):
    if isinstance(v, list):
        xs = [x for x in v if x is not None]
        return sum(xs) / len(xs) if xs else None
    return v


def write_plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.2))
    for att, color in (("dense", "tab:blue"), ("dsv", "tab:orange")):
        h = res["history"][att]
        a1.plot([r["step"] for r in h], [r["loss"] for r in h], color=color, alpha=0.6,
                label=f"{'full attention' if att == 'dense' else 'DSV'} (train)")
        v = res["val"][att]
        a1.plot([r["step"] for r in v], [r["val_loss"] for r in v], "o--", color=color,
                label=f"{'full attention' if att == 'dense' else 'DSV'} (validation)")
    sw = res.get("switch_step")
    for ax in (a1, a2, a3):
        if sw is not None:
            ax.axvline(sw, color="gray", ls=":", label="DSV stage 2")
    a1.set_xlabel("step")
    a1.set_ylabel("flow-matching loss")
    a1.legend(fontsize=8)
    a1.set_title("loss")
    h = res["history"]["dsv"]
    nblk = max((len(r.get("blocks") or []) for r in h), default=0)
    for i in range(nblk):
        pts = [(r["step"], r["blocks"][i].get("sparsity")) for r in h
               if len(r.get("blocks") or []) > i and r["blocks"][i].get("sparsity") is not None]
        if pts:
            a2.plot(*zip(*pts), label=f"block {i}")
    if nblk == 0:
        pts = [(r["step"], _scalar(r.get("sparsity"))) for r in h if _scalar(r.get("sparsity")) is not None]
        if pts:
            a2.plot(*zip(*pts), label="mean")
    a2.set_xlabel("step")
    a2.set_ylabel("sparsity (theta = 0.9)")
    a2.set_ylim(0, 1)
    a2.set_title("DSV per-block sparsity")
    a2.legend(fontsize=8, ncol=2)
    for i in range(nblk):
        pts = [(r["step"], r["blocks"][i].get("recall")) for r in h
               if len(r.get("blocks") or []) > i and r["blocks"][i].get("recall") is not None]
        if pts:
            a3.plot(*zip(*pts), label=f"block {i}")
    a3.axhline(0.9, color="black", lw=0.8, ls="--", label="target 0.9")
    a3.set_xlabel("step")
    a3.set_ylabel("attention mass covered by the predicted index")
    a3.set_ylim(0, 1.02)
    a3.set_title("DSV predictor recall")
    a3.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv_ext.compare",
                                description="Train with full attention and with DSV; compare.")
    p.add_argument("--config", required=True)
    p.add_argument("--out", default=None, help="output folder (default runs/compare-<name>)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SEC.KEY=VALUE")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep dense/ckpt_last.pt and dsv/ckpt_last.pt (deleted by default)")
    p.add_argument("--seeds", type=int, default=1,
                   help="train each arm with this many seeds (train.seed + i) and report mean, spread and "
                        "95%% intervals (compare_seeds.md); 3 or more for an interval worth reading")
    p.add_argument("--val-videos", type=int, default=None,
                   help="validation videos (overrides train.val_videos; each at every train.val_timesteps)")
    a = p.parse_args(argv)

    def body() -> int:
        if a.seeds < 1:
            raise ValueError(f"--seeds: expected an integer >= 1, got {a.seeds}")
        ov = list(a.overrides)
        if a.val_videos is not None:
            if a.val_videos < 1:
                raise ValueError(f"--val-videos: expected an integer >= 1, got {a.val_videos}")
            ov.append(f"train.val_videos={a.val_videos}")
        cfg = load_config(a.config, ov)
        out = a.out or os.path.join("runs", f"compare-{cfg.get('name', 'run')}")
        if a.seeds > 1:
            compare_seeds(cfg, out, a.seeds, steps=a.steps, device=a.device, progress=not a.no_progress,
                          keep_checkpoints=a.keep_checkpoints)
            print(open(os.path.join(out, "compare_seeds.md")).read())
            print(f"outputs in {out}")
            return 0
        compare(cfg, out, steps=a.steps, device=a.device, progress=not a.no_progress,
                keep_checkpoints=a.keep_checkpoints)
        print(open(os.path.join(out, "compare.md")).read())
        print(f"outputs in {out}")
        return 0

    return run_command(p.prog, body)


if __name__ == "__main__":
    sys.exit(main())
