"""GPU tests of the sampled-threshold top-K variant (csrc/dev/topk_sampled.cu) against the shipped
kernel, all called through one library (DSV_TOPK_VARIANT_LIB, built by
benchmarks/device_topk_variant.sh): its dsv_topk_estimate_cuda is the variant,
dsv_dev_topk_estimate_fold_cuda the variant with the collect pass folded into the compaction and
dsv_dev_topk_estimate_shipped_cuda the shipped kernel.

All compute bit-identical fp32 scores and select exactly, so their lists must be equal entry
for entry (no tolerance), on random inputs and on the inputs that push the variant off its usual
path: all scores tied, a few distinct key rows (runs of equal scores wider than the collect
pass), NaN and +-inf scores, sampled key rows scaled up or down (the sample misleads: the band
pass falls back), a score pattern of period 16, K = 0 / 1 / S - 1 / S / above S, kmax above K,
partial last groups, strided and unaligned layouts, every rank padding (16, 48 with fp16: the
block-at-a-time loops, 64). Random cases are also checked against float64 scores
(helpers.check_topk). The CPU emulation of the selection rule is tests/test_topk_sampled_rule.py.
Skipped without a GPU or without DSV_TOPK_VARIANT_LIB.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from helpers import DT, Bshd, LowrankShape, bshd, check_topk, lowrank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHIPPED = "dsv_dev_topk_estimate_shipped_cuda"
VARIANTS = ("dsv_topk_estimate_cuda", "dsv_dev_topk_estimate_fold_cuda")
ENTRIES = VARIANTS + (SHIPPED,)
_LIB = {}


def variant_lib():
    """The variant library (DSV_TOPK_VARIANT_LIB) with its entry points bound; skips if unset."""
    path = os.environ.get("DSV_TOPK_VARIANT_LIB")
    if not path:
        pytest.skip("DSV_TOPK_VARIANT_LIB not set (benchmarks/device_topk_variant.sh builds it)")
    if path not in _LIB:
        lib = ctypes.CDLL(path)
        for name in ENTRIES:
            f = getattr(lib, name)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.POINTER(LowrankShape), Bshd, Bshd, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _LIB[path] = lib
    return _LIB[path]


def run_entry(lib, name, q, k, cnt, G, kmax, out=None, poison=True):
    """kv_index [B, H, NG, kmax] from entry `name` (outputs poisoned with -777 first)."""
    B, S, H, r = q.shape
    NG = -(-S // G)
    if out is None:
        out = torch.empty((B, H, NG, kmax), dtype=torch.int32, device="cuda")
    if poison:
        out.fill_(-777)
    p = LowrankShape(B, S, H, r, G, NG, kmax, DT[q.dtype])
    ws = torch.empty(16, dtype=torch.uint8, device="cuda")
    st = getattr(lib, name)(ctypes.byref(p), bshd(q), bshd(k), ctypes.c_void_p(cnt.data_ptr()),
                            ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(ws.data_ptr()), 0,
                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert st == 0, f"{name}: status {st}"
    if poison:
        torch.cuda.synchronize()
    return out


def sample_rows(S):
    """The variant's sampled key positions (dsv_tks_sample_key)."""
    i = torch.arange(-(-S // 16), dtype=torch.int64)
    return torch.clamp(i * 16 + (((i * 0x9E3779B1) & 0xFFFFFFFF) >> 28), max=S - 1)


def shape_pattern(q, k, pattern, gen):
    """Turn random inputs into one of the adversarial score distributions (in place)."""
    S = k.shape[1]
    if pattern == "random":
        return
    if pattern == "tied":  # every key row equal: every score of a group equal
        k[:] = k[:, :1]
    elif pattern == "few":  # 6 distinct key rows: runs of thousands of equal scores
        pick = torch.randint(0, 6, (S,), generator=gen).cuda()
        k[:] = k[:, pick]
    elif pattern == "nan_inf":
        rows = torch.randperm(S, generator=gen)[:S // 8].cuda()
        k[:, rows[: S // 32]] = float("nan")
        k[:, rows[S // 32: S // 16], :, 0] = float("inf")
        k[:, rows[S // 16:], :, 0] = float("-inf")
        q[:, :64] = float("nan")  # the first group's representative: NaN scores only
    elif pattern in ("sample_up", "sample_down"):
        k[:, sample_rows(S).cuda()] *= 8.0 if pattern == "sample_up" else 0.125
    elif pattern == "periodic":
        k[:, torch.arange(0, S, 16).cuda()] *= 4.0
    else:
        raise ValueError(pattern)


def compare(q, k, cnt, G, kmax, check=False):
    lib = variant_lib()
    ref = run_entry(lib, SHIPPED, q, k, cnt, G, kmax)
    for name in VARIANTS:
        var = run_entry(lib, name, q, k, cnt, G, kmax)
        assert (var != -777).all(), f"{name} left entries unwritten"
        diff = (var != ref).nonzero()
        assert diff.numel() == 0, (f"{name}: {diff.shape[0]} entries differ from the shipped "
                                   f"kernel's, first at {diff[0].tolist()}")
        if check:
            check_topk(var, q, k, cnt, G, kmax)


# (B, S, H, r, G, dtype, layout, fracs of S per head, kmax factor)
RANDOM = [
    (1, 4100, 2, 16, 64, torch.bfloat16, "contiguous", [0.1, 0.2], 1.0),   # sampled, partial group
    (1, 16384, 2, 16, 64, torch.bfloat16, "contiguous", [0.05, 0.1], 1.0),
    (1, 65536, 1, 16, 64, torch.bfloat16, "contiguous", [0.1], 1.0),       # the target length
    (2, 9000, 2, 40, 32, torch.float16, "bhsd", [0.1, 0.3], 1.2),          # RP 48 fp16, strided
    (1, 6000, 2, 64, 64, torch.float16, "padded", [0.05, 0.5], 1.0),       # RP 64, unaligned rows
    (1, 5000, 1, 8, 128, torch.bfloat16, "padded", [0.02], 2.0),           # kmax > K: padding
    (1, 3000, 2, 16, 64, torch.bfloat16, "contiguous", [0.1, 0.01], 1.0),  # no sample (S < 4096)
    (1, 250, 1, 16, 64, torch.float16, "contiguous", [0.3], 1.0),          # collect at once
]


def _id(c):
    B, S, H, r, G, dt, layout, fr, km = c
    return f"B{B}_S{S}_r{r}_G{G}_{str(dt)[6:]}_{layout}_k{fr[0]}"


def _counts(S, fracs, B):
    return torch.tensor([[max(1, int(f * S)) for f in fracs]] * B, dtype=torch.int32)


@pytest.mark.parametrize("case", RANDOM, ids=_id)
def test_random_matches_shipped(case, gen):
    B, S, H, r, G, dt, layout, fracs, km = case
    q, k = lowrank(B, S, H, r, dt, gen, layout, "cuda")
    cnt = _counts(S, fracs, B)
    kmax = int(cnt.max() * km)
    compare(q, k, cnt.cuda(), G, kmax, check=S <= 20000)


@pytest.mark.parametrize("pattern", ["tied", "few", "nan_inf", "sample_up", "sample_down",
                                     "periodic"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_adversarial_matches_shipped(pattern, dt, gen):
    S, H, r, G = 12000, 2, 16, 64
    q, k = lowrank(1, S, H, r, dt, gen, "contiguous", "cuda")
    shape_pattern(q, k, pattern, gen)
    for fracs in ([0.1, 0.2], [0.001, 0.5]):
        cnt = _counts(S, fracs, 1)
        compare(q, k, cnt.cuda(), G, int(cnt.max()))


def test_edge_counts_match_shipped(gen):
    """K = 0, 1, S - 1, S and above S (clamped) in one call, kmax = S + 8."""
    S, H, r, G = 5000, 5, 16, 64
    q, k = lowrank(1, S, H, r, torch.bfloat16, gen, "contiguous", "cuda")
    cnt = torch.tensor([[0, 1, S - 1, S, S + 100]], dtype=torch.int32, device="cuda")
    compare(q, k, cnt, G, S + 8)
    # the variants clamp like the shipped kernel: K = S gives every position, then -1
    for name in VARIANTS:
        var = run_entry(variant_lib(), name, q, k, cnt, G, S + 8)
        assert torch.equal(var[0, 3, :, :S].cpu(), torch.arange(S, dtype=torch.int32).expand(
            var.shape[2], S))
        assert (var[0, 0] == -1).all() and (var[0, 3, :, S:] == -1).all()
