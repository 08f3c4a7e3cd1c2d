"""Train the reference video DiT with flow matching, with DSV sparse attention or full attention.

    python -m dsv_ext.app.train --config configs/tiny.yaml [--out DIR] [--steps N] [--resume CKPT]
                            [--attention dense|dsv] [--device cpu|cuda] [--set train.lr=1e-4 ...]
    python -m dsv_ext.app.train --config configs/tiny.yaml --init runs/tiny-dsv/ckpt_last.pt \
                            --set data.frames=16 --out runs/tiny-dsv-16      # progressive training

The config file has four sections: ``model`` (dsv_ext.app.models.DiTConfig), ``data``
(dsv_ext.app.data.make_dataset), ``train`` (:class:`TrainConfig` below) and ``dsv``
(dsv_ext.config.DSVConfig, used with ``--attention dsv``).

Objective (rectified flow / flow matching): for clean latents x0, noise e ~ N(0, I) and a time
t in (0, 1) (logit-normal by default), x_t = (1 - t) x0 + t e and the model predicts the velocity
e - x0; loss = mean squared error. Everything random in a step (the batch indices, noise and t)
is a pure function of (seed, step), so a resumed run continues exactly like an uninterrupted one.

The validation loss is the same objective on ``train.val_videos`` held-out procedural videos (or
the held-out files of a folder), at the fixed times ``train.val_timesteps``, with fixed noise:
deterministic, comparable across runs and across attention kinds.

Outputs in ``--out`` (default ``runs/<config name>-<attention>``): ``config.yaml`` (resolved),
``metrics.jsonl`` (one JSON object per logged step, ``"kind": "train"`` or ``"val"``),
``ckpt_last.pt`` (model, optimizer, DSV controller, step; also every ``train.ckpt_every`` steps
as ``ckpt_<step>.pt``) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .._buildcheck import source_commit
from .cli import check_numeric_args, run_command
from .common import (BatchStream, TrainConfig, ValidationSet, autocast, build_model, flow_matching_loss,
                     inference_state_dict, init_context_parallel, load_config, resolve_device, validation_loss,
                     validation_losses, validation_se)
from .data import make_dataset

__all__ = ["TrainConfig", "load_config", "train", "build_model", "validation_loss", "WeightEMA",
           "inference_state_dict", "main"]


# ---------------------------------------------------------------------------------------------
# Controller helpers (tolerant of the controller's optional fields)
# ---------------------------------------------------------------------------------------------

def _controller_stats(controller) -> Dict[str, Any]:
    if controller is None:
        return {"stage": 1}
    out: Dict[str, Any] = {"stage": int(getattr(controller, "stage", 1))}
    try:
        summ = controller.summary()
    except Exception:
        summ = {}
    for k, v in summ.items():
        key = k.split("/", 1)[-1]
        key = {"loss": "pred_loss", "step": "controller_step"}.get(key, key)
        if isinstance(v, torch.Tensor):
            v = v.tolist() if v.numel() > 1 else float(v)
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[key] = v
    out["stage"] = int(getattr(controller, "stage", out.get("stage", 1)))
    blocks = _per_block(controller)
    if blocks:
        out["blocks"] = blocks
    return out


def _to_float_list(v) -> Optional[List[Optional[float]]]:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        v = v.detach().float().flatten().cpu().tolist()
    elif isinstance(v, (int, float)):
        v = [float(v)]
    else:
        try:
            v = [float(x) for x in v]
        except Exception:
            return None
    return [x if math.isfinite(x) else None for x in v]


def _mean(xs):
    xs = [x for x in (xs or []) if x is not None]
    return sum(xs) / len(xs) if xs else None


def _per_block(controller) -> List[Dict[str, Any]]:
    """Per-block sparsity (EMA, mean over heads), smoothed predictor loss, latest recall and
    whether the block runs sparse, from the controller's state."""
    rows = []
    mods = getattr(controller, "modules", []) or []
    emas = getattr(controller, "sparsity_ema", None) or [None] * len(mods)
    recs = getattr(controller, "recall", None) or [None] * len(mods)
    losses = getattr(controller, "_loss_ema", None) or [None] * len(mods)
    if losses and any(l is not None for l in losses):
        host = [None if l is None else _mean(_to_float_list(l)) for l in losses]
    else:
        host = [None] * len(mods)
    for (name, mod), ema, rec, lo in zip(mods, emas, recs, host):
        rows.append({
            "name": name,
            "sparsity": _mean(_to_float_list(ema)),
            "head_sparsity": _to_float_list(ema),
            "recall": _mean(_to_float_list(rec)),
            "pred_loss": lo,
            "sparse": bool(getattr(mod, "use_sparse", False)) and int(getattr(controller, "stage", 1)) == 2,
            "head_k": list(getattr(mod, "head_k", []) or []),
        })
    return rows


