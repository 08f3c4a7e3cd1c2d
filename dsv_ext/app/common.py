"""What the application's commands share: the config, the model, the objective, the fixed
validation set, the batch stream, and the device / precision / context-parallel setup.

``train``, ``sample``, ``compare`` and ``evaluate`` (``python -m dsv_ext.app.<command>``) import
these from here; none of them reaches into another command's private helpers.

  * config: :func:`load_config` (a YAML file with sections ``model`` / ``data`` / ``train`` /
    ``dsv``, plus ``section.key=value`` overrides), :class:`TrainConfig` (the ``train`` section),
    :func:`dsv_config` (the ``dsv`` section as a DSVConfig);
  * model: :func:`build_model` (the reference DiT of a config; weights depend only on
    ``train.seed``);
  * objective: :func:`flow_matching_loss`, :func:`sample_timesteps`;
  * data: :class:`ValidationSet` (held-out latents, times and noise, fixed), :func:`validation_losses`,
    :func:`validation_loss`, :func:`validation_se`, :class:`BatchStream` (the batch of step i, a
    pure function of the seed and i);
  * setup: :func:`resolve_device`, :func:`autocast`, :func:`init_context_parallel` (a torchrun
    launch's process group).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..config import yaml_load
from .data import ProceduralVideos, _generator, make_dataset
from .models.dit import DiTConfig, VideoDiT

__all__ = ["TrainConfig", "inference_state_dict", "load_config", "dsv_config", "build_model", "sample_timesteps",
           "flow_matching_loss", "autocast", "ValidationSet", "validation_losses", "validation_se",
           "validation_loss", "BatchStream", "resolve_device", "init_context_parallel"]


@dataclass
class TrainConfig:
    """``train`` section of a config file."""

    steps: int = 500
    batch_size: int = 4
    lr: float = 3e-4
    betas: Sequence[float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 50
    """Linear learning-rate warm-up, then ``lr_schedule``."""
    lr_schedule: str = "constant"
    """After the warm-up: ``constant`` or ``cosine`` (from ``lr`` down to ``lr * lr_min_ratio``
    at the last step)."""
    lr_min_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of ``lr``."""
    ema_decay: float = 0.0
    """Exponential moving average of the model weights (0 = off; e.g. 0.995). When on,
    validation, sampling and the paired evaluation use the averaged weights: they do not move
    with the step-to-step jitter of the live weights (docs/QUALITY.md)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    seed: int = 0
    """Seeds the model init, the data stream, the noise and the timesteps."""
    timestep_sampling: str = "logit_normal"
    """``logit_normal`` (t = sigmoid(N(0, 1)), as SD3) or ``uniform``."""
    log_every: int = 10
    """Write a ``train`` metrics line every this many steps."""
    val_every: int = 100
    """Validation loss every this many steps (and at the end; 0 = only at the end)."""
    val_videos: int = 8
    val_timesteps: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9)
    val_batch_size: int = 8
    ckpt_every: int = 0
    """Also keep ``ckpt_<step>.pt`` every this many steps (0 = only ``ckpt_last.pt``, written at
    the end and at every validation)."""
    precision: str = "auto"
    """``auto`` (bf16 autocast on CUDA, fp32 on CPU), ``bf16`` or ``fp32``."""
    grad_checkpointing: bool = False
    """Recompute each block in the backward (CUDA only; ignored on the CPU)."""
    threads: int = 0
    """torch.set_num_threads on the CPU (0 = leave torch's default)."""
    compile: bool = False
    """torch.compile the model (CUDA only)."""

    def __post_init__(self) -> None:
        from ..config import check_bool, check_choice, check_int, check_number

        for n, lo in (("steps", 0), ("batch_size", 1), ("warmup_steps", 0), ("seed", 0),
                      ("log_every", 1), ("val_every", 0), ("val_videos", 1), ("val_batch_size", 1),
                      ("ckpt_every", 0), ("threads", 0)):
            check_int("train", n, getattr(self, n), lo)
        for n in ("lr", "weight_decay", "grad_clip"):
            check_number("train", n, getattr(self, n))
        for n in ("lr_min_ratio", "ema_decay"):
            v = getattr(self, n)
            check_number("train", n, v)
            if not 0.0 <= v <= 1.0 or (n == "ema_decay" and v == 1.0):
                raise ValueError(f"train.{n}: expected a number in [0, 1{']' if n == 'lr_min_ratio' else ')'}, "
                                 f"got {v!r}")
        for n in ("grad_checkpointing", "compile"):
            check_bool("train", n, getattr(self, n))
        check_choice("train", "precision", self.precision, ("auto", "bf16", "fp32"))
        check_choice("train", "lr_schedule", self.lr_schedule, ("constant", "cosine"))
        check_choice("train", "timestep_sampling", self.timestep_sampling, ("logit_normal", "uniform"))
        for n, count in (("betas", 2), ("val_timesteps", None)):
            v = getattr(self, n)
            ok = isinstance(v, (list, tuple)) and (count is None or len(v) == count) and len(v) > 0 and \
                all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in v)
            if not ok:
                want = f"{count} numbers" if count else "a list of numbers"
                raise ValueError(f"train.{n}: expected {want} in [0, 1], got {v!r}")

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"train: unknown keys {bad}; known: {sorted(names)}")
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def _parse_value(s: str):
    return yaml_load(s)


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                base: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Read a YAML config (sections model / data / train / dsv) and apply ``section.key=value``
    overrides. Returns a plain dict."""
    if base is not None:
        cfg = copy.deepcopy(base)
    else:
        if path is None:
            raise ValueError("config: a path or a base dict is required")
        try:
            with open(path) as f:
                cfg = yaml_load(f) or {}
        except UnicodeDecodeError:
            raise ValueError(f"config: {path}: not a text (YAML) file") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config: {path}: expected a mapping at top level")
    bad = sorted(set(cfg) - {"model", "data", "train", "dsv", "name"})
    if bad:
        raise ValueError(f"config: unknown sections {bad} (expected model, data, train, dsv)")
    for sec in ("model", "data", "train", "dsv"):
        if not isinstance(cfg.get(sec) or {}, dict):
            raise ValueError(f"{sec}: expected a mapping of keys, got {cfg[sec]!r}"
                             + (f" (in {path})" if path else ""))
        cfg[sec] = dict(cfg.get(sec) or {})
    cfg.setdefault("name", os.path.splitext(os.path.basename(path))[0] if path else "run")
    for ov in overrides:
        if "=" not in ov or "." not in ov.split("=", 1)[0]:
            raise ValueError(f"--set: expected section.key=value, got {ov!r}")
        key, val = ov.split("=", 1)
        sec, name = key.split(".", 1)
        if sec not in ("model", "data", "train", "dsv"):
            raise ValueError(f"--set: unknown section {sec!r} in {ov!r}")
        try:
            cfg[sec][name] = _parse_value(val)
        except ValueError as e:
            raise ValueError(f"--set: {ov!r}: {str(e).split(': ', 1)[-1]}") from None
    from .data import check_data_config

    check_data_config(cfg["data"])  # strict, like the other sections
    return cfg


def dsv_config(cfg: Dict[str, Any]):
    """The ``dsv`` section of a config as a :class:`~dsv_ext.config.DSVConfig` (defaults filled)."""
    from ..config import DSVConfig

    return DSVConfig.from_dict(dict(cfg.get("dsv") or {}))


def build_model(cfg: Dict[str, Any], attention: Optional[str] = None, device="cpu"):
    """The model of a config (``attention`` overrides ``model.attention``); weights depend only on
    ``train.seed``."""
    mcfg = dict(cfg["model"])
    if attention is not None:
        mcfg["attention"] = attention
    d = cfg["data"]

    def data_int(key: str, default=None) -> int:
        if key not in d and default is None:
            raise ValueError(f"data.{key}: missing (needed for the model's latent size)")
        v = d.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"data.{key}: expected an integer >= 1, got {v!r}")
        return v

    if "in_channels" not in mcfg:
        mcfg["in_channels"] = data_int("channels", 4)
    if "latent_size" not in mcfg:
        mcfg["latent_size"] = (data_int("frames"), data_int("height"), data_int("width"))
    dit_cfg = DiTConfig.from_dict(mcfg)
    seed = int(cfg["train"].get("seed", 0))
    dsv_cfg = dsv_config(cfg) if dit_cfg.attention == "dsv" else None
    model = VideoDiT(dit_cfg, seed=seed, dsv_config=dsv_cfg)
    return model.to(device), dsv_cfg


# ---------------------------------------------------------------------------------------------
# Flow matching
# ---------------------------------------------------------------------------------------------

def sample_timesteps(n: int, g: torch.Generator, kind: str) -> torch.Tensor:
    """``n`` training times in (0, 1) from ``g``: ``logit_normal`` (sigmoid of N(0, 1)) or ``uniform``."""
    if kind == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=g))
    if kind == "uniform":
        return torch.rand(n, generator=g).clamp(1e-4, 1 - 1e-4)
    raise ValueError(f"train.timestep_sampling: must be 'logit_normal' or 'uniform', got {kind!r}")


def flow_matching_loss(model, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                       reduce: bool = True) -> torch.Tensor:
    """Flow matching: ``x_t = (1 - t) x0 + t noise``, the model predicts ``noise - x0``; the mean
    squared error (``reduce=False``: one value per sample)."""
    tb = t.view(-1, 1, 1, 1, 1).to(x0.dtype)
    xt = (1 - tb) * x0 + tb * noise
    pred = model(xt, t)
    err = (pred.float() - (noise - x0).float()).pow(2)
    return err.mean() if reduce else err.flatten(1).mean(1)


def autocast(device: torch.device, precision: str):
    """The autocast context of ``train.precision`` (``auto``: bf16 on CUDA, fp32 on the CPU)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"train.precision: must be auto, bf16 or fp32, got {precision!r}")


