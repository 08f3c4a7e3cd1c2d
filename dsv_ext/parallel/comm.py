"""Collective building blocks of dsv_ext.parallel: validation, differentiable all-to-alls, groups."""

from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["CPConfigError", "check_collective", "all_to_all_rows", "seq_to_head", "head_to_seq",
           "hybrid_groups", "group_size_rank"]

_MSG_BYTES = 240


class CPConfigError(ValueError):
    """Inputs or configuration differ across the ranks of a context-parallel group (raised on
    every rank, with the same message)."""


def group_size_rank(group) -> Tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _meta_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tensor_checksum(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return -1
    a = t.detach().to("cpu", torch.int64).contiguous()
    return zlib.crc32(repr((tuple(a.shape), a.flatten().tolist())).encode())


def check_collective(group, what: str, fields: Dict[str, int], local_error: Optional[str]) -> None:
    """All-gather ``fields`` (ints) plus this rank's local error message; raise
    :class:`CPConfigError` on every rank when any rank reported an error or any field differs.

    One small all_gather: a rank with a bad shard fails together with the others instead of
    leaving them waiting in the next collective."""
    n, me = group_size_rank(group)
    names = list(fields)
    msg = (local_error or "").encode()[:_MSG_BYTES]
    vals = [int(fields[k]) for k in names] + [1 if local_error else 0, len(msg)]
    vals += list(msg) + [0] * (_MSG_BYTES - len(msg))
    dev = _meta_device(group)
    t = torch.tensor(vals, dtype=torch.int64, device=dev)
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    rows = [o.cpu().tolist() for o in out]
    nf = len(names)
    errs = []
    for r, row in enumerate(rows):
        if row[nf]:
            text = bytes(row[nf + 2: nf + 2 + row[nf + 1]]).decode(errors="replace")
            errs.append(f"rank {r}: {text}")
    if errs:
        raise CPConfigError(f"{what}: " + "; ".join(errs))
    diffs = []
    for i, name in enumerate(names):
        col = [row[i] for row in rows]
        if any(c != col[0] for c in col):
            diffs.append(f"{name} differs across ranks (" + ", ".join(f"rank {r}: {c}" for r, c in enumerate(col)) + ")")
    if diffs:
        raise CPConfigError(f"{what}: inconsistent inputs across ranks: " + "; ".join(diffs))


# ----------------------------------------------------------------------------------------------
# Sparse row exchange (uneven all_to_all_single on dim 0)
# ----------------------------------------------------------------------------------------------
def _a2a(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    if dist.get_world_size(group) == 1:
        out.copy_(x)
        return out
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _a2a(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: ``x[sum(send[:j]):sum(send[:j+1])]`` goes to
    rank j; the result stacks what each rank sent here in rank order. Backward: the reverse."""
    return _AllToAllRows.apply(x, list(map(int, send_splits)), list(map(int, recv_splits)), group)


# ----------------------------------------------------------------------------------------------
# Head-wise all-to-all (Ulysses with uneven head splits)
# ----------------------------------------------------------------------------------------------
def _seq_to_head_raw(x: torch.Tensor, assignment, group) -> torch.Tensor:
    """[B, L, H, d] (this rank's shard, all heads) -> [B, n L, a, d] (all shards, my heads)."""
    n, me = group_size_rank(group)
    B, L, H, d = x.shape
    perm = [h for hs in assignment for h in hs]
    xs = x.permute(2, 0, 1, 3)  # [H, B, L, d]
    if perm != list(range(H)):
        xs = xs[torch.tensor(perm, device=x.device)]
    a = len(assignment[me])
    y = _a2a(xs, [len(hs) for hs in assignment], [a] * n, group)  # [n a, B, L, d]
    return y.view(n, a, B, L, d).permute(2, 0, 3, 1, 4).reshape(B, n * L, a, d)


def _head_to_seq_raw(y: torch.Tensor, assignment, group) -> torch.Tensor:
    """[B, n L, a, d] (all shards, my heads) -> [B, L, H, d] (my shard, all heads)."""
    n, me = group_size_rank(group)
    B, nL, a, d = y.shape
    L = nL // n
    H = sum(len(hs) for hs in assignment)
    ys = y.view(B, n, L, a, d).permute(1, 3, 0, 2, 4).reshape(n * a, B, L, d)  # [n a, B, L, d]
    x = _a2a(ys, [a] * n, [len(hs) for hs in assignment], group)  # [H (perm order), B, L, d]
    perm = [h for hs in assignment for h in hs]
    if perm != list(range(H)):
        inv = [0] * H
        for i, h in enumerate(perm):
            inv[h] = i
        x = x[torch.tensor(inv, device=y.device)]
    return x.permute(1, 2, 0, 3)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, assignment, group, *xs):
        ctx.assignment, ctx.group = assignment, group
        ctx.dims = [x.shape[-1] for x in xs]
        y = _seq_to_head_raw(torch.cat(xs, -1) if len(xs) > 1 else xs[0], assignment, group)
        return tuple(t.contiguous() for t in y.split(ctx.dims, -1))

    @staticmethod
    def backward(ctx, *gs):
        g = torch.cat(gs, -1) if len(gs) > 1 else gs[0]
        gx = _head_to_seq_raw(g.contiguous(), ctx.assignment, ctx.group)
        return (None, None) + tuple(gx.split(ctx.dims, -1))


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, assignment, group, *ys):
        ctx.assignment, ctx.group = assignment, group
        ctx.dims = [y.shape[-1] for y in ys]
        x = _head_to_seq_raw(torch.cat(ys, -1) if len(ys) > 1 else ys[0].contiguous(), assignment, group)
        return tuple(t.contiguous() for t in x.split(ctx.dims, -1))

    @staticmethod
    def backward(ctx, *gs):
        g = torch.cat(gs, -1) if len(gs) > 1 else gs[0]
        gy = _seq_to_head_raw(g.contiguous(), ctx.assignment, ctx.group)
        return (None, None) + tuple(gy.split(ctx.dims, -1))


def seq_to_head(tensors: Sequence[torch.Tensor], assignment, group) -> Tuple[torch.Tensor, ...]:
    """Differentiable: each [B, L, H, d_i] -> [B, n L, a_me, d_i], packed into one all-to-all
    (tensors of one dtype share a collective)."""
    assignment = tuple(tuple(int(h) for h in hs) for hs in assignment)
    out: List[Optional[torch.Tensor]] = [None] * len(tensors)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for _, idxs in by_dtype.items():
        res = _SeqToHead.apply(assignment, group, *[tensors[i] for i in idxs])
        for i, r in zip(idxs, res):
            out[i] = r
    return tuple(out)


def head_to_seq(tensors: Sequence[torch.Tensor], assignment, group) -> Tuple[torch.Tensor, ...]:
    assignment = tuple(tuple(int(h) for h in hs) for hs in assignment)
    return _HeadToSeq.apply(assignment, group, *tensors)


# ----------------------------------------------------------------------------------------------
# Hybrid process groups
# ----------------------------------------------------------------------------------------------
_GROUP_CACHE: Dict[Tuple[Tuple[int, ...], int], Tuple[object, object]] = {}


def hybrid_groups(group, g_h: int):
    """(head group, sequence group) of this rank for ``N = g_h x g_s`` over ``group``.

    Head group: the g_h consecutive ranks of this rank's segment; sequence group: the g_s ranks
    with the same position in their head groups. When ``group`` is the default group every
    rank creates every subgroup (call this on all ranks in the same order, as cp_attention
    does); for another group only the member ranks call it (local synchronisation)."""
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    key = (ranks, g_h)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key]
    n = len(ranks)
    if g_h < 1 or n % g_h:
        raise ValueError(f"g_h: {g_h} does not divide the group size {n}")
    g_s = n // g_h
    me = ranks.index(dist.get_rank())
    world = group is None or group is dist.group.WORLD or ranks == tuple(range(dist.get_world_size()))
    head_lists = [tuple(ranks[i * g_h + j] for j in range(g_h)) for i in range(g_s)]
    seq_lists = [tuple(ranks[i * g_h + j] for i in range(g_s)) for j in range(g_h)]
    mine_h = head_lists[me // g_h]
    mine_s = seq_lists[me % g_h]
    if world:
        hg = sg = None
        for lst in head_lists:
            g = dist.new_group(list(lst))
            if lst == mine_h:
                hg = g
        for lst in seq_lists:
            g = dist.new_group(list(lst))
            if lst == mine_s:
                sg = g
    else:
        hg = dist.new_group(list(mine_h), use_local_synchronization=True)
        sg = dist.new_group(list(mine_s), use_local_synchronization=True)
    _GROUP_CACHE[key] = (hg, sg)
    return hg, sg


def clear_group_cache() -> None:
    """Forget cached subgroups (call before destroy_process_group in tests)."""
    _GROUP_CACHE.clear()
