"""CPU tests of profile_attention (per-head sparsity at mass theta, index recall)."""
import math

import pytest
import torch

import dsv_ext
from dsv_ext.reference import make_qkv, profile_ref, random_index

from conftest import assert_close, poison

# (B, S, H, D, G, Kmax, rows)
SHAPES = [
    (2, 45, 3, 16, 8, 12, [0, 7, 44, 20]),
    (2, 37, 2, 64, 16, 20, [3, 19, 36, 19]),
    (1, 50, 2, 96, 7, 9, list(range(0, 50, 6))),
    (2, 33, 2, 128, 32, 33, [32, 0]),
]


@pytest.mark.parametrize("theta", [0.5, 0.9, 0.99])  # not 1.0: c is then decided by the last bit of a sum
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_D{}_G{}_K{}".format(*s[:6]))
def test_matches_reference(shape, dtype, theta, gen):
    B, S, H, D, G, KM, rows = shape
    # scale 3 spreads the logits so that sparsity is far from 0 and differs between heads
    q, k = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, n=2, scale=3.0 ** 0.5)
    rows = torch.tensor(rows)
    idx, cnt = random_index(B, H, S, G, KM, None, generator=gen, pad="random")
    poison()
    res = dsv_ext.profile_attention(q, k, rows, theta, idx, cnt, G)
    ref = profile_ref(q, k, rows, theta, idx, cnt, G)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert res.sparsity.dtype == acc and res.sparsity.shape == (B, H)
    # Both sides compute the probabilities in float64 from the same input values, so the
    # critical-set sizes agree exactly (no theta lands within 1e-15 of a cumulative sum of
    # random continuous data); the result is only rounded to the acc type: tolerance of acc.
    assert_close(res.sparsity, ref.sparsity, acc, "sparsity")
    assert_close(res.recall, ref.recall, acc, "recall")
    assert torch.all((res.sparsity >= 0) & (res.sparsity < 1))
    assert torch.all((res.recall >= 0) & (res.recall <= 1 + 1e-6))


def test_no_index_and_extremes(gen):
    B, S, H, D = 2, 40, 2, 16
    q, k = make_qkv(B, S, H, D, torch.float64, generator=gen, n=2)
    rows = torch.arange(0, S, 3)
    res = dsv_ext.profile_attention(q, k, rows, 0.9)
    assert res.recall is None
    assert_close(res.sparsity, profile_ref(q, k, rows, 0.9).sparsity, torch.float64, "sparsity")
    # the raw op fills recall with NaN when no index is given
    sp, rec = torch.ops.dsv.profile_attention(q, k, rows.to(torch.int32), 0.9, 0.25, None, None, 1)
    assert torch.isnan(rec).all() and torch.isfinite(sp).all()
    # uniform attention (q = 0): every key has 1/S, so c = ceil(theta * S) (up to round-off)
    zero = torch.zeros_like(q)
    res = dsv_ext.profile_attention(zero, k, rows, 0.5)
    assert torch.allclose(res.sparsity, torch.full((B, H), 1 - math.ceil(0.5 * S) / S,
                                                   dtype=torch.float64), atol=1.0 / S + 1e-12)
    # a full index covers all the mass
    idx = torch.arange(S, dtype=torch.int32).expand(B, H, 1, S).contiguous()
    cnt = torch.full((B, H), S, dtype=torch.int32)
    res = dsv_ext.profile_attention(q, k, rows, 0.9, idx, cnt, S)
    assert torch.allclose(res.recall, torch.ones(B, H, dtype=torch.float64), atol=1e-12)


def test_duplicate_entries_count_once(gen):
    """Recall counts each distinct key once even if a list repeats it (kernel-level guard)."""
    B, S, H, D, G, KM = 1, 24, 2, 16, 6, 8
    q, k = make_qkv(B, S, H, D, torch.float64, generator=gen, n=2)
    idx, cnt = random_index(B, H, S, G, KM, KM, generator=gen)
    dup = idx.clone()
    dup[..., 4:] = dup[..., :4]  # second half repeats the first
    rows = torch.tensor([0, 7, 23]).to(torch.int32)
    _, rec = torch.ops.dsv.profile_attention(q, k, rows, 0.9, 0.25, dup, cnt, G)
    ref = profile_ref(q, k, rows, 0.9, dup, cnt, G, scale=0.25)
    _, rec_half = torch.ops.dsv.profile_attention(q, k, rows, 0.9, 0.25,
                                                  idx[..., :4].contiguous(), cnt // 2, G)
    assert_close(rec, ref.recall, torch.float64, "recall")
    assert_close(rec, rec_half, torch.float64, "recall with duplicates vs without")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    q, k = make_qkv(2, 30, 2, 64, dtype, generator=gen, n=2)
    idx, cnt = random_index(2, 2, 30, 4, 10, None, generator=gen)
    rows = torch.tensor([1, 12, 29])
    res = dsv_ext.profile_attention(q, k, rows, 0.9, idx, cnt, 4)
    ref = profile_ref(q, k, rows, 0.9, idx, cnt, 4)
    assert res.sparsity.dtype == torch.float32
    # half values widen exactly, then everything is computed in float64: float32 tolerance
    assert_close(res.sparsity, ref.sparsity, torch.float32, "sparsity")
    assert_close(res.recall, ref.recall, torch.float32, "recall")
