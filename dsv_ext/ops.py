"""The dsv ops: fake (meta) kernels, autograd, and the validated public functions.

The kernels live in the compiled extension ``dsv_ext._C`` (C reference kernels on the CPU, CUDA
kernels on the GPU) and are registered as ``torch.ops.dsv.*`` through PyTorch's stable ABI. This
module adds what PyTorch needs around them (fake kernels for ``torch.compile`` and meta tensors,
autograd formulas) and the public functions of the package, which check their arguments and raise
``ValueError`` / ``TypeError`` messages that start with the name of the offending argument.

See ``docs/API.md`` for the op contract and ``csrc/dsv.h`` for the exact semantics of each kernel.
"""
from __future__ import annotations

import functools
import glob
import math
import numbers
import operator
import os
from typing import NamedTuple, Optional

import torch

__all__ = [
    "sparse_attention",
    "topk_estimate",
    "expand_block_lists",
    "predictor_loss",
    "profile_attention",
    "ProfileResult",
    "gather_rows",
    "scatter_add_rows",
    "has_cuda_kernels",
    "kernel_tuning",
    "DEFAULT_COS_WEIGHT",
    "DEFAULT_NORM_WEIGHT",
]

DEFAULT_COS_WEIGHT = 0.95
DEFAULT_NORM_WEIGHT = 0.05
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _load_extension() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))
    if not found:
        raise ImportError(
            "dsv_ext: the compiled extension dsv_ext/_C*.so was not found. Build it with "
            "`pip install --no-build-isolation -e .` from the repository root (torch must be "
            "installed first).")
    torch.ops.load_library(found[0])


_load_extension()
_ops = torch.ops.dsv


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("dsv::sparse_attention_fwd", "CUDA")


# the keys that DSV_KERNEL_TUNING may set (csrc/cuda/tuning.cu)
KERNEL_TUNING_KEYS = ("sm_count", "l2_bytes", "wgmma", "km_wgmma", "g128", "qm_wgmma", "wg256",
                      "km_ratio", "merge", "merge_window", "bwd_ranges", "bwd_rmax", "tk_gpw", "tk_sample",
                      "tk_band", "tk_compact", "tk_split")


def _check_tuning_env() -> None:
    """ValueError naming DSV_KERNEL_TUNING when it is not "key=value,..." with known keys and
    numeric values (the kernels refuse it too; this names the offending part)."""
    spec = os.environ.get("DSV_KERNEL_TUNING")
    if not spec:
        return
    for part in spec.split(","):
        if not part:
            continue
        key, eq, val = part.partition("=")
        if not eq:
            raise ValueError(f"DSV_KERNEL_TUNING: expected key=value, got {part!r}")
        if key not in KERNEL_TUNING_KEYS:
            raise ValueError(f"DSV_KERNEL_TUNING: unknown key {key!r}; the keys are "
                             + ", ".join(KERNEL_TUNING_KEYS))
        try:
            float(val)
        except ValueError:
            raise ValueError(f"DSV_KERNEL_TUNING: {key} must be a number, got {val!r}") from None