def _fmt(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _switch_line(controller, step: int) -> str:
    """The console line at the stage switch."""
    st = _controller_stats(controller)
    blocks = st.get("blocks", [])
    cfg = getattr(controller, "config", None)
    forced = getattr(cfg, "force_stage2_step", None) is not None and step >= cfg.force_stage2_step
    if forced:
        why = f"forced at dsv.force_stage2_step={cfg.force_stage2_step}"
    elif getattr(cfg, "switch_rule", "loss") == "dispatch":
        why = "dsv.switch_rule=dispatch: the lists pay in a block"
    else:
        why = f"predictor loss {_fmt(st.get('pred_loss'), '.4f')} < dsv.switch_loss={getattr(cfg, 'switch_loss', 'n/a')}"
    return (f"step {step}: switched to stage 2 ({why}): {sum(1 for b in blocks if b['sparse'])}/"
            f"{len(blocks)} blocks sparse, mean sparsity {_fmt(st.get('sparsity'))}, "
            f"recall {_fmt(st.get('recall'))}")


def _summary_table(summary: Dict[str, Any], vals: List[Dict[str, Any]], st: Dict[str, Any],
                   out_dir: str) -> List[str]:
    """The console table at the end of a run."""
    tps = summary.get("tokens_per_s")
    rows = [("steps", f"{summary['steps']}" + (f" (resumed from {summary['resumed_from']})"
                                               if summary.get("resumed_from") else "")),
            ("final train loss", _fmt(summary.get("final_train_loss"), ".4f")),
            ("final val loss", _fmt(summary.get("final_val_loss"), ".4f")),
            ("val loss by step", "  ".join(f"{r['step']}: {r['val_loss']:.4f}" for r in vals) or "n/a"),
            ("tokens/s", _fmt(tps, ".0f") + (f" (stage 1: {_fmt(summary.get('stage1_tokens_per_s'), '.0f')}, "
                                             f"stage 2: {summary['stage2_tokens_per_s']:.0f})"
                                             if summary.get("stage2_tokens_per_s") else "")),
            ("wall time", f"{summary['wall_time_s']:.0f} s")]
    if summary.get("attention") == "dsv":
        blocks = st.get("blocks", [])
        rows += [("DSV stage", f"{st.get('stage', 1)}" + (f" (switched at step {st['switch_step']})"
                                                         if st.get("switch_step") else "")),
                 ("blocks sparse", f"{sum(1 for b in blocks if b['sparse'])}/{len(blocks)}"),
                 ("mean sparsity", _fmt(st.get("sparsity"))),
                 ("mean recall", _fmt(st.get("recall")))]
    rows.append(("outputs", out_dir))
    blocks = st.get("blocks", []) if summary.get("attention") == "dsv" else []
    w = max(len(k) for k in [k for k, _ in rows] + [b["name"] for b in blocks])
    title = f"summary: {summary['name']} / {summary['attention']} on {summary['device']}"
    lines = [title, "-" * len(title)] + [f"{k:<{w}}  {v}" for k, v in rows]
    if blocks:
        lines.append(f"{'block':<{w}}  sparse  sparsity  recall")
        for b in blocks:
            lines.append(f"{b['name']:<{w}}  {'yes' if b['sparse'] else 'no':<6}  "
                         f"{_fmt(b['sparsity']):>8}  {_fmt(b['recall']):>6}")
    return lines


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def _lr_at(step: int, tcfg: TrainConfig) -> float:
    if tcfg.warmup_steps > 0 and step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    if tcfg.lr_schedule == "cosine":
        span = max(tcfg.steps - tcfg.warmup_steps - 1, 1)
        p = min(max(step - tcfg.warmup_steps, 0) / span, 1.0)
        r = tcfg.lr_min_ratio
        return tcfg.lr * (r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p)))
    return tcfg.lr


