"""Where one inference call of DSV's sparse core spends its time (torch.profiler, CUDA kernels).

    python benchmarks/profile_sparse_core.py [--S 65536] [--heads 16] [--sparsity 0.9]

One block's attention as dsv_ext.functional.attention.sparse_core runs it in sampling (no grad): cube
reorder of q, low-rank projections, top-K estimation, sparse attention forward, inverse reorder.
Prints the CUDA kernels sorted by total time over --iters calls.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_shape_args  # noqa: E402
from dsv_ext.functional.attention import sparse_core  # noqa: E402
from dsv_ext.grouping import cube_permutation  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, heads=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    dev = "cuda"
    H, D, S = a.heads, a.D, a.S
    q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    wq = torch.randn(H, D, a.rank, device=dev) / math.sqrt(D)
    wk = torch.randn(H, D, a.rank, device=dev) / math.sqrt(D)
    side = round((S // 16) ** 0.5)
    perm, inv = cube_permutation((16, side, S // (16 * side)), (2, 4, 4), S, dev)
    K = int(math.ceil((1 - a.sparsity) * S / 64)) * 64
    cnt = torch.full((H,), K, dtype=torch.int32, device=dev)
    with torch.no_grad():
        for _ in range(2):
            sparse_core(q, k, v, wq, wk, perm, inv, cnt, K, a.G, None)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.iters):
                sparse_core(q, k, v, wq, wk, perm, inv, cnt, K, a.G, None)
            torch.cuda.synchronize()
    print(f"sparse_core S={S} H={H} D={D} G={a.G} K={K}, {a.iters} calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
