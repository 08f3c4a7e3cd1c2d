"""What a folder written by dsv_ext.save_pretrained holds, and the check that a model loaded from
one kept its DSV state.

diffusers' ``from_pretrained`` drops the predictor weights of a converted model (they are not
parameters of the unconverted class); :func:`check_not_stripped` (run by ``dsv_ext.convert``)
raises ValueError for such a model instead of letting it start from fresh predictors.
``dsv_ext.from_pretrained`` loads inside :func:`loading` (it restores the predictors itself).
Both ``convert`` and ``pretrained`` import this module; it imports neither.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
from typing import Any, Dict, Iterator, List

import torch
from torch import nn

from ..modules.attention import SparseAttention

__all__ = ["META", "read_predictors", "holds_dsv_state", "check_not_stripped", "loading"]

META = "dsv.json"
_local = threading.local()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """While active (in this thread), :func:`check_not_stripped` passes: the caller restores the
    predictors itself (dsv_ext.from_pretrained)."""
    before = getattr(_local, "loading", False)
    _local.loading = True
    try:
        yield
    finally:
        _local.loading = before


def _predictor_key(k: str) -> bool:
    return k.endswith(".predictor.wq") or k.endswith(".predictor.wk")


def weight_files(folder: str) -> List[str]:
    """The weights files (``*.safetensors``, ``*.bin``) of ``folder``, sorted."""
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")) + glob.glob(os.path.join(folder, "*.bin")))


def read_predictors(folder: str, keys_only: bool = False) -> Dict[str, Any]:
    """Predictor tensors (or just their names: safetensors headers only) in the weights files of
    `folder`."""
    out: Dict[str, Any] = {}
    for f in weight_files(folder):
        if f.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(f, framework="pt") as sf:
                for k in sf.keys():
                    if _predictor_key(k):
                        out[k] = None if keys_only else sf.get_tensor(k)
        elif not keys_only:  # pickled weights: no cheap way to list the names
            sd = torch.load(f, map_location="cpu", weights_only=True)
            out.update({k: v for k, v in sd.items() if _predictor_key(k)})
    return out


def holds_dsv_state(folder: str) -> bool:
    """Whether ``folder`` holds DSV state (a ``dsv.json`` or predictor weights)."""
    if os.path.isfile(os.path.join(folder, META)):
        return True
    try:
        return bool(read_predictors(folder, keys_only=True))
    except Exception:  # unreadable weights: not ours to judge here
        return False


def check_not_stripped(model: nn.Module) -> None:
    """ValueError when `model` (not yet converted) was loaded by diffusers from a folder that holds
    DSV predictors: diffusers dropped them, and converting would start from fresh predictors."""
    if getattr(_local, "loading", False):
        return
    if any(isinstance(m, SparseAttention) for m in model.modules()):
        return
    for m in model.modules():
        cfg = getattr(m, "config", None)
        root = cfg.get("_name_or_path") if isinstance(cfg, dict) else None
        if not isinstance(root, str) or not os.path.isdir(root):
            continue
        folders = [root] + [d for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d)]
        for folder in folders:
            if folder != root:  # a pipeline's subfolder: only the one of this model's class
                try:
                    with open(os.path.join(folder, "config.json")) as fh:
                        if json.load(fh).get("_class_name") != type(m).__name__:
                            continue
                except (OSError, ValueError):
                    continue
            if holds_dsv_state(folder):
                sub = "" if folder == root else f", subfolder={os.path.basename(folder)!r}"
                raise ValueError(
                    f"model: {type(m).__name__} was loaded from {folder}, which holds DSV predictors that "
                    f"{type(m).__name__}.from_pretrained dropped; load it with "
                    f"dsv_ext.from_pretrained({type(m).__name__}, {root!r}{sub}) to keep them")