class WeightEMA:
    """Exponential moving average of a model's trainable weights, kept in float32.

    ``update()`` after each optimizer step (decay ramps up as min(decay, (1 + n) / (10 + n)) over
    the first updates, so early averages are not dominated by the initial weights);
    ``with ema.applied():`` swaps the averages into the model and restores the live weights after.
    ``state_dict()`` maps parameter names to averages (loadable into the model with
    ``load_state_dict(..., strict=False)``) plus the update count.
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], decay: float):
        ids = {id(p) for p in params}
        self.names = [n for n, p in model.named_parameters() if id(p) in ids]
        byname = dict(model.named_parameters())
        self.params = [byname[n] for n in self.names]
        self.decay = float(decay)
        self.count = 0
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1.0 + self.count) / (10.0 + self.count))
        live = [p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.shadow, live, 1.0 - d)
        self.count += 1

    @contextlib.contextmanager
    def applied(self):
        backup = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for p, s in zip(self.params, self.shadow):
                    p.copy_(s)
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> Dict[str, Any]:
        return {"decay": self.decay, "count": self.count,
                "params": {n: s.clone() for n, s in zip(self.names, self.shadow)}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sorted(sd["params"]) != sorted(self.names):
            raise KeyError("ema: the averaged parameters do not match the model's")
        self.count = int(sd["count"])
        for i, n in enumerate(self.names):
            self.shadow[i].copy_(sd["params"][n])



def _save_checkpoint(path, step, model, opt, controller, cfg, attention, history_tail,
                     log_window=None, ema=None):
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "controller": controller.state_dict() if controller is not None else None,
        "ema": ema.state_dict() if ema is not None else None,
        "config": cfg,
        "attention": attention,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "history_tail": history_tail,
        # the partial metrics window (tokens, time, loss sum, steps) since the last train line,
        # so a resumed run logs the same window means as an uninterrupted one
        "log_window": log_window,
    }
    from .checkpoint import save_checkpoint

    save_checkpoint(state, path)  # atomic, with a checksum (dsv_ext/app/checkpoint.py)


def _resume_from(path, dev, cfg, attention, model, opt, controller, log, ema=None) -> Dict[str, Any]:
    """Load a checkpoint into model / optimizer / controller and the RNGs; warn about config
    values that differ from the checkpoint's (refuse only where the weights cannot load)."""
    from .checkpoint import CheckpointError, config_diff, format_diff, load_checkpoint

    ck = load_checkpoint(path, map_location=dev, required=("step", "model", "optimizer", "config"))
    if controller is not None and ck.get("controller") is None:
        raise ValueError(f"resume: {path} has no DSV controller state "
                         f"(it was trained with attention={ck.get('attention')})")
    if controller is None and ck.get("controller") is not None:
        raise ValueError(f"resume: {path} was trained with attention=dsv; "
                         "resume it with --attention dsv")
    # train.steps is the total step count: extending a run is what resuming is for
    diff = config_diff(_with_defaults(ck.get("config") or {}), _with_defaults(cfg),
                       ignore=("train.steps", "model.attention"))
    try:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if controller is not None:
            controller.load_state_dict(ck["controller"])
        if ema is not None and ck.get("ema"):
            ema.load_state_dict(ck["ema"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()
        why = f"the config differs ({format_diff(diff)})" if diff else \
            (first[0] if first else type(e).__name__)
        raise CheckpointError(f"resume: {path} does not fit this model: {why}") from None
    if diff:
        log(f"warning: resuming {path} with a different config: {format_diff(diff)}")
    if ema is not None and not ck.get("ema"):
        log(f"warning: {path} holds no weight average: it starts from the resumed weights")
        ema.shadow = [p.detach().float().clone() for p in ema.params]
    # RNG states are CPU ByteTensors; a checkpoint loaded with map_location="cuda" moved them
    torch.set_rng_state(ck["torch_rng"].cpu())
    if ck.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in ck["cuda_rng"]])
    ck["config_diff"] = diff
    return ck


