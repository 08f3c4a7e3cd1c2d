"""The top-K estimation's paths on the GPU give the same lists, entry for entry: the sampled
threshold band (kernel tuning tk_sample = 1, the default) and the radix passes from the full key
range (tk_sample = 0), each with 16 and 8 query groups per warp (tk_gpw 16 / 8), clusters of two,
four and eight CTAs that split the keys (tk_split = 2 / 4 / 8), the band pass with and without
its histogram (tk_band 0 / 2: the histogram from the stored band keys, or a counting pass where
a buffer overflowed),
the compaction from the band pass's key masks (tk_compact = 1) and the default tuning (tk_gpw =
0: automatic). All compute bit-identical fp32 scores and select exactly, so no tolerance applies
between them; every list is also checked against float64 scores
(helpers.check_topk), outputs poisoned before each call.

Cases: every rank padding (r 8 / 16 / 32 / 40 / 48 / 64), both dtypes, strided and unaligned
layouts, group sizes that leave the last CTA partial, counts 0 / 1 / S - 1 / S / above S, kmax
above K, exact ties, S below and above the sampling threshold (4096) up to 64k, band buffers
wider than the list row or about as wide (the collect step from the buffer or the fallback to
the collect pass, PERF_LOG v23), and the inputs
that push the sampled path off its usual course: all scores tied, a few distinct key rows (runs of
equal scores wider than the collect pass), NaN and +-inf scores, the sampled key rows scaled up
or down (the sample misleads: the band pass falls back), a score pattern of period 16, one
64-key tile in eight scaled up (groups that take most of a tile's keys). The
selection rule itself is emulated on the CPU in tests/test_topk_select_rule.py. The tuning is
read once per process, so each setting runs in a child process. Skipped without a GPU or without
the built extension.
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

# (B, S, H, r, G, dtype, layout, counts per (b, h) or "ties", kmax - max(count), pattern)
CASES = [
    (1, 4096, 2, 16, 128, "bfloat16", "packed", [410, 4096], 0, None),
    (2, 900, 3, 16, 64, "bfloat16", "padded", [0, 1, 90, 300, 899, 900], 0, None),
    (1, 5000, 1, 32, 100, "float16", "packed", [777], 0, None),
    (1, 2600, 2, 48, 16, "bfloat16", "bhsd", [64, 1300], 0, None),
    (1, 3000, 1, 64, 128, "float16", "packed", [1500], 0, None),
    (1, 1000, 2, 16, 32, "bfloat16", "packed", "ties", 0, None),
    (1, 33, 1, 16, 1, "bfloat16", "packed", [5], 0, None),
    (1, 4100, 2, 16, 64, "bfloat16", "packed", [410, 820], 0, None),   # sampled, partial group
    (1, 16384, 2, 16, 64, "bfloat16", "packed", [819, 1638], 0, None),
    (1, 65536, 1, 16, 64, "bfloat16", "packed", [6553], 0, None),     # the target length
    # one 64-key tile in 8 scaled up: tiles of which a group takes more keys than the compaction
    # stages at once (TK_STAGE), written in several windows of the stage
    (1, 65536, 1, 16, 64, "bfloat16", "packed", [6553], 0, "runs"),
    (1, 65536, 1, 16, 128, "bfloat16", "packed", [35389], 0, None),   # G = 128, 54% of the keys
    (2, 9000, 2, 40, 32, "float16", "bhsd", [900, 2700] * 2, 500, None),  # RP 48 fp16, strided
    (1, 6000, 2, 64, 64, "float16", "padded", [300, 3000], 0, None),  # RP 64, unaligned rows
    (1, 5000, 1, 8, 128, "bfloat16", "padded", [100], 100, None),     # kmax > K: padding
    (1, 250, 1, 16, 64, "float16", "packed", [75], 0, None),          # collect at once
    (1, 5000, 5, 16, 64, "bfloat16", "packed", [0, 1, 4999, 5000, 5100], 8, None),  # edges
    # the band buffer in the list row: wider than the row (the collect pass under every tuning),
    # and about as wide as the row (some lane segments overflow, in one CTA of a cluster only)
    (1, 16384, 2, 16, 128, "bfloat16", "packed", [40, 60], 0, None),
    (1, 32768, 4, 16, 128, "bfloat16", "packed", [1150, 1200, 1250, 1300], 0, None),
] + [(1, 12000, 2, 16, 64, dt, "packed", fr, 0, pat)
     for pat in ("tied", "few", "nan_inf", "sample_up", "sample_down", "periodic")
     for dt in ("bfloat16", "float16")
     for fr in ([1200, 2400], [12, 6000])]

# (tuning spec, the tuning the kernels must report); the first is the reference
SETTINGS = [
    ("tk_sample=0,tk_gpw=16", {"tk_sample": 0, "tk_gpw": 16}),
    ("tk_sample=1,tk_gpw=16", {"tk_sample": 1, "tk_gpw": 16}),
    ("tk_sample=1,tk_gpw=8", {"tk_sample": 1, "tk_gpw": 8}),
    ("tk_sample=0,tk_gpw=8", {"tk_sample": 0, "tk_gpw": 8}),
    ("tk_split=2,tk_gpw=8", {"tk_sample": 1, "tk_gpw": 8, "tk_split": 2}),  # clusters of two
    ("tk_split=2,tk_gpw=16", {"tk_sample": 1, "tk_gpw": 16, "tk_split": 2}),
    ("tk_split=2,tk_sample=0", {"tk_sample": 0, "tk_gpw": 0, "tk_split": 2}),
    ("tk_split=1", {"tk_sample": 1, "tk_gpw": 0, "tk_split": 1}),  # one CTA per set of groups
    # clusters of four and eight (ranges of one tile or none where S is small)
    ("tk_split=4,tk_gpw=8", {"tk_sample": 1, "tk_gpw": 8, "tk_split": 4}),
    ("tk_split=4,tk_sample=0,tk_gpw=16", {"tk_sample": 0, "tk_gpw": 16, "tk_split": 4}),
    ("tk_split=8,tk_gpw=8", {"tk_sample": 1, "tk_gpw": 8, "tk_split": 8}),
    ("tk_split=8,tk_band=2,tk_gpw=16", {"tk_band": 2, "tk_gpw": 16, "tk_split": 8}),
    # the band pass: always counting; without its histogram wherever its keys are stored
    # (buffers that overflow take the counting pass after all), alone and in clusters
    ("tk_band=0", {"tk_sample": 1, "tk_band": 0}),
    ("tk_band=2,tk_gpw=16", {"tk_sample": 1, "tk_band": 2, "tk_gpw": 16}),
    ("tk_band=2,tk_split=2,tk_gpw=8", {"tk_band": 2, "tk_gpw": 8, "tk_split": 2}),
    # the compaction from the band pass's key masks (where its condition holds), also with
    # buffers that overflow (those CTAs rescore) and 8 groups per warp
    ("tk_compact=1,tk_split=1", {"tk_compact": 1, "tk_band": 1, "tk_split": 1}),
    ("tk_compact=1,tk_band=2,tk_split=1,tk_gpw=8", {"tk_compact": 1, "tk_band": 2, "tk_gpw": 8}),
    ("", {"tk_sample": 1, "tk_gpw": 0, "tk_split": 0, "tk_band": 1}),  # the defaults
]

_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["DSV_ROOT"], "tests"))
sys.path.insert(0, os.environ["DSV_ROOT"])
import dsv_ext
from helpers import topk_estimate
from test_topk_paths_cuda import CASES, case_inputs
out = {"tuning": dsv_ext.ops.kernel_tuning()}
for i, c in enumerate(CASES):
    q, k, cnt, G, kmax = case_inputs(i)
    out[i] = topk_estimate(q, k, cnt, G, kmax).cpu()
torch.save(out, sys.argv[1])
"""


