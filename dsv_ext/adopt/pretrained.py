"""Save and load DSV-converted diffusers models with their predictors and controller state.

    dsv_ext.save_pretrained(model, path, controller)        # model.save_pretrained(path) + DSV state
    model, controller = dsv_ext.from_pretrained(WanTransformer3DModel, path)

A converted model's predictors are parameters of the model (`....dsv_core.predictor.wq/wk`),
so diffusers' `model.save_pretrained(path)` already writes them into the weights files;
dsv_ext.save_pretrained calls it and adds `dsv.json` (the DSVConfig, the converted layers) and,
given a controller, `dsv_controller.pt` (DSVController.state_dict(): step, stage, sparsity
EMAs, per-block decisions, predictor optimizer). diffusers' own `from_pretrained` drops the
predictor weights (they are not parameters of the unconverted class) with only a warning, so:

  * dsv_ext.from_pretrained(cls, path, ...) loads the model with cls.from_pretrained, converts
    it, loads every predictor from the weights files (ValueError when one is missing) and
    returns it with a DSVController restored from `dsv_controller.pt` (a fresh one, stage 1,
    when the folder has none);
  * dsv_ext.convert() of a model that diffusers loaded from a folder holding DSV predictors
    raises ValueError instead of silently starting from fresh predictors.

Local folders only (download a Hub repository with huggingface_hub.snapshot_download first).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Optional, Tuple

import torch
from torch import nn

from ..modules.attention import SparseAttention
from ..config import DSVConfig
from .saved_state import META, check_not_stripped, loading, read_predictors

__all__ = ["save_pretrained", "from_pretrained", "check_not_stripped"]

CONTROLLER = "dsv_controller.pt"


def save_pretrained(model: nn.Module, path: str, controller=None, **kwargs) -> None:
    """model.save_pretrained(path, **kwargs) (weights include the predictors), then `dsv.json`
    and, with a controller, `dsv_controller.pt` in the same folder."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model: {type(model).__name__} has no save_pretrained (a diffusers ModelMixin is needed; "
                        "use torch.save(model.state_dict()) and DSVController.state_dict() otherwise)")
    cores = [(n, m) for n, m in model.named_modules() if isinstance(m, SparseAttention)]
    if not cores:
        raise ValueError("model: has no DSV attention (call dsv_ext.convert first)")
    if controller is not None and getattr(controller, "model", None) is not model:
        raise ValueError("controller: drives another model than the one being saved")
    model.save_pretrained(path, **kwargs)
    folder = os.fspath(path)
    saved = set(read_predictors(folder))
    want = {f"{n}.predictor.{w}" for n, _ in cores for w in ("wq", "wk")}
    if not want <= saved:
        raise RuntimeError(f"save_pretrained: the weights written to {folder} lack predictors "
                           f"{sorted(want - saved)[:3]}")
    meta = {"format": 1, "config": cores[0][1].config.to_dict(), "layers": [n for n, _ in cores],
            "has_controller": controller is not None}
    with open(os.path.join(folder, META), "w") as fh:
        json.dump(meta, fh, indent=1)
    ctrl_file = os.path.join(folder, CONTROLLER)
    if controller is not None:
        torch.save(controller.state_dict(), ctrl_file)
    elif os.path.exists(ctrl_file):  # a stale state of an earlier save
        os.remove(ctrl_file)


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers warns about the predictor weights it does not know; we load them ourselves."""
    try:
        from diffusers.utils import logging as dlog
    except Exception:  # pragma: no cover
        yield
        return
    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(level)


def from_pretrained(cls, path: str, config: Optional[DSVConfig] = None, grid=None, controller: bool = True,
                    device=None, sdpa_modules=None, **kwargs) -> Tuple[nn.Module, Any]:
    """Load a model saved by dsv_ext.save_pretrained (or by save_pretrained of a converted model):
    cls.from_pretrained(path, **kwargs), dsv_ext.convert, the predictors from the weights files,
    then (controller=True) a DSVController restored from `dsv_controller.pt` if the folder has
    one. Returns (model, controller); controller is None with controller=False.

    config: the DSVConfig (default: the one saved in dsv.json, else DSVConfig()); grid,
    sdpa_modules: as for dsv_ext.convert; device: where the model and the controller's
    optimizer state go (default: where cls.from_pretrained put them).
    Raises ValueError when the folder has no predictors for some converted layer."""
    from ..control.controller import DSVController
    from .convert import convert, sparse_modules
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise TypeError(f"cls: expected a diffusers model class (with from_pretrained), got {cls!r}")
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"path: expected a local folder written by save_pretrained, got {path!r}")
    path = os.fspath(path)
    folder = os.path.join(path, kwargs["subfolder"]) if kwargs.get("subfolder") else path
    meta = None
    if os.path.isfile(os.path.join(folder, META)):
        with open(os.path.join(folder, META)) as fh:
            meta = json.load(fh)
    if config is None:
        config = DSVConfig.from_dict(meta["config"]) if meta is not None else DSVConfig()
    preds = read_predictors(folder)
    if not preds:
        raise ValueError(f"path: {folder} holds no DSV predictors (saved from a model that was not converted? "
                         "then load it with cls.from_pretrained and call dsv_ext.convert)")
    with loading():  # the predictors are loaded below: no stripped-load check
        with _quiet_diffusers():
            model = cls.from_pretrained(path, **kwargs)
        if device is not None:
            model.to(device)
        convert(model, grid=grid, config=config, sdpa_modules=sdpa_modules)
    want = {f"{n}.predictor.{w}": m for n, m in sparse_modules(model) for w in ("wq", "wk")}
    missing = sorted(set(want) - set(preds))
    if missing:
        raise ValueError(f"path: {folder} has no predictor weights for {len(missing)} of the model's DSV "
                         f"tensors, e.g. {missing[:3]} (saved with another conversion or config?)")
    with torch.no_grad():
        for key, m in want.items():
            p = getattr(m.predictor, key.rsplit(".", 1)[1])
            t = preds[key]
            if t.shape != p.shape:
                raise ValueError(f"path: predictor {key} has shape {tuple(t.shape)}, the model expects "
                                 f"{tuple(p.shape)} (rank of the saved DSVConfig differs?)")
            p.copy_(t.to(device=p.device, dtype=p.dtype))
    ctrl = None
    if controller:
        ctrl = DSVController(model, config)
        ctrl_file = os.path.join(folder, CONTROLLER)
        if os.path.isfile(ctrl_file):
            ctrl.load_state_dict(torch.load(ctrl_file, map_location="cpu", weights_only=True))
        else:
            import warnings
            warnings.warn(f"path: {folder} has the predictors but no {CONTROLLER} (saved without a controller): "
                          "the returned DSVController starts in stage 1; pass the controller to "
                          "dsv_ext.save_pretrained to keep the stage, sparsity estimates and step")
    return model, ctrl
