"""Stopping a run cleanly: SIGTERM, SIGUSR1 (what batch systems send before a kill) and SIGINT
(Ctrl-C) set a flag that the loop reads after each iteration; the run then writes its restart
file and ends with :data:`PREEMPTED_EXIT_CODE` or :data:`INTERRUPTED_EXIT_CODE`."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

__all__ = ["Preemption", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE", "after_the_run"]


#: Exit code of a run stopped by SIGTERM/SIGUSR1 after writing its restart file
#: (EX_TEMPFAIL: "try again"); a batch script requeues on it.
PREEMPTED_EXIT_CODE = 75


#: Exit code of a run stopped by SIGINT (Ctrl-C), after writing its restart file or, in its
#: set-up, before anything was trained (128 + SIGINT, what a shell reports for Ctrl-C).
INTERRUPTED_EXIT_CODE = 130


class Preemption:
    """SIGTERM/SIGUSR1/SIGINT set a flag; the loop finishes the iteration, saves, and exits.

    SIGINT (Ctrl-C) is SIGTERM's twin with two differences. In the set-up, before the first
    iteration starts (``training`` is False), there is nothing to save: it raises
    ``KeyboardInterrupt`` at once and the start is abandoned (a run directory made for it is
    removed again). In the loop, the first one sets the flag and says so on stderr, and a
    second one stops at once. In the command line's process (``hard_second``) SIGINT's
    default action is restored after the first, so the second ends the process even inside a
    long native operation, like a SIGKILL at that moment: the log and the last restart file
    stay valid and paired, and ``--resume`` continues from that restart file. Called from a
    program (a notebook, whose kernel must survive) the second raises ``KeyboardInterrupt``
    instead; the log is closed on the way out, the restart file left as it was.

    ``hold_after`` (the command line's process): when the run is over, SIGTERM and SIGUSR1
    are not given back their default action (which ends the process at once, exit -15,
    whatever the run's outcome) but a handler that says on stderr that there is nothing
    left to stop: the process then ends with the code its run decided (0 for a finished
    run, 75 for one a signal stopped), and at its exit
    :func:`deepsolve._process.shutdown_signals` takes over."""

    def __init__(self, hard_second: bool = False, hold_after: bool = False):
        self.signal: int | None = None
        self.interrupted = False     # a SIGINT arrived (the CLI exits with 130)
        self.training = False        # the loop has started: SIGINT stops after the iteration
        self.hard_second = hard_second
        self.hold_after = hold_after
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            if not self.training or self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            if self.hard_second:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(signal.SIGINT, signal.SIG_DFL)   # the second: at once
            with contextlib.suppress(OSError):
                os.write(2, b"\ndeepsolve train: interrupted: the iteration in progress "
                            b"finishes, then the restart file is written; press Ctrl-C again "
                            b"to stop at once (--resume then continues from the last restart "
                            b"file)\n")
        if self.signal is None:
            self.signal = signum

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
                # restart interrupted system calls (SA_RESTART): a signal that arrives while
                # a rank waits in a collective must set the flag, not hand the
                # communication library an EINTR it may treat as fatal
                signal.siginterrupt(sig, False)
            except (ValueError, OSError):  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            if self.hold_after and sig != signal.SIGINT:
                old = after_the_run
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, old)


def after_the_run(signum: int, frame: Any) -> None:
    """SIGTERM/SIGUSR1 once a run is over (its log and restart file written and closed):
    one line on stderr; the process goes on to end with the run's exit code."""
    with contextlib.suppress(OSError, ValueError):
        name = signal.Signals(signum).name
        os.write(2, f"deepsolve train: {name} after the run ended: its log and restart file "
                    f"are written and closed, nothing is left to stop\n".encode())
