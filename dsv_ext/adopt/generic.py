"""DSV attention for generic attention blocks (used by dsv_ext.convert; see docs/ADOPTION.md).

  * torch.nn.MultiheadAttention (batch_first True or False, also inside
    nn.TransformerEncoderLayer / DecoderLayer): convert() swaps the class of each instance for
    DSVMultiheadAttention (same parameters, same state_dict keys plus `dsv_core.predictor.*`).
  * any module that calls F.scaled_dot_product_attention on [B, H, S, D]:
    route_sdpa(module, num_heads, head_dim) makes the self-attention-shaped SDPA calls made
    inside module.forward go to a SparseAttention (`module.dsv_core`): a scoped patch of
    torch.nn.functional.scaled_dot_product_attention, installed by a forward pre-hook and
    removed by a forward hook that also runs when the forward raises.

Stage 1 is bitwise exact in both: the output comes from the very call the unconverted module
makes (the original MultiheadAttention forward; the original SDPA with the same arguments),
and the predictor training / profiling of the armed steps run on detached copies of q and k
on the side. Stage 2 computes q, k, v the way the module does and runs DSV's sparse path.
Calls DSV cannot serve keep the original path in every stage: masks, causal attention,
cross-attention (q, k, v not the same tensor for MHA; differing shapes for SDPA), grouped
heads, and attention dropout in training.
"""
from __future__ import annotations

import threading
import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import attention as _attention
from ..modules.attention import SparseAttention
from ..config import DSVConfig

__all__ = ["DSVMultiheadAttention", "route_sdpa", "unroute_sdpa"]


def _sparse_now(core: SparseAttention) -> bool:
    return core.stage == 2 and core.use_sparse and core.density is not None


def _warn_once(core: SparseAttention, what: str) -> None:
    seen = core.__dict__.setdefault("_generic_warned", set())
    if what not in seen:
        warnings.warn(f"SparseAttention({core.name}): {what}")
        seen.add(what)


# ------------------------------------------------------------------------------------------------
# nn.MultiheadAttention

class DSVMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention with DSV self-attention (convert() sets the class of existing
    instances to this one and adds `dsv_core`). In stage 2 a call returns (out, None): no
    attention weights exist on the sparse path (a warning says so once when they are asked for;
    nn.TransformerEncoderLayer does not ask)."""

    dsv_core: SparseAttention

    def _dsv_ok(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        return (query is key and key is value and key_padding_mask is None and attn_mask is None
                and not is_causal and self._qkv_same_embed_dim and self.bias_k is None
                and not self.add_zero_attn and query.dim() in (2, 3))

    def _dsv_qkv(self, x: torch.Tensor):
        """q, k, v [B, S, H, D] of a batch-first input x [B, S, E] (MHA's packed in-projection)."""
        B, S, E = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        return qkv.view(B, S, 3, self.num_heads, self.head_dim).unbind(2)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        core = self.dsv_core
        args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if not self._dsv_ok(query, key, value, key_padding_mask, attn_mask, is_causal):
            return super().forward(*args)
        sparse = _sparse_now(core)
        if sparse and self.training and self.dropout > 0:
            _warn_once(core, "attention dropout has no sparse path: these calls stay dense")
            sparse = False
        unbatched = query.dim() == 2
        x = query.unsqueeze(1 if not self.batch_first else 0) if unbatched else query
        x = x if self.batch_first else x.transpose(0, 1)           # [B, S, E]
        if not sparse:
            out = super().forward(*args)
            if core.side_tasks_due:
                with torch.no_grad():
                    q, k, _ = self._dsv_qkv(x)
                core.run_side_tasks(q, k, core.grid, None)
            return out
        if need_weights:
            _warn_once(core, "need_weights=True: the sparse path has no attention weights (None returned)")
        q, k, v = self._dsv_qkv(x)
        o = core(q, k, v)
        out = F.linear(o.reshape(x.shape[0], x.shape[1], self.embed_dim), self.out_proj.weight, self.out_proj.bias)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1 if not self.batch_first else 0)
        return out, None


