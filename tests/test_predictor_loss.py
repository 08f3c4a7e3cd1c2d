"""predictor_loss (forward: loss and row statistics; backward in q_lr, k_lr) on every device
against the float64 reference of dsv_ext.reference.

Each test runs on "cpu" and "cuda" (skipped without a GPU): the CPU kernels in float32 / float64,
the CUDA kernels in bfloat16 / float16. The loss, the row statistics and the gradients meet the
tolerance rule of tests/helpers.py (the counterpart: the same formula with PyTorch ops in the
input dtype, as FlashAttention's tests form theirs; for half inputs that is far looser than the
kernels, which accumulate in fp32), and beside it the derived bounds:
  CPU: TOL / GRAD_TOL of tests/helpers.py (loss of half inputs: float32's; the inputs were the
  only rounding, which the reference sees too).
  CUDA forward: z and p are exact products of 16-bit inputs accumulated in fp32 over at most a
  few hundred terms, and the three sums over S keys are fp32 (per-lane partials merged in a
  fixed order), so row_stats carry relative errors of ~1e-6 of sum |terms|: 1e-4 relative to
  sqrt(Szz Spp) (Szp) or to the value (Szz, Spp); the loss, computed in double from those sums,
  gets 1e-4 absolute (loss values are O(1)).
  CUDA backward: G is rebuilt in fp32 (error ~1e-6 relative) and enters the tensor cores as a
  hi + lo pair of 16-bit values (relative error 2^-17 for bf16, 2^-22 for fp16), then the fp32
  sums are rounded once to the output dtype: bf16 2^-8, fp16 2^-11 relative. Allowed:
  |x - ref| <= rtol |ref| + atol rms(ref) with (rtol, atol) = (1e-2, 1e-2) for bf16 and
  (2e-3, 2e-3) for fp16, plus a Frobenius-norm relative error below 4e-3 (bf16) / 5e-4 (fp16);
  fp16 gradients also get 2^-24 absolute (values below 2^-14 are subnormal).
GPU-only cases (rows out of range through the raw kernel, agreement with the CPU kernel) are in
test_predictor_loss_cuda.py.
"""
import math

import pytest
import torch

from helpers import (acc_dtype, assert_close, assert_pt_bound, device_cases, import_dsv_ext,
                     make_qkv, need_backend, predictor_loss_bwd, predictor_loss_fwd,
                     predictor_loss_pt, predictor_loss_ref)

dsv_ext = import_dsv_ext()

DTYPES = {"cpu": [torch.float32, torch.float64], "cuda": [torch.bfloat16, torch.float16]}

# (B, S, H, D, r, rows, layout); rows: a list, or R (R random rows, one sampled twice)
CASES = {
    "cpu": [(2, 45, 3, 16, 16, [0, 7, 44, 7, 20], "packed"),   # a row sampled twice
            (2, 45, 3, 16, 16, [0, 7, 44, 7, 20], "bhsd"),
            (2, 37, 2, 64, 16, [3, 19, 36], "packed"),
            (2, 37, 2, 64, 16, [3, 19, 36], "bhsd"),
            (1, 50, 2, 96, 8, list(range(0, 50, 16)), "packed"),
            (1, 50, 2, 96, 8, list(range(0, 50, 16)), "bhsd"),
            (2, 33, 2, 128, 4, [32, 0], "packed"),
            (2, 33, 2, 128, 4, [32, 0], "bhsd")],
    "cuda": [(1, 777, 2, 64, 16, 50, "contiguous"),
             (2, 300, 1, 128, 16, 19, "bhsd_padded"),
             (1, 513, 2, 96, 24, 33, "contiguous"),
             (1, 260, 1, 256, 64, 16, "bhsd_padded"),
             (1, 9000, 1, 128, 16, 70, "contiguous")],  # several key chunks
}


def _case_id(c):
    B, S, H, D, r, rows, layout = c
    R = rows if isinstance(rows, int) else len(rows)
    return f"B{B}_S{S}_H{H}_D{D}_r{r}_R{R}_{layout}"


