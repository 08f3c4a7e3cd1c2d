"""Where one training step of a config spends its time: attention against the rest
(torch.profiler: CUDA kernels on a GPU, operators on the CPU).

    python benchmarks/profile_step.py --config configs/long-video-narrow.yaml
    python benchmarks/profile_step.py --config configs/long-video-narrow.yaml --attention dsv
    python benchmarks/profile_step.py --config configs/long-video-narrow.yaml --set train.compile=true
    python benchmarks/profile_step.py --checkpoint runs/x/dsv/ckpt_last.pt --attention dsv

The config's model on random latents of its shape, stepped as the trainer steps it: bf16 autocast
(train.precision), forward, backward, gradient clipping, AdamW; with --attention dsv also the DSV
controller's step (stage 1: dense attention plus predictor training). With --checkpoint (a
training checkpoint or its slim copy, python -m dsv_ext.app.checkpoint --slim) the model has the
checkpoint's weights and config (--config / --set change it) and, with --attention dsv, the
controller its saved state: a run past the switch profiles a stage-2 step with the sparse blocks
and per-head K it chose (the predictors keep training every dsv.train_every_stage2 steps as in
training; the optimizer moments start fresh; no profile step, whose recall measurement on the
random latents would replace the run's lists). --warmup steps, then
--steps profiled. Prints the kernels (operators on the CPU) by total time and the step's share
in attention (names matching ATTENTION: cuDNN / FlashAttention SDPA, the pack's attention
kernels), in DSV's side work (SIDE: predictor training, top-K estimation, profiling) and in the
rest by kind (matrix products; the rest: element-wise work and reductions); --json writes the
same numbers.
"""
import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import train_step  # noqa: E402
from dsv_ext.app.common import build_model, inference_state_dict, load_config, resolve_device  # noqa: E402

SIDE = ("predictor", "topk", "profile_attn", "profile_attention")
ATTENTION = ("flash", "fmha", "sdpa", "cudnn", "attn", "attention")
MATMUL = ("gemm", "xmma", "cutlass", "cublas", "matmul", "addmm", "mm", "linear", "bmm")
KINDS = ("attention", "dsv side work", "matmul", "other")


def kind_of(name: str) -> str:
    """One of KINDS from a kernel's or operator's name: DSV's side work (predictor training,
    top-K estimation, profiling), attention, matrix products, the rest."""
    n = name.lower()
    if any(p in n for p in SIDE):
        return "dsv side work"
    if any(p in n for p in ATTENTION):
        return "attention"
    if any(p in n for p in MATMUL):
        return "matmul"
    return "other"


def profile_step(cfg, attention: str, device: str, warmup: int, steps: int, ck=None):
    """Profile ``steps`` training steps after ``warmup`` (``ck``: a loaded checkpoint whose weights
    and DSV controller state start them); returns (rows, totals, stage): rows of (name, kind,
    microseconds per step) sorted by time, totals per kind in microseconds per step, the DSV stage
    profiled (None: dense)."""
    from torch.profiler import ProfilerActivity, profile

    dev = resolve_device(device)
    torch.manual_seed(0)
    model, dsv_cfg = build_model(cfg, attention, dev)
    if ck is not None:
        res = model.load_state_dict(inference_state_dict(ck), strict=False)
        off = [k for k in list(res.missing_keys) + list(res.unexpected_keys) if ".predictor." not in k]
        if off:
            raise ValueError(f"--checkpoint: its weights do not fit this model (e.g. {off[0]})")
    tc = cfg["train"]
    controller = None
    if attention == "dsv":
        from dsv_ext.control.controller import DSVController

        saved = ck.get("controller") if ck is not None else None
        if isinstance(saved, dict) and saved.get("stage") == 2:
            # no profile steps: their recall measurement on random latents would replace the
            # lists the run chose on its data (often with all keys: a dense step)
            dsv_cfg = replace(dsv_cfg, profile_until=0, profile_every_late=10 ** 9)
        controller = DSVController(model, dsv_cfg)
        if isinstance(saved, dict):
            controller.load_state_dict(saved)
    fwd = torch.compile(model) if tc.get("compile") and dev.type == "cuda" else model
    shape = (int(tc.get("batch_size", 1)), model.cfg.in_channels, *model.cfg.latent_size)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(shape, generator=g).to(dev), torch.randn(shape, generator=g).to(dev)
    t = torch.rand(shape[0], generator=g).clamp(0.05, 0.95).to(dev)
    step = train_step(model, cfg, x0, noise, t, dev, controller, fwd)
    model.train()
    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = (e.self_device_time_total if dev.type == "cuda" else e.self_cpu_time_total) / steps
        if us > 0 and (dev.type != "cuda" or e.device_type == torch.autograd.DeviceType.CUDA):
            rows.append((e.key, kind_of(e.key), us))
    rows.sort(key=lambda r: -r[2])
    totals = {k: sum(r[2] for r in rows if r[1] == k) for k in KINDS}
    return rows, totals, None if controller is None else controller.stage


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="the config (default with --checkpoint: the checkpoint's)")
    ap.add_argument("--checkpoint", default=None,
                    help="start from this training checkpoint's weights and DSV controller state")
    ap.add_argument("--set", action="append", default=[], metavar="SEC.KEY=VALUE")
    ap.add_argument("--attention", choices=("dense", "dsv"), default="dense")
    ap.add_argument("--device", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if a.config is None and a.checkpoint is None:
        ap.error("--config or --checkpoint is required")
    ck = None
    if a.checkpoint is not None:
        from dsv_ext.app.checkpoint import load_checkpoint

        ck = load_checkpoint(a.checkpoint, map_location="cpu", required=("model", "config"))
    cfg = load_config(a.config, a.set, base=None if a.config else ck["config"])
    rows, totals, stage = profile_step(cfg, a.attention, a.device, a.warmup, a.steps, ck)
    total = sum(totals.values())
    unit = "device" if (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "CPU"
    what = f"attention={a.attention}" + ("" if stage is None else f" (DSV stage {stage})")
    print(f"{cfg['name']}, {what}: {total / 1000:.2f} ms of {unit} time per step")
    for k, v in totals.items():
        print(f"  {k:13s} {v / 1000:8.2f} ms  {100 * v / max(total, 1e-9):5.1f}%")
    print(f"\n{'ms/step':>8s}  {'kind':13s}  name")
    for name, kind, us in rows[:a.top]:
        print(f"{us / 1000:8.3f}  {kind:13s}  {name[:100]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg["name"], "attention": a.attention, "dsv_stage": stage,
                       "checkpoint": a.checkpoint, "unit": unit,
                       "ms_per_step": {k: v / 1000 for k, v in totals.items()},
                       "top": [{"name": n, "kind": k, "ms": u / 1000} for n, k, u in rows[:a.top]]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
