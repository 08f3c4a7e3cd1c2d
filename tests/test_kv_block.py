"""CPU tests of key-block lists (kv_block > 1) in the ops: the C reference forward and backward
against a float64 dense masked-softmax reference built from the blocks' keys, expand_block_lists,
gradcheck, opcheck, the block top-K against a brute-force torch reference, the recall of block
lists in profile_attention, and the argument checks.

The reference here expands the blocks itself (key multiplicity per group from the block ids), so
it does not share code with dsv_ext.expand_block_lists.
"""
import math

import pytest
import torch

import dsv_ext
from dsv_ext import reference as ref
from dsv_ext.reference import make_qkv

from conftest import assert_close, poison


# ------------------------------------------------------------------------------------------------
# the reference

def block_multiplicity(kv_index, kv_count, S, b):
    """[B, H, NG, S] float64: how many times each key is covered by the used entries of each block
    list (count clamped to [0, Kmax]; ids outside [0, ceil(S/b)) skipped; the last block stops
    at S; a block listed twice counts twice)."""
    B, H, NG, KM = kv_index.shape
    nb = -(-S // b)
    mult = torch.zeros(B, H, NG, S, dtype=torch.float64)
    for bb in range(B):
        for h in range(H):
            c = min(max(int(kv_count[bb, h]), 0), KM)
            for g in range(NG):
                for e in kv_index[bb, h, g, :c].tolist():
                    if 0 <= e < nb:
                        mult[bb, h, g, e * b:min(e * b + b, S)] += 1
    return mult


def masked_attention(q, k, v, mult_g, G, scale):
    """The float64 reference with the key weights of block_multiplicity (dsv_ext/reference.py)."""
    return ref.masked_attention_ref(q, k, v, mult_g, G, scale)


def block_lists(B, H, S, G, b, kmax, counts, gen, extra=True):
    """Random block lists: distinct ascending ids in [0, ceil(S/b)) up to the count; with
    ``extra`` the used part of some lists also holds a duplicate, a -1 and an id past the last
    block (which the kernels must skip), and the entries after the count are random."""
    nb = -(-S // b)
    NG = -(-S // G)
    idx = torch.randint(-1, nb + 2, (B, H, NG, kmax), generator=gen)
    for bb in range(B):
        for h in range(H):
            c = int(counts[bb, h])
            for g in range(NG):
                n = min(c, nb)
                ids = torch.randperm(nb, generator=gen)[:n].sort().values
                idx[bb, h, g, :n] = ids
                if extra and c >= 4 and (g + h) % 2 == 0:
                    idx[bb, h, g, c - 3] = idx[bb, h, g, 0]  # a duplicate
                    idx[bb, h, g, c - 2] = -1                # padding inside the count
                    idx[bb, h, g, c - 1] = nb + 1            # past the last block
    return idx.to(torch.int32), torch.as_tensor(counts, dtype=torch.int32)


# (B, S, H, D, G, b, Kmax): S not a multiple of b (partial last block) nor of G, B*H = 1 (the
# backward's per-thread buffers) and B*H > 1 (per-(b, h) tasks)
SHAPES = [
    (2, 75, 2, 16, 8, 16, 5),
    (1, 150, 1, 32, 32, 64, 3),
    (2, 130, 2, 8, 16, 64, 3),
    (1, 40, 3, 64, 5, 16, 4),
]


def _ids(s):
    return "B{}_S{}_H{}_D{}_G{}_b{}_K{}".format(*s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_matches_reference(shape, dtype, gen):
    B, S, H, D, G, b, KM = shape
    q, k, v = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, requires_grad=True)
    counts = torch.randint(1, KM + 1, (B, H), generator=gen)
    counts.view(-1)[0] = KM
    if B * H > 1:
        counts.view(-1)[-1] = 1 if KM > 1 else 0  # a count of 1
    idx, cnt = block_lists(B, H, S, G, b, KM, counts, gen)
    scale = 1.0 / math.sqrt(D)
    poison()
    out, lse = torch.ops.dsv.sparse_attention_fwd(q.detach(), k.detach(), v.detach(), idx, cnt, G, scale,
                                                  False, b)
    poison()
    out2 = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, check_index=False, kv_block=b)
    assert torch.equal(out, out2), "public op and raw op disagree"
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out2, (q, k, v), dout)

    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v))
    rout, rlse = masked_attention(q64, k64, v64, block_multiplicity(idx, cnt, S, b), G, scale)
    rgrads = torch.autograd.grad(rout, (q64, k64, v64), dout.to(torch.float64))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == dtype and lse.dtype == acc and lse.shape == (B, H, S)
    assert_close(out, rout, dtype, "out")
    assert_close(lse, rlse, acc, "lse", allow_inf=True)
    for name, g_, r_ in zip(("dq", "dk", "dv"), grads, rgrads):
        assert g_.dtype == dtype
        assert_close(g_, r_, dtype, name, grad=True)


