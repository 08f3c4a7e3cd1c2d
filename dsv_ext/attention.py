"""Drop-in DSV attention modules.

PUBLIC API (stable; implementation in progress below)
------------------------------------------------------
class SparseAttention(nn.Module):
    SparseAttention(num_heads: int, head_dim: int, grid: tuple[int,int,int] | None = None,
                    config: DSVConfig | None = None, name: str | None = None)
    forward(q, k, v, grid=None, scale=None) -> out
        q, k, v, out: [B, S, H, D] (same layout as dsv_ext.sparse_attention; D contiguous).
        Replaces `F.scaled_dot_product_attention(q.transpose(1,2), ...).transpose(1,2)`.
        grid: (T, H, W) token grid of the video (T*H*W <= S; extra tokens after the grid keep
        their order); defaults to the grid given at construction / set_grid().
        Without a DSVController it is exactly dense SDPA (stage 1, no predictor work).
    set_grid(grid)                 # (T, H, W) token grid used when forward() gets none
    stage: int                     # 1 (dense) or 2 (sparse); set by the controller
    predictor: LowRankPredictor    # per-head [H, D, r] projections for q and k

class DSVAttention(nn.Module):   # full self-attention layer for new models
    DSVAttention(dim: int, num_heads: int, head_dim: int | None = None, qkv_bias: bool = True,
                 out_bias: bool = True, qk_norm: bool = False, norm_eps: float = 1e-6,
                 rotary: Callable[[q, k], tuple[q, k]] | None = None,
                 grid=None, config: DSVConfig | None = None)
    forward(x: [B, S, dim], grid=None, rotary=None) -> [B, S, dim]
        rotary (arg or constructor): callable (q, k) -> (q, k) on [B, S, H, D] applied after
        the optional QK RMSNorm and before attention.
    .qkv (Linear dim -> 3*H*D), .q_norm/.k_norm (RMSNorm over D or Identity), .proj, .attn_core

class DenseAttention(nn.Module): # plain SDPA core with the same call signature; convert()
    DenseAttention(num_heads, head_dim)   # swaps any `.attn_core` of this type for SparseAttention
    forward(q, k, v, grid=None, scale=None) -> out   # [B, S, H, D]
"""
