"""The top-K estimation with 8 query groups per warp (kernel tuning tk_gpw = 8: rows 0-7 of each
score tile, twice the warps) and the automatic choice (tk_gpw = 0) against 16 (the default): the
same lists, entry for entry, on every
rank padding (r 16 / 32 / 48 / 64), both dtypes, group sizes that leave the last CTA partial,
counts 0 / 1 / clamped / all keys, exact ties and padded rows, and each list checked against the
float64 scores (helpers.check_topk). The tuning is read once per process, so each setting runs
in a child process. Skipped without a GPU or without the built extension.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import check_topk, lowrank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (B, S, H, r, G, dtype, layout, counts per (b, h) or "ties"); kmax = max(count)
CASES = [
    (1, 4096, 2, 16, 128, "bfloat16", "packed", [410, 4096]),
    (2, 900, 3, 16, 64, "bfloat16", "padded", [0, 1, 90, 300, 899, 900]),
    (1, 5000, 1, 32, 100, "float16", "packed", [777]),
    (1, 2600, 2, 48, 16, "bfloat16", "bhsd", [64, 1300]),
    (1, 3000, 1, 64, 128, "float16", "packed", [1500]),
    (1, 1000, 2, 16, 32, "bfloat16", "packed", "ties"),
    (1, 33, 1, 16, 1, "bfloat16", "packed", [5]),
]

_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["DSV_ROOT"], "tests"))
sys.path.insert(0, os.environ["DSV_ROOT"])
import dsv_ext
from test_topk_gpw_cuda import CASES, case_inputs
out = {"tuning": dsv_ext.ops.kernel_tuning()}
for i, c in enumerate(CASES):
    q, k, cnt, G, kmax = case_inputs(c)
    out[i] = torch.ops.dsv.topk_estimate(q, k, cnt, G, kmax).cpu()
torch.save(out, sys.argv[1])
"""


def case_inputs(c):
    """q_lr, k_lr (CUDA), counts (CUDA int32 [B, H]), G, kmax of one case (fixed seed)."""
    B, S, H, r, G, dt, layout, counts = c
    gen = torch.Generator().manual_seed(1000 + S + r)
    dtype = getattr(torch, dt)
    if counts == "ties":  # small integers: exact scores with many ties (stable top-K)
        q = torch.randint(-2, 3, (B, S, H, r), generator=gen).to(dtype).cuda()
        k = torch.randint(-2, 3, (B, S, H, r), generator=gen).to(dtype).cuda()
        counts = [S // 7, S // 3]
    else:
        q, k = lowrank(B, S, H, r, dtype, gen, layout, "cuda")
    cnt = torch.tensor(counts, dtype=torch.int32).view(B, H).cuda()
    return q, k, cnt, G, max(1, max(counts))


def _run(tmp_path, gpw):
    f = tmp_path / f"gpw{gpw}.pt"
    spec = ",".join(x for x in (os.environ.get("DSV_KERNEL_TUNING", ""), f"tk_gpw={gpw}") if x)
    env = dict(os.environ, DSV_KERNEL_TUNING=spec, DSV_ROOT=ROOT)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(f)], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(f)


def test_gpw8_lists_equal_gpw16(tmp_path):
    import dsv_ext  # registers torch.ops.dsv
    if not dsv_ext.has_cuda_kernels():
        pytest.skip("needs the built extension with its CUDA kernels")
    r16, r8, r0 = _run(tmp_path, 16), _run(tmp_path, 8), _run(tmp_path, 0)
    assert r16["tuning"]["tk_gpw"] == 16 and r8["tuning"]["tk_gpw"] == 8 and r0["tuning"]["tk_gpw"] == 0
    for i, c in enumerate(CASES):
        q, k, cnt, G, kmax = case_inputs(c)
        assert torch.equal(r8[i], r16[i]), f"case {i} {c[:7]}: tk_gpw 8 and 16 lists differ"
        assert torch.equal(r0[i], r16[i]), f"case {i} {c[:7]}: tk_gpw 0 (automatic) lists differ"
        check_topk(r8[i].cuda(), q, k, cnt, G, kmax, exact="stable" if c[7] == "ties" else None)


def test_bad_tk_gpw_is_refused(tmp_path):
    """tk_gpw other than 8 / 16: the kernels refuse the tuning (a clear error, no launch)."""
    import dsv_ext
    if not dsv_ext.has_cuda_kernels():
        pytest.skip("needs the CUDA kernels")
    env = dict(os.environ, DSV_KERNEL_TUNING="tk_gpw=12", DSV_ROOT=ROOT)
    code = ("import torch, dsv_ext\n"
            "q = torch.randn(1, 64, 1, 16, device='cuda', dtype=torch.bfloat16)\n"
            "c = torch.tensor([[8]], dtype=torch.int32, device='cuda')\n"
            "torch.ops.dsv.topk_estimate(q, q, c, 16, 8)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode != 0 and "tuning" in r.stderr.lower(), r.stderr[-2000:]