def kernel_tuning(device=None) -> dict:
    """The kernel tuning the CUDA kernels use on ``device`` (an index, ``"cuda:N"`` or a
    ``torch.device``; default the current device): ``sm_count``, ``l2_bytes``, ``cc`` (compute
    capability, 10 major + minor), ``wgmma`` (1: the Hopper warpgroup-MMA kernels run),
    ``km_wgmma`` (1, the default: the backward's key-major dK / dV pass among them where it
    applies, 2: for ``kv_block`` 16 too, 0: never), ``g128`` (1, the default: query groups of a
    multiple of 128 queries run 128 rows per CTA on two warpgroups sharing the key tiles where
    wgmma runs, 0: two CTAs of 64 rows), ``qm_wgmma`` (1, the default: the backward's
    query-major pass with dK / dV reductions of the other groups of 64 queries or more on a
    64-row wgmma kernel where wgmma runs, 0: on mma.sync), ``wg256`` (1, the default: the
    forward at head dim 256 on the wgmma kernel where wgmma runs, 0: on mma.sync), ``km_ratio``
    (the backward's key-major threshold),
    ``merge`` (groups of 16 / 32 / 64 queries: the groups of a 128-query block run as one
    128-row CTA over the union of their lists when it has at most ``merge`` x (128 / G) x K
    entries, in the backward and at G 16 / 32 in the forward; 0.75 by default, 0: never),
    ``merge_window`` (keys per window of the union builder; 0, the default: from its shared
    memory; for tests),
    ``bwd_ranges`` / ``bwd_rmax`` (the backward's key ranges: forced count / the automatic
    rule's most; 0 = automatic), ``tk_gpw`` (the top-K estimation's query groups per warp: 16,
    8, or 0, the default: automatic), ``tk_sample`` (1, the default: the estimation locates each
    group's threshold from a 1/16 sample of the keys first; 0: radix passes only), ``tk_band``
    (1, the default: the band pass stores its keys without a histogram, built from the stored
    keys afterwards, where they fit the buffer with room; 2: wherever they are stored; 0: the
    band pass always counts), ``tk_compact`` (1, the default: the compaction places the selected
    keys from the band pass's key masks, with a workspace of S / 4 bytes per query group, up to
    1 GiB; 0: it rescores every key), ``tk_split``
    (1: one CTA per set of query groups; 2, 4, 8: clusters of that many CTAs, each scoring its part
    of the keys; 0, the default: automatic, 1, or 2 to 8 where the grid is small).
    It is chosen once per device; the environment variable
    ``DSV_KERNEL_TUNING="key=value,..."`` overrides keys for experiments.
    A build without CUDA kernels gives ``{"cuda_kernels": 0}``.

    >>> import dsv_ext.ops
    >>> isinstance(dsv_ext.ops.kernel_tuning(), dict)
    True
    """
    if not has_cuda_kernels():
        return {"cuda_kernels": 0}
    if device is None:
        if not torch.cuda.is_available():
            return {"cuda_kernels": 1, "devices": 0}
        device = torch.cuda.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {device}")
        device = device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise TypeError(f"device: expected an int, str or torch.device, got {type(device).__name__}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= device < n:
        raise ValueError(f"device: no CUDA device {device} ({n} visible)")
    _check_tuning_env()
    raw = bytes(_ops.kernel_tuning(int(device)).tolist()).decode()
    out = {}
    for part in raw.split(","):
        key, _, val = part.partition("=")
        num = float(val)
        out[key] = int(num) if num.is_integer() and key not in ("km_ratio", "merge") else num
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# fake kernels (shapes and dtypes only; used by torch.compile, meta tensors and opcheck)

@torch.library.register_fake("dsv::sparse_attention_fwd")
def _sparse_attention_fwd_fake(q, k, v, kv_index, kv_count, group_size, scale, deterministic=False, kv_block=1):
    B, S, H, D = q.shape
    return q.new_empty(B, S, H, D), q.new_empty(B, H, S, dtype=_acc_dtype(q.dtype))


@torch.library.register_fake("dsv::sparse_attention_bwd")
def _sparse_attention_bwd_fake(dout, q, k, v, out, lse, kv_index, kv_count, group_size, scale,
                               deterministic=False, kv_block=1):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


@torch.library.register_fake("dsv::topk_estimate")
def _topk_estimate_fake(q_lr, k_lr, kv_count, group_size, kmax):
    B, S, H, _ = q_lr.shape
    return q_lr.new_empty(B, H, -(-S // group_size), kmax, dtype=torch.int32)


@torch.library.register_fake("dsv::predictor_loss_fwd")
def _predictor_loss_fwd_fake(q, k, q_lr, k_lr, rows, scale, cos_weight, norm_weight):
    B, _, H, _ = q.shape
    acc = _acc_dtype(q.dtype)
    return q.new_empty(B, H, dtype=acc), q.new_empty(B, H, rows.shape[0], 3, dtype=acc)


@torch.library.register_fake("dsv::predictor_loss_bwd")
def _predictor_loss_bwd_fake(dloss, q, k, q_lr, k_lr, rows, row_stats, scale, cos_weight, norm_weight):
    return q_lr.new_empty(q_lr.shape), q_lr.new_empty(q_lr.shape)


@torch.library.register_fake("dsv::profile_attention")
def _profile_attention_fake(q, k, rows, theta, scale, kv_index, kv_count, group_size):
    B, _, H, _ = q.shape
    acc = _acc_dtype(q.dtype)
    return q.new_empty(B, H, dtype=acc), q.new_empty(B, H, dtype=acc)


@torch.library.register_fake("dsv::gather_rows")
def _gather_rows_fake(src, index):
    return src.new_empty(index.shape[0], src.shape[1])


@torch.library.register_fake("dsv::scatter_add_rows")
def _scatter_add_rows_fake(src, index, num_rows):
    return src.new_empty(num_rows, src.shape[1])


# ---------------------------------------------------------------------------------------------
# autograd

def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:  # an empty gradient may come with any strides (e.g. expanded)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _sparse_attention_setup(ctx, inputs, output):
    q, k, v, kv_index, kv_count, group_size, scale = inputs[:7]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_index, kv_count)
    ctx.group_size = group_size
    ctx.scale = scale
    ctx.deterministic = bool(inputs[7]) if len(inputs) > 7 else False
    ctx.kv_block = int(inputs[8]) if len(inputs) > 8 else 1


def _sparse_attention_backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_index, kv_count = ctx.saved_tensors
    if dout is None:
        return None, None, None, None, None, None, None, None, None
    # the CUDA backward loads dout rows with 16-byte vectors, like q/k/v in the forward
    dq, dk, dv = _ops.sparse_attention_bwd(_kernel_ready(_last_dim_contiguous(dout)), q, k, v, out, lse, kv_index,
                                           kv_count, ctx.group_size, ctx.scale, ctx.deterministic, ctx.kv_block)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("dsv::sparse_attention_fwd", _sparse_attention_backward,
                                setup_context=_sparse_attention_setup)


def _predictor_loss_setup(ctx, inputs, output):
    q, k, q_lr, k_lr, rows, scale, cos_weight, norm_weight = inputs
    _, row_stats = output
    ctx.save_for_backward(q, k, q_lr, k_lr, rows, row_stats)
    ctx.params = (scale, cos_weight, norm_weight)


def _predictor_loss_backward(ctx, dloss, dstats):
    q, k, q_lr, k_lr, rows, row_stats = ctx.saved_tensors
    if dloss is None:
        return None, None, None, None, None, None, None, None
    dloss = dloss.to(row_stats.dtype).contiguous()
    dq_lr, dk_lr = _ops.predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, row_stats, *ctx.params)
    return None, None, dq_lr, dk_lr, None, None, None, None


torch.library.register_autograd("dsv::predictor_loss_fwd", _predictor_loss_backward,
                                setup_context=_predictor_loss_setup)


def _gather_rows_setup(ctx, inputs, output):
    src, index = inputs
    ctx.save_for_backward(index)
    ctx.num_rows = src.shape[0]


def _gather_rows_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return _ops.scatter_add_rows(_last_dim_contiguous(grad), index, ctx.num_rows), None


torch.library.register_autograd("dsv::gather_rows", _gather_rows_backward, setup_context=_gather_rows_setup)


def _scatter_add_rows_setup(ctx, inputs, output):
    _, index, _ = inputs
    ctx.save_for_backward(index)


def _scatter_add_rows_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return _ops.gather_rows(_last_dim_contiguous(grad), index), None, None


torch.library.register_autograd("dsv::scatter_add_rows", _scatter_add_rows_backward,
                                setup_context=_scatter_add_rows_setup)


# ---------------------------------------------------------------------------------------------
# argument checks (messages start with the argument's name)

def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _check_activation(name: str, t, ref: Optional[torch.Tensor] = None, ref_name: str = "q",
                      last_dim: Optional[int] = None) -> None:
    """A [B, S, H, D] floating tensor with a contiguous last dim, matching ``ref``."""
    _check_tensor(name, t)
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-d [B, S, H, D] tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32, float64, float16 or bfloat16, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1 and t.numel() > 0:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")
    if t.shape[-1] == 0:
        raise ValueError(f"{name}: the last dim (head dim) must not be empty")
    if ref is not None:
        if t.device != ref.device:
            raise ValueError(f"{name}: on {t.device}, but {ref_name} is on {ref.device}")
        if t.dtype != ref.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {ref_name}'s {ref.dtype}")
        want = tuple(ref.shape[:3]) + ((ref.shape[3],) if last_dim is None else (last_dim,))
        if last_dim == -1:
            want = tuple(ref.shape[:3]) + (t.shape[3],)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} to match {ref_name}, got {tuple(t.shape)}")


