"""CPU tests of predictor_loss (forward + backward in q_lr, k_lr) against the float64 reference."""
import pytest
import torch

import dsv_ext
from dsv_ext.reference import make_qkv, predictor_loss_ref

from conftest import assert_close, poison

# (B, S, H, D, r, rows)
SHAPES = [
    (2, 45, 3, 16, 16, [0, 7, 44, 7, 20]),   # a row sampled twice
    (2, 37, 2, 64, 16, [3, 19, 36]),
    (1, 50, 2, 96, 8, list(range(0, 50, 16))),
    (2, 33, 2, 128, 4, [32, 0]),
]


def _run_and_ref(q, k, q_lr, k_lr, rows, dtype, gen, **kw):
    B, S, H, _ = q.shape
    poison()
    loss = dsv_ext.predictor_loss(q, k, q_lr, k_lr, rows, **kw)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == acc and loss.shape == (B, H)
    dloss = torch.randn(B, H, generator=gen, dtype=torch.float64)
    poison()
    dq, dk = torch.autograd.grad(loss, (q_lr, k_lr), dloss.to(acc))
    ql64, kl64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (q_lr, k_lr))
    rloss = predictor_loss_ref(q, k, ql64, kl64, rows, **kw)
    rdq, rdk = torch.autograd.grad(rloss, (ql64, kl64), dloss)
    return (loss, dq, dk), (rloss, rdq, rdk)


@pytest.mark.parametrize("layout", ["packed", "bhsd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_D{}_r{}".format(*s[:5]))
def test_matches_reference(shape, dtype, layout, gen):
    B, S, H, D, R, rows = shape
    q, k = make_qkv(B, S, H, D, dtype, layout=layout, generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, R, dtype, layout=layout, generator=gen, n=2,
                          requires_grad=True)
    rows = torch.tensor(rows)
    got, want = _run_and_ref(q, k, q_lr, k_lr, rows, dtype, gen)
    for name, a, b in zip(("loss", "dq_lr", "dk_lr"), got, want):
        assert_close(a, b, dtype, name, grad=name != "loss")
    # rows that were not sampled get no gradient in q_lr
    unsampled = torch.ones(S, dtype=torch.bool)
    unsampled[rows] = False
    assert torch.all(got[1][:, unsampled] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    B, S, H, D, R = 2, 40, 2, 64, 16
    q, k = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, R, dtype, generator=gen, n=2, requires_grad=True)
    got, want = _run_and_ref(q, k, q_lr, k_lr, torch.tensor([1, 17, 39]), dtype, gen)
    # loss and its gradients come out in float32 (acc type); the inputs were the only
    # rounding, which the reference sees too, so float32 tolerances apply to loss; the
    # gradients are returned in the half dtype
    assert_close(got[0], want[0], torch.float32, "loss")
    for name, a, b in zip(("dq_lr", "dk_lr"), got[1:], want[1:]):
        assert a.dtype == dtype
        assert_close(a, b, dtype, name, grad=True)


def test_weights_scale_and_near_optimum(gen):
    """Custom weights and scale; and a predictor that reproduces the logits exactly has a loss
    near 0 (a check that the reference is not just mirroring the kernel)."""
    B, S, H, D = 2, 31, 2, 16
    dtype = torch.float64
    q, k = make_qkv(B, S, H, D, dtype, generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, 8, dtype, generator=gen, n=2, requires_grad=True)
    rows = torch.tensor([0, 5, 30])
    kw = dict(scale=0.7, cos_weight=0.6, norm_weight=0.4)
    got, want = _run_and_ref(q, k, q_lr, k_lr, rows, dtype, gen, **kw)
    for name, a, b in zip(("loss", "dq_lr", "dk_lr"), got, want):
        assert_close(a, b, dtype, name, grad=name != "loss")
    # q_lr = scale * q, k_lr = k (rank = D): p == z, so both terms vanish
    loss = dsv_ext.predictor_loss(q, k, (0.25 * q).contiguous(), k.contiguous(), rows)
    assert torch.all(loss.abs() < 1e-10)


def test_gradcheck_float64(gen):
    B, S, H, D, R = 2, 7, 2, 4, 3
    q, k = make_qkv(B, S, H, D, torch.float64, generator=gen, n=2)
    q_lr, k_lr = make_qkv(B, S, H, R, torch.float64, layout="packed", generator=gen, n=2,
                          requires_grad=True)
    rows = torch.tensor([0, 3, 6, 3])
    assert torch.autograd.gradcheck(
        lambda a, b: dsv_ext.predictor_loss(q, k, a, b, rows, cos_weight=0.7, norm_weight=0.3),
        (q_lr, k_lr), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_q_and_k_are_constants(gen):
    q, k = make_qkv(1, 10, 1, 8, torch.float64, generator=gen, n=2, requires_grad=True)
    q_lr, k_lr = make_qkv(1, 10, 1, 4, torch.float64, generator=gen, n=2, requires_grad=True)
    loss = dsv_ext.predictor_loss(q, k, q_lr, k_lr, torch.tensor([2, 4]))
    loss.sum().backward()
    assert q.grad is None and k.grad is None
    assert q_lr.grad is not None and k_lr.grad is not None
