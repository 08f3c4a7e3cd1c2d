"""Context parallelism inside the DSV modules.

:func:`enable` switches every :class:`dsv_ext.SparseAttention` of a model (the cores of
``DSVAttention`` layers and of models made by ``dsv_ext.convert``) to context-parallel
operation over a process group: each rank's forward then receives its contiguous shard
``[B, S/N, H, D]`` of the (already cube-reordered) sequence and returns its output shard.

* Stage 1 and blocks the dispatcher keeps dense: dense head-wise CP (Ulysses: all-to-all to
  head layout, SDPA, all-to-all back).
* Stage 2 sparse blocks: the block's per-head K (from the profiled sparsity, global S = N x the
  shard length) and its low-rank predictors on the shard, then the plan solver's choice of HCP /
  SCP / hybrid (:class:`Planner`, re-planned when the profile moves) through
  :func:`dsv_ext.parallel.cp_attention`. The block's list granularity (``head_kv_block``) is
  kept when it is the same for every head (the shards are cube-ordered already, so blocks are
  consecutive positions); a block whose heads were given different granularities
  (DSVConfig.kv_block "auto") runs token lists with each head's K under CP.
* Predictor training and profiling steps (armed by DSVController): the keys are all-gathered
  (detached, only on those steps) and each rank trains / profiles on its own sampled query rows
  against all keys; DSVController averages the gradients and statistics over its process group
  (default: the world), which gives the single-process result when the CP ranks are in it.

Every rank of the group must run the same blocks in the same order (as any CP scheme); the
controller's decisions are already made collectively.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from ..functional.attention import autocast_inputs, kernel_dtype
from ..modules.attention import SparseAttention
from .comm import group_size_rank
from .hcp import hcp_attention
from .hybrid import hybrid_attention
from .plan import CostModel, Planner
from .scp import _all_gather_seq, _budget_error

__all__ = ["enable", "disable", "cp_forward", "CPSettings", "gather_sequence"]


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        n, p = group_size_rank(group)
        ctx.p, ctx.L = p, x.shape[1]
        if n == 1:
            return x.clone()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        return g[:, ctx.p * ctx.L:(ctx.p + 1) * ctx.L].contiguous(), None


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[B, S/N, ...]`` shards -> ``[B, S, ...]`` on every rank, differentiable. The backward
    returns this rank's slice of the incoming gradient without reducing it, which is exact when
    every rank computes the same function of the gathered tensor (the same loss on the same
    batch, as context-parallel training does); the replicated parameters' gradients are then
    partial per rank and must be summed over the group (``all_reduce``)."""
    return _GatherSeq.apply(x, group)


@dataclass
class CPSettings:
    """The context-parallel runner :func:`enable` registers on each SparseAttention (one object
    shared by the model's blocks; ``SparseAttention.set_context_parallel``): the module's
    forward calls ``runner(attn, q, k, v, scale)`` (:func:`cp_forward`) on this rank's shard."""

    group: object = None
    cost: Optional[CostModel] = None
    memory_limit: Optional[float] = None
    modes: Sequence[str] = ("hcp", "scp", "hybrid")
    remote_budget: Optional[float] = None
    validate: bool = True
    planner: Optional[Planner] = None
    planners: Dict[tuple, Planner] = field(default_factory=dict)

    def plan_for(self, attn, sparsity, seqlen: int, n: int):
        if self.planner is not None:
            return self.planner.plan(_block_key(attn), sparsity, seqlen)
        cfg = attn.config
        key = (n, attn.head_dim, cfg.group_size, cfg.rank)
        pl = self.planners.get(key)
        if pl is None:
            pl = Planner(world_size=n, seqlen=seqlen, head_dim=attn.head_dim, cost=self.cost,
                         memory_limit=self.memory_limit, group_size=cfg.group_size, rank=cfg.rank,
                         modes=self.modes)
            self.planners[key] = pl
        return pl.plan(_block_key(attn), sparsity, seqlen)

    def __call__(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: Optional[float]) -> torch.Tensor:
        return cp_forward(attn, q, k, v, scale, self)


def _block_key(attn):
    return attn.name if attn.name is not None else id(attn)


def _cores(model):
    if isinstance(model, SparseAttention):
        return [model]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if isinstance(m, SparseAttention)]


