"""Drop-in DSV attention modules.

PUBLIC API
------------------------------------------------------
class SparseAttention(nn.Module):
    SparseAttention(num_heads: int, head_dim: int, grid: tuple[int,int,int] | None = None,
                    config: DSVConfig | None = None, name: str | None = None)
    forward(q, k, v, grid=None, scale=None, *, n_text=0, text_first=False, attn_mask=None) -> out
        q, k, v, out: [B, S, H, D] (same layout as dsv_ext.sparse_attention; D contiguous).
        Replaces `F.scaled_dot_product_attention(q.transpose(1,2), ...).transpose(1,2)`.
        grid: (T, H, W) token grid of the video (T*H*W <= S; extra tokens after the grid keep
        their order); defaults to the grid given at construction / set_grid().
        Without a DSVController it is exactly dense SDPA (stage 1, no predictor work).
        Joint text+video attention: n_text > 0 marks the last n_text tokens (the first ones
        with text_first=True) as text tokens. They stay dense: text queries attend to all keys,
        and each video query group attends to its DSV-selected video keys plus every text key.
        Predictors, profiling and per-head K see the video part only. attn_mask: the SDPA mask
        of the dense path (as the model passes it); the sparse path reads it as a key-padding
        mask of the text tokens (bool, [B, 1, 1, S] or [B, S], True = attend; the video keys
        must all be valid there; a mask without text tokens keeps the call dense).
    set_grid(grid)                 # (T, H, W) token grid used when forward() gets none
    stage: int                     # 1 (dense) or 2 (sparse); set by the controller
    predictor: LowRankPredictor    # per-head [H, D, r] projections for q and k

class DSVAttention(nn.Module):   # full self-attention layer for new models
    DSVAttention(dim: int, num_heads: int, head_dim: int | None = None, qkv_bias: bool = True,
                 out_bias: bool = True, qk_norm: bool = False, norm_eps: float = 1e-6,
                 rotary: Callable[[q, k], tuple[q, k]] | None = None,
                 grid=None, config: DSVConfig | None = None)
    forward(x: [B, S, dim], grid=None, rotary=None) -> [B, S, dim]
        rotary (arg or constructor): callable (q, k) -> (q, k) on [B, S, H, D] applied after
        the optional QK RMSNorm and before attention.
    .qkv (Linear dim -> 3*H*D), .q_norm/.k_norm (RMSNorm over D or Identity), .proj, .attn_core

class DenseAttention(nn.Module): # plain SDPA core with the same call signature; convert()
    DenseAttention(num_heads, head_dim)   # swaps any `.attn_core` of this type for SparseAttention
    forward(q, k, v, grid=None, scale=None) -> out   # [B, S, H, D]
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSVConfig
from .grouping import check_grid, cube_permutation
from .predictor import LowRankPredictor

try:  # the compiled ops; the Python layer stays importable without them (clear error at use)
    from . import ops as _ops
    _OPS_ERROR: Optional[BaseException] = None
except Exception as e:  # pragma: no cover - only before the extension is built
    _ops = None  # type: ignore[assignment]
    _OPS_ERROR = e

__all__ = ["SparseAttention", "DSVAttention", "DenseAttention", "dense_core", "sparse_core", "joint_sparse_core"]


def _identity(x):
    return x


def _need_ops():
    if _ops is None:
        raise ImportError(f"dsv_ext.ops is not available (build the extension): {_OPS_ERROR}")
    return _ops


# ------------------------------------------------------------------------------------------------
# pure core functions (no module state, no host syncs): torch.compile(fullgraph=True) friendly

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
# dsv_ext.generic.route_sdpa, must not route the library's own dense calls back to itself)
_SDPA = F.scaled_dot_product_attention


def _autocast_inputs(q, k, v):
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


_CUDA_SPARSE_HEAD_DIMS = (64, 96, 128, 256)


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
    """Whether the sparse path (estimation + sparse attention) exists for this device and shape."""
    if not kernels_available(device, head_dim, rank):
        return False
    return torch.device(device).type != "cuda" or head_dim in _CUDA_SPARSE_HEAD_DIMS


def _estimate_index(qp: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                    counts: torch.Tensor, group_size: int, kmax: int) -> torch.Tensor:
    """Each query group's top-K keys from the low-rank projections of (cube-ordered) queries qp and
    keys k ([B, S, H, D]) by the predictor weights wq, wk ([H, D, r]); no gradient."""
    with torch.no_grad():
        q_lr = torch.einsum("bshd,hdr->bshr", qp.detach(), wq.detach().to(qp.dtype)).contiguous()
        k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), wk.detach().to(k.dtype)).contiguous()
    return _need_ops().topk_estimate(q_lr, k_lr, counts, group_size, kmax)


def sparse_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                perm: Optional[torch.Tensor], inv: Optional[torch.Tensor], kv_count: torch.Tensor,
                kmax: int, group_size: int, scale: Optional[float] = None,
                index: Optional[torch.Tensor] = None, return_index: bool = False,
                deterministic: Optional[bool] = None):
    """Stage-2 attention on [B, S, H, D]: cube-reorder the queries, low-rank projections (detached
    from the model graph), top-K estimation of each query group's keys, sparse attention,
    inverse reorder. Keys/values stay in their original order (kv_index addresses them there),
    so only q and the output are permuted.

    wq, wk: predictor weights [H, D, r]; perm/inv: int64 [S] (None = no reordering);
    kv_count: int32 [H] per-head K (<= kmax); kmax: Python int, the index list length.
    index: a kv_index [B, H, groups, kmax] from an earlier call with the same shapes, perm and
    kv_count, used instead of estimating again (inference index reuse); return_index: return
    (out, index); deterministic: see dsv_ext.sparse_attention."""
    ops = _need_ops()
    q, k, v = _autocast_inputs(q, k, v)
    out_dtype = q.dtype
    kdt = kernel_dtype(q)
    q, k, v = q.to(kdt), k.to(kdt), v.to(kdt)
    B, S, H, D = q.shape
    qp = q.index_select(1, perm) if perm is not None else q
    counts = kv_count.view(1, H).expand(B, H).contiguous()
    if index is None:
        index = _estimate_index(qp, k, wq, wk, counts, group_size, kmax)
    out = ops.sparse_attention(qp, k, v, index, counts, group_size, scale, check_index=False,
                               deterministic=deterministic)
    out = out.index_select(1, inv) if inv is not None else out
    out = out.to(out_dtype)
    return (out, index) if return_index else out


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
                      deterministic: Optional[bool] = None):
    """Stage-2 joint text+video attention on [B, S, H, D] (S = n_video + n_text; the text tokens
    last, or first with text_first). Video queries: one sparse_attention call over all keys
    (k, v as given, no copies) where each query group's list is its top-K video keys
    (estimated as in sparse_core, K = kv_count[h]) followed by every (valid) text key, so
    kv_count becomes K + n_text; the kernel needs as many query rows as keys, so the text
    queries fill the rows after the video ones and their outputs there are discarded (their
    gradient through that call is exactly zero). Text queries: dense SDPA over all keys.
    index: the video-part top-K index of an earlier call (reuse), return_index: (out, index);
    deterministic: see dsv_ext.sparse_attention."""
    ops = _need_ops()
    B, S, H, D = q.shape
    Sv = S - n_text
    vid, txt = (slice(n_text, S), slice(0, n_text)) if text_first else (slice(0, Sv), slice(Sv, S))
    text_valid = _text_key_mask(attn_mask, B, S, txt)
    out_t = dense_core(q[:, txt], k, v, scale, backend, attn_mask=attn_mask)
    q, k, v = _autocast_inputs(q, k, v)
    out_dtype = q.dtype
    kdt = kernel_dtype(q)
    q, k, v = q.to(kdt), k.to(kdt), v.to(kdt)
    qv, kv, qt = q[:, vid], k[:, vid], q[:, txt]
    qp = qv.index_select(1, perm) if perm is not None else qv
    counts = kv_count.view(1, H).expand(B, H).contiguous()
    if index is None:
        index = _estimate_index(qp, kv, wq, wk, counts, group_size, kmax)
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


# ------------------------------------------------------------------------------------------------

def set_index_refresh(model: nn.Module, every: int) -> int:
    """Inference: every SparseAttention in `model` estimates its critical keys on every
    `every`-th call in eval mode and reuses the index in between (see
    SparseAttention.set_index_refresh; 1 restores per-call estimation). Returns how many modules
    were set. Typical use, around a sampling loop of a DSV-trained model::

        model.eval()
        dsv_ext.set_index_refresh(model, 2)   # estimate on every second denoising step
        ...sample...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    n = 0
    for m in model.modules():
        if isinstance(m, SparseAttention):
            m.set_index_refresh(every)
            n += 1
    return n


