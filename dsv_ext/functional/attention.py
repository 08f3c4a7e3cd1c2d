"""Functional cores of DSV attention: pure functions on [B, S, H, D] tensors, no module state.

PUBLIC API
------------------------------------------------------
dense_core(q, k, v, scale=None, backend="auto", attn_mask=None) -> out      # SDPA, cuDNN first on CUDA
sparse_core(q, k, v, wq, wk, perm, inv, kv_count, kmax, group_size, scale=None, *, index=None,
            return_index=False, deterministic=None, kv_block=1) -> out | (out, index)   # stage 2
joint_sparse_core(q, k, v, wq, wk, perm, inv, kv_count, kmax, group_size, scale, n_text,
                  text_first=False, attn_mask=None, backend="auto", ..., dense_heads=())
                  # text + video tokens; dense_heads: heads at K = S, run dense
estimate_index(qp, k, wq, wk, counts, group_size, kmax, kv_block=1) -> kv_index  # top-K, no grad
head_groups_core(q, k, v, wq, wk, perm, inv, kv_count, groups, group_size, scale=None, *,
                 index=None, return_index=False, deterministic=None, backend="auto")
                 # per-head kv_block; kv_block 0: heads that attend to all keys run dense
block_counts(kv_count, kv_block) -> counts; block_kmax(kmax, kv_block, S) -> int   # keys -> blocks
kernel_dtype(t) -> dtype; kernels_available(device, head_dim, rank) -> bool;
sparse_supported(device, head_dim, rank) -> bool; autocast_inputs(q, k, v) -> (q, k, v)

No host syncs and no Python state: torch.compile(fullgraph=True) friendly. The modules
(dsv_ext.modules.attention) and the context-parallel runner (dsv_ext.parallel) call these.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
try:  # the compiled ops; the Python layer stays importable without them (clear error at use)
    from .. import ops as _ops
    _OPS_ERROR: Optional[BaseException] = None
except Exception as e:  # pragma: no cover - only before the extension is built
    _ops = None  # type: ignore[assignment]
    _OPS_ERROR = e

__all__ = ["dense_core", "sparse_core", "joint_sparse_core", "estimate_index", "kernel_dtype",
           "kernels_available", "sparse_supported", "autocast_inputs", "need_ops", "block_counts", "block_kmax",
           "head_groups_core"]


def need_ops():
    if _ops is None:
        raise ImportError(f"dsv_ext.ops is not available (build the extension): {_OPS_ERROR}")
    return _ops


def _sdpa_priority():
    from torch.nn.attention import SDPBackend
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dense_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
               backend: str = "auto", attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense attention on [B, S, H, D] tensors through SDPA (output [B, S, H, D], a view).

    backend "auto" on CUDA asks SDPA for cuDNN first, then Flash, memory-efficient and math
    (the fastest available on Hopper); elsewhere torch's default choice is kept. attn_mask is
    passed to SDPA as given (SDPA's [B, H, Sq, Skv]-broadcastable layout)."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    extra = {} if attn_mask is None else {"attn_mask": attn_mask}
    if backend == "auto" and q.is_cuda:
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(_sdpa_priority(), set_priority=True):
            o = _SDPA(qt, kt, vt, scale=scale, **extra)
    else:
        o = _SDPA(qt, kt, vt, scale=scale, **extra)
    return o.transpose(1, 2)


# the SDPA function dsv_ext itself calls (a scoped patch of F.scaled_dot_product_attention, see
# dsv_ext.adopt.generic.route_sdpa, must not route the library's own dense calls back to itself)
_SDPA = F.scaled_dot_product_attention


def autocast_inputs(q, k, v):
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


def kernel_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the dsv kernels run in for this input: the CUDA kernels take bf16/fp16 only
    (float32/float64 inputs run in bf16 there); the CPU kernels take any float dtype."""
    if t.is_cuda and t.dtype not in (torch.bfloat16, torch.float16):
        return torch.bfloat16
    return t.dtype


def kernels_available(device: torch.device, head_dim: int, rank: int) -> bool:
    """Whether predictor training / profiling kernels exist for this device and shape."""
    if _ops is None:
        return False
    if torch.device(device).type == "cuda":
        return _ops.has_cuda_kernels() and head_dim <= 256 and rank <= 64
    return True


def sparse_supported(device: torch.device, head_dim: int, rank: int) -> bool:
    """Whether the sparse path (estimation + sparse attention) exists for this device and shape:
    where the kernels are (CUDA: head_dim <= 256, sizes other than 64 / 96 / 128 / 256 run
    zero-padded, see dsv_ext.sparse_attention)."""
    return kernels_available(device, head_dim, rank)