def _init_from(path, dev, model, controller, log, ema=None) -> Dict[str, Any]:
    """Start a new run from a checkpoint's weights (progressive training: e.g. on longer clips
    than the checkpoint saw): the model gets the weights evaluation uses (the moving average
    where kept; a slim copy works), a DSV run also the checkpoint's trained predictors; the
    optimizer, the step count, the weight average and the DSV stage start fresh, and the data
    section may differ (the position embedding follows the clip shape; the weights do not
    depend on it). One-line error where the model does not fit."""
    from .checkpoint import CheckpointError, load_checkpoint

    ck = load_checkpoint(path, map_location=dev, required=("model", "config"))
    try:
        # a DSV model's state holds its predictors (".predictor."); between a dense and a DSV
        # model only those may be missing or left over
        res = model.load_state_dict(inference_state_dict(ck), strict=False)
        off = [k for k in list(res.missing_keys) + list(res.unexpected_keys) if ".predictor." not in k]
        if off:
            raise ValueError(f"{len(res.missing_keys)} weights missing, {len(res.unexpected_keys)} not in "
                             f"this model (e.g. {off[0]})")
        cs = ck.get("controller")
        if controller is not None and cs is not None:  # the controller's copy of the predictors
            names = [n for n, _ in controller.modules]
            if list(cs.get("names", [])) != names:
                raise ValueError(f"its DSV blocks {cs.get('names')} are not this model's {names}")
            for n, m in controller.modules:
                m.predictor.load_state_dict(cs["predictors"][n])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
        why = next((l for l in lines if l.startswith("size mismatch")), lines[0] if lines else type(e).__name__)
        raise CheckpointError(f"init: {path} does not fit this model: {why}") from None
    trained = controller is not None and not any(".predictor." in k for k in res.missing_keys)
    what = "weights and DSV predictors" if trained else "weights"
    if controller is not None and not trained:
        log(f"note: init: {path} was trained with attention={ck.get('attention')}: "
            "the DSV predictors start untrained")
    if ema is not None:
        ema.shadow = [p_.detach().float().clone() for p_ in ema.params]
    log(f"init: {what} of {path} (step {ck.get('step')}); optimizer, step count and DSV stage start fresh")
    return ck


