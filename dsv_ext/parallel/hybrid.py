"""Hybrid context parallelism: N = g_h x g_s ranks, HCP inside head groups, SCP across them.

Rank r of the CP group is head-group rank ``j = r % g_h`` of segment ``i = r // g_h``: the g_h
ranks of a segment hold its g_h consecutive shards (the sequence stays contiguous), swap heads
for tokens with an uneven all-to-all (HCP), so that rank j holds the whole segment for the heads
``assignment[j]``; the g_s ranks with the same j (same heads) then run SCP across segments.
"""

from __future__ import annotations

from typing import Optional

from .comm import group_size_rank, hybrid_groups
from .hcp import hcp_attention
from .local import local_attention
from .scp import _budget_error, scp_attention
from .validate import kv_block_error, prepare

__all__ = ["hybrid_attention"]


def hybrid_attention(q, k, v, q_lr, k_lr, kv_count, group_size: int, *, g_h: int, assignment=None, group=None,
                     scale: Optional[float] = None, validate: bool = True, stats: Optional[dict] = None,
                     estimate: str = "auto", remote_budget: Optional[float] = None, kv_block: int = 1):
    """Hybrid CP attention of this rank's shard ``[B, S/N, H, D]`` -> ``[B, S/N, H, D]``.

    ``g_h`` must divide the group size and be at most H; ``assignment`` (per head-group rank,
    default LPT on ``kv_count / S``) is the same in every head group. ``remote_budget``: see
    :func:`scp_attention` (used when g_h < N); ``kv_block``: list granularity (see
    :func:`hcp_attention` and :func:`scp_attention`). Differentiable in q, k, v.
    """
    n, me = group_size_rank(group)
    prep = prepare("hybrid_attention", q, k, v, q_lr, k_lr, kv_count, group_size, group, scale, validate,
                   extra={"g_h": g_h, "assignment": repr(assignment), "estimate": estimate,
                          "remote_budget": remote_budget, "kv_block": kv_block},
                   local_error=_budget_error(remote_budget) or kv_block_error(kv_block))
    H = q.shape[2]
    if not isinstance(g_h, int) or g_h < 1 or n % g_h or g_h > H:
        raise ValueError(f"g_h: must divide the group size {n} and be in [1, H={H}], got {g_h!r}")
    if g_h == n:
        hg, sg = group, None  # pure HCP: no sequence exchange
    elif g_h == 1:
        hg, sg = None, group  # pure SCP
    else:
        hg, sg = hybrid_groups(group, g_h)
    S = n * q.shape[1]
    if assignment is None:
        from .hcp import default_assignment
        assignment = default_assignment(prep.kv_count_host, S, g_h)

    def inner(qh, kh, vh, qlh, klh, cnt, cnt_host):
        if g_h == n:  # g_s == 1: the head group holds the whole sequence
            return local_attention(qh, kh, vh, qlh, klh, cnt, cnt_host, group_size, scale, kv_block)
        return scp_attention(qh, kh, vh, qlh, klh, cnt, group_size, group=sg, scale=scale, validate=False,
                             stats=stats, estimate=estimate, remote_budget=remote_budget, kv_block=kv_block,
                             _prepared=prep, _kv_count_host=cnt_host)

    if g_h == 1:
        return inner(q, k, v, q_lr, k_lr, kv_count, prep.kv_count_host)
    return hcp_attention(q, k, v, q_lr, k_lr, kv_count, group_size, assignment=assignment, group=hg, scale=scale,
                         validate=False, stats=stats, _inner=inner,
                         _prepared=_sub(prep, g_h))


def _sub(prep, g_h):
    from .validate import Prepared
    return Prepared(g_h, -1, prep.shard, prep.shard * g_h, prep.kv_count_host)