def sample_rows(S):
    """The kernel's sampled key positions (dsv_tk_sample_key)."""
    i = torch.arange(-(-S // 16), dtype=torch.int64)
    return torch.clamp(i * 16 + (((i * 0x9E3779B1) & 0xFFFFFFFF) >> 28), max=S - 1)


def shape_pattern(q, k, pattern, gen):
    """Turn random inputs into one of the adversarial score distributions (in place)."""
    S = k.shape[1]
    if pattern == "tied":  # every key row equal: every score of a group equal
        k[:] = k[:, :1]
    elif pattern == "few":  # 6 distinct key rows: runs of thousands of equal scores
        k[:] = k[:, torch.randint(0, 6, (S,), generator=gen).cuda()]
    elif pattern == "nan_inf":
        rows = torch.randperm(S, generator=gen)[:S // 8].cuda()
        k[:, rows[: S // 32]] = float("nan")
        k[:, rows[S // 32: S // 16], :, 0] = float("inf")
        k[:, rows[S // 16:], :, 0] = float("-inf")
        q[:, :64] = float("nan")  # the first group's representative: NaN scores only
    elif pattern in ("sample_up", "sample_down"):
        k[:, sample_rows(S).cuda()] *= 8.0 if pattern == "sample_up" else 0.125
    elif pattern == "runs":  # every 8th 64-key tile's rows x4: most of the top-K in them
        tiles = torch.arange(S) // 64
        k[:, (tiles % 8 == 0).nonzero().flatten().cuda()] *= 4.0
    elif pattern == "periodic":
        k[:, torch.arange(0, S, 16).cuda()] *= 4.0
    else:
        raise ValueError(pattern)


def case_inputs(i):
    """q_lr, k_lr (CUDA), counts (CUDA int32 [B, H]), G, kmax of case i (fixed seed)."""
    B, S, H, r, G, dt, layout, counts, extra, pattern = CASES[i]
    gen = torch.Generator().manual_seed(1000 + i)
    dtype = getattr(torch, dt)
    if counts == "ties":  # small integers: exact scores with many ties (stable top-K)
        q = torch.randint(-2, 3, (B, S, H, r), generator=gen).to(dtype).cuda()
        k = torch.randint(-2, 3, (B, S, H, r), generator=gen).to(dtype).cuda()
        counts = [S // 7, S // 3]
    else:
        q, k = lowrank(B, S, H, r, dtype, gen, layout, "cuda")
    if pattern:
        shape_pattern(q, k, pattern, gen)
    cnt = torch.tensor(counts, dtype=torch.int32).view(B, H).cuda()
    return q, k, cnt, G, min(S, max(1, max(counts)) + extra)  # the op takes kmax <= S


def _run(tmp_path, spec, name):
    f = tmp_path / f"{name}.pt"
    spec = ",".join(x for x in (os.environ.get("DSV_KERNEL_TUNING", ""), spec) if x)
    env = dict(os.environ, DSV_KERNEL_TUNING=spec, DSV_ROOT=ROOT)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(f)], env=env, capture_output=True,
                       text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(f)


def test_paths_give_equal_lists(tmp_path):
    import dsv_ext  # registers torch.ops.dsv
    if not dsv_ext.has_cuda_kernels():
        pytest.skip("needs the built extension with its CUDA kernels")
    runs = []
    for n, (spec, want) in enumerate(SETTINGS):
        res = _run(tmp_path, spec, f"s{n}")
        got = {key: res["tuning"][key] for key in want}
        assert got == want, f"DSV_KERNEL_TUNING={spec!r}: the kernels report {got}"
        runs.append(res)
    ref = runs[0]
    for i, c in enumerate(CASES):
        q, k, cnt, G, kmax = case_inputs(i)
        exact = "stable" if c[7] == "ties" else None
        if c[9] != "nan_inf":  # NaN scores: equality with the reference path only
            check_topk(ref[i].cuda(), q, k, cnt, G, kmax, exact=exact)
        for (spec, _), res in zip(SETTINGS[1:], runs[1:]):
            diff = (res[i] != ref[i]).nonzero()
            assert diff.numel() == 0, (
                f"case {i} {c[:7]} {c[9]}: {spec or 'default tuning'}: {diff.shape[0]} entries "
                f"differ from {SETTINGS[0][0]}'s, first at {diff[0].tolist()}")


def test_bad_topk_tuning_is_refused(tmp_path):
    """tk_gpw other than 0 / 8 / 16, tk_sample other than 0 / 1, tk_split or tk_band other than
    0 / 1 / 2, tk_compact other than 0 / 1: the
    kernels refuse the tuning (a clear error, no launch)."""
    import dsv_ext
    if not dsv_ext.has_cuda_kernels():
        pytest.skip("needs the CUDA kernels")
    code = ("import torch, dsv_ext\n"
            "q = torch.randn(1, 64, 1, 16, device='cuda', dtype=torch.bfloat16)\n"
            "c = torch.tensor([[8]], dtype=torch.int32, device='cuda')\n"
            "torch.ops.dsv.topk_estimate(q, q, c, 16, 8)\n")
    for bad in ("tk_gpw=12", "tk_sample=2", "tk_split=3", "tk_split=16", "tk_band=3", "tk_compact=2"):
        env = dict(os.environ, DSV_KERNEL_TUNING=bad, DSV_ROOT=ROOT)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert r.returncode != 0 and "tuning" in r.stderr.lower(), (bad, r.stderr[-2000:])
