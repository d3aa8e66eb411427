"""Opening a log file safely: what is not a regular HDF5 file is refused before it is opened,
HDF5 file locks are taken or not as the filesystem allows, a live writer's file is opened in
SWMR mode, and every failure is one :class:`LogError` line naming the file.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
import stat as _stat
import time
from pathlib import Path
from typing import Any

import h5py

__all__ = ["LogError", "EmptyLogError", "replaced_link"]


class LogError(ValueError):
    """A log cannot be read or written as asked; the message is one line and names the file."""


class EmptyLogError(LogError):
    """The file holds no row: it is empty (0 bytes), has no columns yet, or its writer stopped
    before the log's first complete flush. A trainer treats such a log as absent."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# -------------------------------------------------------------------------------- opening


def _locking_kw(locking: bool | None) -> dict[str, Any]:
    """``h5py.File`` keyword for file locking: explicit flag, else ``HDF5_USE_FILE_LOCKING``."""
    if locking is None:
        env = os.environ.get("HDF5_USE_FILE_LOCKING", "").strip().upper()
        if env in ("FALSE", "0", "NO", "OFF"):
            locking = False
        else:
            return {}
    return {"locking": bool(locking)}


def _lock_error(path: Path, err: BaseException) -> LogError:
    detail = _one_line(err)
    hint = "retry with --no-file-locking or HDF5_USE_FILE_LOCKING=FALSE"
    if _is_lock_conflict(err):
        return LogError(
            f"{path}: the file is locked by another process ({detail}); if no other process "
            f"writes it (or the filesystem does not support locks), {hint}")
    return LogError(
        f"{path}: HDF5 file locking failed ({detail}); the filesystem (Lustre, GPFS, NFS) "
        f"probably does not support file locks: {hint}")


_LOCK_WAIT = 5.0     # seconds to wait for another process's lock to go away


def _is_lock_error(err: BaseException) -> bool:
    """A file-locking failure ('unable to lock file', not 'sblock' in a truncation message)."""
    return re.search(r"\block", str(err), re.IGNORECASE) is not None


def _is_lock_conflict(err: BaseException) -> bool:
    return getattr(err, "errno", None) in (_errno.EAGAIN, _errno.EWOULDBLOCK) or \
        "temporarily unavailable" in str(err)


def _open(path: Path, mode: str, locking: bool | None, **kw: Any) -> h5py.File:
    """``h5py.File`` with the locking flag and one-line errors for lock failures; waits up to
    ``_LOCK_WAIT`` seconds while another process holds a conflicting lock."""
    deadline = time.monotonic() + _LOCK_WAIT
    delay = 0.05
    while True:
        try:
            return h5py.File(path, mode, libver="latest", **_locking_kw(locking), **kw)
        except OSError as e:
            if not _is_lock_error(e):
                raise
            if _is_lock_conflict(e) and time.monotonic() + delay < deadline:
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            raise _lock_error(path, e) from None


def _reader_locking(locking: bool | None) -> bool:
    """Readers take HDF5 file locks only when asked (``locking=True``): a reader's shared lock
    would make a writer that opens the file fail, and the file's status flags already tell
    a reader whether a writer has it open."""
    return locking is True


def _open_reader(path: Path, lock: bool, **kw: Any) -> h5py.File:
    """Open read-only with the reader's locking flag. HDF5 refuses to open a file this
    process already has open with another locking flag (an in-process writer): then the
    file is opened as that handle has it."""
    flags: list[bool | None] = [lock, None, not lock]
    for i, flag in enumerate(flags):
        try:
            return _open(path, "r", flag, **kw)
        except LogError as e:
            if "flag values don't match" not in str(e) or i == len(flags) - 1:
                raise
    raise AssertionError("unreachable")


