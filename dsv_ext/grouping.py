"""3D cube reordering of a (T, H, W) video token grid (query grouping of DSV).

Tokens of a video DiT are usually in raster order (t, h, w). DSV groups G consecutive queries
to share one critical-KV list; grouping works best when consecutive queries are spatially close,
so tokens are first reordered so that each small 3D cube (default 4x4x4, DSVConfig.cube) is
contiguous.

Order produced by `cube_permutation(grid, cube)`: cubes are enumerated in raster order of the
cube grid (ceil(T/ct), ceil(H/ch), ceil(W/cw)); inside a cube, tokens in raster order. Grids not
divisible by the cube get smaller edge cubes (only existing tokens are listed, no padding).
Sequences longer than the grid (S > T*H*W, e.g. extra register/text tokens appended after the
video tokens) keep the extra tokens at the end, in their order.

    perm, inv = cube_permutation((T, H, W), (4, 4, 4), seq_len=S, device=x.device)
    x_cube = x.index_select(1, perm)           # x_cube[:, i] = x[:, perm[i]]
    x_back = x_cube.index_select(1, inv)       # == x

perm / inv are int64 tensors cached per (grid, cube, seq_len, device).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["cube_permutation", "reorder", "restore", "check_grid", "clear_cache"]

_CACHE: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
_CACHE_MAX = 64


def check_grid(grid: Optional[Sequence[int]], seq_len: Optional[int] = None,
               name: str = "grid") -> Tuple[int, int, int]:
    """Validate a (T, H, W) grid (and that it fits the sequence); returns it as a tuple of ints."""
    if grid is None:
        raise ValueError(f"{name}: a (T, H, W) token grid is required (pass grid=... or call set_grid)")
    try:
        vals = tuple(grid)
        g = tuple(int(x) for x in vals)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a sequence of three ints (T, H, W), got {grid!r}") from None
    if len(g) != 3 or any(x < 1 for x in g) or any(a != b for a, b in zip(g, vals)):  # no truncation
        raise ValueError(f"{name}: expected three positive ints (T, H, W), got {grid!r}")
    if seq_len is not None and g[0] * g[1] * g[2] > seq_len:
        raise ValueError(
            f"{name}: grid {g} has {g[0] * g[1] * g[2]} tokens, more than the sequence length {seq_len}")
    return g  # type: ignore[return-value]


def _build(grid: Tuple[int, int, int], cube: Tuple[int, int, int], seq_len: int) -> torch.Tensor:
    T, H, W = grid
    ct, ch, cw = (min(c, g) for c, g in zip(cube, grid))
    t = torch.arange(T).view(T, 1, 1).expand(T, H, W)
    h = torch.arange(H).view(1, H, 1).expand(T, H, W)
    w = torch.arange(W).view(1, 1, W).expand(T, H, W)
    nch, ncw = -(-H // ch), -(-W // cw)
    cube_id = ((t // ct) * nch + (h // ch)) * ncw + (w // cw)
    # inside a cube: raster order of the local coordinates; the edge cubes are smaller, which
    # does not matter for a stable sort on (cube_id, local raster).
    local = ((t % ct) * ch + (h % ch)) * cw + (w % cw)
    key = (cube_id * (ct * ch * cw) + local).reshape(-1)
    perm = torch.argsort(key, stable=True)
    n = T * H * W
    if seq_len > n:
        perm = torch.cat([perm, torch.arange(n, seq_len)])
    return perm


def cube_permutation(grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), seq_len: Optional[int] = None,
                     device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(perm, inv) int64 [S]: x.index_select(1, perm) puts each cube contiguous; inv undoes it."""
    g = check_grid(grid, seq_len)
    c = tuple(int(x) for x in cube)
    if len(c) != 3 or any(x < 1 for x in c):
        raise ValueError(f"cube: expected three positive ints, got {cube!r}")
    S = int(seq_len) if seq_len is not None else g[0] * g[1] * g[2]
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (g, c, S, str(dev))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    perm = _build(g, c, S)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(S)
    out = (perm.to(dev), inv.to(dev))
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = out
    return out


def clear_cache() -> None:
    _CACHE.clear()


def reorder(x: torch.Tensor, perm: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Tokens of x (along dim) into cube order."""
    return x.index_select(dim, perm)


def restore(x: torch.Tensor, inv: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Tokens of x (along dim) back from cube order."""
    return x.index_select(dim, inv)
