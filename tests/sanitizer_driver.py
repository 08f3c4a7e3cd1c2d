"""Small-shape run of every CUDA op, for compute-sanitizer (tests/run_sanitizer.sh).

Each op runs once or twice on tiny inputs (partial last groups, per-head counts, entries to
skip) so that memcheck and racecheck see every kernel. Ops are reached through torch.ops.dsv
when the extension is built with CUDA; the sparse attention kernels also through DSV_ATTN_LIB
(see tests/test_sparse_attention_cuda.py). Each section is independent: helpers that own
other ops add theirs below as functions named run_<op>().
Exit code 0 when every section ran (errors are reported by the sanitizer itself).
"""
from __future__ import annotations

import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def run_sparse_attention():
    import test_sparse_attention_cuda as T
    if T.backend() is None:
        print("sparse_attention: no kernels, skipped")
        return
    gen = torch.Generator().manual_seed(1)
    for (S, H, D, G, kmax, dtype) in [(150, 2, 64, 32, 70, torch.bfloat16),
                                      (200, 2, 128, 64, 130, torch.float16),
                                      (131, 1, 96, 128, 100, torch.bfloat16),
                                      (90, 1, 256, 64, 40, torch.bfloat16)]:
        q, k, v = T.ref.make_qkv(1, S, H, D, dtype=dtype, layout="packed", generator=gen,
                                 device="cuda")
        idx, cnt = T.ref.random_index(1, H, S, G, kmax, generator=gen, pad="random")
        idx, cnt = idx.cuda(), cnt.cuda()
        scale = 1.0 / math.sqrt(D)
        out, lse = T.attn_fwd(q, k, v, idx, cnt, G, scale)
        dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
        for ratio in ("0", "1e9"):
            os.environ["DSV_KM_RATIO"] = ratio
            T.attn_bwd(dout, q, k, v, out, lse, idx, cnt, G, scale)
        os.environ.pop("DSV_KM_RATIO", None)
        # entries to skip: out of range, unsorted, counts outside [0, kmax]
        bad = torch.randint(-10, S + 10, idx.shape, generator=gen).to(torch.int32).cuda()
        cnt2 = torch.tensor([[kmax + 9] + [-1] * (H - 1)], dtype=torch.int32).cuda()
        out2, lse2 = T.attn_fwd(q, k, v, bad, cnt2, G, scale)
        T.attn_bwd(dout, q, k, v, out2, lse2, bad, cnt2, G, scale)
    torch.cuda.synchronize()
    print("sparse_attention: ok")


def main():
    if not torch.cuda.is_available():
        print("no GPU")
        return 0
    sections = [v for k, v in sorted(globals().items()) if k.startswith("run_") and callable(v)]
    for fn in sections:
        fn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
