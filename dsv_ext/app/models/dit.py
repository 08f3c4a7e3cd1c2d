"""A reference video Diffusion Transformer (DiT) whose self-attention runs through DSV.

Shape of the computation (one training step of flow matching calls ``model(x_t, t)``):

    latents x [B, C, T, H, W]
      -> 3D patch embedding (Conv3d, kernel = stride = patch (pt, ph, pw))  -> tokens [B, S, hidden]
         with S = (T/pt) * (H/ph) * (W/pw), tokens in raster (t, h, w) order
      -> + fixed 3D sin-cos position embedding (model.position: sincos), or none and a 3D
         rotary embedding of q and k in every attention layer instead (position: rope, as Wan)
      -> depth x DiTBlock: adaLN-zero conditioned on the timestep embedding,
           x = x + gate1 * Attn(modulate(LN(x)))     (self-attention over all S tokens)
           x = x + gate2 * MLP(modulate(LN(x)))
      -> final adaLN + linear to pt*ph*pw*C values per token -> unpatchify -> [B, C, T, H, W]

The attention layer is ``dsv_ext.modules.attention.DSVAttention`` when ``attention="dsv"`` (it owns the
low-rank predictors and switches from dense to sparse attention under a ``DSVController``), and
:class:`SelfAttention` (plain ``scaled_dot_product_attention``) when ``attention="dense"``.
Both have the same ``qkv`` / ``proj`` linear layers, and :meth:`VideoDiT.initialize_weights`
initialises the DiT's own weights from a dedicated generator in module order while skipping the
predictors, so a dense and a DSV model built with the same seed start from identical weights.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["DiTConfig", "VideoDiT", "DiTBlock", "SelfAttention", "timestep_embedding",
           "sincos_pos_embed_3d", "Rope3D", "dsv_attention_available"]


def _triple(v) -> Tuple[int, int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v, v)
    if isinstance(v, (str, bytes)) or any(not isinstance(x, int) or isinstance(x, bool) for x in v):
        raise ValueError(f"expected integers (t, h, w), got {v!r}")
    v = tuple(v)
    if len(v) != 3:
        raise ValueError(f"expected 3 values (t, h, w), got {v}")
    return v  # type: ignore[return-value]


@dataclass
class DiTConfig:
    """Model section of a config file.

    ``latent_size`` is the (T, H, W) latent grid the model is built for (the position embedding
    and DSV's token grid follow from it; inputs must match it). ``patch`` is the 3D patch size.
    ``attention`` is ``dsv`` or ``dense``; ``attention_kwargs`` go to DSVAttention unchanged.
    ``position`` is how tokens know where they are: ``sincos`` (a fixed 3D sin-cos embedding
    added to the patch tokens) or ``rope`` (a 3D rotary embedding of q and k in every attention
    layer, the scheme of Wan and HunyuanVideo: scores depend on relative positions).
    """

    in_channels: int = 4
    latent_size: Tuple[int, int, int] = (8, 16, 16)
    patch: Tuple[int, int, int] = (1, 2, 2)
    hidden: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    qk_norm: bool = True
    attention: str = "dsv"
    position: str = "sincos"
    grad_checkpointing: bool = False
    attention_kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        from dsv_ext.config import check_bool, check_choice, check_int, check_number

        for n in ("in_channels", "hidden", "depth", "heads"):
            check_int("model", n, getattr(self, n), 1)
        check_number("model", "mlp_ratio", self.mlp_ratio, 0.0, lo_open=True)
        for n in ("qk_norm", "grad_checkpointing"):
            check_bool("model", n, getattr(self, n))
        check_choice("model", "attention", self.attention, ("dsv", "dense"))
        check_choice("model", "position", self.position, ("sincos", "rope"))
        if not isinstance(self.attention_kwargs, dict):
            raise ValueError(f"model.attention_kwargs: expected a mapping, got {self.attention_kwargs!r}")
        for n in ("latent_size", "patch"):
            try:
                setattr(self, n, _triple(getattr(self, n)))
            except (TypeError, ValueError):
                raise ValueError(f"model.{n}: expected one or three positive integers (t, h, w), "
                                 f"got {getattr(self, n)!r}") from None
            if min(getattr(self, n)) < 1:
                raise ValueError(f"model.{n}: expected positive integers, got {getattr(self, n)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden: {self.hidden} is not divisible by heads={self.heads}")
        if self.position == "rope" and (self.head_dim % 2 or self.head_dim < 6):
            raise ValueError(f"model.position: rope needs an even head dim of at least 6 (hidden / heads), "
                             f"got {self.head_dim}")
        for n, (a, p) in zip("THW", zip(self.latent_size, self.patch)):
            if a % p:
                raise ValueError(f"model.latent_size: {n}={a} is not divisible by patch {p}")

    @property
    def grid(self) -> Tuple[int, int, int]:
        """The token grid (T/pt, H/ph, W/pw)."""
        return tuple(a // p for a, p in zip(self.latent_size, self.patch))  # type: ignore

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DiTConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"model: unknown keys {unknown}; known: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["latent_size"], d["patch"] = list(self.latent_size), list(self.patch)
        return d


try:  # the SDPA call of DSV's stage 1 (cuDNN first on CUDA); plain SDPA without the pack
    from dsv_ext.functional.attention import dense_core as _dense_core
except Exception:  # pragma: no cover
    _dense_core = None
try:  # DSVAttention's QK norm (fused under autocast), so that both layers compute the same
    from dsv_ext.modules.attention import RMSNorm as _RMSNorm
except Exception:  # pragma: no cover
    _RMSNorm = nn.RMSNorm


def dsv_attention_available() -> bool:
    try:
        from dsv_ext.modules.attention import DSVAttention  # noqa: F401
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------

def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of timesteps ``t`` in [0, 1] (scaled by 1000), ``[B] -> [B, dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32,
                                                          device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def sincos_pos_embed_3d(dim: int, grid: Sequence[int]) -> torch.Tensor:
    """Fixed 3D sin-cos position embedding ``[T*H*W, dim]`` in raster (t, h, w) order.

    Each axis gets ``2 * (dim // 6)`` channels (sin and cos of geometric frequencies); leftover
    channels are zero.
    """
    t, h, w = grid
    per = dim // 6
    out = torch.zeros(t, h, w, dim)
    if per == 0:
        return out.reshape(t * h * w, dim)
    omega = 1.0 / (10000 ** (torch.arange(per, dtype=torch.float64) / per))
    coords = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    for a, c in enumerate(coords):
        ang = c.double()[..., None] * omega
        out[..., 2 * per * a:2 * per * a + per] = torch.sin(ang).float()
        out[..., 2 * per * a + per:2 * per * (a + 1)] = torch.cos(ang).float()
    return out.reshape(t * h * w, dim)


def rope_3d_tables(head_dim: int, grid: Sequence[int], theta: float = 10000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T*H*W, head_dim // 2]`` (float32, raster (t, h, w) order) of the 3D rotary
    embedding: the head dim's pairs of channels (2i, 2i + 1) go to the axes as in Wan (h and w
    2 * (head_dim // 6) channels each, t the rest) and pair j of an axis with n channels turns by
    position * theta ** (-2 j / n)."""
    per = 2 * (head_dim // 6)
    coords = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in grid), indexing="ij")
    ang = []
    for c, n in zip(coords, (head_dim - 2 * per, per, per)):
        freq = theta ** (-torch.arange(0, n, 2, dtype=torch.float64) / n)
        ang.append(c.reshape(-1, 1) * freq)
    a = torch.cat(ang, 1)
    return torch.cos(a).float(), torch.sin(a).float()


def _turn(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with each pair (2i, 2i + 1) taken as a complex number and multiplied by f
    ([S, D / 2], complex): in float32 at least, returned in x's dtype."""
    wd = torch.promote_types(x.dtype, torch.float32)
    z = torch.view_as_complex(x.to(wd).reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * f[:, None]).flatten(-2).to(x.dtype)


class _Rotate(torch.autograd.Function):
    """The rotary turn of x by the unit complex numbers f, whose gradient is the turn back by
    their conjugates: three element-wise kernels each way (cast, complex product, cast) where
    the same arithmetic on real pairs records about three times as many for autograd."""

    @staticmethod
    def forward(ctx, x, f):
        ctx.save_for_backward(f)
        return _turn(x, f)

    @staticmethod
    def backward(ctx, g):
        (f,) = ctx.saved_tensors
        return _turn(g, f.conj()), None


class Rope3D(nn.Module):
    """The 3D rotary embedding of q and k (``model.position: rope``): ``rope(q, k) -> (q, k)`` on
    ``[B, S, H, D]`` tokens of ``grid`` in raster order (the rotary hook of DSVAttention), so
    that q . k depends on the two tokens' positions only through their difference.
    ``index`` (a LongTensor of S positions) rotates tokens taken from those raster positions
    (a context-parallel shard in cube order)."""

    def __init__(self, head_dim: int, grid: Sequence[int], theta: float = 10000.0):
        super().__init__()
        # the turns as complex64 (float32 angles) kept out of the module's buffers: a model cast
        # to bf16 / fp16 keeps exact angles (they follow the inputs' device on first use)
        self.freqs = torch.complex(*rope_3d_tables(head_dim, grid, theta))

    def forward(self, q: torch.Tensor, k: torch.Tensor, index: Optional[torch.Tensor] = None):
        if self.freqs.device != q.device:
            self.freqs = self.freqs.to(q.device)
        f = self.freqs if index is None else self.freqs[index]
        if q.shape[1] != f.shape[0]:
            raise ValueError(f"q: expected {f.shape[0]} tokens for the rotary embedding, got {q.shape[1]}")
        return _Rotate.apply(q, f), _Rotate.apply(k, f)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.freq_dim).to(self.mlp[0].weight.dtype))


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    """Plain full self-attention (``F.scaled_dot_product_attention``): the dense baseline.

    ``[B, S, hidden] -> [B, S, hidden]``; the same ``qkv`` / ``proj`` layers (and optional
    per-head RMS QK-norm) as DSVAttention so the two start from identical weights. On CUDA it
    calls SDPA exactly as DSV's stage 1 does (``dsv_ext.functional.attention.dense_core``: cuDNN first in
    the backend priority), so the baseline is the fastest dense kernel available.
    """

    def __init__(self, hidden: int, heads: int, qk_norm: bool = True, grid=None, **_: Any):
        super().__init__()
        self.hidden, self.heads, self.head_dim = hidden, heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.q_norm = _RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = _RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:  # (q, k) -> (q, k), after the QK norm as in DSVAttention
            q, k = rotary(q, k)
        if q.is_cuda and _dense_core is not None:
            o = _dense_core(q, k, v, None, "auto")  # [B, S, H, D]
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2)).transpose(1, 2)
        return self.proj(o.reshape(b, s, self.hidden))


