"""GPU tests of the CUDA predictor loss kernels (csrc/cuda/predictor_loss.cu), forward + backward.

Reference: dsv_ext/reference.py predictor_loss_ref (float64, autograd for the gradients) on the
same 16-bit inputs; row_stats from a float64 recomputation here.

Tolerances (fp16 gradients also get 2^-24 absolute: values below 2^-14 are subnormal). Forward: z and p are exact products of 16-bit inputs accumulated in fp32 over at
most a few hundred terms, and the three sums over S keys are fp32 (per-lane partials merged in a
fixed order), so row_stats carry relative errors of ~1e-6 of sum |terms|: we allow 1e-4 relative
to the scale sqrt(Szz Spp) (Szp) or to the value (Szz, Spp); the loss, computed in double from
those sums, gets 1e-4 absolute (loss values are O(1)).
Backward: G is rebuilt in fp32 (error ~1e-6 relative) and enters the tensor cores as a hi + lo
pair of 16-bit values (relative error 2^-17 for bf16, 2^-22 for fp16), then the fp32 sums are
rounded once to the output dtype: bf16 2^-8, fp16 2^-11 relative. Allowed: |x - ref| <=
rtol |ref| + atol rms(ref) with (rtol, atol) = (1e-2, 1e-2) for bf16 and (2e-3, 2e-3) for fp16,
plus a Frobenius-norm relative error below 4e-3 (bf16) / 5e-4 (fp16).
"""
from __future__ import annotations

import math

import pytest
import torch

import test_topk_estimate_cuda as KB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ref = KB._load_reference()


def _inputs(B, S, H, D, r, dtype, gen, strided):
    def mk(d):
        if strided:
            t = torch.randn(B, H, S, d + 8, generator=gen).to(dtype).cuda()
            return t[..., :d].transpose(1, 2)  # [B, S, H, d], rows padded, heads outer
        return torch.randn(B, S, H, d, generator=gen).to(dtype).cuda()
    q, k = mk(D), mk(D)
    ql, kl = mk(r), mk(r)
    return q, k, ql, kl


def _stats64(q, k, ql, kl, rows, scale):
    qh = q.double().permute(0, 2, 1, 3)[:, :, rows.long()]
    kh = k.double().permute(0, 2, 1, 3)
    qlh = ql.double().permute(0, 2, 1, 3)[:, :, rows.long()]
    klh = kl.double().permute(0, 2, 1, 3)
    z = scale * qh @ kh.transpose(-1, -2)
    p = qlh @ klh.transpose(-1, -2)
    return torch.stack([(z * p).sum(-1), (z * z).sum(-1), (p * p).sum(-1)], dim=-1)


