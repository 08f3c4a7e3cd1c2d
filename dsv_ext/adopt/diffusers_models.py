"""DSV attention processors for diffusers' video transformers (used by dsv_ext.convert).

Supported (diffusers >= 0.35; tested with 0.42):
  * LTXVideoTransformer3DModel   self-attention `attn1` of each block (video only; the text enters
                                 through the cross-attention `attn2`, which stays dense)
  * CogVideoXTransformer3DModel  joint attention `attn1`: [text, video] in one sequence
  * HunyuanVideoTransformer3DModel  joint attention of the dual- and single-stream blocks:
                                 [video, text], text padding masked by the model's attention mask
  * MochiTransformer3DModel      joint attention `attn1`: [video, valid text] per sample
  * AllegroTransformer3DModel    self-attention `attn1` of each block (heads of 96; the text
                                 enters through the cross-attention `attn2`, which stays dense)
  * CosmosTransformer3DModel     self-attention `attn1` of each block (QK RMSNorm, rotary; the
                                 text enters through the cross-attention `attn2`, which stays dense)

Each converted attention module gets a SparseAttention as `attn.dsv_core` and a processor that
does what the model's own processor does (projections, QK norms, rotary embeddings, masks,
output projections) and calls `attn.dsv_core` where the model calls SDPA. In stage 1 the core
runs SDPA on the very tensors the model's processor would pass it, so outputs and gradients
are bitwise equal to the unconverted model. Text tokens stay dense (see SparseAttention's
`n_text`). The video token grid is read from the transformer's input at every forward (a
forward pre-hook) and the model's patch sizes, so cube grouping needs no user input. Calls the
processor does not cover (other argument combinations) go to the processor it replaced.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.attention import SparseAttention
from ..config import DSVConfig

__all__ = ["DSVLTXAttnProcessor", "DSVCogVideoXAttnProcessor", "DSVHunyuanVideoAttnProcessor",
           "DSVMochiAttnProcessor", "DSVAllegroAttnProcessor", "DSVCosmosAttnProcessor", "convert_diffusers_video"]


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved (real, imaginary) pairs of the last dim, with cos/sin given
    per channel (each value repeated over its pair), computed in float32 like the models do."""
    re, im = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    turned = torch.stack([-im, re], dim=-1).flatten(-2)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


