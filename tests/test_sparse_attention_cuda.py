"""GPU tests of properties that only the CUDA sparse grouped attention kernels have: every
backward path (query-major / key-major dK and dV, mma.sync / wgmma, key ranges), coherent 64-key
blocks, NaN propagation, the deterministic mode, the paths' agreement with each other and with
the CPU kernels. The checks every device shares (shapes, sequence lengths, densities, list
kinds, strides, group sizes, scales, empty and invalid lists) are the device-parametrized tests
of tests/test_sparse_attention.py; test_backward_path runs their CUDA cases on every path.

Skipped without a GPU. The kernels are reached through torch.ops.dsv (the built extension) or,
when the environment variable DSV_ATTN_LIB names a shared library built from
csrc/cuda/sparse_attention_*.cu and tuning.cu alone (benchmarks/device_run.sh builds one; the
csrc/dev/ attention variant libraries export the same functions), through ctypes
(tests/helpers.py), so the kernels can be checked before the whole extension builds.

Reference: dense masked softmax in float64 (dsv_ext/reference.py), with key multiplicity,
out-of-range entries skipped and counts clamped exactly as csrc/dsv.h specifies. Tolerances:
run_and_check applies the rule of tests/helpers.py (at most twice PyTorch's own bf16 / fp16
error) and the derived elementwise bounds CUDA_TOL / CUDA_GTOL (there: why).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import CUDA_GTOL as GTOL
from helpers import CUDA_TOL as TOL
from helpers import DT, AttnShape, Bshd, KernelError, attn_bwd, attn_fwd, bshd, check_close
from helpers import attn_backend as backend
from helpers import (check_lse, check_public_attention, counts_for, get_lib, grad_targets, have_ops,
                     index_lists, make_inputs, ref, run_and_check)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the names benchmarks/bench_kernels.py, tests/sanitizer_driver.py and other test files take
# from this module (the ctypes access lives in tests/helpers.py)
_Bshd, _AttnShape, _DT, _bshd = Bshd, AttnShape, DT, bshd
_have_ops = have_ops


def _get_lib():
    """The DSV_ATTN_LIB library (bound), or None."""
    return get_lib("DSV_ATTN_LIB")


_lib = _get_lib()


def need_backend():
    if backend() is None:
        pytest.skip("no CUDA kernels: build the extension with CUDA or set DSV_ATTN_LIB")


# The backward's paths, each forced by a DSV_KERNEL_TUNING setting. The kernel tuning is read
# once per process, so test_backward_path runs the tests that take the `path` fixture in a child
# process per setting; in this process they run with the automatic choices ("auto").
PATHS = {
    "qmajor": "km_ratio=0,bwd_ranges=1",      # query-major dK / dV (G >= 64, D 64 / 128,
                                              # H100 / H200: the wgmma kernels' line reductions,
                                              # PERF_LOG v34)
    "qmajor_qmma": "km_ratio=0,bwd_ranges=1,qm_wgmma=0",  # the same with the 64-row pass on
                                              # mma.sync (dQ-only and 128-row passes on wgmma)
    "qmajor3": "km_ratio=0,bwd_ranges=3",     # the same split into 3 key ranges
    "qmajor_a4": "km_ratio=0,bwd_rmax=4",     # the automatic per-head ranges, at most 4 (scattered
                                              # lists 4, coherent 2: what long sequences get)
    "qmajor_l2": "km_ratio=0,l2_bytes=65536",  # the automatic rule from a small L2: its most
                                              # ranges (8; G = 64 at D = 128 reaches it a size
                                              # earlier, PERF_LOG v37) at the tests' lengths
    "kmajor": "km_ratio=1e9,bwd_ranges=1",    # key-major wherever allowed (dQ and dK / dV passes
                                              # on wgmma where they apply: D 64 / 128, G >= 64,
                                              # H100 / H200; km_wgmma=1, the default, PERF_LOG v14)
    "kmajor_kmma": "km_ratio=1e9,bwd_ranges=1,km_wgmma=0",  # the same with the key-major dK / dV
                                              # pass on mma.sync (dQ still on wgmma)
    "kmajor_mma": "km_ratio=1e9,wgmma=0",     # the same on mma.sync only (forward included)
    "qmajor_mma": "km_ratio=0,wgmma=0",       # query-major on mma.sync only
    "merge": "km_ratio=0,bwd_ranges=1,merge=1",   # groups of 16 / 32 / 64 queries merged
                                              # per 128-query block wherever their lists allow
                                              # it (sorted, finite inputs; D 64 / 128, H100 /
                                              # H200), scattered or not (PERF_LOG v26 / v27)
    "merge3": "km_ratio=0,bwd_ranges=3,merge=1",  # the same with 3 key ranges
    "merge_w": "km_ratio=0,bwd_ranges=1,merge=1,merge_window=64",  # the same with the union
                                              # builder's bitmaps in windows of 64 keys (several
                                              # windows at these lengths, as S > 80k at G = 32)
    "fwd256_mma": "wg256=0",                  # the forward at D 256 on the mma.sync kernel
                                              # (as on GPUs without wgmma; the default runs it
                                              # on wgmma, PERF_LOG v44), the backward's
                                              # automatic paths
}
# the tests of this file that take `path`, and the device-parametrized tests of
# test_sparse_attention.py (their CUDA cases) that run on every path
PATH_TESTS = "coherent_blocks or nan_reaches or deterministic_backward or merged_groups"
# and the row-count cases of the 128-row kernels (tests/test_group128_cuda.py)
GROUP128_PATH_TESTS = "g128_row_counts"
DEVICE_PATH_TESTS = ("matches_reference or list_kinds or strided_inputs or group_sizes or "
                     "kernel_guards")


@pytest.fixture
def path():
    """The backward path of this process: "auto", or the PATHS key of a test_backward_path child."""
    return os.environ.get("DSV_TEST_PATH", "auto")


def _path_run(name: str, jobs: int) -> subprocess.CompletedProcess:
    """The child process of test_backward_path for one path (see there); with `jobs` children at
    a time each gets its share of the CPU threads (the float64 references run on the CPU)."""
    env = dict(os.environ, DSV_KERNEL_TUNING=PATHS[name], DSV_TEST_PATH=name)
    if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    sel = (f"(test_sparse_attention_cuda and ({PATH_TESTS}))"
           f" or (not test_group128_cuda and cuda and ({DEVICE_PATH_TESTS}))"
           f" or (test_group128_cuda and ({GROUP128_PATH_TESTS}))")
    files = [os.path.abspath(__file__)] + [os.path.join(HERE, f) for f in
                                           ("test_sparse_attention.py", "test_group128_cuda.py")]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *files, "-k", sel], env=env, capture_output=True, text=True,
                          timeout=3000, cwd=ROOT)


@pytest.fixture(scope="module")
def path_runs(request):
    """The child runs of the test_backward_path cases this session selected, started together
    on the first one's request, DSV_TEST_PATH_JOBS (default 4) at a time: {path: Future}."""
    if os.environ.get("DSV_TEST_PATH") or backend() is None:
        yield {}
        return
    from concurrent.futures import ThreadPoolExecutor

    names = sorted({it.callspec.params["name"] for it in request.session.items
                    if getattr(it, "originalname", None) == "test_backward_path"})
    jobs = max(1, int(os.environ.get("DSV_TEST_PATH_JOBS", "4")))
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        yield {n: ex.submit(_path_run, n, jobs) for n in names}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_backward_path(name, path_runs):
    """The tests that take `path` (PATH_TESTS), the CUDA cases of the device-parametrized
    tests of test_sparse_attention.py (DEVICE_PATH_TESTS) and the row-count cases of the
    128-row kernels (GROUP128_PATH_TESTS), in a child process whose DSV_KERNEL_TUNING forces
    one backward path (the children of the selected paths run DSV_TEST_PATH_JOBS at a time)."""
    need_backend()
    if os.environ.get("DSV_TEST_PATH"):
        pytest.skip("inside a path run")
    r = path_runs[name].result() if name in path_runs else _path_run(name, 1)
    assert r.returncode == 0, f"path {name}:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert " passed" in r.stdout, r.stdout[-2000:]


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("G", [32, 64, 100])
def test_coherent_blocks(G, gen, path):
    """Lists made of whole runs of neighbouring keys (what smooth video features give): the
    key-major path sees full 64-key masks."""
    need_backend()
    B, S, H, D = 1, 777, 2, 128
    NG = -(-S // G)
    runs = 3
    kmax = runs * 64
    idx = torch.full((B, H, NG, kmax), -1, dtype=torch.int32)
    for h in range(H):
        for g in range(NG):
            # non-overlapping runs of 64 keys: aligned to the 64-key blocks for even heads,
            # shifted by a random offset for odd heads
            off = int(torch.randint(1, 64, (1,), generator=gen)) if h % 2 else 0
            starts = torch.randperm((S - 64 - off) // 64, generator=gen)[:runs].sort().values
            lst = torch.cat([torch.arange(s * 64 + off, s * 64 + off + 64) for s in starts.tolist()])
            idx[0, h, g] = lst.to(torch.int32)
    cnt = torch.full((B, H), kmax, dtype=torch.int32)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    run_and_check(q, k, v, idx, cnt, G, 1.0 / math.sqrt(D), gen)


_AGREE_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["DSV_ROOT"], "tests"))
import test_sparse_attention_cuda as T
gen = torch.Generator().manual_seed(7)
B, S, H, D, G, kmax = 1, 1000, 2, 128, 64, 256
kv_index, kv_count = T.ref.random_index(B, H, S, G, kmax, counts=kmax, generator=gen)
q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
kv_index, kv_count = kv_index.cuda(), kv_count.cuda()
out, lse = T.attn_fwd(q, k, v, kv_index, kv_count, G, 0.1)
dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
dq, dk, dv = T.attn_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G, 0.1)
torch.save([t.cpu() for t in (dq, dk, dv)], sys.argv[1])
"""


def test_paths_agree(tmp_path):
    """Key-major (dK/dV on wgmma or mma.sync) and query-major dK/dV (with 1 or 4 key ranges,
    mma.sync or wgmma dQ) agree with
    each other on the same inputs; each tuning in a child process."""
    need_backend()
    if os.environ.get("DSV_TEST_PATH"):
        pytest.skip("inside a path run")
    res = {}
    for key, tuning in (("q", "km_ratio=0,bwd_ranges=1"), ("q4", "km_ratio=0,bwd_ranges=4"),
                        ("k", "km_ratio=1e9,bwd_ranges=1"), ("kmma", "km_ratio=1e9,wgmma=0"),
                        ("kkm", "km_ratio=1e9,km_wgmma=0"), ("qmma", "km_ratio=0,wgmma=0")):
        f = tmp_path / f"{key}.pt"
        env = dict(os.environ, DSV_KERNEL_TUNING=tuning, DSV_ROOT=ROOT)
        r = subprocess.run([sys.executable, "-c", _AGREE_CHILD, str(f)], env=env,
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        res[key] = torch.load(f)
    for other in ("q4", "k", "kmma", "kkm", "qmma"):
        for a, b, name in zip(res[other], res["q"], ("dq", "dk", "dv")):
            check_close(f"{name} ({other} vs q)", a, b.double(), GTOL[torch.bfloat16])


@pytest.mark.parametrize("D,G", [(48, 64), (72, 64), (72, 128), (96, 64), (96, 128), (112, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_head_dims(D, G, dtype, gen):
    """Heads of sizes the kernels are not compiled for (48, 72, 112), and 96 where the wgmma
    kernels run, go through the public op zero-padded to the kernels' size (64 or 128; 96 on
    mma.sync without wgmma): out and dq, dk, dv against the float64 reference under the rule.
    The size rule and the padded path on the CPU: tests/test_padded_heads.py."""
    if not have_ops(cuda=True):
        pytest.skip("needs the built extension with CUDA kernels (the public op)")
    import dsv_ext.ops as ops
    wg = ops.kernel_tuning()["wgmma"] == 1
    want = 64 if D < 64 else (128 if wg or D > 96 else 96)
    assert ops._run_head_dim(torch.device("cuda", torch.cuda.current_device()), D) == want
    B, S, H = 2, 3 * G + 17, 3
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    KM = S // 3
    idx, cnt = index_lists(B, H, S, G, KM, gen, counts=counts_for(B, H, KM, gen, zero=True, one=True))
    check_public_attention(q, k, v, idx, cnt, G, gen)


def test_float32_unsupported():
    need_backend()
    q = torch.randn(1, 64, 1, 64, device="cuda")
    idx = torch.zeros(1, 1, 1, 4, dtype=torch.int32, device="cuda")
    cnt = torch.full((1, 1), 4, dtype=torch.int32, device="cuda")
    if backend() == "ctypes":
        with pytest.raises(KernelError, match="-2"):
            attn_fwd(q, q, q, idx, cnt, 64, 0.125)
    else:
        # the public function refuses before the kernel would (raw-op C++ errors are exercised in
        # child processes by tests/test_input_errors.py)
        import dsv_ext
        with pytest.raises(TypeError, match=r"^q: the CUDA kernels take bfloat16 or float16"):
            dsv_ext.sparse_attention(q, q, q, idx, cnt, 64)


def test_agrees_with_cpu_kernels(gen):
    need_backend()
    if not _have_ops():
        pytest.skip("needs the built extension for the CPU kernels")
    B, S, H, D, G, kmax = 1, 260, 2, 64, 64, 100
    kv_index, kv_count = ref.random_index(B, H, S, G, kmax, generator=gen)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    out, lse = attn_fwd(q, k, v, kv_index.cuda(), kv_count.cuda(), G, 0.125)
    out_c, lse_c = torch.ops.dsv.sparse_attention_fwd(q.cpu(), k.cpu(), v.cpu(), kv_index,
                                                      kv_count, G, 0.125)
    check_close("out vs cpu", out, out_c.double(), TOL[torch.bfloat16])
    check_lse(lse, lse_c)


def test_backward_nan_reaches_gradients(gen, path):
    """A NaN in one query row gives NaN in that row's dq and in dk / dv of the keys its group
    selected (as dense attention does), on every backward path (test_backward_path); other rows
    of dq stay finite."""
    need_backend()
    B, H, S, D, G, kmax = 1, 1, 256, 128, 64, 100
    kv_index, kv_count = ref.random_index(B, H, S, G, kmax, counts=kmax, generator=gen)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    q[0, 70, 0, 5] = float("nan")  # group 1
    kv_index, kv_count = kv_index.cuda(), kv_count.cuda()
    out, lse = attn_fwd(q, k, v, kv_index, kv_count, G, 0.1)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G, 0.1)
    torch.cuda.synchronize()
    assert torch.isnan(dq[0, 70, 0]).all()
    assert torch.isfinite(dq[0, :64]).all() and torch.isfinite(dq[0, 128:]).all()
    sel = kv_index[0, 0, 1, :kmax].long()
    sel = sel[sel >= 0].unique()
    assert torch.isnan(dk[0, sel, 0]).any(dim=-1).all()
    assert torch.isnan(dv[0, sel, 0]).any(dim=-1).all()


def _sorted_lists(B, H, S, G, kmax, gen, share=0.0, short=(), empty=()):
    """[B, H, NG, kmax] strictly ascending lists (what topk_estimate writes): each group's list
    keeps a `share` of its 128-query block's base list and draws the rest at random; groups in
    `short` hold fewer valid entries (trailing -1), groups in `empty` none."""
    NG = -(-S // G)
    M = max(1, 128 // G)
    idx = torch.full((B, H, NG, kmax), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                if g % M == 0:
                    base = torch.randperm(S, generator=gen)[:kmax]
                keep = base[torch.randperm(kmax, generator=gen)[:int(share * kmax)]]
                rest = torch.randperm(S, generator=gen)
                rest = rest[~torch.isin(rest, keep)][:kmax - keep.numel()]
                n = 0 if g in empty else kmax // 3 if g in short else kmax
                lst = torch.cat([keep, rest])[:n].sort().values
                idx[b, h, g, :n] = lst.to(torch.int32)
    return idx


@pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("G", [32, 64])
def test_backward_nan_reaches_only_its_groups(where, G, gen, path):
    """A NaN in one element of q, k, v or dout reaches exactly the gradients that attention over
    the lists reaches (NaN there, finite everywhere else), on every backward path: with merged
    groups (merge) a CTA's rows multiply masked zeros with other groups' rows and keys, so a
    head with a non-finite q, k or dout element must run its groups separately. The key with the
    NaN is in group 0's list only; groups 0 and 1 share a 128-query block."""
    need_backend()
    B, H, S, D, kmax = 1, 1, 256, 128, 96
    j, r = 200, 5  # the key (k, v) or the query row (q, dout) with the NaN; row 5 is in group 0
    idx = _sorted_lists(B, H, S, G, kmax, gen, share=0.8)
    lst0 = idx[0, 0, 0]
    if not (lst0 == j).any():
        lst0[0] = j
        idx[0, 0, 0] = lst0.sort().values
    for g in range(1, idx.shape[2]):  # j in group 0's list only
        lst = idx[0, 0, g]
        if (lst == j).any():
            lst[lst == j] = next(x for x in range(S) if x != j and not (lst == x).any())
            idx[0, 0, g] = lst.sort().values
    cnt = torch.full((B, H), kmax, dtype=torch.int32)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    bad = {"q": q, "k": k, "v": v, "dout": dout}[where]
    bad[0, r if where in ("q", "dout") else j, 0, 3] = float("nan")
    idx_c, cnt_c = idx.cuda(), cnt.cuda()
    out, lse = attn_fwd(q, k, v, idx_c, cnt_c, G, 0.1)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, idx_c, cnt_c, G, 0.1)
    torch.cuda.synchronize()
    # the rows that see the NaN, and the keys their groups selected
    groups = [0] if where in ("q", "dout") else [g for g in range(idx.shape[2])
                                                 if (idx[0, 0, g] == j).any()]
    rows = torch.zeros(S, dtype=torch.bool)
    if where in ("q", "dout"):
        rows[r] = True
    else:
        for g in groups:
            rows[g * G:(g + 1) * G] = True
    keys = torch.zeros(S, dtype=torch.bool)
    for g in groups:
        sel = idx[0, 0, g].long()
        keys[sel[sel >= 0]] = True
    nan_rows = torch.isnan(dq[0, :, 0].float()).any(dim=-1).cpu()
    assert torch.equal(nan_rows, rows), f"dq rows with NaN: {nan_rows.nonzero().flatten().tolist()}"
    # the key-major dK / dV pass works on whole 64-key blocks: a row with a NaN (in q or dout,
    # or in lse and delta through k and v) reaches the other keys of its group's blocks too
    # (masked zeros times the row)
    wide = keys.view(-1, 64).any(dim=1, keepdim=True).expand(-1, 64).reshape(-1)
    kmajor = path.startswith("kmajor")
    for name, grad, want in (("dk", dk, keys), ("dv", dv, keys if where != "v" else 0 * keys)):
        # (dv = P^T dO: a NaN in v reaches out and delta, not P or dO)
        nan = torch.isnan(grad[0, :, 0].float()).any(dim=-1).cpu()
        at = nan.nonzero().flatten().tolist()
        if kmajor:
            assert not (want & ~nan).any() and not (nan & ~wide).any(), f"{name} NaN at {at}"
        else:
            assert torch.equal(nan, want), f"{name} rows with NaN: {at}"


