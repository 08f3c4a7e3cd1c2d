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
        of the dense path (as the model passes it; a [B, S] key-padding mask is taken as
        [B, 1, 1, S]); the sparse path reads it as a key-padding
        mask of the text tokens (bool, [B, 1, 1, S] or [B, S], True = attend; the video keys
        must all be valid there; a mask without text tokens keeps the call dense).
    set_grid(grid)                 # (T, H, W) token grid used when forward() gets none
    set_density(density, seq_len=None) / set_head_k(head_k, seq_len)   # per-head K by hand
    set_index_refresh(every)       # inference: reuse the estimated index for `every` calls
    head_kv_block -> tuple[int]    # per-head list granularity (config.kv_block, or the plan's choice)
    predictor: LowRankPredictor    # per-head [H, D, r] projections for q and k
    # the driver's contract (dsv_ext.modules.contract; DSVController uses it):
    plan_step(plan: StepPlan)      # stage, train, profile, row_offset, mode, density of a step
    plan -> StepPlan; stage, use_sparse, density   # views of the plan (stage, use_sparse settable)
    take_stats() -> ModuleStats    # grads, loss, sparsity, recall, recall_curve (resets)
    workload -> Workload           # seq_len, batch, dtype of the latest training forward
    set_context_parallel(runner)   # forward() calls runner(self, q, k, v, scale) (parallel.enable)

class DSVAttention(nn.Module):   # full self-attention layer for new models
    DSVAttention(dim: int, num_heads: int, head_dim: int | None = None, qkv_bias: bool = True,
                 out_bias: bool = True, qk_norm: bool = False, norm_eps: float = 1e-6,
                 rotary: Callable[[q, k], tuple[q, k]] | None = None,
                 grid=None, config: DSVConfig | None = None)
    forward(x: [B, S, dim], grid=None, rotary=None) -> [B, S, dim]
        rotary (arg or constructor): callable (q, k) -> (q, k) on [B, S, H, D] applied after
        the optional QK RMSNorm and before attention.
    .qkv (Linear dim -> 3*H*D), .q_norm/.k_norm (RMSNorm over D or Identity), .proj, .attn_core

class RMSNorm(nn.RMSNorm):       # DSVAttention's QK norm: the weight in the input's dtype, so
                                 # that bf16 autocast keeps the fused kernel

class DenseAttention(nn.Module): # plain SDPA core with the same call signature; convert()
    DenseAttention(num_heads, head_dim)   # swaps any `.attn_core` of this type for SparseAttention
    forward(q, k, v, grid=None, scale=None) -> out   # [B, S, H, D]
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..config import DSVConfig
from ..config import KV_BLOCKS
from ..functional.attention import (block_counts, block_kmax, dense_core, head_groups_core, joint_sparse_core,
                                    kernel_dtype, kernels_available, need_ops, sparse_core, sparse_supported)
from ..grouping import check_grid, cube_permutation
from ..recall import recall_curve
from .contract import ModuleStats, StepPlan, Workload
from .predictor import LowRankPredictor

__all__ = ["SparseAttention", "DSVAttention", "DenseAttention", "set_index_refresh", "StepPlan", "ModuleStats",
           "Workload"]