def inputs(B, S, H, D, r, dtype, gen, layout, device):
    """q, k [B, S, H, D] and q_lr, k_lr [B, S, H, r]; "bhsd_padded": views of [B, H, S, d + 8]
    tensors (heads outer, rows padded), other layouts as make_qkv."""
    if layout == "bhsd_padded":
        def mk(d):
            t = torch.randn(B, H, S, d + 8, generator=gen, dtype=torch.float64)
            return t.to(device=device, dtype=dtype)[..., :d].transpose(1, 2)
        return mk(D), mk(D), mk(r), mk(r)
    q, k = make_qkv(B, S, H, D, dtype, layout=layout, generator=gen, device=device, n=2)
    q_lr, k_lr = make_qkv(B, S, H, r, dtype, layout=layout, generator=gen, device=device, n=2)
    return q, k, q_lr, k_lr


def stats64(q, k, ql, kl, rows, scale):
    """[B, H, R, 3] float64 (Szp, Szz, Spp) of the sampled rows."""
    qh = q.double().cpu().permute(0, 2, 1, 3)[:, :, rows.long().cpu()]
    kh = k.double().cpu().permute(0, 2, 1, 3)
    qlh = ql.double().cpu().permute(0, 2, 1, 3)[:, :, rows.long().cpu()]
    klh = kl.double().cpu().permute(0, 2, 1, 3)
    z = scale * qh @ kh.transpose(-1, -2)
    p = qlh @ klh.transpose(-1, -2)
    return torch.stack([(z * p).sum(-1), (z * z).sum(-1), (p * p).sum(-1)], dim=-1)


def stats_pt(q, k, ql, kl, rows, scale, dt):
    """stats64's formula with PyTorch ops in `dt` (results in float64)."""
    r = rows.long()
    qh = q.to(dt).permute(0, 2, 1, 3)[:, :, r]
    kh = k.to(dt).permute(0, 2, 1, 3)
    qlh = ql.to(dt).permute(0, 2, 1, 3)[:, :, r]
    klh = kl.to(dt).permute(0, 2, 1, 3)
    z = (qh @ kh.transpose(-1, -2)) * scale
    p = qlh @ klh.transpose(-1, -2)
    return torch.stack([(z * p).sum(-1), (z * z).sum(-1), (p * p).sum(-1)], dim=-1).double()


def cuda_grad_close(got, want, dtype, what):
    """The CUDA backward's derived bound (module docstring)."""
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


def check_predictor(q, k, q_lr, k_lr, rows, gen, scale=None, cw=0.95, nw=0.05):
    """Raw forward and backward of q's device (outputs poisoned) against the float64 reference;
    on the CPU also the public op (bit-equal loss and gradients through its autograd)."""
    dev, dtype = q.device, q_lr.dtype
    cpu = dev.type == "cpu"
    B, S, H, D = q.shape
    R = rows.numel()
    acc = acc_dtype(dtype) if cpu else torch.float32
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rows = rows.to(device=dev, dtype=torch.int32)

    loss, stats = predictor_loss_fwd(q, k, q_lr, k_lr, rows, sc, cw, nw)
    assert loss.dtype == acc and loss.shape == (B, H), f"loss: {loss.dtype} {tuple(loss.shape)}"
    assert stats.dtype == acc and stats.shape == (B, H, R, 3), "row_stats: dtype / shape"
    st64 = stats64(q, k, q_lr, k_lr, rows, sc)
    assert_pt_bound("row_stats", stats, st64, stats_pt(q, k, q_lr, k_lr, rows, sc, dtype), dtype)
    s = stats.double().cpu()
    cross = (st64[..., 1] * st64[..., 2]).sqrt()
    assert ((s[..., 0] - st64[..., 0]).abs() <= 1e-4 * cross).all(), "row_stats Szp"
    assert ((s[..., 1:] - st64[..., 1:]).abs() <= 1e-4 * st64[..., 1:]).all(), \
        "row_stats Szz/Spp"

    ql64, kl64 = (t.detach().double().cpu().requires_grad_(True) for t in (q_lr, k_lr))
    want = predictor_loss_ref(q.cpu(), k.cpu(), ql64, kl64, rows.long().cpu(), sc, cw, nw)
    qlp, klp = (t.detach().clone().requires_grad_(True) for t in (q_lr, k_lr))
    pt = predictor_loss_pt(q, k, qlp, klp, rows.long(), sc, cw, nw)
    assert_pt_bound("loss", loss, want, pt, dtype)
    if cpu:
        assert_close(loss, want, acc, "loss")
    else:
        torch.testing.assert_close(loss.double().cpu(), want.detach(), atol=1e-4, rtol=0)

    dloss = torch.randn(B, H, generator=gen, dtype=torch.float64)
    (want * dloss).sum().backward()
    dloss = dloss.to(device=dev, dtype=acc)
    (pt * dloss.to(dtype)).sum().backward()
    dq, dk = predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, stats, sc, cw, nw)
    for name, g, r, p in (("dq_lr", dq, ql64.grad, qlp.grad), ("dk_lr", dk, kl64.grad, klp.grad)):
        assert g.dtype == dtype and g.shape == q_lr.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_pt_bound(name, g, r, p, dtype)
        if cpu:
            assert_close(g, r, dtype, name, grad=True)
        else:
            cuda_grad_close(g, r, dtype, name)
    # rows never sampled get exactly zero
    unsampled = torch.ones(S, dtype=torch.bool)
    unsampled[rows.long().cpu()] = False
    assert (dq.cpu()[:, unsampled] == 0).all(), "dq_lr: unsampled rows must be zero"
    if cpu:
        qg, kg = (t.detach().requires_grad_(True) for t in (q_lr, k_lr))
        lp = dsv_ext.predictor_loss(q, k, qg, kg, rows, scale=scale, cos_weight=cw,
                                    norm_weight=nw)
        assert torch.equal(lp, loss), "public op and raw op disagree (loss)"
        gq, gk = torch.autograd.grad(lp, (qg, kg), dloss)
        assert torch.equal(gq, dq) and torch.equal(gk, dk), "public op and raw op disagree"