def block_counts(kv_count: torch.Tensor, kv_block: int) -> torch.Tensor:
    """Per-head K in keys -> list entries: ceil(K / kv_block) blocks (the same tensor for 1)."""
    if kv_block == 1:
        return kv_count
    return torch.div(kv_count + (kv_block - 1), kv_block, rounding_mode="floor").to(torch.int32)


def block_kmax(kmax: int, kv_block: int, seq_len: int) -> int:
    """The list length in entries for a K of kmax keys: ceil(kmax / b), at most ceil(S / b)."""
    if kv_block == 1:
        return kmax
    return min(-(-int(kmax) // kv_block), -(-int(seq_len) // kv_block))


def estimate_index(qp: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                   counts: torch.Tensor, group_size: int, kmax: int, kv_block: int = 1) -> torch.Tensor:
    """Each query group's top-K keys (or key blocks, kv_block > 1: counts and kmax in blocks) from
    the low-rank projections of (cube-ordered) queries qp and keys k ([B, S, H, D]) by the
    predictor weights wq, wk ([H, D, r]); no gradient."""
    with torch.no_grad():
        q_lr = torch.einsum("bshd,hdr->bshr", qp.detach(), wq.detach().to(qp.dtype)).contiguous()
        k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), wk.detach().to(k.dtype)).contiguous()
    return need_ops().topk_estimate(q_lr, k_lr, counts, group_size, kmax, kv_block=kv_block)


def sparse_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                perm: Optional[torch.Tensor], inv: Optional[torch.Tensor], kv_count: torch.Tensor,
                kmax: int, group_size: int, scale: Optional[float] = None,
                index: Optional[torch.Tensor] = None, return_index: bool = False,
                deterministic: Optional[bool] = None, kv_block: int = 1):
    """Stage-2 attention on [B, S, H, D]: cube-reorder the queries, low-rank projections (detached
    from the model graph), top-K estimation of each query group's keys, sparse attention,
    inverse reorder. With token lists (kv_block 1) keys/values stay in their original order
    (kv_index addresses them there), so only q and the output are permuted; with key blocks
    (kv_block = b > 1) k and v are put into the same cube order as the queries (a block is b
    consecutive keys of that order; raster order without perm) and kv_count / kmax are in keys,
    converted here to ceil(K / b) blocks.

    wq, wk: predictor weights [H, D, r]; perm/inv: int64 [S] (None = no reordering);
    kv_count: int32 [H] per-head K (<= kmax); kmax: Python int, the index list length.
    index: a kv_index [B, H, groups, kmax] from an earlier call with the same shapes, perm and
    kv_count, used instead of estimating again (inference index reuse); return_index: return
    (out, index); deterministic: see dsv_ext.sparse_attention."""
    ops = need_ops()
    q, k, v = autocast_inputs(q, k, v)
    out_dtype = q.dtype
    kdt = kernel_dtype(q)
    q, k, v = q.to(kdt), k.to(kdt), v.to(kdt)
    B, S, H, D = q.shape
    qp = q.index_select(1, perm) if perm is not None else q
    if kv_block > 1:
        if perm is not None:
            k, v = k.index_select(1, perm), v.index_select(1, perm)
        kv_count, kmax = block_counts(kv_count, kv_block), block_kmax(kmax, kv_block, S)
    counts = kv_count.view(1, H).expand(B, H).contiguous()
    if index is None:
        index = estimate_index(qp, k, wq, wk, counts, group_size, kmax, kv_block)
    out = ops.sparse_attention(qp, k, v, index, counts, group_size, scale, check_index=False,
                               deterministic=deterministic, kv_block=kv_block)
    out = out.index_select(1, inv) if inv is not None else out
    out = out.to(out_dtype)
    return (out, index) if return_index else out


