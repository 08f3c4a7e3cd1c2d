"""GPU tests of key-block lists (kv_block 16 / 64) on CUDA: dsv_ext.sparse_attention forward and
backward (bf16 and fp16, head_dim 64 and 128) against the float64 dense masked reference, the
deterministic backward (bit-identical dq, dk, dv over 10 runs), the block top-K, and the raw op.

Skipped without a GPU. The tolerances, the reference gradients and their rounding slack are those
of tests/test_sparse_attention_cuda.py (see its docstring): block lists are checked through the
token lists of their keys (dsv_ext.expand_block_lists, which the CPU tests check exactly), whose
reference is the same dense masked softmax. sparse_attention runs 64-key lists on the CUDA block
kernels and expands 16-key lists to token lists (dsv_ext.ops._native_kv_block); the raw-op tests
run both sizes on the block kernels.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from test_sparse_attention_cuda import GTOL, TOL, check_close, check_lse, grad_targets, ref  # noqa: E402


def _need_kernels():
    import dsv_ext

    if not dsv_ext.has_cuda_kernels():
        pytest.skip("the extension was built without its CUDA kernels")
    return dsv_ext


def _block_lists(B, H, S, G, b, kmax, counts, gen):
    """Distinct ascending block ids in [0, ceil(S/b)) up to the count (the partial last block
    included often), -1 after; int32 on the GPU."""
    nb = -(-S // b)
    NG = -(-S // G)
    idx = torch.full((B, H, NG, kmax), -1, dtype=torch.int32)
    for bb in range(B):
        for h in range(H):
            c = int(counts[bb][h])
            for g in range(NG):
                ids = torch.randperm(nb, generator=gen)[:c]
                if g % 2 == 0 and c > 0 and nb - 1 not in ids.tolist():
                    ids[0] = nb - 1  # the partial last block
                idx[bb, h, g, :c] = ids.sort().values.to(torch.int32)
    return idx.cuda(), torch.as_tensor(counts, dtype=torch.int32).cuda()


def _check(q, k, v, idx, cnt, G, b, scale, gen, deterministic=False):
    dsv_ext = _need_kernels()
    dtype = q.dtype
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = dsv_ext.sparse_attention(qq, kk, vv, idx, cnt, G, scale, kv_block=b, deterministic=deterministic)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(dtype)
    out.backward(dout.cuda())
    torch.cuda.synchronize()
    tok, tcnt = dsv_ext.expand_block_lists(idx.cpu(), cnt.cpu(), b, q.shape[1])
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out_ref, lse_ref = ref.sparse_attention_lse_ref(qr, kr, vr, tok, tcnt, G, scale)
    check_close("out", out, out_ref.detach(), TOL[dtype])
    out_ref.backward(dout.double())
    targets = grad_targets(q, k, v, dout, out.detach(), out_ref, lse_ref, (qr.grad, kr.grad, vr.grad),
                           tok, tcnt, G, scale, dtype)
    for g_, (t, sl), name in zip((qq.grad, kk.grad, vv.grad), targets, ("dq", "dk", "dv")):
        check_close(name, g_, t, GTOL[dtype], sl)
    return out, (qq.grad, kk.grad, vv.grad)


@pytest.fixture
def gen():
    import os
    import random

    seed = int(os.environ.get("DSV_TEST_SEED", random.randrange(2**31)))
    print(f"DSV_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("b", [16, 64])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(dtype, D, b, gen):
    B, H, S, G = 2, 2, 1000, 64  # S: a partial last block for both sizes and a partial last group
    nb = -(-S // b)
    kmax = max(2, nb // 4)
    counts = [[kmax, max(1, kmax // 3)], [1, kmax - 1]]
    idx, cnt = _block_lists(B, H, S, G, b, kmax, counts, gen)
    q, k, v = ref.make_qkv(B, S, H, D, dtype=dtype, generator=gen, device="cuda")
    _check(q, k, v, idx, cnt, G, b, 1 / math.sqrt(D), gen)


@pytest.mark.parametrize("b", [16, 64])
def test_group_size_32_and_strided_inputs(b, gen):
    B, H, S, D, G = 1, 3, 777, 64, 32
    nb = -(-S // b)
    kmax = max(2, nb // 3)
    idx, cnt = _block_lists(B, H, S, G, b, kmax, [[kmax, 1, kmax // 2]], gen)
    q, k, v = ref.make_qkv(B, S, H, D, dtype=torch.bfloat16, layout="packed", generator=gen, device="cuda")
    _check(q, k, v, idx, cnt, G, b, 1 / math.sqrt(D), gen)


@pytest.mark.parametrize("b", [16, 64])
def test_deterministic_backward_bitwise_over_10_runs(b, gen):
    B, H, S, D, G = 1, 2, 1200, 128, 64
    nb = -(-S // b)
    kmax = nb // 2
    idx, cnt = _block_lists(B, H, S, G, b, kmax, [[kmax, kmax // 3]], gen)
    q, k, v = ref.make_qkv(B, S, H, D, dtype=torch.bfloat16, generator=gen, device="cuda")
    dsv_ext = _need_kernels()
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    first = None
    for _ in range(10):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = dsv_ext.sparse_attention(qq, kk, vv, idx, cnt, G, kv_block=b, deterministic=True)
        out.backward(dout)
        grads = (qq.grad, kk.grad, vv.grad)
        if first is None:
            first = grads
        else:
            for a, c, name in zip(first, grads, ("dq", "dk", "dv")):
                assert torch.equal(a, c), f"{name}: deterministic runs differ (kv_block={b})"
    _check(q, k, v, idx, cnt, G, b, 1 / math.sqrt(D), gen, deterministic=True)


@pytest.mark.parametrize("b", [16, 64])
def test_block_topk_on_cuda_is_a_top_k(b, gen):
    """The GPU block lists select, per group, blocks whose float64 scores are the top-count scores
    (up to float32 rounding of near ties), ascending, -1 after."""
    dsv_ext = _need_kernels()
    B, S, H, R, G = 1, 1000, 2, 16, 64
    q_lr, k_lr = ref.make_qkv(B, S, H, R, dtype=torch.bfloat16, generator=gen, device="cuda", n=2)
    nb = -(-S // b)
    cnt = torch.tensor([[nb // 4, 3]], dtype=torch.int32, device="cuda")
    idx = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=nb // 4, kv_block=b).cpu()
    scores = ref.topk_scores_ref(q_lr.cpu(), k_lr.cpu(), G)  # [B, H, NG, S] against every key
    ng = idx.shape[2]
    for h in range(H):
        c = int(cnt[0, h])
        for g in range(ng):
            lst = idx[0, h, g]
            assert (lst[c:] == -1).all() and (lst[:c] >= 0).all()
            assert (lst[1:c] > lst[:c - 1]).all()
            blk = torch.stack([scores[0, h, g, j * b:min(j * b + b, S)].mean() for j in range(nb)])
            best = blk.sort(descending=True).values
            got = blk[lst[:c].long()].sort(descending=True).values
            assert (got - best[:c]).abs().max() <= 1e-3 * best.abs().max(), (h, g)


@pytest.mark.parametrize("b", [16, 64])
def test_raw_op_with_block_lists(b, gen):
    """The raw CUDA ops run block lists of 16 and 64 keys on the block kernels (sparse_attention
    runs 64-key lists there and expands 16-key ones): out, lse and dq, dk, dv match the float64
    reference of the expanded lists."""
    dsv_ext = _need_kernels()
    B, H, S, D, G = 1, 2, 500, 64, 64
    idx, cnt = _block_lists(B, H, S, G, b, 8, [[8, 3]], gen)
    q, k, v = ref.make_qkv(B, S, H, D, dtype=torch.bfloat16, generator=gen, device="cuda")
    scale = 1 / math.sqrt(D)
    out, lse = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, scale, False, b)
    tok, tcnt = dsv_ext.expand_block_lists(idx.cpu(), cnt.cpu(), b, S)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out_ref, lse_ref = ref.sparse_attention_lse_ref(qr, kr, vr, tok, tcnt, G, scale)
    check_close("out", out, out_ref.detach(), TOL[torch.bfloat16])
    check_lse(lse, lse_ref.detach())
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(q.dtype)
    dq, dk, dv = torch.ops.dsv.sparse_attention_bwd(dout.cuda(), q, k, v, out, lse, idx, cnt, G, scale, False, b)
    out_ref.backward(dout.double())
    targets = grad_targets(q, k, v, dout, out, out_ref, lse_ref, (qr.grad, kr.grad, vr.grad), tok, tcnt, G,
                           scale, q.dtype)
    for g_, (t, sl), name in zip((dq, dk, dv), targets, ("dq", "dk", "dv")):
        check_close(name, g_, t, GTOL[q.dtype], sl)


def test_raw_op_refuses_unsupported_block_sizes(gen):
    """kv_block other than 1 / 16 / 64 on CUDA, and a block backward with head_dim > 128, raise
    errors naming kv_block; sparse_attention expands such lists and runs them."""
    dsv_ext = _need_kernels()
    B, H, S, G = 1, 1, 300, 64
    idx, cnt = _block_lists(B, H, S, G, 32, 4, [[4]], gen)
    q, k, v = ref.make_qkv(B, S, H, 64, dtype=torch.bfloat16, generator=gen, device="cuda")
    with pytest.raises(RuntimeError, match="kv_block"):
        torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.125, False, 32)
    assert torch.isfinite(dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=32)).all()
    idx, cnt = _block_lists(B, H, S, G, 64, 3, [[3]], gen)
    q, k, v = ref.make_qkv(B, S, H, 256, dtype=torch.bfloat16, generator=gen, device="cuda")
    out, lse = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.0625, False, 64)
    with pytest.raises(RuntimeError, match="kv_block"):
        torch.ops.dsv.sparse_attention_bwd(out, q, k, v, out, lse, idx, cnt, G, 0.0625, False, 64)
    qq = q.detach().clone().requires_grad_(True)
    dsv_ext.sparse_attention(qq, k, v, idx, cnt, G, kv_block=64).float().sum().backward()
    assert torch.isfinite(qq.grad).all()


def test_raw_block_backward_refuses_long_lists(gen):
    """The CUDA block backward takes Kmax <= 16384 entries: one more (-1 padding) is refused with
    an error naming kv_block before any launch, where 16384 passes the check and runs;
    sparse_attention expands such lists (dsv_ext.ops._native_kv_block) instead."""
    _need_kernels()
    B, H, S, D, G, b = 1, 1, 130, 64, 64, 64
    q, k, v = ref.make_qkv(B, S, H, D, dtype=torch.bfloat16, generator=gen, device="cuda")
    cnt = torch.ones(B, H, dtype=torch.int32, device="cuda")
    lse = torch.zeros(B, H, S, dtype=torch.float32, device="cuda")
    for kmax, ok in ((16384, True), (16385, False)):
        idx = torch.full((B, H, -(-S // G), kmax), -1, dtype=torch.int32, device="cuda")
        idx[..., 0] = 2  # the partial last block
        if ok:
            out, lse_ = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.125, False, b)
            dq, dk, dv = torch.ops.dsv.sparse_attention_bwd(out, q, k, v, out, lse_, idx, cnt, G, 0.125,
                                                            False, b)
            torch.cuda.synchronize()
            assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        else:
            out = torch.zeros_like(q)
            with pytest.raises(RuntimeError, match=r"kv_block: the CUDA backward of block lists needs "
                                                   r"head_dim <= 128 and Kmax <= 16384, got head_dim 64, "
                                                   r"Kmax 16385"):
                torch.ops.dsv.sparse_attention_bwd(out, q, k, v, out, lse, idx, cnt, G, 0.125, False, b)
