"""GPU tests of the CUDA top-K estimation kernel (csrc/cuda/topk_estimate.cu).

Skipped without a GPU. The kernels are reached through torch.ops.dsv (the built extension) or,
when DSV_OPS_LIB names a shared library built from csrc/cuda/{topk_estimate,predictor_loss,
profile_attention,rows}.cu alone (benchmarks/device_run_ops.sh builds one), through ctypes; the
ctypes access below is shared by the other *_cuda test files of these ops (`import
test_topk_estimate_cuda as KB`).

Reference for top-K: the group-mean low-rank scores computed in float64 from the same 16-bit
inputs. The kernel's scores are exact 16-bit products accumulated in fp32 (the representative
is an fp32 mean), so they differ from the float64 scores by at most a few fp32 roundings of
sum_c |rep_c k_c|: with T the K-th largest float64 score, every selected key must score
>= T - tol and every other key <= T + tol, tol = 2^-16 * max_j sum_c |rep_c k_jc| (generous
against fp32's 2^-24 per operation, far below the gaps that a wrong selection produces).
Integer-valued inputs give exact scores with many ties: there the list must equal the stable
(lower position first) top-K exactly.
"""
from __future__ import annotations

import ctypes
import importlib.util
import math
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ============================================================================================
# shared kernel access (torch.ops.dsv or ctypes through DSV_OPS_LIB)


class Bshd(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride_b", ctypes.c_int64),
                ("stride_s", ctypes.c_int64), ("stride_h", ctypes.c_int64)]


class LowrankShape(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "seqlen", "heads", "rank", "group_size",
                                               "num_groups", "kmax")] + [("dtype", ctypes.c_int)]


class PredictorShape(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("batch", "seqlen", "heads", "head_dim", "rank",
                                                "num_rows")] +
                [(n, ctypes.c_double) for n in ("scale", "cos_weight", "norm_weight")] +
                [("dtype", ctypes.c_int)])


class ProfileShape(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("batch", "seqlen", "heads", "head_dim", "num_rows",
                                                "group_size", "num_groups", "kmax")] +
                [(n, ctypes.c_double) for n in ("scale", "theta")] + [("dtype", ctypes.c_int)])


DT = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_lib = None