def head_groups_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                     perm: Optional[torch.Tensor], inv: Optional[torch.Tensor], kv_count: torch.Tensor,
                     groups, group_size: int, scale: Optional[float] = None, *, index=None,
                     return_index: bool = False, deterministic: Optional[bool] = None,
                     backend: str = "auto"):
    """sparse_core with a list granularity per head: ``groups`` is a sequence of
    ``(kv_block, heads, kmax)`` (heads: a list of head indices, together every head once; kmax:
    the largest K in keys of those heads). Each group runs sparse_core on its heads with its
    kv_block; kv_block 0 marks heads that attend to all keys (K = S): they run dense_core with
    ``backend`` (exact attention, as a full list would give, at the dense kernel's speed). The
    outputs are put back in head order. index / return_index: a tuple with one index per group
    (None for the dense group; inference reuse, as in sparse_core)."""
    H = q.shape[2]
    outs, order, idxs = [], [], []
    for gi, (b, heads, kmax) in enumerate(groups):
        hs = list(heads)
        def pick(t, dim=2):
            return t if len(hs) == H else t.index_select(dim, torch.tensor(hs, device=t.device))
        if b == 0:
            qd, kd, vd = autocast_inputs(pick(q), pick(k), pick(v))
            o, ix = dense_core(qd, kd, vd, scale, backend), None
        else:
            o, ix = sparse_core(pick(q), pick(k), pick(v), pick(wq, 0), pick(wk, 0), perm, inv, pick(kv_count, 0),
                                kmax, group_size, scale, index=None if index is None else index[gi],
                                return_index=True, deterministic=deterministic, kv_block=b)
        outs.append(o)
        idxs.append(ix)
        order += hs
    if len(outs) == 1:
        out = outs[0]
    else:
        back = [0] * H
        for i, h in enumerate(order):
            back[h] = i
        out = torch.cat(outs, 2).index_select(2, torch.tensor(back, device=q.device))
    return (out, tuple(idxs)) if return_index else out


def _text_key_mask(attn_mask: Optional[torch.Tensor], B: int, S: int, text: slice) -> Optional[torch.Tensor]:
    """The text part of a key-padding attn_mask as bool [B, n_text] (None: all text keys valid)."""
    if attn_mask is None:
        return None
    m = attn_mask
    if m.dim() == 4:
        if m.shape[1] != 1 or m.shape[2] != 1:
            raise ValueError(f"attn_mask: the sparse path takes a key-padding mask [B, 1, 1, S], got shape "
                             f"{tuple(m.shape)}")
        m = m[:, 0, 0]
    if m.dim() != 2 or m.shape[-1] != S or m.shape[0] not in (1, B):
        raise ValueError(f"attn_mask: expected a key-padding mask [B, 1, 1, {S}] or [B, {S}], got shape "
                         f"{tuple(attn_mask.shape)}")
    if m.dtype != torch.bool:
        m = m == 0 if m.dtype.is_floating_point else m != 0  # additive float mask: 0 = attend
    return m[:, text].expand(B, -1)


