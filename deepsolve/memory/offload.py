"""Second storage levels for two-level schedules: host memory and a disk spill directory.

Spill folders are named ``deepsolve-spill-<pid>-<host>-XXXXXXXX`` so that what a killed
process left behind can be told apart from what a live one uses: :class:`DiskStorage` removes
the folders of dead processes of this host (and user) under its parent directory when it is
first used there, and the trainer does so under the default temporary directory when it
starts. While a folder is open, a SIGTERM that would kill the process (the default action)
first removes it; an ``atexit`` hook removes what is still open at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading

import torch

from .._process import pid_alive
from ..engine import HostStorage

__all__ = ["HostStorage", "DiskStorage", "remove_stale_spill_dirs"]

_PREFIX = "deepsolve-spill-"
# mkdtemp's random part: 8 of [a-z0-9_]
_NAME = re.compile(r"^deepsolve-spill-(\d+)-([A-Za-z0-9._]+)-[a-z0-9_]{8}$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


_OPEN: set[str] = set()            # spill folders of this process that are in use
_LOCK = threading.Lock()
_SCANNED: set[str] = set()         # parents already cleaned by this process
_PREVIOUS_TERM: object = None      # SIGTERM disposition before ours (SIG_DFL) while installed


def _remove_open() -> None:
    """Remove the spill folders still open (at interpreter exit, ``atexit``; on SIGTERM).
    A Ctrl-C meanwhile — a second one while the process exits — neither stops the removal
    nor prints "Exception ignored in atexit callback" with a traceback: in the main thread
    SIGINT is held by a handler of its own until the folders are gone and then dropped (the
    process is ending anyway), and a ``KeyboardInterrupt`` that still gets through (before
    that handler, or in another thread) is caught and the removal goes on."""
    held = _hold_sigint()
    try:
        while True:
            dirs: list[str] = []
            try:
                with _LOCK:
                    dirs = list(_OPEN)
                    _OPEN.clear()
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
                break
            except KeyboardInterrupt:   # the folders not removed yet: once more
                with _LOCK:
                    _OPEN.update(d for d in dirs if os.path.lexists(d))
    finally:
        _release_sigint(held)


def _hold_sigint() -> object:
    """Put a handler that does nothing on SIGINT (main thread only); the one it replaced,
    for :func:`_release_sigint` (``None``: nothing replaced)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return signal.signal(signal.SIGINT, lambda signum, frame: None)
    except (ValueError, OSError, TypeError):
        return None


def _release_sigint(old: object) -> None:
    if old is None:
        return
    try:
        signal.signal(signal.SIGINT, old)  # type: ignore[arg-type]
    except (ValueError, OSError, TypeError, KeyboardInterrupt):
        pass


def _on_sigterm(signum, frame) -> None:
    """SIGTERM with the default action (terminate): remove the open spill folders first."""
    _remove_open()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Route SIGTERM through :func:`_on_sigterm` while folders are open — only where SIGTERM
    would terminate the process anyway (default disposition, main thread): a program's own
    handler (the trainer's finishes the iteration and saves) is left alone."""
    global _PREVIOUS_TERM
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _PREVIOUS_TERM = signal.SIG_DFL
    except (ValueError, OSError):
        pass


def _restore_sigterm() -> None:
    global _PREVIOUS_TERM
    if _PREVIOUS_TERM is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    _PREVIOUS_TERM = None


atexit.register(_remove_open)


def remove_stale_spill_dirs(parent: str | os.PathLike | None = None) -> list[str]:
    """Remove the spill folders of dead processes under ``parent`` (default: the temporary
    directory): folders named by this module for this host whose pid is not running, owned
    by this user, and real directories (not links). Returns the paths removed."""
    parent = os.fspath(parent) if parent is not None else tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_PREFIX)]
    except OSError:
        return removed
    host, me, uid = _host(), os.getpid(), os.getuid()
    for name in names:
        m = _NAME.match(name)
        if m is None or m.group(2) != host:
            continue
        pid = int(m.group(1))
        if pid == me or pid_alive(pid):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class DiskStorage:
    """Snapshots as files in a private directory under ``spill_dir`` (for CPU-only machines
    whose RAM is the first level). The directory is removed by :meth:`close`, which the
    executor calls when the reverse sweep ends or fails, and on SIGTERM or interpreter exit
    (see the module docstring); files are read back with ``torch.load(weights_only=True)``."""

    def __init__(self, spill_dir: str | os.PathLike | None = None):
        if spill_dir is not None:
            try:
                os.makedirs(spill_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"spill_dir {os.fspath(spill_dir)!r}: cannot make the "
                                 f"directory ({e.strerror or e})") from None
        parent = os.path.abspath(os.fspath(spill_dir) if spill_dir is not None
                                 else tempfile.gettempdir())
        if parent not in _SCANNED:
            _SCANNED.add(parent)
            remove_stale_spill_dirs(parent)
        try:
            self.dir = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-{_host()}-",
                                        dir=parent)
        except OSError as e:
            raise ValueError(f"spill_dir {parent!r}: cannot make a spill folder "
                             f"({e.strerror or e})") from None
        with _LOCK:
            first = not _OPEN
            _OPEN.add(self.dir)
        if first:
            _install_sigterm()
        self.bytes_written = 0

    def _path(self, key) -> str:
        level, slot = key
        return os.path.join(self.dir, f"L{level}-S{slot}.pt")

    def put(self, key, tensors: list[torch.Tensor]) -> None:
        path = self._path(key)
        torch.save([t.detach().cpu() for t in tensors], path)
        self.bytes_written += os.path.getsize(path)

    def get(self, key, meta) -> list[torch.Tensor]:
        data = torch.load(self._path(key), weights_only=True)
        return [t.to(m[2]) for t, m in zip(data, meta, strict=True)]

    def drop(self, key) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        with _LOCK:
            _OPEN.discard(self.dir)
            last = not _OPEN
        if last:
            _restore_sigterm()

    def __del__(self):  # last resort; close() is the contract
        try:
            self.close()
        except Exception:
            pass
