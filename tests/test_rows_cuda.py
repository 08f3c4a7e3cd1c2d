"""GPU tests of the CUDA row gather / scatter-add (csrc/cuda/rows.cu): the device-parametrized
tests of tests/test_rows.py (every dtype, strided tables, rows out of range, bit-exact gather,
scatter-add against float64 with its tolerances) hold the CUDA cases; this file keeps the check
that both devices agree.
"""
from __future__ import annotations

import pytest
import torch

from helpers import backend, gather_rows, scatter_add_rows, scatter_add_rows_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_cpu(dtype, gen):
    """gather: bit-identical on both devices; scatter-add: both within the CUDA bound of
    float64 (the dtype's half-ulp relative plus 1e-5 * max|ref|), so within twice it of each
    other."""
    if backend() != "ops":
        pytest.skip("needs the built extension")
    src = torch.randn(300, 96, generator=gen).to(dtype)
    index = torch.randint(0, 300, (500,), generator=gen)
    assert torch.equal(gather_rows(src.cuda(), index.cuda()).cpu(), gather_rows(src, index))
    idx2 = torch.randint(0, 50, (300,), generator=gen)
    g = scatter_add_rows(src.cuda(), idx2.cuda(), 50).double().cpu()
    c = scatter_add_rows(src, idx2, 50).double()
    want = scatter_add_rows_ref(src, idx2, 50)
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    tol = 2 * (u * want.abs() + 1e-5 * want.abs().max())
    assert ((g - c).abs() <= tol).all(), f"CUDA vs CPU scatter-add: {(g - c).abs().max():.3e}"