def test_zero_counts_and_empty_lists(gen):
    """A head with count 0 and lists with only skipped entries give zeros and lse -inf there."""
    B, S, H, D, G, b = 1, 70, 2, 16, 16, 16
    q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen)
    idx = torch.full((B, H, 5, 3), -1, dtype=torch.int32)
    idx[0, 1, :, 0] = torch.tensor([0, 4, 2, 5, 9], dtype=torch.int32)  # 5 and 9 are past block 4
    cnt = torch.tensor([[0, 2]], dtype=torch.int32)
    out, lse = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.25, False, b)
    rout, rlse = masked_attention(q, k, v, block_multiplicity(idx, cnt, S, b), G, 0.25)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.isneginf(lse[0, 0]).all()
    assert torch.isneginf(lse[0, 1, 48:]).all() and torch.isfinite(lse[0, 1, :48]).all()
    assert_close(out, rout, torch.float64, "out")
    assert_close(lse, rlse, torch.float64, "lse", allow_inf=True)


def test_block_equals_expanded_token_lists(gen):
    """The block kernel and the token kernel on expand_block_lists agree (float64: only the
    tiling of the online softmax differs)."""
    B, S, H, D, G, b, KM = 2, 100, 2, 16, 8, 16, 4
    q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen)
    idx, cnt = block_lists(B, H, S, G, b, KM, torch.full((B, H), KM), gen)
    tok, tcnt = dsv_ext.expand_block_lists(idx, cnt, b, S)
    assert tok.shape == (B, H, -(-S // G), KM * b) and tok.dtype == torch.int32
    assert torch.equal(tcnt, cnt * b)
    a = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, check_index=False, kv_block=b)
    t = dsv_ext.sparse_attention(q, k, v, tok, tcnt, G, check_index=False)
    assert (a - t).abs().max() <= 1e-12


def test_expand_block_lists_exact():
    idx = torch.tensor([[[[2, 0, -1, 3, 1]]]], dtype=torch.int32)
    cnt = torch.tensor([[4]], dtype=torch.int32)
    tok, tcnt = dsv_ext.expand_block_lists(idx, cnt, 4, seqlen=10)  # 3 blocks, the last of 2 keys
    assert tok.tolist() == [[[[8, 9, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1, 4, 5, 6, 7]]]]
    assert tcnt.tolist() == [[16]]
    same = dsv_ext.expand_block_lists(idx, cnt, 1, seqlen=10)
    assert same[0] is idx and same[1] is cnt
    # counts are clamped to [0, Kmax] before the expansion, as the kernels clamp them
    _, c = dsv_ext.expand_block_lists(idx, torch.tensor([[9]], dtype=torch.int32), 4, 10)
    assert c.tolist() == [[20]]


def test_kv_block_one_is_the_token_op(gen):
    B, S, H, D, G = 1, 50, 2, 16, 8
    q, k, v = make_qkv(B, S, H, D, torch.float32, generator=gen)
    idx = torch.randint(0, S, (B, H, 7, 6), generator=gen, dtype=torch.int32)
    cnt = torch.tensor([[6, 3]], dtype=torch.int32)
    a = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.3)
    b = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.3, False, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_block_larger_than_sequence(gen):
    """kv_block > S: one block of all S keys (clamped), the same as kv_block = S."""
    B, S, H, D, G = 1, 20, 1, 8, 4
    q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen)
    idx = torch.zeros(B, H, 5, 1, dtype=torch.int32)
    cnt = torch.ones(B, H, dtype=torch.int32)
    a = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=64)
    d = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=S)
    from dsv_ext.reference import dense_attention_ref
    assert_close(a, dense_attention_ref(q, k, v), torch.float64, "out")
    assert torch.equal(a, d)


