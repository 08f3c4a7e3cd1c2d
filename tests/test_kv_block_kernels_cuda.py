"""GPU tests of the CUDA sparse attention kernels on block lists (dsv_attn_shape.kv_block 16, 64).

Skipped without a GPU. The kernels are reached through the C API with ctypes: the library that
DSV_ATTN_LIB names (benchmarks/device_run.sh builds one from csrc/cuda/), else the built
extension dsv_ext/_C.abi3.so, which exports the same functions.

With kv_block b, entry e of a list covers keys e b .. min(e b + b, S) - 1; entries outside
[0, ceil(S / b)) are skipped (the -1 padding among them), a block listed twice counts twice,
kv_count counts entries (blocks). Reference: the lists expanded to token lists (one entry per
key, -1 where a block is skipped or passes S), then the float64 dense masked softmax of
tests/test_sparse_attention_cuda.py (dsv_ext/reference.py) and its gradient targets.

Tolerances are those of tests/test_sparse_attention_cuda.py (TOL, GTOL, with the elementwise
rounding slack of grad_targets): the block kernels run the same arithmetic (P and dS rounded to
the input dtype before the tensor-core products, fp32 accumulation, outputs rounded once), only
the key tiles are loaded differently; lse within 1e-3. The backward of block lists is
deterministic whatever the flags: repeated runs must be bit-identical.
"""
from __future__ import annotations

import ctypes
import math
import os

import pytest
import torch

import test_sparse_attention_cuda as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ref = T.ref

DSV_ERR_INVALID = -1
DSV_ERR_UNSUPPORTED = -2
_lib = None