def joint_sparse_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                      perm: Optional[torch.Tensor], inv: Optional[torch.Tensor], kv_count: torch.Tensor,
                      kmax: int, group_size: int, scale: Optional[float], n_text: int, text_first: bool = False,
                      attn_mask: Optional[torch.Tensor] = None, backend: str = "auto",
                      index: Optional[torch.Tensor] = None, return_index: bool = False,
                      deterministic: Optional[bool] = None, dense_heads: Sequence[int] = ()):
    """Stage-2 joint text+video attention on [B, S, H, D] (S = n_video + n_text; the text tokens
    last, or first with text_first). Video queries: one sparse_attention call over all keys
    (k, v as given, no copies) where each query group's list is its top-K video keys
    (estimated as in sparse_core, K = kv_count[h]) followed by every (valid) text key, so
    kv_count becomes K + n_text; the kernel needs as many query rows as keys, so the text
    queries fill the rows after the video ones and their outputs there are discarded (their
    gradient through that call is exactly zero). Text queries: dense SDPA over all keys.
    index: the video-part top-K index of an earlier call (reuse), return_index: (out, index);
    deterministic: see dsv_ext.sparse_attention. dense_heads: heads whose video queries attend to
    all keys (K = S): they run dense_core alone (every query, with attn_mask), the other heads as
    above; kv_count / kmax / index are then those of the other heads."""
    if dense_heads:
        return _joint_with_dense_heads(q, k, v, wq, wk, perm, inv, kv_count, kmax, group_size, scale, n_text,
                                       text_first, attn_mask, backend, index, return_index, deterministic,
                                       dense_heads)
    ops = need_ops()
    B, S, H, D = q.shape
    Sv = S - n_text
    vid, txt = (slice(n_text, S), slice(0, n_text)) if text_first else (slice(0, Sv), slice(Sv, S))
    text_valid = _text_key_mask(attn_mask, B, S, txt)
    out_t = dense_core(q[:, txt], k, v, scale, backend, attn_mask=attn_mask)
    q, k, v = autocast_inputs(q, k, v)
    out_dtype = q.dtype
    kdt = kernel_dtype(q)
    q, k, v = q.to(kdt), k.to(kdt), v.to(kdt)
    qv, kv, qt = q[:, vid], k[:, vid], q[:, txt]
    qp = qv.index_select(1, perm) if perm is not None else qv
    counts = kv_count.view(1, H).expand(B, H).contiguous()
    if index is None:
        index = estimate_index(qp, kv, wq, wk, counts, group_size, kmax)
    with torch.no_grad():  # the joint lists, built in int32 in one buffer
        ngv, ng, L = index.shape[2], -(-S // group_size), kmax + n_text
        full = torch.empty(B, H, ng, L, dtype=torch.int32, device=q.device)
        fv = full[:, :, :ngv]
        fv[..., :kmax] = index
        if vid.start:
            fv[..., :kmax] += vid.start  # keys stay where they are in k, v (the -1 padding is never read)
        if text_valid is None:  # every text key, in order
            tpos = (txt.start + torch.arange(n_text, device=q.device, dtype=torch.int32)).view(1, 1, 1, n_text)
            jcount = counts + n_text
        else:  # the valid text keys first (stable: in their order)
            order = torch.argsort((~text_valid).to(torch.int8), dim=1, stable=True)
            tpos = (order + txt.start).to(torch.int32).view(B, 1, 1, n_text)
            jcount = counts + text_valid.sum(1, dtype=torch.int32).view(B, 1)
        # head h's text keys go right after its K_h video keys
        slots = kv_count.to(torch.int64).view(1, H, 1, 1) + torch.arange(n_text, device=q.device).view(1, 1, 1, -1)
        fv.scatter_(3, slots.expand(B, H, ngv, n_text), tpos.expand(B, H, ngv, n_text))
        if ng > ngv:  # groups of the text rows only (outputs discarded): any valid list
            full[:, :, ngv:] = fv[:, :, ngv - 1:ngv]
        jcount = jcount.to(torch.int32).contiguous()
    qc = torch.cat([qp, qt], 1)  # video query groups first, aligned to the group size
    out_v = ops.sparse_attention(qc, k, v, full, jcount, group_size, scale, check_index=False,
                                 deterministic=deterministic)[:, :Sv]
    out_v = out_v.index_select(1, inv) if inv is not None else out_v
    out_v = out_v.to(out_dtype)
    out_t = out_t.to(out_dtype)
    out = torch.cat([out_t, out_v], 1) if text_first else torch.cat([out_v, out_t], 1)
    return (out, index) if return_index else out


def _joint_with_dense_heads(q, k, v, wq, wk, perm, inv, kv_count, kmax, group_size, scale, n_text, text_first,
                            attn_mask, backend, index, return_index, deterministic, dense_heads):
    """joint_sparse_core with ``dense_heads`` on dense_core (see there); kv_count [H] of all heads."""
    H = q.shape[2]
    dn = sorted(set(int(h) for h in dense_heads))
    if dn[0] < 0 or dn[-1] >= H:
        raise ValueError(f"dense_heads: expected head indices in [0, {H}), got {list(dense_heads)}")
    sp = [h for h in range(H) if h not in dn]
    if not sp:
        qd, kd, vd = autocast_inputs(q, k, v)
        out = dense_core(qd, kd, vd, scale, backend, attn_mask=attn_mask)
        return (out, index) if return_index else out
    dev = q.device
    spi, dni = torch.tensor(sp, device=dev), torch.tensor(dn, device=dev)
    o_s, ix = joint_sparse_core(q.index_select(2, spi), k.index_select(2, spi), v.index_select(2, spi),
                                wq.index_select(0, spi.to(wq.device)), wk.index_select(0, spi.to(wk.device)),
                                perm, inv, kv_count.index_select(0, spi.to(kv_count.device)), kmax, group_size,
                                scale, n_text, text_first, attn_mask, backend, index=index, return_index=True,
                                deterministic=deterministic)
    qd, kd, vd = autocast_inputs(q.index_select(2, dni), k.index_select(2, dni), v.index_select(2, dni))
    o_d = dense_core(qd, kd, vd, scale, backend, attn_mask=attn_mask).to(o_s.dtype)
    back = [0] * H
    for i, h in enumerate(sp + dn):
        back[h] = i
    out = torch.cat([o_s, o_d], 2).index_select(2, torch.tensor(back, device=dev))
    return (out, ix) if return_index else out
