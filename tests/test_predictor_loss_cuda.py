"""GPU-only tests of the CUDA predictor loss kernels (csrc/cuda/predictor_loss.cu): rows out of
range through the raw kernel, and agreement with the CPU kernel. The checks both devices share
(shapes, strides, a row sampled twice, several key chunks, forward statistics and gradients
against the float64 reference with their tolerances) are the device-parametrized tests of
tests/test_predictor_loss.py.
"""
from __future__ import annotations

import pytest
import torch

from helpers import backend, need_backend, predictor_loss_bwd, predictor_loss_fwd
from test_predictor_loss import inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_predictor_loss_out_of_range_rows(gen):
    """Rows outside [0, S) are ignored by the kernels (stats 0, no gradient); ctypes only, the
    Python layer rejects such rows."""
    if need_backend() != "ctypes":
        pytest.skip("raw kernel behaviour: ctypes only")
    B, S, H, D, r = 1, 200, 1, 64, 16
    q, k, ql, kl = inputs(B, S, H, D, r, torch.bfloat16, gen, "contiguous", "cuda")
    rows = torch.tensor([5, -3, 250, 7], dtype=torch.int32).cuda()
    loss, stats = predictor_loss_fwd(q, k, ql, kl, rows, 0.125, 0.95, 0.05)
    assert (stats[0, 0, 1] == 0).all() and (stats[0, 0, 2] == 0).all()
    dloss = torch.ones(B, H).cuda()
    dq, dk = predictor_loss_bwd(dloss, q, k, ql, kl, rows, stats, 0.125, 0.95, 0.05)
    assert torch.isfinite(dq.float()).all() and torch.isfinite(dk.float()).all()
    keep = torch.tensor([5, 7], dtype=torch.int32).cuda()
    _, st2 = predictor_loss_fwd(q, k, ql, kl, keep, 0.125, 0.95, 0.05)
    # gradient of the valid rows only, with the loss mean over 4 rows -> scale dloss by 2/4
    dq2, dk2 = predictor_loss_bwd(dloss * 0.5, q, k, ql, kl, keep, st2, 0.125, 0.95, 0.05)
    torch.testing.assert_close(dq.float(), dq2.float(), atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(dk.float(), dk2.float(), atol=1e-3, rtol=1e-2)


def test_predictor_loss_matches_cpu(gen):
    """The CUDA and CPU kernels on the same bf16 inputs: losses within 1e-4 (the CUDA loss's
    bound against float64; the CPU one is far closer)."""
    if backend() != "ops":
        pytest.skip("needs the built extension")
    q, k, ql, kl = inputs(1, 400, 2, 64, 16, torch.bfloat16, gen, "contiguous", "cuda")
    rows = torch.randint(0, 400, (25,), generator=gen, dtype=torch.int32)
    lg, sg = torch.ops.dsv.predictor_loss_fwd(q, k, ql, kl, rows.cuda(), 0.125, 0.95, 0.05)
    lc, sc = torch.ops.dsv.predictor_loss_fwd(q.cpu(), k.cpu(), ql.cpu(), kl.cpu(), rows, 0.125,
                                              0.95, 0.05)
    torch.testing.assert_close(lg.cpu().double(), lc.double(), atol=1e-4, rtol=0)