def test_nan_in_nan_out(gen):
    B, S, H, D, G, b = 1, 64, 1, 8, 16, 16
    q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen)
    k[0, 20, 0, 0] = float("nan")  # key 20 lies in block 1
    idx = torch.tensor([[[[0, 1], [0, 2], [3, -1], [1, 3]]]], dtype=torch.int32)
    cnt = torch.tensor([[2]], dtype=torch.int32)
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=b, check_index=False)
    nan_rows = torch.isnan(out[0, :, 0]).any(-1)
    assert nan_rows.tolist() == [g in (0, 3) for g in torch.arange(S).div(G, rounding_mode="floor").tolist()]


def test_gradcheck_float64(gen):
    B, S, H, D, G, b = 1, 21, 2, 4, 4, 8
    q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen, requires_grad=True)
    idx, cnt = block_lists(B, H, S, G, b, 3, torch.tensor([[3, 2]]), gen, extra=False)
    idx[0, 0, 1, :2] = torch.tensor([2, 2])  # a duplicated (partial) block
    torch.autograd.gradcheck(
        lambda q, k, v: dsv_ext.sparse_attention(q, k, v, idx, cnt, G, check_index=False, kv_block=b),
        (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("b", [16, 64])
def test_opcheck(b, gen):
    B, S, H, D, G = 1, 90, 2, 16, 16
    q, k, v = make_qkv(B, S, H, D, torch.float32, layout="contiguous", generator=gen, requires_grad=True)
    idx, cnt = block_lists(B, H, S, G, b, 2, torch.tensor([[2, 1]]), gen, extra=False)
    torch.library.opcheck(torch.ops.dsv.sparse_attention_fwd.default, (q, k, v, idx, cnt, G, 0.25, False, b))
    with torch.no_grad():
        out, lse = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.25, False, b)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(torch.ops.dsv.sparse_attention_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, idx, cnt, G, 0.25, False, b))


# ------------------------------------------------------------------------------------------------
# block top-K

def topk_blocks_ref(q_lr, k_lr, kv_count, G, b, kmax):
    """Brute force: float64 group-mean queries against block-mean keys, ranked by (score desc,
    id asc) with NaN ranked like -inf, the first count ids sorted ascending, -1 after."""
    B, S, H, R = q_lr.shape
    NG, nb = -(-S // G), -(-S // b)
    out = torch.full((B, H, NG, kmax), -1, dtype=torch.int32)
    for bb in range(B):
        for h in range(H):
            c = min(max(int(kv_count[bb, h]), 0), kmax)
            keys = torch.stack([k_lr[bb, j * b:min(j * b + b, S), h].double().mean(0) for j in range(nb)])
            for g in range(NG):
                rep = q_lr[bb, g * G:min(g * G + G, S), h].double().mean(0)
                sc = (keys @ rep).tolist()
                sc = [float("-inf") if math.isnan(x) else x for x in sc]
                order = sorted(range(nb), key=lambda j: (-sc[j], j))[:c]
                out[bb, h, g, :c] = torch.tensor(sorted(order), dtype=torch.int32)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("S,G,b,kmax", [(75, 8, 16, 5), (150, 32, 64, 3), (64, 16, 16, 4)])
def test_topk_blocks_matches_brute_force(S, G, b, kmax, dtype, gen):
    B, H, R = 2, 2, 4
    q_lr, k_lr = make_qkv(B, S, H, R, dtype, generator=gen, n=2)
    cnt = torch.randint(0, kmax + 1, (B, H), generator=gen, dtype=torch.int32)
    cnt[0, 0] = kmax
    poison()
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=kmax, kv_block=b)
    assert got.dtype == torch.int32 and got.shape == (B, H, -(-S // G), kmax)
    assert torch.equal(got, topk_blocks_ref(q_lr, k_lr, cnt, G, b, kmax))
    # kmax=None: the largest count (read on the host)
    assert torch.equal(dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kv_block=b), got[..., :int(cnt.max())])


def test_topk_blocks_ties_and_nan():
    """Integer-valued inputs make exact ties: the lower block id wins; NaN scores rank last."""
    B, S, H, R, G, b = 1, 64, 1, 2, 16, 16
    q_lr = torch.ones(B, S, H, R)
    k_lr = torch.zeros(B, S, H, R)
    k_lr[0, 16:32, 0] = 1.0   # block 1: score 2
    k_lr[0, 48:64, 0] = 1.0   # block 3: score 2 (tie with block 1)
    k_lr[0, 0, 0, 0] = float("nan")  # block 0: NaN score
    cnt = torch.tensor([[3]], dtype=torch.int32)
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=4, kv_block=b)
    # blocks 1 and 3 (score 2), then block 2 (score 0) before the NaN block 0
    assert got[0, 0].tolist() == [[1, 2, 3, -1]] * 4
    got1 = dsv_ext.topk_estimate(q_lr, k_lr, torch.tensor([[1]], dtype=torch.int32), G, kmax=1, kv_block=b)
    assert got1[0, 0, :, 0].tolist() == [1] * 4  # the tie goes to the lower id


