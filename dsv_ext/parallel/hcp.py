"""Sparsity-aware head-wise context parallelism (HCP, Ulysses-like with uneven head splits).

Every rank holds a contiguous shard ``[B, S/N, H, D]`` of the sequence for all heads. An uneven
all-to-all gives rank j all S tokens of its heads ``assignment[j]`` (q, k, v and the low-rank
q_lr, k_lr in one collective when they share a dtype), rank j selects critical keys and runs
attention for those heads, and a second all-to-all returns the output to the sequence layout.
Both all-to-alls are autograd Functions whose backward is the reverse all-to-all, so the
backward moves dout one way and dq, dk, dv the other way.

Heads are assigned by longest-processing-time first on the cost ``1 - s_h`` (a head whose
count covers the whole sequence runs dense and costs 1), so the uneven head counts balance the
attention time; see :mod:`dsv_ext.parallel.plan`.
"""

from __future__ import annotations

from typing import Callable, Optional

from .comm import group_size_rank, head_to_seq, seq_to_head
from .local import local_attention
from .plan import lpt_assign
from .validate import kv_block_error, prepare

__all__ = ["hcp_attention", "default_assignment"]


def default_assignment(kv_count_host, num_keys: int, num_ranks: int):
    """LPT on per-head cost = mean over the batch of count / S (1 for dense heads)."""
    H = len(kv_count_host[0])
    costs = [sum(min(row[h], num_keys) for row in kv_count_host) / (len(kv_count_host) * num_keys) for h in range(H)]
    return lpt_assign(costs, num_ranks)


def hcp_attention(q, k, v, q_lr, k_lr, kv_count, group_size: int, *, assignment=None, group=None,
                  scale: Optional[float] = None, validate: bool = True, stats: Optional[dict] = None,
                  kv_block: int = 1, _inner: Optional[Callable] = None, _prepared=None):
    """Head-wise CP attention of this rank's shard. Returns ``[B, S/N, H, D]``.

    q, k, v: ``[B, S/N, H, D]``; q_lr, k_lr: ``[B, S/N, H, r]``; kv_count: int ``[B, H]`` (the same
    on every rank; a head whose count is >= S runs dense); ``assignment``: per rank of ``group``
    the heads it computes (default: LPT on ``kv_count / S``); ``kv_block``: list granularity
    (K stays in keys; lists of ceil(K / kv_block) blocks of consecutive positions of the
    sequence, see dsv_ext.sparse_attention). Differentiable in q, k, v.
    """
    prep = _prepared or prepare("hcp_attention", q, k, v, q_lr, k_lr, kv_count, group_size, group,
                                scale, validate, extra={"assignment": repr(assignment), "kv_block": kv_block},
                                local_error=kv_block_error(kv_block))
    n, me = group_size_rank(group)
    cnt_host = prep.kv_count_host
    S = prep.seqlen  # tokens of the sequence (segment) this group covers
    if assignment is None:
        assignment = default_assignment(cnt_host, S, n)
    assignment = tuple(tuple(int(h) for h in hs) for hs in assignment)
    H = q.shape[2]
    flat = sorted(h for hs in assignment for h in hs)
    if len(assignment) != n or flat != list(range(H)):
        raise ValueError(f"assignment: must give each of the {n} ranks a list of heads covering 0..{H - 1} "
                         f"exactly once, got {assignment}")
    mine = list(assignment[me])
    if q_lr.dtype == q.dtype:
        qh, kh, vh, qlh, klh = seq_to_head([q, k, v, q_lr.detach(), k_lr.detach()], assignment, group)
    else:
        qh, kh, vh = seq_to_head([q, k, v], assignment, group)
        qlh, klh = seq_to_head([q_lr.detach(), k_lr.detach()], assignment, group)
    cnt = kv_count[:, mine].contiguous() if mine else kv_count[:, :0].contiguous()
    cnt_mine = [[row[h] for h in mine] for row in cnt_host]
    if _inner is None:
        oh = local_attention(qh, kh, vh, qlh, klh, cnt, cnt_mine, group_size, scale, kv_block)
    else:
        oh = _inner(qh, kh, vh, qlh, klh, cnt, cnt_mine)
    (out,) = head_to_seq([oh], assignment, group)
    if stats is not None:
        e = q.element_size()
        B, L, _, D = q.shape
        r = q_lr.shape[-1]
        a = len(mine)
        stats["hcp_assignment"] = assignment
        stats["hcp_heads"] = a
        # bytes this rank sends: forward (q,k,v,q_lr,k_lr out; output back), backward (dout; dq,dk,dv)
        fwd = B * L * (H - a) * (3 * D * e + 2 * r * q_lr.element_size()) + B * L * (n - 1) * a * D * e
        bwd = B * L * (H - a) * D * e + B * L * (n - 1) * a * 3 * D * e
        stats["hcp_bytes_sent_fwd"] = stats.get("hcp_bytes_sent_fwd", 0) + fwd
        stats["hcp_bytes_sent_bwd"] = stats.get("hcp_bytes_sent_bwd", 0) + bwd
    return out