def _to_dsv_attention(layer: SelfAttention, grid, config) -> nn.Module:
    """dsv_ext.convert of a dense layer: a DSVAttention taking over its submodules (same weights,
    same state_dict keys plus the predictor's)."""
    from dsv_ext.modules.attention import DSVAttention

    return DSVAttention.from_modules(layer.qkv, layer.proj, layer.heads, layer.head_dim, layer.q_norm,
                                     layer.k_norm, grid=grid, config=config)


try:  # the library converts this layer through its public registry (it never imports the app)
    from dsv_ext.adopt.convert import register_layer
except Exception:  # pragma: no cover  (the drop-in modules are not importable: not built yet?)
    pass
else:
    register_layer(SelfAttention, _to_dsv_attention)


def _make_attention(cfg: DiTConfig, dsv_config=None) -> nn.Module:
    if cfg.attention == "dense":
        return SelfAttention(cfg.hidden, cfg.heads, qk_norm=cfg.qk_norm)
    try:
        from dsv_ext.modules.attention import DSVAttention
    except Exception as e:  # the drop-in module is not importable (not built yet?)
        warnings.warn(f"dsv_ext.modules.attention.DSVAttention is not importable ({e}); "
                      "falling back to dense SelfAttention")
        return SelfAttention(cfg.hidden, cfg.heads, qk_norm=cfg.qk_norm)
    kw = dict(cfg.attention_kwargs)
    kw.setdefault("qk_norm", cfg.qk_norm)
    if dsv_config is not None:
        kw["config"] = dsv_config
    return DSVAttention(cfg.hidden, cfg.heads, grid=cfg.grid, **kw)


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------

