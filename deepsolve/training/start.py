"""Where a run starts, decided before anything is built, and whether it trains at all.

:func:`decide_start` makes and locks the run directory and decides the start from what it
holds (:func:`.rundir.inspect_run_dir`), a resumed run's restart file checked against its
settings (:func:`.stopping.check_resume`) — on rank 0 alone, which alone writes. Every rank
follows rank 0's decision: a start refused on any rank is refused on all (the directory this
trainer made is removed, its lock released), and the other ranks read the restart file rank 0
has checked. :func:`nothing_to_train` says when a resumed run has no iteration left (it had
finished, or its training time is at its ``time_limit`` already); :func:`untrained_outcome`
then reads its loss and metrics from the log, so the run is answered without building the
problem or writing anything.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from ..config import RunConfig
from .progress import note
from .restart import load_restart
from .rundir import (
    RunFiles,
    RunLock,
    RunStart,
    inspect_run_dir,
    make_and_lock,
    remove_empty_dir,
    remove_stale_temporaries,
)
from .stopping import check_resume

if TYPE_CHECKING:
    from ..distributed.data import DistInfo

__all__ = ["decide_start", "nothing_to_train", "untrained_outcome"]


def decide_start(cfg: RunConfig, dist: DistInfo, files: RunFiles,
                 resume: bool) -> tuple[RunStart, RunLock | None]:
    """Lock the run directory and decide the start (rank 0; the others follow its decision):
    the start and the lock (rank 0's; ``None`` on the other ranks), which the caller
    releases. A start refused on any rank is refused on all: rank 0's error, or a one-line
    ``ValueError`` on the others."""
    from .. import distributed as D
    from ..memory.offload import remove_stale_spill_dirs

    run_dir = files.run_dir
    lock: RunLock | None = None
    created = False
    err: BaseException | None = None
    start = RunStart()
    if dist.is_main:   # rank 0 alone writes, so it alone locks and checks the directory
        try:
            if resume and not os.path.isdir(run_dir):
                raise ValueError(f"--resume: {run_dir} does not exist, so there is no run "
                                 "to resume; check --out, or run without --resume for a "
                                 "fresh run")
            created, lock = make_and_lock(run_dir, files.locking)
            remove_stale_temporaries(run_dir, all_of_them=lock.held)
            remove_stale_spill_dirs()
            start = inspect_run_dir(run_dir, files.log, files.restart, resume,
                                    int(cfg["iterations"]))
            if start.restart is not None:
                check_resume(start.restart, cfg, files.restart)
        except BaseException as e:
            err = e
    try:
        failed = D.any_rank(dist, err is not None, cfg.device)
    except BaseException:
        failed = True
        if err is None:
            raise
    if failed or err is not None:
        if lock is not None:   # a directory is removed only by the trainer that made it
            if created:        # and holds its lock (another may have locked it first)
                remove_empty_dir(run_dir)
            lock.release()
        if err is not None:
            raise err
        raise ValueError(f"rank 0 could not start the run in {run_dir} (see its message)")
    if not dist.is_main and resume and os.path.lexists(files.restart):
        state = load_restart(files.restart)   # rank 0 has checked it against the log
        start = RunStart(start=state["iteration"], restart=state)
    start.created = created
    return start, lock


def nothing_to_train(start: RunStart, cfg: RunConfig) -> str | None:
    """Why a resumed run has no iteration left to train, or ``None``: ``""`` when its restart
    file is at ``iterations`` (the run had finished), the time-limit reason (``"time_limit 5
    min"``) when the training time it records is already at or past ``time_limit`` — a run
    that would otherwise train one more iteration before it asks the clock."""
    if start.restart is None:
        return None
    if start.start >= int(cfg["iterations"]):
        return ""
    limit = 60.0 * float(cfg["time_limit"] or 0)
    trained = float(start.restart.get("elapsed", 0.0))
    if limit and trained >= limit:
        return f"time_limit {limit / 60:g} min"
    return None



def untrained_outcome(files: RunFiles, dist: DistInfo, start: RunStart,
                      stopped: str) -> tuple[float, dict[str, float]]:
    """The loss and metrics of a resumed run with nothing to train (:func:`nothing_to_train`,
    whose reason is ``stopped``): on rank 0 the loss of its last row and the last value of
    each metric, read from the log (NaN and none on the other ranks); a one-line note says
    why when its time limit stops it."""
    k = start.start
    loss, metrics = math.nan, dict[str, float]()
    if dist.is_main:
        loss, metrics = _last_logged(files, k)
        if stopped.startswith("time_limit") and start.restart is not None:
            trained = float(start.restart.get("elapsed", 0.0))
            took = f"{trained / 60:.1f} min" if trained >= 120 else f"{trained:.3g} s"
            note(f"--resume: the run has trained {took} already, at or past its time limit "
                 f"of {stopped.removeprefix('time_limit ')}: stopped before iteration {k} (give "
                 "a longer --set time_limit=MINUTES, or 0 for none, to train on)")
    return loss, metrics


def _last_logged(files: RunFiles, k: int) -> tuple[float, dict[str, float]]:
    """The loss of the log's row at iteration ``k - 1`` and each metric's last value up to
    it (NaN and nothing when the log cannot say)."""
    from ..io import LogError, read_log

    try:
        cols = read_log(files.log, locking=files.locking).columns
    except LogError:
        return math.nan, {}
    rows = [i for i, it in enumerate(cols["iteration"]) if it == k - 1]
    if not rows:
        return math.nan, {}
    last = rows[-1]
    metrics = {}
    for name, values in cols.items():
        if name.startswith("metric/"):
            seen = [float(v) for v in values[:last + 1] if math.isfinite(float(v))]
            if seen:
                metrics[name[len("metric/"):]] = seen[-1]
    return float(cols["loss"][last]), metrics
