"""Reference models built on dsv-ext (see dsv_ext/app/models/dit.py)."""

from .dit import DiTConfig, VideoDiT, DiTBlock, SelfAttention, dsv_attention_available

__all__ = ["DiTConfig", "VideoDiT", "DiTBlock", "SelfAttention", "dsv_attention_available"]