class ValidationSet:
    """Fixed held-out latents, times and noise (built once)."""

    def __init__(self, cfg: Dict[str, Any], tcfg: TrainConfig, clips: Optional[Sequence[torch.Tensor]] = None):
        """``clips``: the held-out latent clips themselves (e.g. ``self.clips()`` of an earlier
        set, saved), instead of the config's data; times and noise as for the config's."""
        if clips is None:
            dcfg = dict(cfg["data"])
            if dcfg.get("source", "procedural") in ("procedural", "video"):
                dcfg["num_val"] = int(tcfg.val_videos)
            ds = make_dataset(dcfg, "val", seed=tcfg.seed)
            n = min(len(ds), int(tcfg.val_videos)) if tcfg.val_videos > 0 else len(ds)
            clips = [ds[j] for j in range(n)]
        self.per_clip = len(tcfg.val_timesteps)
        xs, ts, ns = [], [], []
        for j, x in enumerate(clips):
            g = _generator(tcfg.seed + 7919, j)
            for tv in tcfg.val_timesteps:
                xs.append(x)
                ts.append(float(tv))
                ns.append(torch.randn(x.shape, generator=g))
        self.x = torch.stack(xs)
        self.t = torch.tensor(ts, dtype=torch.float32)
        self.noise = torch.stack(ns)

    def clips(self) -> List[torch.Tensor]:
        """The held-out clips (one per video; ``x`` repeats each once per timestep)."""
        return [self.x[i].clone() for i in range(0, self.x.shape[0], max(1, self.per_clip))]


