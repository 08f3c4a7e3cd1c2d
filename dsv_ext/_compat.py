"""Old module paths that still work, with a DeprecationWarning.

``MOVED`` maps an old dotted module name to the module that now holds its code. ``import
dsv_ext.train``, ``from dsv_ext.attention import SparseAttention`` and ``python -m dsv_ext.train``
all keep working: the import returns the new module itself (same classes and functions), and
``python -m`` runs the new module as the program. The finder sits first on ``sys.meta_path`` and
answers only for the names in ``MOVED``: an old submodule of a moved package
(``dsv_ext.models.dit``) must not be found as a file in the new package's folder by the path
finder, which would load a second copy of the module under the old name.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Dict

# old module -> new module (add one line per moved module)
MOVED: Dict[str, str] = {
    "dsv_ext.attention": "dsv_ext.modules.attention",
    "dsv_ext.predictor": "dsv_ext.modules.predictor",
    "dsv_ext.controller": "dsv_ext.control.controller",
    "dsv_ext.dispatch": "dsv_ext.control.dispatch",
    "dsv_ext.convert": "dsv_ext.adopt.convert",
    "dsv_ext.generic": "dsv_ext.adopt.generic",
    "dsv_ext.diffusers_models": "dsv_ext.adopt.diffusers_models",
    "dsv_ext.pretrained": "dsv_ext.adopt.pretrained",
    "dsv_ext.train": "dsv_ext.app.train",
    "dsv_ext.compare": "dsv_ext.app.compare",
    "dsv_ext.sample": "dsv_ext.app.sample",
    "dsv_ext.evaluate": "dsv_ext.app.evaluate",
    "dsv_ext.seeds": "dsv_ext.app.seeds",
    "dsv_ext.data": "dsv_ext.app.data",
    "dsv_ext.checkpoint": "dsv_ext.app.checkpoint",
    "dsv_ext.cli": "dsv_ext.app.cli",
    "dsv_ext.models": "dsv_ext.app.models",
    "dsv_ext.models.dit": "dsv_ext.app.models.dit",
}


def _message(old: str, new: str, run: bool = False) -> str:
    if run:
        return f"python -m {old} is deprecated; use python -m {new}"
    return f"module {old} is deprecated; import {new} instead"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        return None  # the default module; exec_module swaps in the new one

    def exec_module(self, module) -> None:
        warnings.warn(_message(self.old, self.new), DeprecationWarning, stacklevel=2)
        # importlib returns sys.modules[name] after exec_module: the new module itself
        sys.modules[self.old] = importlib.import_module(self.new)

    def get_code(self, fullname):  # used by ``python -m OLD`` (runpy)
        src = (f"import runpy, warnings\n"
               f"warnings.warn({_message(self.old, self.new, run=True)!r}, DeprecationWarning)\n"
               f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n")
        return compile(src, f"<{self.old}: moved to {self.new}>", "exec")

    def is_package(self, fullname) -> bool:
        return False


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Put the finder of the old names first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def alias(name: str):
    """The module an old submodule name of ``dsv_ext`` (``"train"``) now is, imported through
    the finder (so with its warning); None when ``name`` is not an old name."""
    full = f"dsv_ext.{name}"
    if full not in MOVED:
        return None
    return importlib.import_module(full)