def test_topk_blocks_feed_sparse_attention(gen):
    B, S, H, D, R, G, b = 1, 96, 2, 16, 4, 32, 16
    q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen)
    q_lr, k_lr = make_qkv(B, S, H, R, torch.float64, generator=gen, n=2)
    cnt = torch.tensor([[3, 6]], dtype=torch.int32)
    idx = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kv_block=b)
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=b)  # ids valid: checked
    rout, _ = masked_attention(q, k, v, block_multiplicity(idx, cnt, S, b), G, 1 / math.sqrt(D))
    assert_close(out, rout, torch.float64, "out")
    full = dsv_ext.sparse_attention(q, k, v, dsv_ext.topk_estimate(q_lr, k_lr, torch.full((1, 2), 6), G,
                                                                   kv_block=b), torch.full((1, 2), 6), G,
                                    kv_block=b)
    from dsv_ext.reference import dense_attention_ref
    assert_close(full, dense_attention_ref(q, k, v), torch.float64, "all blocks = dense")


# ------------------------------------------------------------------------------------------------
# profile recall of block lists

def test_profile_recall_of_blocks(gen):
    B, S, H, D, G, b = 2, 100, 2, 16, 20, 16
    q, k = make_qkv(B, S, H, D, torch.float64, generator=gen, n=2)
    rows = torch.tensor([0, 7, 33, 64, 99], dtype=torch.int32)
    idx, cnt = block_lists(B, H, S, G, b, 4, torch.tensor([[4, 2], [1, 3]]), gen, extra=False)
    idx[0, 0, 1, :2] = idx[0, 0, 1, 2]  # a duplicated block: its keys count once in the recall
    got = dsv_ext.profile_attention(q, k, rows, 0.9, idx, cnt, G, kv_block=b)
    base = dsv_ext.profile_attention(q, k, rows, 0.9)
    assert torch.equal(got.sparsity, base.sparsity)
    mult = block_multiplicity(idx, cnt, S, b)
    want = torch.zeros(B, H, dtype=torch.float64)
    for bb in range(B):
        for h in range(H):
            for r in rows.tolist():
                p = torch.softmax(q[bb, r, h] @ k[bb, :, h].T / math.sqrt(D), -1)
                want[bb, h] += (p * (mult[bb, h, r // G] > 0)).sum() / len(rows)  # distinct keys
    assert_close(got.recall, want, torch.float64, "recall")


# ------------------------------------------------------------------------------------------------
# argument checks

@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-16, ValueError), (True, TypeError), (1.5, TypeError),
                                     ("16", TypeError)])
def test_bad_kv_block(bad, exc, gen):
    q, k, v = make_qkv(1, 32, 1, 8, torch.float32, generator=gen)
    idx = torch.zeros(1, 1, 4, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(exc, match=r"^kv_block: "):
        dsv_ext.sparse_attention(q, k, v, idx, cnt, 8, kv_block=bad)
    with pytest.raises(exc, match=r"^kv_block: "):
        dsv_ext.topk_estimate(q, k, cnt, 8, kmax=1, kv_block=bad)
    with pytest.raises(exc, match=r"^kv_block: "):
        dsv_ext.profile_attention(q, k, torch.tensor([0]), 0.9, idx, cnt, 8, kv_block=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(RuntimeError, match="kv_block: must be >= 1"):
            torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, 8, 0.3, False, bad)


def test_block_ids_out_of_range_are_reported(gen):
    S, G, b = 40, 8, 16  # 3 blocks
    q, k, v = make_qkv(1, S, 1, 8, torch.float32, generator=gen)
    idx = torch.zeros(1, 1, 5, 2, dtype=torch.int32)
    idx[0, 0, 2, 1] = 3
    cnt = torch.full((1, 1), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^kv_index: entry \(0, 0, 2, 1\) = 3 is outside \[0, ceil\(S/kv_block\)=3\)"):
        dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=b)
    with pytest.raises(ValueError, match=r"^kv_index: .*ceil\(S/kv_block\)=3"):
        dsv_ext.profile_attention(q, k, torch.tensor([0]), 0.9, idx, cnt, G, kv_block=b)
    # an id valid for blocks is fine; the same list read as token lists is fine too
    idx[0, 0, 2, 1] = 2
    dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=b)
    # the kernel skips the out-of-range id when unchecked (no out-of-bounds access)
    idx[0, 0, 2, 1] = 2**31 - 1
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, kv_block=b, check_index=False)
    assert torch.isfinite(out).all()


