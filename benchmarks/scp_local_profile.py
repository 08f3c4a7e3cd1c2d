"""Why SCP's per-rank compute exceeds HCP's on 2 GPUs (bench_cp): the two local workloads on one GPU.

HCP, rank of 2 at S tokens: H/2 heads, all S queries against all S keys (groups of G).
SCP, rank of 2: all H heads, S/2 queries (padded to the key-table length S with empty lists, as
dsv_ext.parallel.scp does) against a table of S keys; estimation in scp's "repeat" mode (each
local group repeated n times, group size n G). Same FLOPs; this times estimation, forward and
backward of each, and SCP without the query padding (S/2 queries against S/2 keys, an upper
bound on what a kernel taking separate query and key lengths would save).

    python benchmarks/scp_local_profile.py [--S 131072] [--heads 16] [--sparsity 0.9]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dsv_ext  # noqa: E402
from bench_common import cuda_time_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    S, H, D, G, r = a.S, a.heads, a.head_dim, a.group_size, 16
    K = min(S, -(-int(math.ceil((1 - a.sparsity) * S)) // 64) * 64)
    dt = torch.bfloat16
    dev = "cuda"
    torch.manual_seed(0)

    def run(name, Sq_valid, Sk, h, est_args):
        ql, kl, cnt, gsz, keep = est_args
        est = lambda: dsv_ext.topk_estimate(ql, kl, cnt, gsz, kmax=K)  # noqa: E731
        idx = est()[:, :, :keep]
        ng_tab = Sk // G
        if idx.shape[2] < ng_tab:
            idx = torch.cat([idx, idx.new_full((1, h, ng_tab - idx.shape[2], idx.shape[3]), -1)], 2)
        idx = idx.contiguous()
        q, k, v, do = (torch.randn(1, Sk, h, D, device=dev, dtype=dt) for _ in range(4))
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        c = torch.full((1, h), K, dtype=torch.int32, device=dev)
        fwd = lambda: dsv_ext.sparse_attention(q, k, v, idx, c, G, check_index=False)  # noqa: E731
        out = fwd()

        def fb():
            o = fwd()
            torch.autograd.grad(o, (q, k, v), do)
        t_est = cuda_time_ms(est, 1, a.reps)["median_ms"]
        t_fwd = cuda_time_ms(fwd, 1, a.reps)["median_ms"]
        t_fb = cuda_time_ms(fb, 1, a.reps)["median_ms"]
        print(f"{name:34s} est {t_est:7.2f}  fwd {t_fwd:7.2f}  bwd {t_fb - t_fwd:7.2f}  total {t_est + t_fb:7.2f} ms",
              flush=True)
        del out

    def lr(n, h):
        return torch.randn(1, n, h, r, device=dev, dtype=dt)

    hh = H // 2
    cnt_h = torch.full((1, hh), K, dtype=torch.int32, device=dev)
    cnt_f = torch.full((1, H), K, dtype=torch.int32, device=dev)
    run(f"HCP rank: {hh} heads x {S} q", S, S, hh, (lr(S, hh), lr(S, hh), cnt_h, G, S // G))
    L = S // 2
    ql = lr(L, H)
    rep = ql.reshape(1, L // G, 1, G, H, r).expand(1, L // G, 2, G, H, r).reshape(1, S, H, r)
    run(f"SCP rank: {H} heads x {L} q (padded)", L, S, H, (rep, lr(S, H), cnt_f, 2 * G, L // G))
    run(f"SCP, {H} heads x {L} q, no pad", L, L, H, (ql, lr(L, H), torch.full((1, H), min(K, L), dtype=torch.int32, device=dev), G, L // G))


if __name__ == "__main__":
    main()
