"""Local + collective validation of context-parallel inputs (fail on every rank, never hang)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import List, Optional

import torch

from .comm import check_collective, group_size_rank

_DTYPES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}


@dataclasses.dataclass
class Prepared:
    world: int
    rank: int
    shard: int  # L: tokens per rank
    seqlen: int  # n * L: tokens covered by the group
    kv_count_host: List[List[int]]


def _local_errors(q, k, v, q_lr, k_lr, kv_count, group_size) -> Optional[str]:
    for name, t in (("q", q), ("k", k), ("v", v), ("q_lr", q_lr), ("k_lr", k_lr), ("kv_count", kv_count)):
        if not isinstance(t, torch.Tensor):
            return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
    for name, t in (("q", q), ("k", k), ("v", v), ("q_lr", q_lr), ("k_lr", k_lr)):
        if t.dim() != 4:
            return f"{name}: expected [B, S_local, H, d], got shape {tuple(t.shape)}"
        if t.dtype not in _DTYPES:
            return f"{name}: unsupported dtype {t.dtype}"
        if t.device != q.device:
            return f"{name}: on {t.device}, q is on {q.device}"
    if k.shape != q.shape or v.shape != q.shape:
        return f"k/v: shapes {tuple(k.shape)} / {tuple(v.shape)} must equal q's {tuple(q.shape)}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"k/v: dtypes {k.dtype} / {v.dtype} must equal q's {q.dtype}"
    if q_lr.shape[:3] != q.shape[:3] or k_lr.shape != q_lr.shape:
        return f"q_lr/k_lr: shapes {tuple(q_lr.shape)} / {tuple(k_lr.shape)} must be [B, S_local, H, r] with q's {tuple(q.shape[:3])}"
    if not isinstance(group_size, int) or group_size < 1:
        return f"group_size: must be a positive int, got {group_size!r}"
    L = q.shape[1]
    if L == 0 or L % group_size:
        return f"q: shard length {L} is not a positive multiple of group_size {group_size} (query groups may not straddle ranks; pad the sequence)"
    if kv_count.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        return f"kv_count: expected an integer tensor, got {kv_count.dtype}"
    if tuple(kv_count.shape) != (q.shape[0], q.shape[2]):
        return f"kv_count: expected shape [B, H] = {(q.shape[0], q.shape[2])}, got {tuple(kv_count.shape)}"
    return None


def kv_block_error(kv_block) -> Optional[str]:
    """The message for a bad list granularity (None when it is a positive int)."""
    if isinstance(kv_block, bool) or not isinstance(kv_block, int) or kv_block < 1:
        return f"kv_block: expected a positive int (1: token lists), got {kv_block!r}"
    return None


def prepare(what, q, k, v, q_lr, k_lr, kv_count, group_size, group, scale, validate: bool, extra=None,
            local_error: Optional[str] = None) -> Prepared:
    """Checks this rank's arguments and (with ``validate``) that every rank agrees; a problem on
    any rank raises on all of them. ``local_error``: a caller's own check of extra arguments."""
    n, me = group_size_rank(group)
    err = local_error or _local_errors(q, k, v, q_lr, k_lr, kv_count, group_size)
    cnt_host: List[List[int]] = []
    if err is None:
        cnt_host = kv_count.detach().to("cpu", torch.int64).tolist()
        S = n * q.shape[1]
        bad = [c for row in cnt_host for c in row if c < 1]
        if bad:
            err = f"kv_count: values must be >= 1 (counts >= S = {S} run dense), got {bad[0]}"
    if not validate:
        if err:
            raise ValueError(f"{what}: rank {me}: {err}")
    else:
        fields = {}
        if err is None:
            rg = int(q.requires_grad) | int(k.requires_grad) << 1 | int(v.requires_grad) << 2
            fields = {"B": q.shape[0], "S_local": q.shape[1], "H": q.shape[2], "D": q.shape[3], "r": q_lr.shape[3],
                      "group_size": group_size, "dtype": _DTYPES[q.dtype], "lowrank_dtype": _DTYPES[q_lr.dtype],
                      "device_type": zlib.crc32(q.device.type.encode()), "requires_grad(q,k,v)": rg,
                      "kv_count(checksum)": zlib.crc32(repr(cnt_host).encode()),
                      "scale": zlib.crc32(repr(None if scale is None else float(scale)).encode())}
            for key, val in (extra or {}).items():
                fields[key + "(checksum)"] = zlib.crc32(repr(val).encode())
        # every rank must send the same number of fields: a rank with a local error sends its
        # message and zeros in place of the fields it could not compute
        names = ["B", "S_local", "H", "D", "r", "group_size", "dtype", "lowrank_dtype", "device_type",
                 "requires_grad(q,k,v)", "kv_count(checksum)", "scale"] + [key + "(checksum)" for key in (extra or {})]
        check_collective(group, f"dsv_ext.parallel.{what}", {nm: fields.get(nm, 0) for nm in names}, err)
    L = q.shape[1]
    return Prepared(n, me, L, n * L, cnt_host)
