"""GPU tests of the CUDA sparse grouped attention kernels (forward and backward).

Skipped without a GPU. The kernels are reached through torch.ops.dsv (the built extension) or,
when the environment variable DSV_ATTN_LIB names a shared library built from
csrc/cuda/sparse_attention_*.cu and tuning.cu alone (benchmarks/device_run.sh builds one; the
csrc/dev/ attention variant libraries export the same functions), through
ctypes, so the kernels can be checked before the whole extension builds.

Reference: dense masked softmax in float64 (dsv_ext/reference.py, loaded by path), with key
multiplicity, out-of-range entries skipped and counts clamped exactly as csrc/dsv.h specifies.

Tolerances (elementwise |x - ref| <= atol * rms(ref) + rtol * |ref|, plus a relative Frobenius
norm bound): the kernels round P (and dS) to the input dtype before the tensor-core products
and round the outputs once, so the error is a few units of the dtype's epsilon (bf16 2^-8,
fp16 2^-11) of O(rms) values; gradients add one more rounded product (dS) and sums over many
groups (dK, dV), hence twice the allowance. lse is computed from exact products with fp32
accumulation: 1e-3 absolute.
"""
from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _load_reference():
    spec = importlib.util.spec_from_file_location(
        "dsv_reference_by_path", os.path.join(ROOT, "dsv_ext", "reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ref = _load_reference()

# --------------------------------------------------------------------------------------------
# access to the kernels: ctypes library (DSV_ATTN_LIB) or torch.ops.dsv


class _Bshd(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride_b", ctypes.c_int64),
                ("stride_s", ctypes.c_int64), ("stride_h", ctypes.c_int64)]


class _AttnShape(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("seqlen", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("num_groups", ctypes.c_int64), ("kmax", ctypes.c_int64),
                ("scale", ctypes.c_double), ("dtype", ctypes.c_int),
                ("flags", ctypes.c_int),  # dsv_attn_shape.flags (DSV_FLAG_DETERMINISTIC = 1)
                ("kv_block", ctypes.c_int64)]


_DT = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_lib = None


def _get_lib():
    global _lib
    if _lib is None:
        path = os.environ.get("DSV_ATTN_LIB")
        if not path:
            return None
        lib = ctypes.CDLL(path)
        for name in ("dsv_sparse_attention_fwd_workspace_cuda",
                     "dsv_sparse_attention_bwd_workspace_cuda"):
            getattr(lib, name).restype = ctypes.c_size_t
            getattr(lib, name).argtypes = [ctypes.POINTER(_AttnShape)]
        lib.dsv_sparse_attention_fwd_cuda.restype = ctypes.c_int
        lib.dsv_sparse_attention_fwd_cuda.argtypes = [
            ctypes.POINTER(_AttnShape), _Bshd, _Bshd, _Bshd, ctypes.c_void_p, ctypes.c_void_p,
            _Bshd, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.dsv_sparse_attention_bwd_cuda.restype = ctypes.c_int
        lib.dsv_sparse_attention_bwd_cuda.argtypes = [
            ctypes.POINTER(_AttnShape), _Bshd, _Bshd, _Bshd, _Bshd, _Bshd, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, _Bshd, _Bshd, _Bshd, ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_void_p]
        _lib = lib
    return _lib


def _have_ops():
    try:
        import dsv_ext  # noqa: F401
        return dsv_ext.has_cuda_kernels()
    except Exception:
        return False


def backend():
    if _get_lib() is not None:
        return "ctypes"
    if _have_ops():
        return "ops"
    return None


def _bshd(t):
    assert t.stride(3) == 1
    return _Bshd(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def _shape(q, kv_index, G, scale):
    B, S, H, D = q.shape
    return _AttnShape(B, S, H, D, G, kv_index.shape[2], kv_index.shape[3], scale, _DT[q.dtype], 0, 1)


def _nan_like_fill(shape, dtype, device):
    """Poison the caching allocator: a freed NaN block of this size is what the next
    allocation of the same size most likely gets."""
    t = torch.full(shape, float("nan"), dtype=dtype, device=device)
    del t


class KernelError(RuntimeError):
    pass


def attn_fwd(q, k, v, kv_index, kv_count, G, scale):
    """(out, lse) from the CUDA kernel; outputs poisoned with NaN before the call."""
    B, S, H, D = q.shape
    lib = _get_lib()
    if lib is None:
        _nan_like_fill((B, S, H, D), q.dtype, q.device)
        _nan_like_fill((B, H, S), torch.float32, q.device)
        return torch.ops.dsv.sparse_attention_fwd(q, k, v, kv_index, kv_count, G, scale)
    out = torch.full((B, S, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float32, device=q.device)
    sh = _shape(q, kv_index, G, scale)
    ws = lib.dsv_sparse_attention_fwd_workspace_cuda(ctypes.byref(sh))
    work = torch.empty(max(ws, 1), dtype=torch.uint8, device=q.device)
    st = lib.dsv_sparse_attention_fwd_cuda(
        ctypes.byref(sh), _bshd(q), _bshd(k), _bshd(v), kv_index.data_ptr(), kv_count.data_ptr(),
        _bshd(out), lse.data_ptr(), work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise KernelError(f"dsv_sparse_attention_fwd_cuda returned {st}")
    return out, lse


def attn_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G, scale):
    B, S, H, D = q.shape
    lib = _get_lib()
    if lib is None:
        for _ in range(3):
            _nan_like_fill((B, S, H, D), q.dtype, q.device)
        return torch.ops.dsv.sparse_attention_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G,
                                                  scale)
    dq, dk, dv = (torch.full((B, S, H, D), float("nan"), dtype=q.dtype, device=q.device)
                  for _ in range(3))
    sh = _shape(q, kv_index, G, scale)
    ws = lib.dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh))
    work = torch.full((max(ws, 16) // 4,), float("nan"), dtype=torch.float32, device=q.device)
    st = lib.dsv_sparse_attention_bwd_cuda(
        ctypes.byref(sh), _bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout), lse.data_ptr(),
        kv_index.data_ptr(), kv_count.data_ptr(), _bshd(dq), _bshd(dk), _bshd(dv),
        work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise KernelError(f"dsv_sparse_attention_bwd_cuda returned {st}")
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# helpers

TOL = {torch.bfloat16: (1.6e-2, 2e-2, 1e-2), torch.float16: (2e-3, 3e-3, 1.5e-3)}
GTOL = {torch.bfloat16: (3.2e-2, 4e-2, 2e-2), torch.float16: (4e-3, 6e-3, 3e-3)}


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("DSV_TEST_SEED", random.randrange(2**31)))
    print(f"[{request.node.name}] DSV_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def check_close(name, x, r, tol, slack=None):
    """Every element: |x - r| <= atol * rms(r) + rtol * |r| (+ slack, an elementwise rounding
    bound); and ||x - r|| / ||r|| <= nrm."""
    atol, rtol, nrm = tol
    x = x.double().cpu()
    r = r.double().cpu()
    assert torch.isfinite(x).all(), f"{name}: {int((~torch.isfinite(x)).sum())} non-finite elements"
    rms = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    err = (x - r).abs()
    bound = atol * max(rms, 1e-6) + rtol * r.abs()
    if slack is not None:
        bound = bound + slack.double().cpu()
    bad = err > bound
    if bad.any():
        w = int(torch.argmax(torch.where(bad, err, torch.zeros_like(err))))
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(w), x.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{x.numel()} elements out of tolerance, max err "
            f"{err.max().item():.3e}, rms(ref) {rms:.3e}; worst at {pos}: got "
            f"{x.reshape(-1)[w].item():.6g}, expected {r.reshape(-1)[w].item():.6g}")
    denom = r.norm().item()
    if denom > 0:
        rel = (x - r).norm().item() / denom
        assert rel <= nrm, f"{name}: relative error {rel:.3e} > {nrm}"


def check_lse(lse, lse_ref):
    lse = lse.double().cpu()
    lse_ref = lse_ref.double().cpu()
    inf_ref = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse) & (lse < 0), inf_ref), "lse: -inf pattern differs"
    fin = ~inf_ref
    assert torch.isfinite(lse[fin]).all(), "lse: non-finite values"
    if fin.any():
        err = (lse[fin] - lse_ref[fin]).abs().max().item()
        assert err <= 1e-3, f"lse: max error {err:.3e}"


def grad_targets(q, k, v, dout, out_kernel, out_ref, lse_ref, grads_ref, kv_index, kv_count, G,
                 scale, dtype):
    """Reference gradients for the kernel's definition, and elementwise rounding slack.

    Like FlashAttention, the kernel takes delta = rowsum(dout * out) from the output it is given
    (rounded to the input dtype), not from the exact output. The difference
    Delta_q = dout_q . (out_kernel - out_exact) is known here, so the float64 reference
    gradients are corrected by it exactly: dS = P (dP - delta) changes by -P Delta, hence
      dq -= scale * Delta_q * (P K)_q,   dk -= scale * (P Delta)^T Q.
    The slack bounds, to first order, what rounding P and dS to the input dtype for the tensor
    core products can change (u = 2 x the unit roundoff: 2^-8 bf16, 2^-10 fp16):
      dq: u |scale| |dS| |K|,  dk: u |scale| |dS|^T |Q|,  dv: u * P^T |dO|.
    Sums of many large dS terms that cancel make this exceed rtol * |ref| for a few elements; a
    wrong or missing contribution is far above it. dP - delta itself is formed from two fp32
    dot products of length D, off by up to gamma_D = D 2^-24 times |dO| (|V| + |O|); where the
    exact dS is 0 (a query with one key: P = 1 and dP = delta) this is all that is left, so it is
    added too (it is ~1e-6 of the terms, far below any real error)."""
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -10
    B, S, H, D = q.shape
    mult = ref._expand_groups(ref.key_multiplicity(kv_index.cpu(), kv_count.cpu(), S), S, G)
    qh, kh, vh, gh = (t.detach().double().cpu().permute(0, 2, 1, 3) for t in (q, k, v, dout))
    ok = out_kernel.detach().double().cpu().permute(0, 2, 1, 3)
    oe = out_ref.detach().double().cpu().permute(0, 2, 1, 3)
    logits = scale * qh @ kh.transpose(-1, -2)
    l = lse_ref.detach().double().cpu()[..., None]
    P = torch.where(mult > 0, mult * torch.exp(logits - torch.where(torch.isinf(l), 0.0, l)),
                    torch.zeros_like(logits))
    delta = (oe * gh).sum(-1, keepdim=True)
    dS = P * (gh @ vh.transpose(-1, -2) - delta)
    Dl = (gh * (ok - oe)).sum(-1, keepdim=True)
    bhsd = lambda t: t.permute(0, 2, 1, 3)  # noqa: E731
    gq, gk, gv = (g.detach().double().cpu() for g in grads_ref)
    tq = gq - bhsd(scale * Dl * (P @ kh))
    tk = gk - bhsd(scale * (P * Dl).transpose(-1, -2) @ qh)
    e_dp = D * 2.0 ** -24 * (gh.abs() @ vh.abs().transpose(-1, -2)
                             + (gh.abs() * ok.abs()).sum(-1, keepdim=True))
    e_ds = u * dS.abs() + P * e_dp
    sq = bhsd(abs(scale) * e_ds @ kh.abs())  # a bound: |scale| (scale may be negative)
    sk = bhsd(abs(scale) * e_ds.transpose(-1, -2) @ qh.abs())
    sv = bhsd(u * P.transpose(-1, -2) @ gh.abs())
    return (tq, sq), (tk, sk), (gv, sv)


def make_inputs(B, S, H, D, dtype, gen, layout="contiguous"):
    q, k, v = ref.make_qkv(B, S, H, D, dtype=dtype, layout=layout, generator=gen, device="cuda")
    return q, k, v


def run_and_check(q, k, v, kv_index, kv_count, G, scale, gen, grads=True):
    dtype = q.dtype
    kv_index = kv_index.cuda()
    kv_count = kv_count.cuda()
    out, lse = attn_fwd(q, k, v, kv_index, kv_count, G, scale)
    torch.cuda.synchronize()
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(grads) for t in (q, k, v))
    out_ref, lse_ref = ref.sparse_attention_lse_ref(qr, kr, vr, kv_index.cpu(), kv_count.cpu(), G,
                                                    scale)
    check_close("out", out, out_ref.detach(), TOL[dtype])
    check_lse(lse, lse_ref.detach())
    if not grads:
        return
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(dtype)
    out_ref.backward(dout.double())
    dq, dk, dv = attn_bwd(dout.cuda(), q, k, v, out, lse, kv_index, kv_count, G, scale)
    torch.cuda.synchronize()
    (tq, sq), (tk, sk), (tv, sv) = grad_targets(q, k, v, dout, out, out_ref, lse_ref,
                                                (qr.grad, kr.grad, vr.grad), kv_index,
                                                kv_count, G, scale, dtype)
    check_close("dq", dq, tq, GTOL[dtype], sq)
    check_close("dk", dk, tk, GTOL[dtype], sk)
    check_close("dv", dv, tv, GTOL[dtype], sv)


def need_backend():
    if backend() is None:
        pytest.skip("no CUDA kernels: build the extension with CUDA or set DSV_ATTN_LIB")


# The backward's paths, each forced by a DSV_KERNEL_TUNING setting. The kernel tuning is read
# once per process, so test_backward_path runs the tests that take the `path` fixture in a child
# process per setting; in this process they run with the automatic choices ("auto").
PATHS = {
    "qmajor": "km_ratio=0,bwd_ranges=1",      # query-major dK / dV (TMA bulk reductions)
    "qmajor3": "km_ratio=0,bwd_ranges=3",     # the same split into 3 key ranges
    "qmajor_a4": "km_ratio=0,bwd_rmax=4",     # the automatic per-head ranges, at most 4 (scattered
                                              # lists 4, coherent 2: what long sequences get)
    "kmajor": "km_ratio=1e9,bwd_ranges=1",    # key-major wherever allowed (dQ pass on wgmma where
                                              # it applies: D 64 / 128, G >= 64, H100 / H200)
    "kmajor_mma": "km_ratio=1e9,wgmma=0",     # the same on mma.sync only (forward included)
    "qmajor_mma": "km_ratio=0,wgmma=0",       # query-major on mma.sync only
}
PATH_TESTS = ("matches_reference or strided_inputs or coherent_blocks or padded_lists or "
              "bad_entries or large_group_sizes or nan_reaches or deterministic_backward")


@pytest.fixture
def path():
    """The backward path of this process: "auto", or the PATHS key of a test_backward_path child."""
    return os.environ.get("DSV_TEST_PATH", "auto")


@pytest.mark.parametrize("name", sorted(PATHS))
def test_backward_path(name):
    """The tests that take `path` (PATH_TESTS), in a child process whose DSV_KERNEL_TUNING forces
    one backward path."""
    need_backend()
    if os.environ.get("DSV_TEST_PATH"):
        pytest.skip("inside a path run")
    env = dict(os.environ, DSV_KERNEL_TUNING=PATHS[name], DSV_TEST_PATH=name)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", PATH_TESTS],
                       env=env, capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert r.returncode == 0, f"path {name}:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert " passed" in r.stdout, r.stdout[-2000:]


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_matches_reference(dtype, D, G, gen, path):
    need_backend()
    B, H = 2, 3
    S = 3 * G + 17  # partial last group
    kmax = min(S, 150)  # several key tiles, the last one partial
    counts = [[kmax, 0, 77], [1, 64, int(torch.randint(1, kmax + 1, (1,), generator=gen))]]
    kv_index, kv_count = ref.random_index(B, H, S, G, kmax, counts=counts, generator=gen,
                                          pad="random")
    q, k, v = make_inputs(B, S, H, D, dtype, gen)
    run_and_check(q, k, v, kv_index, kv_count, G, 1.0 / math.sqrt(D), gen)


@pytest.mark.parametrize("layout", ["packed", "packed_d", "bhsd"])
@pytest.mark.parametrize("D", [64, 128])
def test_strided_inputs(layout, D, gen, path):
    need_backend()
    B, S, H, G, kmax = 2, 300, 2, 64, 96
    kv_index, kv_count = ref.random_index(B, H, S, G, kmax, generator=gen)
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen, layout=layout)
    run_and_check(q, k, v, kv_index, kv_count, G, 0.7 / math.sqrt(D), gen)


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


