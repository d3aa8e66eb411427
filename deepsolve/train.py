"""The trainer's public names, where they have always been imported from
(``from deepsolve.train import train``); the trainer itself is the package
:mod:`deepsolve.training`, one concern per module."""

from __future__ import annotations

from .training import (
    DEFAULT_THREADS,
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    ConfigError,
    RestartError,
    Run,
    RunConfig,
    RunDirBusy,
    TrainResult,
    apply_threads,
    build,
    load_restart,
    plan_problem,
    remove_stale_temporaries,
    resolve_config,
    run_threads,
    save_restart,
    train,
)

__all__ = ["train", "TrainResult", "Run", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE",
           "plan_problem", "RestartError", "RunDirBusy", "save_restart", "load_restart",
           "remove_stale_temporaries", "RunConfig", "ConfigError", "resolve_config",
           "DEFAULT_THREADS", "build", "apply_threads", "run_threads"]
