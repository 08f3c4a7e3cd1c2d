"""GPU tests of the 128-row kernels: query groups of a multiple of 128 queries (token lists, D 64
and 128) run 128 rows per CTA on two wgmma warpgroups that share the key tiles (the forward, and
the backward's query-major pass with dK / dV reductions: warpgroup 0 forms dV_t, warpgroup 1
dK_t over all 128 rows, one reduction per key and 128 rows; csrc/cuda/sparse_attention_fwd.cu,
sparse_attention_bwd_wg.cuh). They run by default on an H100 / H200 (the kernel tuning's g128 =
1, with wgmma); g128 = 0 runs two CTAs of 64 rows per 128, as other GPUs do.

Against the float64 reference under the tolerance rule of tests/helpers.py (check_attention)
for every list the op accepts: duplicates (they count twice), -1 padding and out-of-range
entries, counts 0, 1, kmax, past kmax and negative, G = 128 and 256 with a partial last group
(one warpgroup, or a whole second CTA, past the end), D 64 and 128, bf16 and fp16. The 128-row
and 64-row kernels against each other (a child process per tuning, g128 = 1 and 0): within
twice the reference bound, NaN reaching exactly the same elements, and not bit-identical in dK /
dV where wgmma runs (the 128-row kernel sums the rows in another order: evidence that it ran).
The backward's kernel serves the heads of the query-major path; test_backward_path of
tests/test_sparse_attention_cuda.py runs test_g128_matches_reference on every path (key-major,
key ranges, mma.sync).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import CUDA_GTOL, CUDA_TOL, attn_bwd, attn_backend, attn_fwd, check_attention
from helpers import check_close, counts_for, index_lists, make_inputs, ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def need_backend():
    if attn_backend() is None:
        pytest.skip("no CUDA kernels: build the extension with CUDA or set DSV_ATTN_LIB")


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


KINDS = ["random", "smooth", "duplicates", "padded", "invalid", "clamped"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_g128_matches_reference(kind, D, dtype, gen):
    """Every list kind against the float64 reference (forward and backward): G = 128, S = 2 x 128 + 77 (3 groups, the last partial: one warpgroup
    of its CTA has rows past the end), H = 5 with counts kmax, 0, 1 and 64, kmax = 150 (several
    key tiles of 32 and 64)."""
    need_backend()
    B, S, H, G, kmax = 2, 2 * 128 + 77, 5, 128, 150
    idx, cnt = g128_lists(B, H, S, G, kmax, gen, kind)
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    check_attention(q, k, v, idx, cnt, G, 0.125, gen=gen)


@pytest.mark.parametrize("kind", ["random", "padded", "duplicates"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_g256_matches_reference(kind, D, dtype, gen):
    """G = 256 (two CTAs of 128 rows per group): S = 256 + 150 (the last group's second CTA
    has 22 rows, its second warpgroup none) and 256 + 40 (the second CTA of the last group
    has no rows at all)."""
    need_backend()
    for S in (256 + 150, 256 + 40):
        B, H, G, kmax = 1, 4, 256, 130
        idx, cnt = g128_lists(B, H, S, G, kmax, gen, kind)
        q, k, v = make_inputs(B, S, H, D, dtype, gen)
        check_attention(q, k, v, idx, cnt, G, 0.125, gen=gen)


@pytest.mark.parametrize("S", [100, 128, 129, 191, 192, 255, 256, 3 * 128 + 64])
def test_g128_row_counts(S, gen):
    """One group (S < 128: the group is clamped to S and the shipped kernels run), one exact
    group, a group and one row, a partial second warpgroup, two groups, more: against the
    reference with lists of several key tiles."""
    need_backend()
    B, H, D, G = 1, 2, 128, 128
    kmax = min(S, 140)
    idx, cnt = ref.random_index(B, H, S, G, kmax, generator=gen, pad="random")
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    check_attention(q, k, v, idx, cnt, G, 0.1, gen=gen)


# The 128-row and the 64-row kernels on the same inputs, each in a child process (the kernel
# tuning is read once per process): the larger-shape agreement cases and the NaN cases.
_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["DSV_ROOT"], "tests"))
import test_group128_cuda as T
torch.save(T.child_results(sys.argv[2] if len(sys.argv) > 2 else None), sys.argv[1])
"""

NAN_CASES = ["q_nan_wg0", "q_nan_wg1", "dout_nan", "k_nan", "v_nan"]


def _agree_case(dtype):
    """Lists of 600 keys, smooth and random heads, some counts 0: the larger shape."""
    gen = torch.Generator().manual_seed(11)
    B, S, H, D, G, kmax = 1, 128 * 13 + 50, 4, 128, 128, 600
    idx, cnt = index_lists(B, H, S, G, kmax, gen, kind="smooth",
                           counts=counts_for(B, H, kmax, gen, zero=True))
    idx[:, 2:] = index_lists(B, H - 2, S, G, kmax, gen, kind="random",
                             counts=cnt[:, 2:].clone())[0]
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
    return q, k, v, dout, idx, cnt, G, 0.09


def _nan_case(where):
    """Whole groups (S a multiple of 128, so that no rows past the end take part) with one NaN:
    in a query row of either warpgroup, a dout row, or a K / V row of a listed key."""
    gen = torch.Generator().manual_seed(12)
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
    return q, k, v, dout, idx, cnt, G, 0.1


