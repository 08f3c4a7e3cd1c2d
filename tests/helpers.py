"""Shared helpers of the op tests (CPU and CUDA); tests/conftest.py holds only fixtures.

- the float64 references of dsv_ext/reference.py, loaded by path as `ref` (so that the CUDA
  kernels can be checked through ctypes before the whole extension builds) and re-exported;
- PyTorch counterparts of the ops in the same dtype (`attention_pt`, `predictor_loss_pt`,
  `scatter_add_rows_pt`) and the tolerance rule built on them (`assert_pt_bound`); the
  dtype-derived bounds (`TOL`, `GRAD_TOL`, `assert_close`) for what has no such counterpart;
- output poisoning (`poison` on the host heap, `poison_cache` in the CUDA caching allocator);
- index builders (`counts_for`, `index_lists`, and the reference's `random_index`);
- ctypes bindings of csrc/dsv.h (`Bshd`, `AttnShape` with its `kv_block`, `LowrankShape`,
  `PredictorShape`, `ProfileShape`, `DT`) for libraries built from csrc/cuda alone:
  DSV_ATTN_LIB (the attention kernels; benchmarks/device_run.sh builds one) and DSV_OPS_LIB (the
  other ops; benchmarks/device_run_ops.sh);
- kernel access on either device (`attn_fwd`, `attn_bwd`, `topk_estimate`,
  `predictor_loss_fwd` / `_bwd`, `profile_attention`, `gather_rows`, `scatter_add_rows`): the
  raw torch.ops.dsv op of the tensors' device with its outputs poisoned first or, on CUDA with
  the library variable set, the C function through ctypes on NaN-filled outputs;
- the attention check used by every device (`check_attention`) and the CUDA kernels' derived
  elementwise bounds (`check_close`, `check_lse`, `grad_targets`).

The tolerance rule (FlashAttention's): a kernel's error against the float64 reference may be at
most a small multiple of the error that PyTorch makes for the same computation in the same
dtype, plus a tiny absolute term:

    max |ours - ref64| <= f(dtype) * max |pt - ref64| + 2 u max |ref64|,   u: unit roundoff

with f = 2 for bfloat16 / float16 and f = 10 for float32.
Why: the float64 reference is the exact answer for the rounded inputs; PyTorch's own result in
the input dtype is what a user accepts from the framework, and its error scales by itself with
the dtype, the shape, the magnitudes and the sequence length, so no hand-tuned number per dtype
and shape is needed. A kernel that drops, duplicates or misweights a term, reads a wrong key or
skips a rescale is off by O(rms), far outside. The absolute term (twice the rounding of the
largest element) covers outputs whose only error is the final rounding, which PyTorch may get
exactly by chance (a list of one key, zero outputs of empty lists). In half precision PyTorch
rounds the logits, P and every product to the dtype while the kernels accumulate in fp32: f = 2
as in FlashAttention's tests. In float32 both sides differ only in summation order: PyTorch's
blocked FMA GEMMs sum more accurately than a kernel's running dot products and online softmax,
and exp amplifies the logits' error where they are large (scale 2: a peaked softmax); measured
on the CPU kernels over ~2000 cases: up to 5x PyTorch's error (dv), 3x elsewhere, hence f = 10.
float64 has no PyTorch counterpart distinct from the reference (the reference is PyTorch in
float64): there the bound is 1e-10 (1 + max |ref64|), summation order only (the measured error
is ~1e-14 of O(1) values). The counterpart computes in the input dtype, except where an op
keeps a result in its wider accumulator type (lse; the scatter-add sums, rounded once): there
in that type from the same inputs.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_reference():
    spec = importlib.util.spec_from_file_location(
        "dsv_reference_by_path", os.path.join(ROOT, "dsv_ext", "reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ref = _load_reference()
sparse_attention_lse_ref = ref.sparse_attention_lse_ref
sparse_attention_ref = ref.sparse_attention_ref
dense_attention_ref = ref.dense_attention_ref
topk_ref = ref.topk_ref
topk_scores_ref = ref.topk_scores_ref
predictor_loss_ref = ref.predictor_loss_ref
profile_ref = ref.profile_ref
gather_rows_ref = ref.gather_rows_ref
scatter_add_rows_ref = ref.scatter_add_rows_ref
key_multiplicity = ref.key_multiplicity
random_index = ref.random_index
make_qkv = ref.make_qkv

# ============================================================================================
# devices

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def device_cases(by_device, name=lambda c: str(c)):
    """pytest parameters (device, dtype, case) from {device: (dtypes, cases)}; ids like
    "cpu-float32-<name(case)>"; the CUDA ones are skipped without a GPU."""
    out = []
    for dev, (dtypes, cases) in by_device.items():
        for dt in dtypes:
            for c in cases:
                out.append(pytest.param(dev, dt, c, marks=needs_cuda if dev == "cuda" else (),
                                        id=f"{dev}-{str(dt).replace('torch.', '')}-{name(c)}"))
    return out


def device_dtypes(by_device):
    """pytest parameters (device, dtype) from {device: [dtypes]}."""
    return [pytest.param(dev, dt, marks=needs_cuda if dev == "cuda" else (),
                         id=f"{dev}-{str(dt).replace('torch.', '')}")
            for dev, dts in by_device.items() for dt in dts]


# `@pytest.mark.parametrize("device", DEVICES)`: the CUDA case is skipped without a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
# the dtypes each device's attention kernels take in the device-parametrized tests (the CPU
# kernels also take half inputs: test_half_inputs of each op)
ATTN_DTYPES = {"cpu": [torch.float32, torch.float64], "cuda": [torch.bfloat16, torch.float16]}


def have_ops(cuda: bool = True) -> bool:
    """The built extension is importable (and, with cuda, holds the CUDA kernels)."""
    try:
        import dsv_ext
        return bool(dsv_ext.ops.has_cuda_kernels()) if cuda else hasattr(torch.ops.dsv,
                                                                          "gather_rows")
    except Exception:
        return False


def need_backend(device="cuda", lib_env="DSV_OPS_LIB"):
    """Skip unless kernels for `device` are reachable; returns "ops" or "ctypes"."""
    if str(device) == "cpu":
        if not have_ops(cuda=False):
            pytest.skip("needs the built extension (the CPU kernels)")
        return "ops"
    b = backend(lib_env)
    if b is None:
        pytest.skip(f"no CUDA kernels: neither {lib_env} nor a CUDA build of dsv_ext")
    return b


def need_ops(device):
    """Skip unless the public dsv_ext ops run on `device` (the built extension, with CUDA
    kernels for "cuda")."""
    if not have_ops(cuda=str(device) != "cpu"):
        pytest.skip("needs the built extension (the public op)")


def import_dsv_ext():
    """dsv_ext, or None where the extension does not load (a ctypes-only check of the CUDA
    kernels through DSV_ATTN_LIB / DSV_OPS_LIB: the tests that need it skip)."""
    try:
        import dsv_ext
        return dsv_ext
    except Exception:
        return None


# ============================================================================================
# tolerances

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}
PT_FACTOR = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 10.0}
FLOAT64_TOL = 1e-10

# Derived bounds (atol, rtol) against the float64 references, by dtype, for results without a
# same-dtype PyTorch counterpart (and kept as a second, absolute check beside the rule):
#  float64: summation order only (values are O(1)).
#  float32: float32 accumulation over up to a few hundred products of O(1) values
#           (eps 1.2e-7 times a growth of ~sqrt(n)*|logit| through exp) stays below 2e-5.
#  float16: computed in float32 and rounded once to fp16 (eps 9.8e-4): a few ulps of O(1) values.
#  bfloat16: the same with bf16's eps of 7.8e-3 (8 mantissa bits).
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
# Gradients are sums over more products (dS, dP) than the forward, and for half inputs the
# backward also reuses the half-rounded forward output in D_i = dout . out: double the float32 /
# half allowance; float64 stays at round-off level.
GRAD_TOL = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (5e-5, 5e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 6e-2),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "",
                 grad: bool = False, allow_inf: bool = False) -> None:
    """Every element of `got` (any dtype) equals `want` (float64) within TOL / GRAD_TOL of
    `dtype`; and `got` holds no NaN (nor inf unless allow_inf)."""
    atol, rtol = (GRAD_TOL if grad else TOL)[dtype]
    got64 = got.detach().to(torch.float64).cpu()
    want = want.detach().to(torch.float64).cpu()
    assert got64.shape == want.shape, f"{what}: shape {tuple(got64.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(got64).any(), f"{what}: NaN in the output"
    if not allow_inf:
        assert torch.isfinite(got64).all(), f"{what}: inf in the output"
    else:
        assert torch.equal(torch.isinf(got64), torch.isinf(want)), f"{what}: inf pattern differs"
        assert torch.equal(got64[torch.isinf(got64)], want[torch.isinf(want)]), f"{what}: inf sign"
        fin = torch.isfinite(want)
        got64, want = got64[fin], want[fin]
    torch.testing.assert_close(got64, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_pt_bound(what: str, got: torch.Tensor, want: torch.Tensor, pt: torch.Tensor,
                    dtype: torch.dtype, factor: float = None) -> None:
    """The tolerance rule of this module: every element of `got` within
    f(dtype) * max|pt - want| + 2 u(dtype) max|want| of the float64 `want` (float64:
    FLOAT64_TOL (1 + max|want|)); infinities of `want` matched exactly, NaN nowhere."""
    got = got.detach().to(torch.float64).cpu()
    want = want.detach().to(torch.float64).cpu()
    pt = pt.detach().to(torch.float64).cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{what}: {int(torch.isnan(got).sum())} NaN elements"
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf), f"{what}: the pattern of infinities differs"
    assert torch.equal(got[inf], want[inf]), f"{what}: the signs of infinities differ"
    fin = ~inf
    got, want, pt = got[fin], want[fin], pt[fin]
    if not want.numel():
        return
    big = want.abs().max().item()
    if dtype == torch.float64:
        pt_err, factor = 0.0, 0.0
        bound = FLOAT64_TOL * (1.0 + big)
    else:
        factor = PT_FACTOR[dtype] if factor is None else factor
        pt_err = (pt - want).abs().max().item() if torch.isfinite(pt).all() else math.inf
        bound = factor * pt_err + 2.0 * UNIT_ROUNDOFF[dtype] * big
    err = (got - want).abs()
    if err.max().item() > bound:
        w = int(err.argmax())
        raise AssertionError(
            f"{what}: max error {err.max().item():.3e} > {factor:g} x PyTorch's {pt_err:.3e} "
            f"+ 2u max|ref| = {bound:.3e} ({int((err > bound).sum())}/{err.numel()} elements "
            f"out; worst: got {got[w].item():.8g}, expected {want[w].item():.8g})")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulator / statistics type for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ============================================================================================
# PyTorch counterparts in the same dtype (the baseline of the tolerance rule)


def group_multiplicity(kv_index, kv_count, S, G, device):
    """[B, H, S(query), S(key)] float64: how often each key is listed for each query's group."""
    mult = key_multiplicity(kv_index.cpu(), kv_count.cpu(), S)
    return ref._expand_groups(mult, S, G).to(device)