def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class Mlp(nn.Module):
    def __init__(self, hidden: int, ratio: float):
        super().__init__()
        inner = int(hidden * ratio)
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN-zero transformer block: self-attention and MLP, gated by the conditioning."""

    def __init__(self, cfg: DiTConfig, dsv_config=None):
        super().__init__()
        h = cfg.hidden
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.attn = _make_attention(cfg, dsv_config)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(h, cfg.mlp_ratio)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(h, 6 * h))

    def forward(self, x: torch.Tensor, c: torch.Tensor, rotary=None) -> torch.Tensor:
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(c).chunk(6, dim=-1)
        h = modulate(self.norm1(x), sh1, sc1)
        x = x + g1[:, None] * (self.attn(h) if rotary is None else self.attn(h, rotary=rotary))
        x = x + g2[:, None] * self.mlp(modulate(self.norm2(x), sh2, sc2))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out)

    def forward(self, x, c):
        shift, scale = self.ada(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class VideoDiT(nn.Module):
    """The reference video DiT. ``forward(x [B, C, T, H, W], t [B] in [0, 1]) -> [B, C, T, H, W]``
    (the flow-matching velocity). ``seed`` drives :meth:`initialize_weights`; ``dsv_config``
    (a ``DSVConfig``) is handed to every DSVAttention layer."""

    def __init__(self, cfg: DiTConfig, seed: int = 0, dsv_config=None):
        super().__init__()
        self.cfg = cfg
        c, h = cfg.in_channels, cfg.hidden
        self.patch_embed = nn.Conv3d(c, h, kernel_size=cfg.patch, stride=cfg.patch)
        sincos = cfg.position == "sincos"
        self.register_buffer("pos_embed", sincos_pos_embed_3d(h, cfg.grid) if sincos else None, persistent=False)
        self.rope = None if sincos else Rope3D(cfg.head_dim, cfg.grid)
        self.t_embed = TimestepEmbedder(h)
        self.blocks = nn.ModuleList([DiTBlock(cfg, dsv_config) for _ in range(cfg.depth)])
        pt, ph, pw = cfg.patch
        self.final = FinalLayer(h, pt * ph * pw * c)
        self.grad_checkpointing = cfg.grad_checkpointing
        self._cp = None  # context parallelism: (group, cube) or None
        self.initialize_weights(seed)

    def set_context_parallel(self, enabled: bool, group=None, cube: Sequence[int] = (4, 4, 4)) -> None:
        """Split each sequence over the ranks of ``group`` (default: the world). Every rank passes
        the same ``x`` and ``t`` and gets the whole output; in between the tokens are put in
        ``cube`` order once (use the DSV config's cube), each rank runs the blocks on its
        contiguous shard and the final layer's output is all-gathered
        (:func:`dsv_ext.parallel.gather_sequence`). Apply :func:`dsv_ext.parallel.enable` to the
        model too (its DSV attention then works on shards), and sum the DiT parameters' gradients
        over the group after ``backward`` (each rank holds its shard's part). ``dsv_ext.app.train
        --context-parallel`` does all of this."""
        self._cp = (group, tuple(int(c) for c in cube)) if enabled else None

    # -- init -----------------------------------------------------------------------------------
    def _own_modules(self):
        """(name, module) of the DiT's own layers in order, skipping DSV predictor internals."""
        skip = set()
        try:
            from dsv_ext.modules.attention import SparseAttention  # type: ignore
        except Exception:
            SparseAttention = None
        for name, m in self.named_modules():
            if SparseAttention is not None and isinstance(m, SparseAttention):
                skip.add(name)
        for name, m in self.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skip):
                continue
            if "predictor" in name.split(".")[-1] or ".predictor" in name:
                continue
            yield name, m

    @torch.no_grad()
    def initialize_weights(self, seed: int = 0) -> None:
        """DiT initialisation from a private generator (independent of the global RNG and of the
        predictors' parameters): xavier-uniform linears, zero biases, N(0, 0.02) timestep MLP,
        zero adaLN modulation and zero output layer (adaLN-zero)."""
        g = torch.Generator()
        g.manual_seed(int(seed))
        for name, m in self._own_modules():
            if isinstance(m, nn.Linear):
                w = torch.empty(m.weight.shape, dtype=torch.float32)
                if name.startswith("t_embed"):
                    w.normal_(0.0, 0.02, generator=g)
                else:
                    nn.init.xavier_uniform_(w, generator=g)
                m.weight.copy_(w)
                if m.bias is not None:
                    m.bias.zero_()
        w = torch.empty(self.patch_embed.weight.shape, dtype=torch.float32)
        nn.init.xavier_uniform_(w.view(w.shape[0], -1), generator=g)
        self.patch_embed.weight.copy_(w)
        self.patch_embed.bias.zero_()
        for blk in self.blocks:
            blk.ada[-1].weight.zero_()
            blk.ada[-1].bias.zero_()
        self.final.ada[-1].weight.zero_()
        self.final.ada[-1].bias.zero_()
        self.final.linear.weight.zero_()
        self.final.linear.bias.zero_()

    # -- forward --------------------------------------------------------------------------------
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, S, hidden], raster order

    def unpatchify(self, y: torch.Tensor) -> torch.Tensor:
        b = y.shape[0]
        t, h, w = self.cfg.grid
        pt, ph, pw = self.cfg.patch
        c = self.cfg.in_channels
        y = y.view(b, t, h, w, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return y.reshape(b, c, t * pt, h * ph, w * pw)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or tuple(x.shape[1:]) != (self.cfg.in_channels, *self.cfg.latent_size):
            raise ValueError(f"x: expected [B, {self.cfg.in_channels}, "
                             f"{', '.join(map(str, self.cfg.latent_size))}], got {tuple(x.shape)}")
        if t.dim() != 1 or t.shape[0] != x.shape[0]:
            raise ValueError(f"t: expected shape [{x.shape[0]}], got {tuple(t.shape)}")
        tok = self.patchify(x)
        if self.pos_embed is not None:
            tok = tok + self.pos_embed.to(x.dtype)
        c = self.t_embed(t)
        inv = None
        rot = self.rope
        if self._cp is not None:
            from dsv_ext.grouping import cube_permutation
            from dsv_ext.parallel.comm import group_size_rank

            n, p = group_size_rank(self._cp[0])
            S = tok.shape[1]
            if S % n:
                raise ValueError(f"context parallelism: {S} tokens do not split over {n} ranks")
            perm, inv = cube_permutation(self.cfg.grid, self._cp[1], S, tok.device)
            L = S // n
            shard = perm[p * L:(p + 1) * L]
            tok = tok.index_select(1, shard)  # this rank's shard, cube order
            if rot is not None:
                rot = functools.partial(self.rope, index=shard)
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                tok = checkpoint(blk, tok, c, rot, use_reentrant=False)
            else:
                tok = blk(tok, c, rot)
        y = self.final(tok, c)
        if inv is not None:
            from dsv_ext.parallel.module import gather_sequence

            y = gather_sequence(y, self._cp[0]).index_select(1, inv)
        return self.unpatchify(y)

    def dit_parameters(self):
        """Parameters trained by the DiT optimizer (everything except DSV predictors)."""
        pred = set()
        for name, m in self.named_modules():
            if hasattr(m, "predictor_parameters") and callable(m.predictor_parameters):
                pred.update(id(p) for p in m.predictor_parameters())
        return [p for n, p in self.named_parameters() if id(p) not in pred
                and "predictor" not in n]