def _get_lib():
    """The C API by ctypes: DSV_ATTN_LIB, else the built extension; None without either."""
    global _lib
    if _lib is not None:
        return _lib
    lib = T._get_lib()
    if lib is None:
        path = os.path.join(ROOT, "dsv_ext", "_C.abi3.so")
        if not os.path.exists(path):
            return None
        try:
            lib = ctypes.CDLL(path)
            lib.dsv_sparse_attention_fwd_cuda  # noqa: B018 (a CPU-only build lacks it)
        except (OSError, AttributeError):
            return None
        for name in ("dsv_sparse_attention_fwd_workspace_cuda",
                     "dsv_sparse_attention_bwd_workspace_cuda"):
            getattr(lib, name).restype = ctypes.c_size_t
            getattr(lib, name).argtypes = [ctypes.POINTER(T._AttnShape)]
        lib.dsv_sparse_attention_fwd_cuda.restype = ctypes.c_int
        lib.dsv_sparse_attention_fwd_cuda.argtypes = [
            ctypes.POINTER(T._AttnShape), T._Bshd, T._Bshd, T._Bshd, ctypes.c_void_p,
            ctypes.c_void_p, T._Bshd, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.c_void_p]
        lib.dsv_sparse_attention_bwd_cuda.restype = ctypes.c_int
        lib.dsv_sparse_attention_bwd_cuda.argtypes = [
            ctypes.POINTER(T._AttnShape), T._Bshd, T._Bshd, T._Bshd, T._Bshd, T._Bshd,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, T._Bshd, T._Bshd, T._Bshd,
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _lib = lib
    return _lib


def need_lib():
    if _get_lib() is None:
        pytest.skip("no CUDA kernels: build the extension with CUDA or set DSV_ATTN_LIB")


class KernelError(RuntimeError):
    def __init__(self, fn, status):
        super().__init__(f"{fn} returned {status}")
        self.status = status


def _shape(q, kv_index, G, scale, blk, flags=0):
    B, S, H, D = q.shape
    return T._AttnShape(B, S, H, D, G, kv_index.shape[2], kv_index.shape[3], scale, T._DT[q.dtype],
                        flags, blk)


def blk_fwd(q, k, v, kv_index, kv_count, G, scale, blk):
    """(out, lse) of the CUDA forward on block lists; outputs poisoned with NaN before the call."""
    lib = _get_lib()
    B, S, H, D = q.shape
    out = torch.full((B, S, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float32, device=q.device)
    sh = _shape(q, kv_index, G, scale, blk)
    ws = lib.dsv_sparse_attention_fwd_workspace_cuda(ctypes.byref(sh))
    work = torch.full(((max(ws, 16) + 3) // 4,), float("nan"), dtype=torch.float32, device=q.device)
    st = lib.dsv_sparse_attention_fwd_cuda(
        ctypes.byref(sh), T._bshd(q), T._bshd(k), T._bshd(v), kv_index.data_ptr(),
        kv_count.data_ptr(), T._bshd(out), lse.data_ptr(), work.data_ptr(), ws,
        torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise KernelError("dsv_sparse_attention_fwd_cuda", st)
    return out, lse


def blk_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G, scale, blk, flags=0):
    """(dq, dk, dv) of the CUDA backward on block lists; outputs and workspace poisoned."""
    lib = _get_lib()
    B, S, H, D = q.shape
    dq, dk, dv = (torch.full((B, S, H, D), float("nan"), dtype=q.dtype, device=q.device)
                  for _ in range(3))
    sh = _shape(q, kv_index, G, scale, blk, flags)
    ws = lib.dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh))
    work = torch.full(((max(ws, 16) + 3) // 4,), float("nan"), dtype=torch.float32, device=q.device)
    st = lib.dsv_sparse_attention_bwd_cuda(
        ctypes.byref(sh), T._bshd(q), T._bshd(k), T._bshd(v), T._bshd(out), T._bshd(dout),
        lse.data_ptr(), kv_index.data_ptr(), kv_count.data_ptr(), T._bshd(dq), T._bshd(dk),
        T._bshd(dv), work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise KernelError("dsv_sparse_attention_bwd_cuda", st)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# lists


def expand_blocks(kv_index, kv_count, S, blk):
    """Token lists equivalent to block lists: entry j of a block list becomes entries
    j blk .. j blk + blk - 1, key e blk + o of block e, or -1 where e is outside
    [0, ceil(S / blk)) or the key passes S; counts times blk (after clamping to [0, kmax])."""
    B, H, NG, KM = kv_index.shape
    nblk = -(-S // blk)
    e = kv_index.to(torch.int64).cpu()
    keys = e[..., None] * blk + torch.arange(blk).view(1, 1, 1, 1, blk)
    ok = (e[..., None] >= 0) & (e[..., None] < nblk) & (keys < S)
    tok = torch.where(ok, keys, torch.full_like(keys, -1)).reshape(B, H, NG, KM * blk)
    cnt = kv_count.to(torch.int64).cpu().clamp(0, KM) * blk
    return tok.to(torch.int32), cnt.to(torch.int32)


def random_blocks(B, H, NG, kmax, nblk, counts, gen, pad=0.15, dup=True, bad=False):
    """Block lists [B, H, NG, kmax] and counts [B, H]: random blocks (duplicates when dup, else
    distinct and shuffled), a share `pad` of the entries -1; with bad, some entries out of range
    (ceil(S / blk) and beyond, below -1)."""
    idx = torch.empty(B, H, NG, kmax, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                if dup:
                    idx[b, h, g] = torch.randint(0, nblk, (kmax,), generator=gen)
                else:
                    perm = torch.randperm(max(nblk, kmax), generator=gen)[:kmax]
                    idx[b, h, g] = torch.where(perm < nblk, perm, torch.full_like(perm, -1))
    idx = torch.where(torch.rand(idx.shape, generator=gen) < pad, torch.full_like(idx, -1), idx)
    if bad:
        r = torch.rand(idx.shape, generator=gen)
        idx = torch.where(r < 0.05, nblk + torch.randint(0, 3, idx.shape, generator=gen), idx)
        idx = torch.where((r >= 0.05) & (r < 0.08), torch.full_like(idx, -7), idx)
    cnt = torch.tensor(counts, dtype=torch.int32).view(B, H)
    return idx.to(torch.int32), cnt


# --------------------------------------------------------------------------------------------
# checks


def run_and_check(q, k, v, kv_index, kv_count, G, scale, blk, gen, grads=True):
    """Forward (and backward) on block lists against the float64 reference of the expanded lists;
    returns the kernel's (out, lse, grads)."""
    dtype = q.dtype
    S = q.shape[1]
    idx_d, cnt_d = kv_index.cuda(), kv_count.cuda()
    out, lse = blk_fwd(q, k, v, idx_d, cnt_d, G, scale, blk)
    torch.cuda.synchronize()
    tok, tcnt = expand_blocks(kv_index, kv_count, S, blk)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(grads) for t in (q, k, v))
    out_ref, lse_ref = ref.sparse_attention_lse_ref(qr, kr, vr, tok, tcnt, G, scale)
    T.check_close("out", out, out_ref.detach(), T.TOL[dtype])
    T.check_lse(lse, lse_ref.detach())
    if not grads:
        return out, lse, None
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(dtype)
    out_ref.backward(dout.double())
    dq, dk, dv = blk_bwd(dout.cuda(), q, k, v, out, lse, idx_d, cnt_d, G, scale, blk)
    torch.cuda.synchronize()
    (tq, sq), (tk, sk), (tv, sv) = T.grad_targets(q, k, v, dout, out, out_ref, lse_ref,
                                                  (qr.grad, kr.grad, vr.grad), tok, tcnt, G,
                                                  scale, dtype)
    T.check_close("dq", dq, tq, T.GTOL[dtype], sq)
    T.check_close("dk", dk, tk, T.GTOL[dtype], sk)
    T.check_close("dv", dv, tv, T.GTOL[dtype], sv)
    return out, lse, (dq, dk, dv)


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("blk", [16, 64])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(dtype, D, G, blk, gen):
    """S = 300: a partial last group for every G and a partial last block (300 = 18 x 16 + 12 =
    4 x 64 + 44); random lists with duplicates and -1 padding; head counts kmax (not a multiple
    of the key tile) and 1."""
    need_lib()
    B, H, S = 1, 2, 300
    nblk = -(-S // blk)
    NG = -(-S // G)
    kmax = 7 if blk == 64 else 13
    q, k, v = T.make_inputs(B, S, H, D, dtype, gen)
    idx, cnt = random_blocks(B, H, NG, kmax, nblk, [[kmax, 1]], gen)
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)


@pytest.mark.parametrize("blk", [16, 64])
@pytest.mark.parametrize("D", [96, 256])
def test_other_head_dims(D, blk, gen):
    """D = 96 (forward and backward) and 256 (forward; the backward of block lists needs
    D <= 128 and says DSV_ERR_UNSUPPORTED)."""
    need_lib()
    B, H, S, G = 1, 2, 200, 64
    nblk = -(-S // blk)
    kmax = 5 if blk == 64 else 9
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    idx, cnt = random_blocks(B, H, -(-S // G), kmax, nblk, [[kmax, 3]], gen)
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen, grads=(D <= 128))
    if D > 128:
        out, lse = blk_fwd(q, k, v, idx.cuda(), cnt.cuda(), G, 0.1, blk)
        with pytest.raises(KernelError) as e:
            blk_bwd(torch.zeros_like(q), q, k, v, out, lse, idx.cuda(), cnt.cuda(), G, 0.1, blk)
        assert e.value.status == DSV_ERR_UNSUPPORTED


@pytest.mark.parametrize("blk", [16, 64])
def test_counts_and_padding(blk, gen):
    """Head counts 0, 1, 3 (not a multiple of the tile), kmax, above kmax (clamped to kmax) and
    negative (clamped to 0), with a group whose list is all -1 and one listing the last (partial)
    block only."""
    need_lib()
    B, H, S, D, G = 1, 6, 250, 64, 64
    nblk = -(-S // blk)
    NG = -(-S // G)
    kmax = 6
    q, k, v = T.make_inputs(B, S, H, D, torch.float16, gen)
    idx, cnt = random_blocks(B, H, NG, kmax, nblk, [[0, 1, 3, kmax, kmax + 4, -3]], gen)
    idx[0, :, 1] = -1
    idx[0, :, 2, 0] = nblk - 1
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)


@pytest.mark.parametrize("blk", [16, 64])
def test_duplicates_and_bad_entries(blk, gen):
    """Blocks listed up to kmax times (a list of one block repeated, lists with many repeats),
    entries out of range (ceil(S / blk) and beyond, below -1) skipped."""
    need_lib()
    B, H, S, D, G = 2, 2, 333, 128, 64
    nblk = -(-S // blk)
    NG = -(-S // G)
    kmax = 8
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    idx, cnt = random_blocks(B, H, NG, kmax, nblk, [[kmax, 5], [2, kmax]], gen, bad=True)
    idx[0, 0, 0] = nblk - 1                      # the partial last block, kmax times
    idx[1, 1, 1, :4] = 0                         # block 0 four times
    idx[1, 1, 2] = torch.tensor([3, 3, 1, 3, -1, 1, 2, 3], dtype=torch.int32)  # 3 < nblk
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)


@pytest.mark.parametrize("blk,kmax", [(16, 700), (64, 700), (16, 16384)])
def test_long_lists(blk, kmax, gen):
    """Lists longer than the sort's 256 threads (700 entries: 1024 sort slots, 4 per thread and
    step) and of the backward's most entries, 16384 (64 KB of shared memory, the sort kernel's
    attribute), random blocks with many duplicates; kmax 16385: the backward says
    DSV_ERR_UNSUPPORTED and its workspace size is 0."""
    need_lib()
    B, H, S, D, G = 1, 1, 300, 64, 128
    nblk = -(-S // blk)
    NG = -(-S // G)
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    idx, cnt = random_blocks(B, H, NG, kmax, nblk, [[kmax - 1]], gen, pad=0.05)
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)
    if kmax == 16384:
        idx = torch.zeros(B, H, NG, kmax + 1, dtype=torch.int32)
        out, lse = blk_fwd(q, k, v, idx.cuda(), cnt.cuda(), G, 0.1, blk)
        sh = _shape(q, idx, G, 0.1, blk)
        assert _get_lib().dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh)) == 0
        with pytest.raises(KernelError) as e:
            blk_bwd(torch.zeros_like(q), q, k, v, out, lse, idx.cuda(), cnt.cuda(), G, 0.1, blk)
        assert e.value.status == DSV_ERR_UNSUPPORTED


@pytest.mark.parametrize("blk", [16, 64])
def test_group_longer_than_sequence(blk, gen):
    """group_size 2^29 through the C API (one group of all S queries): the reference's result.
    The kernels clamp G to S; unclamped, the key-major pass would walk G / 64 = 2^23 empty query
    chunks per (group, mask) entry (minutes per key block) and the entry x chunk count would
    overflow int with 256 entries of a key block."""
    need_lib()
    B, H, S, D, G = 1, 1, 200, 64, 1 << 29
    nblk = -(-S // blk)
    kmax = 6
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    idx, cnt = random_blocks(B, H, 1, kmax, nblk, [[kmax]], gen)
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)


@pytest.mark.parametrize("blk", [16, 64])
def test_strided_inputs_and_negative_scale(blk, gen):
    """q, k, v as strided views of one packed buffer, a negative scale."""
    need_lib()
    B, H, S, D, G = 1, 2, 190, 64, 32
    nblk = -(-S // blk)
    kmax = 4 if blk == 64 else 7
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen, layout="packed")
    idx, cnt = random_blocks(B, H, -(-S // G), kmax, nblk, [[kmax, kmax - 1]], gen)
    run_and_check(q, k, v, idx, cnt, G, -0.3, blk, gen)


@pytest.mark.parametrize("blk", [16, 64])
def test_coherent_lists_many_groups(blk, gen):
    """Many groups selecting overlapping runs of blocks (long key-major entry lists, the index
    fill's warp prefix sums over several rounds of 32 groups) at S = 1100."""
    need_lib()
    B, H, S, D, G = 1, 2, 1100, 64, 32
    nblk = -(-S // blk)
    NG = -(-S // G)
    kmax = 6
    idx = torch.empty(B, H, NG, kmax, dtype=torch.int32)
    for h in range(H):
        for g in range(NG):
            start = (g * G // blk + h) % nblk
            idx[0, h, g] = torch.tensor([(start + j) % nblk for j in range(kmax)])
    cnt = torch.tensor([[kmax, kmax - 2]], dtype=torch.int32)
    q, k, v = T.make_inputs(B, S, H, D, torch.float16, gen)
    run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)


@pytest.mark.parametrize("blk", [16, 64])
def test_backward_bitwise_repeatable(blk, gen):
    """Ten backward runs give bit-identical dq, dk, dv, with and without
    DSV_FLAG_DETERMINISTIC (block lists have no other path), and the first matches the
    reference. G = 64, D = 128 (the wgmma forward on H100 / H200), unsorted lists with
    duplicates and padding."""
    need_lib()
    B, H, S, D, G = 1, 2, 700, 128, 64
    nblk = -(-S // blk)
    kmax = 6 if blk == 64 else 20
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    idx, cnt = random_blocks(B, H, -(-S // G), kmax, nblk, [[kmax, kmax - 3]], gen)
    out, lse, first = run_and_check(q, k, v, idx, cnt, G, 1 / math.sqrt(D), blk, gen)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    idx_d, cnt_d = idx.cuda(), cnt.cuda()
    runs = [blk_bwd(dout, q, k, v, out, lse, idx_d, cnt_d, G, 1 / math.sqrt(D), blk,
                    flags=i % 2) for i in range(10)]
    for i, r in enumerate(runs[1:], 1):
        for a, b, name in zip(runs[0], r, ("dq", "dk", "dv")):
            assert torch.equal(a, b), f"{name}: run {i} differs from run 0"


@pytest.mark.parametrize("blk", [16, 64])
def test_forward_nan_reaches_output(blk, gen):
    """A NaN in q makes its row's output and lse NaN, and its gradients NaN (dq of the row, dk / dv
    of the keys of its list); other groups stay finite."""
    need_lib()
    B, H, S, D, G = 1, 1, 128, 64, 64
    nblk = -(-S // blk)
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    q[0, 5, 0, 3] = float("nan")
    idx = torch.tensor([[[[0, 1], [1, nblk - 1]]]], dtype=torch.int32)
    cnt = torch.tensor([[2]], dtype=torch.int32)
    out, lse = blk_fwd(q, k, v, idx.cuda(), cnt.cuda(), G, 0.125, blk)
    assert torch.isnan(out[0, 5]).all() and torch.isnan(lse[0, 0, 5])
    assert torch.isfinite(out[0, 64:]).all() and torch.isfinite(lse[0, 0, 64:]).all()
    dq, dk, dv = blk_bwd(torch.ones_like(q), q, k, v, out, lse, idx.cuda(), cnt.cuda(), G, 0.125,
                         blk)
    assert torch.isnan(dq[0, 5]).any()
    assert torch.isnan(dk[0, :blk]).any(dim=-1).all() and torch.isnan(dv[0, :blk]).any(dim=-1).all()


@pytest.mark.parametrize("blk", [16, 64])
def test_nan_value_stays_in_its_lists(blk, gen):
    """A NaN in v at a key of group 0's list makes group 0's outputs NaN (and so its delta =
    rowsum(dout out)) and its dq and the dk of its keys, but nothing that is not computed from
    that key: the other groups' results stay finite and the keys that no group lists keep
    exactly zero dk and dv, also those in the same 64-key block as group 0's keys (with kv_block
    16 the key-major kernels see group 0's entry there: its unselected keys must get dS = 0, not
    0 x NaN). The C reference of the CPU op gives the same pattern (the dense float64 reference
    does not: its P V and dS^T Q products spread the NaN through zero probabilities)."""
    need_lib()
    B, H, S, D, G = 1, 1, 256, 64, 64
    q, k, v = T.make_inputs(B, S, H, D, torch.bfloat16, gen)
    v[0, 3, 0, 5] = float("nan")
    lists = [[0], [5], [-1], [12]] if blk == 16 else [[0], [2], [-1], [3]]
    idx = torch.tensor([[lists]], dtype=torch.int32)
    cnt = torch.tensor([[1]], dtype=torch.int32)
    tok, _ = expand_blocks(idx, cnt, S, blk)
    listed = torch.zeros(S, dtype=torch.bool)
    listed[tok[tok >= 0].long()] = True
    out, lse = blk_fwd(q, k, v, idx.cuda(), cnt.cuda(), G, 0.125, blk)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).cuda()
    dq, dk, dv = blk_bwd(dout, q, k, v, out, lse, idx.cuda(), cnt.cuda(), G, 0.125, blk)
    torch.cuda.synchronize()
    assert torch.isnan(out[0, :G]).any(dim=-1).all() and torch.isfinite(out[0, G:]).all()
    assert torch.isfinite(lse[0, 0, :2 * G]).all() and torch.isfinite(lse[0, 0, 3 * G:]).all()
    assert (lse[0, 0, 2 * G:3 * G] == -math.inf).all()  # group 2's empty list
    assert torch.isnan(dq[0, :G]).any(dim=-1).all() and torch.isfinite(dq[0, G:]).all()
    own = tok[0, 0, 0][tok[0, 0, 0] >= 0].long()  # group 0's keys: dS = P (dP - NaN)
    assert torch.isnan(dk[0, own]).any(dim=-1).all()
    others = listed.clone()
    others[own] = False
    assert torch.isfinite(dk[0, others]).all() and torch.isfinite(dv[0, listed]).all()
    for name, t in (("dk", dk), ("dv", dv)):
        z = t[0, ~listed]
        assert torch.equal(z, torch.zeros_like(z)), f"{name}: keys no group lists are not 0"


def test_block_size_checks():
    """kv_block 8, 32, 128 (not compiled): DSV_ERR_UNSUPPORTED; 0 and -4: DSV_ERR_INVALID; in the
    forward and the backward (whose workspace size is 0 then)."""
    need_lib()
    S, D, G = 64, 64, 64
    q = torch.zeros(1, S, 1, D, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device="cuda")
    cnt = torch.ones(1, 1, dtype=torch.int32, device="cuda")
    for blk, want in ((8, DSV_ERR_UNSUPPORTED), (32, DSV_ERR_UNSUPPORTED),
                      (128, DSV_ERR_UNSUPPORTED), (0, DSV_ERR_INVALID), (-4, DSV_ERR_INVALID)):
        with pytest.raises(KernelError) as e:
            blk_fwd(q, q, q, idx, cnt, G, 0.1, blk)
        assert e.value.status == want, (blk, e.value.status)
        sh = _shape(q, idx, G, 0.1, blk)
        assert _get_lib().dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh)) == 0
        lse = torch.zeros(1, 1, S, device="cuda")
        with pytest.raises(KernelError) as e:
            blk_bwd(q, q, q, q, q, lse, idx, cnt, G, 0.1, blk)
        assert e.value.status == want, (blk, e.value.status)


@pytest.mark.parametrize("tuning", ["wgmma=0", "km_wgmma=0", "km_wgmma=2"])
def test_kernel_choices(tuning):
    """The tests above in a child process with another kernel choice (DSV_KERNEL_TUNING; the
    choices differ where wgmma would run, G >= 64 and D 64 / 128 on an H100 / H200): wgmma=0 the
    mma.sync forward, dQ and key-major kernels; km_wgmma=0 the key-major dK / dV pass on
    mma.sync with the wgmma forward and dQ (this process runs the default, km_wgmma=1: that pass
    on wgmma for kv_block 64); km_wgmma=2 on wgmma for kv_block 16 too."""
    need_lib()
    if os.environ.get("DSV_KERNEL_TUNING"):
        pytest.skip("inside a tuning run")
    import subprocess
    import sys
    env = dict(os.environ, DSV_KERNEL_TUNING=tuning)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", "not kernel_choices and not km_kernels"],
                       env=env, capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert r.returncode == 0, f"{tuning}:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert " passed" in r.stdout, r.stdout[-2000:]


# (kv_block, D, G, dtype) of test_km_kernels_agree; kv_block 1: token lists in deterministic
# mode (every head key-major, entries in ascending group order). G 100 and 128: chunks of 64
# queries past the group's end.
KM_CASES = ((64, 128, 64, torch.bfloat16), (16, 128, 128, torch.float16),
            (64, 64, 100, torch.float16), (16, 64, 64, torch.bfloat16),
            (1, 128, 64, torch.bfloat16), (1, 64, 128, torch.float16))

_KM_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["DSV_ROOT"], "tests"))
import test_kv_block_kernels_cuda as K
T = K.T
gen = torch.Generator().manual_seed(23)
res = []
for blk, D, G, dtype in K.KM_CASES:
    B, H, S = 1, 2, 300
    NG = -(-S // G)
    scale = 1 / D ** 0.5
    q, k, v = T.make_inputs(B, S, H, D, dtype, gen)
    if blk > 1:
        kmax = 7 if blk == 64 else 13
        idx, cnt = K.random_blocks(B, H, NG, kmax, -(-S // blk), [[kmax, kmax - 2]], gen)
    else:
        idx, cnt = T.ref.random_index(B, H, S, G, 120, counts=[[120, 77]], generator=gen)
    dout = torch.randn(q.shape, generator=gen).to(dtype).cuda()
    idx_d, cnt_d = idx.cuda(), cnt.cuda()
    if blk > 1:
        out, lse = K.blk_fwd(q, k, v, idx_d, cnt_d, G, scale, blk)
        runs = [K.blk_bwd(dout, q, k, v, out, lse, idx_d, cnt_d, G, scale, blk) for _ in range(3)]
    else:
        out, lse = T.attn_fwd(q, k, v, idx_d, cnt_d, G, scale)
        runs = [T.attn_bwd(dout, q, k, v, out, lse, idx_d, cnt_d, G, scale, deterministic=True)
                for _ in range(3)]
    torch.cuda.synchronize()
    for r in runs[1:]:
        for a, b, name in zip(runs[0], r, ("dq", "dk", "dv")):
            assert torch.equal(a, b), f"{(blk, D, G)} {name}: runs differ"
    names = ("q", "k", "v", "dout", "out", "lse", "idx", "cnt", "dq", "dk", "dv")
    res.append(dict(zip(names, (t.cpu() for t in (q, k, v, dout, out, lse, idx, cnt, *runs[0])))))
torch.save(res, sys.argv[1])
"""


def _ulp(x, dtype):
    """The spacing of `dtype` (bfloat16: 8 significant bits, float16: 11, subnormals from
    2^-24) at |x| (float64)."""
    mant, tiny = (8, 2.0 ** -133) if dtype == torch.bfloat16 else (11, 2.0 ** -24)
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.maximum(torch.exp2(e - (mant - 1)), torch.full_like(x, tiny))


def _km_magnitudes(r, G, blk, scale):
    """Float64 magnitude sums of the terms of dK and dV in the key-major pass, (Mk, Mv), each
    [B, S, H, D]: Mv = sum_q C P |dO|, Mk = |scale| sum_q C |dS| |Q|, with C the times the key is
    listed for the query's group, P = exp(scale q.k - lse) (the kernel's lse), |dS| bounded by
    P (|dP| + |delta|), delta = rowsum(dO out) (the kernel's out); P and |dS| raised by 2^-17 to
    cover the absolute spacing of tiny float16 values."""
    q, k, v, dout, out = (r[n].double() for n in ("q", "k", "v", "dout", "out"))
    lse = r["lse"].double()
    B, S, H, D = q.shape
    if blk > 1:
        tok, tcnt = expand_blocks(r["idx"], r["cnt"], S, blk)
    else:
        tok, tcnt = r["idx"], r["cnt"]
    mv = torch.zeros(B, S, H, D, dtype=torch.float64)
    mk = torch.zeros_like(mv)
    for b in range(B):
        for h in range(H):
            C = torch.zeros(S, S, dtype=torch.float64)
            n = int(tcnt[b, h].clamp(0, tok.shape[-1]))
            for g in range(tok.shape[2]):
                keys = tok[b, h, g, :n].long()
                keys = keys[(keys >= 0) & (keys < S)]
                C[g * G:min(S, g * G + G)] += torch.bincount(keys, minlength=S).double()
            s = scale * (q[b, :, h] @ k[b, :, h].T) - lse[b, h][:, None]
            P = torch.where(C > 0, torch.exp(torch.where(C > 0, s, torch.zeros_like(s))),
                            torch.zeros_like(s))
            dP = dout[b, :, h] @ v[b, :, h].T
            delta = (dout[b, :, h] * out[b, :, h]).sum(-1)
            W = C * (P + 2.0 ** -17)
            mv[b, :, h] = W.T @ dout[b, :, h].abs()
            Wk = C * (P * (dP.abs() + delta.abs()[:, None]) + 2.0 ** -17)
            mk[b, :, h] = abs(scale) * (Wk.T @ q[b, :, h].abs())
    return mk, mv


def test_km_kernels_agree(tmp_path):
    """The key-major dK / dV pass on wgmma (km_wgmma=2: every case, kv_block 16 included) and
    on mma.sync (km_wgmma=0), each in a child process, on the same inputs (KM_CASES: block lists
    16 / 64 with duplicates, padding, a partial last block and partial last groups; token lists
    in deterministic mode): each run three times bit-identically; out, lse and dq (the same
    kernels in both) bit-identical across the two; dk, dv within
        ulp(max(|a|, |b|)) + (2^-7 + 2^-10) M   elementwise,
    M the float64 magnitude sum of the element's terms (_km_magnitudes). Why: both kernels form
    the same fp32 P and dS from fp32 scores, then round them to the input type and sum the
    products in fp32 in different orders. Different score sums can move an fp32 P or dS across a
    rounding boundary of the input type: one spacing, at most 2^-7 of the term (bf16; fp16 2^-10,
    or 2^-24 absolute below 2^-14: the 2^-17 floor); the fp32 sum orders and scores differ by
    far less than 2^-10 M (2 n 2^-24 M with n < 2^10 terms); the two roundings of the output to
    the input type add one spacing. That bound assumes every term moved; in fact few do (a
    score moves by ~1e-6 of itself), so the difference is about the output spacing: also
    ||a - b|| <= 2^-6 ||a|| (bf16; fp16 2^-8), 2-4x the worst case of one spacing everywhere,
    and far below what a lost or repeated work item gives (tens of %). Outputs are poisoned
    (NaN) before each run."""
    need_lib()
    if os.environ.get("DSV_KERNEL_TUNING"):
        pytest.skip("inside a tuning run")
    import subprocess
    import sys
    res = {}
    for km in (2, 0):
        f = tmp_path / f"km{km}.pt"
        env = dict(os.environ, DSV_KERNEL_TUNING=f"km_ratio=1e9,bwd_ranges=1,km_wgmma={km}",
                   DSV_ROOT=ROOT)
        r = subprocess.run([sys.executable, "-c", _KM_CHILD, str(f)], env=env,
                           capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert r.returncode == 0, f"km_wgmma={km}:\n{r.stderr[-3000:]}"
        res[km] = torch.load(f)
    for (blk, D, G, dtype), a, b in zip(KM_CASES, res[2], res[0]):
        case = f"kv_block {blk}, D {D}, G {G}, {dtype}"
        for name in ("q", "k", "v", "dout", "idx", "out", "lse", "dq"):
            assert torch.equal(a[name], b[name]), f"{case}: {name} differs"
        mk, mv = _km_magnitudes(a, G, blk, 1 / D ** 0.5)
        for name, m in (("dk", mk), ("dv", mv)):
            x, y = a[name].double(), b[name].double()
            assert torch.isfinite(x).all() and torch.isfinite(y).all(), f"{case}: {name} not finite"
            bound = _ulp(torch.maximum(x.abs(), y.abs()), dtype) + (2.0 ** -7 + 2.0 ** -10) * m
            err = (x - y).abs()
            bad = err > bound
            assert not bad.any(), (f"{case}: {name}: {int(bad.sum())} elements past the bound, "
                                   f"worst {float((err - bound).max()):.3g}")
            rel = float((x - y).norm() / x.norm())
            assert rel <= (2.0 ** -6 if dtype == torch.bfloat16 else 2.0 ** -8), \
                f"{case}: {name}: relative difference {rel:.3g}"
