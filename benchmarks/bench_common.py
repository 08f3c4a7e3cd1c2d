"""Helpers shared by the GPU benchmarks: CUDA-event timing, the reference DiT's training step and
the video token grids."""
from __future__ import annotations

import datetime
import math
import os
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

# token grid (T, H, W) after patchify (patch 1x2x2: latents are T x 2H x 2W), by token count
DEFAULT_GRIDS = {32768: (32, 32, 32), 65536: (16, 64, 64), 16384: (16, 32, 32),
                 8192: (8, 32, 32), 4096: (16, 16, 16), 131072: (32, 64, 64)}


def step_times(fn: Callable[[], object], warmup: int, reps: int, cuda: bool = True) -> List[float]:
    """Milliseconds of each of ``reps`` runs of ``fn`` after ``warmup`` runs: CUDA events (``cuda``)
    or the wall clock (the CPU)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def cuda_time_ms(fn: Callable[[], object], warmup: int = 1, reps: int = 10) -> Dict[str, float]:
    """Median / min / max milliseconds of ``fn`` over ``reps`` runs (CUDA events, after warm-up)."""
    times = step_times(fn, warmup, reps)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "iters": reps}


def train_step(model, cfg: Dict, x0, noise, t, dev, controller=None, fwd=None) -> Callable[[], None]:
    """One training step of the reference DiT ``model`` of config ``cfg`` as the trainer takes it
    (flow matching on ``x0`` / ``noise`` at times ``t``, the config's precision, gradient
    clipping, a fused AdamW over the DiT's parameters, then the DSV ``controller``'s step), as a
    closure; ``fwd``: the callable run forward (e.g. the compiled model; default ``model``)."""
    from dsv_ext.app.common import autocast, flow_matching_loss

    tc = cfg["train"]
    params = model.dit_parameters()
    opt = torch.optim.AdamW(params, lr=float(tc.get("lr", 1e-4)), fused=(dev.type == "cuda") or None)
    precision = tc.get("precision", "bf16" if dev.type == "cuda" else "fp32")
    clip = float(tc.get("grad_clip", 1.0))
    fwd = model if fwd is None else fwd

    def step():
        with autocast(dev, precision):
            loss = flow_matching_loss(fwd, x0, noise, t)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if controller is not None:
            controller.step()
    return step


def add_shape_args(parser, heads: int) -> None:
    """The one-shape options of the single-run drivers: ``--S``, ``--heads`` (default
    ``heads``), ``--D``, ``--G``, ``--sparsity`` (default 64k tokens, D 128, G 64, 0.9)."""
    parser.add_argument("--S", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--G", type=int, default=64)
    parser.add_argument("--sparsity", type=float, default=0.9)


def add_seq_grid_args(parser) -> None:
    """``--seq`` (token counts, default 32k and 64k) and ``--grid`` (T,H,W per --seq entry)."""
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--grid", type=str, nargs="*", default=None,
                        help="T,H,W token grid per --seq entry (default: 32k 32x32x32, 64k 16x64x64)")


def resolve_grids(seqs: Sequence[int], grid_args: Optional[Sequence[str]]) -> Dict[int, Tuple[int, int, int]]:
    """The (T, H, W) grid of each sequence length: ``--grid T,H,W`` in order, else the default."""
    grids = {}
    for i, S in enumerate(seqs):
        if grid_args and i < len(grid_args):
            grids[S] = tuple(int(v) for v in grid_args[i].split(","))
        elif S in DEFAULT_GRIDS:
            grids[S] = DEFAULT_GRIDS[S]
        else:
            raise ValueError(f"--grid: give T,H,W for --seq {S}")
        if math.prod(grids[S]) != S:
            raise ValueError(f"--grid: {grids[S]} has {math.prod(grids[S])} tokens, not {S}")
    return grids


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd) -> str:
    try:
        return subprocess.check_output(cmd, cwd=_ROOT, text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def git_commit() -> str:
    """The commit measured (dsv_ext._buildcheck.source_commit: DSV_COMMIT, else the checkout's
    short HEAD, "+changes" when its tracked files differ from it; "unknown" outside a git tree)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dsv_buildcheck", os.path.join(_ROOT, "dsv_ext", "_buildcheck.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.source_commit()


def provenance() -> Dict[str, str]:
    """When and from what a result was measured: UTC date, git commit, csrc hash
    (benchmarks/csrc_hash.sh; the kernels' source whatever the commit says)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(),
            "csrc": _run(["bash", os.path.join(_ROOT, "benchmarks", "csrc_hash.sh")])}


def provenance_line(res: Dict) -> str:
    p = res.get("provenance") or {}
    return (f"Measured {p.get('date', '?')}, commit {p.get('commit', '?')} (csrc "
            f"{p.get('csrc', '?')}), {res.get('device', '?')}.")
