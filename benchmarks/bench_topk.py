"""Time the fused top-K estimation kernel (csrc/cuda/topk_estimate.cu) against S and K.

Reaches the kernel through torch.ops.dsv (built extension) or, when DSV_OPS_LIB is set, through
ctypes (tests/helpers.py holds the access code). Medians of CUDA-event timings
after warm-up, random bf16 N(0, 1) low-rank inputs of shape [1, S, H, r], every head with
K = frac * S. Optionally times the plain PyTorch way (group-mean matmul + torch.topk + sort) at
the same shape for comparison (--torch-baseline; needs H * S/G * S * 4 bytes of scores).

  python benchmarks/bench_topk.py --shapes 65536:0.1,131072:0.2 --heads 24 --group 64
Prints one line per shape and, with --json, writes the records there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import test_topk_estimate_cuda as KB  # noqa: E402

sys.path.insert(0, HERE)
from bench_common import cuda_time_ms  # noqa: E402


def time_ms(fn, warmup=3, reps=10):
    t = cuda_time_ms(fn, warmup=warmup, reps=reps)
    return t["median_ms"], t["min_ms"], t["max_ms"]


def torch_baseline(q, k, K, G):
    B, S, H, r = q.shape
    NG = -(-S // G)
    pad = NG * G - S
    qf = q.float()
    if pad:
        qf = torch.cat([qf, qf.new_zeros(B, pad, H, r)], dim=1)
    cnt = torch.full((NG,), G, device=q.device, dtype=torch.float32)
    cnt[-1] = G - pad
    rep = qf.view(B, NG, G, H, r).sum(2) / cnt[None, :, None, None]  # [B, NG, H, r]
    sc = torch.einsum("bghr,bshr->bhgs", rep, k.float())
    idx = torch.topk(sc, K, dim=-1).indices
    return idx.sort(dim=-1).values


def spot_check(q, k, idx, G, K, ngroups=32):
    """Head 0, first `ngroups` (full) groups: the selection against float64 scores (same rule
    as tests/helpers.py check_topk). Returns an error string or None."""
    S, r = q.shape[1], q.shape[3]
    ng = min(ngroups, S // G)
    rep = q[0, :ng * G, 0].float().view(ng, G, r).mean(1).double()
    kk = k[0, :, 0].double()
    sc = rep @ kk.T
    tol = 2.0 ** -16 * (rep.abs() @ kk.abs().T).max(1).values
    kth = torch.topk(sc, K, dim=1).values[:, -1]
    sel = idx[0, 0, :ng, :K].long()
    if not ((sel >= 0) & (sel < S)).all():
        return "positions out of range"
    if K > 1 and not (sel[:, 1:] > sel[:, :-1]).all():
        return "not ascending"
    if not (torch.gather(sc, 1, sel) >= (kth - tol)[:, None]).all():
        return "a selected key below the K-th score"
    rest = sc.scatter(1, sel, float("-inf"))
    if not (rest.max(1).values <= kth + tol).all():
        return "an unselected key above the K-th score"
    if idx.shape[3] > K and not (idx[0, 0, :ng, K:] == -1).all():
        return "padding not -1"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384:0.1,32768:0.1,65536:0.1,65536:0.05,131072:0.2",
                    help="comma list of S:frac (K = ceil(frac * S))")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--torch-baseline", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--other-ops", default=None,
                    help="also time predictor_loss fwd/bwd and profile_attention at S:R:D "
                         "(e.g. 65536:4096:128), H = --heads")
    args = ap.parse_args()
    if KB.backend() is None:
        print("bench_topk: no CUDA kernels (set DSV_OPS_LIB or build dsv_ext with CUDA)")
        return 1
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    recs = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for item in args.shapes.split(","):
        s, f = item.split(":")
        S, frac = int(s), float(f)
        K = min(S, int(-(-frac * S // 1)))
        H, G, r = args.heads, args.group, args.rank
        q = torch.randn(1, S, H, r, generator=g, device="cuda").to(dt)
        k = torch.randn(1, S, H, r, generator=g, device="cuda").to(dt)
        cnt = torch.full((1, H), K, dtype=torch.int32, device="cuda")
        NG = -(-S // G)
        out = {"idx": torch.empty((1, H, NG, K), dtype=torch.int32, device="cuda")
               if KB.backend() == "ctypes" else None}

        def run():
            out["idx"] = KB.topk_estimate(q, k, cnt, G, K, out=out["idx"], poison=False)

        med, lo, hi = time_ms(run, reps=args.reps)
        err = spot_check(q, k, out["idx"], G, K)
        rec = dict(S=S, H=H, G=G, r=r, K=K, frac=frac, dtype=args.dtype, backend=KB.backend(),
                   ms=med, ms_min=lo, ms_max=hi,
                   gscores_per_s=H * NG * S / (med * 1e-3) / 1e9,
                   out_GB=H * NG * K * 4 / 1e9, check=err or "ok")
        if args.torch_baseline:
            try:
                tb, _, _ = time_ms(lambda: torch_baseline(q, k, K, G), warmup=1, reps=3)
                rec["torch_topk_ms"] = tb
            except torch.cuda.OutOfMemoryError:
                rec["torch_topk_ms"] = None
            torch.cuda.empty_cache()
        recs.append(rec)
        print(f"topk S={S:7d} H={H} G={G} r={r} K={K:6d} ({frac:.0%}) {args.dtype}: "
              f"{med:8.3f} ms (min {lo:.3f}, max {hi:.3f}), {rec['gscores_per_s']:.0f} G scores/s, "
              f"index {rec['out_GB']:.2f} GB, spot check {rec['check']}"
              + (f", torch.topk path {rec['torch_topk_ms']:.2f} ms" if rec.get("torch_topk_ms")
                 else ""), flush=True)
        del q, k, out
        torch.cuda.empty_cache()
    if args.other_ops:
        S, R, D = (int(x) for x in args.other_ops.split(":"))
        H, r = args.heads, args.rank
        mk = lambda d: torch.randn(1, S, H, d, generator=g, device="cuda").to(dt)  # noqa: E731
        q, k, ql, kl = mk(D), mk(D), mk(r), mk(r)
        rows = torch.randperm(S, device="cuda")[:R].to(torch.int32)
        sc = D ** -0.5
        st = {}

        def fwd():
            st["f"] = KB.predictor_loss_fwd(q, k, ql, kl, rows, sc, 0.95, 0.05)

        tf, _, _ = time_ms(fwd, warmup=1, reps=5)
        loss, stats = st["f"]
        dl = torch.ones_like(loss)
        tb, _, _ = time_ms(lambda: KB.predictor_loss_bwd(dl, q, k, ql, kl, rows,
                                                         stats.contiguous(), sc, 0.95, 0.05),
                           warmup=1, reps=5)
        tp, _, _ = time_ms(lambda: KB.profile_attention(q, k, rows, 0.9, sc), warmup=1, reps=3)
        rec = dict(op="others", S=S, H=H, D=D, r=r, R=R, predictor_fwd_ms=tf,
                   predictor_bwd_ms=tb, profile_ms=tp)
        recs.append(rec)
        print(f"predictor_loss S={S} H={H} D={D} r={r} R={R}: fwd {tf:.2f} ms, bwd {tb:.2f} ms; "
              f"profile_attention (theta 0.9, no index): {tp:.2f} ms (these timings include the "
              f"test wrappers' allocation, poisoning and a synchronisation)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(card=torch.cuda.get_device_name(), records=recs), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
