"""dsv-ext: DSV sparse attention for video Diffusion Transformer training.

Kernels (C on the CPU, CUDA on the GPU) registered as ``torch.ops.dsv.*``; the public functions
below wrap them with argument checks, fake kernels and autograd. The modules (SparseAttention,
DSVAttention, DenseAttention), the training controller (DSVController), the config (DSVConfig),
``convert`` and the context-parallel package (``dsv_ext.parallel``) are imported on first use.
"""
from importlib import import_module

from . import _compat
from .ops import (
    ProfileResult,
    expand_block_lists,
    gather_rows,
    has_cuda_kernels,
    predictor_loss,
    profile_attention,
    scatter_add_rows,
    sparse_attention,
    topk_estimate,
)

__version__ = "0.1.0"

# name -> module that defines it, imported lazily so `import dsv_ext` stays light
_LAZY = {
    "SparseAttention": "modules.attention",
    "DSVAttention": "modules.attention",
    "DenseAttention": "modules.attention",
    "set_index_refresh": "modules.attention",
    "StepPlan": "modules.contract",
    "ModuleStats": "modules.contract",
    "DSVController": "control.controller",
    "DSVConfig": "config",
    "convert": "adopt.convert",
    "register_layer": "adopt.convert",
    "route_sdpa": "adopt.generic",
    "save_pretrained": "adopt.pretrained",
    "from_pretrained": "adopt.pretrained",
    "build_info": "info",
    "recall_curve": "recall",
    "parallel": None,
    "models": None,
}
# the modules among the names above (None in _LAZY): where they live
_SUBMODULES = {"parallel": "parallel", "models": "app.models"}

__all__ = [
    "sparse_attention", "topk_estimate", "expand_block_lists", "predictor_loss", "profile_attention", "ProfileResult",
    "gather_rows", "scatter_add_rows", "has_cuda_kernels", *_LAZY,
]


_compat.install()  # old module paths (dsv_ext/_compat.py) keep working, with a warning


def __getattr__(name):
    if name in _LAZY:
        module = import_module(f".{_LAZY[name] or _SUBMODULES[name]}", __name__)
        value = module if _LAZY[name] is None else getattr(module, name)
        globals()[name] = value
        return value
    moved = _compat.alias(name)
    if moved is not None:
        return moved
    raise AttributeError(f"module 'dsv_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
