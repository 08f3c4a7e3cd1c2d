"""Single-rank attention used inside the CP schemes: per-head dense/sparse split, estimation."""

from __future__ import annotations

from typing import List, Optional

import torch

from .. import ops
from ..functional.attention import block_counts, block_kmax, dense_core

__all__ = ["local_attention", "dense_heads"]


def dense_heads(kv_count_host: List[List[int]], num_keys: int) -> List[bool]:
    """A head is run dense when every batch's count covers all keys."""
    H = len(kv_count_host[0]) if kv_count_host else 0
    return [all(row[h] >= num_keys for row in kv_count_host) for h in range(H)]


def _sdpa(q, k, v, scale):
    """Dense heads: SDPA with the single-GPU stage 1's backend order (cuDNN first on CUDA: on the
    H100 / H200 it is 1.7-1.8x FlashAttention-2's speed at 64k tokens,
    benchmarks/results/kernels.md)."""
    return dense_core(q, k, v, scale, "auto")


def local_attention(q, k, v, q_lr, k_lr, kv_count, kv_count_host, group_size: int, scale: Optional[float],
                    kv_block: int = 1):
    """Attention of all queries against all keys of ``q``'s sequence for the heads given:
    q, k, v [B, S, a, D]; q_lr, k_lr [B, S, a, r]; kv_count int32 [B, a] (a host copy too), K in
    keys. Heads whose count covers S run dense (SDPA); the others select keys with
    dsv_ext.topk_estimate and run dsv_ext.sparse_attention, with lists of ceil(K / kv_block)
    blocks of kv_block consecutive positions when kv_block > 1. Returns [B, S, a, D]."""
    B, S, a, D = q.shape
    if a == 0:
        return q * 0.0  # keeps the (empty) graph connected so every rank runs the backward collectives
    dense = dense_heads(kv_count_host, S)
    sp = [h for h in range(a) if not dense[h]]
    dn = [h for h in range(a) if dense[h]]
    outs, order = [], []
    if sp:
        def pick(t):
            return t if len(sp) == a else t[:, :, sp]
        cnt = kv_count if len(sp) == a else kv_count[:, sp].contiguous()
        kmax = max(row[h] for row in kv_count_host for h in sp)
        kmax = max(1, min(kmax, S))
        cnt_b, kmax_b = block_counts(cnt, kv_block), block_kmax(kmax, kv_block, S)  # K in keys -> entries
        with torch.no_grad():
            idx = ops.topk_estimate(pick(q_lr).detach(), pick(k_lr).detach(), cnt_b, group_size, kmax=kmax_b,
                                    kv_block=kv_block)
        outs.append(ops.sparse_attention(pick(q), pick(k), pick(v), idx, cnt_b, group_size, scale=scale,
                                         check_index=False, kv_block=kv_block))
        order += sp
    if dn:
        def pickd(t):
            return t if len(dn) == a else t[:, :, dn]
        outs.append(_sdpa(pickd(q), pickd(k), pickd(v), scale))
        order += dn
    if len(outs) == 1:
        return outs[0]
    out = torch.cat(outs, 2)
    inv = [0] * a
    for i, h in enumerate(order):
        inv[h] = i
    return out[:, :, inv]