def _identity(x):
    return x


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

    Stage 1 (default; also what you get without a DSVController): dense SDPA. When the step plan
    asks for it, the training forward additionally trains the predictors on sampled query rows
    (loss and its backward run here on detached q, k; the gradients go to a private accumulator
    that the controller reads with take_stats(); the model's graph and .grad are untouched)
    and/or profiles the per-head sparsity. Stage 2: cube-ordered query groups, top-K keys per
    group estimated from the low-rank predictors with per-head K from the profiled sparsity,
    sparse attention; blocks the dispatcher keeps dense stay on SDPA. With key blocks
    (DSVConfig.kv_block 16 / 64, or per head under "auto": ``head_kv_block``) k and v are put in
    the same cube order, the lists hold ceil(K / b) blocks of b consecutive keys, and per-head K
    stays in keys (joint text+video calls keep token lists).

    The driver's side (dsv_ext.modules.contract): ``plan_step(StepPlan)`` hands over a step's
    decisions (stage, train, profile, sampled rows, sparse/dense, per-head density);
    ``take_stats() -> ModuleStats`` returns what the forwards measured; ``workload`` is the input
    shape of the latest training forward. Context parallelism is given to the module:
    ``set_context_parallel(runner)`` (dsv_ext.parallel.enable does it) makes forward() call
    ``runner(self, q, k, v, scale)`` on this rank's shard.
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
        # the driver's decisions (plan_step) and the per-head K they give (host side)
        self._plan = StepPlan()
        self.kmax: int = 0
        self._ks: List[int] = []          # per-head K for _k_seq_len
        self._k_seq_len: int = -1
        self.register_buffer("kv_count", torch.zeros(num_heads, dtype=torch.int32), persistent=False)
        # what the training forwards saw and measured (workload, take_stats)
        self._workload = Workload()
        self._grad_acc: Optional[List[torch.Tensor]] = None     # predictor grads [wq, wk]
        self._sums: Dict[str, Tuple[torch.Tensor, int]] = {}   # name -> (sum over forwards, count)
        self._rows_cache: Dict[tuple, torch.Tensor] = {}
        self._warned = False
        # inference index reuse (set_index_refresh): estimate every `index_refresh` calls in eval
        self.index_refresh: int = 1
        self._index_cache: Optional[Tuple[tuple, torch.Tensor]] = None
        self._index_calls: int = 0
        # context parallelism (set_context_parallel): None = this rank holds whole sequences
        self._cp: Optional[Callable] = None

    # ---------------------------------------------------------------- the driver's contract
    @property
    def plan(self) -> StepPlan:
        """The step plan in force (see plan_step)."""
        return self._plan

    def plan_step(self, plan: StepPlan) -> None:
        """Take a driver's decisions for the coming forwards (dsv_ext.modules.contract.StepPlan):
        stage, predictor training / profiling, the sampled rows, sparse or dense, per-head
        density (per-head K follows for the workload's length, host only, no sync)."""
        if not isinstance(plan, StepPlan):
            raise TypeError(f"plan: expected a StepPlan, got {type(plan).__name__}")
        if plan.density is not None and len(plan.density) != self.num_heads:
            raise ValueError(f"plan: density has {len(plan.density)} values, expected {self.num_heads}")
        if plan.kv_block is not None and len(plan.kv_block) != self.num_heads:
            raise ValueError(f"plan: kv_block has {len(plan.kv_block)} values, expected {self.num_heads}")
        old, self._plan = self._plan, plan
        if plan.density is None:
            self.kmax, self._ks, self._k_seq_len = 0, [], -1
            return
        S = self._workload.seq_len if self._workload.seq_len > 0 else self._k_seq_len
        if S > 0 and (plan.density != old.density or S != self._k_seq_len):
            self._refresh_counts(S)

    def take_stats(self) -> ModuleStats:
        """What the training forwards measured since the last call (ModuleStats: predictor
        gradients, loss, sparsity, recall, recall curve; device tensors); resets it."""
        st = self.peek_stats()
        self._grad_acc, self._sums = None, {}
        return st

    def peek_stats(self) -> ModuleStats:
        """take_stats() without the reset."""
        def mean(name):
            s = self._sums.get(name)
            return None if s is None else s[0] / s[1]
        g = self._grad_acc
        return ModuleStats(grads=None if g is None else (g[0], g[1]), loss=mean("loss"),
                           sparsity=mean("sparsity"), recall=mean("recall"), recall_curve=mean("curve"),
                           block_curves=mean("bcurve"),
                           trained=self._sums.get("loss", (None, 0))[1],
                           profiled=self._sums.get("sparsity", (None, 0))[1])

    @property
    def workload(self) -> Workload:
        """Input shape (video part) of the latest training forward: seq_len, batch, dtype."""
        return self._workload

    def set_workload(self, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> None:
        """Restore the workload (from a checkpoint, or for planning before any forward)."""
        if not isinstance(seq_len, int) or seq_len == 0 or seq_len < -1:
            raise ValueError(f"seq_len: expected a positive int (or -1: unknown), got {seq_len!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        self._workload = Workload(seq_len, batch, dtype)

    # public views of the plan (kept settable for benchmarks and tests: they replace the plan)
    @property
    def stage(self) -> int:
        """1 (dense) or 2 (DSV); part of the step plan."""
        return self._plan.stage

    @stage.setter
    def stage(self, value: int) -> None:
        self._plan = replace(self._plan, stage=int(value))

    @property
    def use_sparse(self) -> bool:
        """Whether stage 2 runs this block sparse (the plan's mode)."""
        return self._plan.mode == "sparse"

    @use_sparse.setter
    def use_sparse(self, value: bool) -> None:
        self._plan = replace(self._plan, mode="sparse" if value else "dense")

    @property
    def head_kv_block(self) -> Tuple[int, ...]:
        """Per-head list granularity: the plan's (DSVConfig.kv_block "auto": the dispatcher's
        choice), else config.kv_block (1 while "auto" has not chosen)."""
        if self._plan.kv_block is not None:
            return self._plan.kv_block
        kb = self.config.kv_block
        return (kb if isinstance(kb, int) else 1,) * self.num_heads

    def _full_heads(self, S: int) -> Tuple[int, ...]:
        """The heads whose K covers all S keys (they run dense; host only)."""
        return tuple(h for h, kk in enumerate(self._ks) if kk >= S)

    def _head_groups(self, S: int) -> Tuple[Tuple[int, Tuple[int, ...], int], ...]:
        """(kv_block, heads, kmax in keys) per granularity in use (host only); heads whose K
        covers all S keys form a group of kv_block 0 (run dense, head_groups_core)."""
        kb = self.head_kv_block
        full = self._full_heads(S)
        out = [(0, full, S)] if full else []
        for b in KV_BLOCKS:
            hs = tuple(h for h in range(self.num_heads) if kb[h] == b and h not in full)
            if hs:
                out.append((b, hs, max(self._ks[h] for h in hs) if self._ks else self.kmax))
        return tuple(out)

    @property
    def density(self) -> Optional[List[float]]:
        """Per-head K / S of the plan (None: no estimate yet)."""
        d = self._plan.density
        return None if d is None else list(d)

    # ---------------------------------------------------------------- configuration
    def set_grid(self, grid: Optional[Sequence[int]]) -> None:
        """The (T, H, W) token grid used when forward() is called without one (None: no reorder)."""
        self.grid = None if grid is None else check_grid(grid)

    def set_density(self, density: Optional[Sequence[float]], seq_len: Optional[int] = None) -> None:
        """Per-head density (1 - sparsity) -> per-head K for seq_len (default: the workload's
        length, else the length K was last sized for); host only, no sync."""
        if density is None:
            self.plan_step(replace(self._plan, density=None))
            return
        if len(density) != self.num_heads:
            raise ValueError(f"density: expected {self.num_heads} values, got {len(density)}")
        self._plan = replace(self._plan, density=tuple(float(d) for d in density))
        S = seq_len if seq_len is not None else (
            self._workload.seq_len if self._workload.seq_len > 0 else self._k_seq_len)
        if S is not None and S > 0:
            self._refresh_counts(S)

    def set_head_k(self, head_k: Sequence[int], seq_len: int) -> None:
        """Pin per-head K exactly (1 <= K <= seq_len) for sequences of seq_len tokens; the
        density becomes K / seq_len (another length sizes K from it through config.head_k)."""
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len: expected a positive int, got {seq_len!r}")
        ks = [int(k) for k in head_k]
        if len(ks) != self.num_heads or not all(1 <= k <= seq_len for k in ks):
            raise ValueError(f"head_k: expected {self.num_heads} values in [1, {seq_len}], got {ks}")
        self._plan = replace(self._plan, density=tuple(k / seq_len for k in ks))
        self._set_counts(ks, seq_len)

    @torch._dynamo.disable
    def _refresh_counts(self, S: int) -> None:
        self._set_counts([self.config.head_k(1.0 - d, S) for d in self._plan.density], S)  # type: ignore

    def _set_counts(self, ks: List[int], S: int) -> None:
        self._ks, self.kmax, self._k_seq_len = ks, max(ks), S
        with torch.no_grad():
            self.kv_count.copy_(torch.tensor(ks, dtype=torch.int32), non_blocking=True)

    def kv_counts_for(self, S: int) -> torch.Tensor:
        """Per-head K (int32 [H], the kv_count buffer) sized for sequences of S tokens."""
        if S != self._k_seq_len:
            self._refresh_counts(S)
        return self.kv_count

    @property
    def k_seq_len(self) -> int:
        """The sequence length per-head K is sized for (-1: none)."""
        return self._k_seq_len

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
        if self._plan.density is None or self._k_seq_len < 0:
            return []
        return list(self._ks)

    @property
    def context_parallel(self) -> Optional[Callable]:
        """The context-parallel runner in use (None: whole sequences; see set_context_parallel)."""
        return self._cp

    def set_context_parallel(self, runner: Optional[Callable]) -> None:
        """Run forward() through ``runner(self, q, k, v, scale) -> out`` on this rank's sequence
        shard (dsv_ext.parallel.enable registers one); None: back to whole sequences. Drops a
        reused inference index."""
        if runner is not None and not callable(runner):
            raise TypeError(f"runner: expected a callable or None, got {type(runner).__name__}")
        self._cp = runner
        self.reset_index_cache()

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

    @property
    def side_tasks_due(self) -> bool:
        """Whether a forward now runs the plan's predictor training / profiling (training mode)."""
        return self.training and self._plan.side_tasks

    def _sparse_now(self) -> bool:
        return self.stage == 2 and self.use_sparse and self._plan.density is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Optional[Sequence[int]] = None,
                scale: Optional[float] = None, *, n_text: int = 0, text_first: bool = False,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check(q, k, v)
        if n_text or attn_mask is not None:
            return self._joint_forward(q, k, v, grid, scale, int(n_text), bool(text_first), attn_mask)
        if self._cp is not None:  # context parallel: q, k, v are this rank's shards
            return self._cp(self, q, k, v, scale)
        grid = self.grid if grid is None else tuple(grid)
        if self.side_tasks_due:
            self.run_side_tasks(q, k, grid, scale)
        if not self._sparse_now():
            return dense_core(q, k, v, scale, self.config.dense_backend)
        S = q.shape[1]
        perm, inv = self._perm(grid, S, q.device)
        counts = self.kv_counts_for(S)
        groups = self._head_groups(S)
        if len(groups) == 1 and groups[0][0] == 0:  # every head attends to all keys
            return dense_core(q, k, v, scale, self.config.dense_backend)
        if len(groups) == 1:  # one granularity for every head (kv_block 1: DSV as before)
            b = groups[0][0]
            core, args = sparse_core, (q, k, v, self.predictor.wq, self.predictor.wk, perm, inv, counts, self.kmax,
                                       self.config.group_size, scale)
            extra = {} if b == 1 else {"kv_block": b}
        else:  # heads that attend to all keys run dense, the others one sparse call per granularity
            core, args = head_groups_core, (q, k, v, self.predictor.wq, self.predictor.wk, perm, inv, counts,
                                            groups, self.config.group_size, scale)
            extra = {"backend": self.config.dense_backend}
        kb = self.head_kv_block
        if self._reuse_index():
            return self._with_index_reuse((tuple(q.shape), grid, str(q.device), kb), core, *args,
                                          deterministic=self.config.deterministic, **extra)
        return core(*args, deterministic=self.config.deterministic, **extra)

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
        B = q.shape[0]
        if attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] in (1, B) and \
                attn_mask.shape[0] != S and attn_mask.shape[1] == S:
            attn_mask = attn_mask[:, None, None, :]  # a key-padding mask [B, S]: SDPA's layout [B, 1, 1, S]
        if self.side_tasks_due:
            self.run_side_tasks(q[:, vid], k[:, vid], grid, scale)
        if not (self._sparse_now() and n_text > 0):
            return dense_core(q, k, v, scale, self.config.dense_backend, attn_mask=attn_mask)
        perm, inv = self._perm(grid, Sv, q.device)
        counts = self.kv_counts_for(Sv)
        full = self._full_heads(Sv)  # video queries on all keys: dense
        if len(full) == self.num_heads:
            return dense_core(q, k, v, scale, self.config.dense_backend, attn_mask=attn_mask)
        kmax = max(kk for h, kk in enumerate(self._ks) if h not in full) if full else self.kmax
        args = (q, k, v, self.predictor.wq, self.predictor.wk, perm, inv, counts, kmax,
                self.config.group_size, scale, n_text, text_first, attn_mask, self.config.dense_backend)
        extra = {"deterministic": self.config.deterministic, "dense_heads": full}
        if self._reuse_index():
            return self._with_index_reuse((tuple(q.shape), n_text, grid, str(q.device)), joint_sparse_core,
                                          *args, **extra)
        return joint_sparse_core(*args, **extra)

    def _reuse_index(self) -> bool:
        return not self.training and self.index_refresh > 1

    @torch._dynamo.disable
    def _with_index_reuse(self, key: tuple, core: Callable, *args, **kwargs) -> torch.Tensor:
        """Eval-mode index reuse (set_index_refresh): ``core`` with the kept index while it is
        valid for ``key`` (shapes, grid, device, per-head K) and not due for a refresh."""
        key = key + (self.kmax, tuple(self.head_k))
        cached = self._index_cache
        index = None
        if cached is not None and cached[0] == key and self._index_calls % self.index_refresh != 0:
            index = cached[1]
        else:
            self._index_calls = 0  # a (re-)estimate starts a new cycle
        out, index = core(*args, index=index, return_index=True, **kwargs)
        self._index_cache = (key, index)
        self._index_calls += 1
        return out

    # ---------------------------------------------------------------- side tasks (eager)
    def sampled_rows(self, S: int, device) -> torch.Tensor:
        """The query rows the plan samples (cube-order positions: row_offset, + stride, ...)."""
        stride = self.config.row_sample_stride
        off = self._plan.row_offset % min(stride, S)
        key = (S, off, stride, str(device))
        r = self._rows_cache.get(key)
        if r is None:
            if len(self._rows_cache) > 32:
                self._rows_cache.clear()
            r = torch.arange(off, S, stride, dtype=torch.int32).to(device)
            self._rows_cache[key] = r
        return r

    def _add(self, name: str, value: torch.Tensor) -> None:
        cur = self._sums.get(name)
        self._sums[name] = (value, 1) if cur is None else (cur[0] + value, cur[1] + 1)

    @torch._dynamo.disable
    def run_side_tasks(self, q: torch.Tensor, k: torch.Tensor, grid, scale: Optional[float],
                       rows: Optional[torch.Tensor] = None, weight: float = 1.0) -> None:
        """The plan's predictor training step (loss + backward into the private gradient
        accumulator) and profiling, on detached q, k [B, S, H, D] (the video tokens). Skipped
        while autograd recomputes a checkpointed forward. ``rows``: the sampled query rows,
        positions in the cube order of ``grid`` (the query groups' order; default:
        sampled_rows); ``weight`` scales this call's gradients and statistics (context
        parallelism passes the rank's own rows, weighted by their share, so that the average
        over ranks is the single-process value). Results: take_stats(); input shape: workload."""
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
        ops = need_ops()
        kdt = kernel_dtype(q)
        q, k = q.detach().to(kdt), k.detach().to(kdt)
        B, S, H, D = q.shape
        self._workload = Workload(S, B, q.dtype)
        if rows is None:
            rows = self.sampled_rows(S, q.device)
        # every task samples the same rows of the cube-ordered queries (what the query groups and
        # a context-parallel rank's shard see)
        perm, _ = self._perm(grid, S, q.device)
        k_cube = k  # keys in the queries' cube order: what block lists address
        if perm is not None:
            q = q.index_select(1, perm)
            if any(b > 1 for b in self.head_kv_block) or cfg.kv_block == "auto":
                k_cube = k.index_select(1, perm)
        # identity saved-tensor hooks: the predictor-loss graph must stay invisible to activation
        # checkpointing (whose own hooks would otherwise count these tensors) and to offloading
        with torch.autocast(device_type=q.device.type, enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            if self._plan.train:
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
                self._add("loss", loss.detach().float().mean(0) * weight)
            if self._plan.profile:
                self._profile(q, k, rows, scale, weight, k_cube)

    def _profile(self, q, k, rows, scale, weight: float, k_cube=None) -> None:
        cfg, ops = self.config, need_ops()
        B, S, H, _ = q.shape
        k_cube = k if k_cube is None else k_cube
        with torch.no_grad():
            recall = None
            if cfg.measure_recall and self._plan.density is not None:
                counts = self.kv_counts_for(S).view(1, H).expand(B, H).contiguous()
                kb = self.head_kv_block
                if min(self.head_k) >= S:  # every head's list holds every key: recall 1, no lists
                    prof = ops.profile_attention(q, k, rows, cfg.theta, scale=scale)
                    recall = prof.sparsity * 0 + 1  # NaN where the sparsity is (a non-finite row)
                elif all(b == 1 for b in kb):
                    q_lr, k_lr = self.predictor(q, k)
                    index = ops.topk_estimate(q_lr, k_lr, counts, cfg.group_size, self.kmax)
                    prof = ops.profile_attention(q, k, rows, cfg.theta, index, counts, cfg.group_size, scale)
                    recall = prof.recall
                else:  # block lists: the recall of each granularity in use, per head its own
                    q_lr, k_lr = self.predictor(q, k_cube)
                    recall = None
                    for b in sorted(set(kb)):
                        cb = block_counts(counts, b)
                        index = ops.topk_estimate(q_lr, k_lr, cb, cfg.group_size, block_kmax(self.kmax, b, S),
                                                  kv_block=b)
                        prof = ops.profile_attention(q, k_cube, rows, cfg.theta, index, cb, cfg.group_size,
                                                     scale, kv_block=b)
                        mine = torch.tensor([x == b for x in kb], device=q.device)
                        recall = prof.recall if recall is None else torch.where(mine, prof.recall, recall)
            else:
                prof = ops.profile_attention(q, k, rows, cfg.theta, scale=scale)
        self._add("sparsity", prof.sparsity.float().mean(0) * weight)
        if recall is not None:
            self._add("recall", recall.float().mean(0) * weight)
        if cfg.k_rule == "recall":
            # the curve of the configured granularity (fixed kv_block b: K in keys of b-key blocks)
            b = cfg.kv_block if isinstance(cfg.kv_block, int) else 1
            curve = recall_curve(q, k if b == 1 else k_cube, self.predictor.wq, self.predictor.wk, rows,
                                 cfg.group_size, cfg.k_multiple, scale, max_rows=cfg.recall_rows, kv_block=b)
            cur = self._sums.get("curve")
            if cur is not None and cur[0].shape[-1] != curve.shape[-1]:
                del self._sums["curve"]  # the length changed
                self._sums.pop("bcurve", None)
            self._add("curve", curve.mean(0) * weight)
            if cfg.kv_block == "auto":  # recall versus K of every granularity (row 0: the token curve)
                curves = [curve.mean(0)] + [
                    recall_curve(q, k_cube, self.predictor.wq, self.predictor.wk, rows, cfg.group_size,
                                 cfg.k_multiple, scale, max_rows=cfg.recall_rows, kv_block=b).mean(0)
                    for b in KV_BLOCKS[1:]]
                self._add("bcurve", torch.stack(curves) * weight)

    def sparse_supported(self) -> bool:
        """Whether this block can run the sparse path on its device (dispatcher precondition)."""
        return sparse_supported(self.kv_count.device, self.head_dim, self.config.rank)

    def predictor_parameters(self):
        """The predictor weights (trained by DSVController's own optimizer, never by the model's)."""
        return list(self.predictor.parameters())

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, grid={self.grid}, stage={self.stage}, "
                f"use_sparse={self.use_sparse}, rank={self.config.rank}, group_size={self.config.group_size}"
                + ("" if self.config.kv_block == 1 else f", kv_block={self.config.kv_block}"))


# ------------------------------------------------------------------------------------------------

class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose weight takes the input's dtype in forward: under bf16 autocast q and k
    are bf16 while the weight stays fp32, and ``nn.RMSNorm`` then falls back from the fused kernel
    to its composite form (a handful of element-wise and reduction kernels each way, and a
    warning). Same parameter, same state_dict; the product in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.rms_norm(x, self.normalized_shape, None if w is None else w.to(x.dtype), self.eps)


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
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
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
