"""What DSV's training side work costs per block: predictor training and profiling.

    python benchmarks/bench_side_tasks.py [--S 65536] [--heads 8] [--D 128] [--G 128]
                                          [--density 1.0 0.1] [--out DIR]

A SparseAttention block (DSVConfig defaults but group_size G and row_sample_stride, as
configs/long-video.yaml) runs its side tasks (`run_side_tasks`) on random bf16 q / k of one
video, the way a training forward does under each StepPlan: predictor training alone (a
stage-1 / stage-2 training step), profiling alone (the sparsity at theta, the recall of the
predicted lists at the block's per-head K = density x S, and the recall-versus-K curve of
k_rule "recall"), both together; and each part of profiling alone (`profile_attention` for the
sparsity, `topk_estimate` + `profile_attention` for the recall, `recall_curve`). Times are CUDA-
event medians in ms, beside the dense attention forward + backward of the same block (cuDNN
SDPA) for scale: the long real-video run profiles every 25 steps, so a profile that costs x
dense steps adds x / 25 to the step time of every block.

Writes side_tasks.json and side_tasks.md to --out (default benchmarks/results/side_tasks) with
date, commit and card. Needs a CUDA GPU and the CUDA kernels.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cuda_time_ms, provenance  # noqa: E402

import dsv_ext  # noqa: E402
from dsv_ext.config import DSVConfig  # noqa: E402
from dsv_ext.grouping import cube_permutation  # noqa: E402
from dsv_ext.modules.attention import SparseAttention  # noqa: E402
from dsv_ext.modules.contract import StepPlan  # noqa: E402
from dsv_ext.recall import recall_curve  # noqa: E402


def grid_for(S: int):
    """A (T, H, W) grid of S tokens with T = 16 (the long-video shape at 64k: 16 x 64 x 64)."""
    side = math.isqrt(S // 16)
    if 16 * side * side != S:
        raise SystemExit(f"--S: expected 16 x a square (e.g. 65536 = 16 x 64 x 64), got {S}")
    return (16, side, side)


def measure(S: int, H: int, D: int, G: int, density: float, stride: int, reps: int) -> dict:
    dev = torch.device("cuda")
    cfg = DSVConfig(group_size=G, row_sample_stride=stride)
    grid = grid_for(S)
    m = SparseAttention(H, D, grid=grid, config=cfg).to(dev)
    q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(D)

    def side(train: bool, profile: bool):
        m.plan_step(StepPlan(stage=2, train=train, profile=profile, density=(density,) * H, seq_len=S))
        m.run_side_tasks(q, k, grid, scale)
        m.take_stats()

    side(False, False)  # the workload, per-head K
    perm, _ = cube_permutation(grid, cfg.cube, S, dev)  # the queries' cube order
    qc = q.index_select(1, perm)
    rows = m.sampled_rows(S, dev)
    counts = m.kv_counts_for(S).view(1, H).contiguous()
    ops = dsv_ext.ops
    wq, wk = m.predictor.wq.detach(), m.predictor.wk.detach()

    def recall_part():
        q_lr, k_lr = m.predictor(qc, k)
        idx = ops.topk_estimate(q_lr, k_lr, counts, G, m.kmax)
        ops.profile_attention(qc, k, rows, cfg.theta, idx, counts, G, scale)

    parts = {
        "train": lambda: side(True, False),
        "profile": lambda: side(False, True),
        "train + profile": lambda: side(True, True),
        "profile: sparsity (profile_attention)": lambda: ops.profile_attention(qc, k, rows, cfg.theta,
                                                                               scale=scale),
        "profile: recall (topk_estimate + profile_attention)": recall_part,
        "profile: recall curve (recall_curve)": lambda: recall_curve(
            qc, k, wq, wk, rows, G, cfg.k_multiple, scale, max_rows=cfg.recall_rows),
    }
    out = {"S": S, "H": H, "D": D, "G": G, "density": density, "K": int(m.kmax), "rows": int(rows.numel()),
           "recall_rows": cfg.recall_rows, "ms": {}}
    for name, fn in parts.items():
        with torch.no_grad() if name.startswith("profile:") else torch.enable_grad():
            out["ms"][name] = cuda_time_ms(fn, warmup=1, reps=reps)["median_ms"]

    qd, kd, vd = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    go = torch.randn_like(qd)

    def dense():
        o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd)
        o.backward(go)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        out["dense_fwdbwd_ms"] = cuda_time_ms(dense, warmup=1, reps=reps)["median_ms"]
    return out


def write_md(recs, info, path):
    lines = ["# DSV's training side work per block", "",
             f"`benchmarks/bench_side_tasks.py`, {info['date']}, commit {info['commit']} (csrc "
             f"{info['csrc']}), {info['card']}, torch {info['torch']}. One SparseAttention block, bf16, "
             "batch 1; CUDA-event medians (ms) "
             "and as a fraction of the block's dense attention forward + backward (cuDNN).", ""]
    for r in recs:
        lines += [f"S = {r['S']}, {r['H']} heads of {r['D']}, G = {r['G']}, per-head K = {r['K']} "
                  f"(density {r['density']}), {r['rows']} sampled rows ({r['recall_rows']} for the curve); "
                  f"dense forward + backward {r['dense_fwdbwd_ms']:.2f} ms", "",
                  "| side work | ms | x dense fwd + bwd |", "|---|---|---|"]
        lines += [f"| {n} | {ms:.2f} | {ms / r['dense_fwdbwd_ms']:.3f} |" for n, ms in r["ms"].items()]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--G", type=int, default=128)
    ap.add_argument("--stride", type=int, default=32, help="row_sample_stride (long-video.yaml: 32)")
    ap.add_argument("--density", type=float, nargs="+", default=[1.0, 0.1],
                    help="per-head K / S of the block (1.0: every head at K = S, as the long run's)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "side_tasks"))
    a = ap.parse_args(argv)
    for d in a.density:
        if not 0.0 < d <= 1.0:
            raise SystemExit(f"--density: expected values in (0, 1], got {d}")
    if not torch.cuda.is_available() or not dsv_ext.has_cuda_kernels():
        raise SystemExit("bench_side_tasks: needs a CUDA GPU and the extension built with CUDA kernels")
    recs = []
    for d in a.density:
        r = measure(a.S, a.heads, a.D, a.G, d, a.stride, a.reps)
        print(json.dumps(r))
        recs.append(r)
    info = dict(provenance(), card=torch.cuda.get_device_name(), torch=torch.__version__)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "side_tasks.json"), "w") as f:
        json.dump({"info": info, "records": recs}, f, indent=1)
    write_md(recs, info, os.path.join(a.out, "side_tasks.md"))
    print(f"wrote {a.out}/side_tasks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
