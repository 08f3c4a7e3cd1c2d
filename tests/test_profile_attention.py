"""profile_attention (per-head sparsity at mass theta, index recall) on every device against the
float64 reference of dsv_ext.reference (softmax, sort, cumulative sum).

Each test runs on "cpu" and "cuda" (skipped without a GPU): the CPU kernels in float32 / float64,
the CUDA kernel in bfloat16 / float16. Sparsity counts keys, which has no PyTorch counterpart in
the input dtype: its bounds are derived, by device:
  CPU: the probabilities are computed in float64 from the same input values as the reference,
  so the critical-set sizes agree exactly (no theta lands within 1e-15 of a cumulative sum of
  random continuous data); the results are only rounded to the accumulator type: TOL of that
  type (tests/helpers.py).
  CUDA: the logits are exact 16-bit products accumulated in fp32 (relative error ~1e-6), the
  probabilities and the histogram masses fp32: a row's c_i can differ from the float64 one only
  where the cumulative mass passes theta within ~1e-5, i.e. by one key on a rare row; sparsity =
  1 - mean(c)/S therefore gets 3 / (R S) (three rows off by one key). Recall sums fp32
  probabilities of at most kmax keys: 2e-5 absolute.
Recall also meets the tolerance rule of tests/helpers.py (the counterpart: PyTorch's softmax in
the input dtype over the same inputs, summed over the listed keys).
"""
import math

import pytest
import torch

from helpers import (DEVICES, acc_dtype, assert_close, assert_pt_bound, device_cases,
                     import_dsv_ext, key_multiplicity, make_qkv, need_backend,
                     profile_attention, profile_ref, random_index)

dsv_ext = import_dsv_ext()

DTYPES = {"cpu": [torch.float32, torch.float64], "cuda": [torch.bfloat16, torch.float16]}

# (B, S, H, D, G, Kmax, rows, theta, layout); rows: a list, or R (R random rows, one twice)
CASES = {
    "cpu": [(B, S, H, D, G, K, rows, theta, "packed")
            for (B, S, H, D, G, K, rows) in [
                (2, 45, 3, 16, 8, 12, [0, 7, 44, 20]),
                (2, 37, 2, 64, 16, 20, [3, 19, 36, 19]),
                (1, 50, 2, 96, 7, 9, list(range(0, 50, 6))),
                (2, 33, 2, 128, 32, 33, [32, 0])]
            # not 1.0: c is then decided by the last bit of a sum
            for theta in (0.5, 0.9, 0.99)],
    "cuda": [(1, 600, 2, 64, 64, 100, 40, 0.9, "packed"),
             (2, 333, 1, 128, 32, 64, 17, 0.5, "bhsd"),
             (1, 2500, 2, 96, 128, 300, 30, 0.95, "packed_d"),
             (1, 300, 1, 256, 64, 50, 9, 0.9, "packed"),
             (1, 5000, 1, 128, 64, 500, 70, 0.99, "packed")],  # several key chunks
}
# how the logits are spread (scale 3 on the CPU: sparsity far from 0 and different per head)
SPREAD = {"cpu": 3.0 ** 0.5, "cuda": 1.7}


def _case_id(c):
    B, S, H, D, G, K, rows, theta, layout = c
    R = rows if isinstance(rows, int) else len(rows)
    return f"B{B}_S{S}_H{H}_D{D}_G{G}_k{K / S:.2g}_R{R}_t{theta}_{layout}"


