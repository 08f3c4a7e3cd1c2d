"""GPU-only test of the CUDA attention profile (csrc/cuda/profile_attention.cu): agreement with
the CPU kernel. The checks both devices share (shapes, layouts, theta values and edges, peaked
and flat rows, duplicate list entries, no index) are the device-parametrized tests of
tests/test_profile_attention.py, with their tolerances.
"""
from __future__ import annotations

import pytest
import torch

from helpers import backend, make_qkv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_profile_matches_cpu(gen):
    """Sparsity of the CUDA and CPU kernels on the same bf16 inputs within 3 / (R S) (three
    rows off by one key: the CUDA bound against float64)."""
    if backend() != "ops":
        pytest.skip("needs the built extension")
    q, k = make_qkv(1, 500, 2, 64, dtype=torch.bfloat16, generator=gen, device="cuda", n=2)
    rows = torch.randint(0, 500, (20,), generator=gen, dtype=torch.int32)
    g = torch.ops.dsv.profile_attention(q, k, rows.cuda(), 0.9, 0.125, None, None, 1)
    c = torch.ops.dsv.profile_attention(q.cpu(), k.cpu(), rows, 0.9, 0.125, None, None, 1)
    torch.testing.assert_close(g[0].double().cpu(), c[0].double(), atol=3.0 / (20 * 500), rtol=0)
