"""Backward of the sparse attention: the wgmma kernel (DSV_ATTN_BWD_TILE=w64x2) against the
mma.sync query-major kernel (32x2), timed alternately in the same run on the same inputs
(top-K lists from dsv's estimate, random and smooth distributions, as bench_kernels.py), with
the forward and the estimate for the composed total, and a full-size agreement check of the two
kernels' gradients (max |a - b| / rms(b) per tensor). Also the dK / dV row reductions per
backward (groups x chunks x selected keys, what the query-major path adds into L2).

Usage: python benchmarks/bench_bwd_wg.py [--S 65536] [--H 24] [--D 128] [--G 64]
       [--sparsity 0.9] [--dist random smooth] [--reps 7] [--out DIR]
Writes DIR/bench_bwd_wg.json (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_kernels as BK  # noqa: E402
from bench_kernels import T  # noqa: E402


def rel_err(a, b):
    a, b = a.float(), b.float()
    rms = b.pow(2).mean().sqrt().clamp(min=1e-30)
    return float((a - b).abs().max() / rms)


def kernel_times(fn, title):
    """Per-kernel CUDA time (ms) of one call of fn, the 5 longest."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:5]
    print(f"  kernels {title}: " + "; ".join(
        f"{e.key.split('<')[0].split('(')[0][-28:]} {e.device_time_total / 1e3:.2f}" for e in ev), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=[65536])
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--D", type=int, nargs="+", default=[128])
    ap.add_argument("--G", type=int, nargs="+", default=[64])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.9])
    ap.add_argument("--dist", nargs="+", default=["random", "smooth"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ranges", default=None, help="DSV_ATTN_RANGES for both kernels")
    ap.add_argument("--profile", action="store_true", help="per-kernel times (torch.profiler)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.ranges:
        os.environ["DSV_ATTN_RANGES"] = args.ranges
    B, dtype = 1, torch.bfloat16
    est_name, est = BK.estimate_fn()
    gen = torch.Generator().manual_seed(0)
    recs, dense = [], {}
    for S in args.S:
        for dist in args.dist:
            cache = {}
            ql, kl = BK.lowrank_inputs(dist, B, S, args.H, gen, "cuda")
            ql, kl = ql.to(dtype), kl.to(dtype)
            for sp in args.sparsity:
                K = BK.keys_for(S, sp)
                cnt = torch.full((B, args.H), K, dtype=torch.int32, device="cuda")
                for G in args.G:
                    kv_index = est(ql, kl, cnt, G, K)
                    est_ms = BK.bench(lambda: est(ql, kl, cnt, G, K), 3, 1)
                    for D in args.D:
                        scale = 1.0 / math.sqrt(D)
                        q, k, v, do = (torch.randn(B, S, args.H, D, device="cuda", dtype=dtype)
                                       for _ in range(4))
                        out, lse = T.attn_fwd(q, k, v, kv_index, cnt, G, scale)
                        fwd_ms = BK.bench(lambda: T.attn_fwd(q, k, v, kv_index, cnt, G, scale),
                                          args.reps)
                        bwd = lambda: T.attn_bwd(do, q, k, v, out, lse, kv_index, cnt, G, scale)  # noqa: E731
                        grads, times = {}, {"32x2": [], "w64x2": [], "default": [], "nored": []}
                        for tile in ("32x2", "w64x2"):
                            os.environ["DSV_ATTN_BWD_TILE"] = tile
                            grads[tile] = bwd()
                        for _ in range(3):  # alternate: drift in clocks hits both alike
                            for tile in ("32x2", "w64x2", "default", "nored"):
                                if tile == "default":
                                    os.environ.pop("DSV_ATTN_BWD_TILE", None)
                                elif tile == "nored":  # measurement only: no dK/dV reductions
                                    os.environ["DSV_ATTN_BWD_TILE"] = "w64x2"
                                    os.environ["DSV_ATTN_BWD_WG_DIAG"] = "nored"
                                else:
                                    os.environ["DSV_ATTN_BWD_TILE"] = tile
                                times[tile].append(BK.bench(bwd, args.reps, 1))
                                os.environ.pop("DSV_ATTN_BWD_WG_DIAG", None)
                        if args.profile:
                            for tile, km in (("32x2", "0"), ("w64x2", "0"), ("32x2", "1e9"), ("w64x2", "1e9")):
                                os.environ["DSV_ATTN_BWD_TILE"] = tile
                                os.environ["DSV_KM_RATIO"] = km
                                kernel_times(bwd, f"{dist} D={D} G={G} tile={tile} km_ratio={km}")
                            os.environ.pop("DSV_KM_RATIO", None)
                        os.environ.pop("DSV_ATTN_BWD_TILE", None)
                        agree = {n: rel_err(a, b) for n, a, b in
                                 zip(("dq", "dk", "dv"), grads["w64x2"], grads["32x2"])}
                        nan = {n: bool(torch.isnan(a).any()) for n, a in zip(("dq", "dk", "dv"), grads["w64x2"])}
                        valid = (kv_index >= 0).sum().item() * math.ceil(G / 64)
                        ratio = BK.km_stats(kv_index, cnt)
                        ms = {t: min(v) for t, v in times.items()}
                        if (S, D) not in dense:
                            dense[(S, D)] = BK.dense_times(B, S, args.H, D, dtype, 3, ("cudnn",))
                        cudnn = dense[(S, D)].get("cudnn_fwdbwd_ms")
                        rec = dict(S=S, H=args.H, D=D, G=G, sparsity=sp, dist=dist, K=K,
                                   est_ms=est_ms, fwd_ms=fwd_ms, bwd_mma_ms=ms["32x2"],
                                   bwd_wg_ms=ms["w64x2"], bwd_default_ms=ms["default"],
                                   bwd_wg_noreductions_ms=ms["nored"],
                                   bwd_all_ms=times, agree_wg_vs_mma=agree, wg_nan=nan,
                                   km_ratio_median=float(ratio.median()),
                                   fp32_reductions=int(valid) * D * 2,
                                   total_wg_ms=est_ms + fwd_ms + ms["w64x2"],
                                   total_mma_ms=est_ms + fwd_ms + ms["32x2"], cudnn_fwdbwd_ms=cudnn)
                        if cudnn:
                            rec["speedup_wg"] = cudnn / rec["total_wg_ms"]
                            rec["speedup_mma"] = cudnn / rec["total_mma_ms"]
                        print(json.dumps({k: v for k, v in rec.items() if k != "bwd_all_ms"}), flush=True)
                        recs.append(rec)
                        del q, k, v, do, out, lse, grads
                        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_bwd_wg.json"), "w") as f:
        json.dump({"card": torch.cuda.get_device_name(), "commit": BK.git_commit(),
                   "estimate": est_name, "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
