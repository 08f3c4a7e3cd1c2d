"""Sample videos from a trained reference DiT (a ``dsv_ext.train`` checkpoint), with DSV or full
attention.

    python -m dsv_ext.sample --checkpoint runs/tiny-dsv/ckpt_last.pt --steps 30 --out samples/
        [--num-samples 4] [--seed 0] [--full-attention] [--device cpu|cuda] [--solver euler|heun]
        [--batch-size 4] [--shift 1.0] [--precision auto|bf16|fp32] [--fps 8] [--scale N]
        [--view first3|pca] [--normalize auto|channel|joint] [--show-data N]
        [--set dsv.KEY=VALUE ...] [--index-refresh N] [--threads N] [--no-progress]

Flow matching, the convention of ``dsv_ext.train``: ``x_t = (1 - t) x0 + t e`` and the model
predicts the velocity ``v = e - x0``. Sampling integrates ``dx/dt = v(x, t)`` from pure noise at
``t = 1`` down to ``t = 0`` over ``--steps`` steps on the grid ``t_i = 1 - i / N`` (optionally
warped by ``--shift`` s: ``t -> s t / (1 + (s - 1) t)``, SD3's resolution shift, which spends more
steps at high noise). ``--solver euler`` (default) takes ``x <- x + (t_next - t) v``: N model
evaluations. ``--solver heun`` adds the trapezoidal correction (Heun / 2nd-order Runge-Kutta,
the last step stays Euler): 2N - 1 evaluations.

Attention. The model is rebuilt from the configuration saved in the checkpoint, its weights
loaded, and for a DSV checkpoint a :class:`~dsv_ext.controller.DSVController` restores the saved
state: the stage, the per-head sparsity EMAs (hence per-head K), the trained low-rank predictors
and the dispatcher's per-block sparse/dense decisions. The model then runs in eval mode and the
controller is never stepped: no predictor training, no profiling, nothing changes while
sampling. A stage-2 checkpoint samples with sparse attention in the blocks that ran sparse in
training (top-K estimation from the predictors + sparse attention, per sampling step); a stage-1
checkpoint samples dense (as it trained). ``--full-attention`` forces every block dense (same
weights), for a side-by-side comparison. ``--set dsv.KEY=VALUE`` overrides DSV settings for
sampling, e.g. ``--set dsv.k_margin=0.1`` (10% more keys per head) or
``--set dsv.min_density=1.0`` (K = S: the sparse path over all keys, equal to full attention up
to rounding). ``--index-refresh N`` (default 1) estimates the critical keys on every N-th model
evaluation only and reuses each block's index in between (attention patterns of neighbouring
denoising steps are close; :func:`dsv_ext.set_index_refresh`): it removes (N - 1) / N of the
estimation cost, at the price of samples that differ slightly from N = 1; each batch starts
with a fresh estimate.

Outputs in ``--out`` (per sample i, 3-digit index):

- ``sample_000.gif``: the clip, animated (``--fps``, looping), frames upscaled by nearest
  neighbour (``--scale``, default: to at least 128 pixels high);
- ``sample_000.png``: all frames side by side (1-pixel gaps), same mapping and scale;
- ``sample_000.npy``: the raw latents, float32 ``[C, T, H, W]`` (the model's latent space);
- ``sampling.json``: checkpoint, mode, solver, steps, seed, per-block attention (sparse or dense,
  per-head K), sampling time, and per-sample latent statistics;
- with ``--show-data N``: ``data_000.gif/.png`` for N held-out clips of the training data,
  rendered the same way (what the model should produce).

Latents to pictures (:func:`latents_to_frames`): ``--view first3`` (default) shows channels 0, 1,
2 as R, G, B (fewer channels are repeated). For ``data.mode: pixels``, folder and video data, channels
0-2 are the patch means of R, G, B (``dsv_ext.data.PatchEncoder``), so this is the true colour
picture at latent resolution; for ``mode: latent`` they are random mixtures of the scene's
texture fields (false colour). ``--view pca`` projects the C channels on their three principal
components over the clip (false colour that uses every channel; sign fixed so that the largest
loading of each component is positive). Values are mapped to 0..255 linearly between the 1st and
99th percentile over the whole clip (all frames: brightness is comparable over time):
``--normalize channel`` stretches each colour channel on its own (more colour), ``joint`` uses
one range for all three (keeps colour balance); ``auto`` picks ``joint`` for pixel/folder data
with ``first3`` and ``channel`` otherwise.

Python API: :func:`load_for_sampling` (model + controller from a checkpoint),
:func:`sample_latents` (the ODE solve), :func:`latents_to_frames`, :func:`save_gif`,
:func:`save_grid`, :func:`sample` (the whole command).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .cli import check_numeric_args, run_command
from .train import _autocast, _resolve_device, build_model, inference_state_dict, load_config

__all__ = ["SamplingModel", "load_for_sampling", "timestep_grid", "sample_latents",
           "latents_to_frames", "save_gif", "save_grid", "sample", "main"]


# ---------------------------------------------------------------------------------------------
# Checkpoint -> model + controller
# ---------------------------------------------------------------------------------------------

@dataclass
class SamplingModel:
    """A model rebuilt from a checkpoint, ready to sample (eval mode)."""

    model: torch.nn.Module
    controller: Any  # DSVController or None (dense checkpoint)
    config: Dict[str, Any]
    attention: str  # what the checkpoint trained with: "dsv" or "dense"
    mode: str  # what sampling runs: "dsv" (stage 2, >= 1 sparse block), "dense"
    step: int
    device: torch.device
    notes: List[str] = field(default_factory=list)

    def blocks(self) -> List[Dict[str, Any]]:
        """Per attention block: name, whether it runs sparse now, per-head K, sequence length."""
        if self.controller is None:
            return []
        out = []
        for name, m in self.controller.modules:
            sparse = bool(m.stage == 2 and m.use_sparse and m.density is not None)
            out.append({"name": name, "sparse": sparse, "head_k": list(m.head_k) if sparse else None,
                        "seq_len": int(m._k_seq_len) if sparse else int(m._seq_len),
                        "sparsity": (None if m.density is None
                                     else [round(1.0 - d, 4) for d in m.density])})
        return out


def _torch_load(path: str, device) -> Dict[str, Any]:
    from .checkpoint import load_checkpoint

    # verified against its checksum; one-line CheckpointError (a ValueError) on any problem
    return load_checkpoint(path, map_location=device, required=("model", "config"))


def load_for_sampling(checkpoint: str, device: Optional[str] = None, full_attention: bool = False,
                      dsv_overrides: Optional[Dict[str, Any]] = None) -> SamplingModel:
    """Rebuild the model of a ``dsv_ext.train`` checkpoint and, for a DSV checkpoint, its
    controller state (stage, per-head K, predictors, per-block sparse/dense choice).

    ``full_attention``: every block runs dense SDPA (the DSV predictors are loaded but unused).
    ``dsv_overrides``: DSVConfig fields replaced for sampling (e.g. ``{"k_margin": 0.1}``).
    The model is returned in eval mode; the controller must not be stepped while sampling.
    """
    dev = _resolve_device(device)
    ck = _torch_load(checkpoint, dev)
    cfg = copy.deepcopy(ck["config"])
    attention = ck.get("attention") or cfg.get("model", {}).get("attention", "dsv")
    cfg = load_config(base=cfg)  # validates the sections, fills missing ones
    notes: List[str] = []
    if dsv_overrides:
        cfg["dsv"].update(dsv_overrides)
    with torch.random.fork_rng(devices=[]):  # the predictors' init draws (overwritten below)
        torch.manual_seed(int(cfg["train"].get("seed", 0)))  # must not move the caller's RNG
        model, dsv_cfg = build_model(cfg, attention, dev)
    model.load_state_dict(inference_state_dict(ck), strict=True)
    controller = None
    if attention == "dsv":
        if ck.get("controller") is None:
            raise ValueError(f"checkpoint: {checkpoint} says attention=dsv but has no controller state")
        from .controller import DSVController

        controller = DSVController(model, dsv_cfg)
        controller.load_state_dict(ck["controller"])
        if controller.stage != 2:
            notes.append(f"the checkpoint is in DSV stage {controller.stage} (step {ck.get('step')}): "
                         "it trained with dense attention, so it samples dense")
    model.eval()
    mode = "dense"
    if controller is not None:
        unsupported = [n for n, m in controller.modules if m.use_sparse and not m.sparse_supported()]
        if unsupported and not full_attention:
            notes.append(f"no dsv sparse kernels for {dev.type} with this shape: {len(unsupported)} "
                         "sparse block(s) run dense")
        for n, m in controller.modules:
            if full_attention or n in unsupported:
                m.use_sparse = False
        if full_attention:
            pass  # mode stays "dense"
        elif controller.stage == 2 and any(m.use_sparse for _, m in controller.modules):
            mode = "dsv"
        elif controller.stage == 2:
            notes.append("stage 2, but the dispatcher kept every block dense: samples dense")
        for _, m in controller.modules:  # nothing trains or profiles while sampling
            m._train_now = m._profile_now = False
    elif attention != "dsv":
        notes.append("the checkpoint was trained with full attention: samples dense")
    return SamplingModel(model=model, controller=controller, config=cfg, attention=attention,
                         mode=mode, step=int(ck.get("step", 0)), device=dev, notes=notes)


# ---------------------------------------------------------------------------------------------
# The ODE solve
# ---------------------------------------------------------------------------------------------

def timestep_grid(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` times from 1 (noise) to 0 (data), float64: ``1 - i/N`` warped by
    ``t -> shift t / (1 + (shift - 1) t)``."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
    if not (shift > 0 and math.isfinite(shift)):
        raise ValueError(f"shift: expected a positive number, got {shift!r}")
    t = 1.0 - torch.arange(steps + 1, dtype=torch.float64) / steps
    return shift * t / (1.0 + (shift - 1.0) * t)


@torch.no_grad()
def sample_latents(model: torch.nn.Module, noise: torch.Tensor, steps: int, solver: str = "euler",
                   shift: float = 1.0, precision: str = "auto",
                   callback: Optional[Callable[[int, float], None]] = None) -> torch.Tensor:
    """Integrate the flow from ``noise`` (``[B, C, T, H, W]`` at t = 1) to t = 0; returns the
    float32 latents. ``callback(i, t)`` runs after each step (progress bars)."""
    if solver not in ("euler", "heun"):
        raise ValueError(f"solver: must be 'euler' or 'heun', got {solver!r}")
    ts = timestep_grid(steps, shift).tolist()
    x = noise.float().clone()
    b = x.shape[0]

    def velocity(x, t):
        tt = torch.full((b,), float(t), dtype=torch.float32, device=x.device)
        with _autocast(x.device, precision):
            return model(x, tt).float()

    for i in range(steps):
        t, tn = ts[i], ts[i + 1]
        v = velocity(x, t)
        x_e = x + (tn - t) * v
        if solver == "heun" and tn > 0:
            x = x + (tn - t) * 0.5 * (v + velocity(x_e, tn))
        else:
            x = x_e
        if callback is not None:
            callback(i, tn)
    return x


# ---------------------------------------------------------------------------------------------
# Latents -> pictures
# ---------------------------------------------------------------------------------------------

def _pca3(z: np.ndarray) -> np.ndarray:
    """[C, N] -> [3, N]: projection on the top-3 principal components (zero-padded if C < 3)."""
    c = z.shape[0]
    zc = z - z.mean(axis=1, keepdims=True)
    cov = zc @ zc.T / max(zc.shape[1] - 1, 1)
    w, vecs = np.linalg.eigh(cov)  # ascending
    vecs = vecs[:, ::-1][:, :min(3, c)]
    sign = np.sign(vecs[np.abs(vecs).argmax(axis=0), np.arange(vecs.shape[1])])
    vecs = vecs * np.where(sign == 0, 1.0, sign)
    out = vecs.T @ zc
    if out.shape[0] < 3:
        out = np.concatenate([out, np.zeros((3 - out.shape[0], out.shape[1]), out.dtype)])
    return out


def latents_to_frames(latents, view: str = "first3", normalize: str = "channel",
                      scale: Optional[int] = None, min_height: int = 128) -> np.ndarray:
    """Latents ``[C, T, H, W]`` (tensor or array) -> uint8 RGB frames ``[T, H*s, W*s, 3]``.

    ``view``: ``first3`` (channels 0-2 as R, G, B; a single channel is shown in grey, two are
    padded with their mean) or ``pca`` (top-3 principal components over the clip). ``normalize``:
    ``channel`` or ``joint`` percentile stretch (1st-99th over the clip, per colour channel or
    shared). ``scale``: integer nearest-neighbour upscaling (default: smallest making the frames
    at least ``min_height`` pixels high)."""
    z = latents.detach().float().cpu().numpy() if isinstance(latents, torch.Tensor) else np.asarray(latents, np.float32)
    if z.ndim != 4:
        raise ValueError(f"latents: expected [C, T, H, W], got shape {tuple(z.shape)}")
    c, t, h, w = z.shape
    z = z.astype(np.float64)
    if not np.isfinite(z).all():
        raise ValueError("latents: contain NaN or inf")
    if view == "first3":
        if c >= 3:
            rgb = z[:3]
        elif c == 2:
            rgb = np.stack([z[0], z[1], 0.5 * (z[0] + z[1])])
        else:
            rgb = np.repeat(z[:1], 3, axis=0)
    elif view == "pca":
        rgb = _pca3(z.reshape(c, -1)).reshape(3, t, h, w)
    else:
        raise ValueError(f"view: must be 'first3' or 'pca', got {view!r}")
    if normalize == "channel":
        flat = rgb.reshape(3, -1)
        lo = np.percentile(flat, 1, axis=1)[:, None, None, None]
        hi = np.percentile(flat, 99, axis=1)[:, None, None, None]
    elif normalize == "joint":
        lo, hi = np.percentile(rgb, 1), np.percentile(rgb, 99)
    else:
        raise ValueError(f"normalize: must be 'channel' or 'joint', got {normalize!r}")
    img = (rgb - lo) / np.maximum(hi - lo, 1e-6)
    img = np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)  # [3, T, H, W]
    img = img.transpose(1, 2, 3, 0)  # [T, H, W, 3]
    if scale is None:
        scale = max(1, -(-min_height // h))
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale: expected an integer >= 1, got {scale!r}")
    if scale > 1:
        img = img.repeat(scale, axis=1).repeat(scale, axis=2)
    return np.ascontiguousarray(img)


def save_gif(frames: np.ndarray, path: str, fps: float = 8.0) -> None:
    """uint8 frames ``[T, H, W, 3]`` -> looping animated GIF (Pillow)."""
    from PIL import Image

    if fps <= 0:
        raise ValueError(f"fps: expected a positive number, got {fps!r}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames: expected uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    # a 256-colour palette per frame (median cut), no dithering: flat colours stay flat
    ims = [Image.fromarray(f).quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                       dither=Image.Dither.NONE) for f in frames]
    ims[0].save(path, save_all=True, append_images=ims[1:], duration=int(round(1000 / fps)),
                loop=0, optimize=False, disposal=1)


def save_grid(frames: np.ndarray, path: str, cols: Optional[int] = None, gap: int = 1) -> None:
    """uint8 frames ``[T, H, W, 3]`` -> one PNG with the frames left to right, top to bottom
    (``cols`` per row, default all in one row), separated by ``gap`` white pixels."""
    from PIL import Image

    t, h, w, _ = frames.shape
    cols = t if cols is None else max(1, min(int(cols), t))
    rows = -(-t // cols)
    grid = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, 3), 255, np.uint8)
    for i in range(t):
        r, c = divmod(i, cols)
        grid[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = frames[i]
    Image.fromarray(grid).save(path)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def _parse_overrides(items: Sequence[str]) -> Dict[str, Any]:
    from .config import yaml_load

    out: Dict[str, Any] = {}
    for ov in items:
        key, sep, val = ov.partition("=")
        if not sep or not key.startswith("dsv.") or len(key) <= 4:
            raise ValueError(f"--set: expected dsv.KEY=VALUE, got {ov!r}")
        out[key[4:]] = yaml_load(val)
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sample(checkpoint: str, out_dir: str, steps: int = 30, num_samples: int = 4, seed: int = 0,
           full_attention: bool = False, device: Optional[str] = None, solver: str = "euler",
           batch_size: int = 4, shift: float = 1.0, precision: str = "auto", fps: float = 8.0,
           scale: Optional[int] = None, view: str = "first3", normalize: str = "auto",
           show_data: int = 0, dsv_overrides: Optional[Dict[str, Any]] = None,
           threads: Optional[int] = None, progress: bool = True,
           log: Optional[Callable[[str], None]] = None, index_refresh: int = 1,
           context_parallel: bool = False) -> Dict[str, Any]:
    """Sample ``num_samples`` clips and write them to ``out_dir`` (see the module docstring).
    Returns the ``sampling.json`` record (with ``"latents"``: the float32 ``[K, C, T, H, W]``
    tensor added, not written to the JSON).

    Sample i's starting noise is the i-th draw of a CPU generator seeded with ``seed``, so it
    does not depend on ``num_samples`` or ``batch_size``.

    ``index_refresh``: estimate DSV's critical keys on every N-th model evaluation and reuse
    them in between (1: every evaluation; see the module docstring).

    ``threads``: torch CPU threads while sampling (None: the checkpoint's ``train.threads`` when
    > 0, else torch's default); the previous setting is restored on return.

    ``context_parallel``: split each clip's token sequence over the ranks of the (initialised)
    default process group (``dsv_ext.parallel``; every rank computes the same latents, rank 0
    writes the files; ``index_refresh`` must be 1)."""
    log = log or (lambda s: print(s, file=sys.stderr))
    writer = True
    if context_parallel:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("context_parallel: torch.distributed is not initialised (launch with "
                               "torchrun and python -m dsv_ext.sample --context-parallel)")
        if index_refresh != 1:
            raise ValueError(f"index_refresh: must be 1 with context parallelism, got {index_refresh!r}")
        writer = dist.get_rank() == 0
        if not writer:
            progress, log = False, (lambda s: None)
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples: expected an integer >= 1, got {num_samples!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    if solver not in ("euler", "heun"):
        raise ValueError(f"solver: must be 'euler' or 'heun', got {solver!r}")
    if view not in ("first3", "pca"):
        raise ValueError(f"view: must be 'first3' or 'pca', got {view!r}")
    if normalize not in ("auto", "channel", "joint"):
        raise ValueError(f"normalize: must be 'auto', 'channel' or 'joint', got {normalize!r}")
    if not isinstance(index_refresh, int) or isinstance(index_refresh, bool) or index_refresh < 1:
        raise ValueError(f"index_refresh: expected an integer >= 1, got {index_refresh!r}")
    timestep_grid(steps, shift)  # validates steps / shift before any work
    sm = load_for_sampling(checkpoint, device, full_attention, dsv_overrides)
    if context_parallel:
        if sm.attention != "dsv":
            raise ValueError(f"checkpoint: context parallelism needs a DSV checkpoint (attention=dsv), "
                             f"{checkpoint} was trained with attention={sm.attention!r}")
        from . import parallel as _cp

        _cp.enable(sm.model)
        sm.model.set_context_parallel(True, cube=_cp_cube(sm))
    for n in sm.notes:
        log(f"note: {n}")
    if threads is None:
        threads = int(sm.config["train"].get("threads", 0) or 0) or None
    old_threads = torch.get_num_threads()
    if threads is not None and sm.device.type == "cpu":
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected an integer >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    try:
        return _sample(sm, out_dir, steps, num_samples, seed, full_attention, solver, batch_size,
                       shift, precision, fps, scale, view, normalize, show_data, dsv_overrides,
                       progress, checkpoint, index_refresh, writer)
    finally:
        torch.set_num_threads(old_threads)


def _cp_cube(sm) -> Tuple[int, int, int]:
    from .config import DSVConfig

    return tuple(DSVConfig.from_dict(dict(sm.config.get("dsv") or {})).cube)


def _sample(sm, out_dir, steps, num_samples, seed, full_attention, solver, batch_size, shift,
            precision, fps, scale, view, normalize, show_data, dsv_overrides, progress,
            checkpoint, index_refresh=1, writer=True) -> Dict[str, Any]:
    from .attention import set_index_refresh

    model, dev, cfg = sm.model, sm.device, sm.config
    mcfg = model.cfg
    shape = (mcfg.in_channels, *mcfg.latent_size)
    dcfg = cfg["data"]
    if normalize == "auto":
        rgb_data = dcfg.get("source", "procedural") in ("folder", "video") or dcfg.get("mode") == "pixels"
        normalize = "joint" if (rgb_data and view == "first3") else "channel"
    if writer:
        os.makedirs(out_dir, exist_ok=True)

    g = torch.Generator().manual_seed(int(seed))
    noise = torch.stack([torch.randn(shape, generator=g) for _ in range(num_samples)])
    nfe_per = steps if solver == "euler" else 2 * steps - 1
    bar = None
    n_batches = -(-num_samples // batch_size)
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=n_batches * steps, desc=f"sampling ({sm.mode}, {solver})",
                       unit="step", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            bar = None
    outs = []
    times = []
    try:
        for bi in range(n_batches):
            xb = noise[bi * batch_size:(bi + 1) * batch_size].to(dev)

            def cb(i, t, bi=bi):
                if bar is not None:
                    bar.set_postfix({"batch": f"{bi + 1}/{n_batches}", "t": f"{t:.3f}"}, refresh=False)
                    bar.update(1)

            set_index_refresh(model, index_refresh)  # also a fresh estimate for each batch
            _sync(dev)
            t0 = time.perf_counter()
            x = sample_latents(model, xb, steps, solver, shift, precision, cb)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            outs.append(x.cpu())
    finally:
        if bar is not None:
            bar.close()
    latents = torch.cat(outs).float()
    if not writer:  # another context-parallel rank: the same latents, rank 0 writes them
        return {"latents": latents, "mode": sm.mode, "sampling_time_s": sum(times)}

    files = []
    stats = []
    for i in range(num_samples):
        z = latents[i]
        stem = os.path.join(out_dir, f"sample_{i:03d}")
        np.save(stem + ".npy", z.numpy())
        fr = latents_to_frames(z, view, normalize, scale)
        frame_size = fr.shape[1:3]
        save_gif(fr, stem + ".gif", fps)
        save_grid(fr, stem + ".png")
        files += [stem + ".gif", stem + ".png", stem + ".npy"]
        stats.append({"mean": float(z.mean()), "std": float(z.std()), "min": float(z.min()),
                      "max": float(z.max())})
    data_files = []
    if show_data > 0:
        from .data import make_dataset

        dd = dict(dcfg)
        if dd.get("source", "procedural") in ("procedural", "video"):
            dd["num_val"] = max(int(show_data), int(dd.get("num_val", 0) or 0))
        ds = make_dataset(dd, "val", seed=int(cfg["train"].get("seed", 0)))
        for j in range(min(int(show_data), len(ds))):
            fr = latents_to_frames(ds[j], view, normalize, scale)
            stem = os.path.join(out_dir, f"data_{j:03d}")
            save_gif(fr, stem + ".gif", fps)
            save_grid(fr, stem + ".png")
            data_files += [stem + ".gif", stem + ".png"]

    total = sum(times)
    rec: Dict[str, Any] = {
        "checkpoint": os.path.abspath(checkpoint), "checkpoint_step": sm.step,
        "trained_attention": sm.attention, "mode": sm.mode, "full_attention_flag": bool(full_attention),
        "dsv_stage": None if sm.controller is None else int(sm.controller.stage),
        "dsv_overrides": dsv_overrides or {}, "index_refresh": index_refresh, "notes": sm.notes,
        "device": str(dev), "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "precision": precision, "solver": solver, "steps": steps, "shift": shift,
        "model_evaluations_per_sample": nfe_per, "seed": seed, "num_samples": num_samples,
        "batch_size": batch_size, "latent_shape": list(shape), "tokens": mcfg.num_tokens,
        "view": view, "normalize": normalize, "fps": fps,
        "frame_size": list(frame_size),
        "blocks": sm.blocks(),
        "sparse_blocks": sum(1 for b in sm.blocks() if b["sparse"]),
        "sampling_time_s": total, "seconds_per_sample": total / num_samples,
        "seconds_per_step": total / (n_batches * steps),
        "samples": stats, "files": [os.path.basename(f) for f in files + data_files],
    }
    with open(os.path.join(out_dir, "sampling.json"), "w") as f:
        json.dump(rec, f, indent=1)
    rec["latents"] = latents
    return rec


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv_ext.sample",
                                description="Sample videos from a dsv_ext.train checkpoint "
                                            "(flow matching; DSV sparse or full attention).",
                                epilog="Outputs per sample: sample_NNN.gif, sample_NNN.png (frame "
                                       "grid), sample_NNN.npy (latents [C, T, H, W]); sampling.json.")
    p.add_argument("--checkpoint", required=True, help="a dsv_ext.train checkpoint (OUT/ckpt_last.pt)")
    p.add_argument("--steps", type=int, default=30, help="sampling steps (default 30)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num-samples", type=int, default=4, help="how many clips (default 4)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument("--full-attention", action="store_true",
                   help="force dense attention in every block (default: as the checkpoint trained)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--solver", choices=("euler", "heun"), default="euler")
    p.add_argument("--batch-size", type=int, default=4, help="clips per model call (default 4)")
    p.add_argument("--shift", type=float, default=1.0, help="timestep shift (1 = uniform steps)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on CPU (as training)")
    p.add_argument("--fps", type=float, default=8.0, help="GIF frame rate (default 8)")
    p.add_argument("--scale", type=int, default=None,
                   help="nearest-neighbour upscaling (default: frames at least 128 px high)")
    p.add_argument("--view", choices=("first3", "pca"), default="first3",
                   help="latent channels to RGB: channels 0-2 (default) or top-3 PCA")
    p.add_argument("--normalize", choices=("auto", "channel", "joint"), default="auto",
                   help="percentile stretch per colour channel or shared (default auto)")
    p.add_argument("--show-data", type=int, default=0, metavar="N",
                   help="also render N held-out training clips as data_NNN.gif/png")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dsv.KEY=VALUE",
                   help="override a DSV setting for sampling, e.g. --set dsv.k_margin=0.1")
    p.add_argument("--index-refresh", type=int, default=1, metavar="N",
                   help="estimate DSV's critical keys on every N-th model evaluation and reuse "
                        "them in between (default 1: every evaluation)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the checkpoint's train.threads, else torch's)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--context-parallel", action="store_true",
                   help="split each clip over the ranks started by torchrun (long videos on several GPUs), e.g. "
                        "torchrun --nproc_per_node=2 -m dsv_ext.sample --checkpoint C --out D --context-parallel")
    a = p.parse_args(argv)

    def body() -> int:
        check_numeric_args(a, ints={"steps": 1, "num_samples": 1, "seed": 0, "batch_size": 1,
                                    "scale": 1, "show_data": 0, "index_refresh": 1, "threads": 1},
                           numbers={"shift": 0.0, "fps": 0.0})
        if a.context_parallel:
            from .train import _init_context_parallel

            a.device = _init_context_parallel(a.device)
            try:
                return run()
            finally:
                import torch.distributed as dist

                from .parallel import clear_group_cache

                clear_group_cache()
                dist.destroy_process_group()
        return run()

    def run() -> int:
        rec = sample(a.checkpoint, a.out, steps=a.steps, num_samples=a.num_samples, seed=a.seed,
                     full_attention=a.full_attention, device=a.device, solver=a.solver,
                     batch_size=a.batch_size, shift=a.shift, precision=a.precision, fps=a.fps,
                     scale=a.scale, view=a.view, normalize=a.normalize, show_data=a.show_data,
                     dsv_overrides=_parse_overrides(a.overrides), threads=a.threads,
                     progress=not a.no_progress, index_refresh=a.index_refresh,
                     context_parallel=a.context_parallel)
        if "files" not in rec:  # a context-parallel rank other than 0
            return 0
        print(json.dumps({k: rec[k] for k in ("mode", "dsv_stage", "sparse_blocks", "solver", "steps",
                                              "num_samples", "sampling_time_s", "seconds_per_sample")}))
        print(f"wrote {len(rec['files'])} files to {a.out}")
        return 0

    def guarded() -> int:
        try:
            return body()
        except KeyboardInterrupt:
            print(f"{p.prog}: interrupted", file=sys.stderr)
            return 130

    return run_command(p.prog, guarded)


if __name__ == "__main__":
    sys.exit(main())