def test_topk_block_counts_checked(gen):
    S, G, b = 40, 8, 16
    q_lr, k_lr = make_qkv(1, S, 1, 4, torch.float32, generator=gen, n=2)
    with pytest.raises(ValueError, match=r"^kmax: must be in \[0, ceil\(S/kv_block\)=3\]"):
        dsv_ext.topk_estimate(q_lr, k_lr, torch.ones(1, 1, dtype=torch.int32), G, kmax=4, kv_block=b)
    with pytest.raises(ValueError, match=r"^kv_count: values must be in \[0, ceil\(S/kv_block\)=3\]"):
        dsv_ext.topk_estimate(q_lr, k_lr, torch.full((1, 1), 4, dtype=torch.int32), G, kv_block=b)
    with pytest.raises(ValueError, match=r"^kv_count: values must be in \[0, kmax=2\]"):
        dsv_ext.topk_estimate(q_lr, k_lr, torch.full((1, 1), 3, dtype=torch.int32), G, kmax=2, kv_block=b)


def test_random_lists_and_sizes_match_reference(gen):
    """Arbitrary int32 entries (huge, negative, duplicates), counts outside [0, Kmax] and block
    sizes from 1 to past S (and 2**62): the kernels read no memory out of bounds and follow the
    per-key rules of the reference (raw ops, no Python checks)."""
    for trial in range(12):
        S = int(torch.randint(1, 70, (1,), generator=gen))
        G = int(torch.randint(1, 20, (1,), generator=gen))
        b = [1, 2, 3, 16, 64, S, S + 5, 2**62][trial % 8]
        B, H, D, KM = 1, 2, 4, int(torch.randint(0, 6, (1,), generator=gen))
        q, k, v = make_qkv(B, S, H, D, torch.float64, generator=gen)
        NG = -(-S // G)
        nb = -(-S // min(b, S))
        pool = torch.tensor([-2**31, -1, 0, 1, nb - 1, nb, 2**31 - 1, 2], dtype=torch.int32)
        idx = pool[torch.randint(0, len(pool), (B, H, NG, KM), generator=gen)]
        cnt = torch.tensor([[KM + 3, -2]], dtype=torch.int32) if trial % 2 else \
            torch.randint(0, KM + 1, (B, H), generator=gen, dtype=torch.int32)
        out, lse = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 0.5, False, b)
        rout, rlse = masked_attention(q, k, v, block_multiplicity(idx, cnt, S, min(b, S)), min(G, S), 0.5)
        assert_close(out, rout, torch.float64, f"out (S={S}, G={G}, b={b})")
        assert_close(lse, rlse, torch.float64, "lse", allow_inf=True)
        dq, dk, dv = torch.ops.dsv.sparse_attention_bwd(torch.ones_like(out), q, k, v, out, lse, idx, cnt, G, 0.5,
                                                        False, b)
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_cuda_runs_64_key_lists_natively_and_expands_others():
    """sparse_attention's choice on CUDA: 64-key lists on the block kernels within their limits
    (head_dim <= 128, Kmax <= 16384), every other block size expanded; the CPU reads all."""
    from dsv_ext.ops import _native_kv_block

    cuda = torch.device("cuda")
    assert _native_kv_block(cuda, 64, 128, 1024)
    assert not _native_kv_block(cuda, 16, 128, 1024)
    assert not _native_kv_block(cuda, 32, 64, 8)
    assert not _native_kv_block(cuda, 64, 256, 8)
    assert not _native_kv_block(cuda, 64, 64, 16385)
    assert all(_native_kv_block(torch.device("cpu"), b, 256, 10**6) for b in (2, 16, 64))
