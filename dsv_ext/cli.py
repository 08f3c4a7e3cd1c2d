"""Shared behaviour of the package's commands (python -m dsv_ext.train / compare / sample /
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
