"""CPU tests of sparse grouped attention (forward + backward) against the float64 dense
masked-softmax reference of dsv_ext.reference."""
import pytest
import torch
import torch.nn.functional as F

import dsv_ext
from dsv_ext.reference import (dense_attention_ref, make_qkv, random_index,
                               sparse_attention_lse_ref)

from conftest import assert_close, poison

# (B, S, H, D, G, Kmax): B > 1, S not a multiple of G (partial last group), D in 16/64/96/128,
# B*H = 1 (backward through per-thread dk/dv buffers) and B*H >= threads (per-(b, h) tasks).
SHAPES = [
    (2, 45, 3, 16, 8, 12),
    (2, 37, 2, 64, 16, 20),
    (1, 50, 2, 96, 7, 9),
    (2, 33, 2, 128, 32, 33),
    (1, 40, 1, 64, 5, 10),
]


def _ids(s):
    return "B{}_S{}_H{}_D{}_G{}_K{}".format(*s)


def _run(q, k, v, idx, cnt, G, scale=None, dout=None, check_index=True):
    """Forward through the raw op (to see lse) and backward through autograd of the public op."""
    sc = (1.0 / q.shape[-1] ** 0.5) if scale is None else scale
    poison()
    out, lse = torch.ops.dsv.sparse_attention_fwd(q.detach(), k.detach(), v.detach(), idx, cnt,
                                                  G, sc)
    poison()
    out2 = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, scale=scale, check_index=check_index)
    assert torch.equal(out, out2), "public op and raw op disagree"
    grads = torch.autograd.grad(out2, (q, k, v), dout) if dout is not None else None
    return out, lse, grads


def _reference(q, k, v, idx, cnt, G, scale=None, dout=None):
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v))
    out, lse = sparse_attention_lse_ref(q64, k64, v64, idx, cnt, G, scale)
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, (q64, k64, v64), dout.to(torch.float64))
    return out, lse, grads


def _check_all(q, k, v, idx, cnt, G, dtype, scale=None, gen=None, check_index=True):
    B, S, H, D = q.shape
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64).to(dtype)
    out, lse, grads = _run(q, k, v, idx, cnt, G, scale, dout, check_index)
    rout, rlse, rgrads = _reference(q, k, v, idx, cnt, G, scale, dout)
    assert out.dtype == dtype and out.shape == (B, S, H, D) and out.is_contiguous()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == acc and lse.shape == (B, H, S)
    assert_close(out, rout, dtype, "out")
    # lse is kept in the accumulator type (float32 for half inputs): its tolerance is float32's
    assert_close(lse, rlse, acc if dtype in (torch.float32, torch.float64) else torch.float32,
                 "lse", allow_inf=True)
    for name, g_, r_ in zip(("dq", "dk", "dv"), grads, rgrads):
        assert g_.dtype == dtype
        assert_close(g_, r_, dtype, name, grad=True)


