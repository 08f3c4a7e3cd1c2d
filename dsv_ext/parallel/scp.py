"""Sequence-wise context parallelism (SCP) with a sparse all-to-all of critical K/V rows.

Rank p holds the queries and keys of its contiguous shard ``[p L, (p+1) L)`` for all heads.

1. The low-rank keys are all-gathered (``r / D`` of the key bytes) and each rank selects, for
   its own query groups, the top-K keys against *all* S keys (dsv_ext.topk_estimate).
2. Per owner rank and head the union of the selected remote keys is requested: a request-count
   all-to-all, then an all-to-all of row ids.
3. Owners gather the requested K|V rows (dsv_ext.gather_rows) and send them in one uneven
   all_to_all_single; received rows and the local keys are placed (dsv_ext.scatter_add_rows)
   into a key table ``[B, S_tab, H, D]`` holding, per head, only the needed keys in global
   order (so the remapped index stays sorted and the kernel sums in the single-process order).
   Block lists (kv_block > 1): the estimation selects blocks of the full sequence; they are
   expanded to their keys (dsv_ext.expand_block_lists) and everything from step 2 on works on
   those token lists (exact: the same keys; the table holds keys, not blocks).
4. dsv_ext.sparse_attention runs the local queries against the table. The kernel takes one
   length for queries and keys: when a head needs more than L keys, the queries are padded
   to the table length with empty (all -1) lists, which the kernel still iterates over (a
   kernel taking separate query and key lengths would remove that cost).

Backward is autograd through the same ops: dK/dV rows of remote keys go back through the
reverse all-to-all and are scatter-added into the owner's dK/dV (the backward of gather_rows).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

import dsv_ext

from ..functional.attention import block_counts, block_kmax
from .comm import all_to_all_rows, group_size_rank, _a2a
from .local import local_attention
from .validate import kv_block_error, prepare

__all__ = ["scp_attention", "estimate_local"]


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, L, H, r] -> [B, n L, H, r] (not differentiable)."""
    n, _ = group_size_rank(group)
    if n == 1:
        return x
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, 1)


