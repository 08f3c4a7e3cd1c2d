"""CPU scaling of dsv-ext sparse attention: time grows with S * K, not S^2.

For each sequence length S and per-group key count K, times the C reference kernel
(torch.ops.dsv.sparse_attention_fwd, and with --backward the backward too) on random sorted
key lists, next to dense attention (torch's scaled_dot_product_attention, same dtype) at the
same S, on one thread by default (--threads). Prints a table, the time per (query, key) pair (flat when the cost is linear in K), and
log-log slopes of time against S (about 1 for sparse at fixed K, about 2 for dense) and against
K (about 1). Defaults run in well under a minute.

    python benchmarks/cpu_scaling.py                 # table
    python benchmarks/cpu_scaling.py --backward --threads 0   # + backward, all threads
    python benchmarks/cpu_scaling.py --json out.json # also write the rows as JSON ("-": stdout)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

import dsv_ext  # noqa: F401  (registers torch.ops.dsv)
from dsv_ext.config import DSVConfig
from dsv_ext.reference import random_index


def _time_once(fn, min_time: float = 0.03) -> float:
    """Mean wall time of fn() over a batch of calls lasting at least min_time seconds."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= min_time or n >= 50:
            return el / n


def _slope(xs, ys):
    """Least-squares slope of log(y) against log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def run(args) -> dict:
    """Times every case once per round, `repeat` rounds, and keeps each case's best time.
    Interleaving the rounds spreads the noise of a shared machine evenly over the cases."""
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    g = torch.Generator().manual_seed(0)
    B, H, D, G = args.batch, args.heads, args.dim, args.group
    scale = 1.0 / math.sqrt(D)
    cases = []  # (key, fn)
    rows = []
    for S in args.seqlens:
        q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=dtype) for _ in range(3))
        if not args.no_dense:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            cases.append((("dense", S), lambda qt=qt, kt=kt, vt=vt:
                          F.scaled_dot_product_attention(qt, kt, vt)))
        for K in args.ks:
            if K > S:
                continue
            idx, cnt = random_index(B, H, S, G, K, K, generator=g)
            fwd = (lambda q=q, k=k, v=v, idx=idx, cnt=cnt:
                   torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, scale))
            cases.append((("fwd", S, K), fwd))
            if args.backward:
                out, lse = fwd()
                dout = torch.randn(out.shape, generator=g, dtype=dtype)
                cases.append((("bwd", S, K), lambda q=q, k=k, v=v, out=out, lse=lse, idx=idx,
                              cnt=cnt, dout=dout: torch.ops.dsv.sparse_attention_bwd(
                                  dout, q, k, v, out, lse, idx, cnt, G, scale)))
            rows.append({"S": S, "K": K, "density": K / S})
    best = {}
    for _, fn in cases:  # warm-up
        fn()
    for r in range(args.repeat):
        for key, fn in cases:
            best[key] = min(best.get(key, math.inf), _time_once(fn))
        if args.verbose:
            print(f"round {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    for row in rows:
        S, K = row["S"], row["K"]
        row["sparse_fwd_ms"] = 1e3 * best[("fwd", S, K)]
        row["dense_fwd_ms"] = 1e3 * best[("dense", S)] if ("dense", S) in best else None
        row["ns_per_pair_fwd"] = 1e6 * row["sparse_fwd_ms"] / (B * H * S * K)
        if args.backward:
            row["sparse_bwd_ms"] = 1e3 * best[("bwd", S, K)]
            row["ns_per_pair_bwd"] = 1e6 * row["sparse_bwd_ms"] / (B * H * S * K)

    fits = {}
    for K in args.ks:
        pts = [(r["S"], r["sparse_fwd_ms"]) for r in rows if r["K"] == K]
        if len(pts) >= 2:
            fits[f"sparse_fwd_vs_S_at_K{K}"] = _slope(*zip(*pts))
    for S in args.seqlens:
        pts = [(r["K"], r["sparse_fwd_ms"]) for r in rows if r["S"] == S]
        if len(pts) >= 2:
            fits[f"sparse_fwd_vs_K_at_S{S}"] = _slope(*zip(*pts))
    dense = sorted({(r["S"], r["dense_fwd_ms"]) for r in rows if r["dense_fwd_ms"]})
    if len(dense) >= 2:
        fits["dense_fwd_vs_S"] = _slope(*zip(*dense))
    return {
        "config": {"rounds": args.repeat, "batch": B, "heads": H, "head_dim": D, "group_size": G, "dtype": args.dtype,
                   "threads": torch.get_num_threads(), "omp_num_threads":
                   os.environ.get("OMP_NUM_THREADS"), "cpu": platform.processor() or platform.machine(),
                   "torch": torch.__version__,
                   "loadavg_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                   "cpus": os.cpu_count()},
        "rows": rows,
        "loglog_slopes": fits,
    }


def print_table(res: dict, backward: bool) -> None:
    c = res["config"]
    print(f"dsv-ext CPU sparse attention scaling: B={c['batch']} H={c['heads']} D={c['head_dim']} "
          f"G={c['group_size']} {c['dtype']}, threads={c['threads']}, best of {c['rounds']} "
          f"interleaved rounds; load average {c['loadavg_1min_at_end']:.1f} on {c['cpus']} CPUs "
          f"(a load above the CPU count makes the timings noisy)")
    head = f"{'S':>6} {'K':>5} {'K/S':>6} {'sparse fwd ms':>13} {'ns/(q,k) pair':>13}"
    if backward:
        head += f" {'sparse bwd ms':>13} {'bwd ns/pair':>11}"
    head += f" {'dense SDPA ms':>13} {'dense/sparse':>12}"
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        line = (f"{r['S']:>6} {r['K']:>5} {r['density']:>6.3f} {r['sparse_fwd_ms']:>13.2f} "
                f"{r['ns_per_pair_fwd']:>13.2f}")
        if backward:
            line += f" {r['sparse_bwd_ms']:>13.2f} {r['ns_per_pair_bwd']:>11.2f}"
        if r["dense_fwd_ms"] is not None:
            line += f" {r['dense_fwd_ms']:>13.2f} {r['dense_fwd_ms'] / r['sparse_fwd_ms']:>12.2f}"
        print(line)
    print("\nlog-log slopes (time ~ x^slope): sparse vs S at fixed K should be ~1, "
          "sparse vs K ~1, dense vs S ~2")
    for k, v in res["loglog_slopes"].items():
        print(f"  {k:<28} {v:5.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 2048, 4096, 8192])
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=DSVConfig.group_size)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backward", action="store_true", help="also time the sparse backward")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense SDPA baseline")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch / OpenMP threads for both the sparse kernel and dense SDPA "
                         "(default 1: this shows scaling, not parallel speed, and one thread "
                         "gives steady numbers on a busy shared machine; 0 = torch's default)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels share torch's OpenMP runtime
    res = run(args)
    if args.json == "-":
        json.dump(res, sys.stdout, indent=2)
        print()
    else:
        print_table(res, args.backward)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
            print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