def _load_reference():
    spec = importlib.util.spec_from_file_location(
        "dsv_reference_by_path_ops", os.path.join(ROOT, "dsv_ext", "reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def get_lib():
    global _lib
    if _lib is None:
        path = os.environ.get("DSV_OPS_LIB")
        if not path:
            return None
        lib = ctypes.CDLL(path)
        P, vp, sz, i64, i32, dbl = (ctypes.POINTER, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_int64, ctypes.c_int, ctypes.c_double)
        lib.dsv_topk_estimate_workspace_cuda.restype = sz
        lib.dsv_topk_estimate_workspace_cuda.argtypes = [P(LowrankShape)]
        lib.dsv_topk_estimate_cuda.restype = i32
        lib.dsv_topk_estimate_cuda.argtypes = [P(LowrankShape), Bshd, Bshd, vp, vp, vp, sz, vp]
        lib.dsv_predictor_loss_workspace_cuda.restype = sz
        lib.dsv_predictor_loss_workspace_cuda.argtypes = [P(PredictorShape)]
        lib.dsv_predictor_loss_fwd_cuda.restype = i32
        lib.dsv_predictor_loss_fwd_cuda.argtypes = [P(PredictorShape), Bshd, Bshd, Bshd, Bshd, vp,
                                                    vp, vp, vp, sz, vp]
        lib.dsv_predictor_loss_bwd_cuda.restype = i32
        lib.dsv_predictor_loss_bwd_cuda.argtypes = [P(PredictorShape), Bshd, Bshd, Bshd, Bshd, vp,
                                                    vp, vp, Bshd, Bshd, vp, sz, vp]
        lib.dsv_profile_attention_workspace_cuda.restype = sz
        lib.dsv_profile_attention_workspace_cuda.argtypes = [P(ProfileShape)]
        lib.dsv_profile_attention_cuda.restype = i32
        lib.dsv_profile_attention_cuda.argtypes = [P(ProfileShape), Bshd, Bshd, vp, vp, vp, vp,
                                                   vp, vp, sz, vp]
        lib.dsv_gather_rows_cuda.restype = i32
        lib.dsv_gather_rows_cuda.argtypes = [i32, i64, vp, i64, i64, vp, i64, vp, vp]
        lib.dsv_scatter_add_rows_cuda.restype = i32
        lib.dsv_scatter_add_rows_cuda.argtypes = [i32, i64, vp, i64, vp, i64, i64, vp, vp]
        _lib = lib
    return _lib


def have_ops():
    try:
        import dsv_ext
        return bool(dsv_ext.ops.has_cuda_kernels())
    except Exception:
        return False


def backend():
    if get_lib() is not None:
        return "ctypes"
    if have_ops():
        return "ops"
    return None


def need_backend():
    b = backend()
    if b is None:
        pytest.skip("no CUDA kernels: neither DSV_OPS_LIB nor a CUDA build of dsv_ext")
    return b


def _bshd(t):
    assert t.stride(-1) == 1
    return Bshd(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _check(rc, what):
    assert rc == 0, f"{what}: status {rc}"


def poison_cache(nbytes, device="cuda"):
    """Leave a freed NaN / 0xff block of this size in the caching allocator, so that a fresh
    output of the same size most likely starts as garbage."""
    t = torch.full((max(int(nbytes), 8) // 4 + 1,), -1, dtype=torch.int32, device=device)
    t.view(torch.float32).fill_(float("nan"))
    del t


def _ws(nbytes):
    w = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device="cuda")
    w.fill_(0xA5)  # the kernels must not rely on a zeroed workspace
    return w


def topk_estimate(q_lr, k_lr, kv_count, group_size, kmax, out=None, poison=True):
    """kv_index from the kernel. poison=False (benchmarks): no poisoning, no synchronisation;
    `out` (ctypes backend only) reuses a preallocated output."""
    B, S, H, r = q_lr.shape
    NG = -(-S // group_size)
    if backend() == "ops":
        if poison:
            poison_cache(B * H * NG * kmax * 4)
        return torch.ops.dsv.topk_estimate(q_lr, k_lr, kv_count, group_size, kmax)
    lib = get_lib()
    if out is None:
        out = torch.empty((B, H, NG, kmax), dtype=torch.int32, device="cuda")
    if poison:
        out.fill_(-777)
    p = LowrankShape(B, S, H, r, group_size, NG, kmax, DT[q_lr.dtype])
    n = lib.dsv_topk_estimate_workspace_cuda(ctypes.byref(p))
    w = _ws(n) if poison else torch.empty(max(int(n), 1), dtype=torch.uint8, device="cuda")
    _check(lib.dsv_topk_estimate_cuda(ctypes.byref(p), _bshd(q_lr), _bshd(k_lr), _ptr(kv_count),
                                      _ptr(out), _ptr(w), n, _stream()), "topk_estimate")
    if poison:
        torch.cuda.synchronize()
    return out


def predictor_loss_fwd(q, k, q_lr, k_lr, rows, scale, cw, nw):
    B, S, H, D = q.shape
    R = rows.numel()
    if backend() == "ops":
        poison_cache(B * H * R * 12)
        return torch.ops.dsv.predictor_loss_fwd(q, k, q_lr, k_lr, rows, scale, cw, nw)
    lib = get_lib()
    loss = torch.full((B, H), float("nan"), dtype=torch.float32, device="cuda")
    stats = torch.full((B, H, R, 3), float("nan"), dtype=torch.float32, device="cuda")
    p = PredictorShape(B, S, H, D, q_lr.shape[3], R, scale, cw, nw, DT[q.dtype])
    n = lib.dsv_predictor_loss_workspace_cuda(ctypes.byref(p))
    w = _ws(n)
    _check(lib.dsv_predictor_loss_fwd_cuda(ctypes.byref(p), _bshd(q), _bshd(k), _bshd(q_lr),
                                           _bshd(k_lr), _ptr(rows), _ptr(loss), _ptr(stats),
                                           _ptr(w), n, _stream()), "predictor_loss_fwd")
    torch.cuda.synchronize()
    return loss, stats


def predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, stats, scale, cw, nw):
    B, S, H, D = q.shape
    R = rows.numel()
    if backend() == "ops":
        poison_cache(q_lr.numel() * q_lr.element_size())
        return torch.ops.dsv.predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, stats, scale, cw, nw)
    lib = get_lib()
    dq = torch.full(q_lr.shape, float("nan"), dtype=q_lr.dtype, device="cuda")
    dk = torch.full(k_lr.shape, float("nan"), dtype=k_lr.dtype, device="cuda")
    p = PredictorShape(B, S, H, D, q_lr.shape[3], R, scale, cw, nw, DT[q.dtype])
    n = lib.dsv_predictor_loss_workspace_cuda(ctypes.byref(p))
    w = _ws(n)
    _check(lib.dsv_predictor_loss_bwd_cuda(ctypes.byref(p), _bshd(q), _bshd(k), _bshd(q_lr),
                                           _bshd(k_lr), _ptr(rows), _ptr(dloss), _ptr(stats),
                                           _bshd(dq), _bshd(dk), _ptr(w), n, _stream()),
           "predictor_loss_bwd")
    torch.cuda.synchronize()
    return dq, dk


def profile_attention(q, k, rows, theta, scale, kv_index=None, kv_count=None, group_size=1):
    B, S, H, D = q.shape
    R = rows.numel()
    if backend() == "ops":
        poison_cache(B * H * 4)
        return torch.ops.dsv.profile_attention(q, k, rows, theta, scale, kv_index, kv_count,
                                               group_size)
    lib = get_lib()
    sp = torch.full((B, H), float("nan"), dtype=torch.float32, device="cuda")
    rc = torch.full((B, H), -5.0, dtype=torch.float32, device="cuda")
    NG = kv_index.shape[2] if kv_index is not None else 0
    KM = kv_index.shape[3] if kv_index is not None else 0
    p = ProfileShape(B, S, H, D, R, group_size, NG, KM, scale, theta, DT[q.dtype])
    n = lib.dsv_profile_attention_workspace_cuda(ctypes.byref(p))
    w = _ws(n)
    _check(lib.dsv_profile_attention_cuda(ctypes.byref(p), _bshd(q), _bshd(k), _ptr(rows),
                                          _ptr(kv_index), _ptr(kv_count), _ptr(sp), _ptr(rc),
                                          _ptr(w), n, _stream()), "profile_attention")
    torch.cuda.synchronize()
    return sp, rc


def gather_rows(src, index):
    if backend() == "ops":
        poison_cache(index.numel() * src.shape[1] * src.element_size())
        return torch.ops.dsv.gather_rows(src, index)
    lib = get_lib()
    M, D = index.numel(), src.shape[1]
    dst = torch.empty((M, D), dtype=src.dtype, device="cuda")
    dst.view(torch.uint8).fill_(0x7F)
    _check(lib.dsv_gather_rows_cuda(DT[src.dtype], D, _ptr(src), src.stride(0), src.shape[0],
                                    _ptr(index), M, _ptr(dst), _stream()), "gather_rows")
    torch.cuda.synchronize()
    return dst


def scatter_add_rows(src, index, num_rows):
    """Returns the accumulator cast to src's dtype, like torch.ops.dsv.scatter_add_rows."""
    if backend() == "ops":
        return torch.ops.dsv.scatter_add_rows(src, index, num_rows)
    lib = get_lib()
    acc_dt = torch.float64 if src.dtype == torch.float64 else torch.float32
    acc = torch.zeros((num_rows, src.shape[1]), dtype=acc_dt, device="cuda")
    _check(lib.dsv_scatter_add_rows_cuda(DT[src.dtype], src.shape[1], _ptr(src), src.stride(0),
                                         _ptr(index), index.numel(), num_rows, _ptr(acc),
                                         _stream()), "scatter_add_rows")
    torch.cuda.synchronize()
    return acc.to(src.dtype)


# ============================================================================================
# top-K tests


def group_scores64(q_lr, k_lr, G):
    """[B, H, NG, S] float64 scores of the fp32 group means (as the kernel forms them)."""
    B, S, H, r = q_lr.shape
    NG = -(-S // G)
    q = q_lr.float()
    reps = []
    for g in range(NG):
        reps.append(q[:, g * G:min(S, (g + 1) * G)].mean(dim=1))  # [B, H, r] (fp32 mean)
    rep = torch.stack(reps, dim=2).double()  # [B, H, NG, r]
    kk = k_lr.double().permute(0, 2, 3, 1)  # [B, H, r, S]
    sc = rep @ kk
    mag = rep.abs() @ kk.abs()
    return sc, mag


def check_topk(out, q_lr, k_lr, kv_count, G, kmax, exact=False):
    B, S, H, r = q_lr.shape
    NG = -(-S // G)
    assert out.shape == (B, H, NG, kmax)
    out = out.cpu()
    sc, mag = group_scores64(q_lr, k_lr, G)
    sc, mag = sc.cpu(), mag.cpu()
    cnt = kv_count.cpu().clamp(0, kmax).clamp(max=S)
    for b in range(B):
        for h in range(H):
            K = int(cnt[b, h])
            lst = out[b, h]
            assert (lst[:, K:] == -1).all(), f"(b={b}, h={h}): entries after K={K} are not -1"
            if K == 0:
                continue
            sel = lst[:, :K].long()
            assert ((sel >= 0) & (sel < S)).all(), f"(b={b}, h={h}): positions out of range"
            if K > 1:
                assert (sel[:, 1:] > sel[:, :-1]).all(), f"(b={b}, h={h}): lists not ascending"
            s = sc[b, h]  # [NG, S]
            if exact:
                # stable top-K: score descending, lower position first
                order = torch.sort(-s, dim=1, stable=True).indices[:, :K]
                want = torch.sort(order, dim=1).values
                assert torch.equal(sel, want), f"(b={b}, h={h}): exact tie-broken top-K differs"
                continue
            tol = 2.0 ** -16 * mag[b, h].max(dim=1).values  # [NG]
            kth = torch.topk(s, K, dim=1).values[:, -1]  # [NG]
            got = torch.gather(s, 1, sel)
            assert (got >= (kth - tol)[:, None]).all(), \
                f"(b={b}, h={h}): a selected key scores below the K-th largest"
            mask = torch.ones_like(s, dtype=torch.bool)
            mask.scatter_(1, sel, False)
            rest = torch.where(mask, s, torch.full_like(s, -math.inf))
            assert (rest.max(dim=1).values <= kth + tol).all(), \
                f"(b={b}, h={h}): an unselected key scores above the K-th largest"


def _lowrank(B, S, H, r, dtype, gen, layout="packed"):
    if layout == "packed":
        q = torch.randn(B, S, H, r, generator=gen)
        k = torch.randn(B, S, H, r, generator=gen)
        return q.to(dtype).cuda(), k.to(dtype).cuda()
    if layout == "bhsd":  # [B, H, S, r] storage viewed as [B, S, H, r]
        q = torch.randn(B, H, S, r, generator=gen).to(dtype).cuda().transpose(1, 2)
        k = torch.randn(B, H, S, r, generator=gen).to(dtype).cuda().transpose(1, 2)
        return q, k
    # "padded": rows of r + 3 elements (not 16-byte aligned), a slice of a bigger tensor
    q = torch.randn(B, S, H, r + 3, generator=gen).to(dtype).cuda()[..., 1:r + 1]
    k = torch.randn(B, S, H, r + 3, generator=gen).to(dtype).cuda()[..., 1:r + 1]
    return q, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,H,r,G,counts,kmax,layout", [
    (1000, 2, 16, 64, [100, 1000], 1000, "packed"),     # K = S on one head, partial group
    (777, 2, 16, 32, [64, 0], 80, "bhsd"),              # K = 0 head, -1 padding, strided
    (530, 1, 8, 128, [200], 256, "padded"),             # rank 8, unaligned rows, kmax > K
    (300, 2, 40, 64, [500, 77], 400, "packed"),         # count > S (clamped), rank 40
    (256, 1, 64, 64, [64], 64, "padded"),               # rank 64
    (4100, 2, 16, 64, [820, 410], 900, "packed"),       # K = 20% / 10% of S
])
def test_topk_random(gen, dtype, S, H, r, G, counts, kmax, layout):
    if need_backend() == "ops":
        kmax = min(kmax, S)  # the registration rejects kmax > S; the raw kernel clamps
    q, k = _lowrank(1, S, H, r, dtype, gen, layout)
    cnt = torch.tensor([counts], dtype=torch.int32, device="cuda")
    out = topk_estimate(q, k, cnt, G, kmax)
    check_topk(out, q, k, cnt, G, kmax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_ties_exact(gen, dtype):
    """Small-integer inputs: exact scores with many ties; the list must be the stable top-K."""
    need_backend()
    B, S, H, r, G = 2, 700, 2, 16, 64
    q = torch.randint(-2, 3, (B, S, H, r), generator=gen).to(dtype).cuda()
    k = torch.randint(-1, 2, (B, S, H, r), generator=gen).to(dtype).cuda()
    # the means of full groups (sum / 64) are exact; the partial last group (60 rows) would not
    # be, so its queries are zero: every score 0, a full tie, the list is the first K positions
    q[:, 640:] = 0
    cnt = torch.tensor([[70, 333], [1, 699]], dtype=torch.int32, device="cuda")
    out = topk_estimate(q, k, cnt, G, 400)
    check_topk(out, q, k, cnt, G, 400, exact=True)


def test_topk_large_k_20pct(gen):
    """K = 20% of S at a longer sequence (the 128k case shrunk to a test size)."""
    need_backend()
    S, H, r, G = 16384, 1, 16, 64
    q, k = _lowrank(1, S, H, r, torch.bfloat16, gen)
    cnt = torch.tensor([[S // 5]], dtype=torch.int32, device="cuda")
    out = topk_estimate(q, k, cnt, G, S // 5)
    check_topk(out, q, k, cnt, G, S // 5)


def test_topk_matches_cpu(gen):
    """Same lists as the CPU kernel up to near-ties (both checked against float64)."""
    if backend() != "ops":
        pytest.skip("needs the built extension")
    S, H, r, G = 900, 2, 16, 64
    q, k = _lowrank(1, S, H, r, torch.bfloat16, gen)
    cnt = torch.tensor([[90, 300]], dtype=torch.int32)
    gpu = topk_estimate(q, k, cnt.cuda(), G, 300).cpu()
    cpu = torch.ops.dsv.topk_estimate(q.cpu(), k.cpu(), cnt, G, 300)
    same = (gpu == cpu).float().mean().item()
    assert same > 0.99, f"GPU and CPU lists agree on only {same:.4f} of the entries"
    check_topk(cpu.cuda(), q, k, cnt, G, 300)
