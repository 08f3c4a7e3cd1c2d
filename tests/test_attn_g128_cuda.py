"""GPU tests of the G = 128 variant (csrc/dev/attn_g128.cu: two wgmma warpgroups per CTA on the
same key tiles, rows 0-63 and 64-127 of a group; the forward shares one K / V pipeline, the
backward's query-major pass forms dV_t / dK_t over all 128 rows and reduces them once).

Runs when DSV_ATTN_LIB names a library built from that file (benchmarks/device_variant.sh builds
one; it also runs tests/test_sparse_attention_cuda.py against it), else skips. The variant
changes which rows share a CTA and the order of the dK / dV sums, nothing else: out, lse and the
gradients must meet the float64 reference under the tolerance rule of tests/helpers.py
(check_attention, through the library's C API, which runs the variant where it applies) for
every list the op accepts: duplicates (they count twice), -1 padding and out-of-range entries,
counts 0, 1, kmax, past kmax and negative, G = 128 and 256 with a partial last group, D 64 and
128, bf16 and fp16. NaN reaches exactly the elements it reaches on the shipped kernels. The
backward's kernel runs on heads of the query-major path: benchmarks/device_variant.sh also runs
this file with DSV_KERNEL_TUNING=km_ratio=0 (every head there) and with bwd_ranges=3 (key
ranges). That the variant ran (and did not fall through to the shipped kernels) is checked by
its launch counter (dsv_dev_g128_runs).
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from helpers import CUDA_GTOL, CUDA_TOL, DT, AttnShape, bshd, check_attention, check_close, get_lib
from helpers import counts_for, index_lists, make_inputs, ref, variant_entry_points

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_lib = get_lib("DSV_ATTN_LIB")
_eps = variant_entry_points(_lib, "g128")
_HAS = _eps is not None
if _HAS:
    _f, _fb = _eps
    _runs = _lib.dsv_dev_g128_runs
    _runs.restype = ctypes.c_longlong
    _runs.argtypes = [ctypes.c_int]


def need_g128():
    if not _HAS:
        pytest.skip("DSV_ATTN_LIB is not the csrc/dev/attn_g128.cu library")


def _is_h100_class():
    """Where the variant runs: wgmma (a 9.0 device) not switched off by the kernel tuning."""
    return (torch.cuda.get_device_capability() == (9, 0) and
            "wgmma=0" not in os.environ.get("DSV_KERNEL_TUNING", ""))


def _km_forced():
    """Whether the kernel tuning sends every head key-major (then the backward's query-major
    pass with reductions, the variant's kernel, has no head to run)."""
    return "km_ratio=3" in os.environ.get("DSV_KERNEL_TUNING", "")


def runs():
    """(forward, backward) launches of the variant so far."""
    return _runs(0), _runs(1)


def fwd(q, k, v, idx, cnt, G, scale, g128=1):
    """(out, lse, variant_ran) of the dev entry; outputs poisoned with NaN."""
    B, S, H, D = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float32, device=q.device)
    sh = AttnShape(B, S, H, D, G, idx.shape[2], idx.shape[3], float(scale), DT[q.dtype], 0, 1)
    work = torch.empty(16, dtype=torch.uint8, device=q.device)
    before = runs()[0]
    st = _f(g128, ctypes.byref(sh), bshd(q), bshd(k), bshd(v), idx.data_ptr(), cnt.data_ptr(),
            bshd(out), lse.data_ptr(), work.data_ptr(), 0, torch.cuda.current_stream().cuda_stream)
    assert st == 0, f"dsv_dev_sparse_attention_fwd_g128_cuda returned {st}"
    torch.cuda.synchronize()
    return out, lse, runs()[0] > before


