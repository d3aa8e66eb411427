"""The trainer: problem file in, trained model, HDF5 log and restart files out.

``train("problems/navier_stokes.py", overrides={"iterations": 20})`` loads the problem,
builds its model and data, and runs the optimisation loop. Each iteration appends one row to
``RUN_DIR/log.h5`` (loss terms, times, peak memory, step counts, schedule, learning rate,
gradient norm, metrics); every ``checkpoint_every`` iterations, at the end, and when SIGTERM or
SIGUSR1 arrives (batch systems send these before killing a job) or SIGINT (Ctrl-C; a second
one stops at once) it flushes the log and then writes ``RUN_DIR/restart.pt`` atomically, so
the log always holds the restart file's rows.

Before any work — loading data, building the model, making the run directory — the
settings become one frozen :class:`~deepsolve.config.RunConfig` (:func:`prepare`):
every setting checked, the budget, device, dtype and thread count parsed, so a bad
``--budget``, ``--device`` or ``--set`` is a one-line error that leaves nothing behind. A
fresh run that fails before its first row (a ``build`` that raises, a ``BudgetError`` at the
first iteration, a Ctrl-C in the set-up) leaves no run directory either (the one this run
made is removed, by the trainer that made it and holds its lock).

A run directory has one writer (an exclusive ``flock`` on it, released by the kernel however
the trainer ends). A start decides from what the directory holds, before changing anything:
no restart file — start at iteration 0 (a log without one, from a run stopped before its first
restart file, is replaced; with neither, ``--resume`` is refused: nothing to resume); a
restart file — refused without ``--resume``; with it, the file's
fields are checked (types, ranges, iteration <= the log's rows) and matched against the run
(model keys and shapes, optimiser groups, RNG states) before the log is touched, then the log
rows after it are dropped, so the iteration column stays complete and strictly increasing.
See docs/problems.md.

One concern per module, each importing only those listed before it:

* :mod:`.progress` — notes on stderr and the progress bar or lines;
* :mod:`.signals` — SIGTERM / SIGUSR1 / SIGINT to a clean stop, the exit codes;
* :mod:`.rng` — the random state a restart file records;
* :mod:`.restart_check` — what a restart file must hold, field by field;
* :mod:`.restart` — restart files: atomic writes, checked reads, matched restores;
* :mod:`.rundir` — the run directory: made, locked, inspected before a start;
* :mod:`.rows` — what one iteration's log row holds;
* :mod:`.terms` — the names of the loss terms, from one evaluation before training;
* :mod:`.prepare` — settings, threads, the problem built, the checks before the first
  iteration, ``deepsolve plan``;
* :mod:`.stopping` — a run's ``target`` and ``time_limit``: when it stops, and whether a
  resumed one has anything to train;
* :mod:`.start` — the start decided on rank 0 and followed by every rank, and the answer
  of a resumed run with nothing left to train;
* :mod:`.run` — :func:`train` and the :class:`Run` (set-up, loop, iteration, checkpoint).
"""

from __future__ import annotations

from ..config import DEFAULT_THREADS, ConfigError, RunConfig
from .prepare import apply_threads, build, plan_problem, prepare, resolve_config, run_threads
from .restart import RestartError, load_restart, save_restart
from .run import Run, TrainResult, train
from .rundir import RunDirBusy, remove_stale_temporaries
from .signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

__all__ = ["train", "TrainResult", "Run", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE",
           "plan_problem", "RestartError", "RunDirBusy", "save_restart", "load_restart",
           "remove_stale_temporaries", "RunConfig", "ConfigError", "resolve_config", "prepare",
           "DEFAULT_THREADS", "build", "apply_threads", "run_threads"]
