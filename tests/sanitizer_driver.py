"""Small-shape run of every CUDA op, for compute-sanitizer (tests/run_sanitizer.sh).

Each op runs once or twice on tiny inputs (partial last groups, per-head counts, entries to
skip) so that memcheck and racecheck see every kernel. Ops are reached through torch.ops.dsv
when the extension is built with CUDA; the sparse attention kernels also through DSV_ATTN_LIB
(see tests/test_sparse_attention_cuda.py). Each section is independent; a new op adds its
own below as a function named run_<op>(). run_fuzz() runs the whole bad-input
matrix of tests/fuzz_worker.py on CUDA tensors (DSV_SANITIZER_SECTIONS=fuzz: only that one;
DSV_SANITIZER_SKIP=fuzz: all but that one).
Exit code 0 when every section ran (errors are reported by the sanitizer itself); 3 when a GPU
is present but a section found no kernels to run (the sanitizer run would be vacuous); 4 when a
fuzz case failed its check.
"""
from __future__ import annotations

import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # dsv_ext of this checkout when it is not installed
sys.path.insert(0, HERE)
SKIPPED = []


def run_sparse_attention():
    import test_sparse_attention_cuda as T
    if T.backend() is None:
        print("sparse_attention: no kernels, skipped")
        SKIPPED.append("sparse_attention")
        return
    gen = torch.Generator().manual_seed(1)
    for (S, H, D, G, kmax, dtype) in [(150, 2, 64, 32, 70, torch.bfloat16),
                                      (200, 2, 128, 64, 130, torch.float16),
                                      (131, 1, 96, 128, 100, torch.bfloat16),
                                      (300, 2, 128, 128, 140, torch.bfloat16),
                                      (180, 1, 64, 128, 90, torch.float16),
                                      (90, 1, 256, 64, 40, torch.bfloat16)]:
        q, k, v = T.ref.make_qkv(1, S, H, D, dtype=dtype, layout="packed", generator=gen,
                                 device="cuda")
        idx, cnt = T.ref.random_index(1, H, S, G, kmax, generator=gen, pad="random")
        idx, cnt = idx.cuda(), cnt.cuda()
        scale = 1.0 / math.sqrt(D)
        out, lse = T.attn_fwd(q, k, v, idx, cnt, G, scale)
        dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
        # the backward with this process's kernel tuning (tests/run_sanitizer.sh runs this section
        # again under DSV_KERNEL_TUNING settings that force each backward path)
        T.attn_bwd(dout, q, k, v, out, lse, idx, cnt, G, scale)
        # entries to skip: out of range, unsorted, counts outside [0, kmax]
        bad = torch.randint(-10, S + 10, idx.shape, generator=gen).to(torch.int32).cuda()
        cnt2 = torch.tensor([[kmax + 9] + [-1] * (H - 1)], dtype=torch.int32).cuda()
        out2, lse2 = T.attn_fwd(q, k, v, bad, cnt2, G, scale)
        T.attn_bwd(dout, q, k, v, out2, lse2, bad, cnt2, G, scale)
    # merged groups (the tuning's merge): sorted lists whose 128-query blocks share most keys,
    # short and empty lists, a partial last block
    for (S, H, D, G, kmax, dtype) in [(301, 2, 64, 16, 60, torch.bfloat16),
                                      (301, 2, 128, 32, 90, torch.float16),
                                      (301, 2, 128, 64, 90, torch.bfloat16)]:
        q, k, v = T.ref.make_qkv(1, S, H, D, dtype=dtype, layout="packed", generator=gen,
                                 device="cuda")
        idx = T._sorted_lists(1, H, S, G, kmax, gen, share=0.7, short=(1,), empty=(2,)).cuda()
        cnt = torch.tensor([[kmax, 37][:H]], dtype=torch.int32).cuda()
        scale = 1.0 / math.sqrt(D)
        out, lse = T.attn_fwd(q, k, v, idx, cnt, G, scale)
        dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
        T.attn_bwd(dout, q, k, v, out, lse, idx, cnt, G, scale)
    torch.cuda.synchronize()
    print("sparse_attention: ok")