def bwd(dout, q, k, v, out, lse, idx, cnt, G, scale, g128=1):
    """(dq, dk, dv, variant_ran) of the dev entry; outputs poisoned with NaN, the workspace
    too."""
    B, S, H, D = q.shape
    dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(3))
    sh = AttnShape(B, S, H, D, G, idx.shape[2], idx.shape[3], float(scale), DT[q.dtype], 0, 1)
    ws = _lib.dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh))
    work = torch.full((max(ws, 16) // 4 + 1,), float("nan"), dtype=torch.float32, device=q.device)
    before = runs()[1]
    st = _fb(g128, ctypes.byref(sh), bshd(q), bshd(k), bshd(v), bshd(out), bshd(dout),
             lse.data_ptr(), idx.data_ptr(), cnt.data_ptr(), bshd(dq), bshd(dk), bshd(dv),
             work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    assert st == 0, f"dsv_dev_sparse_attention_bwd_g128_cuda returned {st}"
    torch.cuda.synchronize()
    return dq, dk, dv, runs()[1] > before


def g128_lists(B, H, S, G, kmax, gen, kind):
    """(kv_index, kv_count) of one kind: those of helpers.index_lists (counts 0 on head 1, 1 on
    head 3 with H >= 4, kmax on head 0), "invalid" (-1, S, 2^30, negative and INT32_MAX entries
    inside the counted part) and "clamped" (counts past kmax and negative)."""
    cnt = counts_for(B, H, kmax, gen, zero=True, one=True)
    if kind in ("random", "smooth", "duplicates", "padded"):
        return index_lists(B, H, S, G, kmax, gen, kind=kind, counts=cnt)
    idx, cnt = ref.random_index(B, H, S, G, kmax, counts=cnt, generator=gen, pad="random")
    if kind == "invalid":
        bad = torch.tensor([-1, S, 1 << 30, -7, 0x7fffffff], dtype=torch.int32)
        pos = torch.rand(idx.shape, generator=gen) < 0.2
        idx[pos] = bad[torch.randint(0, len(bad), (int(pos.sum()),), generator=gen)]
    elif kind == "clamped":
        cnt = cnt.clone()
        cnt.view(-1)[0] = kmax + 100
        cnt.view(-1)[2] = -3
    else:
        raise ValueError(kind)
    return idx, cnt


# two kernels against each other: each within CUDA_TOL of the exact result, so twice that apart
TOL2 = {dt: tuple(2 * t for t in CUDA_TOL[dt]) for dt in CUDA_TOL}
GTOL2 = {dt: tuple(2 * t for t in CUDA_GTOL[dt]) for dt in CUDA_GTOL}

KINDS = ["random", "smooth", "duplicates", "padded", "invalid", "clamped"]


def _check_ran(q, k, v, idx, cnt, G, scale):
    """On an H100-class device: the variant's forward and backward kernels ran for this shape
    (the backward's unless every head was sent key-major)."""
    if not _is_h100_class():
        return
    idx, cnt = idx.cuda(), cnt.cuda()
    out, lse, ran = fwd(q, k, v, idx, cnt, G, 0.125)
    assert ran, "the variant's forward did not run"
    dout = torch.randn_like(q)
    *_, ran_b = bwd(dout, q, k, v, out, lse, idx, cnt, G, 0.125)
    assert ran_b or _km_forced(), "the variant's backward did not run"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_g128_matches_reference(kind, D, dtype, gen):
    """Every list kind against the float64 reference (forward and backward, both the variant
    through the C API): G = 128, S = 2 x 128 + 77 (3 groups, the last partial: one warpgroup
    of its CTA has rows past the end), H = 5 with counts kmax, 0, 1 and 64, kmax = 150 (several
    key tiles of 32 and 64)."""
    need_g128()
    B, S, H, G, kmax = 2, 2 * 128 + 77, 5, 128, 150
    idx, cnt = g128_lists(B, H, S, G, kmax, gen, kind)
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    check_attention(q, k, v, idx, cnt, G, 0.125, gen=gen)
    _check_ran(q, k, v, idx, cnt, G, 0.125)


@pytest.mark.parametrize("kind", ["random", "padded", "duplicates"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_g256_matches_reference(kind, D, dtype, gen):
    """G = 256 (two CTAs of 128 rows per group): S = 256 + 150 (the last group's second CTA
    has 22 rows, its second warpgroup none) and 256 + 40 (the second CTA of the last group
    has no rows at all)."""
    need_g128()
    for S in (256 + 150, 256 + 40):
        B, H, G, kmax = 1, 4, 256, 130
        idx, cnt = g128_lists(B, H, S, G, kmax, gen, kind)
        q, k, v = make_inputs(B, S, H, D, dtype, gen)
        check_attention(q, k, v, idx, cnt, G, 0.125, gen=gen)
        _check_ran(q, k, v, idx, cnt, G, 0.125)


@pytest.mark.parametrize("S", [100, 128, 129, 191, 192, 255, 256, 3 * 128 + 64])
def test_g128_row_counts(S, gen):
    """One group (S < 128: the group is clamped to S and the shipped kernels run), one exact
    group, a group and one row, a partial second warpgroup, two groups, more: against the
    reference with lists of several key tiles."""
    need_g128()
    B, H, D, G = 1, 2, 128, 128
    kmax = min(S, 140)
    idx, cnt = ref.random_index(B, H, S, G, kmax, generator=gen, pad="random")
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    check_attention(q, k, v, idx, cnt, G, 0.1, gen=gen)
    if S >= 128:
        _check_ran(q, k, v, idx, cnt, G, 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_g128_agrees_with_shipped(dtype, gen):
    """The variant and the shipped kernels (g128 = 0) at a larger shape (lists of 600 keys,
    smooth and random heads): forward within twice the reference bound of each other (TOL2),
    the same -inf lse rows; the backward on the same forward results within twice the gradient
    bound (GTOL2)."""
    need_g128()
    B, S, H, D, G, kmax = 1, 128 * 13 + 50, 4, 128, 128, 600
    idx, cnt = index_lists(B, H, S, G, kmax, gen, kind="smooth",
                           counts=counts_for(B, H, kmax, gen, zero=True))
    idx[:, 2:] = index_lists(B, H - 2, S, G, kmax, gen, kind="random",
                             counts=cnt[:, 2:].clone())[0]
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    idx, cnt = idx.cuda(), cnt.cuda()
    o1, l1, ran = fwd(q, k, v, idx, cnt, G, 0.09, g128=1)
    o0, l0, ran0 = fwd(q, k, v, idx, cnt, G, 0.09, g128=0)
    assert not ran0
    if _is_h100_class():
        assert ran
    check_close("out (g128 vs shipped)", o1, o0, TOL2[dtype])
    assert torch.equal(torch.isinf(l1), torch.isinf(l0))
    fin = torch.isfinite(l0)
    assert (l1[fin] - l0[fin]).abs().max().item() <= 2e-3
    dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
    *got, ran_b = bwd(dout, q, k, v, o0, l0, idx, cnt, G, 0.09, g128=1)
    *want, ran_b0 = bwd(dout, q, k, v, o0, l0, idx, cnt, G, 0.09, g128=0)
    assert not ran_b0
    if _is_h100_class():
        assert ran_b or _km_forced()
    for name, g_, w_ in zip(("dq", "dk", "dv"), got, want):
        check_close(f"{name} (g128 vs shipped)", g_, w_, GTOL2[dtype])


def _same_nan_then_close(name, got, want, tol):
    """The same NaN elements; the rest (rows without NaN) within tol of each other."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN pattern differs"
    fin = ~torch.isnan(want).any(-1)
    check_close(name, got[fin], want[fin], tol)


@pytest.mark.parametrize("where", ["q_nan_wg0", "q_nan_wg1", "dout_nan", "k_nan", "v_nan"])
def test_g128_nan_as_shipped(where, gen):
    """A NaN reaches exactly the elements it reaches on the shipped kernels: out / lse rows
    (a NaN query row of either warpgroup only itself; a NaN in K or V of a listed key the rows
    of the groups that list it) and dq / dk / dv (a NaN query or dout row reaches its own dq
    row and dK / dV of its group's keys, not the other rows' dq). Whole groups (S a multiple
    of 128), so that no rows past the end take part."""
    need_g128()
    B, S, H, D, G, kmax = 1, 3 * 128, 2, 128, 128, 90
    idx, cnt = ref.random_index(B, H, S, G, kmax, counts=kmax, generator=gen)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    key = int(idx[0, 0, 1, 5])
    if where == "q_nan_wg0":
        q[0, 128 + 10, 0, 7] = float("nan")
    elif where == "q_nan_wg1":
        q[0, 128 + 64 + 3, 0, 7] = float("nan")
    elif where == "dout_nan":
        dout[0, 128 + 70, 0, 9] = float("nan")
    elif where == "k_nan":
        k[0, key, 0, 2] = float("nan")
    else:
        v[0, key, 0, 2] = float("nan")
    idx, cnt = idx.cuda(), cnt.cuda()
    o1, l1, ran = fwd(q, k, v, idx, cnt, G, 0.1, g128=1)
    o0, l0, _ = fwd(q, k, v, idx, cnt, G, 0.1, g128=0)
    assert ran or not _is_h100_class(), "the variant's forward did not run"
    if where != "dout_nan":
        assert torch.isnan(o0).any(), "the case must put a NaN somewhere"
    _same_nan_then_close("out", o1, o0, TOL2[torch.bfloat16])
    assert torch.equal(torch.isnan(l1), torch.isnan(l0))
    if where.startswith("q_nan"):
        row = 128 + 10 if where == "q_nan_wg0" else 128 + 64 + 3
        assert torch.isnan(o1[0, :, 0]).any(-1).nonzero().flatten().tolist() == [row]
    *got, ran_b = bwd(dout, q, k, v, o0, l0, idx, cnt, G, 0.1, g128=1)
    assert ran_b or not _is_h100_class() or _km_forced(), "the variant's backward did not run"
    want = bwd(dout, q, k, v, o0, l0, idx, cnt, G, 0.1, g128=0)[:3]
    assert any(torch.isnan(w).any() for w in want), "the case must put a NaN somewhere"
    for name, g_, w_ in zip(("dq", "dk", "dv"), got, want):
        _same_nan_then_close(name, g_, w_, GTOL2[torch.bfloat16])
    if where in ("q_nan_wg1", "dout_nan"):
        # the NaN row's group is group 1: the other groups' dq rows stay finite
        assert torch.isfinite(got[0][0, :128]).all() and torch.isfinite(got[0][0, 256:]).all()
