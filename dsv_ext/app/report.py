"""Number formatting shared by the comparison reports (``compare.md``, ``compare_seeds.md``)."""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["fmt", "scalar"]


def fmt(v: Any, nd: int = 4) -> str:
    """A table cell: ``-`` for None, floats with ``nd`` decimals, anything else as ``str``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def scalar(v: Any) -> Optional[Any]:
    """The mean of a per-block list (None entries skipped; None when nothing is left), else ``v``."""
    if isinstance(v, list):
        xs = [x for x in v if x is not None]
        return sum(xs) / len(xs) if xs else None
    return v