def convert_mha(model: nn.Module, grid, config: DSVConfig) -> int:
    """Convert the nn.MultiheadAttention modules that can serve self-attention: not those with
    other key/value sizes (kdim/vdim) and not the cross-attention `multihead_attn` of
    nn.TransformerDecoderLayer (a converted module that never sees a self-attention call would
    never be profiled, and the controller waits for every block's profile before the switch)."""
    cross = {id(getattr(m, "multihead_attn", None)) for m in model.modules()
             if isinstance(m, nn.TransformerDecoderLayer)}
    n = 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.MultiheadAttention) or id(m) in cross or not m._qkv_same_embed_dim:
            continue
        if not isinstance(m, DSVMultiheadAttention):
            if type(m) is not nn.MultiheadAttention:
                continue  # a user subclass: its forward may differ, leave it alone
            m.__class__ = DSVMultiheadAttention
        core = getattr(m, "dsv_core", None)
        if not isinstance(core, SparseAttention):
            core = SparseAttention(m.num_heads, m.head_dim, grid=grid, config=config, name=name)
            core.to(device=m.out_proj.weight.device)
            m.dsv_core = core
        elif grid is not None:
            core.set_grid(grid)
        n += 1
    return n


# ------------------------------------------------------------------------------------------------
# scoped SDPA routing

_ORIG_SDPA = _attention._SDPA
_local = threading.local()
_lock = threading.Lock()
_installed = 0


def _stack():
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, **kwargs):
    stack = _stack()
    core = stack[-1] if stack else None

    def original():
        return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa, **kwargs)

    if (core is None or kwargs or attn_mask is not None or is_causal or enable_gqa
            or not all(isinstance(t, torch.Tensor) for t in (query, key, value)) or query.dim() != 4
            or key.shape != query.shape or value.shape != query.shape
            or query.shape[1] != core.num_heads or query.shape[3] != core.head_dim):
        return original()
    q, k = query.transpose(1, 2), key.transpose(1, 2)
    if not _sparse_now(core) or (dropout_p and core.training):
        if dropout_p and core.training and _sparse_now(core):
            _warn_once(core, "attention dropout has no sparse path: these calls stay dense")
        if core.side_tasks_due:
            core.run_side_tasks(q, k, core.grid, scale)
        return original()
    return core(q, k, value.transpose(1, 2), scale=scale).transpose(1, 2)


def _install() -> None:
    global _installed
    with _lock:
        if _installed == 0:
            F.scaled_dot_product_attention = _routed_sdpa
        _installed += 1


def _uninstall() -> None:
    global _installed
    with _lock:
        _installed -= 1
        if _installed == 0:
            F.scaled_dot_product_attention = _ORIG_SDPA


def _pre_hook(module, args):
    _stack().append(module.dsv_core)
    _install()


def _post_hook(module, args, output):
    s = _stack()
    if s and s[-1] is module.dsv_core:
        s.pop()
        _uninstall()
    return None


def route_sdpa(module: nn.Module, num_heads: int, head_dim: int, grid: Optional[Sequence[int]] = None,
               config: Optional[DSVConfig] = None, name: Optional[str] = None) -> SparseAttention:
    """Route the SDPA self-attention calls inside `module.forward` to DSV; returns its core.

    Every F.scaled_dot_product_attention(q, k, v, ...) call made while module.forward runs,
    with q, k, v of one shape [B, num_heads, S, head_dim], no mask, not causal, goes to a
    SparseAttention registered as `module.dsv_core` (stage 1: the original SDPA call, exact;
    stage 2: DSV sparse attention); other calls run unchanged. Use it on the innermost module
    that makes one such call per forward (one core = one attention layer's predictor). The
    module's code must look SDPA up at call time (`F.scaled_dot_product_attention(...)` or
    `torch.nn.functional.scaled_dot_product_attention(...)`), not hold its own reference from
    `from torch.nn.functional import scaled_dot_product_attention`. Eager mode only."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    core = getattr(module, "dsv_core", None)
    if isinstance(core, SparseAttention):
        if core.num_heads != num_heads or core.head_dim != head_dim:
            raise ValueError(f"num_heads: module already routed with heads={core.num_heads}, "
                             f"head_dim={core.head_dim}")
        if config is not None:
            core.config = config
        if grid is not None:
            core.set_grid(grid)
    else:
        core = SparseAttention(num_heads, head_dim, grid=grid, config=config, name=name)
        p = next(iter(module.parameters()), None)
        if p is not None:
            core.to(device=p.device)
        module.dsv_core = core
    if getattr(module, "_dsv_sdpa_hooks", None) is None:
        module._dsv_sdpa_hooks = (module.register_forward_pre_hook(_pre_hook),
                                  module.register_forward_hook(_post_hook, always_call=True))
    return core


def unroute_sdpa(module: nn.Module) -> None:
    """Undo route_sdpa (removes the hooks and `module.dsv_core`)."""
    hooks = getattr(module, "_dsv_sdpa_hooks", None)
    if hooks is not None:
        for h in hooks:
            h.remove()
        module._dsv_sdpa_hooks = None
    if isinstance(getattr(module, "dsv_core", None), SparseAttention):
        del module.dsv_core
