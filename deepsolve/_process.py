"""This process and others: how this one started (command line or library), whether another is
alive."""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["cli_start", "pid_alive", "end_rank", "shutdown_signals"]


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


def shutdown_signals(code: int) -> int:
    """In the command line's process, once its exit code ``code`` is decided (everything
    written and closed): what is left is the interpreter's exit — ``atexit`` callbacks of
    deepsolve, torch, h5py, logging — where a signal must not change the outcome. SIGTERM
    and SIGUSR1 (a batch system's stop) are ignored: there is nothing left to stop, and
    their default action would end the process with -15 instead of ``code``. SIGINT (a
    second Ctrl-C) ends the process at once with ``code``, the standard streams flushed,
    without the rest of the exit: a ``KeyboardInterrupt`` inside an ``atexit`` callback
    would print a traceback ("Exception ignored in atexit callback"). A rank of a
    distributed run (``WORLD_SIZE > 1``), which torchrun stops with SIGTERM when another
    fails, ends at once with ``code`` on SIGTERM and SIGUSR1 too. Returns ``code``;
    elsewhere (a program calling :func:`deepsolve.cli.main`) nothing is changed."""
    if not cli_start():
        return code

    def at_once(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, RuntimeError):
                pass
        os._exit(code)

    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    stop = at_once if world > 1 else signal.SIG_IGN
    for sig, how in ((signal.SIGTERM, stop), (signal.SIGUSR1, stop), (signal.SIGINT, at_once)):
        try:
            signal.signal(sig, how)
        except (ValueError, OSError):  # not the main thread
            pass
    return code


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
