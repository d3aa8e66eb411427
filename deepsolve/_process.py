"""This process and others: how this one started (command line or library), whether another is
alive."""

from __future__ import annotations

import os
import sys

__all__ = ["cli_start", "pid_alive", "end_rank"]


def cli_start() -> bool:
    """Whether this process is the command line (``python -m deepsolve`` or the
    ``deepsolve`` script), where a Ctrl-C gets one line, not a traceback."""
    argv = getattr(sys, "orig_argv", None) or []
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] == "deepsolve"
    return bool(sys.argv) and sys.argv[0].rsplit("/", 1)[-1] == "deepsolve"


def end_rank(code: int) -> int:
    """End a rank of a distributed command-line run (``WORLD_SIZE > 1``, started as
    ``python -m deepsolve`` or ``deepsolve``) that succeeded (``code`` 0) at once, without
    the interpreter's finalization; otherwise return ``code``. (A failed rank exits as
    usual: ending at once, it would have torchrun stop the other ranks before they print
    their own line.)

    The run has closed its log and restart files and ended its process groups
    (:func:`deepsolve.distributed.cleanup`) by then. What finalization would add is a race:
    a communication thread of PyTorch's gloo backend still alive while Python tears itself
    down is killed by ``pthread_exit`` when it reaches for the GIL, through C++ frames that
    cannot unwind, and the process aborts with "terminate called without an active
    exception" (SIGABRT; seen on a loaded machine) or hangs. Standard streams are flushed
    first; ``os._exit`` then ends the process with the run's exit code."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if world <= 1 or code != 0 or not cli_start():
        return code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
