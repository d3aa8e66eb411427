"""The run directory: made atomically, locked for one writer, inspected before a start.

A run directory has one writer, an exclusive ``flock`` (:class:`RunLock`) the kernel releases
however the trainer ends. :func:`inspect_run_dir` decides how a run starts from what the
directory holds (its log and restart file), changing nothing; a fresh start that fails before
its first row removes what it made (:func:`discard_start`). Temporary files of killed
trainers are removed by :func:`remove_stale_temporaries`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import artefacts
from .._process import pid_alive
from .progress import note
from .restart import RestartError, load_restart, remove_quietly

__all__ = ["RunDirBusy", "RunLock", "RunStart", "RunFiles", "inspect_run_dir", "make_and_lock",
           "remove_empty_dir", "discard_start", "remove_stale_temporaries"]


_UNSUPPORTED_LOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL, errno.ENOSYS}


class RunDirBusy(ValueError):
    """Another trainer writes the run directory."""


class RunLock:
    """One writer per run directory: an exclusive ``flock`` on the directory itself (on a
    lock file ``.deepsolve.lock`` inside it where a filesystem cannot lock directories). The
    kernel releases it when the process ends, however it ends, so a killed trainer leaves
    no lock behind. ``locking=False`` (``--no-file-locking``): where the filesystem supports
    no locks at all, run without one."""

    LOCK_FILE = ".deepsolve.lock"

    def __init__(self, run_dir: str, locking: bool | None):
        self.run_dir = run_dir
        self.fd: int | None = None
        self.path: str | None = None   # the locked file: None for the directory itself
        self.held = False
        self.gone = False              # the directory vanished before it could be opened
        err: OSError | None = None
        for path, flags in ((run_dir, os.O_RDONLY | os.O_DIRECTORY),
                            (os.path.join(run_dir, self.LOCK_FILE), os.O_RDWR | os.O_CREAT)):
            try:
                fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:   # removed since it was made: the caller makes it again
                self.gone = True
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                os.close(fd)
                raise RunDirBusy(
                    f"{run_dir}: another trainer{holder} is writing this run directory; wait "
                    "for it to end, or give another --out") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _UNSUPPORTED_LOCK:
                    raise
                err = e
                continue
            self.fd, self.held = fd, True
            self.path = None if path == run_dir else path
            return
        if locking is False:
            return
        why = err.strerror if err is not None and err.strerror else "not supported"
        raise ValueError(f"{run_dir}: cannot lock the run directory ({why}); the filesystem "
                         "does not support locks: retry with --no-file-locking (and make sure "
                         "no other trainer writes it)")

    def on(self, run_dir: str) -> bool:
        """Whether the locked file is still the one at its path (not removed or replaced
        since it was opened); True without a lock."""
        if self.gone:
            return False
        if self.fd is None:
            return True
        path = self.path if self.path is not None else run_dir
        try:
            a, b = os.fstat(self.fd), os.stat(path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.held = False


def _lock_holder(fd: int) -> str:
    """`` (pid N)`` of the process holding a flock on ``fd``'s file, from /proc/locks."""
    try:
        st = os.fstat(fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
                    return f" (pid {parts[4]})"
    except (OSError, ValueError):
        pass
    return ""


_TMP = re.compile(r"^(?:restart\.pt|log\.h5)\.tmp-(\d+)$|^log\.h5\.recover\.tmp$")


def remove_stale_temporaries(run_dir: str, *, all_of_them: bool = False) -> list[str]:
    """Remove the temporary files a killed or failed trainer left in ``run_dir``
    (``restart.pt.tmp-<pid>``, ``log.h5.tmp-<pid>``): those of dead processes, or all of them
    when the caller holds the run directory's lock (``all_of_them``). Returns their names."""
    removed: list[str] = []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if m is None:
            continue
        pid = int(m.group(1)) if m.group(1) else None
        if all_of_them or pid is None or pid == os.getpid() or not pid_alive(pid):
            path = os.path.join(run_dir, name)
            if os.path.isfile(path) and not os.path.islink(path):
                remove_quietly(path)
                removed.append(name)
    return removed


@dataclass(frozen=True)
class RunFiles:
    """Where a run writes: its directory, ``log.h5`` and ``restart.pt`` in it, and whether the
    log takes HDF5 file locks (``None``: HDF5's default; ``False``: ``--no-file-locking``)."""

    run_dir: str
    log: str
    restart: str
    locking: bool | None = None

    @classmethod
    def of(cls, problem_path: str, out: str | None, locking: bool | None = None) -> RunFiles:
        """``out``, or ``runs/<problem name>`` without one."""
        run_dir = out or os.path.join(
            "runs", os.path.splitext(os.path.basename(problem_path))[0])
        return cls(run_dir, os.path.join(run_dir, "log.h5"), os.path.join(run_dir, "restart.pt"),
                   locking)


@dataclass
class RunStart:
    """How a run starts, as decided from what its directory holds."""

    start: int = 0                      # first iteration to train
    restart: dict[str, Any] | None = None
    resume_log: bool = False            # continue the existing log (else a new one)
    created: bool = False               # this trainer made the run directory


def inspect_run_dir(run_dir: str, log_path: str, restart_path: str, resume: bool,
                     iterations: int) -> RunStart:
    """Decide how to start from what the directory holds; one-line errors. Nothing is
    changed here: the restart file's fields and the log's rows are checked first.

    * a ``log.h5`` or ``restart.pt`` that is a symbolic link: refused, whatever the start
      (the run replaces both files atomically, which would replace the link and leave its
      target stale); a run directory that is itself a link is written through, as any;
    * nothing (no log, no restart file): a fresh run starts at iteration 0; ``--resume`` is
      refused (a mistyped ``--out`` must not start a new run in silence);
    * a log but no restart file (a run stopped before its first one): it cannot be
      continued; the run starts at iteration 0, with or without ``--resume``, and the log
      is replaced by the new run's, with a note saying so;
    * a restart file and no ``--resume``: refused (``--resume`` continues it);
    * ``--resume`` with a restart file at iteration k: the log must hold iterations 0..k-1;
      its rows after them are dropped (they are re-run).
    """
    from ..io import LogError, log_iterations
    from ..io.log.files import replaced_link

    for path in (restart_path, log_path):   # the run replaces both, never through a link
        linked = replaced_link(path, run_dir)
        if linked is not None:
            raise ValueError(linked)
    has_restart = os.path.lexists(restart_path)
    try:
        rows = log_iterations(log_path)
        log_err = None
    except LogError as e:
        rows, log_err = None, e
    if not has_restart:
        if log_err is not None:
            raise ValueError(f"{log_err}; there is no restart file either, so nothing in "
                             f"{run_dir} can be continued: move log.h5 away, or give another "
                             "--out")
        n = 0 if rows is None else len(rows)
        if resume and rows is None:
            raise ValueError(f"--resume: {run_dir} holds no run to resume (no log.h5, no "
                             "restart.pt); check --out, or run without --resume for a fresh "
                             "run")
        if resume:
            note(f"--resume: {run_dir} holds no restart file (the run stopped before its "
                  f"first one): starting from iteration 0"
                  + (f"; the log's {n} rows are replaced" if n else ""))
        elif n:
            note(f"{log_path} holds {n} rows but no restart file (the run stopped before "
                  "its first one): starting the run over; the new log replaces it")
        return RunStart()
    if not resume:
        raise ValueError(f"{run_dir} already holds a run (restart.pt); continue it with "
                         "--resume or give a new --out directory")
    state = load_restart(restart_path)
    k = state["iteration"]
    if k > iterations:
        raise RestartError(f"{restart_path} is at iteration {k}, past iterations={iterations}: "
                           f"nothing to train; give --iterations {k} or more to continue the "
                           "run")
    if k > 0:
        if log_err is not None:
            raise RestartError(f"{log_err}; the restart file (iteration {k}) needs the log's "
                               f"rows 0..{k - 1}")
        what = _rows_mismatch(rows, k)
        if what is not None:
            raise RestartError(
                f"{restart_path} is at iteration {k} but {log_path} has {what}: the two do "
                "not belong together; move restart.pt away to start the run over, or put back "
                "the log that goes with it")
    return RunStart(start=k, restart=state, resume_log=rows is not None and len(rows) > 0)


def _rows_mismatch(rows: np.ndarray | None, k: int) -> str | None:
    """What keeps a log whose ``iteration`` column is ``rows`` (``None``: no log) from going
    with a restart file at iteration ``k``, which needs rows 0..k-1 first, in order; ``None``
    when they go together. The first offending rows are named: a repeated iteration, the
    first missing one, or the first row out of order."""
    want = f"iterations 0..{k - 1}"
    if rows is None:
        return f"no log, not {want}"
    n = len(rows)
    if n == 0:
        return f"no rows, not {want}"
    head = [int(v) for v in rows[:k]]
    if head == list(range(len(head))):
        if n >= k:
            return None
        return f"{n} rows (iterations 0..{n - 1}), not {want}"
    why: list[str] = []
    seen: set[int] = set()
    for v in head:
        if v in seen:
            at = [i for i, u in enumerate(head) if u == v]
            times = "twice" if len(at) == 2 else f"{len(at)} times"
            where = ", ".join(map(str, at[:-1])) + f" and {at[-1]}"
            why.append(f"iteration {v} appears {times}, at rows {where}")
            break
        seen.add(v)
    present = set(head)
    missing = next((m for m in range(k) if m not in present), None)
    if missing is not None:
        why.append(f"iteration {missing} is missing")
    if not why:   # each of 0..k-1 once, in another order
        j = next(j for j, v in enumerate(head) if v != j)
        why.append(f"row {j} holds iteration {head[j]}")
    return f"{n} rows whose iterations are not 0..{k - 1} in order ({'; '.join(why)})"


def _make_dir(run_dir: str) -> bool:
    """Make the run directory (and its parents); True if this call made it. ``os.mkdir`` is
    atomic: of two trainers starting at the same instant exactly one makes it, so the other
    never takes it for its own (and never removes it)."""
    parent = os.path.dirname(os.path.abspath(run_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(run_dir)
        return True
    except FileExistsError:
        if os.path.isdir(run_dir):
            return False
        raise ValueError(f"--out {run_dir}: cannot make the run directory (File exists)") \
            from None
    except OSError as e:
        raise ValueError(f"--out {run_dir}: cannot make the run directory "
                         f"({e.strerror or e})") from None


def make_and_lock(run_dir: str, locking: bool | None) -> tuple[bool, RunLock]:
    """``(made by this call, lock)``: the run directory made if it is missing, and locked.
    A trainer that cannot lock it (:class:`RunDirBusy`: another holds it) leaves it alone.
    A directory removed between its creation and the lock (a failed start cleaning up what
    it made) is made and locked again, so the lock held is always on the directory at
    ``run_dir``."""
    for _ in range(20):
        created = _make_dir(run_dir)
        lock = RunLock(run_dir, locking)
        if lock.on(run_dir):
            return created, lock
        lock.release()
    raise ValueError(f"--out {run_dir}: the run directory kept disappearing while the trainer "
                     "locked it (another program removes it?); give another --out")


def remove_empty_dir(path: str) -> None:
    """Remove a run directory this run made, if nothing (but its lock file) is in it."""
    try:
        names = os.listdir(path)
        if names == [RunLock.LOCK_FILE]:
            os.remove(os.path.join(path, RunLock.LOCK_FILE))
            names = []
        if not names:
            os.rmdir(path)
    except OSError:
        pass


def discard_start(run_dir: str, log_path: str, tb_dir: str | None, created: bool) -> None:
    """Remove what a fresh run made before it failed, or was interrupted, ahead of its first
    row: the new, empty log, the compiled artefacts of its first compile, the TensorBoard
    directory it made and, if it made it, the run directory (a directory that was there
    before is left, as it was)."""
    import shutil

    if os.path.isfile(log_path) and not os.path.islink(log_path):
        remove_quietly(log_path)
    compiled = os.path.join(run_dir, artefacts.RUN_FILE)  # a first compile's artefacts
    if os.path.isfile(compiled) and not os.path.islink(compiled):
        remove_quietly(compiled)
    if tb_dir is not None and os.path.isdir(tb_dir) and not os.path.islink(tb_dir):
        shutil.rmtree(tb_dir, ignore_errors=True)
    if created:
        remove_empty_dir(run_dir)
