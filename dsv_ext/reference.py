"""Plain-PyTorch float64 references of every dsv op, and input helpers shared by the tests.

Everything here is written for clarity, not speed: the attention references build the dense
[B, H, S, S] logits and mask, which is fine for test sizes only. All references compute in
float64 whatever the input dtype and return float64 tensors.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

__all__ = [
    "sparse_attention_ref",
    "sparse_attention_lse_ref",
    "dense_attention_ref",
    "topk_ref",
    "topk_scores_ref",
    "predictor_loss_ref",
    "profile_ref",
    "gather_rows_ref",
    "scatter_add_rows_ref",
    "key_multiplicity",
    "random_index",
    "make_qkv",
    "ProfileRef",
]


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _default_scale(d: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def key_multiplicity(kv_index: torch.Tensor, kv_count: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[B, H, G, S] float64: how many times each key appears among the used entries of each list.

    Entries at positions >= kv_count[b, h] (count clamped to [0, Kmax]) and entries outside
    [0, S) are ignored, exactly as the kernels do."""
    B, H, NG, KM = kv_index.shape
    idx = kv_index.to(torch.int64).cpu()
    cnt = kv_count.to(torch.int64).cpu().clamp(0, KM)
    used = torch.arange(KM).view(1, 1, 1, KM) < cnt.view(B, H, 1, 1)
    valid = used & (idx >= 0) & (idx < seqlen)
    mult = torch.zeros(B, H, NG, seqlen, dtype=torch.float64)
    mult.scatter_add_(3, torch.where(valid, idx, torch.zeros_like(idx)), valid.to(torch.float64))
    return mult.to(kv_index.device)


def _expand_groups(mult_g: torch.Tensor, seqlen: int, group_size: int) -> torch.Tensor:
    """[B, H, G, S] per-group tensor -> [B, H, S(query), S(key)] per-query tensor."""
    groups = torch.arange(seqlen, device=mult_g.device) // group_size
    return mult_g[:, :, groups, :]


def sparse_attention_lse_ref(q, k, v, kv_index, kv_count, group_size, scale=None):
    """Dense masked softmax reference of sparse grouped attention, in float64.

    Returns (out [B, S, H, D], lse [B, H, S]); a query whose list has no valid entry gets a zero
    output and lse = -inf. A key listed twice counts twice (weight = multiplicity), as in the
    kernels. Differentiable in q, k, v."""
    S = q.shape[1]
    return masked_attention_ref(q, k, v, key_multiplicity(kv_index, kv_count, S), group_size, scale)


def masked_attention_ref(q, k, v, mult_g, group_size, scale=None):
    """(out [B, S, H, D], lse [B, H, S]) in float64 of attention in which group g's queries see
    key j with weight mult_g[b, h, g, j] (0: masked; a key listed twice counts twice); a query
    without keys gets a zero output and lse = -inf. Differentiable in q, k, v."""
    B, S, H, D = q.shape
    scale = _default_scale(D, scale)
    qh, kh, vh = (_f64(t).permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, S, D]
    mult = _expand_groups(mult_g, S, group_size)
    logits = scale * qh @ kh.transpose(-1, -2)
    masked = logits.masked_fill(mult == 0, float("-inf")) + torch.log(mult.clamp(min=1.0))
    empty = (mult.sum(-1) == 0)[..., None]
    safe = masked.masked_fill(empty, 0.0)
    p = torch.softmax(safe, dim=-1) * (~empty)
    out = (p @ vh).permute(0, 2, 1, 3)
    lse = torch.logsumexp(safe, dim=-1).masked_fill(empty[..., 0], float("-inf"))
    return out, lse


def sparse_attention_ref(q, k, v, kv_index, kv_count, group_size, scale=None):
    """out [B, S, H, D] (float64) of sparse grouped attention; see sparse_attention_lse_ref."""
    return sparse_attention_lse_ref(q, k, v, kv_index, kv_count, group_size, scale)[0]


def dense_attention_ref(q, k, v, scale=None):
    """Plain dense softmax attention in float64, [B, S, H, D] in and out."""
    D = q.shape[-1]
    scale = _default_scale(D, scale)
    qh, kh, vh = (_f64(t).permute(0, 2, 1, 3) for t in (q, k, v))
    p = torch.softmax(scale * qh @ kh.transpose(-1, -2), dim=-1)
    return (p @ vh).permute(0, 2, 1, 3)


