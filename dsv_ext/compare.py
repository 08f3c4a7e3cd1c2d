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
against the seed spread), and whether the gap is resolved relative to 1% (``dsv_ext/seeds.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .cli import check_numeric_args, run_command
from .train import load_config, train

__all__ = ["compare", "write_table", "write_plot", "main"]


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
        stopped = runs[att]["summary"].get("stopped_by")
        if stopped:  # SIGINT / SIGTERM: keep the checkpoint, run nothing more
            raise KeyboardInterrupt(f"{stopped}: the {att} run stopped at step "
                                    f"{runs[att]['summary']['stopped_at_step']}; its checkpoint is "
                                    f"{os.path.join(out_dir, att, 'ckpt_last.pt')}")
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
        check_numeric_args(a, ints={"steps": 1})
        if a.seeds < 1:
            raise ValueError(f"--seeds: expected an integer >= 1, got {a.seeds}")
        ov = list(a.overrides)
        if a.val_videos is not None:
            if a.val_videos < 1:
                raise ValueError(f"--val-videos: expected an integer >= 1, got {a.val_videos}")
            ov.append(f"train.val_videos={a.val_videos}")
        cfg = load_config(a.config, ov)
        out = a.out or os.path.join("runs", f"compare-{cfg.get('name', 'run')}")
        if a.seeds > 1:  # dsv_ext/seeds.py: the pair per seed, then the statistics over seeds
            from .seeds import compare_seeds

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

    def guarded() -> int:
        try:
            return body()
        except KeyboardInterrupt as e:
            print(f"{p.prog}: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
            return 143 if str(e).startswith("SIGTERM") else 130

    return run_command(p.prog, guarded)


if __name__ == "__main__":
    sys.exit(main())