@pytest.mark.parametrize("device,dtype,case", device_cases(
    {dev: (DTYPES[dev], CASES[dev]) for dev in DTYPES}, _case_id))
def test_matches_reference(device, dtype, case, gen):
    need_backend(device)
    B, S, H, D, r, rows, layout = case
    q, k, q_lr, k_lr = inputs(B, S, H, D, r, dtype, gen, layout, device)
    if isinstance(rows, int):
        R = rows
        rows = torch.randint(0, S, (R,), generator=gen)
        rows[min(3, R - 1)] = rows[0]  # a row sampled twice
    else:
        rows = torch.tensor(rows)
    check_predictor(q, k, q_lr, k_lr, rows, gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    """Half inputs on the CPU: loss and statistics in float32, gradients in the half dtype."""
    need_backend("cpu")
    B, S, H, D, R = 2, 40, 2, 64, 16
    q, k = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, R, dtype, generator=gen, n=2)
    check_predictor(q, k, q_lr, k_lr, torch.tensor([1, 17, 39]), gen)


def test_weights_scale_and_near_optimum(gen):
    """Custom weights and scale; and a predictor that reproduces the logits exactly has a loss
    near 0 (a check that the reference is not just mirroring the kernel)."""
    need_backend("cpu")
    B, S, H, D = 2, 31, 2, 16
    dtype = torch.float64
    q, k = make_qkv(B, S, H, D, dtype, generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, 8, dtype, generator=gen, n=2)
    rows = torch.tensor([0, 5, 30])
    check_predictor(q, k, q_lr, k_lr, rows, gen, scale=0.7, cw=0.6, nw=0.4)
    # q_lr = scale * q, k_lr = k (rank = D): p == z, so both terms vanish
    loss = dsv_ext.predictor_loss(q, k, (0.25 * q).contiguous(), k.contiguous(), rows)
    assert torch.all(loss.abs() < 1e-10)


def test_gradcheck_float64(gen):
    need_backend("cpu")
    B, S, H, D, R = 2, 7, 2, 4, 3
    q, k = make_qkv(B, S, H, D, torch.float64, generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, R, torch.float64, layout="packed", generator=gen, n=2,
                          requires_grad=True)
    rows = torch.tensor([0, 3, 6, 3])
    assert torch.autograd.gradcheck(
        lambda a, b: dsv_ext.predictor_loss(q, k, a, b, rows, cos_weight=0.7, norm_weight=0.3),
        (q_lr, k_lr), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_q_and_k_are_constants(gen):
    need_backend("cpu")
    q, k = make_qkv(1, 10, 1, 8, torch.float64, generator=gen, n=2, requires_grad=True)
    q_lr, k_lr = make_qkv(1, 10, 1, 4, torch.float64, generator=gen, n=2, requires_grad=True)
    loss = dsv_ext.predictor_loss(q, k, q_lr, k_lr, torch.tensor([2, 4]))
    loss.sum().backward()
    assert q.grad is None and k.grad is None
    assert q_lr.grad is not None and k_lr.grad is not None
