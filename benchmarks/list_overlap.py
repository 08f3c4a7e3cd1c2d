"""How much the top-K key lists of adjacent query groups overlap (CPU; the inputs of
bench_kernels.py): the quantity that decides whether a backward that reduces dK/dV once per key
shared by a pair of groups pays (benchmarks/PERF_LOG.md, "What next" 0).

    python benchmarks/list_overlap.py          # about 1 min on 2 cores
"""
import sys, math, torch
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as BK
G = 64
for S in (16384, 65536):
    for dist in ("random", "smooth"):
        gen = torch.Generator().manual_seed(0)
        ql, kl = BK.lowrank_inputs(dist, 1, S, 2, gen, "cpu")
        K = BK.keys_for(S, 0.9)
        NG = S // G
        res = []
        for h in range(2):
            rep = ql[0, :, h].view(NG, G, -1).mean(1)            # [NG, r]
            sc = rep @ kl[0, :, h].T                              # [NG, S]
            idx = sc.topk(K, dim=1).indices
            sel = torch.zeros(NG, S, dtype=torch.bool); sel.scatter_(1, idx, True)
            pair = (sel[0::2] & sel[1::2]).sum(1).float() / K      # overlap of groups 2i, 2i+1
            u2 = (sel[0::2] | sel[1::2]).sum(1).float() / K        # union size / K
            s4 = sel.view(NG // 4, 4, S)
            u4 = s4.any(1).sum(1).float() / K
            res.append((pair.mean().item(), u2.mean().item(), u4.mean().item()))
        f = sum(r[0] for r in res) / 2; u2 = sum(r[1] for r in res) / 2; u4 = sum(r[2] for r in res) / 2
        # a pair reducing each key of its union once: u2 K reductions instead of 2 K; split into
        # intersection (128 query rows) and exclusive parts (64 rows), the MMA work is unchanged
        print(f"S={S} {dist:6s} K={K}: pair overlap {f:.3f}, union of 2 = {u2:.2f} K, union of 4 = "
              f"{u4:.2f} K -> paired backward: reductions x{u2 / 2:.2f}, MMA x1.00")