def estimate_local(q_lr_local, k_lr_full, kv_count, group_size: int, rank: int, kmax: int, mode: str = "auto",
                   kv_block: int = 1):
    """Top-K keys (positions in the full sequence) for the query groups of this rank's shard.

    topk_estimate takes queries and keys of one length. ``mode="repeat"`` builds a length-S
    query tensor in which each local group's members are repeated n times, with group size
    n G: the representative (mean) is the local group's and the work is the local groups'
    only. ``mode="pad"`` places the local queries at their global positions (zeros
    elsewhere) and keeps the local groups' lists: bit-identical to the single-process index
    but n times the estimation work. ``"auto"``: repeat, falling back to pad if the kernel
    rejects the larger group size. ``kv_block > 1``: block lists (ids of blocks of the full
    sequence; kv_count and kmax in blocks)."""
    B, L, H, r = q_lr_local.shape
    S = k_lr_full.shape[1]
    n = S // L
    G = group_size
    kb = {} if kv_block == 1 else {"kv_block": kv_block}
    if n == 1:
        return dsv_ext.topk_estimate(q_lr_local, k_lr_full, kv_count, G, kmax=kmax, **kb)
    if mode in ("auto", "repeat"):
        ng = L // G
        rep = q_lr_local.reshape(B, ng, 1, G, H, r).expand(B, ng, n, G, H, r).reshape(B, S, H, r)
        try:
            return dsv_ext.topk_estimate(rep, k_lr_full, kv_count, n * G, kmax=kmax, **kb)
        except (ValueError, RuntimeError):
            if mode == "repeat":
                raise
    pad = q_lr_local.new_zeros((B, S, H, r))
    pad[:, rank * L:(rank + 1) * L] = q_lr_local
    idx = dsv_ext.topk_estimate(pad, k_lr_full, kv_count, G, kmax=kmax, **kb)
    return idx[:, :, rank * L // G:(rank + 1) * L // G].contiguous()


def _budget_error(remote_budget) -> Optional[str]:
    if remote_budget is None:
        return None
    try:
        b = float(remote_budget)
    except (TypeError, ValueError):
        return f"remote_budget: expected None or a number in (0, 1], got {remote_budget!r}"
    if not (0.0 < b <= 1.0):
        return f"remote_budget: expected None or a number in (0, 1], got {remote_budget!r}"
    return None


def _apply_budget(idx64, valid, p: int, n: int, L: int, S: int, budget: float):
    """Per (batch, head, owner rank) keep only the ceil(budget L) remote keys that most of this
    rank's groups selected (ties: lower position first); drop the other remote entries from the
    lists. Returns the new ``valid`` mask."""
    B, H = idx64.shape[:2]
    # votes per key: a bincount of the valid entries only (a scatter-add would pile the padding
    # entries' atomics onto one address)
    bh = torch.arange(B * H, device=idx64.device).view(B, H, 1, 1)
    votes = torch.bincount((bh * S + idx64)[valid], minlength=B * H * S).view(B, H, n, L)
    votes[:, :, p] = 0  # local keys are free
    cap = max(1, min(L, int(math.ceil(budget * L))))
    # rank the keys of each owner by votes (stable: ties keep the lower position)
    order = torch.argsort(votes, dim=3, descending=True, stable=True)[..., :cap]
    keep = torch.zeros(B, H, n, L, dtype=torch.bool, device=idx64.device)
    keep.scatter_(3, order, votes.gather(3, order) > 0)
    keep[:, :, p] = True
    keep = torch.cat([keep.view(B, H, S), keep.new_zeros(B, H, 1)], 2)
    return valid & keep.gather(2, idx64.view(B, H, -1)).view_as(valid)


def _positions(idx, S: int) -> torch.Tensor:
    """int64 copy of the lists with the padding (negative entries) at position S."""
    idx64 = idx.long()
    return idx64.masked_fill_(idx64 < 0, S)


def _compact(idx, valid):
    """Lists with the invalid entries removed, order kept, -1 padded at the end (the kernels trim
    trailing padding)."""
    km = idx.shape[-1]
    n_valid = valid.sum(-1, keepdim=True)
    out = torch.full_like(idx, -1)
    out[torch.arange(km, device=idx.device) < n_valid] = idx[valid]  # both in row-major order
    return out


def scp_attention(q, k, v, q_lr, k_lr, kv_count, group_size: int, *, group=None, scale: Optional[float] = None,
                  validate: bool = True, stats: Optional[dict] = None, estimate: str = "auto",
                  remote_budget: Optional[float] = None, kv_block: int = 1, _prepared=None, _kv_count_host=None):
    """Sequence-wise CP attention of this rank's shard. Returns ``[B, S/N, H, D]``.

    Arguments as :func:`dsv_ext.parallel.hcp_attention` (kv_count the same on every rank).
    Heads whose count is >= S run through the same path with all keys (correct but it moves
    the whole K/V: prefer HCP for dense heads). Differentiable in q, k, v.

    ``remote_budget`` (None: exact): at most this fraction of each other rank's keys is fetched
    per head, those that most of this rank's query groups selected; the groups' other remote
    keys are dropped from their lists (an approximation: each group attends to fewer keys, see
    ``stats["scp_kept_fraction"]``). With ``remote_budget = 1 - sparsity`` SCP sends at most
    that fraction of the K/V bytes of dense sequence parallelism. The same on every rank.
    ``stats`` receives bytes, the union fraction, the kept fraction and, when it holds
    ``"scp_keep_index": True``, the lists used (``"scp_kv_index"``, global key positions).
    ``kv_block`` (K still in keys): the groups select ceil(K / kv_block) blocks of kv_block
    consecutive global positions, run as the token lists of their keys (the same result as block
    lists; the budget then counts keys).
    """
    if _prepared is None:
        prep = prepare("scp_attention", q, k, v, q_lr, k_lr, kv_count, group_size, group, scale, validate,
                       extra={"estimate": estimate, "remote_budget": remote_budget, "kv_block": kv_block},
                       local_error=_budget_error(remote_budget) or kv_block_error(kv_block))
        cnt_host = prep.kv_count_host
    else:
        prep = _prepared
        cnt_host = _kv_count_host if _kv_count_host is not None else prep.kv_count_host
    n, p = group_size_rank(group)
    B, L, H, D = q.shape
    S = n * L
    G = group_size
    if n == 1:
        return local_attention(q, k, v, q_lr, k_lr, kv_count, cnt_host, G, scale, kv_block)
    if H == 0:
        # no heads here: nothing to exchange, but keep the graph connected
        _all_gather_seq(k_lr, group)
        return q * 0.0
    dev = q.device
    cnt = kv_count.to(torch.int32).contiguous()
    kmax = max(1, min(S, max(c for row in cnt_host for c in row)))
    cnt = cnt.clamp(max=S)

    # 1. low-rank keys of every rank, then this rank's groups against all keys
    k_lr_full = _all_gather_seq(k_lr, group)
    with torch.no_grad():
        if kv_block == 1:
            idx = estimate_local(q_lr.detach(), k_lr_full, cnt, G, p, kmax, estimate)  # [B, H, L/G, kmax], -1 padded
        else:  # blocks of the full sequence, then the token lists of their keys
            cnt_b, kmax_b = block_counts(cnt, kv_block), block_kmax(kmax, kv_block, S)
            idx = estimate_local(q_lr.detach(), k_lr_full, cnt_b, G, p, kmax_b, estimate, kv_block)
            idx, cnt = dsv_ext.expand_block_lists(idx, cnt_b, kv_block, S)
            idx = _compact(idx, idx >= 0)  # the partial last block's -1 entries to the end
    valid = idx >= 0
    idx64 = _positions(idx, S)
    n_entries = int(valid.sum()) if stats is not None else 0
    if remote_budget is not None and float(remote_budget) < 1.0:
        valid = _apply_budget(idx64, valid, p, n, L, S, float(remote_budget))
        idx = _compact(idx, valid)
        valid = idx >= 0
        idx64 = _positions(idx, S)

    # 2. which keys are needed; extended-table position of every global key (per b, h)
    needed = torch.zeros(B, H, S + 1, dtype=torch.bool, device=dev)
    needed.scatter_(2, idx64.view(B, H, -1), True)
    needed = needed[:, :, :S]
    local = torch.zeros(S, dtype=torch.bool, device=dev)
    local[p * L:(p + 1) * L] = True
    remote = needed & ~local
    # the table holds only the needed keys (local and remote), in global order, so the remapped
    # lists stay sorted and the summation order equals the single-process kernel's; ext_pad: the
    # table position of every global key, and -1 in an extra column for the padding (position S)
    ext_pad = torch.cat([needed.to(torch.int64).cumsum(2) - 1, needed.new_full((B, H, 1), -1, dtype=torch.int64)], 2)
    ext = ext_pad[:, :, :S]  # [B, H, S]
    S_need = int(needed.sum(2).max())
    S_pad = -(-max(S_need, L) // G) * G  # the kernel takes one length for queries and keys

    # requests, grouped by owner: (o, b, h, s) with s local to the owner
    nz = remote.view(B, H, n, L).permute(2, 0, 1, 3).nonzero()
    o, bb, hh, ss = nz.unbind(1)
    req_ids = (bb * L + ss) * H + hh  # row in the owner's [B*L*H, 2D] table
    dest_remote = (bb * S_pad + ext[bb, hh, o * L + ss]) * H + hh
    want = torch.bincount(o, minlength=n)  # rows I receive from each owner
    want_host = want.tolist()
    give = _a2a(want, [1] * n, [1] * n, group)  # rows each rank asks of me
    give_host = give.tolist()
    req_in = _a2a(req_ids, want_host, give_host, group)  # row ids others want from me

    # 3. gather, exchange, place into the extended table
    kv_loc = torch.cat([k, v], -1).reshape(B * L * H, 2 * D)
    rows = dsv_ext.gather_rows(kv_loc, req_in, check_index=False)
    recv = all_to_all_rows(rows, give_host, want_host, group)
    bl = torch.arange(B, device=dev).view(B, 1, 1)
    hl = torch.arange(H, device=dev).view(1, 1, H)
    ext_local = ext[:, :, p * L:(p + 1) * L].permute(0, 2, 1)  # [B, L, H]
    need_local = needed[:, :, p * L:(p + 1) * L].permute(0, 2, 1)
    dest_local = torch.where(need_local, (bl * S_pad + ext_local) * H + hl, -1).reshape(-1)  # -1: dropped
    kv_ext = dsv_ext.scatter_add_rows(torch.cat([kv_loc, recv], 0), torch.cat([dest_local, dest_remote]),
                                      B * S_pad * H, check_index=False).view(B, S_pad, H, 2 * D)
    k_ext, v_ext = kv_ext[..., :D], kv_ext[..., D:]

    # 4. remapped index; queries padded to the table length (the kernel takes one length)
    idx_ext = ext_pad.gather(2, idx64.view(B, H, -1)).view_as(idx).to(torch.int32)
    ng = L // G
    if S_pad > L:
        idx_ext = torch.cat([idx_ext, idx_ext.new_full((B, H, S_pad // G - ng, idx.shape[-1]), -1)], 2)
        q_in = torch.cat([q, q.new_zeros((B, S_pad - L, H, D))], 1)
    else:
        q_in = q
    out = dsv_ext.sparse_attention(q_in, k_ext, v_ext, idx_ext, cnt, G, scale=scale, check_index=False)
    out = out[:, :L]
    if stats is not None:
        e = q.element_size()
        nrows = sum(want_host)
        stats["scp_rows_recv"] = stats.get("scp_rows_recv", 0) + nrows
        stats["scp_rows_sent"] = stats.get("scp_rows_sent", 0) + sum(give_host)
        stats["scp_kv_bytes_sent_fwd"] = stats.get("scp_kv_bytes_sent_fwd", 0) + sum(give_host) * 2 * D * e
        stats["scp_kv_bytes_sent_bwd"] = stats.get("scp_kv_bytes_sent_bwd", 0) + nrows * 2 * D * e
        stats["scp_index_bytes_sent"] = stats.get("scp_index_bytes_sent", 0) + nrows * 8 + n * 8
        stats["scp_klr_bytes_sent"] = stats.get("scp_klr_bytes_sent", 0) + (n - 1) * k_lr.numel() * k_lr.element_size()
        dense = B * L * H * 2 * D * e * (n - 1)  # K/V a dense sequence-parallel rank sends (all-gather)
        stats["scp_dense_kv_bytes"] = stats.get("scp_dense_kv_bytes", 0) + dense
        stats["scp_union_fraction"] = nrows / max(1, B * H * (n - 1) * L)
        per_head = torch.bincount(hh, minlength=H).double() / max(1, B * (n - 1) * L)
        stats["scp_union_per_head"] = per_head.tolist()
        stats["scp_table_len"] = S_pad
        stats["scp_query_pad"] = S_pad / L - 1.0
        stats["scp_kept_fraction"] = int(valid.sum()) / max(1, n_entries)
        if stats.get("scp_keep_index"):
            stats["scp_kv_index"] = idx  # the lists used (global key positions), for inspection
    return out
