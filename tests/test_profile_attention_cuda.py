"""GPU tests of the CUDA attention profile (csrc/cuda/profile_attention.cu).

Reference: dsv_ext/reference.py profile_ref (float64 softmax, sort, cumulative sum) on the same
16-bit inputs.

Tolerances. The kernel's logits are exact 16-bit products accumulated in fp32 (relative error
~1e-6), its probabilities and the histogram masses are fp32: a row's c_i can differ from the
float64 one only where the cumulative mass passes theta within ~1e-5, i.e. by one key on a rare
row; sparsity = 1 - mean(c)/S therefore gets 3 / (R S) (three rows off by one key). Recall sums
fp32 probabilities of at most kmax keys: 2e-5 absolute.
"""
from __future__ import annotations

import math

import pytest
import torch

import test_topk_estimate_cuda as KB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ref = KB._load_reference()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S,H,D,R,theta,G,kmax,layout", [
    (1, 600, 2, 64, 40, 0.9, 64, 100, "packed"),
    (2, 333, 1, 128, 17, 0.5, 32, 64, "bhsd"),
    (1, 2500, 2, 96, 30, 0.95, 128, 300, "packed_d"),
    (1, 300, 1, 256, 9, 0.9, 64, 50, "packed"),
    (1, 5000, 1, 128, 70, 0.99, 64, 500, "packed"),  # several key chunks
])
def test_profile_random(gen, dtype, B, S, H, D, R, theta, G, kmax, layout):
    KB.need_backend()
    q, k = ref.make_qkv(B, S, H, D, dtype=dtype, layout=layout, generator=gen, device="cuda",
                        scale=1.7, n=2)
    rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32)
    rows[-1] = rows[0]
    idx, cnt = ref.random_index(B, H, S, G, kmax, generator=gen, pad="random")
    # duplicates inside a list: recall counts each key once
    idx[..., 1] = idx[..., 0]
    scale = 1.0 / math.sqrt(D)
    rows_d, idx_d, cnt_d = rows.cuda(), idx.cuda(), cnt.cuda()
    want = ref.profile_ref(q, k, rows.long().cuda(), theta, idx_d, cnt_d, G, scale)
    sp, rc = KB.profile_attention(q, k, rows_d, theta, scale, idx_d, cnt_d, G)
    sp, rc = sp.double().cpu(), rc.double().cpu()
    assert torch.isfinite(sp).all() and torch.isfinite(rc).all()
    torch.testing.assert_close(sp, want.sparsity.cpu(), atol=3.0 / (R * S) + 1e-7, rtol=0)
    torch.testing.assert_close(rc, want.recall.cpu(), atol=2e-5, rtol=0)

    # no index: recall NaN, sparsity unchanged
    sp2, rc2 = KB.profile_attention(q, k, rows_d, theta, scale)
    torch.testing.assert_close(sp2.double().cpu(), want.sparsity.cpu(),
                               atol=3.0 / (R * S) + 1e-7, rtol=0)
    assert torch.isnan(rc2).all()


@pytest.mark.parametrize("theta", [1e-9, 1.0])
def test_profile_theta_edges(gen, theta):
    KB.need_backend()
    B, S, H, D, R = 1, 257, 2, 64, 12
    q, k = ref.make_qkv(B, S, H, D, dtype=torch.bfloat16, generator=gen, device="cuda", n=2)
    rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32).cuda()
    want = ref.profile_ref(q, k, rows.long(), theta, scale=0.125)
    sp, _ = KB.profile_attention(q, k, rows, theta, 0.125)
    if theta < 1.0:
        # the smallest mass: one key per row covers it, sparsity 1 - 1/S (fp32 rounding)
        assert (want.sparsity == 1.0 - 1.0 / S).all()
        assert ((sp.double().cpu() - (1.0 - 1.0 / S)).abs() < 1e-6).all(), sp
    else:
        # theta = 1: all keys, up to fp32 rounding of the total mass (c = S or a few keys less
        # whose mass is below rounding)
        torch.testing.assert_close(sp.double().cpu(), want.sparsity.cpu(), atol=0.05, rtol=0)


def test_profile_theta_zero_rejected(gen):
    KB.need_backend()
    q, k = ref.make_qkv(1, 64, 2, 64, dtype=torch.bfloat16, generator=gen, device="cuda", n=2)
    rows = torch.arange(4, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="theta"):
        KB.profile_attention(q, k, rows, 0.0, 0.125)


def test_profile_peaked_rows(gen):
    """Rows whose softmax is almost one-hot (c = 1) and flat rows (c ~ theta S)."""
    KB.need_backend()
    B, S, H, D, R = 1, 1000, 2, 64, 10
    q, k = ref.make_qkv(B, S, H, D, dtype=torch.bfloat16, generator=gen, device="cuda", n=2)
    q[:, :, 0] *= 20.0   # head 0: very peaked
    q[:, :, 1] *= 0.01   # head 1: nearly uniform
    rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32).cuda()
    want = ref.profile_ref(q, k, rows.long(), 0.9, scale=0.125)
    sp, _ = KB.profile_attention(q, k, rows, 0.9, 0.125)
    torch.testing.assert_close(sp.double().cpu(), want.sparsity.cpu(), atol=3.0 / (R * S), rtol=0)


def test_profile_matches_cpu(gen):
    if KB.backend() != "ops":
        pytest.skip("needs the built extension")
    q, k = ref.make_qkv(1, 500, 2, 64, dtype=torch.bfloat16, generator=gen, device="cuda", n=2)
    rows = torch.randint(0, 500, (20,), generator=gen, dtype=torch.int32)
    g = torch.ops.dsv.profile_attention(q, k, rows.cuda(), 0.9, 0.125, None, None, 1)
    c = torch.ops.dsv.profile_attention(q.cpu(), k.cpu(), rows, 0.9, 0.125, None, None, 1)
    torch.testing.assert_close(g[0].double().cpu(), c[0].double(), atol=3.0 / (20 * 500), rtol=0)