def _with_defaults(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The train and dsv sections with their defaults filled in (for comparing configs)."""
    from ..config import DSVConfig

    out = copy.deepcopy(cfg)
    for sec, fill in (("train", lambda d: dataclasses.asdict(TrainConfig.from_dict(d))),
                      ("dsv", lambda d: DSVConfig.from_dict(d).to_dict())):
        try:
            out[sec] = fill(dict(cfg.get(sec) or {}))
        except (ValueError, TypeError):
            pass  # compare as written
    return out


def train(cfg: Dict[str, Any], out_dir: Optional[str] = None, steps: Optional[int] = None,
          resume: Optional[str] = None, attention: Optional[str] = None,
          device: Optional[str] = None, progress: bool = True,
          log: Callable[[str], None] = None, context_parallel: bool = False,
          time_limit_s: Optional[float] = None,
          on_step: Optional[Callable[[int, Dict[str, Any]], None]] = None,
          init: Optional[str] = None) -> Dict[str, Any]:
    """Run (or resume) a training run. Returns ``{"history": [...], "val": [...], "summary": {...}}``.

    ``cfg`` is a dict from :func:`load_config`; ``steps`` overrides ``train.steps`` (the total
    step count, also when resuming); ``attention`` overrides ``model.attention``.
    ``context_parallel``: every rank of the (initialised) default process group trains the same
    batch, each sequence split over the ranks (``dsv_ext.parallel``); rank 0 writes the outputs.
    ``time_limit_s``: stop before the step that would end past this many seconds of wall time,
    write ``ckpt_last.pt`` (no final validation) and return with ``summary["complete"]`` False;
    resuming from that checkpoint continues exactly (for jobs cut into time-limited chunks).
    ``on_step(step, info)``: called after each optimizer step (``step`` counts from 1; ``info``
    has ``loss``, ``stage``, ``step_time_s`` and ``controller``), e.g. by benchmarks/soak.py.
    ``init``: a checkpoint (or its slim copy) whose weights, and DSV predictors, a new run starts
    from (:func:`_init_from`: progressive training, e.g. continuing on longer clips); ignored
    when resuming (the resumed run started from it).
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    cp_rank, cp_world = 0, 1
    if context_parallel:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("context_parallel: torch.distributed is not initialised (launch with "
                               "torchrun and python -m dsv_ext.app.train --context-parallel)")
        cp_rank, cp_world = dist.get_rank(), dist.get_world_size()
        if cp_rank != 0:
            progress = False
            log = (lambda s: None)
    cfg = copy.deepcopy(cfg)
    if steps is not None:
        cfg["train"]["steps"] = steps  # range-checked with the section
    tcfg = TrainConfig.from_dict(cfg["train"])
    dev = resolve_device(device)
    if dev.type == "cpu" and tcfg.threads > 0:
        # context-parallel ranks on one machine share its cores
        torch.set_num_threads(max(1, tcfg.threads // cp_world))
    attention = attention or cfg["model"].get("attention", "dsv")
    cfg["model"]["attention"] = attention
    if context_parallel and attention != "dsv":
        raise ValueError("context_parallel: needs attention=dsv (its stage 1 is dense context-parallel "
                         f"attention), got attention={attention!r}")
    name = cfg.get("name", "run")
    out_dir = out_dir or os.path.join("runs", f"{name}-{attention}")
    writer = cp_rank == 0  # the other context-parallel ranks compute the same numbers
    if writer:
        os.makedirs(out_dir, exist_ok=True)

    # The DiT weights come from a private generator (VideoDiT.initialize_weights); the global RNG
    # seeds everything else created here (DSV predictor projections).
    torch.manual_seed(tcfg.seed)
    model, dsv_cfg = build_model(cfg, attention, dev)
    if tcfg.grad_checkpointing and dev.type == "cuda":
        model.grad_checkpointing = True
    if context_parallel:
        from .. import parallel as _cp

        _cp.enable(model)
        model.set_context_parallel(True, cube=dsv_cfg.cube)
        log(f"context parallel: {cp_world} ranks, {model.cfg.num_tokens // cp_world} tokens per rank")
    params = model.dit_parameters()
    opt = torch.optim.AdamW(params, lr=tcfg.lr, betas=tuple(tcfg.betas),
                            weight_decay=tcfg.weight_decay,
                            fused=(dev.type == "cuda") or None)
    ema = WeightEMA(model, params, tcfg.ema_decay) if tcfg.ema_decay > 0 else None
    controller = None
    if attention == "dsv":
        from ..control.controller import DSVController

        controller = DSVController(model, dsv_cfg)
        if not getattr(controller, "modules", None):
            log("warning: DSVController found no SparseAttention modules (dense fallback in use)")
    fwd_model = model
    if tcfg.compile and dev.type == "cuda" and context_parallel:
        log("note: train.compile is ignored with context parallelism (the attention layers' "
            "collectives run eagerly)")
    elif tcfg.compile and dev.type == "cuda":
        fwd_model = torch.compile(model)

    def sync_grads():
        """Context parallelism: each rank holds its shard's part of the DiT gradients."""
        if cp_world > 1:
            import torch.distributed as dist

            gs = [p_.grad for p_ in params if p_.grad is not None]
            flat = torch.cat([g_.reshape(-1) for g_ in gs])
            dist.all_reduce(flat)
            off = 0
            for g_ in gs:
                g_.copy_(flat[off:off + g_.numel()].view_as(g_))
                off += g_.numel()

    start = 0
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    history: List[Dict[str, Any]] = []
    vals: List[Dict[str, Any]] = []
    log_window = None
    if init and not resume:
        _init_from(init, dev, model, controller, log, ema)
    if resume:
        ck = _resume_from(resume, dev, cfg, attention, model, opt, controller, log, ema)
        start = int(ck["step"])
        log_window = ck.get("log_window")
        # Drop metric lines past the checkpoint (a crashed run may have logged further).
        if writer and os.path.exists(metrics_path):
            kept = []
            with open(metrics_path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("step", 0) <= start:
                        kept.append(line if line.endswith("\n") else line + "\n")
            with open(metrics_path, "w") as f:
                f.writelines(kept)
    elif writer:
        open(metrics_path, "w").close()
    import yaml

    if writer:
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)

    ds = make_dataset(cfg["data"], "train", seed=tcfg.seed)
    stream = BatchStream(ds, tcfg.batch_size, tcfg.seed)
    valset = ValidationSet(cfg, tcfg)
    tokens_per_sample = model.cfg.num_tokens
    mf = open(metrics_path, "a") if writer else None

    def write(rec):
        if mf is not None:
            mf.write(json.dumps(rec) + "\n")
            mf.flush()

    def save(path, step_):
        if writer:
            _save_checkpoint(path, step_, model, opt, controller, cfg, attention, history[-3:],
                             (win_tokens, win_time, win_loss, win_n), ema)

    val_se = [None]

    def run_val(step):
        t0 = time.perf_counter()
        with ema.applied() if ema is not None else contextlib.nullcontext():
            per = validation_losses(fwd_model, valset, dev, tcfg.precision, tcfg.val_batch_size)
        v = float(per.mean()) if per.numel() else 0.0
        val_se[0] = validation_se(per, len(tcfg.val_timesteps))
        nt = len(tcfg.val_timesteps)
        # each held-out video's loss (its timesteps averaged): runs validated on the same clips
        # and noise compare video by video (dsv_ext.app.compare's paired difference)
        per_video = ([round(float(x), 7) for x in per.double().view(-1, nt).mean(1)]
                     if nt and per.numel() and per.numel() % nt == 0 else None)
        rec = {"kind": "val", "step": step, "val_loss": v, "val_loss_se": val_se[0],
               "val_loss_per_video": per_video,
               "val_weights": "ema" if ema is not None else "live",
               "val_time_s": time.perf_counter() - t0, **_controller_stats(controller)}
        vals.append(rec)
        write(rec)
        say(f"step {step}: val_loss {v:.4f} (stage {rec.get('stage', 1)}, {rec['val_time_s']:.1f} s)")
        return v

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=tcfg.steps, initial=start, desc=f"{name}/{attention}",
                       dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            bar = None

    def say(line):
        """A console line (through `log`), printed above the progress bar."""
        if bar is None:
            log(line)
        else:
            with bar.external_write_mode(file=sys.stderr):
                log(line)

    pool = ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(stream.batch, start, tcfg.timestep_sampling) if start < tcfg.steps else None
    last_val = None
    win_tokens, win_time, win_loss, win_n = 0, 0.0, 0.0, 0
    if log_window:
        win_tokens, win_time, win_loss, win_n = log_window
    train_time = 0.0
    stage2_tokens, stage2_time = 0, 0.0
    stage1_tokens, stage1_time, cpu_note_done = 0, 0.0, dev.type != "cpu"
    wall0 = time.perf_counter()
    model.train()
    step = start
    from .checkpoint import StopOnSignal

    stop = StopOnSignal(log).__enter__()
    stopped_at = None
    try:
        for step in range(start, tcfg.steps):
            x0, noise, t = fut.result()
            fut = (pool.submit(stream.batch, step + 1, tcfg.timestep_sampling)
                   if step + 1 < tcfg.steps else None)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            x0, noise, t = (x0.to(dev, non_blocking=True), noise.to(dev, non_blocking=True),
                            t.to(dev, non_blocking=True))
            lr = _lr_at(step, tcfg)
            for gr in opt.param_groups:
                gr["lr"] = lr
            stage_before = int(getattr(controller, "stage", 1)) if controller is not None else 1
            with autocast(dev, tcfg.precision):
                loss = flow_matching_loss(fwd_model, x0, noise, t)
            loss.backward()
            sync_grads()
            gnorm = None
            if tcfg.grad_clip > 0:
                gnorm = torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update()
            if controller is not None:
                controller.step()
                if stage_before == 1 and controller.stage == 2:
                    say(_switch_line(controller, step + 1))
            loss_v = float(loss.detach())  # host sync: step time below includes the whole step
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            train_time += dt
            ntok = x0.shape[0] * tokens_per_sample
            win_tokens += ntok
            win_time += dt
            win_loss += loss_v
            win_n += 1
            if stage_before == 2:
                stage2_tokens += ntok
                stage2_time += dt
            else:
                stage1_tokens += ntok
                stage1_time += dt
            if not math.isfinite(loss_v):
                raise FloatingPointError(f"loss is {loss_v} at step {step}")
            done = step + 1
            if on_step is not None:
                on_step(done, {"loss": loss_v, "step_time_s": dt, "controller": controller,
                               "stage": int(getattr(controller, "stage", 1)) if controller is not None else 1})
            if done % tcfg.log_every == 0 or done == tcfg.steps:
                st = _controller_stats(controller)
                rec = {"kind": "train", "step": done, "loss": win_loss / win_n, "last_loss": loss_v,
                       "lr": lr, "grad_norm": float(gnorm) if gnorm is not None else None,
                       "tokens_per_s": win_tokens / max(win_time, 1e-9),
                       "step_time_ms": 1000 * win_time / win_n, **st}
                history.append(rec)
                write(rec)
                if bar is not None:
                    post = {"loss": f"{rec['loss']:.4f}", "stage": st.get("stage", 1)}
                    sp = st.get("sparsity")
                    if isinstance(sp, list):
                        sp = _mean(sp)
                    if sp is not None:
                        post["sparsity"] = f"{sp:.3f}"
                    post["tok/s"] = f"{rec['tokens_per_s']:.0f}"
                    bar.set_postfix(post, refresh=False)
                win_tokens, win_time, win_loss, win_n = 0, 0.0, 0.0, 0
                if not cpu_note_done and stage2_time > 0 and stage1_time > 0:
                    cpu_note_done = True
                    tps1, tps2 = stage1_tokens / stage1_time, stage2_tokens / stage2_time
                    if tps2 < tps1:
                        say(f"note: tokens/s {tps1:.0f} in stage 1 -> {tps2:.0f} in stage 2: on the CPU the "
                            "sparse path runs the C reference kernels plus top-K estimation, slower than "
                            "dense attention at this size; the speed-up of sparse attention is a GPU "
                            "result (docs/TRAINING.md)")
            if bar is not None:
                bar.update(1)
            if tcfg.val_every > 0 and done % tcfg.val_every == 0 and done < tcfg.steps:
                last_val = run_val(done)
                save(os.path.join(out_dir, "ckpt_last.pt"), done)
            if tcfg.ckpt_every > 0 and done % tcfg.ckpt_every == 0 and done < tcfg.steps:
                save(os.path.join(out_dir, f"ckpt_{done}.pt"), done)
            if time_limit_s is not None and done < tcfg.steps:
                out_of_time = time.perf_counter() - wall0 + dt > time_limit_s
                if cp_world > 1:  # every rank stops at the same step
                    import torch.distributed as dist

                    flag = torch.tensor([float(out_of_time)], device=dev)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    out_of_time = bool(flag.item() > 0)
                if out_of_time:
                    stopped_at = done
                    break
            if stop.requested(cp_world, dev) and done < tcfg.steps:
                stopped_at = done
                log(f"{stop.signal}: stopped after step {done} of {tcfg.steps}; resume with "
                    f"--resume {os.path.join(out_dir, 'ckpt_last.pt')}")
                break
        final_step = max(start, tcfg.steps) if stopped_at is None else stopped_at
        if stopped_at is None and (start < tcfg.steps or not vals):
            last_val = run_val(final_step)
        save(os.path.join(out_dir, "ckpt_last.pt"), final_step)
    finally:
        stop.__exit__(None, None, None)
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
        if mf is not None:
            mf.close()

    st = _controller_stats(controller)
    n_trained = max(final_step - start, 0)
    summary = {
        "name": name, "attention": attention, "device": str(dev), "steps": tcfg.steps,
        "resumed_from": start if resume else None,
        "init_from": init or None,
        "complete": stopped_at is None, "last_step": final_step,
        "stopped_by": stop.signal if stopped_at is not None else None,
        "stopped_at_step": stopped_at,
        "tokens_per_sample": tokens_per_sample, "batch_size": tcfg.batch_size,
        "final_val_loss": last_val,
        "final_val_loss_se": val_se[0],
        "val_weights": "ema" if ema is not None else "live",
        "final_train_loss": history[-1]["loss"] if history else None,
        "train_time_s": train_time, "wall_time_s": time.perf_counter() - wall0,
        "tokens_per_s": (n_trained * tcfg.batch_size * tokens_per_sample / train_time
                         if train_time > 0 else None),
        "stage1_tokens_per_s": stage1_tokens / stage1_time if stage1_time > 0 else None,
        "stage2_tokens_per_s": stage2_tokens / stage2_time if stage2_time > 0 else None,
        "stage2_steps": round(stage2_tokens / (tcfg.batch_size * tokens_per_sample)),
        "parameters": sum(p.numel() for p in params),
        "context_parallel_ranks": cp_world if context_parallel else None,
        # the code this run (its last chunk, when resumed) trained with: the provenance of a
        # comparison whose runs were trained at different times
        "commit": source_commit(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "card": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "torch": torch.__version__,
        **{f"dsv_{k}": v for k, v in st.items()},
    }
    if writer:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        for line in _summary_table(summary, vals, st, out_dir):
            log(line)
    return {"history": history, "val": vals, "summary": summary, "out_dir": out_dir}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv_ext.app.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (sections model/data/train/dsv)")
    p.add_argument("--out", default=None, help="output folder (default runs/<name>-<attention>)")
    p.add_argument("--steps", type=int, default=None, help="total training steps (overrides train.steps)")
    p.add_argument("--resume", default=None, help="checkpoint to resume from (e.g. OUT/ckpt_last.pt)")
    p.add_argument("--init", default=None, metavar="CKPT",
                   help="start a new run from this checkpoint's weights and DSV predictors (or its --slim "
                        "copy): fresh optimizer, step count and DSV stage; the data section may differ "
                        "(progressive training, e.g. --set data.frames=32 after 16)")
    p.add_argument("--attention", choices=("dense", "dsv"), default=None,
                   help="attention kind (overrides model.attention; default dsv)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SEC.KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-4 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop (with ckpt_last.pt, no final validation) before exceeding this wall "
                        "time; continue later with --resume OUT/ckpt_last.pt")
    p.add_argument("--context-parallel", action="store_true",
                   help="split each sequence over the ranks started by torchrun (gloo on the CPU, NCCL "
                        "on GPUs: one GPU per rank); e.g. torchrun --nproc_per_node=2 -m dsv_ext.app.train "
                        "--config configs/tiny.yaml --context-parallel")
    a = p.parse_args(argv)

    def body() -> int:
        check_numeric_args(a, ints={"steps": 1}, numbers={"time_limit": 0})
        cfg = load_config(a.config, a.overrides)
        device = a.device
        if a.context_parallel:
            device = init_context_parallel(device)
        try:
            res = train(cfg, out_dir=a.out, steps=a.steps, resume=a.resume, attention=a.attention,
                        device=device, progress=not a.no_progress, context_parallel=a.context_parallel,
                        time_limit_s=a.time_limit, init=a.init)
        finally:
            if a.context_parallel:
                import torch.distributed as dist

                from ..parallel import clear_group_cache

                clear_group_cache()
                dist.destroy_process_group()
        if a.context_parallel and res["summary"]["context_parallel_ranks"] and int(os.environ["RANK"]) != 0:
            return 0
        s = res["summary"]
        keys = ("final_val_loss", "final_train_loss", "tokens_per_s", "stage2_tokens_per_s",
                "wall_time_s", "dsv_stage", "dsv_sparsity", "dsv_recall")
        print(json.dumps({k: s.get(k) for k in keys if k in s}))
        print(f"outputs in {res['out_dir']}")
        # a run stopped by a signal (checkpoint saved) exits as shells expect: 128 + signal number
        return {"SIGINT": 130, "SIGTERM": 143}.get(s.get("stopped_by"), 0)

    def guarded() -> int:
        try:
            return body()
        except KeyboardInterrupt as e:
            print(f"{p.prog}: interrupted{': ' + str(e) if str(e) else ''} (checkpoints on disk are "
                  "intact: they are written atomically)", file=sys.stderr)
            return 130

    return run_command(p.prog, guarded)



if __name__ == "__main__":
    sys.exit(main())
