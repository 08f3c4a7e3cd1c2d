"""Shared pytest fixtures and helpers of the dsv-ext test suite.

Every test gets fresh random inputs: the `gen` fixture seeds a torch.Generator from
DSV_TEST_SEED when set (to reproduce a failure) and otherwise from a fresh random seed; the seed
is printed, so pytest shows it next to any failure.
"""
from __future__ import annotations

import inspect
import os
import random
import re

import pytest
import torch

# Tolerances (atol, rtol) for kernel outputs against the float64 references, by input dtype.
#  float64: kernels compute in float64, only summation order differs (values are O(1)).
#  float32: float32 accumulation over up to a few hundred products of O(1) values
#           (eps 1.2e-7 times a growth of ~sqrt(n)*|logit| through exp) stays below 2e-5.
#  float16: computed in float32 and rounded once to fp16 (eps 9.8e-4): a few ulps of O(1) values.
#  bfloat16: the same with bf16's eps of 7.8e-3 (8 mantissa bits).
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

# Gradients are sums over more products (dS, dP) than the forward, and for half inputs the
# backward also reuses the half-rounded forward output in D_i = dout . out: double the float32 /
# half allowance; float64 stays at round-off level.
GRAD_TOL = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (5e-5, 5e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 6e-2),
}


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("DSV_TEST_SEED", random.randrange(2**31)))
    print(f"[{request.node.name}] DSV_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def poison(nbytes: int = 1 << 16) -> None:
    """Best-effort poisoning of the host heap: allocate and free NaN-filled blocks so that the
    next small CPU allocations (the ops' outputs) are likely to reuse NaN memory rather than
    fresh zero pages. Outputs are then checked element by element, so an element a kernel
    forgot to write shows up as NaN / garbage."""
    for n in (nbytes, nbytes // 4, nbytes // 16, 1024):
        t = torch.full((max(n // 8, 1),), float("nan"), dtype=torch.float64)
        del t


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "",
                 grad: bool = False, allow_inf: bool = False) -> None:
    """Every element of `got` (any dtype) equals `want` (float64) within the tolerance of
    `dtype`; and `got` holds no NaN (nor inf unless allow_inf)."""
    atol, rtol = (GRAD_TOL if grad else TOL)[dtype]
    got64 = got.detach().to(torch.float64).cpu()
    want = want.detach().to(torch.float64).cpu()
    assert got64.shape == want.shape, f"{what}: shape {tuple(got64.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(got64).any(), f"{what}: NaN in the output"
    if not allow_inf:
        assert torch.isfinite(got64).all(), f"{what}: inf in the output"
    else:
        assert torch.equal(torch.isinf(got64), torch.isinf(want)), f"{what}: inf pattern differs"
        assert torch.equal(got64[torch.isinf(got64)], want[torch.isinf(want)]), f"{what}: inf sign"
        fin = torch.isfinite(want)
        got64, want = got64[fin], want[fin]
    torch.testing.assert_close(got64, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# On a machine without a CUDA GPU, pytest's -ra summary (pyproject addopts) would list the GPU
# tests' skips once per skip location: fold them into one line.
_GPU_SKIP = re.compile(r"\b(GPUs?|CUDA)\b")
_GPU_SKIP_LINE = inspect.currentframe().f_lineno - 1  # 0-based, as pytest stores it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.skipped and isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3):
        return
    if torch.cuda.is_available():
        return
    reason = str(rep.longrepr[2])
    if item.path.name.endswith("_cuda.py") or _GPU_SKIP.search(reason):
        rep.longrepr = (__file__, _GPU_SKIP_LINE, "GPU tests: no CUDA GPU on this machine")
