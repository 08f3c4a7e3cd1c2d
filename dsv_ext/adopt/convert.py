"""dsv_ext.convert: put DSV attention into an existing model, in place.

    model = dsv_ext.convert(model, grid=(T, H, W))        # after loading pretrained weights

Handled (self-attention only; cross-attention is left alone):
  1. Any module with an `attn_core` attribute (the hook for new models). If it is already a
     SparseAttention (e.g. inside DSVAttention) its grid/config are updated; otherwise the core
     must be a module called as `core(q, k, v, ...)` on [B, S, H, D] tensors (such as
     dsv_ext.DenseAttention) and must expose `num_heads` and `head_dim` (on the core
     or on its parent); it is replaced by a SparseAttention.
  2. Layer classes registered with `register_layer(cls, replace)`: every module of exactly that
     class is replaced by `replace(layer, grid, config)`. The reference DiT's dense layer
     (dsv_ext.app.models.dit.SelfAttention) registers itself this way: it becomes a DSVAttention
     that takes over its qkv / q_norm / k_norm / proj submodules, so the DiT's state_dict keys stay
     the same (plus `attn_core.predictor.*`).
  3. diffusers' WanTransformer3DModel, WanVACETransformer3DModel (its VACE blocks too) and
     SkyReelsV2Transformer3DModel (any WanAttention / SkyReelsV2Attention with
     is_cross_attention False): its processor becomes
     DSVWanAttnProcessor, which calls a SparseAttention registered on the attention module as
     `attn.dsv_core`. The token grid is read from each forward's input
     (latent frames/height/width divided by the patch size) by a forward pre-hook on the
     transformer, so `grid` is optional there.

  4. diffusers' LTX-Video, CogVideoX, HunyuanVideo, Mochi, Allegro and Cosmos transformers (see
     dsv_ext.adopt.diffusers_models): their attention processors are replaced; joint text+video
     attention keeps the text tokens dense; the grid is read from each forward's input.
  5. torch.nn.MultiheadAttention (self-attention calls; see dsv_ext.adopt.generic).
  6. sdpa_modules=(SomeClass, ...): every instance of these classes gets its SDPA
     self-attention calls routed to DSV (dsv_ext.route_sdpa); heads and head_dim are
     read from its `num_heads`/`heads`/`n_heads` and `head_dim` attributes (or dim // heads).

The model's forward does not change otherwise. Returns the model. Each SparseAttention gets a
name (its module path) and the given config (one DSVConfig object shared by all).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..modules.attention import DSVAttention, SparseAttention
from ..config import DSVConfig
from ..grouping import check_grid
from ..modules.predictor import LowRankPredictor

__all__ = ["convert", "register_layer", "DSVWanAttnProcessor", "sparse_modules"]


def sparse_modules(model: nn.Module) -> List[Tuple[str, SparseAttention]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseAttention)]


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent = model
    parts = name.split(".")
    for p in parts[:-1]:
        parent = getattr(parent, p)
    setattr(parent, parts[-1], new)


def _int_attr(*objs, names=("num_heads", "heads", "head_dim")) -> Optional[int]:
    for o in objs:
        for n in names:
            v = getattr(o, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _like(core: SparseAttention, ref: nn.Module) -> SparseAttention:
    """Move a fresh SparseAttention to the device of ref's parameters."""
    p = next(iter(ref.parameters()), None) if ref is not None else None
    if p is not None:
        core.to(device=p.device)
    return core


# ------------------------------------------------------------------------------------------------
# diffusers Wan

def _wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # same arithmetic as diffusers' WanAttnProcessor (interleaved pairs)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class DSVWanAttnProcessor:
    """Attention processor for diffusers' WanAttention (self-attention) calling `attn.dsv_core`.

    Anything this processor does not handle (cross-attention, an attention mask, added image
    K/V) goes to the processor it replaced."""

    def __init__(self, fallback: Optional[Callable] = None):
        self.fallback = fallback

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, rotary_emb=None, **kwargs: Any) -> torch.Tensor:
        core = getattr(attn, "dsv_core", None)
        if (core is None or encoder_hidden_states is not None or attention_mask is not None
                or getattr(attn, "add_k_proj", None) is not None or kwargs):
            if self.fallback is None:
                raise ValueError("attn: DSVWanAttnProcessor handles plain self-attention only")
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _wan_rotary(query, *rotary_emb)
            key = _wan_rotary(key, *rotary_emb)
        out = core(query, key, value)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        return out


def _wan_grid_hook(module, args, kwargs):
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    pt, ph, pw = module.config.patch_size
    grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
    for core in module._dsv_cores:
        if core.grid != grid:
            core.set_grid(grid)
    return None


