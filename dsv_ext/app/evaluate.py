"""Paired quality measurement: the validation-loss increase that DSV's sparse attention itself
causes in one trained model.

    python -m dsv_ext.app.evaluate --checkpoint runs/small-dsv/ckpt_last.pt [--out DIR]
        [--targets 0.85,0.9,0.95,0.98] [--val-videos N] [--val-timesteps 0.1,0.3,...]
        [--calib-batches 4] [--no-per-block] [--device cuda] [--set SEC.KEY=VALUE ...]

One checkpoint of an ``attention=dsv`` run (its DiT weights and trained predictors) is evaluated
on the validation set of its config (fixed videos, timesteps and noise: the same for every arm)
with full attention and with sparse attention, and the loss differences are taken sample by
sample, so the training noise that makes two runs differ is not in them:

- for every recall target T of ``--targets``, the per-head K of the recall rule
  (``DSVConfig.k_rule = "recall"``, see docs/QUALITY.md) from the predictors' recall-versus-K
  measured on ``--calib-batches`` training batches (heads needing more than
  ``dsv.recall_max_density`` of the keys attend to all keys, as in training), then
  * ``all``: every eligible block sparse at those K's,
  * ``dispatched``: only the blocks the dispatcher would run sparse (its cost model on this device),
  * ``block i``: block i alone sparse, every other block dense (skip with ``--no-per-block``);
- ``checkpoint``: the controller state saved in the checkpoint (its K's and per-block choices),
  when the run was in stage 2.

Every arm reports the mean paired difference of the loss (sparse - full) and its standard error
over the validation videos (differences averaged over a video's timesteps first, then the spread
over videos), also relative to the full-attention loss. Writes ``evaluate.json``, ``evaluate.md``
and (with matplotlib) ``evaluate.png`` into ``--out`` (default: ``<checkpoint dir>/evaluate``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..modules.attention import SparseAttention
from .checkpoint import load_checkpoint
from .cli import run_command
from ..grouping import cube_permutation
from ..recall import density_for_recall, recall_curve
from .common import (BatchStream, TrainConfig, ValidationSet, autocast, build_model, flow_matching_loss,
                     inference_state_dict, load_config, resolve_device, validation_losses)

__all__ = ["per_sample_losses", "paired_stats", "measure_recall_curves", "evaluate", "main"]

DEFAULT_TARGETS = (0.85, 0.9, 0.95, 0.98)


def per_sample_losses(model, valset: ValidationSet, device, precision: str, batch_size: int = 8) -> torch.Tensor:
    """float64 [n_videos * n_timesteps]: the flow-matching loss of every validation sample (video
    j at timestep t is sample j * n_timesteps + t), in eval mode (dsv_ext.app.common.validation_losses)."""
    return validation_losses(model, valset, device, precision, batch_size)


def paired_stats(a: torch.Tensor, b: torch.Tensor, per_video: int) -> Dict[str, Any]:
    """Paired difference b - a of per-sample losses (samples ordered video-major, ``per_video``
    timesteps per video): mean, its standard error over the videos, and both relative to mean(a).
    With one video the standard error is None."""
    if a.shape != b.shape:
        raise ValueError(f"b: expected the shape of a {tuple(a.shape)}, got {tuple(b.shape)}")
    if per_video < 1 or a.numel() % per_video:
        raise ValueError(f"per_video: {per_video} does not divide the {a.numel()} samples")
    d = (b - a).double().view(-1, per_video).mean(1)
    n = d.numel()
    base = float(a.double().mean())
    mean = float(d.mean())
    se = float(d.std(unbiased=True) / math.sqrt(n)) if n > 1 else None
    return {"loss_full": base, "loss_sparse": float(b.double().mean()), "diff": mean, "diff_se": se,
            "rel": mean / base if base else None,
            "rel_se": (se / base if se is not None and base else None), "videos": n}


def provenance(device) -> Dict[str, str]:
    """When, from which commit and on what a result was measured (UTC date, git commit of the
    checkout the package runs from, or the environment variable DSV_COMMIT when set, else
    "unknown"; device name)."""
    import datetime

    from .._buildcheck import source_commit

    commit = source_commit()
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit, "device_name": name}


def _cores(model) -> List[SparseAttention]:
    return [m for m in model.modules() if isinstance(m, SparseAttention)]


@torch.no_grad()
def measure_recall_curves(model, batches, device, precision: str) -> List[Optional[torch.Tensor]]:
    """Per SparseAttention of ``model`` (in module order): the recall-versus-K curve [H, bins] of
    its predictors (dsv_ext.recall.recall_curve on the profiler's sampled rows, all offsets
    visited in turn, at most config.recall_rows rows per call), averaged over the forwards of
    ``batches`` (an iterable of (x0, noise, t)). The model runs dense (its blocks' use_sparse is
    left off during the measurement)."""
    cores = _cores(model)
    sums: List[Optional[torch.Tensor]] = [None] * len(cores)
    counts = [0] * len(cores)
    calls = [0]
    saved = [(m.stage, m.use_sparse) for m in cores]

    def hook(i):
        def fn(mod, args, kwargs):
            q, k = args[0], args[1]
            grid = kwargs.get("grid", args[3] if len(args) > 3 else None)
            scale = kwargs.get("scale", args[4] if len(args) > 4 else None)
            grid = mod.grid if grid is None else tuple(grid)
            cfg = mod.config
            B, S, H, D = q.shape
            qp = q if grid is None else q.index_select(1, cube_permutation(grid, cfg.cube, S, q.device)[0])
            off = (calls[0] * 7) % min(cfg.row_sample_stride, S)
            rows = torch.arange(off, S, cfg.row_sample_stride, device=q.device)
            c = recall_curve(qp.float(), k.float(), mod.predictor.wq, mod.predictor.wk, rows, cfg.group_size,
                             cfg.k_multiple, scale, max_rows=cfg.recall_rows).mean(0).double()
            if sums[i] is not None and sums[i].shape != c.shape:
                raise ValueError("batches: the sequence length changed between batches")
            sums[i] = c if sums[i] is None else sums[i] + c
            counts[i] += 1
        return fn

    hs = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(cores)]
    was = model.training
    model.eval()
    try:
        for m in cores:
            m.use_sparse = False
        for x0, noise, t in batches:
            with autocast(device, precision):
                flow_matching_loss(model, x0.to(device), noise.to(device), t.to(device))
            calls[0] += 1
    finally:
        for h in hs:
            h.remove()
        for m, (st, us) in zip(cores, saved):
            m.stage, m.use_sparse = st, us
        model.train(was)
    return [None if s is None else (s / n).float() for s, n in zip(sums, counts)]


def _set_dense(cores) -> None:
    for m in cores:
        m.stage, m.use_sparse = 1, False


def _set_sparse(cores, which) -> None:
    for i, m in enumerate(cores):
        m.stage = 2
        m.use_sparse = bool(i in which) and m.density is not None and m.sparse_supported()


def evaluate(cfg: Dict[str, Any], ckpt: Dict[str, Any], out_dir: Optional[str] = None,
             targets: Sequence[float] = DEFAULT_TARGETS, device: Optional[str] = None,
             calib_batches: int = 4, per_block: bool = True, progress: bool = True) -> Dict[str, Any]:
    """Run the paired evaluation (see the module docstring); ``cfg`` is the checkpoint's config
    (with any overrides), ``ckpt`` the loaded checkpoint dict. Returns the result dict (also
    written to ``out_dir`` when given)."""
    from ..control.controller import DSVController

    if not targets:
        raise ValueError("targets: expected at least one recall target")
    for t in targets:
        if not isinstance(t, (int, float)) or not 0.0 < float(t) <= 1.0:
            raise ValueError(f"targets: each target must be in (0, 1], got {t!r}")
    if not isinstance(calib_batches, int) or calib_batches < 1:
        raise ValueError(f"calib_batches: expected an integer >= 1, got {calib_batches!r}")
    if ckpt.get("attention", cfg["model"].get("attention")) != "dsv":
        raise ValueError("checkpoint: trained with attention="
                         f"{ckpt.get('attention')!r}; the paired evaluation needs a dsv run (its predictors)")
    log = (lambda s: print(s, file=sys.stderr)) if progress else (lambda s: None)
    dev = resolve_device(device)
    tcfg = TrainConfig.from_dict(cfg["train"])
    torch.manual_seed(tcfg.seed)
    model, dsv_cfg = build_model(cfg, "dsv", dev)
    model.load_state_dict(inference_state_dict(ckpt))
    cores = _cores(model)
    if not cores:
        raise ValueError("checkpoint: the model has no SparseAttention blocks")
    eligible = [i for i, m in enumerate(cores) if m.sparse_supported()]
    valset = ValidationSet(cfg, tcfg)
    n_t = len(tcfg.val_timesteps)
    bs = tcfg.val_batch_size
    t0 = time.perf_counter()

    def losses(tag: str) -> torch.Tensor:
        r = per_sample_losses(model, valset, dev, tcfg.precision, bs)
        log(f"evaluate: {tag}: loss {float(r.mean()):.5f} ({time.perf_counter() - t0:.0f} s)")
        return r

    _set_dense(cores)
    full = losses("full attention")
    res: Dict[str, Any] = {
        "config": cfg.get("name"), "checkpoint_step": ckpt.get("step"), "device": str(dev),
        "val_videos": valset.x.shape[0] // n_t, "val_timesteps": list(tcfg.val_timesteps),
        "tokens_per_sample": model.cfg.num_tokens, "blocks": len(cores), "eligible_blocks": eligible,
        "loss_full": float(full.mean()), "calib_batches": calib_batches,
        "recall_max_density": dsv_cfg.recall_max_density, "provenance": provenance(dev), "arms": [],
    }

    # the checkpoint's own policy (its controller state), when it reached stage 2
    sd = ckpt.get("controller")
    if sd is not None and int(sd.get("stage", 1)) == 2:
        ctl = DSVController(model, dsv_cfg)
        ctl.load_state_dict(sd)
        which = [i for i, m in enumerate(cores) if m.use_sparse]
        dens = [[k / m.k_seq_len for k in m.head_k] or None for m in cores]  # the K's it runs with
        if which:
            _set_sparse(cores, set(which))
            st = paired_stats(full, losses("checkpoint policy"), n_t)
            res["arms"].append({"arm": "checkpoint", "target": None, "sparse_blocks": which,
                                "density": _mean_density([dens[i] for i in which]), **st})

    # recall-versus-K of the trained predictors on training batches (as the profiler sees them)
    from .data import make_dataset

    ds = make_dataset(dict(cfg["data"]), "train", seed=tcfg.seed)
    stream = BatchStream(ds, tcfg.batch_size, tcfg.seed)
    curves = measure_recall_curves(model, (stream.batch(s, tcfg.timestep_sampling) for s in range(calib_batches)),
                                   dev, tcfg.precision)
    S = model.cfg.num_tokens
    res["curves"] = [None if c is None else c.tolist() for c in curves]
    for T in targets:
        cfg_t = dsv_cfg.replace(recall_target=float(T), k_rule="recall")
        ctl = DSVController(model, cfg_t)
        ctl.recall_density = [None if c is None else
                              [density_for_recall(c[h], float(T), S, cfg_t.k_multiple) for h in range(c.shape[0])]
                              for c in curves]
        ctl.sparsity_ema = [[0.0] * m.num_heads for m in cores]
        for m in cores:
            m.set_workload(S, bs, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        ctl.stage = 2
        ctl._update_dispatch()  # per-head K of the recall rule and the dispatcher's choice
        dispatched = [i for i, m in enumerate(cores) if m.use_sparse]
        dens = [[k / S for k in m.head_k] or None for m in cores]  # K / S as run (min_density included)
        base = {"target": float(T), "head_density": dens, "head_k": [m.head_k for m in cores]}
        runs = [("all", eligible)]
        if dispatched != eligible:
            runs.append(("dispatched", dispatched))
        if per_block:
            runs += [(f"block {i}", [i]) for i in eligible]
        for name, which in runs:
            if not which:
                res["arms"].append({"arm": name, **base, "sparse_blocks": [], "density": None,
                                    **paired_stats(full, full, n_t)})
                continue
            _set_sparse(cores, set(which))
            st = paired_stats(full, losses(f"target {T}, {name}"), n_t)
            res["arms"].append({"arm": name, **base, "sparse_blocks": list(which),
                                "density": _mean_density([dens[i] for i in which]), **st})
    _set_dense(cores)
    res["eval_time_s"] = time.perf_counter() - t0
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "evaluate.json"), "w") as f:
            json.dump(res, f, indent=1)
        write_table(res, os.path.join(out_dir, "evaluate.md"))
        try:
            write_plot(res, os.path.join(out_dir, "evaluate.png"))
        except ImportError as e:
            print(f"evaluate: no plot ({e}); pip install matplotlib", file=sys.stderr)
    return res


def _mean_density(dens) -> Optional[float]:
    xs = [d for ds in dens if ds is not None for d in ds]
    return sum(xs) / len(xs) if xs else None


def _pct(v, nd=2):
    return "-" if v is None else f"{100 * v:+.{nd}f}%"


def _f(v, nd=4):
    return "-" if v is None else f"{v:.{nd}f}"


def write_table(res: Dict[str, Any], path: str) -> None:
    L = [f"# Paired evaluation: `{res['config']}` at step {res['checkpoint_step']}", "",
         f"{res['val_videos']} validation videos x {len(res['val_timesteps'])} timesteps "
         f"({res['tokens_per_sample']} tokens each), device `{res['device']}`; every arm on the same "
         "samples, noise and timesteps as full attention. K per head from the recall rule on "
         f"{res['calib_batches']} training batches (heads needing more than "
         f"{res['recall_max_density']} of the keys attend to all keys). Increase = sparse - full, "
         "+- one standard error over the videos.", "",
         f"Full attention: validation loss {_f(res['loss_full'], 5)}.", ""]
    p = res.get("provenance")
    if p:
        L += [f"Measured {p['date']}, commit {p['commit']}, {p['device_name']}.", ""]
    L += [
         "| arm | recall target | sparse blocks | mean K/S | loss | increase | relative increase |",
         "|---|---|---|---|---|---|---|"]
    for a in res["arms"]:
        inc = f"{a['diff']:+.5f}" + (f" +- {a['diff_se']:.5f}" if a["diff_se"] is not None else "")
        rel = _pct(a["rel"]) + (f" +- {100 * a['rel_se']:.2f}%" if a["rel_se"] is not None else "")
        L.append(f"| {a['arm']} | {_f(a['target'], 2) if a['target'] is not None else '-'} | "
                 f"{len(a['sparse_blocks'])} | {_f(a['density'], 3)} | {_f(a['loss_sparse'], 5)} | {inc} | {rel} |")
    L += ["", "`all`: every eligible block sparse; `dispatched`: the blocks the dispatcher picks on this "
          "device (shown when it differs from all); `block i`: block i alone sparse; `checkpoint`: the "
          "run's own controller state.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def write_plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in res["arms"] if a["arm"] == "all" and a["target"] is not None]
    if not arms:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [a["target"] for a in arms]
    ax.errorbar(xs, [100 * a["rel"] for a in arms], yerr=[100 * (a["rel_se"] or 0) for a in arms],
                fmt="o-", capsize=3, label="all blocks sparse")
    ax.axhline(1.0, color="gray", ls="--", lw=0.8, label="1%")
    ax.axhline(0.0, color="black", lw=0.5)
    ax.set_xlabel("recall target")
    ax.set_ylabel("validation loss increase (%)")
    ax2 = ax.twinx()
    ax2.plot(xs, [a["density"] for a in arms], "s:", color="tab:orange", label="mean K / S")
    ax2.set_ylabel("mean K / S")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_title(f"paired loss increase: {res['config']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _floats(s: str, name: str) -> List[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numbers, got {s!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv_ext.app.evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="ckpt_*.pt of an attention=dsv training run")
    p.add_argument("--out", default=None, help="output folder (default <checkpoint dir>/evaluate)")
    p.add_argument("--targets", default=",".join(str(t) for t in DEFAULT_TARGETS),
                   help="comma-separated recall targets (default %(default)s)")
    p.add_argument("--val-videos", type=int, default=None, help="validation videos (overrides train.val_videos)")
    p.add_argument("--val-timesteps", default=None, help="comma-separated validation times in (0, 1)")
    p.add_argument("--calib-batches", type=int, default=4,
                   help="training batches on which recall versus K is measured (default 4)")
    p.add_argument("--no-per-block", action="store_true", help="skip the one-block-sparse arms")
    p.add_argument("--device", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SEC.KEY=VALUE")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    def body() -> int:
        ckpt = load_checkpoint(a.checkpoint, map_location="cpu")  # verified, one-line errors
        ov = list(a.overrides)
        if a.val_videos is not None:
            ov.append(f"train.val_videos={a.val_videos}")
        if a.val_timesteps is not None:
            ov.append(f"train.val_timesteps=[{','.join(str(x) for x in _floats(a.val_timesteps, '--val-timesteps'))}]")
        cfg = load_config(base=ckpt["config"], overrides=ov)
        out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.checkpoint)), "evaluate")
        evaluate(cfg, ckpt, out, targets=_floats(a.targets, "--targets"), device=a.device,
                 calib_batches=a.calib_batches, per_block=not a.no_per_block, progress=not a.no_progress)
        print(open(os.path.join(out, "evaluate.md")).read())
        print(f"outputs in {out}")
        return 0

    return run_command(p.prog, body)


if __name__ == "__main__":
    sys.exit(main())