# ------------------------------------------------------------------------------------------------

class DenseAttention(nn.Module):
    """Plain SDPA attention core with SparseAttention's call signature (q, k, v: [B, S, H, D]).

    A model may use it as its `.attn_core`; dsv_ext.convert() swaps it for a SparseAttention."""

    def __init__(self, num_heads: int, head_dim: int, backend: str = "auto"):
        super().__init__()
        self.num_heads, self.head_dim, self.backend = int(num_heads), int(head_dim), backend

    def forward(self, q, k, v, grid=None, scale=None):
        return dense_core(q, k, v, scale, self.backend)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}"


class SparseAttention(nn.Module):
    """Drop-in for F.scaled_dot_product_attention on [B, S, H, D] with DSV's two stages.

    Stage 1 (default; also what you get without a DSVController): dense SDPA. When the controller
    arms a step, the forward additionally trains the predictors on sampled query rows (loss and
    its backward run here on detached q, k; the gradients go to a private accumulator that the
    controller applies, the model's graph and .grad are untouched) and/or profiles the per-head
    sparsity. Stage 2: cube-ordered query groups, top-K keys per group estimated from the
    low-rank predictors with per-head K from the profiled sparsity, sparse attention; blocks the
    dispatcher keeps dense stay on SDPA.

    State the controller sets (all host-side): stage, use_sparse, density/kv_count/kmax (from the
    sparsity EMAs), _train_now, _profile_now, _row_offset.
    """

    def __init__(self, num_heads: int, head_dim: int, grid: Optional[Sequence[int]] = None,
                 config: Optional[DSVConfig] = None, name: Optional[str] = None):
        super().__init__()
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
        self.config = config if config is not None else DSVConfig()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.name = name
        self.grid: Optional[Tuple[int, int, int]] = None
        if grid is not None:
            self.set_grid(grid)
        self.predictor = LowRankPredictor(num_heads, head_dim, self.config.rank)
        # stage / dispatch state (host side, set by the controller)
        self.stage: int = 1
        self.use_sparse: bool = False
        self.density: Optional[List[float]] = None       # per-head 1 - sparsity EMA
        self.kmax: int = 0
        self._k_seq_len: int = -1
        self.register_buffer("kv_count", torch.zeros(num_heads, dtype=torch.int32), persistent=False)
        # per-step flags (controller) and per-step results (read by the controller)
        self._train_now: bool = False
        self._profile_now: bool = False
        self._row_offset: int = 0
        self._seq_len: int = -1
        self._batch: int = 1
        self._dtype: torch.dtype = torch.float32
        self._pending_loss: Optional[torch.Tensor] = None      # [H] sum over forwards
        self._pending_loss_n: int = 0
        self._pending_sparsity: Optional[torch.Tensor] = None  # [H]
        self._pending_sparsity_n: int = 0
        self._pending_recall: Optional[torch.Tensor] = None    # [H]
        self._pending_recall_n: int = 0
        self._pending_curve: Optional[torch.Tensor] = None     # [H, bins] recall vs K (k_rule recall)
        self._pending_curve_n: int = 0
        self._rows_cache: Dict[tuple, torch.Tensor] = {}
        self._grad_acc: Optional[List[torch.Tensor]] = None     # predictor grads [wq, wk]
        self._warned = False
        # inference index reuse (set_index_refresh): estimate every `index_refresh` calls in eval
        self.index_refresh: int = 1
        self._index_cache: Optional[Tuple[tuple, torch.Tensor]] = None
        self._index_calls: int = 0
        # context parallelism (dsv_ext.parallel.enable): None = this rank holds whole sequences
        self._cp = None

    # ---------------------------------------------------------------- configuration
    def set_grid(self, grid: Optional[Sequence[int]]) -> None:
        """The (T, H, W) token grid used when forward() is called without one (None: no reorder)."""
        self.grid = None if grid is None else check_grid(grid)

    def set_density(self, density: Optional[Sequence[float]], seq_len: Optional[int] = None) -> None:
        """Per-head density (1 - sparsity) -> per-head K for seq_len (host only, no sync)."""
        if density is None:
            self.density, self.kmax, self._k_seq_len = None, 0, -1
            return
        if len(density) != self.num_heads:
            raise ValueError(f"density: expected {self.num_heads} values, got {len(density)}")
        self.density = [float(d) for d in density]
        # no length given: the training length, else the length the counts were last built for
        # (kv_count must follow the new density even when no side task recorded a length)
        S = seq_len if seq_len is not None else (self._seq_len if self._seq_len > 0 else self._k_seq_len)
        if S is not None and S > 0:
            self._refresh_counts(S)

    @torch._dynamo.disable
    def _refresh_counts(self, S: int) -> None:
        ks = [self.config.head_k(1.0 - d, S) for d in self.density]  # type: ignore[union-attr]
        self.kmax = max(ks)
        with torch.no_grad():
            self.kv_count.copy_(torch.tensor(ks, dtype=torch.int32), non_blocking=True)
        self._k_seq_len = S

    def set_index_refresh(self, every: int) -> None:
        """Inference only: estimate the critical keys on every `every`-th stage-2 call in eval
        mode and reuse that index on the calls in between (1, the default: estimate every call,
        exactly DSV). In a sampler each call is one model evaluation, and attention patterns of
        neighbouring denoising steps are close, so 2-4 saves most of the estimation cost. The
        index is re-estimated whenever the batch, length, grid or per-head K change; training
        mode never reuses it. Also resets the counter (reset_index_cache)."""
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every: expected an integer >= 1, got {every!r}")
        self.index_refresh = every
        self.reset_index_cache()

    def reset_index_cache(self) -> None:
        """Forget a reused index: the next eval call estimates again (call it per new batch)."""
        self._index_cache = None
        self._index_calls = 0

    @property
    def head_k(self) -> List[int]:
        """Per-head K for the current sequence length (host copy, no device sync)."""
        if self.density is None or self._k_seq_len < 0:
            return []
        return [self.config.head_k(1.0 - d, self._k_seq_len) for d in self.density]

    # ---------------------------------------------------------------- forward
    def _check(self, q, k, v) -> None:
        for n, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{n}: expected a [B, S, H, D] tensor, got shape {tuple(t.shape)}")
            if t.shape[2] != self.num_heads or t.shape[3] != self.head_dim:
                raise ValueError(f"{n}: expected H={self.num_heads}, D={self.head_dim} in [B, S, H, D], "
                                 f"got shape {tuple(t.shape)}")
        if k.shape != q.shape or v.shape != q.shape:
            raise ValueError(f"k, v: expected the shape of q {tuple(q.shape)} (self-attention), "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")

    def _perm(self, grid, S: int, device):
        if grid is None:
            return None, None
        return cube_permutation(grid, self.config.cube, S, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Optional[Sequence[int]] = None,
                scale: Optional[float] = None, *, n_text: int = 0, text_first: bool = False,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check(q, k, v)
        if n_text or attn_mask is not None:
            return self._joint_forward(q, k, v, grid, scale, int(n_text), bool(text_first), attn_mask)
        if self._cp is not None:  # context parallel (dsv_ext.parallel.enable): q, k, v are shards
            from .parallel.module import cp_forward
            return cp_forward(self, q, k, v, scale)
        grid = self.grid if grid is None else tuple(grid)
        if self.training and (self._train_now or self._profile_now):
            self._side_tasks(q, k, grid, scale)
        if self.stage == 2 and self.use_sparse and self.density is not None:
            S = q.shape[1]
            if S != self._k_seq_len:
                self._refresh_counts(S)
            perm, inv = self._perm(grid, S, q.device)
            if self.training or self.index_refresh <= 1:
                return sparse_core(q, k, v, self.predictor.wq, self.predictor.wk, perm, inv,
                                   self.kv_count, self.kmax, self.config.group_size, scale,
                                   deterministic=self.config.deterministic)
            return self._reuse_index_core(q, k, v, grid, perm, inv, scale)
        return dense_core(q, k, v, scale, self.config.dense_backend)

    def _joint_forward(self, q, k, v, grid, scale, n_text: int, text_first: bool, attn_mask):
        """forward() with text tokens (n_text > 0) and/or an attention mask (see the class doc)."""
        S = q.shape[1]
        if not 0 <= n_text < S:
            raise ValueError(f"n_text: expected 0 <= n_text < S={S}, got {n_text}")
        if self._cp is not None:
            raise ValueError("n_text: joint text+video attention is not supported under context parallelism")
        grid = self.grid if grid is None else tuple(grid)
        Sv = S - n_text
        if grid is not None and grid[0] * grid[1] * grid[2] > Sv:
            raise ValueError(f"grid: {grid} has more tokens than the {Sv} video tokens (S={S}, n_text={n_text})")
        vid = slice(n_text, S) if text_first else slice(0, Sv)
        if self.training and (self._train_now or self._profile_now):
            self._side_tasks(q[:, vid], k[:, vid], grid, scale)
        if self.stage == 2 and self.use_sparse and self.density is not None and n_text > 0:
            if Sv != self._k_seq_len:
                self._refresh_counts(Sv)
            perm, inv = self._perm(grid, Sv, q.device)
            index = None
            key = (tuple(q.shape), n_text, grid, str(q.device), self.kmax, tuple(self.head_k))
            reuse = not self.training and self.index_refresh > 1
            if reuse:
                cached = self._index_cache
                if cached is not None and cached[0] == key and self._index_calls % self.index_refresh != 0:
                    index = cached[1]
                else:
                    self._index_calls = 0
            out, index = joint_sparse_core(q, k, v, self.predictor.wq, self.predictor.wk, perm, inv, self.kv_count,
                                           self.kmax, self.config.group_size, scale, n_text, text_first, attn_mask,
                                           self.config.dense_backend, index=index, return_index=True,
                                           deterministic=self.config.deterministic)
            if reuse:
                self._index_cache = (key, index)
                self._index_calls += 1
            return out
        return dense_core(q, k, v, scale, self.config.dense_backend, attn_mask=attn_mask)

    @torch._dynamo.disable
    def _reuse_index_core(self, q, k, v, grid, perm, inv, scale):
        key = (tuple(q.shape), grid, str(q.device), self.kmax, tuple(self.head_k))
        cached = self._index_cache
        index = None
        if cached is not None and cached[0] == key and self._index_calls % self.index_refresh != 0:
            index = cached[1]
        else:
            self._index_calls = 0  # a (re-)estimate starts a new cycle
        out, index = sparse_core(q, k, v, self.predictor.wq, self.predictor.wk, perm, inv,
                                 self.kv_count, self.kmax, self.config.group_size, scale,
                                 index=index, return_index=True, deterministic=self.config.deterministic)
        self._index_cache = (key, index)
        self._index_calls += 1
        return out

    # ---------------------------------------------------------------- side tasks (eager)
    def _rows(self, S: int, device) -> torch.Tensor:
        stride = self.config.row_sample_stride
        off = self._row_offset % min(stride, S)
        key = (S, off, str(device))
        r = self._rows_cache.get(key)
        if r is None:
            if len(self._rows_cache) > 32:
                self._rows_cache.clear()
            r = torch.arange(off, S, stride, dtype=torch.int32).to(device)
            self._rows_cache[key] = r
        return r

    @staticmethod
    def _accumulate(cur: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
        return new if cur is None else cur + new

    @torch._dynamo.disable
    def _side_tasks(self, q: torch.Tensor, k: torch.Tensor, grid, scale: Optional[float],
                    rows: Optional[torch.Tensor] = None, weight: float = 1.0) -> None:
        """Predictor training step (loss + backward into predictor .grad) and profiling, on
        detached q, k. Skipped while autograd recomputes a checkpointed forward. ``rows``: the
        sampled query rows, positions in the cube order of ``grid`` (the query groups' order;
        default: every row_sample_stride-th); ``weight`` scales this call's
        gradients and statistics (context parallelism passes the rank's own rows, weighted by
        their share, so that the average over ranks is the single-process value)."""
        if torch._C._current_graph_task_id() != -1:  # inside backward (activation recompute)
            return
        cfg = self.config
        if not kernels_available(q.device, self.head_dim, cfg.rank):
            if not self._warned:
                import warnings
                warnings.warn(f"SparseAttention({self.name}): no dsv kernels for {q.device.type} with "
                              f"head_dim={self.head_dim}, rank={cfg.rank}: predictors are not trained "
                              "and the block stays dense")
                self._warned = True
            return
        ops = _need_ops()
        kdt = kernel_dtype(q)
        q, k = q.detach().to(kdt), k.detach().to(kdt)
        B, S, H, D = q.shape
        self._seq_len, self._batch, self._dtype = S, B, q.dtype
        if rows is None:
            rows = self._rows(S, q.device)
        # every task samples the same rows of the cube-ordered queries (what the query groups and
        # a context-parallel rank's shard see)
        perm, _ = self._perm(grid, S, q.device)
        if perm is not None:
            q = q.index_select(1, perm)
        # identity saved-tensor hooks: the predictor-loss graph must stay invisible to activation
        # checkpointing (whose own hooks would otherwise count these tensors) and to offloading
        with torch.autocast(device_type=q.device.type, enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            if self._train_now:
                with torch.enable_grad():
                    wq = self.predictor.wq.detach().requires_grad_(True)
                    wk = self.predictor.wk.detach().requires_grad_(True)
                    q_lr, k_lr = self.predictor(q, k, wq, wk)
                    loss = ops.predictor_loss(q, k, q_lr, k_lr, rows, scale, cfg.cos_weight,
                                              cfg.norm_weight, check_rows=False)
                    gq, gk = torch.autograd.grad(loss.mean(0).sum() * weight, (wq, wk))
                if self._grad_acc is None:
                    self._grad_acc = [gq, gk]
                else:
                    self._grad_acc[0] += gq
                    self._grad_acc[1] += gk
                self._pending_loss = self._accumulate(self._pending_loss, loss.detach().float().mean(0) * weight)
                self._pending_loss_n += 1
            if self._profile_now:
                with torch.no_grad():
                    recall = None
                    if cfg.measure_recall and self.density is not None:
                        if S != self._k_seq_len:
                            self._refresh_counts(S)
                        q_lr, k_lr = self.predictor(q, k)
                        counts = self.kv_count.view(1, H).expand(B, H).contiguous()
                        index = ops.topk_estimate(q_lr, k_lr, counts, cfg.group_size, self.kmax)
                        prof = ops.profile_attention(q, k, rows, cfg.theta, index, counts, cfg.group_size, scale)
                        recall = prof.recall
                    else:
                        prof = ops.profile_attention(q, k, rows, cfg.theta, scale=scale)
                self._pending_sparsity = self._accumulate(self._pending_sparsity,
                                                          prof.sparsity.float().mean(0) * weight)
                self._pending_sparsity_n += 1
                if recall is not None:
                    self._pending_recall = self._accumulate(self._pending_recall, recall.float().mean(0) * weight)
                    self._pending_recall_n += 1
                if cfg.k_rule == "recall":
                    from .recall import recall_curve
                    curve = recall_curve(q, k, self.predictor.wq, self.predictor.wk, rows, cfg.group_size,
                                         cfg.k_multiple, scale, max_rows=cfg.recall_rows)
                    if self._pending_curve is not None and self._pending_curve.shape[-1] != curve.shape[-1]:
                        self._pending_curve, self._pending_curve_n = None, 0  # the length changed
                    self._pending_curve = self._accumulate(self._pending_curve, curve.mean(0) * weight)
                    self._pending_curve_n += 1

    def sparse_supported(self) -> bool:
        """Whether this block can run the sparse path on its device (dispatcher precondition)."""
        return sparse_supported(self.kv_count.device, self.head_dim, self.config.rank)

    def predictor_parameters(self):
        """The predictor weights (trained by DSVController's own optimizer, never by the model's)."""
        return list(self.predictor.parameters())

    def pop_grads(self) -> Optional[List[torch.Tensor]]:
        """Predictor gradients accumulated by the forwards since the last call ([d wq, d wk])."""
        g, self._grad_acc = self._grad_acc, None
        return g

    def pop_pending(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(mean loss [H], mean sparsity [H], mean recall [H]) measured since the last call (device
        tensors or None); resets the accumulators. Used by the controller."""
        def mean(t, n):
            return None if t is None or n == 0 else t / n
        out = (mean(self._pending_loss, self._pending_loss_n),
               mean(self._pending_sparsity, self._pending_sparsity_n),
               mean(self._pending_recall, self._pending_recall_n))
        self._pending_loss, self._pending_loss_n = None, 0
        self._pending_sparsity, self._pending_sparsity_n = None, 0
        self._pending_recall, self._pending_recall_n = None, 0
        return out

    def pop_recall_curve(self) -> Optional[torch.Tensor]:
        """Mean recall-versus-K curve [H, ceil(S / k_multiple)] (device tensor, see
        dsv_ext.recall.recall_curve) measured by the profile forwards since the last call (k_rule
        "recall"), or None; resets the accumulator. Used by the controller."""
        c, n = self._pending_curve, self._pending_curve_n
        self._pending_curve, self._pending_curve_n = None, 0
        return None if c is None or n == 0 else c / n

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, grid={self.grid}, stage={self.stage}, "
                f"use_sparse={self.use_sparse}, rank={self.config.rank}, group_size={self.config.group_size}")


# ------------------------------------------------------------------------------------------------

class DSVAttention(nn.Module):
    """Self-attention layer for new models: qkv projection, optional QK RMSNorm, rotary hook,
    DSV attention core (SparseAttention) and output projection. x: [B, S, dim] -> [B, S, dim]."""

    def __init__(self, dim: int, num_heads: int, head_dim: Optional[int] = None, qkv_bias: bool = True,
                 out_bias: bool = True, qk_norm: bool = False, norm_eps: float = 1e-6,
                 rotary: Optional[Callable] = None, grid: Optional[Sequence[int]] = None,
                 config: Optional[DSVConfig] = None):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim: expected a positive int, got {dim!r}")
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"num_heads: {num_heads} does not divide dim={dim} (pass head_dim)")
            head_dim = dim // num_heads
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        inner = num_heads * head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.rotary = rotary
        self.attn_core = SparseAttention(num_heads, head_dim, grid=grid, config=config)
        self.proj = nn.Linear(inner, dim, bias=out_bias)

    @classmethod
    def from_modules(cls, qkv: nn.Linear, proj: nn.Linear, num_heads: int, head_dim: int,
                     q_norm: Optional[nn.Module] = None, k_norm: Optional[nn.Module] = None,
                     rotary: Optional[Callable] = None, grid: Optional[Sequence[int]] = None,
                     config: Optional[DSVConfig] = None) -> "DSVAttention":
        """A DSVAttention that takes over existing layers (no copies: same parameters)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.dim, self.num_heads, self.head_dim = qkv.in_features, num_heads, head_dim
        if qkv.out_features != 3 * num_heads * head_dim:
            raise ValueError(f"qkv: expected {3 * num_heads * head_dim} output features, got {qkv.out_features}")
        self.qkv = qkv
        self.q_norm = q_norm if q_norm is not None else nn.Identity()
        self.k_norm = k_norm if k_norm is not None else nn.Identity()
        self.rotary = rotary
        self.attn_core = SparseAttention(num_heads, head_dim, grid=grid, config=config)
        p = qkv.weight
        self.attn_core.to(device=p.device)
        self.proj = proj
        return self

    def forward(self, x: torch.Tensor, grid: Optional[Sequence[int]] = None,
                rotary: Optional[Callable] = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, S, {self.dim}], got shape {tuple(x.shape)}")
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        rot = rotary if rotary is not None else self.rotary
        if rot is not None:
            q, k = rot(q, k)
        o = self.attn_core(q, k, v, grid=grid)
        return self.proj(o.reshape(B, S, self.num_heads * self.head_dim))
