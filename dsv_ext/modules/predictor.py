"""Per-head low-rank predictors of DSV.

For head h, q_lr = q @ Wq[h] and k_lr = k @ Wk[h] (head_dim -> rank), trained so that
q_lr . k_lr approximates the exact logit scale * q . k (loss: dsv_ext.predictor_loss).
The weights are batched parameters of shape [H, D, r] (one einsum for all heads).

Initialisation: Wq = Wk = W with W ~ N(0, scale / r), scale = 1/sqrt(D), so that
E[W W^T] = scale * I and q_lr . k_lr is an unbiased random-projection estimate of the logit
before any training (a Johnson-Lindenstrauss start, better than a random bilinear form).

The weights stay float32 when the model is cast to a 16-bit type (``model.to(torch.bfloat16)``,
``.half()``): the controller's AdamW updates them by ~1e-3 of their size per step, which a bf16
weight (8 significant bits) would mostly round away. Casts to float64 and device moves apply as
usual; projections run in the inputs' dtype.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

__all__ = ["LowRankPredictor"]


class LowRankPredictor(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, rank: int = 16, scale: Optional[float] = None,
                 device=None, dtype=torch.float32):
        super().__init__()
        for n, v in (("num_heads", num_heads), ("head_dim", head_dim), ("rank", rank)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{n}: expected a positive int, got {v!r}")
        self.num_heads, self.head_dim, self.rank = num_heads, head_dim, rank
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        # requires_grad=False: the predictors are invisible to the model's optimizer, to DDP and to
        # the model's backward; their gradients come from the predictor loss only and are kept in a
        # private accumulator of SparseAttention until DSVController.step() applies them.
        self.wq = nn.Parameter(torch.empty(num_heads, head_dim, rank, device=device, dtype=dtype),
                               requires_grad=False)
        self.wk = nn.Parameter(torch.empty(num_heads, head_dim, rank, device=device, dtype=dtype),
                               requires_grad=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        std = math.sqrt(self.scale / self.rank)
        w = torch.randn(self.wq.shape, generator=generator, dtype=torch.float32) * std
        self.wq.copy_(w)
        self.wk.copy_(w)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        with torch.no_grad():
            for p in (self.wq, self.wk):
                if p.dtype in (torch.float16, torch.bfloat16):
                    p.data = p.data.float()  # keep fp32 master weights (see the module docstring)
        return self

    def project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[B, S, H, D] x [H, D, r] -> [B, S, H, r] in x's dtype (autocast off: explicit dtype)."""
        if x.dim() != 4 or x.shape[2] != self.num_heads or x.shape[3] != self.head_dim:
            raise ValueError(f"x: expected [B, S, {self.num_heads}, {self.head_dim}], got {tuple(x.shape)}")
        with torch.autocast(device_type=x.device.type, enabled=False):
            return torch.einsum("bshd,hdr->bshr", x, w.to(x.dtype)).contiguous()

    def forward(self, q: torch.Tensor, k: torch.Tensor, wq: Optional[torch.Tensor] = None,
                wk: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(q_lr, k_lr); wq/wk override the weights (e.g. detached copies that require grad)."""
        return (self.project(q, self.wq if wq is None else wq),
                self.project(k, self.wk if wk is None else wk))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, rank={self.rank}"
