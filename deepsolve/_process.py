"""This process and others: how this one started (command line or library), whether another is
alive."""

from __future__ import annotations

import os
import sys

__all__ = ["cli_start", "pid_alive"]


def cli_start() -> bool:
    """Whether this process is the command line (``python -m deepsolve`` or the
    ``deepsolve`` script), where a Ctrl-C gets one line, not a traceback."""
    argv = getattr(sys, "orig_argv", None) or []
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] == "deepsolve"
    return bool(sys.argv) and sys.argv[0].rsplit("/", 1)[-1] == "deepsolve"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
