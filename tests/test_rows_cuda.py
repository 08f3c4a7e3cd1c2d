"""GPU tests of the CUDA row gather / scatter-add (csrc/cuda/rows.cu).

gather is a copy: results must be bit-identical to dsv_ext.reference.gather_rows_ref.
scatter-add accumulates in fp32 (float64 for float64 input) with atomics, so the order of the
adds varies: against the float64 reference, each output element sums at most n inputs of
magnitude <= m, error <= n * 2^-24 * n * m in fp32, then one rounding to the src dtype
(ops backend) -- we allow the dtype's half-ulp relative plus 1e-5 * max|ref| absolute.
"""
from __future__ import annotations

import pytest
import torch

import test_topk_estimate_cuda as KB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ref = KB._load_reference()

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11,
       torch.bfloat16: 2.0 ** -8}


def _src(N, D, dtype, gen, pad):
    t = torch.randn(N, D + pad, generator=gen, dtype=torch.float64).to(dtype).cuda()
    return t[:, :D] if pad else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,D,M,pad", [(50, 128, 70, 0), (33, 7, 40, 3), (9, 1, 20, 5),
                                       (1000, 130, 3000, 2), (64, 256, 1, 0)])
def test_gather_rows(gen, dtype, N, D, M, pad):
    b = KB.need_backend()
    src = _src(N, D, dtype, gen, pad)
    index = torch.randint(0, N, (M,), generator=gen, dtype=torch.int64)
    if b == "ctypes":  # the raw kernel zero-fills rows out of range
        index[::7] = torch.randint(-5, 0, index[::7].shape, generator=gen)
        index[3::11] = N + 2
    index = index.cuda()
    out = KB.gather_rows(src, index)
    want = ref.gather_rows_ref(src, index)
    assert out.shape == (M, D) and out.dtype == dtype
    assert torch.equal(out, want), "gather differs"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,D,num_rows,pad", [(100, 64, 30, 0), (77, 5, 10, 3), (500, 1, 7, 1),
                                              (2000, 132, 300, 0), (10, 256, 1000, 4)])
def test_scatter_add_rows(gen, dtype, M, D, num_rows, pad):
    b = KB.need_backend()
    src = _src(M, D, dtype, gen, pad)
    index = torch.randint(0, num_rows, (M,), generator=gen, dtype=torch.int64)
    if b == "ctypes":  # the raw kernel skips rows out of range
        index[::5] = -1
        index[2::9] = num_rows
    index = index.cuda()
    out = KB.scatter_add_rows(src, index, num_rows)
    want = ref.scatter_add_rows_ref(src, index, num_rows).cpu()
    assert out.shape == (num_rows, D) and out.dtype == dtype
    got = out.double().cpu()
    assert torch.isfinite(got).all()
    tol = EPS[dtype] * want.abs() + 1e-5 * (want.abs().max().item() + 1e-30)
    if dtype == torch.float64:
        tol = 1e-12 * (want.abs().max().item() + 1.0) + 0 * want
    err = (got - want).abs()
    assert (err <= tol).all(), f"scatter-add: max error {err.max().item():.3e}"