def _grad_close(got, want, dtype, what):
    rtol, atol, ftol = (1e-2, 1e-2, 4e-3) if dtype == torch.bfloat16 else (2e-3, 2e-3, 5e-4)
    # fp16 outputs below 2^-14 are subnormal, spaced 2^-24: rounding adds up to 2^-25 absolute
    sub = 2.0 ** -24 if dtype == torch.float16 else 0.0
    got = got.double().cpu()
    want = want.double().cpu()
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    rms = want.pow(2).mean().sqrt().item() + 1e-30
    ftol = ftol + sub / rms
    err = (got - want).abs()
    bad = err > rtol * want.abs() + atol * rms + sub
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, max err {err.max().item():.3e}"
                           f" (rms {rms:.3e})")
    fro = (got - want).norm().item() / (want.norm().item() + 1e-30)
    assert fro < ftol, f"{what}: relative Frobenius error {fro:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S,H,D,r,R,strided", [
    (1, 777, 2, 64, 16, 50, False),
    (2, 300, 1, 128, 16, 19, True),
    (1, 513, 2, 96, 24, 33, False),
    (1, 260, 1, 256, 64, 16, True),
    (1, 9000, 1, 128, 16, 70, False),  # several key chunks
])
def test_predictor_loss_fwd_bwd(gen, dtype, B, S, H, D, r, R, strided):
    KB.need_backend()
    q, k, ql, kl = _inputs(B, S, H, D, r, dtype, gen, strided)
    rows = torch.randint(0, S, (R,), generator=gen, dtype=torch.int32)
    rows[min(3, R - 1)] = rows[0]  # a row sampled twice
    rows = rows.cuda()
    scale = 1.0 / math.sqrt(D)
    cw, nw = 0.95, 0.05

    loss, stats = KB.predictor_loss_fwd(q, k, ql, kl, rows, scale, cw, nw)
    torch.cuda.synchronize()
    st64 = _stats64(q, k, ql, kl, rows, scale).cpu()
    stats = stats.double().cpu()
    assert stats.shape == (B, H, R, 3)
    assert torch.isfinite(stats).all(), "row_stats: unwritten or non-finite"
    cross = (st64[..., 1] * st64[..., 2]).sqrt()
    assert ((stats[..., 0] - st64[..., 0]).abs() <= 1e-4 * cross).all(), "row_stats Szp"
    assert ((stats[..., 1:] - st64[..., 1:]).abs() <= 1e-4 * st64[..., 1:]).all(), "row_stats Szz/Spp"

    q64, k64 = q.double(), k.double()
    ql64 = ql.double().requires_grad_(True)
    kl64 = kl.double().requires_grad_(True)
    want = ref.predictor_loss_ref(q64, k64, ql64, kl64, rows.long(), scale, cw, nw)
    got = loss.double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want.detach().cpu(), atol=1e-4, rtol=0)

    dloss = torch.randn(B, H, generator=gen).float().cuda()
    (want * dloss.double()).sum().backward()
    stats_dev = stats.float().cuda().contiguous()
    dq, dk = KB.predictor_loss_bwd(dloss, q, k, ql, kl, rows, stats_dev, scale, cw, nw)
    assert dq.shape == ql.shape and dk.shape == kl.shape
    assert dq.dtype == dtype and dk.dtype == dtype
    _grad_close(dq, ql64.grad, dtype, "dq_lr")
    _grad_close(dk, kl64.grad, dtype, "dk_lr")
    # rows never sampled get exactly zero
    unsampled = torch.ones(S, dtype=torch.bool)
    unsampled[rows.long().cpu()] = False
    assert (dq.float().cpu()[:, unsampled] == 0).all(), "dq_lr: unsampled rows must be zero"


def test_predictor_loss_out_of_range_rows(gen):
    """Rows outside [0, S) are ignored by the kernels (stats 0, no gradient); ctypes only, the
    Python layer rejects such rows."""
    if KB.need_backend() != "ctypes":
        pytest.skip("raw kernel behaviour: ctypes only")
    B, S, H, D, r = 1, 200, 1, 64, 16
    q, k, ql, kl = _inputs(B, S, H, D, r, torch.bfloat16, gen, False)
    rows = torch.tensor([5, -3, 250, 7], dtype=torch.int32).cuda()
    loss, stats = KB.predictor_loss_fwd(q, k, ql, kl, rows, 0.125, 0.95, 0.05)
    assert (stats[0, 0, 1] == 0).all() and (stats[0, 0, 2] == 0).all()
    dloss = torch.ones(B, H).cuda()
    dq, dk = KB.predictor_loss_bwd(dloss, q, k, ql, kl, rows, stats, 0.125, 0.95, 0.05)
    assert torch.isfinite(dq.float()).all() and torch.isfinite(dk.float()).all()
    keep = torch.tensor([5, 7], dtype=torch.int32).cuda()
    _, st2 = KB.predictor_loss_fwd(q, k, ql, kl, keep, 0.125, 0.95, 0.05)
    # gradient of the valid rows only, with the loss mean over 4 rows -> scale dloss by 2/4
    dq2, dk2 = KB.predictor_loss_bwd(dloss * 0.5, q, k, ql, kl, keep, st2, 0.125, 0.95, 0.05)
    torch.testing.assert_close(dq.float(), dq2.float(), atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(dk.float(), dk2.float(), atol=1e-3, rtol=1e-2)


def test_predictor_loss_matches_cpu(gen):
    if KB.backend() != "ops":
        pytest.skip("needs the built extension")
    q, k, ql, kl = _inputs(1, 400, 2, 64, 16, torch.bfloat16, gen, False)
    rows = torch.randint(0, 400, (25,), generator=gen, dtype=torch.int32)
    lg, sg = torch.ops.dsv.predictor_loss_fwd(q, k, ql, kl, rows.cuda(), 0.125, 0.95, 0.05)
    lc, sc = torch.ops.dsv.predictor_loss_fwd(q.cpu(), k.cpu(), ql.cpu(), kl.cpu(), rows, 0.125,
                                              0.95, 0.05)
    torch.testing.assert_close(lg.cpu().double(), lc.double(), atol=1e-4, rtol=0)