def enable(model, group=None, *, cost: Optional[CostModel] = None, memory_limit: Optional[float] = None,
           modes: Sequence[str] = ("hcp", "scp", "hybrid"), remote_budget: Optional[float] = None,
           planner: Optional[Planner] = None, validate: bool = True) -> int:
    """Run every SparseAttention of ``model`` context-parallel over ``group`` (default: the
    world). Returns how many modules were switched.

    After this, each rank passes its shard ``[B, S/N, H, D]`` of the cube-reordered sequence (rank r
    holds tokens ``[r S/N, (r+1) S/N)``; ``S/N`` a multiple of the group size) and gets its output
    shard; the module's ``grid`` is not used (reorder before sharding, ``dsv_ext.grouping``).
    ``cost``, ``memory_limit``, ``modes``: for the plan solver (one :class:`Planner` per head
    shape, or pass your own ``planner``); ``remote_budget``: see :func:`scp_attention`;
    ``validate``: the collective argument check of every call (one tiny all_gather; turn it off
    in a tuned loop). ``torch.distributed`` must be initialised.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dsv_ext.parallel.enable: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    err = _budget_error(remote_budget)
    if err:
        raise ValueError(err)
    bad = [m for m in modes if m not in ("hcp", "scp", "hybrid")]
    if bad or not modes:
        raise ValueError(f"modes: expected a non-empty subset of ('hcp', 'scp', 'hybrid'), got {tuple(modes)!r}")
    cores = _cores(model)
    if not cores:
        raise ValueError("model: has no dsv_ext.SparseAttention modules (build it with DSVAttention or "
                         "dsv_ext.convert first)")
    st = CPSettings(group=group, cost=cost, memory_limit=memory_limit, modes=tuple(modes),
                    remote_budget=remote_budget, validate=validate, planner=planner)
    for m in cores:
        m.set_context_parallel(st)
    return len(cores)


def disable(model) -> int:
    """Back to whole sequences per rank; returns how many modules were switched."""
    cores = _cores(model)
    for m in cores:
        m.set_context_parallel(None)
    return len(cores)


@torch._dynamo.disable
def cp_forward(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
               settings: Optional[CPSettings] = None) -> torch.Tensor:
    """SparseAttention.forward on this rank's shard (see the module docstring); ``settings``:
    the runner's (default: the one registered on ``attn``)."""
    st = settings if settings is not None else attn.context_parallel
    n, p = group_size_rank(st.group)
    B, L, H, D = q.shape
    S = n * L
    cfg = attn.config
    if attn.side_tasks_due and torch._C._current_graph_task_id() == -1:
        # side tasks on this rank's sampled rows against all keys (q padded to the full length:
        # only the rows are read). The rows are the cube-order positions the single-process
        # module samples; each rank's share is weighted so that the controller's average over
        # the ranks is the single-process value.
        k_full = _all_gather_seq(k.detach(), st.group)
        q_pad = q.detach().new_zeros((B, S, H, D))
        q_pad[:, p * L:(p + 1) * L] = q.detach()
        rows = attn.sampled_rows(S, q.device)
        n_all = rows.numel()
        rows = rows[(rows >= p * L) & (rows < (p + 1) * L)]
        weight = rows.numel() * n / n_all
        if rows.numel() == 0:  # no sampled row here: contribute zeros (every rank must report)
            rows, weight = torch.full((1,), p * L, dtype=torch.int32, device=q.device), 0.0
        attn.run_side_tasks(q_pad, k_full, None, scale, rows=rows, weight=weight)
        del k_full, q_pad
    q, k, v = autocast_inputs(q, k, v)
    out_dtype = q.dtype
    kdt = kernel_dtype(q)
    q, k, v = q.to(kdt), k.to(kdt), v.to(kdt)
    if attn.stage == 2 and attn.use_sparse and attn.density is not None:
        counts = attn.kv_counts_for(S).view(1, H).expand(B, H).contiguous()
        with torch.no_grad():
            q_lr = torch.einsum("bshd,hdr->bshr", q.detach(), attn.predictor.wq.detach().to(kdt)).contiguous()
            k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), attn.predictor.wk.detach().to(kdt)).contiguous()
        sparsity = [1.0 - kk / S for kk in attn.head_k]
        plan = st.plan_for(attn, sparsity, S, n)
        if plan.world_size != n:
            raise ValueError(f"plan: made for {plan.world_size} ranks, the group has {n}")
        kb = attn.head_kv_block
        out = hybrid_attention(q, k, v, q_lr, k_lr, counts, cfg.group_size, g_h=plan.g_h,
                               assignment=plan.assignment, group=st.group, scale=scale, validate=st.validate,
                               remote_budget=st.remote_budget,
                               kv_block=kb[0] if all(b == kb[0] for b in kb) else 1)
    else:
        # dense (stage 1, or a block the dispatcher keeps dense): Ulysses through HCP with every
        # head's count >= S (the low-rank inputs travel along; r / D of q's bytes)
        counts = torch.full((B, H), S, dtype=torch.int32, device=q.device)
        z = q.new_zeros((B, L, H, cfg.rank))
        out = hcp_attention(q, k, v, z, z, counts, cfg.group_size, group=st.group, scale=scale,
                            validate=st.validate)
    return out.to(out_dtype)
