"""Functional cores of DSV attention (layer 2: pure functions over dsv_ext.ops; see attention.py)."""
from .attention import (autocast_inputs, dense_core, estimate_index, joint_sparse_core, kernel_dtype,
                        kernels_available, sparse_core, sparse_supported)

__all__ = ["dense_core", "sparse_core", "joint_sparse_core", "estimate_index", "kernel_dtype",
           "kernels_available", "sparse_supported", "autocast_inputs"]
