"""Shared behaviour of the package's commands (python -m dsv_ext.app.train / compare / sample /
dispatch): a bad argument, config value or missing file ends the command with one line,
``<prog>: error: <message naming the argument>``, and exit status 2, as argparse does for its
own arguments. Set ``DSV_TRACEBACK=1`` to get the full traceback instead."""
from __future__ import annotations

import os
import sys
from typing import Callable


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run ``body`` (a command's work after argument parsing) and return its exit status;
    ValueError / TypeError / OSError / ImportError (a missing optional package) become
    ``prog: error: ...`` and status 2."""
    try:
        return body()
    except (ValueError, TypeError, OSError, ImportError) as e:
        if os.environ.get("DSV_TRACEBACK"):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        print(f"{prog}: (DSV_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 2


def check_numeric_args(args, ints=None, numbers=None) -> None:
    """Range-check parsed numeric command-line arguments (those that are not None): ``ints`` maps
    an argparse dest to the smallest allowed integer, ``numbers`` to the bound a finite number
    must exceed. Raises ValueError naming the option, e.g. ``--steps: expected an integer >= 1,
    got -1``."""
    import math

    for dest, lo in (ints or {}).items():
        v = getattr(args, dest)
        if v is not None and v < lo:
            raise ValueError(f"--{dest.replace('_', '-')}: expected an integer >= {lo}, got {v}")
    for dest, lo in (numbers or {}).items():
        v = getattr(args, dest)
        if v is not None and not (math.isfinite(v) and v > lo):
            raise ValueError(f"--{dest.replace('_', '-')}: expected a finite number > {lo}, got {v}")
