"""dsv_ext.parallel: sparsity-aware context parallelism for DSV attention.

Each rank of a process group holds a contiguous shard ``[B, S/N, H, D]`` of the (cube-reordered)
sequence. Entry points (all differentiable in q, k, v; see docs/PARALLEL.md):

* :func:`cp_attention` -- runs a :class:`Plan` (HCP, SCP or hybrid) from :func:`solve_plan`;
* :func:`hcp_attention` -- head-wise CP, LPT head assignment, uneven all-to-all;
* :func:`scp_attention` -- sequence-wise CP, sparse all-to-all of critical K/V rows;
* :func:`hybrid_attention` -- ``N = g_h x g_s``, HCP inside head groups, SCP across;
* :func:`enable` -- run a model's DSV attention modules context-parallel (training with
  DSVController included): each rank's forward takes its sequence shard.

Inputs are validated collectively (one small all_gather): a rank with a non-matching shard or
configuration makes every rank raise :class:`CPConfigError` instead of hanging.
"""

from __future__ import annotations

from typing import Optional

import torch._dynamo  # noqa: F401  (see below)

# torch._dynamo is imported above so that it comes before the user's init_process_group
# (docs/PARALLEL.md, "Troubleshooting"): importing it after (dsv_ext.modules.attention does, through
# @torch._dynamo.disable) keeps the default gloo group alive past destroy_process_group and can
# abort the process at exit.

from .comm import CPConfigError, all_to_all_rows, clear_group_cache, head_to_seq, hybrid_groups, seq_to_head
from .hcp import hcp_attention
from .hybrid import hybrid_attention
from .plan import (CostModel, Plan, Planner, assignment_loads, head_costs, lpt_assign, naive_assign,
                   solve_plan)
from .scp import scp_attention
from .module import CPSettings, disable, enable

__all__ = [
    "cp_attention", "hcp_attention", "scp_attention", "hybrid_attention", "enable", "disable", "CPSettings",
    "CostModel", "Plan", "Planner", "solve_plan", "lpt_assign", "naive_assign", "head_costs",
    "assignment_loads", "CPConfigError", "all_to_all_rows", "seq_to_head", "head_to_seq",
    "hybrid_groups", "clear_group_cache",
]


def cp_attention(q, k, v, q_lr, k_lr, kv_count, group_size: int, plan: Plan, *, group=None,
                 scale: Optional[float] = None, validate: bool = True, stats: Optional[dict] = None,
                 estimate: str = "auto", remote_budget: Optional[float] = None, kv_block: int = 1):
    """Run ``plan`` (from :func:`solve_plan` / :class:`Planner`) on this rank's shard.
    ``remote_budget``: see :func:`scp_attention` (SCP and hybrid plans); ``kv_block``: list
    granularity (K in keys; see :func:`hybrid_attention`)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if plan.world_size != n:
        raise ValueError(f"plan: made for {plan.world_size} ranks, the group has {n}")
    return hybrid_attention(q, k, v, q_lr, k_lr, kv_count, group_size, g_h=plan.g_h,
                            assignment=plan.assignment, group=group, scale=scale, validate=validate,
                            stats=stats, estimate=estimate, remote_budget=remote_budget, kv_block=kv_block)
