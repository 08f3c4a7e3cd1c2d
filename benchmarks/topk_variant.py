"""Time the sampled-threshold top-K variants (csrc/dev/topk_sampled.cu: with a collect pass, and
with it folded into the compaction) against the shipped kernel in one process: the entry points
of the library DSV_TOPK_VARIANT_LIB (built by benchmarks/device_topk_variant.sh) on the same
inputs, alternating, with the lists compared entry for entry (they must be equal: same scores,
exact selection).

Inputs per shape: random bf16 N(0, 1) low-rank rows [1, S, H, r] (as benchmarks/bench_topk.py)
and, with --patterns, the adversarial ones of tests/test_topk_sampled_cuda.py (sample_up: the
sample misleads, the band pass falls back; few: runs of equal scores).

  DSV_TOPK_VARIANT_LIB=/tmp/tks/libtopk_sampled.so python benchmarks/topk_variant.py \
      --shapes 65536:0.1,65536:0.05 --heads 24 --group 64 --json /tmp/out/topk_variant.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import test_topk_sampled_cuda as V  # noqa: E402
from bench_common import cuda_time_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="65536:0.1,65536:0.05,131072:0.2,32768:0.1",
                    help="comma list of S:frac (K = ceil(frac * S))")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--patterns", default="random",
                    help="comma list of random, sample_up, sample_down, few, periodic")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not os.environ.get("DSV_TOPK_VARIANT_LIB"):
        print("topk_variant: needs a GPU and DSV_TOPK_VARIANT_LIB")
        return 1
    lib = V.variant_lib()
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    gc = torch.Generator().manual_seed(0)
    recs = []
    for item in args.shapes.split(","):
        s, f = item.split(":")
        S, frac = int(s), float(f)
        K = min(S, int(-(-frac * S // 1)))
        H, G, r = args.heads, args.group, args.rank
        for pattern in args.patterns.split(","):
            q = torch.randn(1, S, H, r, generator=g, device="cuda").to(dt)
            k = torch.randn(1, S, H, r, generator=g, device="cuda").to(dt)
            V.shape_pattern(q, k, pattern, gc)
            cnt = torch.full((1, H), K, dtype=torch.int32, device="cuda")
            NG = -(-S // G)
            outs = {n: torch.empty((1, H, NG, K), dtype=torch.int32, device="cuda")
                    for n in V.ENTRIES}
            rec = dict(S=S, H=H, G=G, r=r, K=K, frac=frac, dtype=args.dtype, pattern=pattern)
            for rnd in range(2):  # alternate: the variants, shipped, the variants, shipped
                for n in V.ENTRIES:
                    t = cuda_time_ms(lambda: V.run_entry(lib, n, q, k, cnt, G, K, out=outs[n],
                                                         poison=False),
                                     warmup=2, reps=args.reps)
                    rec.setdefault(n, []).append(t["median_ms"])
            ms = {n: min(rec[n]) for n in V.ENTRIES}
            same = all(torch.equal(outs[n], outs[V.SHIPPED]) for n in V.VARIANTS)
            rec.update(ms_variant=ms[V.VARIANTS[0]], ms_fold=ms[V.VARIANTS[1]],
                       ms_shipped=ms[V.SHIPPED], lists_equal=same)
            recs.append(rec)
            ref = ms[V.SHIPPED]
            print(f"topk S={S:7d} H={H} G={G} r={r} K={K:6d} ({frac:.0%}) {args.dtype} "
                  f"{pattern:11s}: sampled {rec['ms_variant']:7.3f} ms "
                  f"({ref / rec['ms_variant']:.2f}x), folded {rec['ms_fold']:7.3f} ms "
                  f"({ref / rec['ms_fold']:.2f}x), shipped {ref:7.3f} ms, lists "
                  f"{'equal' if same else 'DIFFER'}", flush=True)
            del q, k, outs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(card=torch.cuda.get_device_name(), records=recs), fh, indent=1)
    return 0 if all(r["lists_equal"] for r in recs) else 2


if __name__ == "__main__":
    sys.exit(main())