_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def _check_cuda_dtype(name: str, t: torch.Tensor) -> None:
    """The CUDA attention-type kernels take half types; say so before the kernel refuses."""
    if t.is_cuda and t.dtype not in _CUDA_DTYPES:
        raise TypeError(
            f"{name}: the CUDA kernels take bfloat16 or float16, got {t.dtype}; cast the inputs "
            f"(the dsv_ext modules do this under torch.autocast), or use CPU tensors for float32/float64")


_INT64_MAX = 2**63 - 1


def _as_int(name: str, x, what: str = "an int") -> int:
    """A Python int from an int-like value (int, numpy integer, 0-d integer tensor); bools and
    floats are refused (operator.index(True) would pass it as 1)."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        raise TypeError(f"{name}: expected {what}, got bool")
    try:
        return int(operator.index(x))
    except TypeError:
        raise TypeError(f"{name}: expected {what}, got {type(x).__name__}") from None


def _check_group_size(group_size, seqlen: Optional[int] = None) -> int:
    """A positive int. Groups larger than the sequence are one group of S queries, so a huge
    group_size is clamped to max(S, 1) (same lists, same result) before it reaches C."""
    group_size = _as_int("group_size", group_size)
    if group_size <= 0:
        raise ValueError(f"group_size: must be a positive int, got {group_size}")
    if seqlen is not None:
        group_size = min(group_size, max(int(seqlen), 1))
    elif group_size > _INT64_MAX:
        raise ValueError(f"group_size: must be at most 2**63 - 1, got {group_size}")
    return group_size


def _check_kv_block(kv_block, seqlen: int) -> int:
    """A positive int. A block larger than the sequence is one block of S keys (the same lists,
    the same result), so kv_block is clamped to max(S, 1) before it reaches C."""
    kv_block = _as_int("kv_block", kv_block, "a positive int")
    if kv_block < 1:
        raise ValueError(f"kv_block: must be a positive int (1: token lists), got {kv_block}")
    return min(kv_block, max(int(seqlen), 1))


# The CUDA block-list kernels that sparse_attention runs: 64-key blocks (head_dim <= 128, Kmax <=
# 16384: the block backward's limits). 16-key lists run faster expanded to token lists (their
# block kernels do ~1.3x worse at S = 64k, benchmarks/PERF_LOG.md, kernels v14), so they are
# expanded, as every other block size is.
_CUDA_NATIVE_KV_BLOCKS = (64,)


def _native_kv_block(device: torch.device, kv_block: int, head_dim: int, kmax: int) -> bool:
    """Whether the sparse-attention kernels of ``device`` read these block lists themselves: the
    CPU reference always does; on CUDA 64-key lists run on the block kernels (head_dim <= 128,
    Kmax <= 16384) and :func:`sparse_attention` expands every other block list to token lists
    first (:func:`expand_block_lists`)."""
    if torch.device(device).type != "cuda":
        return True
    return kv_block in _CUDA_NATIVE_KV_BLOCKS and head_dim <= 128 and kmax <= 16384


def expand_block_lists(kv_index: torch.Tensor, kv_count: torch.Tensor, kv_block: int,
                       seqlen: int) -> tuple:
    """Token lists equivalent to block lists: ``(index, count)`` with index int32
    ``[B, H, NG, Kmax * kv_block]`` and count int32 ``[B, H]`` = ``clamp(kv_count, 0, Kmax) *
    kv_block``.

    Entry ``e`` of a block list becomes the keys ``e*b .. e*b+b-1`` in place; keys at or past
    ``seqlen`` (the partial last block) and every key of an entry outside ``[0, ceil(S/b))``
    become ``-1``, which the kernels skip, so the token lists give exactly the result of the
    block lists (duplicated blocks still count twice). Memory is that of a token list of the
    same number of keys. No host sync (traceable by torch.compile); ``kv_block = 1`` returns the
    inputs as they are.

    >>> import torch, dsv_ext
    >>> idx = torch.tensor([[[[1, 0, -1]]]], dtype=torch.int32)
    >>> cnt = torch.tensor([[2]], dtype=torch.int32)
    >>> t, c = dsv_ext.expand_block_lists(idx, cnt, 4, seqlen=6)
    >>> t.tolist(), c.tolist()
    ([[[[4, 5, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1]]]], [[8]])
    """
    b = int(kv_block)
    if b == 1:
        return kv_index, kv_count
    B, H, NG, KM = kv_index.shape
    nb = -(-int(seqlen) // b)
    valid = (kv_index >= 0) & (kv_index < nb)
    base = torch.where(valid, kv_index, torch.zeros_like(kv_index)).to(torch.int32) * b  # < S + b
    keys = base.unsqueeze(-1) + torch.arange(b, dtype=torch.int32, device=kv_index.device)
    keys = torch.where(valid.unsqueeze(-1) & (keys < seqlen), keys, torch.full_like(keys, -1))
    count = (kv_count.clamp(0, KM) * b).to(torch.int32)
    return keys.view(B, H, NG, KM * b), count.contiguous()


def _finite_float(name: str, x, expected: str = "a float") -> float:
    """x as a finite Python float; TypeError / ValueError naming the argument otherwise."""
    if isinstance(x, (bool, str, bytes)):
        raise TypeError(f"{name}: expected {expected}, got {type(x).__name__}")
    try:
        x = float(x)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name}: expected {expected}, got {type(x).__name__}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name}: must be finite, got {x}")
    return x


def _check_weight(name: str, x) -> float:
    if not isinstance(x, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    return _finite_float(name, x)


def _scale_of(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _finite_float("scale", scale, "a float or None")


_SIGNED_INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _check_index_dtype(name: str, t: torch.Tensor, want: str) -> None:
    """Signed integer dtypes (and uint8, whose values convert exactly). Wider unsigned dtypes
    are refused: uint64 2**32 + 3 would wrap to 3 in int32, and past 2**63 to a negative int64."""
    if t.dtype not in _SIGNED_INDEX_DTYPES:
        raise TypeError(f"{name}: expected a signed integer tensor ({want}), got {t.dtype}")


def _as_int32(name: str, t, device: torch.device, ref_name: str = "q") -> torch.Tensor:
    _check_tensor(name, t)
    _check_index_dtype(name, t, "int32 or int64")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but {ref_name} is on {device}")
    if t.dtype == torch.int64:  # saturate: a wrapped value could land inside the valid range
        t = t.clamp(-2**31, 2**31 - 1)
    return t.to(torch.int32).contiguous()


def _check_counts(kv_count: torch.Tensor, B: int, H: int) -> None:
    if tuple(kv_count.shape) != (B, H):
        raise ValueError(f"kv_count: expected shape ({B}, {H}) = [B, H], got {tuple(kv_count.shape)}")


def _check_index(kv_index: torch.Tensor, kv_count: torch.Tensor, B: int, S: int, H: int,
                 group_size: int, check_values: bool, kv_block: int = 1) -> None:
    ng = -(-S // group_size)
    if kv_index.dim() != 4 or tuple(kv_index.shape[:3]) != (B, H, ng):
        raise ValueError(
            f"kv_index: expected shape [B, H, ceil(S/G), Kmax] = [{B}, {H}, {ng}, Kmax] for S={S}, "
            f"G={group_size}, got {tuple(kv_index.shape)}")
    _check_counts(kv_count, B, H)
    if not check_values or kv_index.numel() == 0 and kv_count.numel() == 0:
        return
    kmax = kv_index.shape[3]
    lo, hi = (int(x) for x in torch.aminmax(kv_count)) if kv_count.numel() else (0, 0)
    if lo < 0 or hi > kmax:
        raise ValueError(f"kv_count: values must be in [0, Kmax={kmax}], got min {lo}, max {hi}")
    if kv_index.numel() == 0:
        return
    used = torch.arange(kmax, device=kv_index.device) < kv_count[:, :, None, None]
    top = S if kv_block == 1 else -(-S // kv_block)
    bad = used & ((kv_index < 0) | (kv_index >= top))
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        what = f"S={S})" if kv_block == 1 else f"ceil(S/kv_block)={top}) (block ids; S={S}, kv_block={kv_block})"
        raise ValueError(
            f"kv_index: entry {tuple(where)} = {int(kv_index[tuple(where)])} is outside [0, {what} "
            f"(only the first kv_count[b, h] entries of each list are used and checked)")


def _check_rows(rows, S: int, device: torch.device, check_values: bool) -> torch.Tensor:
    rows = _as_int32("rows", rows, device)
    if rows.dim() != 1:
        raise ValueError(f"rows: expected a 1-d tensor of query positions, got shape {tuple(rows.shape)}")
    if rows.numel() == 0:
        raise ValueError("rows: expected at least one query position (results are means over rows), got none")
    if check_values and rows.numel():
        lo, hi = (int(x) for x in torch.aminmax(rows))
        if lo < 0 or hi >= S:
            raise ValueError(f"rows: positions must be in [0, S={S}), got min {lo}, max {hi}")
    return rows


try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover
    def _is_fake(t: torch.Tensor) -> bool:
        return False


def _misaligned(t: torch.Tensor) -> bool:
    """Whether 16-byte row loads of t would be misaligned. The strides are checked always; under
    torch.compile nothing else (storage_offset() and data_ptr() break the graph there, and the
    buffers of a compiled graph come from the aligned caching allocator); while AOT autograd
    traces a backward with fake tensors, the storage offset (data_ptr() cannot be read there)."""
    es = t.element_size()
    if any((s * es) % 16 for s in t.stride()[:-1]):
        return True
    if torch.compiler.is_compiling():
        return False
    if _is_fake(t):  # fake / functional tensor while tracing: no pointer to read
        return (t.storage_offset() * es) % 16 != 0
    try:
        return t.data_ptr() % 16 != 0
    except RuntimeError:  # other tensor subclasses without storage
        return (t.storage_offset() * es) % 16 != 0


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """CUDA kernels load rows with 16-byte vectors: copy the rare misaligned view."""
    if t.is_cuda and _misaligned(t):
        return t.contiguous()
    return t


# ---------------------------------------------------------------------------------------------
# public functions

def _deterministic_of(deterministic) -> bool:
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, (bool, int)) or isinstance(deterministic, int) and deterministic not in (0, 1):
        raise TypeError(f"deterministic: expected a bool or None, got {deterministic!r}")
    return bool(deterministic)


# Head dims the CUDA attention kernels are compiled for. A head of another size up to 256 runs
# zero-padded to the next of them: zero columns of q and k change no score, zero columns of v
# give zero output columns, which are cut off (the same for dq, dk, dv). The Hopper wgmma kernels
# take 64 and 128 only: where they run, heads between 64 and 128 go to 128 (96 included: at
# S = 64k, G = 128, 0.9 the 96 kernels on mma.sync take 1.5x the time of the 128 ones on wgmma,
# benchmarks/results/kernels.md; PERF_LOG v36).
_CUDA_HEAD_DIMS = (64, 96, 128, 256)


@functools.lru_cache(maxsize=None)
def _wgmma_on(index: int) -> bool:
    return kernel_tuning(index).get("wgmma", 0) == 1


@torch.compiler.assume_constant_result
def _cuda_head_dim(index: int, head_dim: int) -> int:
    if 64 < head_dim < 128 and _wgmma_on(index):
        return 128
    return next(d for d in _CUDA_HEAD_DIMS if head_dim <= d)


def _run_head_dim(device: torch.device, head_dim: int) -> int:
    """The head dim the attention kernels of ``device`` run a head of ``head_dim`` at (the CPU
    kernels: any; CUDA: _CUDA_HEAD_DIMS, padded)."""
    if device.type != "cuda" or head_dim in (64, 128):
        return head_dim
    if head_dim > _CUDA_HEAD_DIMS[-1]:
        raise ValueError(f"q: the CUDA attention kernels take head_dim <= {_CUDA_HEAD_DIMS[-1]}, "
                         f"got {head_dim}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_head_dim(index, head_dim)


def _pad_head(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, dim - t.shape[-1]))


class _PaddedHeads(torch.autograd.Function):
    """sparse_attention with the heads zero-padded to ``dim`` for the kernels (_run_head_dim).
    Saves the unpadded q, k, v and output and pads again in the backward, so the padded copies
    live only while a kernel runs."""

    @staticmethod
    def forward(ctx, q, k, v, kv_index, kv_count, group_size, scale, deterministic, kv_block, dim):
        D = q.shape[-1]
        out, lse = _ops.sparse_attention_fwd(_pad_head(q, dim), _pad_head(k, dim), _pad_head(v, dim), kv_index,
                                             kv_count, group_size, scale, deterministic, kv_block)
        out = out[..., :D].contiguous()
        ctx.save_for_backward(q, k, v, out, lse, kv_index, kv_count)
        ctx.params = (group_size, scale, deterministic, kv_block, dim)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, kv_index, kv_count = ctx.saved_tensors
        group_size, scale, deterministic, kv_block, dim = ctx.params
        D = q.shape[-1]
        dq, dk, dv = _ops.sparse_attention_bwd(*(_pad_head(t, dim) for t in (dout, q, k, v, out)), lse, kv_index,
                                               kv_count, group_size, scale, deterministic, kv_block)
        return dq[..., :D], dk[..., :D], dv[..., :D], None, None, None, None, None, None, None


def _sorted_lists(kv_index: torch.Tensor, kv_count: torch.Tensor, S: int) -> torch.Tensor:
    """The used entries of every list in ascending order, then -1 (entries outside [0, S), which
    the kernels skip anyway, are dropped): the form the deterministic CUDA backward needs."""
    kmax = kv_index.shape[3]
    used = torch.arange(kmax, device=kv_index.device) < kv_count[:, :, None, None]
    used = used & (kv_index >= 0) & (kv_index < S)
    keys = torch.where(used, kv_index, torch.full_like(kv_index, S)).sort(dim=-1).values
    return torch.where(keys >= S, torch.full_like(keys, -1), keys).contiguous()


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor,
                     kv_count: torch.Tensor, group_size: int, scale: Optional[float] = None,
                     check_index: bool = True, deterministic: Optional[bool] = None,
                     kv_block: int = 1) -> torch.Tensor:
    """Grouped sparse attention over per-group key lists (of keys, or of key blocks).

    Args:
        q, k, v: ``[B, S, H, D]`` (last dim contiguous; other strides are used without copies).
            The CUDA kernels take D up to 256: heads of another size than 64, 96, 128 or 256
            run zero-padded to the next of them (on H100 / H200 heads between 64 and 128 to
            128, whose kernels are faster there), with the padded copies made around each
            kernel call only.
        kv_index: int32 ``[B, H, ceil(S/G), Kmax]``: for each group of ``group_size`` consecutive
            queries, the positions of the keys it attends to (distinct; duplicates would count
            twice). Only the first ``kv_count[b, h]`` entries of each list are used.
        kv_count: int32 ``[B, H]``, per-head list length, ``0 <= kv_count <= Kmax``.
        group_size: queries per group ``G``; the last group may be partial.
        scale: softmax scale, default ``1/sqrt(D)``.
        check_index: check ``kv_count`` and the used ``kv_index`` entries on the host (a device
            sync). Indices from :func:`topk_estimate` are valid by construction, so pass False
            there; kernels never access memory out of bounds either way.
        deterministic: bit-identical dq, dk, dv from run to run (ordered reductions, no float
            atomics; see docs/API.md, "Determinism"). ``None`` (default) follows
            ``torch.are_deterministic_algorithms_enabled()``. The CPU backward is always
            deterministic; on CUDA it needs head_dim <= 128, distinct entries in ascending order
            (as topk_estimate writes them; with check_index=True other lists are sorted here)
            and costs some backward speed.
        kv_block: keys per list entry ``b`` (default 1: the entries are key positions). With
            ``b > 1`` an entry ``e`` is a block id in ``[0, ceil(S/b))`` and stands for the keys
            ``e*b .. min(e*b+b, S)-1`` (the last block may be partial), ``kv_count`` counts
            blocks and Kmax is in blocks; -1 padding, skipping and duplicates work per key as for
            token lists (docs/API.md, "Key blocks"). The CPU kernels read block lists natively;
            on CUDA 64-key lists run on the block kernels (head_dim <= 128, Kmax <= 16384;
            their backward is deterministic) and other block lists are expanded to token lists
            first (:func:`expand_block_lists`; for 16-key lists that is also the faster path).

    Returns:
        ``[B, S, H, D]``, the same dtype as q; differentiable in q, k and v. A query row whose
        scores contain NaN (or +inf) gives a NaN output row and NaN gradients, as softmax does;
        an empty list (count 0) gives zeros.

    Example:
        >>> import torch, dsv_ext
        >>> q, k, v = (torch.randn(1, 128, 2, 64) for _ in range(3))
        >>> q_lr, k_lr = torch.randn(1, 128, 2, 16), torch.randn(1, 128, 2, 16)
        >>> count = torch.full((1, 2), 32, dtype=torch.int32)
        >>> index = dsv_ext.topk_estimate(q_lr, k_lr, count, group_size=32)
        >>> dsv_ext.sparse_attention(q, k, v, index, count, group_size=32).shape
        torch.Size([1, 128, 2, 64])
    """
    _check_activation("q", q)
    _check_activation("k", k, q)
    _check_activation("v", v, q)
    _check_cuda_dtype("q", q)
    B, S, H, D = q.shape
    group_size = _check_group_size(group_size, S)
    kv_index = _as_int32("kv_index", kv_index, q.device)
    kv_count = _as_int32("kv_count", kv_count, q.device)
    kv_block = _check_kv_block(kv_block, S)
    _check_index(kv_index, kv_count, B, S, H, group_size, check_index, kv_block)
    scale = _scale_of(scale, D)
    deterministic = _deterministic_of(deterministic)
    dim = _run_head_dim(q.device, D)
    if kv_block > 1 and not _native_kv_block(q.device, kv_block, dim, kv_index.shape[3]):
        kv_index, kv_count = expand_block_lists(kv_index, kv_count, kv_block, S)
        kv_block = 1
    if deterministic and q.is_cuda and kv_block == 1:  # the block backward sorts its lists itself
        if dim > 128:
            raise ValueError(f"deterministic: the deterministic CUDA backward needs head_dim <= 128, got {D}"
                             + ("" if dim == D else f" (run as {dim})"))
        # the deterministic backward needs ascending lists (topk_estimate's are); with
        # check_index (already a host sync) unsorted ones are sorted here, without it the caller
        # vouches for the order (an unsorted head falls back to the non-deterministic path)
        if check_index and kv_index.numel() and kv_index.shape[3] > 1:
            used = torch.arange(1, kv_index.shape[3], device=q.device) < kv_count[:, :, None, None]
            if bool((used & (kv_index[..., 1:] <= kv_index[..., :-1])).any()):
                kv_index = _sorted_lists(kv_index, kv_count, S)
    if dim != D:
        return _PaddedHeads.apply(q, k, v, kv_index, kv_count, group_size, scale, deterministic, kv_block, dim)
    out, _ = _ops.sparse_attention_fwd(_kernel_ready(q), _kernel_ready(k), _kernel_ready(v), kv_index, kv_count,
                                       group_size, scale, deterministic, kv_block)
    return out


def _pool(x: torch.Tensor, n: int, size: int, acc: torch.dtype) -> torch.Tensor:
    """[B, S, H, r] -> [B, H, n, r]: the mean of x over each run of ``size`` consecutive positions
    (the last run may be partial: its mean is over its members)."""
    B, S, H, r = x.shape
    x = x.to(acc)
    if n * size != S:
        x = torch.cat([x, x.new_zeros(B, n * size - S, H, r)], 1)
    sizes = torch.full((n,), float(size), dtype=acc, device=x.device)
    sizes[-1] = S - (n - 1) * size
    return (x.view(B, n, size, H, r).sum(2) / sizes.view(1, n, 1, 1)).transpose(1, 2)


def _topk_blocks(q_lr: torch.Tensor, k_lr: torch.Tensor, kv_count: torch.Tensor, group_size: int,
                 kv_block: int, kmax: int) -> torch.Tensor:
    """topk_estimate for kv_block > 1 with torch ops: group-mean queries against block-mean keys
    ([B, H, groups, blocks] scores), a stable descending sort (ties: lower id first; NaN ranked
    last, tied with -inf), the first kv_count ids of each list sorted ascending, -1 after."""
    B, S, H, _ = q_lr.shape
    ng, nb = -(-S // group_size), -(-S // kv_block)
    acc = torch.float64 if q_lr.dtype == torch.float64 else torch.float32
    rep = _pool(q_lr, ng, group_size, acc)
    keys = _pool(k_lr, nb, kv_block, acc)
    scores = rep @ keys.transpose(-1, -2)  # [B, H, ng, nb]
    scores = scores.masked_fill(torch.isnan(scores), float("-inf"))
    ids = scores.sort(dim=-1, descending=True, stable=True).indices[..., :kmax]
    used = torch.arange(kmax, device=q_lr.device) < kv_count.clamp(0, kmax)[:, :, None, None]
    ids = torch.where(used, ids, torch.full_like(ids, nb)).sort(dim=-1).values
    return torch.where(ids >= nb, torch.full_like(ids, -1), ids).to(torch.int32).contiguous()


def topk_estimate(q_lr: torch.Tensor, k_lr: torch.Tensor, kv_count: torch.Tensor, group_size: int,
                  kmax: Optional[int] = None, kv_block: int = 1) -> torch.Tensor:
    """Critical-key lists from low-rank projections: exact top-K of each group's scores.

    The representative of group ``g`` is the mean of ``q_lr`` over its members; its scores are
    its dot products with every ``k_lr`` row. List ``(b, h, g)`` holds the positions of the
    ``kv_count[b, h]`` best keys, sorted ascending, then ``-1`` up to ``kmax``. Memory is
    O(S * kmax): no score matrix is formed.

    Args:
        q_lr, k_lr: ``[B, S, H, r]`` low-rank queries and keys.
        kv_count: int32 ``[B, H]`` keys to keep per head.
        group_size: queries per group.
        kmax: the list length (the last dim of the result). ``None`` uses ``max(kv_count)``, which
            reads ``kv_count`` on the host (a device sync) and checks its values; pass it
            explicitly in training loops. With ``kmax`` given, CPU counts are still checked
            (no sync there); CUDA counts are clamped to ``[0, kmax]`` unchecked.

    NaN scores rank below every number (a key whose score is NaN is chosen last), so the lists
    stay valid positions whatever the input.

    Key blocks (``kv_block = b > 1``): the keys are pooled per block of ``b`` consecutive
    positions (the mean of ``k_lr`` over the block's members; the last block may be partial) and
    each list holds the ids (in ``[0, ceil(S/b))``) of the ``kv_count[b, h]`` best blocks, sorted
    ascending, then -1; ties go to the lower id, NaN scores rank last. ``kv_count`` and ``kmax``
    count blocks (``kmax <= ceil(S/b)``). This path runs torch ops (matmul + sort) on any device
    and forms the ``[B, H, ceil(S/G), ceil(S/b)]`` score matrix: memory O(S/G * S/b) per
    (batch, head), e.g. 16 MiB of float32 per head for S = 64Ki, G = 64, b = 16.

    Returns:
        int32 ``[B, H, ceil(S/G), kmax]``, ready for :func:`sparse_attention` (with the same
        ``kv_block``).
    """
    _check_activation("q_lr", q_lr)
    _check_activation("k_lr", k_lr, q_lr, "q_lr")
    _check_cuda_dtype("q_lr", q_lr)
    B, S, H, _ = q_lr.shape
    group_size = _check_group_size(group_size, S)
    kv_block = _check_kv_block(kv_block, S)
    kv_count = _as_int32("kv_count", kv_count, q_lr.device, "q_lr")
    _check_counts(kv_count, B, H)
    n_keys = S if kv_block == 1 else -(-S // kv_block)  # list entries: keys or blocks
    S_name = f"S={S}" if kv_block == 1 else f"ceil(S/kv_block)={n_keys}"
    if kmax is not None:
        kmax = _as_int("kmax", kmax, "an int or None")
        if kmax < 0 or kmax > n_keys:
            raise ValueError(f"kmax: must be in [0, {S_name}], got {kmax}")
    # with kmax given, CPU counts are checked too (no device sync), except while torch.compile
    # traces (a host read would break the graph; the kernels clamp counts to [0, kmax])
    check = kmax is None or not (kv_count.is_cuda or torch.compiler.is_compiling())
    if check and kv_count.numel():
        lo, hi = (int(x) for x in torch.aminmax(kv_count))
        top = n_keys if kmax is None else kmax
        if lo < 0 or hi > top:
            what = S_name if kmax is None else f"kmax={kmax}"
            raise ValueError(f"kv_count: values must be in [0, {what}], got min {lo}, max {hi}")
        if kmax is None:
            kmax = hi
    if kmax is None:
        kmax = 0
    if kv_block > 1:
        return _topk_blocks(q_lr, k_lr, kv_count, group_size, kv_block, int(kmax))
    return _ops.topk_estimate(_kernel_ready(q_lr), _kernel_ready(k_lr), kv_count, group_size, int(kmax))


def predictor_loss(q: torch.Tensor, k: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor, rows,
                   scale: Optional[float] = None, cos_weight: float = DEFAULT_COS_WEIGHT,
                   norm_weight: float = DEFAULT_NORM_WEIGHT, check_rows: bool = True) -> torch.Tensor:
    """Loss of the low-rank predictor on sampled query rows, per (batch, head).

    For each sampled row i the exact logits ``z_j = scale * q_i . k_j`` and the predicted ones
    ``p_j = q_lr_i . k_lr_j`` over all keys j give
    ``loss_i = cos_weight * (1 - cos(z, p)) + norm_weight * (|p| / |z| - 1)^2``; the result is the
    mean over rows, ``[B, H]`` (float32, float64 for float64 inputs). Differentiable in ``q_lr``
    and ``k_lr``; ``q`` and ``k`` are constants (detached). Memory is O(S) per row: no score
    matrix is kept. NaN or inf in the inputs gives NaN where the formula does (the losses of the
    (batch, head) pairs they reach); with ``check_rows=False``, a row outside ``[0, S)`` has a
    NaN loss (it is not counted as any value).
    """
    _check_activation("q", q)
    _check_activation("k", k, q)
    _check_activation("q_lr", q_lr, q, last_dim=-1)
    _check_activation("k_lr", k_lr, q_lr, "q_lr")
    _check_cuda_dtype("q", q)
    B, S, H, D = q.shape
    rows = _check_rows(rows, S, q.device, check_rows)
    scale = _scale_of(scale, D)
    cos_weight = _check_weight("cos_weight", cos_weight)
    norm_weight = _check_weight("norm_weight", norm_weight)
    loss, _ = _ops.predictor_loss_fwd(_kernel_ready(q.detach()), _kernel_ready(k.detach()), _kernel_ready(q_lr),
                                      _kernel_ready(k_lr), rows, scale, cos_weight, norm_weight)
    return loss


class ProfileResult(NamedTuple):
    """Per-head attention profile from sampled rows: ``sparsity`` and ``recall``, each ``[B, H]``.

    ``sparsity`` is the fraction of keys outside the critical set (the smallest set holding
    ``theta`` of the softmax mass); ``recall`` (None when no index was given) is the softmax mass
    that the index covers.
    """
    sparsity: torch.Tensor
    recall: Optional[torch.Tensor]


def profile_attention(q: torch.Tensor, k: torch.Tensor, rows, theta: float = 0.9,
                      kv_index: Optional[torch.Tensor] = None, kv_count: Optional[torch.Tensor] = None,
                      group_size: Optional[int] = None, scale: Optional[float] = None,
                      kv_block: int = 1) -> ProfileResult:
    """Measure per-head sparsity at mass ``theta`` (and the recall of an index) on sampled rows.

    With ``kv_block = b > 1`` the index holds block lists (as for :func:`sparse_attention`) and
    the recall is the softmax mass of the keys its blocks cover (each key counted once; the
    lists are expanded to token lists first, :func:`expand_block_lists`).

    A sampled row whose scores contain NaN or +inf has an undefined softmax: its (batch, head)
    gets NaN sparsity and recall."""
    _check_activation("q", q)
    _check_activation("k", k, q)
    _check_cuda_dtype("q", q)
    B, S, H, D = q.shape
    rows = _check_rows(rows, S, q.device, True)
    if isinstance(theta, (bool, str, bytes)):
        raise TypeError(f"theta: expected a float, got {type(theta).__name__}")
    try:
        theta = float(theta)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"theta: expected a float, got {type(theta).__name__}") from None
    if not 0.0 < theta <= 1.0:
        raise ValueError(f"theta: must be in (0, 1], got {theta}")
    scale = _scale_of(scale, D)
    kv_block = _check_kv_block(kv_block, S)
    given = [x is not None for x in (kv_index, kv_count, group_size)]
    if any(given) and not all(given):
        raise ValueError("kv_index, kv_count, group_size: give all three to measure recall, or none")
    if all(given):
        group_size = _check_group_size(group_size, S)
        kv_index = _as_int32("kv_index", kv_index, q.device)
        kv_count = _as_int32("kv_count", kv_count, q.device)
        _check_index(kv_index, kv_count, B, S, H, group_size, True, kv_block)
        kv_index, kv_count = expand_block_lists(kv_index, kv_count, kv_block, S)
    sparsity, recall = _ops.profile_attention(_kernel_ready(q.detach()), _kernel_ready(k.detach()), rows, theta,
                                              scale, kv_index, kv_count, group_size or 1)
    return ProfileResult(sparsity, recall if all(given) else None)


def _check_row_table(src, index) -> torch.Tensor:
    _check_tensor("src", src)
    if src.dim() != 2:
        raise ValueError(f"src: expected a 2-d [rows, dim] tensor, got shape {tuple(src.shape)}")
    if src.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"src: expected a floating dtype, got {src.dtype}")
    if src.shape[1] > 1 and src.stride(1) != 1 and src.numel() > 0:
        raise ValueError(f"src: the last dim must be contiguous, got strides {src.stride()}")
    _check_tensor("index", index)
    _check_index_dtype("index", index, "int64 or int32")
    if index.dim() != 1:
        raise ValueError(f"index: expected a 1-d tensor, got shape {tuple(index.shape)}")
    if index.device != src.device:
        raise ValueError(f"index: on {index.device}, but src is on {src.device}")
    return index.to(torch.int64).contiguous()


def gather_rows(src: torch.Tensor, index: torch.Tensor, check_index: bool = True) -> torch.Tensor:
    """``src[index]`` for a ``[N, D]`` row table (differentiable: the backward scatter-adds)."""
    index = _check_row_table(src, index)
    if check_index and index.numel():
        lo, hi = (int(x) for x in torch.aminmax(index))
        if lo < 0 or hi >= src.shape[0]:
            raise ValueError(f"index: rows must be in [0, {src.shape[0]}), got min {lo}, max {hi}")
    return _ops.gather_rows(_kernel_ready(src), index)


def scatter_add_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int,
                     check_index: bool = True) -> torch.Tensor:
    """A ``[num_rows, D]`` table with ``out[index[i]] += src[i]`` (accumulated in float32/64)."""
    index = _check_row_table(src, index)
    num_rows = _as_int("num_rows", num_rows, "a non-negative int")
    if num_rows < 0:
        raise ValueError(f"num_rows: expected a non-negative int, got {num_rows}")
    if num_rows * max(src.shape[1], 1) * 8 > 2**48:
        raise ValueError(f"num_rows: {num_rows} rows of {src.shape[1]} values is too large a table")
    if index.shape[0] != src.shape[0]:
        raise ValueError(f"index: has {index.shape[0]} entries but src has {src.shape[0]} rows")
    if check_index and index.numel():
        lo, hi = (int(x) for x in torch.aminmax(index))
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"index: rows must be in [0, num_rows={num_rows}), got min {lo}, max {hi}")
    return _ops.scatter_add_rows(_kernel_ready(src), index, num_rows)
