"""GPU tests of the G = 32 pair kernels (csrc/dev/attn_fwd_pairs.cu: two groups per wgmma
warpgroup over the merged union of their lists, each warp masking the other group's keys; the
forward, and the backward's query-major pass with dK / dV reduced once per key of the union).

Runs when DSV_ATTN_LIB names a library built from that file (benchmarks/device_variant.sh builds
one; it also runs tests/test_sparse_attention*.py against it), else skips. The union changes
which keys share a tile and so the summation order, nothing else: out and lse must meet the
float64 reference under the tolerance rule of tests/helpers.py (check_attention: forward and
backward, both through the library's C API, which runs the pairs) for every list the op accepts: sorted and unsorted,
overlapping and disjoint pairs, duplicates (they count twice, per group), -1 and out-of-range
entries, counts past kmax or negative, an odd number of groups and a partial last group. NaN
stays in the rows (and gradients) that it reaches on the shipped kernels (a NaN in V of a key
only the partner group lists must not reach a row through P = 0, a NaN query row must not reach
the partner group's keys through dS = 0). The backward's pair kernel runs on heads of the
query-major path: benchmarks/device_variant.sh also runs this file with
DSV_KERNEL_TUNING=km_ratio=0 (every head there) and with bwd_ranges=3 (key ranges). Every call fills the
workspace with 0xA5 first; that the pair path ran (and did not fall through to the shipped one)
is checked by its writes there.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from helpers import CUDA_GTOL, CUDA_TOL, DT, AttnShape, bshd, check_attention, check_close, get_lib
from helpers import index_lists, make_inputs, ref, variant_entry_points

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_lib = get_lib("DSV_ATTN_LIB")
_eps = variant_entry_points(_lib, "pairs")
_HAS = _eps is not None
if _HAS:
    _f, _fb = _eps


def need_pairs():
    if not _HAS:
        pytest.skip("DSV_ATTN_LIB is not the csrc/dev/attn_fwd_pairs.cu library")


def _is_h100_class():
    """Where the pairs run: wgmma (a 9.0 device) not switched off by the kernel tuning."""
    return (torch.cuda.get_device_capability() == (9, 0) and
            "wgmma=0" not in os.environ.get("DSV_KERNEL_TUNING", ""))


def fwd(q, k, v, idx, cnt, G, scale, pairs=1, ws_bytes=None):
    """(out, lse, pair_path_ran) of the dev entry; outputs poisoned with NaN, the workspace
    with 0xA5."""
    B, S, H, D = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float32, device=q.device)
    sh = AttnShape(B, S, H, D, G, idx.shape[2], idx.shape[3], float(scale), DT[q.dtype], 0, 1)
    need = _lib.dsv_sparse_attention_fwd_workspace_cuda(ctypes.byref(sh))
    n = need if ws_bytes is None else ws_bytes
    work = torch.full((max(need, 16),), 0xA5, dtype=torch.uint8, device=q.device)
    st = _f(pairs, ctypes.byref(sh), bshd(q), bshd(k), bshd(v), idx.data_ptr(), cnt.data_ptr(),
            bshd(out), lse.data_ptr(), work.data_ptr(), n, torch.cuda.current_stream().cuda_stream)
    assert st == 0, f"dsv_dev_sparse_attention_fwd_pairs_cuda returned {st}"
    torch.cuda.synchronize()
    return out, lse, bool((work != 0xA5).any())


def bwd(dout, q, k, v, out, lse, idx, cnt, G, scale, pairs=1):
    """(dq, dk, dv) of the dev entry; outputs poisoned with NaN, the workspace too."""
    B, S, H, D = q.shape
    dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(3))
    sh = AttnShape(B, S, H, D, G, idx.shape[2], idx.shape[3], float(scale), DT[q.dtype], 0, 1)
    ws = _lib.dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh))
    work = torch.full((max(ws, 16) // 4 + 1,), float("nan"), dtype=torch.float32, device=q.device)
    st = _fb(pairs, ctypes.byref(sh), bshd(q), bshd(k), bshd(v), bshd(out), bshd(dout),
             lse.data_ptr(), idx.data_ptr(), cnt.data_ptr(), bshd(dq), bshd(dk), bshd(dv),
             work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    assert st == 0, f"dsv_dev_sparse_attention_bwd_pairs_cuda returned {st}"
    torch.cuda.synchronize()
    return dq, dk, dv


def pair_lists(B, H, S, kmax, gen, kind):
    """(kv_index, kv_count) at G = 32 of one kind (see test_pairs_match_reference)."""
    G = 32
    cnt = torch.randint(1, kmax + 1, (B, H), generator=gen).to(torch.int32)
    cnt.view(-1)[0] = kmax
    if cnt.numel() > 1:
        cnt.view(-1)[1] = 0
    if kind in ("random", "smooth", "duplicates", "padded"):
        return index_lists(B, H, S, G, kmax, gen, kind=kind, counts=cnt)
    idx, cnt = ref.random_index(B, H, S, G, kmax, counts=cnt, generator=gen, pad="random")
    NG = idx.shape[2]
    if kind == "unsorted":  # the same keys in a random order per list
        for b in range(B):
            for h in range(H):
                c = int(cnt[b, h])
                for g in range(NG):
                    idx[b, h, g, :c] = idx[b, h, g, torch.randperm(c, generator=gen)]
    elif kind == "overlap":  # the odd group of a pair takes its partner's list, a quarter replaced
        for b in range(B):
            for h in range(H):
                c = int(cnt[b, h])
                for g in range(1, NG, 2):
                    keys = idx[b, h, g - 1, :c].clone()
                    sel = torch.rand(c, generator=gen) < 0.25
                    keys[sel] = torch.randint(0, S, (int(sel.sum()),), generator=gen,
                                              dtype=torch.int32)
                    idx[b, h, g, :c] = keys.sort().values  # may hold repeats: they count twice
    elif kind == "invalid":  # -1, S, 2^30 and negative entries inside the counted part
        bad = torch.tensor([-1, S, 1 << 30, -7, 0x7fffffff], dtype=torch.int32)
        pos = torch.rand(idx.shape, generator=gen) < 0.2
        idx[pos] = bad[torch.randint(0, len(bad), (int(pos.sum()),), generator=gen)]
    elif kind == "clamped":  # counts past kmax (clamped to it) and negative (none)
        cnt = cnt.clone()
        cnt.view(-1)[0] = kmax + 100
        if cnt.numel() > 2:
            cnt.view(-1)[2] = -3
    else:
        raise ValueError(kind)
    return idx, cnt


# two kernels against each other: each within CUDA_TOL of the exact result, so twice that apart
PAIR_TOL = tuple(2 * t for t in CUDA_TOL[torch.bfloat16])

KINDS = ["random", "unsorted", "overlap", "smooth", "duplicates", "padded", "invalid", "clamped"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pairs_match_reference(kind, D, dtype, gen):
    """Every list kind against the float64 reference (forward and the shipped backward on the
    variant's lse): S = 5 x 32 + 13 gives 6 groups, the last partial (3 pairs), H = 3 with a
    head of count 0."""
    need_pairs()
    B, S, H, G, kmax = 2, 5 * 32 + 13, 3, 32, 70
    idx, cnt = pair_lists(B, H, S, kmax, gen, kind)
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    check_attention(q, k, v, idx, cnt, G, 0.125, gen=gen)
    if _is_h100_class():
        _, _, ran = fwd(q, k, v, idx.cuda(), cnt.cuda(), G, 0.125)
        assert ran, "the pair path did not run"


@pytest.mark.parametrize("S", [32, 33, 63, 64, 65, 97, 2 * 32 * 7])
def test_pairs_group_counts(S, gen):
    """One group, one and a partial group, exact pairs, an odd group count: against the reference
    with lists longer than one key tile."""
    need_pairs()
    B, H, D, G = 1, 2, 128, 32
    kmax = min(S, 80)
    idx, cnt = ref.random_index(B, H, S, G, kmax, generator=gen, pad="random")
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    check_attention(q, k, v, idx, cnt, G, 0.1, gen=gen, grads=False)


def test_pairs_agree_with_shipped(gen):
    """The pair path and the shipped forward (pairs = 0) at a larger shape with overlapping
    lists: within twice the reference bound of each other (PAIR_TOL), the same -inf
    lse rows; a workspace too small falls through to the shipped forward bit for bit."""
    need_pairs()
    B, S, H, D, G, kmax = 1, 32 * 41 + 5, 4, 128, 32, 600
    idx, cnt = pair_lists(B, H, S, kmax, gen, "overlap")
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    idx, cnt = idx.cuda(), cnt.cuda()
    o1, l1, ran = fwd(q, k, v, idx, cnt, G, 0.09, pairs=1)
    o0, l0, _ = fwd(q, k, v, idx, cnt, G, 0.09, pairs=0)
    if _is_h100_class():
        assert ran
    check_close("out (pairs vs shipped)", o1, o0, PAIR_TOL)
    assert torch.equal(torch.isinf(l1), torch.isinf(l0))
    fin = torch.isfinite(l0)
    assert (l1[fin] - l0[fin]).abs().max().item() <= 2e-3
    o2, l2, ran2 = fwd(q, k, v, idx, cnt, G, 0.09, pairs=1, ws_bytes=0)
    assert not ran2 and torch.equal(o2, o0) and torch.equal(l2, l0)


@pytest.mark.parametrize("where", ["v_nan_b_only", "k_inf_a_only", "q_nan", "v_nan_shared"])
def test_pairs_nan_stays_in_its_rows(where, gen):
    """A non-finite input reaches exactly the rows it reaches on the shipped forward: a NaN in V
    of a key only group 1 lists (or +inf in K of a key only group 0 lists) leaves the partner
    group finite; a NaN query row only itself; a NaN in V of a shared key both groups."""
    need_pairs()
    B, S, H, D, G, kmax = 1, 256, 1, 128, 32, 40
    idx, cnt = ref.random_index(B, H, S, G, kmax, counts=kmax, generator=gen)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    a = set(idx[0, 0, 0].tolist())
    bl = set(idx[0, 0, 1].tolist())
    only_b = sorted(bl - a)
    only_a = sorted(a - bl)
    shared = sorted(a & bl)
    if where == "v_nan_b_only":
        v[0, only_b[0], 0, 3] = float("nan")
    elif where == "k_inf_a_only":
        k[0, only_a[0], 0, 3] = float("inf")
    elif where == "q_nan":
        q[0, 40, 0, 7] = float("nan")
    else:
        if not shared:  # give the pair a shared key
            idx[0, 0, 1, 0] = idx[0, 0, 0, 0]
            idx[0, 0, 1] = idx[0, 0, 1].sort().values
            shared = [int(idx[0, 0, 0, 0])]
        v[0, shared[0], 0, 3] = float("nan")
    idx, cnt = idx.cuda(), cnt.cuda()
    o1, l1, _ = fwd(q, k, v, idx, cnt, G, 0.1, pairs=1)
    o0, l0, _ = fwd(q, k, v, idx, cnt, G, 0.1, pairs=0)
    n1, n0 = torch.isnan(o1).any(-1), torch.isnan(o0).any(-1)
    assert n0.any(), "the case must put a NaN somewhere"
    assert torch.equal(n1, n0), "NaN rows differ from the shipped forward"
    assert torch.equal(torch.isnan(l1), torch.isnan(l0))
    fin = ~n0[0, :, 0]
    check_close("out (finite rows)", o1[0, fin], o0[0, fin], PAIR_TOL)
    if where == "v_nan_b_only":
        assert torch.isfinite(o1[0, :32]).all() and torch.isnan(o1[0, 32:64]).any(-1).all()
    if where == "k_inf_a_only":
        assert torch.isfinite(o1[0, 32:64]).all()
    if where == "q_nan":
        assert n1[0, :, 0].nonzero().flatten().tolist() == [40]


def _same_nan_then_close(name, got, want, tol):
    """The same NaN elements; the rest (rows without NaN) within tol of each other."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN pattern differs"
    fin = ~torch.isnan(want).any(-1)
    check_close(name, got[fin], want[fin], tol)


@pytest.mark.parametrize("where", ["none", "q_nan", "dout_nan", "k_nan_b_only", "v_nan_b_only"])
def test_pairs_backward_agrees_with_shipped(where, gen):
    """The backward with pairs against the shipped one (pairs = 0) on the same forward results,
    with overlapping lists: finite inputs within twice the reference bound of each other; a
    non-finite input gives exactly the shipped NaN elements in dq, dk and dv (a NaN query or
    dout row of group 1 must not reach the keys only group 0 lists, a NaN in K or V of a key
    only group 1 lists must not reach group 0's dq)."""
    need_pairs()
    B, S, H, D, G, kmax = 1, 32 * 9 + 7, 2, 128, 32, 60
    idx, cnt = pair_lists(B, H, S, kmax, gen, "overlap")
    cnt[:] = kmax
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    a, bl = set(idx[0, 0, 0].tolist()), set(idx[0, 0, 1].tolist())
    only_b = sorted(bl - a)
    if where == "q_nan":
        q[0, 40, 0, 5] = float("nan")
    elif where == "dout_nan":
        dout[0, 45, 0, 9] = float("nan")
    elif where == "k_nan_b_only":
        k[0, only_b[0], 0, 2] = float("nan")
    elif where == "v_nan_b_only":
        v[0, only_b[0], 0, 2] = float("nan")
    idx, cnt = idx.cuda(), cnt.cuda()
    out, lse, _ = fwd(q, k, v, idx, cnt, G, 0.1, pairs=0)
    got = bwd(dout, q, k, v, out, lse, idx, cnt, G, 0.1, pairs=1)
    want = bwd(dout, q, k, v, out, lse, idx, cnt, G, 0.1, pairs=0)
    if where != "none":
        assert any(torch.isnan(w).any() for w in want), "the case must put a NaN somewhere"
    tol = tuple(2 * t for t in CUDA_GTOL[torch.bfloat16])
    for name, g_, w_ in zip(("dq", "dk", "dv"), got, want):
        _same_nan_then_close(name, g_, w_, tol)
