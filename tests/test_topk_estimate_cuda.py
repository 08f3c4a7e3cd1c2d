"""GPU-only tests of the CUDA top-K estimation kernel (csrc/cuda/topk_estimate.cu): a long
sequence and agreement with the CPU kernel. The checks both devices share (shapes, layouts,
counts 0 / 1 / S / above S, exact ties, clamped counts) are the device-parametrized tests of
tests/test_topk_estimate.py; the selection check and its tolerance: helpers.check_topk.

Skipped without a GPU. The kernels are reached through torch.ops.dsv (the built extension) or,
when DSV_OPS_LIB names a shared library built from csrc/cuda/{topk_estimate,tuning,
predictor_loss,profile_attention,rows}.cu alone (benchmarks/device_run_ops.sh builds one), through ctypes
(tests/helpers.py; re-exported here for benchmarks/bench_topk.py and tests/sanitizer_driver.py).
"""
from __future__ import annotations

import pytest
import torch

from helpers import (DT, Bshd, LowrankShape, PredictorShape, ProfileShape, backend,  # noqa: F401
                     check_topk, gather_rows, get_lib, have_ops, lowrank, need_backend,
                     poison_cache, predictor_loss_bwd, predictor_loss_fwd, profile_attention,
                     ref, scatter_add_rows, topk_estimate)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _load_reference():
    """dsv_ext/reference.py loaded by path (helpers.ref)."""
    return ref


def test_topk_large_k_20pct(gen):
    """K = 20% of S at a longer sequence (the 128k case shrunk to a test size)."""
    need_backend()
    S, H, r, G = 16384, 1, 16, 64
    q, k = lowrank(1, S, H, r, torch.bfloat16, gen, "contiguous", "cuda")
    cnt = torch.tensor([[S // 5]], dtype=torch.int32, device="cuda")
    out = topk_estimate(q, k, cnt, G, S // 5)
    check_topk(out, q, k, cnt, G, S // 5)


def test_topk_matches_cpu(gen):
    """Same lists as the CPU kernel up to near-ties (both checked against float64)."""
    if backend() != "ops":
        pytest.skip("needs the built extension")
    S, H, r, G = 900, 2, 16, 64
    q, k = lowrank(1, S, H, r, torch.bfloat16, gen, "contiguous", "cuda")
    cnt = torch.tensor([[90, 300]], dtype=torch.int32)
    gpu = topk_estimate(q, k, cnt.cuda(), G, 300).cpu()
    cpu = torch.ops.dsv.topk_estimate(q.cpu(), k.cpu(), cnt, G, 300)
    same = (gpu == cpu).float().mean().item()
    assert same > 0.99, f"GPU and CPU lists agree on only {same:.4f} of the entries"
    check_topk(cpu, q.cpu(), k.cpu(), cnt, G, 300)
    check_topk(cpu.cuda(), q, k, cnt, G, 300)
