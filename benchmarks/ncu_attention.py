"""Driver for Nsight Compute: runs the sparse attention forward and backward once each (after a
warm-up) at the target shape, so `ncu` can profile one launch of each kernel.

  ncu --clock-control none -k regex:"sparse_attn_fwd|bwd_qmajor|bwd_kmajor" -c 3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      python benchmarks/ncu_attention.py --heads 4

Inputs: top-K lists of random low-rank scores ("random") or of spatially smooth ones
("smooth"), as in bench_kernels.py. Heads default to 4 (the grid still fills the card: 1024
groups x 4 heads CTAs at S = 64k). With --kv-block 16 / 64: random lists of key blocks (as
bench_kernels.py --kv-block), on the block kernels through the C API:

  ncu ... -k regex:"sparse_attn_fwd|bwd_" python benchmarks/ncu_attention.py --kv-block 64 --G 128
"""
import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_kernels as BK  # noqa: E402
from bench_common import add_shape_args  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, heads=4)
    ap.add_argument("--dist", default="random", choices=["random", "smooth"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kv-block", type=int, default=1, choices=[1, 16, 64],
                    help="random lists of key blocks of this many keys (1: token lists)")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    B, S, H, D, G = 1, a.S, a.heads, a.D, a.G
    if a.kv_block > 1:
        return block_lists(a, gen)
    K = BK.keys_for(S, a.sparsity)
    _, est = BK.estimate_fn()
    ql, kl = BK.lowrank_inputs(a.dist, B, S, H, gen, "cuda")
    cnt = torch.full((B, H), K, dtype=torch.int32, device="cuda")
    kv_index = est(ql.bfloat16(), kl.bfloat16(), cnt, G, K)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1.0 / math.sqrt(D)
    for _ in range(a.warmup + 1):
        out, lse = BK.T.attn_fwd(q, k, v, kv_index, cnt, G, scale)
        BK.T.attn_bwd(do, q, k, v, out, lse, kv_index, cnt, G, scale)
    torch.cuda.synchronize()
    print("done", S, H, D, G, K)


def block_lists(a, gen):
    """The forward and backward of random key-block lists (bench_kernels.block_case's lists)."""
    lib, M = BK.block_lib()
    S, H, D, G, b = a.S, a.heads, a.D, a.G, a.kv_block
    q, k, v, do, out, lse, dq, dk, dv = BK.block_buffers(S, H, D)
    idx, cnt = BK.random_block_lists(1, S, H, G, a.sparsity, b, gen)
    scale = 1.0 / math.sqrt(D)
    wf, wb = BK.block_workspaces(lib, M, q, idx, G, scale, b)
    for _ in range(a.warmup + 1):
        BK._blk_call(lib, M, q, k, v, idx, cnt, G, scale, b, (out, lse, dq, dk, dv, do, wf, wb))
    torch.cuda.synchronize()
    print("done", S, H, D, G, f"{int(cnt[0, 0])} blocks of {b}")


if __name__ == "__main__":
    main()