def _run(case, base=None):
    """out, lse of the forward; dq, dk, dv of the backward on the forward's out and lse, or on
    those of `base` (another run's results of the same case), so that two runs' backwards see
    the same inputs."""
    q, k, v, dout, idx, cnt, G, scale = case
    idx, cnt = idx.cuda(), cnt.cuda()
    out, lse = attn_fwd(q, k, v, idx, cnt, G, scale)
    bo, bl = (out, lse) if base is None else (base[0].cuda(), base[1].cuda())
    dq, dk, dv = attn_bwd(dout, q, k, v, bo, bl, idx, cnt, G, scale)
    torch.cuda.synchronize()
    return [t.cpu() for t in (out, lse, dq, dk, dv)]


def child_results(base_file=None):
    """{case: [out, lse, dq, dk, dv]} under this process's kernel tuning; with base_file (a
    file of another child's results) its backwards run on that file's out and lse."""
    base = torch.load(base_file) if base_file else {}
    cases = {f"agree_{dt}": _agree_case(dt) for dt in (torch.bfloat16, torch.float16)}
    cases.update({w: _nan_case(w) for w in NAN_CASES})
    res = {name: _run(case, base.get(name)) for name, case in cases.items()}
    import dsv_ext.ops
    res["tuning"] = dsv_ext.ops.kernel_tuning() if dsv_ext.ops.has_cuda_kernels() else {}
    return res


# two kernels against each other: each within CUDA_TOL of the exact result, so twice that apart
TOL2 = {dt: tuple(2 * t for t in CUDA_TOL[dt]) for dt in CUDA_TOL}
GTOL2 = {dt: tuple(2 * t for t in CUDA_GTOL[dt]) for dt in CUDA_GTOL}


def _same_nan_then_close(name, got, want, tol):
    """The same NaN elements; the rest (rows without NaN) within tol of each other."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN pattern differs"
    fin = ~torch.isnan(want).any(-1)
    check_close(name, got[fin], want[fin], tol)


def test_g128_agrees_with_64_row_kernels(tmp_path):
    """g128 = 1 (128 rows per CTA) against g128 = 0 (two CTAs of 64): forward within twice the
    reference bound (TOL2), the same -inf lse rows; the backward within twice the gradient bound
    (GTOL2); NaN in q (either warpgroup's rows), dout, K or V reaches exactly the elements it
    reaches on the 64-row kernels, and a NaN query or dout row of group 1 leaves the other
    groups' dq finite. Where wgmma runs (the 128-row kernels' condition), dK / dV of the larger
    case are not bit-identical between the two (the 128-row kernel sums rows in its own order)."""
    need_backend()
    if os.environ.get("DSV_TEST_PATH"):
        pytest.skip("inside a path run")
    res = {}
    for g128 in (0, 1):  # g128 = 1's backwards on g128 = 0's forward results
        f = tmp_path / f"g128_{g128}.pt"
        spec = ",".join(x for x in (os.environ.get("DSV_KERNEL_TUNING", ""), f"g128={g128}") if x)
        env = dict(os.environ, DSV_KERNEL_TUNING=spec, DSV_ROOT=ROOT)
        args = [str(f)] + ([str(tmp_path / "g128_0.pt")] if g128 else [])
        r = subprocess.run([sys.executable, "-c", _CHILD, *args], env=env, capture_output=True,
                           text=True, timeout=900, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        res[g128] = torch.load(f)
    assert res[1]["tuning"].get("g128", 1) == 1 and res[0]["tuning"].get("g128", 0) == 0
    wgmma = res[1]["tuning"].get("wgmma", 0) == 1
    for dt in (torch.bfloat16, torch.float16):
        (o1, l1, *g1), (o0, l0, *g0) = res[1][f"agree_{dt}"], res[0][f"agree_{dt}"]
        check_close(f"out ({dt}, g128 vs 64 rows)", o1, o0.double(), TOL2[dt])
        assert torch.equal(torch.isinf(l1), torch.isinf(l0))
        fin = torch.isfinite(l0)
        assert (l1[fin] - l0[fin]).abs().max().item() <= 2e-3
        for name, a, b in zip(("dq", "dk", "dv"), g1, g0):
            check_close(f"{name} ({dt}, g128 vs 64 rows)", a, b.double(), GTOL2[dt])
        if wgmma:
            assert not torch.equal(g1[1], g0[1]) and not torch.equal(g1[2], g0[2]), \
                "dK / dV bit-identical: the 128-row backward kernel did not run"
    for where in NAN_CASES:
        (o1, l1, *g1), (o0, l0, *g0) = res[1][where], res[0][where]
        if where != "dout_nan":
            assert torch.isnan(o0).any(), "the case must put a NaN somewhere"
        _same_nan_then_close(f"out ({where})", o1, o0, TOL2[torch.bfloat16])
        assert torch.equal(torch.isnan(l1), torch.isnan(l0))
        if where.startswith("q_nan"):
            row = 128 + 10 if where == "q_nan_wg0" else 128 + 64 + 3
            assert torch.isnan(o1[0, :, 0]).any(-1).nonzero().flatten().tolist() == [row]
        assert any(torch.isnan(w).any() for w in g0), "the case must put a NaN somewhere"
        for name, a, b in zip(("dq", "dk", "dv"), g1, g0):
            _same_nan_then_close(f"{name} ({where})", a, b, GTOL2[torch.bfloat16])
        if where in ("q_nan_wg1", "dout_nan"):
            # the NaN row's group is group 1: the other groups' dq rows stay finite
            assert torch.isfinite(g1[0][0, :128]).all() and torch.isfinite(g1[0][0, 256:]).all()