@pytest.mark.parametrize("layout", ["packed", "bhsd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_matches_reference(shape, dtype, layout, gen):
    B, S, H, D, G, KM = shape
    q, k, v = make_qkv(B, S, H, D, dtype, layout=layout, generator=gen, requires_grad=True)
    assert not q.is_contiguous() or (layout == "bhsd" and H == 1)  # [B,1,S,D]^T is contiguous
    # per-head counts in [1, Kmax], at least one below Kmax; unused entries hold arbitrary
    # in-range positions that the kernels must ignore
    counts = torch.randint(1, KM + 1, (B, H), generator=gen)
    counts[0, 0] = max(1, KM // 2)
    idx, cnt = random_index(B, H, S, G, KM, counts, generator=gen, pad="random")
    _check_all(q, k, v, idx, cnt, G, dtype, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    B, S, H, D, G, KM = 2, 41, 2, 64, 8, 16
    q, k, v = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, requires_grad=True)
    idx, cnt = random_index(B, H, S, G, KM, None, generator=gen)
    _check_all(q, k, v, idx, cnt, G, dtype, gen=gen)


def test_custom_scale_and_group_sizes(gen):
    dtype = torch.float64
    for (S, G) in ((29, 1), (29, 64), (29, 29), (30, 4)):
        q, k, v = make_qkv(2, S, 2, 16, dtype, layout="packed_d", generator=gen,
                           requires_grad=True)
        idx, cnt = random_index(2, 2, S, G, 7, None, generator=gen)
        _check_all(q, k, v, idx, cnt, G, dtype, scale=0.37, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_index_equals_dense_sdpa(dtype, gen):
    """With every key in every list (K = S), sparse attention is dense attention."""
    B, S, H, D, G = 2, 53, 3, 64, 16
    q, k, v = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, requires_grad=True)
    NG = -(-S // G)
    idx = torch.arange(S, dtype=torch.int32).expand(B, H, NG, S).contiguous()
    cnt = torch.full((B, H), S, dtype=torch.int32)
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)
    assert_close(out, dense_attention_ref(q, k, v), dtype, "out vs float64 dense")
    # SDPA in the input dtype has its own round-off: compare at the float32 level
    assert_close(out, sdpa, torch.float32 if dtype == torch.float32 else torch.float64,
                 "out vs SDPA")
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64).to(dtype)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(sdpa, (q, k, v), dout)
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        assert_close(a, b, dtype, name + " vs SDPA", grad=True)


def test_zero_count_head(gen):
    """A head with count 0 gives out = 0, lse = -inf, zero gradients; other heads unaffected."""
    B, S, H, D, G, KM = 2, 30, 2, 16, 8, 6
    dtype = torch.float64
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, requires_grad=True)
    idx, cnt = random_index(B, H, S, G, KM, [[0, 6], [3, 0]], generator=gen, pad="random")
    _check_all(q, k, v, idx, cnt, G, dtype, gen=gen)
    out, lse = torch.ops.dsv.sparse_attention_fwd(q.detach(), k.detach(), v.detach(), idx, cnt,
                                                  G, 0.25)
    assert torch.all(out[0, :, 0] == 0) and torch.all(out[1, :, 1] == 0)
    assert torch.all(lse[0, 0] == float("-inf")) and torch.all(lse[1, 1] == float("-inf"))
    assert torch.isfinite(lse[0, 1]).all() and torch.isfinite(lse[1, 0]).all()
    dq, dk, dv = torch.autograd.grad(dsv_ext.sparse_attention(q, k, v, idx, cnt, G).sum(),
                                     (q, k, v))
    for g_ in (dq, dk, dv):
        assert torch.all(g_[0, :, 0] == 0) and torch.all(g_[1, :, 1] == 0)


def test_kernel_guards_on_invalid_index(gen):
    """The raw kernels clamp counts to [0, Kmax], skip entries outside [0, S) and count a key
    listed twice twice (what the reference's multiplicity weights model). The public op reports
    such input instead; check_index=False passes it through."""
    B, S, H, D, G, KM = 2, 27, 2, 16, 5, 6
    dtype = torch.float64
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, requires_grad=True)
    idx, _ = random_index(B, H, S, G, KM, KM, generator=gen)
    idx[0, 0, :, 1] = -7           # out of range: skipped
    idx[0, 1, :, 2] = S + 3        # out of range: skipped
    idx[1, 0, :, 3] = idx[1, 0, :, 0]  # duplicate: counts twice
    idx[1, 1, 2, :] = -1           # a list with no valid entry (group 2 only)
    cnt = torch.tensor([[KM + 5, 4], [KM, -3]], dtype=torch.int32)  # clamped to [0, Kmax]
    _check_all(q, k, v, idx, cnt, G, dtype, gen=gen, check_index=False)
    with pytest.raises(ValueError, match="kv_count"):
        dsv_ext.sparse_attention(q, k, v, idx, cnt, G)
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, check_index=False)
    assert not torch.isnan(out).any()


def test_gradcheck_float64(gen):
    B, S, H, D, G, KM = 2, 7, 2, 4, 3, 4
    q, k, v = make_qkv(B, S, H, D, torch.float64, layout="packed", generator=gen,
                       requires_grad=True)
    idx, cnt = random_index(B, H, S, G, KM, [[4, 2], [0, 3]], generator=gen)
    assert torch.autograd.gradcheck(
        lambda q_, k_, v_: dsv_ext.sparse_attention(q_, k_, v_, idx, cnt, G, scale=0.8),
        (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)