# Wan and the models built on its attention (same processor arithmetic): (module, transformer,
# attention class)
_WAN_LIKE = [("diffusers.models.transformers.transformer_wan", "WanTransformer3DModel", "WanAttention"),
             ("diffusers.models.transformers.transformer_wan_vace", "WanVACETransformer3DModel", "WanAttention"),
             ("diffusers.models.transformers.transformer_skyreels_v2", "SkyReelsV2Transformer3DModel",
              "SkyReelsV2Attention")]


def _convert_wan(model: nn.Module, grid, config: DSVConfig) -> int:
    import importlib
    n = 0
    for mod_name, top_name, attn_name in _WAN_LIKE:
        try:
            mod = importlib.import_module(mod_name)
            top_cls, attn_cls = getattr(mod, top_name), getattr(mod, attn_name)
        except Exception:  # diffusers not installed, or no such model in this version
            continue
        n += _convert_wan_like(model, grid, config, top_cls, attn_cls)
    return n


def _convert_wan_like(model: nn.Module, grid, config: DSVConfig, top_cls: type, attn_cls: type) -> int:
    n = 0
    for top in [m for m in model.modules() if isinstance(m, top_cls)]:
        cores = []
        for name, attn in top.named_modules():
            if not isinstance(attn, attn_cls) or attn.is_cross_attention:
                continue
            if getattr(attn, "added_kv_proj_dim", None) is not None:
                continue
            if isinstance(getattr(attn, "dsv_core", None), SparseAttention):
                core = attn.dsv_core
                core.config = config
                if grid is not None:
                    core.set_grid(grid)
            else:
                head_dim = attn.inner_dim // attn.heads
                core = _like(SparseAttention(attn.heads, head_dim, grid=grid, config=config, name=name), attn)
                attn.dsv_core = core
            old = attn.processor
            if not isinstance(old, DSVWanAttnProcessor):
                attn.set_processor(DSVWanAttnProcessor(fallback=old))
            cores.append(core)
            n += 1
        top._dsv_cores = cores
        if not getattr(top, "_dsv_grid_hook", None):
            top._dsv_grid_hook = top.register_forward_pre_hook(_wan_grid_hook, with_kwargs=True)
    return n


# ------------------------------------------------------------------------------------------------

# dense attention layer class -> replace(layer, grid, config) returning the module put in its place
_LAYERS: Dict[type, Callable[[nn.Module, Optional[Tuple[int, int, int]], DSVConfig], nn.Module]] = {}


