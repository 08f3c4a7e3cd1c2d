"""Recall of the predicted key lists as a function of K, and the recall-targeted K rule.

    curve = recall_curve(q, k, wq, wk, rows, group_size=64, k_multiple=64)   # [B, H, bins]
    K = k_for_recall(curve.mean(0)[h], target=0.95, seq_len=S, k_multiple=64)

``recall_curve`` answers, for every sampled query row and every K on the kernel's K grid
(multiples of ``k_multiple``, capped at S), which fraction of the row's exact softmax mass the
first K keys of its group's predicted list cover: the keys are ranked by the low-rank score of
the group's mean projected query (exactly what ``dsv_ext.ops.topk_estimate`` keeps), the exact
probabilities are those of the row itself. Bin ``i`` of the result is the mean over the rows of
the mass covered by the top ``min((i + 1) * k_multiple, S)`` keys, so the last bin is 1.

With ``kv_block = b > 1`` the lists hold key blocks (``b`` consecutive positions of ``k``, the
order the block lists address): blocks are ranked by the group representative's score against
the block-mean projected key (what ``topk_estimate(..., kv_block=b)`` keeps), and bin ``i`` is the
mass of the top ``ceil(K / b)`` blocks for ``K = min((i + 1) * k_multiple, S)`` keys.

Plain PyTorch on the sampled rows (no kernel): per chunk of rows it builds the rows' exact
probabilities and predicted scores against all S keys (``[H, rows, S]``), sorts the scores and
sums the probabilities per K bin. Memory is bounded by ``chunk_bytes`` (rows are processed in
chunks), time is one sort of ``rows x S`` per head; ``max_rows`` subsamples the rows (the
controller uses ``DSVConfig.recall_rows``, 256 by default: a standard error of the mean recall of
a few 1e-3).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["recall_curve", "k_for_recall", "density_for_recall"]


def _check(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-d tensor, got shape {tuple(t.shape)}")


@torch.no_grad()
def recall_curve(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, rows,
                 group_size: int, k_multiple: int, scale: Optional[float] = None,
                 max_rows: Optional[int] = None, chunk_bytes: int = 1 << 28,
                 kv_block: int = 1) -> torch.Tensor:
    """float32 ``[B, H, ceil(S / k_multiple)]``: mean over the sampled rows of the exact attention
    mass covered by the top ``min((i + 1) * k_multiple, S)`` keys of the row's group list.

    q, k: ``[B, S, H, D]``, the queries in the order the query groups are formed in (cube order);
    wq, wk: predictor weights ``[H, D, r]``; rows: int tensor of sampled query positions in
    [0, S); group_size: G (queries ``g*G .. g*G+G-1`` share a list); scale: softmax scale
    (default 1/sqrt(D)); max_rows: use at most this many of the rows (evenly strided);
    kv_block: list granularity (1: keys; b > 1: blocks of b consecutive keys of ``k``)."""
    _check("q", q, 4)
    _check("k", k, 4)
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    B, S, H, D = q.shape
    for n, w in (("wq", wq), ("wk", wk)):
        _check(n, w, 3)
        if w.shape[0] != H or w.shape[1] != D:
            raise ValueError(f"{n}: expected [{H}, {D}, r], got shape {tuple(w.shape)}")
    for n, v in (("group_size", group_size), ("k_multiple", k_multiple), ("kv_block", kv_block)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{n}: expected an integer >= 1, got {v!r}")
    rows = torch.as_tensor(rows, device=q.device).to(torch.int64).reshape(-1)
    if rows.numel() == 0:
        raise ValueError("rows: expected at least one sampled row")
    if int(rows.min()) < 0 or int(rows.max()) >= S:
        raise ValueError(f"rows: positions must be in [0, {S}), got min {int(rows.min())}, max {int(rows.max())}")
    if max_rows is not None:
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows: expected an integer >= 1, got {max_rows!r}")
        if rows.numel() > max_rows:
            rows = rows[::math.ceil(rows.numel() / max_rows)]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return _curve(q, k, wq, wk, rows, group_size, k_multiple, scale, min(kv_block, S), chunk_bytes)


def _curve(q, k, wq, wk, rows, G: int, km: int, scale: float, b: int, chunk_bytes: int) -> torch.Tensor:
    """recall_curve with rows checked and subsampled: per row, the softmax mass of each key block
    (b keys; b = 1: each key) taken in the order of the row's group's predicted block scores,
    accumulated and read at each bin's K (ceil(K / b) blocks)."""
    B, S, H, D = q.shape
    f32 = torch.float32
    nbins, NG, nb = -(-S // km), -(-S // G), -(-S // b)
    q_lr = torch.einsum("bshd,hdr->bshr", q, wq.to(q.dtype)).to(f32)
    k_lr = torch.einsum("bshd,hdr->bshr", k, wk.to(k.dtype)).to(f32)
    r = q_lr.shape[-1]

    def pool(x, n, size):  # [B, S, H, r] -> [B, n, H, r] means over runs of `size` positions
        if n * size != S:
            x = torch.cat([x, x.new_zeros(B, n * size - S, H, r)], 1)
        sizes = torch.full((n,), float(size), device=q.device)
        sizes[-1] = S - (n - 1) * size
        return x.view(B, n, size, H, r).sum(2) / sizes.view(1, n, 1, 1)

    q_grp, k_blk = pool(q_lr, NG, G), pool(k_lr, nb, b)
    # blocks (ceil(K / b)) kept at each bin's K; the last bin keeps every block
    kept = (torch.minimum(torch.arange(1, nbins + 1, device=q.device) * km,
                          torch.tensor(S, device=q.device)) + b - 1) // b - 1
    groups = rows // G
    R = rows.numel()
    per_row = H * (S + nb) * 16
    step = max(1, min(R, chunk_bytes // max(per_row, 1)))
    out = torch.zeros(B, H, nbins, dtype=torch.float64, device=q.device)
    kf = k.to(f32)
    pad = nb * b - S
    for bi in range(B):
        kb = kf[bi].transpose(0, 1)                        # [H, S, D]
        klb = k_blk[bi].permute(1, 2, 0)                   # [H, r, nb]
        for i in range(0, R, step):
            rr, gg = rows[i:i + step], groups[i:i + step]
            qr = q[bi, rr].to(f32).transpose(0, 1)         # [H, Rc, D]
            p = torch.softmax(scale * (qr @ kb.transpose(1, 2)), dim=-1)  # [H, Rc, S]
            if pad:
                p = torch.cat([p, p.new_zeros(H, p.shape[1], pad)], -1)
            pblk = p.view(H, -1, nb, b).sum(-1, dtype=torch.float64)     # mass per block
            pred = q_grp[bi, gg].transpose(0, 1) @ klb     # [H, Rc, nb]
            order = pred.argsort(dim=-1, descending=True, stable=True)
            cum = pblk.gather(-1, order).cumsum(-1)
            del p, pred, order, pblk
            out[bi] += cum[..., kept].sum(1)
    return (out / R).to(f32)


def k_for_recall(curve: Sequence[float], target: float, seq_len: int, k_multiple: int) -> int:
    """Smallest K on the grid (multiples of k_multiple, capped at seq_len) whose mean recall in
    ``curve`` (one head's ``recall_curve``) reaches ``target``; seq_len if none does."""
    vals = curve.tolist() if isinstance(curve, torch.Tensor) else list(curve)
    for i, c in enumerate(vals):
        if c >= target:
            return int(min((i + 1) * k_multiple, seq_len))
    return int(seq_len)


def density_for_recall(curve: Sequence[float], target: float, seq_len: int, k_multiple: int) -> float:
    """``k_for_recall(...) / seq_len``: the fraction of the keys a head needs for ``target``."""
    return k_for_recall(curve, target, seq_len, k_multiple) / float(seq_len)