def _check_file(path: Path) -> int:
    """Size of ``path`` after checking it is a regular, non-empty file (no FIFO, device or
    directory: opening those could hang or read without end)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise LogError(f"{path}: no such log file") from None
    except OSError as e:
        raise LogError(f"{path}: cannot read the log ({e.strerror or _one_line(e)})") from None
    if not _stat.S_ISREG(st.st_mode):
        what = "a directory" if _stat.S_ISDIR(st.st_mode) else \
            "a FIFO" if _stat.S_ISFIFO(st.st_mode) else \
            "a device" if _stat.S_ISCHR(st.st_mode) or _stat.S_ISBLK(st.st_mode) else \
            "a socket" if _stat.S_ISSOCK(st.st_mode) else "not a regular file"
        raise LogError(f"{path}: not a regular file ({what}); a log is a regular HDF5 file")
    if st.st_size == 0:
        raise EmptyLogError(f"{path}: empty file (0 bytes): no row was ever written")
    return int(st.st_size)


def _superblock(path: Path) -> tuple[int | None, int]:
    """``(end-of-file address, status flags)`` from the superblock at offset 0 (``None`` and
    0 where not found). Flags (superblock versions 2 and 3): 0x1 open for writing, 0x4 open
    for SWMR writing."""
    try:
        with open(path, "rb") as fh:
            b = fh.read(64)
    except OSError:
        return None, 0
    if len(b) < 12 or b[:8] != b"\x89HDF\r\n\x1a\n":
        return None, 0
    version = b[8]
    flags = 0
    if version in (2, 3):
        so, start, flags = b[9], 12, b[11]
    elif version in (0, 1):
        so, start = b[13], 24 if version == 0 else 28
    else:
        return None, 0
    if so not in (2, 4, 8) or len(b) < start + 3 * so:
        return None, flags
    base = int.from_bytes(b[start:start + so], "little")
    eof = int.from_bytes(b[start + 2 * so:start + 3 * so], "little")
    return base + eof, flags


_SWMR_WAIT = 3.0     # seconds a live writer may take to write what its superblock announces


def _open_for_reading(path: Path, locking: bool | None) -> tuple[h5py.File, bool]:
    """Open a log read-only; returns ``(file, live)``. ``live``: the file is marked open for
    writing (a trainer writes it, or its writer was killed) and was opened in SWMR mode, after
    checking the file is not shorter than its superblock says (HDF5 skips that check for SWMR
    readers, and its readers then retry reads of missing metadata for minutes; a live writer
    is given ``_SWMR_WAIT`` seconds to catch up)."""
    lock = _reader_locking(locking)
    _check_file(path)
    _, flags = _superblock(path)
    if not flags & 0x5:
        try:
            return _open_reader(path, lock), False
        except LogError:
            raise
        except OSError as e:
            if not _is_dirty_flag_error(e) and not _superblock(path)[1] & 0x5:
                raise LogError(f"{path}: not a readable HDF5 log ({_one_line(e)})") from None
    deadline = time.monotonic() + _SWMR_WAIT
    while True:
        eof, _ = _superblock(path)
        size = path.stat().st_size
        if eof is None or size >= eof:
            break
        if time.monotonic() > deadline:
            raise LogError(f"{path}: truncated log (file has {size} bytes, its superblock "
                           f"says {eof})")
        time.sleep(0.05)   # a live writer between extending and writing the file
    try:
        return _open_reader(path, lock, swmr=True), True
    except LogError:
        raise
    except OSError as e:
        if "not already open for SWMR writing" in str(e):
            # written by an earlier deepsolve, whose writer switched to SWMR after creating the
            # datasets in the log itself: no row can have been flushed yet
            raise EmptyLogError(
                f"{path}: the writer stopped before the log's first complete flush (file left "
                f"marked open for writing, no rows); `h5clear -s {path}` (HDF5 tools) clears "
                f"the mark") from None
        raise LogError(f"{path}: not a readable HDF5 log ({_one_line(e)})") from None


def _is_dirty_flag_error(err: BaseException) -> bool:
    text = str(err)
    return "already open for write" in text or "h5clear" in text


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "log.h5"
    return p


# -------------------------------------------------------------------------------- writing


def replaced_link(path: str | os.PathLike, where: str | None = None) -> str | None:
    """Why a file that deepsolve replaces (a log, a restart file) cannot be a symbolic link,
    in one line naming it and the link's target; ``None`` when ``path`` is no link. A file is
    replaced atomically — written whole beside the name, then renamed over it — which puts a
    regular file where the link was and leaves the file it points to behind, stale.
    ``where``: the directory to copy the file into (default: the link's own)."""
    p = os.fspath(path)
    if not os.path.islink(p):
        return None
    try:
        target = os.readlink(p)
    except OSError:
        target = "?"
    into = where if where is not None else (os.path.dirname(p) or ".")
    return (f"{p} is a symbolic link (to {target}): deepsolve replaces its files atomically "
            "(a new file renamed over the name), which would replace the link and leave the "
            f"file it points to behind, stale; copy the file into {into} instead of linking it")


def _tmp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