def _rope_mochi(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mochi's rotary embedding: cos/sin per pair (half the channels), float32 arithmetic."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    a = (even * cos - odd * sin).to(x.dtype)
    b = (even * sin + odd * cos).to(x.dtype)
    return torch.stack([a, b], dim=-1).flatten(-2)


def _text_qkv(attn, encoder_hidden_states: torch.Tensor):
    """The text tokens' q, k, v of a joint attention layer ([B, N, H, D]), with its added norms."""
    eq, ek, ev = (p(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                  for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    if attn.norm_added_q is not None:
        eq = attn.norm_added_q(eq)
    if attn.norm_added_k is not None:
        ek = attn.norm_added_k(ek)
    return eq, ek, ev


class _DSVProcessor:
    """Base: keeps the replaced processor for the calls this one does not handle."""

    def __init__(self, fallback: Optional[Callable] = None):
        self.fallback = fallback

    def _fallback(self, attn, *args, **kwargs):
        if self.fallback is None:
            raise ValueError(f"attn: {type(self).__name__} does not handle this call and has no fallback processor")
        return self.fallback(attn, *args, **kwargs)


# ------------------------------------------------------------------------------------------------
# LTX-Video

class DSVLTXAttnProcessor(_DSVProcessor):
    """LTX-Video self-attention (`attn1`): to_q/k/v, RMSNorm over all heads, rotary on the
    flattened channels, attention, to_out. Cross-attention calls go to the fallback."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs: Any):
        core = getattr(attn, "dsv_core", None)
        if core is None or encoder_hidden_states is not None or attention_mask is not None or kwargs:
            return self._fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                  **kwargs)
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(hidden_states))
        v = attn.to_v(hidden_states)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            q, k = _rope_pairs(q, cos, sin), _rope_pairs(k, cos, sin)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = core(q, k, v).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


# ------------------------------------------------------------------------------------------------
# CogVideoX

class DSVCogVideoXAttnProcessor(_DSVProcessor):
    """CogVideoX joint attention: [text, video] through one attention; QK LayerNorm per head;
    rotary on the video part; returns (video, text) outputs."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                 **kwargs: Any):
        core = getattr(attn, "dsv_core", None)
        if core is None or attention_mask is not None or kwargs or encoder_hidden_states is None:
            return self._fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                  **kwargs)
        n_text = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        B = x.shape[0]
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        hd = k.shape[-1] // attn.heads
        # [B, H, S, D] as the model lays them out (norms and in-place rotary act there)
        q, k, v = (t.view(B, -1, attn.heads, hd).transpose(1, 2) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            cos, sin = (f[None, None].to(x.device) for f in image_rotary_emb)
            q[:, :, n_text:] = _rope_pairs(q[:, :, n_text:], cos, sin)
            if not attn.is_cross_attention:
                k[:, :, n_text:] = _rope_pairs(k[:, :, n_text:], cos, sin)
        out = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), n_text=n_text, text_first=True)
        out = out.reshape(B, -1, attn.heads * hd)
        out = attn.to_out[1](attn.to_out[0](out))
        text_out, video_out = out.split([n_text, out.size(1) - n_text], dim=1)
        return video_out, text_out


# ------------------------------------------------------------------------------------------------
# HunyuanVideo

class DSVHunyuanVideoAttnProcessor(_DSVProcessor):
    """HunyuanVideo joint attention, dual-stream (added q/k/v projections for the text) and
    single-stream (one projection over [video, text]) blocks; [video, text] order; the model's
    boolean key mask of the text padding."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs: Any):
        core = getattr(attn, "dsv_core", None)
        if core is None or kwargs or encoder_hidden_states is None:
            return self._fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                  **kwargs)
        n_text = encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None
        x = torch.cat([hidden_states, encoder_hidden_states], dim=1) if single else hidden_states
        q, k, v = (p(x).unflatten(2, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            cos, sin = (f[None, :, None, :].to(x.device) for f in image_rotary_emb)
            if single:
                q = torch.cat([_rope_pairs(q[:, :-n_text], cos, sin), q[:, -n_text:]], dim=1)
                k = torch.cat([_rope_pairs(k[:, :-n_text], cos, sin), k[:, -n_text:]], dim=1)
            else:
                q, k = _rope_pairs(q, cos, sin), _rope_pairs(k, cos, sin)
        if not single:
            eq, ek, ev = _text_qkv(attn, encoder_hidden_states)
            q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        mask = attention_mask
        if mask is not None and mask.ndim == 2 and mask.shape[0] == q.shape[0] and mask.shape[1] == k.shape[1]:
            mask = mask[:, None, None, :]  # what diffusers' native SDPA backend does with [B, S] masks
        out = core(q, k, v, n_text=n_text, attn_mask=mask)
        out = out.flatten(2, 3).to(q.dtype)
        video_out, text_out = out[:, :-n_text], out[:, -n_text:]
        if getattr(attn, "to_out", None) is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return video_out, text_out


# ------------------------------------------------------------------------------------------------
# Mochi

class DSVMochiAttnProcessor(_DSVProcessor):
    """Mochi joint attention: per sample, [video, the valid text tokens] through one attention
    (outputs of the text padding are zero, as in the model)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None,
                 **kwargs: Any):
        core = getattr(attn, "dsv_core", None)
        if core is None or kwargs or encoder_hidden_states is None or attention_mask is None:
            return self._fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                  **kwargs)
        q, k, v = (p(hidden_states).unflatten(2, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        eq, ek, ev = _text_qkv(attn, encoder_hidden_states)
        if image_rotary_emb is not None:
            q, k = _rope_mochi(q, *image_rotary_emb), _rope_mochi(k, *image_rotary_emb)
        # [B, H, S, D] as the model lays them out
        q, k, v, eq, ek, ev = (t.transpose(1, 2) for t in (q, k, v, eq, ek, ev))
        Sv, St = q.size(2), eq.size(2)
        outs = []
        for b in range(q.shape[0]):
            valid = torch.nonzero(attention_mask[b][None, :].flatten(), as_tuple=False).flatten()
            qb = torch.cat([q[b:b + 1], eq[b:b + 1, :, valid, :]], dim=2)
            kb = torch.cat([k[b:b + 1], ek[b:b + 1, :, valid, :]], dim=2)
            vb = torch.cat([v[b:b + 1], ev[b:b + 1, :, valid, :]], dim=2)
            ob = core(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), n_text=valid.numel())
            ob = ob.transpose(1, 2)
            outs.append(F.pad(ob, (0, 0, 0, Sv + St - ob.size(2))))
        out = torch.cat(outs, dim=0).transpose(1, 2).flatten(2, 3)
        video_out, text_out = out.split_with_sizes((Sv, St), dim=1)
        video_out = attn.to_out[1](attn.to_out[0](video_out))
        if hasattr(attn, "to_add_out"):
            text_out = attn.to_add_out(text_out)
        return video_out, text_out


# ------------------------------------------------------------------------------------------------
# Allegro

class DSVAllegroAttnProcessor(_DSVProcessor):
    """Allegro self-attention (`attn1`): to_q/k/v, heads split as [B, H, S, D], Allegro's 3-axis
    rotary on q and k, attention, to_out. Cross-attention (`attn2`), masked calls and the
    Attention options Allegro does not use go to the fallback."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None, **kwargs: Any):
        core = getattr(attn, "dsv_core", None)
        if (core is None or encoder_hidden_states is not None or attention_mask is not None or temb is not None
                or kwargs or hidden_states.dim() != 3 or attn.spatial_norm is not None
                or attn.group_norm is not None or attn.residual_connection or attn.rescale_output_factor != 1.0):
            return self._fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb,
                                  image_rotary_emb, **kwargs)
        B = hidden_states.shape[0]
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        D = k.shape[-1] // attn.heads
        q, k, v = (t.view(B, -1, attn.heads, D).transpose(1, 2) for t in (q, k, v))
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb_allegro
            q = apply_rotary_emb_allegro(q, image_rotary_emb[0], image_rotary_emb[1])
            k = apply_rotary_emb_allegro(k, image_rotary_emb[0], image_rotary_emb[1])
        out = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.reshape(B, -1, attn.heads * D).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


# ------------------------------------------------------------------------------------------------
# Cosmos

class DSVCosmosAttnProcessor(_DSVProcessor):
    """Cosmos self-attention (`attn1`): to_q/k/v, heads split as [B, H, S, D], RMSNorm of q and k,
    rotary (real form), attention, to_out. Cross-attention (`attn2`) and masked calls go to the
    fallback."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs: Any):
        core = getattr(attn, "dsv_core", None)
        if core is None or encoder_hidden_states is not None or attention_mask is not None or kwargs:
            return self._fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                  **kwargs)
        q, k, v = (p(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                   for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb
            q = apply_rotary_emb(q, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
            k = apply_rotary_emb(k, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
        out = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


# ------------------------------------------------------------------------------------------------
# conversion

def _patch(cfg, name: str, default: int = 1) -> int:
    v = getattr(cfg, name, None)
    return default if v is None else int(v)


def _grid_5d(x, t_dim: int, pt: int, p: int) -> Optional[Tuple[int, int, int]]:
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    T = x.shape[t_dim]
    return (T // pt, x.shape[-2] // p, x.shape[-1] // p)


def _grid_ltx(model, bound: Dict[str, Any]):
    x = bound.get("hidden_states")
    nf, h, w = bound.get("num_frames"), bound.get("height"), bound.get("width")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or None in (nf, h, w):
        return None
    S = x.shape[1]
    for g in ((int(nf), int(h), int(w)),
              (int(nf) // _patch(model.config, "patch_size_t"), int(h) // _patch(model.config, "patch_size"),
               int(w) // _patch(model.config, "patch_size"))):
        if g[0] * g[1] * g[2] == S:
            return g
    return None


def _grid_cogvideox(model, bound):
    c = model.config
    return _grid_5d(bound.get("hidden_states"), 1, _patch(c, "patch_size_t"), _patch(c, "patch_size"))


def _grid_cthw(model, bound):  # [B, C, T, H, W] inputs patched by patch_size_t x patch_size^2
    c = model.config
    return _grid_5d(bound.get("hidden_states"), 2, _patch(c, "patch_size_t"), _patch(c, "patch_size"))


def _grid_mochi(model, bound):
    return _grid_5d(bound.get("hidden_states"), 2, 1, _patch(model.config, "patch_size"))


def _grid_cosmos(model, bound):  # [B, C, T, H, W], patch_size (t, h, w)
    x, (pt, ph, pw) = bound.get("hidden_states"), model.config.patch_size
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    return (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)


# (module, transformer class, [block list attribute, attention attribute], processor, grid reader)
_SPECS = [
    ("diffusers.models.transformers.transformer_ltx", "LTXVideoTransformer3DModel",
     [("transformer_blocks", "attn1")], DSVLTXAttnProcessor, _grid_ltx),
    ("diffusers.models.transformers.cogvideox_transformer_3d", "CogVideoXTransformer3DModel",
     [("transformer_blocks", "attn1")], DSVCogVideoXAttnProcessor, _grid_cogvideox),
    ("diffusers.models.transformers.transformer_hunyuan_video", "HunyuanVideoTransformer3DModel",
     [("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")], DSVHunyuanVideoAttnProcessor,
     _grid_cthw),
    ("diffusers.models.transformers.transformer_mochi", "MochiTransformer3DModel",
     [("transformer_blocks", "attn1")], DSVMochiAttnProcessor, _grid_mochi),
    ("diffusers.models.transformers.transformer_allegro", "AllegroTransformer3DModel",
     [("transformer_blocks", "attn1")], DSVAllegroAttnProcessor, _grid_cthw),
    ("diffusers.models.transformers.transformer_cosmos", "CosmosTransformer3DModel",
     [("transformer_blocks", "attn1")], DSVCosmosAttnProcessor, _grid_cosmos),
]


def _grid_hook(module, args, kwargs):
    try:
        bound = module._dsv_signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    grid = module._dsv_grid_reader(module, bound)
    if grid is not None:
        for core in module._dsv_cores:
            if core.grid != grid:
                core.set_grid(grid)
    return None


def _head_dim(attn) -> int:
    hd = getattr(attn, "head_dim", None)
    if isinstance(hd, int):
        return hd
    return attn.to_q.out_features // attn.heads


def convert_diffusers_video(model: nn.Module, grid, config: DSVConfig) -> int:
    """Convert every supported diffusers video transformer inside `model`; returns the number of
    attention layers converted."""
    import importlib
    n = 0
    for mod_name, cls_name, places, proc_cls, reader in _SPECS:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except Exception:  # diffusers missing, or this model absent from its version
            continue
        for top in [m for m in model.modules() if isinstance(m, cls)]:
            cores: List[SparseAttention] = []
            for prefix, (blocks_attr, attn_attr) in enumerate(places):
                for i, block in enumerate(getattr(top, blocks_attr, None) or []):
                    attn = getattr(block, attn_attr, None)
                    if attn is None or not hasattr(attn, "processor"):
                        continue
                    name = f"{blocks_attr}.{i}.{attn_attr}"
                    core = getattr(attn, "dsv_core", None)
                    if isinstance(core, SparseAttention):
                        core.config = config
                    else:
                        core = SparseAttention(attn.heads, _head_dim(attn), config=config, name=name)
                        p = next(iter(attn.parameters()), None)
                        if p is not None:
                            core.to(device=p.device)
                        attn.dsv_core = core
                    if grid is not None:
                        core.set_grid(grid)
                    if not isinstance(attn.processor, proc_cls):
                        proc = proc_cls(fallback=attn.processor)
                        if hasattr(attn, "set_processor"):
                            attn.set_processor(proc)
                        else:  # MochiAttention: a plain attribute
                            attn.processor = proc
                    cores.append(core)
                    n += 1
            top._dsv_cores = cores
            top._dsv_grid_reader = reader
            top._dsv_signature = inspect.signature(top.forward)
            if not getattr(top, "_dsv_grid_hook", None):
                top._dsv_grid_hook = top.register_forward_pre_hook(_grid_hook, with_kwargs=True)
    return n