def attention_pt(q, k, v, kv_index, kv_count, G, scale=None, stats_dtype=None):
    """Masked softmax attention on the listed keys with PyTorch ops in the input dtype (logits,
    softmax and the product with V all in q.dtype, as a user would write it; FlashAttention's
    `attention_ref(upcast=False)`). Differentiable. Returns (out [B, S, H, D], lse [B, H, S]);
    lse is formed in `stats_dtype` (default: the dtype) from inputs cast to it, the type the
    kernels return it in. A key listed twice weighs twice (log-multiplicity bias), a query
    without keys gets 0 and lse -inf, as in the reference."""
    B, S, H, D = q.shape
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    mult = group_multiplicity(kv_index, kv_count, S, G, q.device)
    bias64 = torch.where(mult > 0, mult.clamp(min=1.0).log(), torch.full_like(mult, -math.inf))
    empty = (mult.sum(-1) == 0)[..., None]

    def logits(dt, grad=True):
        qh, kh = ((t if grad else t.detach()).to(dt).permute(0, 2, 1, 3) for t in (q, k))
        s = (qh @ kh.transpose(-1, -2)) * sc + bias64.to(dt)
        return s.masked_fill(empty, 0.0)

    s = logits(q.dtype)
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    out = (p @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
    s2 = logits(stats_dtype or q.dtype, grad=False)
    lse = torch.logsumexp(s2, dim=-1).masked_fill(empty[..., 0], -math.inf)
    return out, lse


def predictor_loss_pt(q, k, q_lr, k_lr, rows, scale=None, cos_weight=0.95, norm_weight=0.05,
                      eps=1e-12, dtype=None):
    """The predictor loss formula of dsv.h with PyTorch ops in `dtype` (default q_lr.dtype);
    differentiable in q_lr and k_lr."""
    dt = dtype or q_lr.dtype
    D = q.shape[-1]
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rows = torch.as_tensor(rows, device=q.device).to(torch.int64)
    qh = q.detach().to(dt).permute(0, 2, 1, 3)[:, :, rows]
    kh = k.detach().to(dt).permute(0, 2, 1, 3)
    qlh = q_lr.to(dt).permute(0, 2, 1, 3)[:, :, rows]
    klh = k_lr.to(dt).permute(0, 2, 1, 3)
    z = (qh @ kh.transpose(-1, -2)) * sc
    p = qlh @ klh.transpose(-1, -2)
    nz = torch.sqrt((z * z).sum(-1) + eps)
    np_ = torch.sqrt((p * p).sum(-1) + eps)
    loss = cos_weight * (1.0 - (z * p).sum(-1) / (nz * np_)) + norm_weight * (np_ / nz - 1.0) ** 2
    return loss.mean(-1)


def scatter_add_rows_pt(src, index, num_rows, dtype=None):
    """index_add_ in `dtype` (default src's; rows out of range skipped)."""
    dt = dtype or src.dtype
    index = index.to(torch.int64)
    valid = (index >= 0) & (index < num_rows)
    out = torch.zeros(num_rows, src.shape[1], dtype=dt, device=src.device)
    return out.index_add_(0, index[valid], src[valid].to(dt))


# ============================================================================================
# poisoning


def poison(nbytes: int = 1 << 16) -> None:
    """Best-effort poisoning of the host heap: allocate and free NaN-filled blocks so that the
    next small CPU allocations (the ops' outputs) are likely to reuse NaN memory rather than
    fresh zero pages. Outputs are then checked element by element, so an element a kernel
    forgot to write shows up as NaN / garbage."""
    for n in (nbytes, nbytes // 4, nbytes // 16, 1024):
        t = torch.full((max(n // 8, 1),), float("nan"), dtype=torch.float64)
        del t


def poison_cache(nbytes, device="cuda", dtype=torch.float32):
    """Leave a freed block of this size filled with NaN of `dtype` in the CUDA caching
    allocator, so that a fresh output of the same size most likely starts as garbage (float32
    NaN reads as 0x7fc00000 through an int view)."""
    es = torch.empty((), dtype=dtype).element_size()
    t = torch.full((max(int(nbytes), 8) // es + 1,), float("nan"), dtype=dtype, device=device)
    del t


def poison_for(device, nbytes, dtype=torch.float32):
    """poison_cache on a CUDA device, poison on the host."""
    if str(device).startswith("cuda"):
        poison_cache(nbytes, device, dtype)
    else:
        poison(max(int(nbytes), 1 << 16))


# ============================================================================================
# index builders


def counts_for(B, H, kmax, gen, zero=False, one=False):
    """[B, H] int32 counts in [1, kmax], kmax on the first head; with enough heads, `zero` puts
    a count 0 on the second head, `one` a count 1 on the fourth, and a count of 64 (one whole
    64-key tile, where kmax allows) goes on the fifth."""
    cnt = torch.randint(1, kmax + 1, (B, H), generator=gen)
    flat = cnt.view(-1)
    flat[0] = kmax
    if zero and flat.numel() > 1:
        flat[1] = 0
    if one and flat.numel() > 3:
        flat[3] = 1
    if flat.numel() > 4:
        flat[4] = min(64, kmax)
    return cnt.to(torch.int32)


def index_lists(B, H, S, G, kmax, gen, kind="random", counts=None, pad="random"):
    """(kv_index, kv_count) of one of several kinds: "random" (distinct sorted keys, see
    random_index), "smooth" (runs of up to 16 neighbouring keys, what smooth video features
    give), "duplicates" (a key listed twice in each list: it counts twice), "padded" (lists
    shorter than the count, padded with -1; the last group all -1)."""
    if counts is None:
        counts = counts_for(B, H, kmax, gen)
    idx, cnt = random_index(B, H, S, G, kmax, counts, generator=gen, pad=pad)
    NG = idx.shape[2]
    if kind == "random":
        pass
    elif kind == "smooth":
        for b in range(B):
            for h in range(H):
                c = int(cnt[b, h])
                for g in range(NG):
                    run = max(1, min(c, 16))
                    keys = set()
                    for s0 in torch.randperm(max(S - run + 1, 1), generator=gen).tolist():
                        keys.update(range(s0, s0 + run))
                        if len(keys) >= c:
                            break
                    idx[b, h, g, :c] = torch.tensor(sorted(keys)[:c], dtype=torch.int32)
    elif kind == "duplicates":
        for b in range(B):
            for h in range(H):
                c = int(cnt[b, h])
                if c >= 2:
                    idx[b, h, :, c - 1] = idx[b, h, :, 0]
    elif kind == "padded":
        for b in range(B):
            for h in range(H):
                for g in range(NG):
                    keep = int(torch.randint(0, kmax + 1, (1,), generator=gen))
                    if g == NG - 1:
                        keep = 0
                    idx[b, h, g, keep:] = -1
    else:
        raise ValueError(f"kind: unknown index kind {kind!r}")
    return idx, cnt


# ============================================================================================
# ctypes bindings of the C API (csrc/dsv.h) for libraries built from csrc/cuda alone


class Bshd(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride_b", ctypes.c_int64),
                ("stride_s", ctypes.c_int64), ("stride_h", ctypes.c_int64)]


class AttnShape(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("seqlen", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("num_groups", ctypes.c_int64), ("kmax", ctypes.c_int64),
                ("scale", ctypes.c_double), ("dtype", ctypes.c_int),
                ("flags", ctypes.c_int),  # DSV_FLAG_* (DSV_FLAG_DETERMINISTIC = 1)
                ("kv_block", ctypes.c_int64)]  # keys per list entry: 1 = token lists


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
_libs = {}


def attn_shape(q, kv_index, G, scale, flags=0):
    """The dsv_attn_shape of a call on token lists (kv_block = 1)."""
    B, S, H, D = q.shape
    return AttnShape(B, S, H, D, G, kv_index.shape[2], kv_index.shape[3], float(scale),
                     DT[q.dtype], flags, 1)


def _bind_attn(lib):
    for name in ("dsv_sparse_attention_fwd_workspace_cuda",
                 "dsv_sparse_attention_bwd_workspace_cuda"):
        getattr(lib, name).restype = ctypes.c_size_t
        getattr(lib, name).argtypes = [ctypes.POINTER(AttnShape)]
    lib.dsv_sparse_attention_fwd_cuda.restype = ctypes.c_int
    lib.dsv_sparse_attention_fwd_cuda.argtypes = [
        ctypes.POINTER(AttnShape), Bshd, Bshd, Bshd, ctypes.c_void_p, ctypes.c_void_p,
        Bshd, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.dsv_sparse_attention_bwd_cuda.restype = ctypes.c_int
    lib.dsv_sparse_attention_bwd_cuda.argtypes = [
        ctypes.POINTER(AttnShape), Bshd, Bshd, Bshd, Bshd, Bshd, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, Bshd, Bshd, Bshd, ctypes.c_void_p,
        ctypes.c_size_t, ctypes.c_void_p]
    if hasattr(lib, "dsv_dev_sparse_attention_bwd_variant_cuda"):  # csrc/dev/attn_bwd_variants.cu
        f = lib.dsv_dev_sparse_attention_bwd_variant_cuda
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_char_p] + lib.dsv_sparse_attention_bwd_cuda.argtypes


def _bind_ops(lib):
    P, vp, sz, i64, i32 = (ctypes.POINTER, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64,
                           ctypes.c_int)
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


def get_lib(env="DSV_OPS_LIB"):
    """The ctypes library named by `env` (DSV_ATTN_LIB: attention kernels, DSV_OPS_LIB: the
    other ops), bound to the signatures of csrc/dsv.h; None when the variable is unset."""
    if env not in _libs:
        path = os.environ.get(env)
        if not path:
            return None
        lib = ctypes.CDLL(path)
        (_bind_attn if env == "DSV_ATTN_LIB" else _bind_ops)(lib)
        _libs[env] = lib
    return _libs[env]


def variant_entry_points(lib, name):
    """The (forward, backward) entry points of a csrc/dev attention variant in ``lib``
    (``dsv_dev_sparse_attention_{fwd,bwd}_<name>_cuda``: an int, 1 the variant / 0 the shipped
    kernels, then the arguments of the shipped C API), bound; None when ``lib`` lacks them."""
    if lib is None or not hasattr(lib, f"dsv_dev_sparse_attention_fwd_{name}_cuda"):
        return None
    out = []
    for pas in ("fwd", "bwd"):
        f = getattr(lib, f"dsv_dev_sparse_attention_{pas}_{name}_cuda")
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int] + list(getattr(lib, f"dsv_sparse_attention_{pas}_cuda").argtypes)
        out.append(f)
    return tuple(out)


def backend(env="DSV_OPS_LIB"):
    """How the CUDA kernels are reached: "ctypes" (the library named by `env`), "ops" (the
    built extension) or None."""
    if get_lib(env) is not None:
        return "ctypes"
    if have_ops():
        return "ops"
    return None


def attn_backend():
    """backend() of the attention kernels (DSV_ATTN_LIB)."""
    return backend("DSV_ATTN_LIB")


def bshd(t):
    assert t.stride(-1) == 1
    return Bshd(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _check(rc, what):
    assert rc == 0, f"{what}: status {rc}"


def _ws(nbytes):
    w = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device="cuda")
    w.fill_(0xA5)  # the kernels must not rely on a zeroed workspace
    return w


def _dsv():
    """torch.ops.dsv, the extension loaded (importing dsv_ext loads it)."""
    import dsv_ext  # noqa: F401
    return torch.ops.dsv


def _lib_for(t, env="DSV_OPS_LIB"):
    return None if t.device.type == "cpu" else get_lib(env)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ============================================================================================
# kernel access (outputs poisoned before every call)


class KernelError(RuntimeError):
    pass


def attn_fwd(q, k, v, kv_index, kv_count, G, scale, deterministic=False):
    """(out, lse) from the kernel of q's device; outputs poisoned with NaN before the call."""
    B, S, H, D = q.shape
    lib = _lib_for(q, "DSV_ATTN_LIB")
    if lib is None:
        poison_for(q.device, B * S * H * D * q.element_size(), q.dtype)
        poison_for(q.device, B * H * S * 4)
        return _dsv().sparse_attention_fwd(q, k, v, kv_index, kv_count, G, scale, deterministic)
    out = torch.full((B, S, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float32, device=q.device)
    sh = attn_shape(q, kv_index, G, scale, int(deterministic))
    ws = lib.dsv_sparse_attention_fwd_workspace_cuda(ctypes.byref(sh))
    work = torch.empty(max(ws, 1), dtype=torch.uint8, device=q.device)
    st = lib.dsv_sparse_attention_fwd_cuda(
        ctypes.byref(sh), bshd(q), bshd(k), bshd(v), kv_index.data_ptr(), kv_count.data_ptr(),
        bshd(out), lse.data_ptr(), work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise KernelError(f"dsv_sparse_attention_fwd_cuda returned {st}")
    return out, lse


def attn_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G, scale, deterministic=False):
    """(dq, dk, dv) from the kernel of q's device; outputs poisoned with NaN before the call."""
    B, S, H, D = q.shape
    lib = _lib_for(q, "DSV_ATTN_LIB")
    if lib is None:
        for _ in range(3):
            poison_for(q.device, B * S * H * D * q.element_size(), q.dtype)
        return _dsv().sparse_attention_bwd(dout, q, k, v, out, lse, kv_index, kv_count, G,
                                           scale, deterministic)
    dq, dk, dv = (torch.full((B, S, H, D), float("nan"), dtype=q.dtype, device=q.device)
                  for _ in range(3))
    sh = attn_shape(q, kv_index, G, scale, int(deterministic))
    ws = lib.dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh))
    work = torch.full(((max(ws, 16) + 3) // 4,), float("nan"), dtype=torch.float32, device=q.device)
    # DSV_DEV_BWD_VARIANT: a query-major variant of csrc/dev/attn_bwd_variants.cu (its library
    # as DSV_ATTN_LIB), e.g. "w128_nored"
    variant = os.environ.get("DSV_DEV_BWD_VARIANT")
    if variant:
        if not hasattr(lib, "dsv_dev_sparse_attention_bwd_variant_cuda"):
            raise KernelError("DSV_DEV_BWD_VARIANT needs DSV_ATTN_LIB = a csrc/dev/attn_bwd_variants.cu build")
        call = functools.partial(lib.dsv_dev_sparse_attention_bwd_variant_cuda, variant.encode())
        name = f"dsv_dev_sparse_attention_bwd_variant_cuda ({variant!r}; -1: not a variant's name)"
    else:
        call, name = lib.dsv_sparse_attention_bwd_cuda, "dsv_sparse_attention_bwd_cuda"
    st = call(
        ctypes.byref(sh), bshd(q), bshd(k), bshd(v), bshd(out), bshd(dout), lse.data_ptr(),
        kv_index.data_ptr(), kv_count.data_ptr(), bshd(dq), bshd(dk), bshd(dv),
        work.data_ptr(), ws, torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise KernelError(f"{name} returned {st}")
    return dq, dk, dv


def topk_estimate(q_lr, k_lr, kv_count, group_size, kmax, out=None, poison=True):
    """kv_index from the kernel of q_lr's device. poison=False (benchmarks): no poisoning, no
    synchronisation; `out` (ctypes backend only) reuses a preallocated output."""
    B, S, H, r = q_lr.shape
    NG = -(-S // group_size)
    lib = _lib_for(q_lr)
    if lib is None:
        if poison:
            poison_for(q_lr.device, B * H * NG * kmax * 4)
        return _dsv().topk_estimate(q_lr, k_lr, kv_count, group_size, kmax)
    if out is None:
        out = torch.empty((B, H, NG, kmax), dtype=torch.int32, device="cuda")
    if poison:
        out.fill_(-777)
    p = LowrankShape(B, S, H, r, group_size, NG, kmax, DT[q_lr.dtype])
    n = lib.dsv_topk_estimate_workspace_cuda(ctypes.byref(p))
    w = _ws(n) if poison else torch.empty(max(int(n), 1), dtype=torch.uint8, device="cuda")
    _check(lib.dsv_topk_estimate_cuda(ctypes.byref(p), bshd(q_lr), bshd(k_lr), _ptr(kv_count),
                                      _ptr(out), _ptr(w), n, _stream()), "topk_estimate")
    if poison:
        torch.cuda.synchronize()
    return out


def predictor_loss_fwd(q, k, q_lr, k_lr, rows, scale, cw, nw):
    """(loss [B, H], row_stats [B, H, R, 3]) from the raw kernel of q's device."""
    B, S, H, D = q.shape
    R = rows.numel()
    lib = _lib_for(q)
    if lib is None:
        poison_for(q.device, B * H * R * 3 * 8)
        return _dsv().predictor_loss_fwd(q, k, q_lr, k_lr, rows, scale, cw, nw)
    loss = torch.full((B, H), float("nan"), dtype=torch.float32, device="cuda")
    stats = torch.full((B, H, R, 3), float("nan"), dtype=torch.float32, device="cuda")
    p = PredictorShape(B, S, H, D, q_lr.shape[3], R, scale, cw, nw, DT[q.dtype])
    n = lib.dsv_predictor_loss_workspace_cuda(ctypes.byref(p))
    w = _ws(n)
    _check(lib.dsv_predictor_loss_fwd_cuda(ctypes.byref(p), bshd(q), bshd(k), bshd(q_lr),
                                           bshd(k_lr), _ptr(rows), _ptr(loss), _ptr(stats),
                                           _ptr(w), n, _stream()), "predictor_loss_fwd")
    torch.cuda.synchronize()
    return loss, stats


def predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, stats, scale, cw, nw):
    """(dq_lr, dk_lr) from the raw kernel of q's device."""
    B, S, H, D = q.shape
    R = rows.numel()
    lib = _lib_for(q)
    if lib is None:
        for _ in range(2):
            poison_for(q.device, q_lr.numel() * q_lr.element_size(), q_lr.dtype)
        return _dsv().predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, stats, scale, cw, nw)
    dq = torch.full(q_lr.shape, float("nan"), dtype=q_lr.dtype, device="cuda")
    dk = torch.full(k_lr.shape, float("nan"), dtype=k_lr.dtype, device="cuda")
    p = PredictorShape(B, S, H, D, q_lr.shape[3], R, scale, cw, nw, DT[q.dtype])
    n = lib.dsv_predictor_loss_workspace_cuda(ctypes.byref(p))
    w = _ws(n)
    _check(lib.dsv_predictor_loss_bwd_cuda(ctypes.byref(p), bshd(q), bshd(k), bshd(q_lr),
                                           bshd(k_lr), _ptr(rows), _ptr(dloss), _ptr(stats),
                                           bshd(dq), bshd(dk), _ptr(w), n, _stream()),
           "predictor_loss_bwd")
    torch.cuda.synchronize()
    return dq, dk


def profile_attention(q, k, rows, theta, scale, kv_index=None, kv_count=None, group_size=1):
    """(sparsity, recall) from the raw kernel of q's device."""
    B, S, H, D = q.shape
    R = rows.numel()
    lib = _lib_for(q)
    if lib is None:
        poison_for(q.device, B * H * 8)
        return _dsv().profile_attention(q, k, rows, theta, scale, kv_index, kv_count, group_size)
    sp = torch.full((B, H), float("nan"), dtype=torch.float32, device="cuda")
    rc = torch.full((B, H), -5.0, dtype=torch.float32, device="cuda")
    NG = kv_index.shape[2] if kv_index is not None else 0
    KM = kv_index.shape[3] if kv_index is not None else 0
    p = ProfileShape(B, S, H, D, R, group_size, NG, KM, scale, theta, DT[q.dtype])
    n = lib.dsv_profile_attention_workspace_cuda(ctypes.byref(p))
    w = _ws(n)
    st = lib.dsv_profile_attention_cuda(ctypes.byref(p), bshd(q), bshd(k), _ptr(rows),
                                        _ptr(kv_index), _ptr(kv_count), _ptr(sp), _ptr(rc),
                                        _ptr(w), n, _stream())
    if st != 0:
        raise KernelError(f"profile_attention (theta {theta}): status {st}")
    torch.cuda.synchronize()
    return sp, rc


def gather_rows(src, index):
    """dst [M, D] from the raw kernel of src's device (rows out of range zero-filled)."""
    lib = _lib_for(src)
    if lib is None:
        poison_for(src.device, index.numel() * src.shape[1] * src.element_size(), src.dtype)
        return _dsv().gather_rows(src, index)
    M, D = index.numel(), src.shape[1]
    dst = torch.empty((M, D), dtype=src.dtype, device="cuda")
    dst.view(torch.uint8).fill_(0x7F)
    _check(lib.dsv_gather_rows_cuda(DT[src.dtype], D, _ptr(src), src.stride(0), src.shape[0],
                                    _ptr(index), M, _ptr(dst), _stream()), "gather_rows")
    torch.cuda.synchronize()
    return dst


def scatter_add_rows(src, index, num_rows):
    """[num_rows, D] in src's dtype from the raw kernel of src's device (the ctypes kernel's
    accumulator cast to src's dtype, like torch.ops.dsv.scatter_add_rows)."""
    lib = _lib_for(src)
    if lib is None:
        poison_for(src.device, num_rows * src.shape[1] * 8)
        return _dsv().scatter_add_rows(src, index, num_rows)
    acc_dt = torch.float64 if src.dtype == torch.float64 else torch.float32
    acc = torch.zeros((num_rows, src.shape[1]), dtype=acc_dt, device="cuda")
    _check(lib.dsv_scatter_add_rows_cuda(DT[src.dtype], src.shape[1], _ptr(src), src.stride(0),
                                         _ptr(index), index.numel(), num_rows, _ptr(acc),
                                         _stream()), "scatter_add_rows")
    torch.cuda.synchronize()
    return acc.to(src.dtype)


# ============================================================================================
# sparse attention checks

# CUDA attention bounds (elementwise |x - ref| <= atol * rms(ref) + rtol * |ref|, plus a
# relative Frobenius norm bound), applied beside the tolerance rule: the kernels round P (and
# dS) to the input dtype before the tensor-core products and round the outputs once, so the
# error is a few units of the dtype's epsilon (bf16 2^-8, fp16 2^-11) of O(rms) values;
# gradients add one more rounded product (dS) and sums over many groups (dK, dV), hence twice
# the allowance. lse is computed from exact products with fp32 accumulation (and fast exp):
# 1e-3 absolute (PyTorch forms lse from rounded logits: no counterpart of the same accuracy).
CUDA_TOL = {torch.bfloat16: (1.6e-2, 2e-2, 1e-2), torch.float16: (2e-3, 3e-3, 1.5e-3)}
CUDA_GTOL = {torch.bfloat16: (3.2e-2, 4e-2, 2e-2), torch.float16: (4e-3, 6e-3, 3e-3)}


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
    """CUDA lse: the same -inf pattern as the reference, 1e-3 absolute elsewhere."""
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
    """Reference gradients for the CUDA kernel's definition, and elementwise rounding slack.

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


def make_inputs(B, S, H, D, dtype, gen, layout="contiguous", device="cuda"):
    """q, k, v of make_qkv on `device` (default CUDA)."""
    return make_qkv(B, S, H, D, dtype=dtype, layout=layout, generator=gen, device=device)


def check_attention(q, k, v, kv_index, kv_count, G, scale=None, gen=None, grads=True,
                    check_index=True, public=None, tamper=None):
    """Forward (out, lse) and backward (dq, dk, dv) of the kernels of q's device against the
    float64 reference, every element, outputs poisoned before each run.

    Both devices: the raw kernels (attn_fwd / attn_bwd; ctypes when DSV_ATTN_LIB is set) under
    the tolerance rule (`assert_pt_bound` against `attention_pt` in the input dtype) for out
    and the gradients. CPU: lse by the rule too (PyTorch's logsumexp in the lse type), the
    derived bounds TOL / GRAD_TOL, and the public op (`dsv_ext.sparse_attention`): its output
    bit-equal to the raw op's, its gradients through autograd bit-equal to the raw backward's.
    CUDA: also the
    derived elementwise bounds (CUDA_TOL / CUDA_GTOL with `grad_targets`, `check_lse`); with
    public=True also the public op, its results under the rule (the CUDA backward sums with
    atomics: not bit-equal from run to run). `tamper(name, tensor) -> tensor` (tests of the
    check) may alter a kernel result before it is checked."""
    tamper = tamper or (lambda name, t: t)
    dtype, dev = q.dtype, q.device
    B, S, H, D = q.shape
    cpu = dev.type == "cpu"
    if public is None:
        public = cpu
    sc = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    kv_index, kv_count = kv_index.to(dev), kv_count.to(dev)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = attn_fwd(qd, kd, vd, kv_index, kv_count, G, sc)
    sync(dev)
    acc = acc_dtype(dtype) if cpu else torch.float32
    assert out.dtype == dtype and out.shape == (B, S, H, D) and out.is_contiguous()
    assert lse.dtype == acc and lse.shape == (B, H, S)
    if public:
        import dsv_ext
        qg, kg, vg = (t.detach().requires_grad_(grads) for t in (q, k, v))
        poison_for(dev, B * S * H * D * q.element_size(), dtype)
        out_pub = dsv_ext.sparse_attention(qg, kg, vg, kv_index, kv_count, G, scale=scale,
                                           check_index=check_index, deterministic=False)
        if cpu:
            assert torch.equal(out, out_pub.detach()), "public op and raw op disagree"
    out, lse = tamper("out", out), tamper("lse", lse)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(grads) for t in (q, k, v))
    out_ref, lse_ref = sparse_attention_lse_ref(qr, kr, vr, kv_index.cpu(), kv_count.cpu(), G, sc)
    qp, kp, vp = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    out_pt, lse_pt = attention_pt(qp, kp, vp, kv_index, kv_count, G, sc, stats_dtype=acc)
    assert_pt_bound("out", out, out_ref, out_pt, dtype)
    if cpu:
        # CUDA lse: exp2-based fp32 statistics, bounded by check_lse below
        assert_pt_bound("lse", lse, lse_ref, lse_pt, acc)
    if public and not cpu:
        assert_pt_bound("out (public op)", out_pub, out_ref, out_pt, dtype)
    if cpu:
        assert_close(out, out_ref, dtype, "out")
        # lse is kept in the accumulator type (float32 for half inputs): float32's tolerance
        assert_close(lse, lse_ref, acc, "lse", allow_inf=True)
    else:
        check_close("out", out, out_ref.detach(), CUDA_TOL[dtype])
        check_lse(lse, lse_ref.detach())
    if not grads:
        return
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(dtype)
    out_ref.backward(dout.double())
    dout = dout.to(dev)
    out_pt.backward(dout)
    got = attn_bwd(dout, qd, kd, vd, out, lse, kv_index, kv_count, G, sc)
    sync(dev)
    if public:
        poison_for(dev, B * S * H * D * q.element_size(), dtype)
        pub = torch.autograd.grad(out_pub, (qg, kg, vg), dout)
        for name, a, b in zip(("dq", "dk", "dv"), got, pub):
            if cpu:
                assert torch.equal(a, b), f"{name}: public op and raw op disagree"
    got = [tamper(n, g) for n, g in zip(("dq", "dk", "dv"), got)]
    for name, g, r, p in zip(("dq", "dk", "dv"), got, (qr.grad, kr.grad, vr.grad),
                             (qp.grad, kp.grad, vp.grad)):
        assert g.dtype == dtype and g.shape == q.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_pt_bound(name, g, r, p, dtype)
        if public and not cpu:
            assert_pt_bound(name + " (public op)", pub[("dq", "dk", "dv").index(name)], r, p,
                            dtype)
        if cpu:
            assert_close(g, r, dtype, name, grad=True)
    if not cpu:
        targets = grad_targets(q, k, v, dout.cpu(), out, out_ref, lse_ref,
                               (qr.grad, kr.grad, vr.grad), kv_index, kv_count, G, sc, dtype)
        for name, g, (t, sl) in zip(("dq", "dk", "dv"), got, targets):
            check_close(name, g, t, CUDA_GTOL[dtype], sl)


def check_public_attention(q, k, v, kv_index, kv_count, G, gen, check_index=True):
    """The public op alone (dsv_ext.sparse_attention, as the modules call it: e.g. heads run
    zero-padded) against the float64 reference under the tolerance rule: out, dq, dk, dv, every
    element, the allocator poisoned before each call."""
    import dsv_ext
    dtype, dev = q.dtype, q.device
    B, S, H, D = q.shape
    sc = 1.0 / math.sqrt(D)
    kv_index, kv_count = kv_index.to(dev), kv_count.to(dev)
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    poison_for(dev, B * S * H * D * q.element_size(), dtype)
    out = dsv_ext.sparse_attention(qg, kg, vg, kv_index, kv_count, G, check_index=check_index)
    assert out.dtype == dtype and out.shape == (B, S, H, D) and out.is_contiguous()
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out_ref, _ = sparse_attention_lse_ref(qr, kr, vr, kv_index.cpu(), kv_count.cpu(), G, sc)
    qp, kp, vp = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    acc = acc_dtype(dtype) if dev.type == "cpu" else torch.float32
    out_pt, _ = attention_pt(qp, kp, vp, kv_index, kv_count, G, sc, stats_dtype=acc)
    assert_pt_bound("out", out, out_ref, out_pt, dtype)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(dtype)
    out_ref.backward(dout.double())
    out_pt.backward(dout.to(dev))
    poison_for(dev, B * S * H * D * q.element_size(), dtype)
    got = torch.autograd.grad(out, (qg, kg, vg), dout.to(dev))
    for name, g, r, p in zip(("dq", "dk", "dv"), got, (qr.grad, kr.grad, vr.grad),
                             (qp.grad, kp.grad, vp.grad)):
        assert g.dtype == dtype and g.shape == q.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_pt_bound(name, g, r, p, dtype)
    return out, got


def run_and_check(q, k, v, kv_index, kv_count, G, scale, gen, grads=True):
    """check_attention with an explicit scale (the CUDA tests' spelling)."""
    check_attention(q, k, v, kv_index, kv_count, G, scale, gen, grads=grads)


# ============================================================================================
# top-K checks


def group_scores(q_lr, k_lr, G, device=None):
    """([B, H, NG, S] float64 group-mean scores, [B, H, NG, S] magnitudes sum_c |rep_c k_c|) as
    the kernels of `device` (default q_lr's) form the group means: in float64 on the CPU, as an
    fp32 mean on CUDA."""
    device = str(device or q_lr.device)
    B, S, H, r = q_lr.shape
    NG = -(-S // G)
    if device.startswith("cuda"):
        q = q_lr.float()
        rep = torch.stack([q[:, g * G:min(S, (g + 1) * G)].mean(dim=1) for g in range(NG)],
                          dim=2).double()  # [B, H, NG, r] (fp32 means)
    else:
        qh = q_lr.double().permute(0, 2, 1, 3)
        rep = torch.stack([qh[:, :, g * G:min(S, (g + 1) * G)].mean(dim=2) for g in range(NG)],
                          dim=2)
    kk = k_lr.double().permute(0, 2, 3, 1)  # [B, H, r, S]
    return (rep @ kk).cpu(), (rep.abs() @ kk.abs()).cpu()


# Selection tolerance, relative to max_j sum_c |rep_c k_jc| of each group: the CPU kernels form
# the scores in float64 from the same input values as the reference (only summation order
# differs: 1e-12); the CUDA kernel's scores are exact 16-bit products accumulated in fp32 with an
# fp32 mean (a few fp32 roundings: 2^-16 is generous against 2^-24 per operation and far below
# the gaps that a wrong selection produces).
TOPK_TOL = {"cpu": 1e-12, "cuda": 2.0 ** -16}


def check_topk(out, q_lr, k_lr, kv_count, G, kmax, exact=None, device=None):
    """Every list of `out` (int32 [B, H, NG, kmax]): the first K = clamp(count, 0, min(kmax, S))
    entries distinct positions in [0, S), strictly ascending, -1 after; every selected key
    scores >= T - tol and every other key <= T + tol, T the K-th largest float64 score
    (TOPK_TOL: exact ties may go either way). exact="torch": `out` equals topk_ref (torch.topk)
    exactly; exact="stable": the stable top-K (equal scores: lower position first)."""
    device = str(device or q_lr.device).split(":")[0]
    B, S, H, r = q_lr.shape
    NG = -(-S // G)
    assert out.dtype == torch.int32 and out.shape == (B, H, NG, kmax), \
        f"kv_index: {out.dtype} {tuple(out.shape)}"
    assert out.is_contiguous()
    out = out.cpu()
    sc, mag = group_scores(q_lr, k_lr, G, device)
    cnt = kv_count.cpu().to(torch.int64).clamp(0, kmax).clamp(max=S)
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
            if exact == "stable":
                order = torch.sort(-s, dim=1, stable=True).indices[:, :K]
                want = torch.sort(order, dim=1).values
                assert torch.equal(sel, want), f"(b={b}, h={h}): exact tie-broken top-K differs"
                continue
            tol = TOPK_TOL[device] * mag[b, h].max(dim=1).values  # [NG]
            kth = torch.topk(s, K, dim=1).values[:, -1]  # [NG]
            got = torch.gather(s, 1, sel)
            assert (got >= (kth - tol)[:, None]).all(), \
                f"(b={b}, h={h}): a selected key scores below the K-th largest"
            mask = torch.ones_like(s, dtype=torch.bool)
            mask.scatter_(1, sel, False)
            rest = torch.where(mask, s, torch.full_like(s, -math.inf))
            assert (rest.max(dim=1).values <= kth + tol).all(), \
                f"(b={b}, h={h}): an unselected key scores above the K-th largest"
    if exact == "torch":
        assert torch.equal(out, topk_ref(q_lr.cpu(), k_lr.cpu(), kv_count.cpu(), G, kmax)), \
            "kv_index differs from torch.topk's lists"


def lowrank(B, S, H, r, dtype, gen, layout="packed", device="cpu"):
    """q_lr, k_lr [B, S, H, r]: "packed" / "bhsd" / "packed_d" as make_qkv; "padded": rows of
    r + 3 elements (not 16-byte aligned), a slice of a bigger tensor."""
    if layout != "padded":
        return make_qkv(B, S, H, r, dtype, layout=layout, generator=gen, device=device, n=2)
    q, k = make_qkv(B, S, H, r + 3, dtype, layout="contiguous", generator=gen, device=device,
                    n=2)
    return q[..., 1:r + 1], k[..., 1:r + 1]