def register_layer(cls: type, replace: Callable[[nn.Module, Optional[Tuple[int, int, int]], DSVConfig],
                                                nn.Module]) -> None:
    """Teach :func:`convert` a dense self-attention layer class of your own model.

    Every module whose type is exactly ``cls`` is replaced by ``replace(layer, grid, config)``
    (``grid``: the (T, H, W) token grid or None; ``config``: the DSVConfig of the conversion),
    typically a :class:`DSVAttention` built with ``DSVAttention.from_modules`` from the layer's own
    projections so the state_dict keys stay. Registering a class again replaces its function."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"cls: expected an nn.Module subclass, got {cls!r}")
    if not callable(replace):
        raise TypeError(f"replace: expected a function (layer, grid, config) -> nn.Module, got {replace!r}")
    _LAYERS[cls] = replace


def _route_sdpa_modules(model: nn.Module, classes, grid, config: DSVConfig) -> int:
    from .generic import route_sdpa
    if isinstance(classes, type):
        classes = (classes,)
    try:
        classes = tuple(classes)
    except TypeError:
        raise TypeError(f"sdpa_modules: expected a class or a sequence of classes, got {classes!r}") from None
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"sdpa_modules: expected nn.Module subclasses, got {classes!r}")
    n = 0
    for name, m in list(model.named_modules()):
        if not isinstance(m, classes):
            continue
        H = _int_attr(m, names=("num_heads", "heads", "n_heads", "n_head"))
        D = _int_attr(m, names=("head_dim",))
        if H is not None and D is None:
            dim = _int_attr(m, names=("dim", "embed_dim", "hidden_size", "inner_dim"))
            D = dim // H if dim is not None and dim % H == 0 else None
        if H is None or D is None:
            raise ValueError(f"sdpa_modules: {name or 'model'} ({type(m).__name__}) needs `num_heads` (or `heads`) "
                             "and `head_dim` (or `dim`) attributes; call dsv_ext.route_sdpa(module, "
                             "num_heads, head_dim) on it instead")
        route_sdpa(m, H, D, grid=grid, config=config, name=name)
        n += 1
    return n


def convert(model: nn.Module, grid: Optional[Sequence[int]] = None, config: Optional[DSVConfig] = None,
            *, sdpa_modules=None, verbose: bool = False) -> nn.Module:
    """Replace the self-attention of `model` by DSV attention in place and return the model.

    grid: (T, H, W) token grid (after patchifying) of the video; default: `model.cfg.grid` when
    the model has one (the reference DiT), per-forward detection for Wan, else None (no cube
    reordering until set). config: a DSVConfig (default DSVConfig()) shared by all blocks.
    sdpa_modules: module classes whose SDPA calls are routed to DSV (see the module doc).
    Raises ValueError when nothing convertible is found, and when the model was loaded by
    diffusers' from_pretrained from a folder holding DSV predictors (they were dropped: load
    with dsv_ext.from_pretrained instead)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    from .saved_state import check_not_stripped
    check_not_stripped(model)
    if config is None:
        config = DSVConfig()
    elif isinstance(config, (str, dict)):
        config = DSVConfig.from_yaml(config) if isinstance(config, str) else DSVConfig.from_dict(config)
    elif not isinstance(config, DSVConfig):
        raise TypeError(f"config: expected a DSVConfig, got {type(config).__name__}")
    if grid is None:
        g = getattr(getattr(model, "cfg", None), "grid", None)
        grid = tuple(g) if g is not None else None
    if grid is not None:
        grid = check_grid(grid)

    n = 0
    # 2. registered layer classes (the reference DiT's SelfAttention) -> their replacement
    for name, m in list(model.named_modules()):
        replace = _LAYERS.get(type(m))
        if replace is None:
            continue
        if name == "":
            raise ValueError("model: is itself an attention layer; wrap it in a container module")
        new = replace(m, grid, config)
        if not isinstance(new, nn.Module):
            raise TypeError(f"register_layer: the function for {type(m).__name__} returned "
                            f"{type(new).__name__}, not an nn.Module")
        new.train(m.training)
        _set_child(model, name, new)
        n += 1
    # 1. the attn_core hook
    for name, m in list(model.named_modules()):
        core = getattr(m, "attn_core", None)
        if core is None or not isinstance(core, nn.Module):
            continue
        if isinstance(core, SparseAttention):
            core.config = config
            if grid is not None:
                core.set_grid(grid)
        else:
            H = _int_attr(core, m, names=("num_heads", "heads"))
            D = _int_attr(core, m, names=("head_dim",))
            if H is None or D is None:
                raise ValueError(f"model: {name or 'model'}.attn_core ({type(core).__name__}) needs "
                                 "`num_heads` and `head_dim` attributes (on the core or its parent)")
            m.attn_core = _like(SparseAttention(H, D, grid=grid, config=config), m)
        n += 1
    # 3. diffusers Wan, Wan VACE, SkyReels-V2
    n += _convert_wan(model, grid, config)
    # 4. diffusers LTX-Video, CogVideoX, HunyuanVideo, Mochi, Allegro, Cosmos
    from .diffusers_models import convert_diffusers_video
    n += convert_diffusers_video(model, grid, config)
    # 5. nn.MultiheadAttention, 6. modules calling SDPA
    from .generic import convert_mha
    n += convert_mha(model, grid, config)
    if sdpa_modules is not None:
        n += _route_sdpa_modules(model, sdpa_modules, grid, config)
    if n == 0:
        raise ValueError(f"model: no convertible attention found in {type(model).__name__} "
                         "(expected `.attn_core` modules, the reference DiT, a diffusers Wan, Wan VACE, "
                         "SkyReels-V2, LTX-Video, CogVideoX, HunyuanVideo, Mochi, Allegro or Cosmos transformer, "
                         "nn.MultiheadAttention, or pass sdpa_modules=(YourAttentionClass,))")
    for name, m in sparse_modules(model):
        m.name = name
        m.config = config
        if m.predictor.rank != config.rank:  # an existing core built with another config
            w = m.predictor.wq
            m.predictor = LowRankPredictor(m.num_heads, m.head_dim, config.rank, device=w.device, dtype=w.dtype)
    if verbose:
        print(f"dsv_ext.convert: {n} attention layer(s) converted")
    return model


class _CallableModule(type(__import__("sys"))):
    """`import dsv_ext.convert` (the old path of this module) binds the name `convert` of the
    package to this module (shadowing the function the package exports lazily); making the module callable keeps
    `dsv_ext.convert(model, ...)` working in either import order."""

    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