def topk_scores_ref(q_lr, k_lr, group_size):
    """[B, H, G, S] float64 low-rank scores of each group's mean query against every key."""
    B, S, H, R = q_lr.shape
    NG = -(-S // group_size)
    qh = _f64(q_lr).permute(0, 2, 1, 3)  # [B, H, S, R]
    groups = torch.arange(S, device=q_lr.device) // group_size
    rep = torch.zeros(B, H, NG, R, dtype=torch.float64, device=q_lr.device)
    rep.index_add_(2, groups, qh)
    sizes = torch.bincount(groups, minlength=NG).to(torch.float64)
    rep = rep / sizes.view(1, 1, NG, 1)
    return rep @ _f64(k_lr).permute(0, 2, 3, 1)


def topk_ref(q_lr, k_lr, kv_count, group_size, kmax=None):
    """int32 [B, H, G, kmax]: torch.topk of the group-mean low-rank scores, each list's first
    min(kv_count[b, h], S) entries sorted ascending, -1 after."""
    B, S, H, _ = q_lr.shape
    cnt = kv_count.to(torch.int64).cpu()
    if kmax is None:
        kmax = int(cnt.max().item()) if cnt.numel() else 0
    scores = topk_scores_ref(q_lr, k_lr, group_size)
    NG = scores.shape[2]
    out = torch.full((B, H, NG, kmax), -1, dtype=torch.int32, device=q_lr.device)
    for b in range(B):
        for h in range(H):
            K = min(max(int(cnt[b, h]), 0), kmax, S)
            if K == 0:
                continue
            idx = torch.topk(scores[b, h], K, dim=-1).indices
            out[b, h, :, :K] = idx.sort(dim=-1).values.to(torch.int32)
    return out


def predictor_loss_ref(q, k, q_lr, k_lr, rows, scale=None, cos_weight=0.95, norm_weight=0.05,
                       eps=1e-12):
    """loss [B, H] (float64) of the low-rank predictor on the sampled rows, as in dsv.h.
    Differentiable in q_lr and k_lr (q and k are detached)."""
    D = q.shape[-1]
    scale = _default_scale(D, scale)
    rows = torch.as_tensor(rows, device=q.device).to(torch.int64)
    qh = _f64(q.detach()).permute(0, 2, 1, 3)[:, :, rows]  # [B, H, R, D]
    kh = _f64(k.detach()).permute(0, 2, 1, 3)
    qlh = _f64(q_lr).permute(0, 2, 1, 3)[:, :, rows]
    klh = _f64(k_lr).permute(0, 2, 1, 3)
    z = scale * qh @ kh.transpose(-1, -2)  # [B, H, R, S]
    p = qlh @ klh.transpose(-1, -2)
    szp = (z * p).sum(-1)
    nz = torch.sqrt((z * z).sum(-1) + eps)
    np_ = torch.sqrt((p * p).sum(-1) + eps)
    loss = cos_weight * (1.0 - szp / (nz * np_)) + norm_weight * (np_ / nz - 1.0) ** 2
    return loss.mean(-1)


class ProfileRef(NamedTuple):
    sparsity: torch.Tensor
    recall: Optional[torch.Tensor]


def profile_ref(q, k, rows, theta=0.9, kv_index=None, kv_count=None, group_size=None,
                scale=None):
    """Per-head sparsity at mass theta and, with an index, recall (float64, [B, H])."""
    B, S, H, D = q.shape
    scale = _default_scale(D, scale)
    rows = torch.as_tensor(rows, device=q.device).to(torch.int64)
    qh = _f64(q).permute(0, 2, 1, 3)[:, :, rows]
    kh = _f64(k).permute(0, 2, 1, 3)
    P = torch.softmax(scale * qh @ kh.transpose(-1, -2), dim=-1)  # [B, H, R, S]
    if theta <= 0:
        c = torch.zeros(P.shape[:-1], dtype=torch.float64, device=q.device)
    else:
        cum = P.sort(dim=-1, descending=True).values.cumsum(-1)
        c = ((cum < theta).sum(-1) + 1).clamp(max=S).to(torch.float64)
    sparsity = 1.0 - c.mean(-1) / S
    recall = None
    if kv_index is not None:
        mult = key_multiplicity(kv_index, kv_count, S)  # [B, H, G, S]
        covered = (mult[:, :, rows // group_size, :] > 0).to(torch.float64)
        recall = (P * covered).sum(-1).mean(-1)
    return ProfileRef(sparsity, recall)


def gather_rows_ref(src, index):
    """dst[i] = src[index[i]] (rows out of range: zeros), same dtype as src."""
    index = index.to(torch.int64)
    valid = (index >= 0) & (index < src.shape[0])
    out = torch.zeros(index.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
    out[valid] = src[index[valid]]
    return out


def scatter_add_rows_ref(src, index, num_rows):
    """float64 [num_rows, D]: dst[index[i]] += src[i] (indices out of range skipped)."""
    index = index.to(torch.int64)
    valid = (index >= 0) & (index < num_rows)
    out = torch.zeros(num_rows, src.shape[1], dtype=torch.float64, device=src.device)
    out.index_add_(0, index[valid], _f64(src)[valid])
    return out


def random_index(B: int, H: int, S: int, G: int, kmax: int,
                 counts: Union[None, int, Sequence, torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None, pad: Union[int, str] = -1):
    """A valid random index: (kv_index int32 [B, H, ceil(S/G), kmax], kv_count int32 [B, H]).

    Each list holds kv_count[b, h] distinct key positions in [0, S), sorted ascending; the
    entries after the count are `pad` (an int, or "random" for arbitrary in-range positions,
    to check that kernels ignore them). counts: None (random in [1, min(kmax, S)] per head),
    an int (same for every head), or a [B, H] sequence / tensor."""
    if kmax > S:
        raise ValueError(f"kmax={kmax} > S={S}: lists cannot hold that many distinct keys")
    NG = -(-S // G)
    if counts is None:
        cnt = torch.randint(1, max(kmax, 1) + 1, (B, H), generator=generator)
        cnt = cnt.clamp(max=kmax)
    elif isinstance(counts, int):
        cnt = torch.full((B, H), counts, dtype=torch.int64)
    else:
        cnt = torch.as_tensor(counts, dtype=torch.int64).reshape(B, H)
    if pad == "random":
        index = torch.randint(0, S, (B, H, NG, kmax), generator=generator)
    else:
        index = torch.full((B, H, NG, kmax), int(pad), dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            c = int(cnt[b, h])
            if c == 0:
                continue
            perm = torch.rand(NG, S, generator=generator).argsort(dim=-1)[:, :c]
            index[b, h, :, :c] = perm.sort(dim=-1).values
    return index.to(torch.int32), cnt.to(torch.int32)


def make_qkv(B: int, S: int, H: int, D: int, dtype=torch.float32, layout: str = "packed",
             generator: Optional[torch.Generator] = None, device="cpu", requires_grad=False,
             scale: float = 1.0, n: int = 3):
    """n random [B, S, H, D] tensors (default q, k, v).

    layout: "contiguous" (separate tensors), "packed" (views of one [B, S, n, H, D] tensor, so
    the sequence stride is n*H*D), "packed_d" (views of [B, S, H, n*D]: head stride n*D) or
    "bhsd" (transposes of contiguous [B, H, S, D] tensors). Only the last dim is contiguous in
    the non-contiguous layouts. With requires_grad the views are detached (keeping their
    strides) and made leaves. Values are N(0, scale^2), drawn in float64 on the CPU (so a
    generator gives the same values on every device) and then cast."""
    def rnd(*shape):
        t = torch.randn(*shape, generator=generator, dtype=torch.float64).mul_(scale)
        return t.to(device=device, dtype=dtype)

    if layout == "contiguous":
        ts = [rnd(B, S, H, D) for _ in range(n)]
    elif layout == "packed":
        base = rnd(B, S, n, H, D)
        ts = [base[:, :, i] for i in range(n)]
    elif layout == "packed_d":
        base = rnd(B, S, H, n * D)
        ts = [base[..., i * D:(i + 1) * D] for i in range(n)]
    elif layout == "bhsd":
        ts = [rnd(B, H, S, D).transpose(1, 2) for _ in range(n)]
    else:
        raise ValueError(f"layout: unknown layout {layout!r}")
    if requires_grad:
        ts = [t.detach().requires_grad_(True) for t in ts]
    return tuple(ts)