def recall_pt(q, k, rows, kv_index, kv_count, G, scale, dt):
    """Recall with PyTorch's softmax in `dt` (float64 masks of the listed keys)."""
    r = rows.long()
    qh = q.to(dt).permute(0, 2, 1, 3)[:, :, r]
    kh = k.to(dt).permute(0, 2, 1, 3)
    P = torch.softmax((qh @ kh.transpose(-1, -2)) * scale, dim=-1)
    mult = key_multiplicity(kv_index.cpu(), kv_count.cpu(), q.shape[1])
    covered = (mult[:, :, r.cpu() // G, :] > 0).to(device=q.device, dtype=dt)
    return (P * covered).sum(-1).mean(-1)


def check_profile(device, sp, rc, want, R, S, dtype, pt=None):
    """sparsity / recall of the kernel against the reference (module docstring)."""
    acc = acc_dtype(dtype) if device == "cpu" else torch.float32
    assert sp.dtype == acc and sp.shape == want.sparsity.shape, "sparsity: dtype / shape"
    if device == "cpu":
        assert_close(sp, want.sparsity, acc, "sparsity")
    else:
        torch.testing.assert_close(sp.double().cpu(), want.sparsity.cpu(),
                                   atol=3.0 / (R * S) + 1e-7, rtol=0)
    assert torch.all((sp >= 0) & (sp < 1))
    if want.recall is None:
        assert torch.isnan(rc).all(), "recall without an index must be NaN"
        return
    assert rc.dtype == acc
    if pt is not None:
        assert_pt_bound("recall", rc, want.recall, pt, dtype)
    if device == "cpu":
        assert_close(rc, want.recall, acc, "recall")
    else:
        torch.testing.assert_close(rc.double().cpu(), want.recall.cpu(), atol=2e-5, rtol=0)
    assert torch.all((rc >= 0) & (rc <= 1 + 1e-6))


@pytest.mark.parametrize("device,dtype,case", device_cases(
    {dev: (DTYPES[dev], CASES[dev]) for dev in DTYPES}, _case_id))
def test_matches_reference(device, dtype, case, gen):
    need_backend(device)
    B, S, H, D, G, KM, rows, theta, layout = case
    q, k = make_qkv(B, S, H, D, dtype, layout=layout, generator=gen, n=2, scale=SPREAD[device],
                    device=device)
    if isinstance(rows, int):
        rows = torch.randint(0, S, (rows,), generator=gen)
        rows[-1] = rows[0]
    else:
        rows = torch.tensor(rows)
    R = rows.numel()
    idx, cnt = random_index(B, H, S, G, KM, None, generator=gen, pad="random")
    if device == "cuda":
        idx[..., 1] = idx[..., 0]  # duplicates inside a list: recall counts each key once
    scale = 1.0 / math.sqrt(D)
    rows_d, idx_d, cnt_d = rows.to(device, torch.int32), idx.to(device), cnt.to(device)
    want = profile_ref(q.cpu(), k.cpu(), rows, theta, idx, cnt, G, scale)
    pt = recall_pt(q, k, rows_d, idx, cnt, G, scale, dtype)
    sp, rc = profile_attention(q, k, rows_d, theta, scale, idx_d, cnt_d, G)
    check_profile(device, sp, rc, want, R, S, dtype, pt)
    if device == "cpu":
        res = dsv_ext.profile_attention(q, k, rows, theta, idx, cnt, G)
        assert torch.equal(res.sparsity, sp) and torch.equal(res.recall, rc), \
            "public op and raw op disagree"
    # no index: recall NaN, sparsity unchanged
    sp2, rc2 = profile_attention(q, k, rows_d, theta, scale)
    check_profile(device, sp2, rc2, want._replace(recall=None), R, S, dtype)


def test_no_index_and_extremes(gen):
    need_backend("cpu")
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


DUP = {"cpu": (torch.float64, 1, 24, 2, 16, 6, 8), "cuda": (torch.bfloat16, 1, 300, 2, 64, 64, 40)}


@pytest.mark.parametrize("device", DEVICES)
def test_duplicate_entries_count_once(device, gen):
    """Recall counts each distinct key once even if a list repeats it (kernel-level guard)."""
    need_backend(device)
    dtype, B, S, H, D, G, KM = DUP[device]
    q, k = make_qkv(B, S, H, D, dtype, generator=gen, n=2, device=device)
    idx, cnt = random_index(B, H, S, G, KM, KM, generator=gen)
    dup = idx.clone()
    dup[..., KM // 2:] = dup[..., :KM // 2]  # second half repeats the first
    rows = torch.tensor([0, 7, S - 1]).to(device=device, dtype=torch.int32)
    _, rec = profile_attention(q, k, rows, 0.9, 0.25, dup.to(device), cnt.to(device), G)
    want = profile_ref(q.cpu(), k.cpu(), rows.cpu(), 0.9, dup, cnt, G, scale=0.25)
    _, rec_half = profile_attention(q, k, rows, 0.9, 0.25, idx[..., :KM // 2].contiguous().to(device),
                                    (cnt // 2).to(device), G)
    if device == "cpu":
        assert_close(rec, want.recall, torch.float64, "recall")
        assert_close(rec, rec_half, torch.float64, "recall with duplicates vs without")
    else:
        torch.testing.assert_close(rec.double().cpu(), want.recall, atol=2e-5, rtol=0)
        torch.testing.assert_close(rec.double().cpu(), rec_half.double().cpu(), atol=2e-5,
                                   rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    need_backend("cpu")
    q, k = make_qkv(2, 30, 2, 64, dtype, generator=gen, n=2)
    idx, cnt = random_index(2, 2, 30, 4, 10, None, generator=gen)
    rows = torch.tensor([1, 12, 29])
    res = dsv_ext.profile_attention(q, k, rows, 0.9, idx, cnt, 4)
    ref = profile_ref(q, k, rows, 0.9, idx, cnt, 4)
    assert res.sparsity.dtype == torch.float32
    # half values widen exactly, then everything is computed in float64: float32 tolerance
    assert_close(res.sparsity, ref.sparsity, torch.float32, "sparsity")
    assert_close(res.recall, ref.recall, torch.float32, "recall")


EDGE = {"cpu": torch.float32, "cuda": torch.bfloat16}


@pytest.mark.parametrize("theta", [1e-9, 1.0])
@pytest.mark.parametrize("device", DEVICES)
def test_theta_edges(device, theta, gen):
    need_backend(device)
    B, S, H, D, R = 1, 257, 2, 64, 12
    q, k = make_qkv(B, S, H, D, EDGE[device], generator=gen, device=device, n=2)
    rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32).to(device)
    want = profile_ref(q.cpu(), k.cpu(), rows.long().cpu(), theta, scale=0.125)
    sp, _ = profile_attention(q, k, rows, theta, 0.125)
    if theta < 1.0:
        # the smallest mass: one key per row covers it, sparsity 1 - 1/S (fp32 rounding)
        assert (want.sparsity == 1.0 - 1.0 / S).all()
        assert ((sp.double().cpu() - (1.0 - 1.0 / S)).abs() < 1e-6).all(), sp
    else:
        # theta = 1: all keys, up to the rounding of the total mass (c = S or a few keys less
        # whose mass is below rounding)
        torch.testing.assert_close(sp.double().cpu(), want.sparsity.cpu(), atol=0.05, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_theta_zero_rejected(device, gen):
    need_backend(device)
    q, k = make_qkv(1, 64, 2, 64, EDGE[device], generator=gen, device=device, n=2)
    rows = torch.arange(4, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="theta"):
        profile_attention(q, k, rows, 0.0, 0.125)


@pytest.mark.parametrize("device", DEVICES)
def test_peaked_rows(device, gen):
    """Rows whose softmax is almost one-hot (c = 1) and flat rows (c ~ theta S)."""
    need_backend(device)
    B, S, H, D, R = 1, 1000, 2, 64, 10
    q, k = make_qkv(B, S, H, D, EDGE[device], generator=gen, device=device, n=2)
    q[:, :, 0] *= 20.0   # head 0: very peaked
    q[:, :, 1] *= 0.01   # head 1: nearly uniform
    rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32).to(device)
    want = profile_ref(q.cpu(), k.cpu(), rows.long().cpu(), 0.9, scale=0.125)
    sp, _ = profile_attention(q, k, rows, 0.9, 0.125)
    torch.testing.assert_close(sp.double().cpu(), want.sparsity.cpu(), atol=3.0 / (R * S), rtol=0)