@torch.no_grad()
def validation_losses(model, valset: ValidationSet, device, precision: str, batch_size: int = 8) -> torch.Tensor:
    """float64 [videos * timesteps] (video-major): the loss of every validation sample, eval mode."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(0, valset.x.shape[0], batch_size):
            x = valset.x[i:i + batch_size].to(device)
            n = valset.noise[i:i + batch_size].to(device)
            t = valset.t[i:i + batch_size].to(device)
            with autocast(device, precision):
                out.append(flow_matching_loss(model, x, n, t, reduce=False).double().cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def validation_se(per_sample: torch.Tensor, per_video: int) -> Optional[float]:
    """Standard error of the validation loss over the videos (each video's timesteps averaged
    first; None with one video): how much the evaluation itself could move the loss."""
    if per_video < 1 or per_sample.numel() % per_video or per_sample.numel() // per_video < 2:
        return None
    v = per_sample.double().view(-1, per_video).mean(1)
    return float(v.std(unbiased=True) / math.sqrt(v.numel()))


def validation_loss(model, valset: ValidationSet, device, precision: str, batch_size: int = 8) -> float:
    per = validation_losses(model, valset, device, precision, batch_size)
    return float(per.mean()) if per.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# Data stream
# ---------------------------------------------------------------------------------------------

class BatchStream:
    """Batch of step i: dataset items at positions i*B .. i*B+B-1 of a per-epoch permutation
    (deterministic from the seed; procedural data is already random per index)."""

    def __init__(self, ds, batch_size: int, seed: int):
        self.ds, self.b, self.seed = ds, batch_size, seed
        self.n = len(ds)
        self.shuffle = not isinstance(ds, ProceduralVideos) and self.n <= 10**7
        self._perm_epoch, self._perm = -1, None

    def indices(self, step: int) -> List[int]:
        out = []
        for j in range(self.b):
            pos = step * self.b + j
            epoch, k = divmod(pos, self.n)
            if self.shuffle:
                if epoch != self._perm_epoch:
                    g = _generator(self.seed + 104729, epoch)
                    self._perm, self._perm_epoch = torch.randperm(self.n, generator=g).tolist(), epoch
                out.append(self._perm[k])
            else:
                out.append(k)
        return out

    def batch(self, step: int, timestep_kind: str):
        x0 = torch.stack([self.ds[i] for i in self.indices(step)])
        g = _generator(self.seed + 31337, step)
        noise = torch.randn(x0.shape, generator=g)
        t = sample_timesteps(x0.shape[0], g, timestep_kind)
        return x0, noise, t


# ---------------------------------------------------------------------------------------------
# Device, precision, context parallelism
# ---------------------------------------------------------------------------------------------

def inference_state_dict(ck: Dict[str, Any]) -> Dict[str, Any]:
    """The weights a checkpoint is evaluated and sampled with: the moving average of the
    weights where the run kept one (``train.ema_decay`` > 0), else the live weights."""
    sd = dict(ck["model"])
    ema = ck.get("ema")
    if ema:
        for n, t in ema["params"].items():
            sd[n] = t.to(dtype=sd[n].dtype) if n in sd else t
    return sd


def resolve_device(device: Optional[str]) -> torch.device:
    """``None`` / ``"auto"``: CUDA when available, else the CPU; ValueError for CUDA without a GPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch.cuda.is_available() is False")
    return dev


def init_context_parallel(device: Optional[str]) -> str:
    """The process group of a torchrun launch; returns the device of this rank."""
    import torch.distributed as dist

    from .. import parallel  # noqa: F401  (imports torch._dynamo before init_process_group: docs/PARALLEL.md)

    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"--context-parallel: launch with torchrun (environment lacks {', '.join(missing)}), "
                         "e.g. torchrun --nproc_per_node=2 -m dsv_ext.app.train --config C --context-parallel")
    dev = resolve_device(device)
    if dev.type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return str(dev)
