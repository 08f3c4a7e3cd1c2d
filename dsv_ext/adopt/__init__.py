"""Putting DSV into existing models (layer 4): convert.py (dsv_ext.convert), generic.py
(route_sdpa, nn.MultiheadAttention), diffusers_models.py (diffusers' video transformers) and
pretrained.py (save_pretrained / from_pretrained)."""