def run_kv_blocks():
    """The block-list kernels (kv_block 16 / 64): forward, backward (sort, key-major index, dQ,
    dK / dV), with -1 padding, duplicates, entries out of range, counts outside [0, kmax] and a
    partial last block and group; D 256 forward only (its backward is unsupported). D 64 / 128
    with G >= 64 reach the key-major dK / dV pass on wgmma (H100 / H200; G 128 at S 170: the
    last group's second 64-query chunk is empty)."""
    import test_kv_block_kernels_cuda as M
    if M._get_lib() is None:
        print("kv_blocks: no kernels, skipped")
        SKIPPED.append("kv_blocks")
        return
    gen = torch.Generator().manual_seed(3)
    for (S, H, D, G, blk, kmax, dtype) in [(150, 2, 64, 32, 16, 9, torch.bfloat16),
                                           (200, 2, 128, 64, 64, 4, torch.float16),
                                           (170, 2, 64, 128, 16, 7, torch.bfloat16),
                                           (131, 1, 96, 128, 16, 12, torch.bfloat16),
                                           (90, 1, 256, 64, 64, 2, torch.bfloat16)]:
        q, k, v = M.ref.make_qkv(1, S, H, D, dtype=dtype, layout="packed", generator=gen,
                                 device="cuda")
        nblk = -(-S // blk)
        idx, cnt = M.random_blocks(1, H, -(-S // G), kmax, nblk, [[kmax + 5] + [3] * (H - 1)],
                                   gen, bad=True)
        idx, cnt = idx.cuda(), cnt.cuda()
        scale = 1.0 / math.sqrt(D)
        out, lse = M.blk_fwd(q, k, v, idx, cnt, G, scale, blk)
        if D <= 128:
            dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
            M.blk_bwd(dout, q, k, v, out, lse, idx, cnt, G, scale, blk)
    torch.cuda.synchronize()
    print("kv_blocks: ok")


# ---- BEGIN ops kernels: topk / predictor loss / profile / rows ------------------------------
def run_ops_kernels():
    """Small shapes of topk_estimate, predictor_loss fwd/bwd, profile_attention, gather /
    scatter-add (via torch.ops.dsv, or ctypes when DSV_OPS_LIB is set)."""
    import test_topk_estimate_cuda as KB
    if KB.backend() is None:
        print("ops kernels: no kernels, skipped")
        SKIPPED.append("ops kernels")
        return
    raw = KB.backend() == "ctypes"
    gen = torch.Generator().manual_seed(2)
    dev = "cuda"
    # S = 4500: the sampled threshold band (S >= 4096) and a partial last CTA; S = 32k, K 5%:
    # a band buffer that holds the band's keys, so that under tk_band=2 the compaction runs from
    # the key masks (and its staged list stores)
    for (S, H, r, G, counts, kmax, dt) in [(300, 2, 16, 64, [40, 300], 300, torch.bfloat16),
                                            (130, 1, 40, 32, [7], 64, torch.float16),
                                            (4500, 2, 16, 64, [450, 2], 460, torch.bfloat16),
                                            (32768, 1, 16, 64, [1638], 1638, torch.bfloat16)]:
        q = torch.randn(1, S, H, r, generator=gen).to(dt).to(dev)
        k = torch.randn(1, S, H + 1, r, generator=gen).to(dt).to(dev)[:, :, :H]
        cnt = torch.tensor([counts], dtype=torch.int32, device=dev)
        KB.topk_estimate(q, k, cnt, G, kmax)
        if raw:  # counts outside [0, kmax]
            KB.topk_estimate(q, k, torch.tensor([[-3, 999][:H]], dtype=torch.int32, device=dev),
                             G, kmax)
    for (S, H, D, r, R, dt) in [(150, 2, 64, 16, 9, torch.bfloat16),
                                (70, 1, 96, 24, 5, torch.float16)]:
        q, k, ql, kl = (torch.randn(1, S, H, d, generator=gen).to(dt).to(dev)
                        for d in (D, D, r, r))
        rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32)
        if raw:
            rows[1] = S + 4
        rows = rows.to(dev)
        loss, st = KB.predictor_loss_fwd(q, k, ql, kl, rows, D ** -0.5, 0.95, 0.05)
        KB.predictor_loss_bwd(torch.ones_like(loss), q, k, ql, kl, rows, st.contiguous(),
                              D ** -0.5, 0.95, 0.05)
        idx = torch.randint(-5 if raw else 0, S + (5 if raw else 0), (1, H, -(-S // 32), 40),
                            generator=gen).to(torch.int32).to(dev)
        cnt = torch.tensor([[40] * H], dtype=torch.int32, device=dev)
        KB.profile_attention(q, k, rows, 0.9, D ** -0.5, idx, cnt, 32)
        KB.profile_attention(q, k, rows, 0.5, D ** -0.5)
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        src = torch.randn(40, 19, generator=gen).to(dt).to(dev)
        ix = torch.randint(-3 if raw else 0, 43 if raw else 40, (60,), generator=gen).to(dev)
        KB.gather_rows(src, ix)
        ix2 = torch.randint(-3 if raw else 0, 13 if raw else 10, (40,), generator=gen).to(dev)
        KB.scatter_add_rows(src, ix2, 10)
    torch.cuda.synchronize()
    print("ops kernels: ok")
# ---- END ops kernels -------------------------------------------------------------------------


# ---- BEGIN fuzz: the bad-input matrix of tests/fuzz_worker.py on CUDA tensors -----------------
FAILED = []


def run_fuzz():
    """Every case of the fuzz matrix (tests/test_fuzz.py) on CUDA tensors, in this process, so
    that memcheck sees each kernel launch of bad, odd and NaN input; plus the deterministic
    backward (ordered key-major fill) on lists with padding and a partial last group."""
    import dsv_ext
    if not dsv_ext.has_cuda_kernels():
        print("fuzz: no kernels, skipped")
        SKIPPED.append("fuzz")
        return
    import fuzz_worker as F
    for seed in (0, 1):
        cs = F.cases("cuda", seed)
        for i, case in enumerate(cs):
            status, msg = F.run_case(case)
            torch.cuda.synchronize()
            if status != "ok":
                FAILED.append(f"fuzz seed {seed} case {i} {case[0]}: {status} {msg}")
        print(f"fuzz seed {seed}: {len(cs)} cases, {len(FAILED)} failed so far")
    from dsv_ext.reference import random_index
    gen = torch.Generator().manual_seed(4)
    for (S, H, D, G, kmax) in [(700, 2, 128, 64, 200), (333, 1, 64, 48, 90)]:
        q, k, v, do = (torch.randn(1, S, H, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(4))
        idx, cnt = random_index(1, H, S, G, kmax, generator=gen, pad="random")
        idx, cnt = idx.cuda(), cnt.cuda()
        for t in (q, k, v):
            t.requires_grad_(True)
        out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, deterministic=True)
        out.backward(do)
    torch.cuda.synchronize()
    for line in FAILED:
        print(line, file=sys.stderr)
    print("fuzz: ok" if not FAILED else f"fuzz: {len(FAILED)} cases failed")
# ---- END fuzz ----------------------------------------------------------------------------------


def main():
    if not torch.cuda.is_available():
        print("no GPU")
        return 0
    # DSV_SANITIZER_SECTIONS / DSV_SANITIZER_SKIP: comma-separated section names (e.g. "fuzz")
    only = [x for x in os.environ.get("DSV_SANITIZER_SECTIONS", "").split(",") if x]
    skip = [x for x in os.environ.get("DSV_SANITIZER_SKIP", "").split(",") if x]
    sections = [(k[4:], v) for k, v in sorted(globals().items()) if k.startswith("run_") and callable(v)]
    for name, fn in sections:
        if (only and name not in only) or name in skip:
            continue
        fn()
    if SKIPPED:  # a GPU but no kernels: the sanitizer would check nothing, so that is a failure
        print("no CUDA kernels for: " + ", ".join(SKIPPED), file=sys.stderr)
        return 3
    if FAILED:  # fuzz cases that gave a wrong result or error (crashes end the process anyway)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
