"""Shared pytest fixtures of the dsv-ext test suite (the op tests' references, tolerances,
poisoning and kernel access: tests/helpers.py).

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

# names that test files imported from here before tests/helpers.py held them
from helpers import GRAD_TOL, TOL, assert_close, poison  # noqa: F401


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("DSV_TEST_SEED", random.randrange(2**31)))
    print(f"[{request.node.name}] DSV_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


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


_NEEDS_GPU = re.compile(r"\bneeds\b.*\b(GPUs?|CUDA)\b")


def _needs_gpu(item) -> bool:
    """A test of the GPU: in a *_cuda.py file, marked cuda, skipped by a skipif whose reason says
    it needs a GPU / CUDA, or parametrized with a CUDA device."""
    if item.path.name.endswith("_cuda.py") or item.get_closest_marker("cuda"):
        return True
    for m in item.iter_markers("skipif"):
        if _NEEDS_GPU.search(str(m.kwargs.get("reason", ""))):
            return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(str(v).startswith("cuda") for v in params.values())


def pytest_collection_modifyitems(config, items):
    """Marks every GPU test `cuda`, so `pytest -m cuda` runs the GPU tests alone (the CPU ones
    run in CI anyway)."""
    for item in items:
        if _needs_gpu(item) and not item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.cuda)
