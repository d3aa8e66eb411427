"""How this process started: from the command line, or as a library."""

from __future__ import annotations

import sys

__all__ = ["cli_start"]


def cli_start() -> bool:
    """Whether this process is the command line (``python -m deepsolve`` or the
    ``deepsolve`` script), where a Ctrl-C gets one line, not a traceback."""
    argv = getattr(sys, "orig_argv", None) or []
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] == "deepsolve"
    return bool(sys.argv) and sys.argv[0].rsplit("/", 1)[-1] == "deepsolve"