@pytest.mark.parametrize("share", [1.0, 0.7])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [16, 32, 64])
def test_merged_groups_match_reference(G, D, share, gen, path):
    """Groups of 16 / 32 / 64 queries whose 128-query blocks share most keys (what coherent video
    lists give), sorted as topk_estimate writes them: where merging applies (the tuning's merge,
    D 64 / 128 on an H100 / H200: the backward, and the forward at G 16 / 32; scattered lists
    too in the "merge" paths of test_backward_path) one 128-row CTA walks the union of a block's
    lists with each row masked to its group's keys. A partial last block and group, groups with
    fewer valid entries (trailing -1) or none (out 0, lse -inf beside groups that have keys),
    and heads with counts 0, 1, 37 and kmax."""
    need_backend()
    B, H, S, kmax = 2, 3, 3 * 128 + 45, 96
    idx = _sorted_lists(B, H, S, G, kmax, gen, share=share, short=(1, 5), empty=(2,))
    cnt = torch.tensor([[kmax, 37, 1], [0, kmax, kmax]], dtype=torch.int32)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16 if G != 32 else torch.float16, gen)
    run_and_check(q, k, v, idx, cnt, G, 1.0 / math.sqrt(D), gen)


_MERGED_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import dsv_ext
G, S, H, D, K = 32, 2048, 2, 128, 256
gen = torch.Generator().manual_seed(0)
# every group of a 128-query block lists the same keys, runs of 64 keys that straddle two
# 64-key blocks (coherent lists, not whole blocks: the query-major dK / dV path)
base = torch.stack([torch.randperm(S // 128, generator=gen)[:K // 64].sort().values
                    for _ in range(S // 128)])
lst = (base[:, :, None] * 128 + 32 + torch.arange(64)).reshape(S // 128, K)
idx = lst.repeat_interleave(128 // G, dim=0)[None, None].expand(1, H, -1, -1).contiguous()
idx = idx.to(torch.int32).cuda()
cnt = torch.full((1, H), K, dtype=torch.int32, device="cuda")
q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
names = [e.name for e in prof.events()]


def template_args(name):  # the top-level template arguments of a demangled kernel name
    name = name.split("(")[0]
    args, depth, cur = [], 0, ""
    for ch in name[name.index("<") + 1:name.rindex(">")]:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return args + [cur.strip()]


# UN (merged groups): template argument 7 of sparse_attn_fwd_wg_kernel<T, D, BN, NS, MINB, BLK,
# WG, UN>, 4 of bwd_wg128_kernel<T, Prm, D, NS, UN, NORED>
merged = lambda kern, i: any(kern + "<" in n and template_args(n)[i] == "true" for n in names)
print("MERGED", merged("sparse_attn_fwd_wg_kernel", 7), merged("bwd_wg128_kernel", 4),
      any("union_build_kernel" in n for n in names))
"""


@pytest.mark.parametrize("tuning,expect", [("", "True True True"),
                                           ("merge=0", "False False False")])
def test_merged_groups_run_by_default(tuning, expect):
    """With the default tuning, coherent lists of G = 32 (every group of a block lists the same
    keys) run their forward and backward on the merged 128-row kernels (merge 0.75); merge=0
    turns merging off. Seen through the profiler's kernel names, in a child process (the
    tuning is read once per process)."""
    need_backend()
    if not _have_ops():
        pytest.skip("needs the built extension (dsv_ext.sparse_attention)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the merged kernel runs on wgmma (compute capability 9.0)")
    env = dict(os.environ, DSV_KERNEL_TUNING=tuning)
    r = subprocess.run([sys.executable, "-c", _MERGED_CHILD, ROOT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"MERGED {expect}" in r.stdout, r.stdout[-2000:]


def test_deterministic_backward_repeats_bitwise(gen, path):
    """Deterministic mode at G = 64, D = 128 (the key-major path; its dQ pass on wgmma by default
    on an H100 / H200, on mma.sync in the "..._mma" path runs of test_backward_path): two
    backward runs give bit-identical gradients, which match the reference."""
    need_backend()
    if not _have_ops():
        pytest.skip("needs the built extension (dsv_ext.sparse_attention)")
    import dsv_ext
    B, H, S, D, G, kmax = 1, 2, 300, 128, 64, 150
    kv_index, kv_count = ref.random_index(B, H, S, G, kmax, counts=[[kmax, 97]], generator=gen)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    grads = []
    kv_index, kv_count = kv_index.cuda(), kv_count.cuda()
    scale = 1 / math.sqrt(D)
    for _ in range(2):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = dsv_ext.sparse_attention(qq, kk, vv, kv_index, kv_count, G, scale,
                                       deterministic=True)
        out.backward(dout)
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b, name in zip(grads[0], grads[1], ("dq", "dk", "dv")):
        assert torch.equal(a, b), f"{name}: deterministic runs differ"
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out_ref, lse_ref = ref.sparse_attention_lse_ref(qr, kr, vr, kv_index.cpu(), kv_count.cpu(), G,
                                                    scale)
    out_ref.backward(dout.double().cpu())
    targets = grad_targets(q, k, v, dout.cpu(), out.detach(), out_ref, lse_ref,
                           (qr.grad, kr.grad, vr.grad), kv_index, kv_count, G, scale,
                           torch.bfloat16)
    for g, (t, sl), name in zip(grads[0], targets, ("dq", "dk", "dv")):
        check_close(name, g, t, GTOL[torch.bfloat16], sl)