def test_padded_lists(gen, path):
    """Lists shorter than the count, padded with trailing -1 (some groups all -1, as the query
    rows that dsv_ext.parallel's SCP pads): the kernels trim the padding (key-major heads
    included) and agree with the reference, which skips those entries."""
    need_backend()
    B, S, H, D, G, kmax = 1, 500, 3, 128, 64, 160
    kv_index, kv_count = ref.random_index(B, H, S, G, kmax, counts=kmax, generator=gen)
    NG = kv_index.shape[2]
    for h in range(H):
        for g in range(NG):
            keep = int(torch.randint(0, kmax + 1, (1,), generator=gen))
            if g == NG - 1 or (h == 1 and g % 2):
                keep = 0  # whole groups without keys
            kv_index[0, h, g, keep:] = -1
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    run_and_check(q, k, v, kv_index, kv_count, G, 1.0 / math.sqrt(D), gen)


def test_bad_entries_are_skipped(gen, path):
    """Unsorted lists, duplicates, entries outside [0, S), counts outside [0, Kmax]."""
    need_backend()
    B, S, H, D, G, kmax = 1, 200, 4, 64, 32, 80
    NG = -(-S // G)
    idx = torch.randint(-20, S + 20, (B, H, NG, kmax), generator=gen, dtype=torch.int64)
    idx[0, 1, :, 5] = idx[0, 1, :, 4]  # duplicates count twice
    kv_index = idx.to(torch.int32)
    kv_count = torch.tensor([[-3, kmax + 50, 40, 0]], dtype=torch.int32)
    q, k, v = make_inputs(B, S, H, D, torch.float16, gen)
    run_and_check(q, k, v, kv_index, kv_count, G, 1.0 / math.sqrt(D), gen)


def test_large_group_sizes_and_tiny_seq(gen, path):
    need_backend()
    for (S, G, kmax) in [(5, 32, 5), (130, 128, 130), (70, 17, 33)]:
        kv_index, kv_count = ref.random_index(1, 2, S, G, kmax, generator=gen)
        q, k, v = make_inputs(1, S, 2, 64, torch.bfloat16, gen)
        run_and_check(q, k, v, kv_index, kv_count, G, 0.125, gen)


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
    """Key-major and query-major dK/dV (with 1 or 4 key ranges, mma.sync or wgmma dQ) agree with
    each other on the same inputs; each tuning in a child process."""
    need_backend()
    if os.environ.get("DSV_TEST_PATH"):
        pytest.skip("inside a path run")
    res = {}
    for key, tuning in (("q", "km_ratio=0,bwd_ranges=1"), ("q4", "km_ratio=0,bwd_ranges=4"),
                        ("k", "km_ratio=1e9,bwd_ranges=1"), ("kmma", "km_ratio=1e9,wgmma=0"),
                        ("qmma", "km_ratio=0,wgmma=0")):
        f = tmp_path / f"{key}.pt"
        env = dict(os.environ, DSV_KERNEL_TUNING=tuning, DSV_ROOT=ROOT)
        r = subprocess.run([sys.executable, "-c", _AGREE_CHILD, str(f)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        res[key] = torch.load(f)
    for other in ("q4", "k", "kmma", "qmma"):
        for a, b, name in zip(res[other], res["q"], ("dq", "dk", "dv")):
            check_close(f"{name} ({other} vs q)", a, b.double(), GTOL[torch.bfloat16])


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


@pytest.mark.parametrize("scale", [-0.2, 0.0, 2.0])
def test_any_scale(scale, gen):
    """The forward keeps its running max on raw scores for a positive scale and on scaled ones
    for a negative scale; zero and large scales too, forward and backward, against the
    reference."""
    need_backend()
    B, H, G, D = 1, 2, 64, 64
    S = 2 * G + 9
    kv_index, kv_count = ref.random_index(B, H, S, G, 100, counts=[[100, 37]], generator=gen,
                                          pad="random")
    q, k, v = make_inputs(B, S, H, D, torch.bfloat16, gen)
    run_and_check(q, k, v, kv_index, kv_count, G, scale, gen)


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
