"""The training log: one row per iteration in an HDF5 file that can be read while it is written.

Layout (``schema_version`` 1, see docs/h5-log.md):

* one resizable, chunked 1-D dataset per column (``maxshape=(None,)``), in creation order (the
  file is created with ``track_order=True``), ``iteration`` first;
* the length of ``iteration`` is the number of rows: the writer extends every other column
  first, flushes, and extends ``iteration`` last, so a reader that trusts its length (and
  stops at a negative value, the fill value of rows not yet written) reads a consistent
  prefix of complete rows, even while the writer flushes or after it was killed mid-flush;
* dtypes: ``int64`` for ``iteration`` and for every column whose first value is an ``int``,
  ``float64`` for other numbers, variable-length UTF-8 strings for ``str`` columns;
* HDF5 link names cannot contain ``/``, so a column ``loss/pde`` is stored as the dataset
  ``loss.pde``; each dataset carries its column name in the attribute ``column`` (and
  ``units`` where known), and :func:`read_log` returns the column names;
* missing values: ``NaN`` (float), ``-1`` (int, :data:`INT_MISSING`), ``""`` (str);
* file attributes: ``schema_version``, ``created`` (ISO 8601, UTC), ``json_attrs`` (a JSON list
  of the attribute names stored as JSON) and the writer's ``attrs``: strings and numbers as
  they are, everything else (dicts, lists, None: ``config`` in particular) as JSON strings.

Writing: :class:`H5Log` buffers rows and appends them one block per dataset. Every change of
the file's structure (creating it, its first rows, resuming it) is made in a temporary file
``<log>.tmp-<pid>`` that replaces the log with ``os.replace`` once complete, so the log's path
never holds a half-made file. The file is in SWMR mode (single writer, multiple readers) from
its first row on: ``h5py.File(path, "r", swmr=True, libver="latest")`` sees every flushed row
while training runs, and after the writer is killed (see docs/h5-log.md).

Reading: :func:`read_log` takes no HDF5 file locks (so no reader can make a writer fail),
follows no links out of the file, refuses external-storage and virtual datasets and files that
are not regular files, checks the schema version and every dataset's declared size against the
file before reading it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import json
import math
import os
import re
import stat as _stat
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = [
    "H5Log", "LogData", "LogError", "EmptyLogError", "read_log", "to_pandas",
    "SCHEMA_VERSION", "INT_MISSING", "column_to_dataset", "UNITS", "log_iterations",
    "read_curves", "CURVE_WIDTH",
]

CURVE_WIDTH = 512
"""Points of one logged curve at most (see :meth:`H5Log.append_curve`)."""

SCHEMA_VERSION = 1
"""Version of the file layout, stored as the file attribute ``schema_version``."""

INT_MISSING = -1
"""Value written into an int64 column for a row that does not give it."""

UNITS: dict[str, str] = {
    "iteration": "1",
    "time": "s", "time_forward": "s", "time_backward": "s",
    "peak_device_memory": "bytes", "peak_host_memory": "bytes",
    "peak_real_memory": "bytes", "peak_tracked_memory": "bytes", "budget_bytes": "bytes",
    "advances": "step evaluations", "recorded": "step evaluations", "snapshots": "states",
}
"""Units stored as the dataset attribute ``units`` for the conventional columns."""

_CHUNK = 1024          # rows per HDF5 chunk (8 KiB for float64)
_STR = h5py.string_dtype("utf-8")
_MAX_COLUMNS = 100_000           # root members a reader looks at before refusing the file
_SIZE_SLACK = 1 << 20            # bytes a dataset may declare beyond the file's size
_READ_SLACK = 64 << 20           # bytes all columns together may declare beyond the file's size


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


# -------------------------------------------------------------------------------- columns


def column_to_dataset(name: str) -> str:
    """The HDF5 dataset name of a column: ``/`` becomes ``.`` (``loss/pde`` -> ``loss.pde``)."""
    ds = name.replace("/", ".")
    if not name or ds == "." or ds == "..":
        raise LogError(f"invalid column name {name!r}")
    return ds


def _kind_of(value: Any) -> str:
    """Column kind of a first value: 'i' (int64), 'f' (float64) or 's' (string)."""
    if isinstance(value, str):
        return "s"
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        return "i"
    return "f"


def _scalar(value: Any) -> Any:
    """Python scalar of a row value (numpy scalars, 0-d arrays, torch scalars via ``item``)."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    item = getattr(value, "item", None)
    if item is not None:
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return value


def _convert(kind: str, name: str, value: Any) -> Any:
    """Validated storage value of ``value`` for a column of ``kind``; raises LogError."""
    v = _scalar(value)
    if kind == "s":
        if v is None:
            return ""
        if not isinstance(v, str):
            raise LogError(f"column {name!r} holds strings, got {type(value).__name__} {v!r}")
        return v
    if v is None:
        return _FILL[kind]
    if isinstance(v, str) or not isinstance(v, (bool, int, float)):
        raise LogError(f"column {name!r} holds numbers, got {type(value).__name__} {v!r}")
    if kind == "f":
        return float(v)
    # int64 column
    if isinstance(v, float):
        if math.isnan(v):
            return INT_MISSING
        if not v.is_integer():
            raise LogError(f"column {name!r} is int64 (its first value was an int), got {v!r}")
    return int(v)


_FILL = {"i": INT_MISSING, "f": math.nan, "s": ""}
_DTYPE = {"i": np.int64, "f": np.float64, "s": _STR}


# -------------------------------------------------------------------------------- attributes


def _encode_attrs(attrs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    as_json: list[str] = []
    for k, v in attrs.items():
        if not isinstance(k, str) or not k:
            raise LogError(f"attribute names must be non-empty strings, got {k!r}")
        if k in ("schema_version", "json_attrs"):
            raise LogError(f"attribute name {k!r} is reserved")
        v = _scalar(v) if not isinstance(v, np.ndarray) or v.ndim == 0 else v
        if isinstance(v, (str, bool, int, float, np.ndarray)):
            out[k] = v
        else:
            out[k] = json.dumps(v, default=str)
            as_json.append(k)
    return out, as_json


def _decode_attrs(raw: Mapping[str, Any]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for k, v in raw.items():
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, np.generic):
            v = v.item()
        attrs[k] = v
    json_names = attrs.get("json_attrs")
    names: list[str] = []
    if isinstance(json_names, str):
        with contextlib.suppress(ValueError):
            names = list(json.loads(json_names))
    for k in names:
        if isinstance(attrs.get(k), str):
            with contextlib.suppress(ValueError):
                attrs[k] = json.loads(attrs[k])
    attrs.pop("json_attrs", None)
    return attrs


# -------------------------------------------------------------------------------- reading


@dataclass
class LogData:
    """A log read into memory.

    Attributes:
        columns: column name -> 1-D array (int64, float64, or str for string columns), in the
            order the columns were created; every array has ``n_rows`` entries.
        attrs: file attributes, JSON attributes (``config``) decoded.
        n_rows: number of rows.
        path: the file read.
        units: column name -> the ``units`` attribute of its dataset, where there is one.
    """

    columns: dict[str, np.ndarray]
    attrs: dict[str, Any]
    n_rows: int
    path: str = ""
    units: dict[str, str] = field(default_factory=dict)


class _Torn(Exception):
    """A live file changed under the reader in a way a consistent read cannot use: retry."""


def _check_schema(f: h5py.File, p: Path) -> None:
    sv = f.attrs.get("schema_version")
    if sv is None:          # not written by deepsolve: read it as the current layout
        return
    if isinstance(sv, np.ndarray) and sv.shape in ((), (1,)):
        sv = sv.reshape(()).item()
    if isinstance(sv, np.generic):
        sv = sv.item()
    if isinstance(sv, bool) or not isinstance(sv, int) or not 1 <= sv <= SCHEMA_VERSION:
        raise LogError(f"{p}: schema_version {_one_line(repr(sv))[:40]} is not a layout this "
                       f"deepsolve reads (1..{SCHEMA_VERSION}); read it with the deepsolve "
                       f"version that wrote it, or upgrade deepsolve")


def _kind_of_dataset(d: h5py.Dataset) -> str | None:
    """'i', 'f', 's' for the dtypes a log holds; None for anything else."""
    if h5py.check_string_dtype(d.dtype) is not None:
        return "s"
    k = d.dtype.kind
    if k in "iub":
        return "i"
    if k == "f":
        return "f"
    return None


def _checked_members(f: h5py.File, p: Path) -> list[tuple[str, str, h5py.Dataset, str | None]]:
    """``(dataset name, column name, dataset, units)`` of the root's 1-D datasets in creation
    order, after refusing links out of the file, external-storage and virtual datasets and
    dtypes a log does not hold. Groups and datasets of other ranks are skipped."""
    n = len(f)
    if n > _MAX_COLUMNS:
        raise LogError(f"{p}: {n} members at the root, more than a log holds "
                       f"({_MAX_COLUMNS} at most); not reading it")
    out = []
    for key in f:
        link = f.get(key, getlink=True)
        if not isinstance(link, h5py.HardLink):
            kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            raise LogError(f"{p}: {key!r} is {kind}; a log holds only its own datasets "
                           "(not following it)")
        obj = f.get(key)
        if not isinstance(obj, h5py.Dataset) or obj.ndim != 1:
            continue
        dcpl = obj.id.get_create_plist()
        if dcpl.get_layout() == h5py.h5d.VIRTUAL:
            raise LogError(f"{p}: {key!r} is a virtual dataset (its data lives in other files); "
                           "not reading it")
        if dcpl.get_external_count() > 0:
            raise LogError(f"{p}: {key!r} keeps its data in external files; not reading it")
        if _kind_of_dataset(obj) is None:
            raise LogError(f"{p}: {key!r} has dtype {obj.dtype}, not one a log holds "
                           "(int, float, string)")
        a = obj.attrs
        col, units = key, None
        if len(a):
            col = a.get("column", key)
            units = a.get("units")
        if isinstance(col, bytes):
            col = col.decode("utf-8", "replace")
        if isinstance(units, bytes):
            units = units.decode("utf-8", "replace")
        out.append((key, str(col), obj, None if units is None else str(units)))
    return out


def _check_size(d: h5py.Dataset, key: str, p: Path, file_size: int) -> None:
    declared = int(d.shape[0]) * max(int(d.dtype.itemsize), 1)
    if declared > file_size + _SIZE_SLACK:
        raise LogError(f"{p}: dataset {key!r} declares {d.shape[0]} rows ({declared} bytes), "
                       f"more than the file's {file_size} bytes can hold: corrupt log")


def _read_dataset(d: h5py.Dataset, n: int | None = None) -> np.ndarray:
    sl = slice(None) if n is None else slice(0, n)
    if h5py.check_string_dtype(d.dtype) is not None:
        vals = d.asstr()[sl]
        return np.asarray(vals, dtype=str) if len(vals) else np.zeros(0, dtype=str)
    return np.asarray(d[sl])


def _row_count(its: np.ndarray) -> int:
    """Rows of a consistent prefix: ``iteration`` up to its first negative value (the fill
    value of rows whose data a live or killed writer had not written yet)."""
    neg = np.flatnonzero(its < 0)
    return int(neg[0]) if len(neg) else len(its)


def _read_open(f: h5py.File, p: Path, live: bool,
               only_iteration: bool = False) -> tuple[dict[str, Any], list[tuple[str, str, str]],
                                                  dict[str, np.ndarray], dict[str, str]]:
    """Read an open log: ``(raw attrs, [(dataset, column, kind)], columns, units)``, the
    columns cut to the consistent prefix. ``only_iteration``: check the other columns'
    lengths but read no data but ``iteration``'s."""
    _check_schema(f, p)
    raw_attrs = {k: f.attrs[k] for k in f.attrs}
    file_size = max(p.stat().st_size, 1)
    members = _checked_members(f, p)
    if not members:
        raise EmptyLogError(f"{p}: no columns (no row was ever flushed)")
    by_col = {c: (k, d) for k, c, d, _ in members}
    if "iteration" not in by_col:
        raise LogError(f"{p}: no 'iteration' column (columns: "
                       f"{', '.join(c for _, c, _, _ in members)[:300]})")
    k_it, d_it = by_col["iteration"]
    if _kind_of_dataset(d_it) != "i":
        raise LogError(f"{p}: the 'iteration' column holds {d_it.dtype}, not integers")
    # the iteration column first: its length is the row count the other columns must reach
    _check_size(d_it, k_it, p, file_size)
    its = _read_dataset(d_it)
    n = _row_count(its)
    budget = 2 * file_size + _READ_SLACK - n * 8
    columns: dict[str, np.ndarray] = {"iteration": its[:n].astype(np.int64, copy=False)}
    kinds = [(k_it, "iteration", "i")]
    units: dict[str, str] = {}
    short = {}
    for key, col, d, _ in members:
        if col == "iteration":
            continue
        _check_size(d, key, p, file_size)
        if d.shape[0] < n:
            short[col] = d.shape[0]
            continue
        budget -= n * max(int(d.dtype.itemsize), 1)
        if budget < 0:
            raise LogError(f"{p}: its columns declare more data than the file's {file_size} "
                           "bytes can hold: corrupt log")
        if only_iteration:
            continue
        columns[col] = _read_dataset(d, n)
        kind = _kind_of_dataset(d)
        assert kind is not None  # _checked_members refused the other dtypes
        kinds.append((key, col, kind))
    if short:
        if live:
            raise _Torn()
        detail = ", ".join(f"{c}: {m}" for c, m in list(short.items())[:10])
        raise LogError(f"{p}: columns of different lengths (iteration: {n}, {detail})")
    for _, col, _, u in members:
        if u is not None and col in columns:
            units[col] = u
    # keep the creation order of the file (iteration is first in deepsolve's logs)
    order = [c for _, c, _, _ in members if c in columns]
    columns = {c: columns[c] for c in order}
    pos = {c: i for i, c in enumerate(order)}
    kinds.sort(key=lambda t: pos[t[1]])
    return raw_attrs, kinds, columns, units


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "log.h5"
    return p


_LIVE_RETRY = 5.0    # seconds a reader of a live log keeps retrying a failed read


def _read(p: Path, locking: bool | None, only_iteration: bool = False):
    """:func:`_read_open` with the opening, one-line errors, and retries (for up to
    ``_LIVE_RETRY`` seconds) on a file marked open for writing: its writer may be extending
    it under the reader (HDF5 then fails a read with "len exceeds EOA" until the writer has
    written its superblock)."""
    deadline = time.monotonic() + _LIVE_RETRY
    delay = 0.01
    while True:
        f, live = _open_for_reading(p, locking)
        try:
            with f:
                return _read_open(f, p, live, only_iteration) + (live,)
        except LogError:
            raise
        except _Torn:
            if time.monotonic() > deadline:
                raise LogError(f"{p}: the columns kept changing while reading the live log; "
                               "read it again") from None
        except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:
            if not live or time.monotonic() > deadline:
                raise LogError(f"{p}: corrupt or truncated log ({_one_line(e)})") from None
        time.sleep(delay)
        delay = min(2 * delay, 0.25)


def read_curves(path: str | os.PathLike, name: str, *,
                locking: bool | None = None) -> dict[str, np.ndarray]:
    """The curves of group ``name`` of a log (:meth:`H5Log.append_curve`): ``iteration``
    (k,), ``step`` and ``value`` (k, :data:`CURVE_WIDTH`; -1 / NaN past each curve's points).
    The ``iteration`` entries are written last, so a live log reads complete curves."""
    p = _resolve(path)
    f, _ = _open_for_reading(p, locking)
    with f:
        g = f.get(name)
        if not isinstance(g, h5py.Group) or g.attrs.get("kind") != "curve":
            raise LogError(f"{p}: no curve group {name!r} (was the run logging it?)")
        d_it = g["iteration"]
        it = _read_dataset(d_it)
        k = int(np.argmax(it < 0)) if (it < 0).any() else len(it)
        return {"iteration": it[:k], "step": g["step"][:k], "value": g["value"][:k]}


def read_log(path: str | os.PathLike, *, locking: bool | None = None) -> LogData:
    """Read a whole log (``path`` or a run directory holding ``log.h5``).

    Opens read-only and without HDF5 file locks (``locking=True`` takes them), so a reader
    never makes a writer fail. A log marked open for writing (a trainer is writing it, or its
    writer was killed) is opened in SWMR mode and reads as of its last complete flush: the
    rows counted by the ``iteration`` column, a consistent prefix of complete rows.

    Raises:
        LogError: (one line naming the file) missing file, not a regular file, not an HDF5
            file, a schema version this deepsolve does not read, truncated or corrupt file,
            links out of the file, external-storage or virtual datasets, a dataset larger
            than the file can hold, no ``iteration`` column, columns shorter than it.
            :class:`EmptyLogError` (a ``LogError``) for a file without rows.
    """
    p = _resolve(path)
    raw_attrs, _, columns, units, _ = _read(p, locking)
    attrs = _decode_attrs(raw_attrs)
    n = len(columns["iteration"])
    return LogData(columns=columns, attrs=attrs, n_rows=n, path=str(p), units=units)


def log_iterations(path: str | os.PathLike, *, locking: bool | None = None) -> np.ndarray | None:
    """The ``iteration`` column of the log at ``path`` (its consistent prefix); ``None`` when
    there is no file, an empty array for a log without rows (:class:`EmptyLogError`).
    Raises :class:`LogError` for a log that cannot be read."""
    p = Path(path)
    if not os.path.lexists(p):
        return None
    try:
        _, _, columns, _, _ = _read(p, locking, only_iteration=True)
    except EmptyLogError:
        return np.zeros(0, dtype=np.int64)
    return columns["iteration"]


def to_pandas(path: str | os.PathLike, *, locking: bool | None = None):
    """The log as a ``pandas.DataFrame`` (one column per log column, file attributes in
    ``df.attrs``). Needs pandas, which deepsolve does not depend on."""
    try:
        import pandas as pd
    except ImportError as e:
        raise ImportError("to_pandas needs pandas (pip install pandas)") from e
    log = read_log(path, locking=locking)
    df = pd.DataFrame(log.columns)
    df.attrs.update(log.attrs)
    return df


# -------------------------------------------------------------------------------- writing


def _tmp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


class H5Log:
    """Append-only training log, one row per iteration (see the module docstring).

    Args:
        path: the ``.h5`` file. Without ``resume`` a new, empty log (attributes only)
            replaces whatever is at ``path``; the datasets are made with the first rows.
        attrs: file attributes (strings and numbers as they are; dicts, lists, None as JSON
            strings: ``config`` is JSON). With ``resume`` they are added to / overwrite the
            existing ones.
        resume: continue an existing log: its rows (those with ``iteration <= keep_through``
            when given) and attributes are copied into a fresh file that replaces it. A log
            whose writer was killed (left marked open for SWMR writing) is recovered that way
            (a ``RuntimeWarning`` says so; ``recovered`` is True). A log without rows (0
            bytes, no columns) resumes as a new one.
        keep_through: with ``resume``: keep only the rows up to this iteration (the restart
            file's iteration - 1); ``None`` keeps them all.
        locking: HDF5 file locking of the writer; ``None`` follows ``HDF5_USE_FILE_LOCKING``
            (``FALSE``: off). ``False`` is needed on filesystems that refuse locks (Lustre,
            GPFS, NFS).
        flush_seconds: flush automatically once this long has passed since the last flush
            (checked at each :meth:`append`).
        block_rows: flush automatically once this many rows are buffered.

    Columns are fixed by the first row appended to a log without datasets: give every column
    in that row (``NaN`` for a metric not evaluated at that iteration). A later row with an
    unknown column raises :class:`LogError`; a missing column is written as NaN, ``-1`` for
    int64 columns, ``""`` for strings. ``iteration`` is required and strictly increasing.

    Only one writer may use a log at a time (the trainer holds a lock on its run directory).
    """

    def __init__(self, path: str | os.PathLike, *, attrs: dict | None = None,
                 resume: bool = False, locking: bool | None = None,
                 flush_seconds: float = 5.0, block_rows: int = 64,
                 keep_through: int | None = None, curves: tuple[str, ...] = ()) -> None:
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.path = Path(path)
        self.locking = locking
        self.flush_seconds = float(flush_seconds)
        self.block_rows = int(block_rows)
        self.recovered = False
        self._f: h5py.File | None = None
        self._kinds: dict[str, str] = {}          # column -> 'i' | 'f' | 's'
        self._dsets: dict[str, h5py.Dataset] = {}
        self._buf: list[dict[str, Any]] = []
        self._n = 0                               # rows in the datasets
        self._last_it = -1
        self._closed = False
        self._last_flush = time.monotonic()
        self._raw_attrs: dict[str, Any] = {}      # what a new file gets
        self._curve_names = tuple(curves)
        for name in self._curve_names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"curve name {name!r}: use letters, digits and _")
        self._cbuf: list[tuple[str, int, np.ndarray, np.ndarray]] = []
        self._cdsets: dict[str, tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset]] = {}
        self._cn: dict[str, int] = {}
        self._old_curves: dict[str, dict[str, np.ndarray]] = {}
        enc, as_json = _encode_attrs(attrs or {})  # fail on bad attributes before any file
        if resume:
            self._resume(enc, as_json, keep_through)
        else:
            self._raw_attrs = {
                "schema_version": SCHEMA_VERSION,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **enc, "json_attrs": json.dumps(sorted(as_json))}
            self._publish({})

    # ---------------------------------------------------------------- setup

    def _resume(self, enc: dict[str, Any], as_json: list[str], keep_through: int | None) -> None:
        p = self.path
        if not os.path.lexists(p):
            raise LogError(f"{p}: no log to resume")
        raw: dict[str, Any] = {}
        data: dict[str, np.ndarray] = {}
        kinds: list[tuple[str, str, str]] = []
        live = False
        try:
            raw, kinds, data, _, live = _read(p, self.locking)
        except EmptyLogError:
            with contextlib.suppress(LogError, OSError):   # keep the attributes if readable
                f, _ = _open_for_reading(p, self.locking)
                with f:
                    _check_schema(f, p)
                    raw = {k: f.attrs[k] for k in f.attrs}
        if kinds:
            its = data["iteration"]
            bad = its > keep_through if keep_through is not None else np.zeros(len(its), bool)
            bad[1:] |= its[1:] <= its[:-1]      # the strictly increasing prefix
            keep = int(np.argmax(bad)) if bad.any() else len(its)
            data = {c: a[:keep] for c, a in data.items()}
            self._kinds = {c: k for _, c, k in kinds}
            last = int(data["iteration"][-1]) if keep else -1
            for name in self._curve_names:  # the curves of the rows kept
                with contextlib.suppress(LogError):
                    c = read_curves(p, name, locking=self.locking)
                    ok = c["iteration"] <= last
                    self._old_curves[name] = {k: v[ok] for k, v in c.items()}
        old_json = raw.get("json_attrs")
        if isinstance(old_json, bytes):
            old_json = old_json.decode("utf-8", "replace")
        prev: set[str] = set()
        if isinstance(old_json, str):
            with contextlib.suppress(ValueError, TypeError):
                prev = set(json.loads(old_json))
        raw.update(enc)
        raw.setdefault("schema_version", SCHEMA_VERSION)
        raw.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds"))
        raw["json_attrs"] = json.dumps(sorted((prev - set(enc)) | set(as_json)))
        self._raw_attrs = raw
        self._publish(data)
        if live:
            self.recovered = True
            warnings.warn(f"{p} was not closed cleanly (writer killed?); recovered its "
                          f"{self._n} flushed rows", RuntimeWarning, stacklevel=3)

    @staticmethod
    def _create_dataset(f: h5py.File, col: str, kind: str) -> h5py.Dataset:
        kw: dict[str, Any] = {}
        if kind != "s":
            kw["fillvalue"] = _FILL[kind]
        d = f.create_dataset(column_to_dataset(col), shape=(0,), maxshape=(None,),
                             dtype=_DTYPE[kind], chunks=(_CHUNK,), **kw)
        d.attrs["column"] = col
        if col in UNITS:
            d.attrs["units"] = UNITS[col]
        return d

    @staticmethod
    def _create_curve(f: h5py.File, name: str, old: Mapping[str, np.ndarray] | None):
        """The group ``name`` of a curve: ``iteration`` (k,), ``step`` (k, CURVE_WIDTH) int64
        (-1 padding) and ``value`` (k, CURVE_WIDTH) float64 (NaN padding)."""
        g = f.create_group(name)
        g.attrs["kind"] = "curve"
        k = 0 if old is None else len(old["iteration"])
        w = CURVE_WIDTH
        it = g.create_dataset("iteration", shape=(k,), maxshape=(None,), dtype=np.int64,
                              chunks=(_CHUNK,), fillvalue=-1)
        st = g.create_dataset("step", shape=(k, w), maxshape=(None, w), dtype=np.int64,
                              chunks=(8, w), fillvalue=-1)
        va = g.create_dataset("value", shape=(k, w), maxshape=(None, w), dtype=np.float64,
                              chunks=(8, w), fillvalue=np.nan)
        if k:
            assert old is not None  # k > 0 only with old curves
            st[:] = old["step"]
            va[:] = old["value"]
            it[:] = old["iteration"]
        return it, st, va

    def append_curve(self, name: str, iteration: int, steps: Any, values: Any) -> None:
        """Buffer one curve of iteration ``iteration`` for the group ``name`` (declared with
        ``curves=`` when the log was opened): up to :data:`CURVE_WIDTH` points ``(steps[j],
        values[j])``. Written with the rows (before their ``iteration``); a reader sees the
        curves whose ``iteration`` entry is written (:func:`read_curves`)."""
        if name not in self._curve_names:
            raise LogError(f"{self.path}: curve {name!r} was not declared (curves=...)")
        s = np.asarray(steps, dtype=np.int64).reshape(-1)
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if s.shape != v.shape or len(s) > CURVE_WIDTH:
            raise LogError(f"{self.path}: curve {name!r} needs as many steps as values, at "
                           f"most {CURVE_WIDTH}; got {len(s)} and {len(v)}")
        self._cbuf.append((name, int(iteration), s, v))

    def _write_curves(self) -> None:
        if self._f is None or not self._cbuf:
            return
        for name, it, s, v in self._cbuf:
            d_it, d_st, d_va = self._cdsets[name]
            k = self._cn[name]
            d_st.resize((k + 1, CURVE_WIDTH))
            d_va.resize((k + 1, CURVE_WIDTH))
            d_st[k, :len(s)] = s
            d_va[k, :len(v)] = v
            self._f.flush()
            d_it.resize((k + 1,))
            d_it[k] = it
            self._cn[name] = k + 1
        self._cbuf = []

    def _publish(self, data: Mapping[str, np.ndarray]) -> None:
        """Write a complete file (attributes, and with ``self._kinds`` the datasets holding
        ``data``) under a temporary name and rename it over the log. With columns, the file
        stays open in SWMR mode for the appends that follow."""
        tmp = _tmp_path(self.path)
        f: h5py.File | None = None
        try:
            f = _open(tmp, "w", self.locking, track_order=True)
            for k, v in self._raw_attrs.items():
                f.attrs[k] = v
            n = len(data["iteration"]) if self._kinds and "iteration" in data else 0
            dsets = {}
            for col, kind in self._kinds.items():
                d = dsets[col] = self._create_dataset(f, col, kind)
                if n:
                    d.resize((n,))
                    a = data[col]
                    d[:] = a.astype(object) if kind == "s" else a
            cdsets = {}
            if self._kinds:
                for name in self._curve_names:   # made now: SWMR allows no new datasets
                    cdsets[name] = self._create_curve(f, name, self._old_curves.get(name))
                f.swmr_mode = True               # flushes the file
            else:
                f.close()
                f = None
            os.replace(tmp, self.path)
        except BaseException as e:
            if f is not None:
                with contextlib.suppress(Exception):
                    f.close()
            _remove(tmp)
            if isinstance(e, LogError):
                raise
            if isinstance(e, (OSError, RuntimeError, ValueError)):
                raise LogError(f"{self.path}: cannot write the log ({_one_line(e)})") from None
            raise
        self._f = f
        self._dsets = dsets
        self._cdsets = cdsets
        self._cn = {k: int(v[0].shape[0]) for k, v in cdsets.items()}
        self._old_curves = {}
        self._n = n
        self._last_it = int(data["iteration"][-1]) if n else -1

    # ---------------------------------------------------------------- API

    @property
    def columns(self) -> list[str]:
        """Column names, in order (empty before the first row of a new log)."""
        return list(self._kinds)

    @property
    def last_iteration(self) -> int:
        """Iteration of the last row appended (buffered or written); -1 when empty."""
        return self._last_it

    @property
    def n_rows(self) -> int:
        """Rows appended so far (written and buffered)."""
        return self._n + len(self._buf)

    def append(self, row: Mapping[str, Any]) -> None:
        """Buffer one row (column -> int, float, numpy/torch scalar, or str); flushes when
        ``block_rows`` rows are buffered or ``flush_seconds`` have passed.

        Raises:
            LogError: missing or non-increasing ``iteration``, a column the log does not
                have, a value of the wrong type for its column.
        """
        if self._closed:
            raise LogError(f"{self.path}: log is closed")
        if "iteration" not in row:
            raise LogError(f"{self.path}: every row needs an 'iteration'")
        if not self._kinds:  # the first row fixes the columns
            kinds = {"iteration": "i"}
            ds_names: dict[str, str] = {}
            for k, v in row.items():
                if not isinstance(k, str):
                    raise LogError(f"column names must be strings, got {k!r}")
                ds = column_to_dataset(k)
                if ds in ds_names:
                    raise LogError(f"{self.path}: columns {ds_names[ds]!r} and {k!r} map to "
                                   f"the same dataset {ds!r}")
                ds_names[ds] = k
                if k != "iteration":
                    kinds[k] = _kind_of(_scalar(v))
            new_kinds = kinds
        else:
            new_kinds = None
            unknown = [k for k in row if k not in self._kinds]
            if unknown:
                raise LogError(
                    f"{self.path}: new column(s) {', '.join(map(repr, unknown))}; the columns "
                    f"were fixed by the first row ({', '.join(self._kinds)}): give every "
                    f"column in the first row, NaN where not evaluated")
        kinds = new_kinds if new_kinds is not None else self._kinds
        out = {k: _convert(kinds[k], k, v) for k, v in row.items()}
        it = out["iteration"]
        if it < 0 or it <= self._last_it:
            raise LogError(
                f"{self.path}: iteration {it} after iteration {self._last_it}: iterations must "
                f"be >= 0 and strictly increasing (call truncate_after() when resuming)")
        if new_kinds is not None:
            self._kinds = new_kinds
        self._buf.append(out)
        self._last_it = it
        if len(self._buf) >= self.block_rows or \
                time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def _block(self, col: str) -> np.ndarray:
        kind = self._kinds[col]
        fill = _FILL[kind]
        arr = np.array([r.get(col, fill) for r in self._buf],
                       dtype=object if kind == "s" else _DTYPE[kind])
        assert arr.shape == (len(self._buf),)
        return arr

    def flush(self, sync: bool = False) -> None:
        """Write the buffered rows (one block per dataset) and flush the file: every other
        column first, ``iteration`` (the row count readers trust) last. ``sync``: also
        ``fsync`` the file (the trainer does before it publishes a restart file)."""
        if self._closed:
            return
        if self._buf:
            if self._f is None:                    # the first rows: a complete new file
                data = {c: self._block(c) for c in self._kinds}
                self._publish(data)
                self._write_curves()
                assert self._f is not None  # _publish left it open (there are columns)
                self._f.flush()
            else:
                n0, n1 = self._n, self._n + len(self._buf)
                try:
                    self._write_curves()
                    for col, d in self._dsets.items():
                        if col != "iteration":
                            d.resize((n1,))
                            d[n0:n1] = self._block(col)
                    self._f.flush()
                    d = self._dsets["iteration"]
                    d.resize((n1,))
                    d[n0:n1] = self._block("iteration")
                    self._f.flush()
                except (OSError, RuntimeError) as e:
                    raise LogError(f"{self.path}: cannot write the log ({_one_line(e)}); "
                                   f"its first {self._n} rows are intact") from None
                self._n = n1
            self._buf = []
        elif self._f is not None:
            self._write_curves()
            self._f.flush()
        if sync and self._f is not None:
            with contextlib.suppress(OSError, RuntimeError, ValueError, TypeError):
                os.fsync(self._f.id.get_vfd_handle())
        self._last_flush = time.monotonic()

    def truncate_after(self, iteration: int) -> int:
        """Drop the rows whose iteration is greater than ``iteration`` (buffered or written);
        returns how many were dropped. Use when resuming from a restart file written at
        ``iteration`` (or open with ``H5Log(path, resume=True, keep_through=iteration)``,
        which drops them in the copy). ``iteration`` shrinks first, so readers never see a
        row whose columns are gone."""
        if self._closed:
            raise LogError(f"{self.path}: log is closed")
        k = int(iteration)
        dropped = sum(1 for r in self._buf if r["iteration"] > k)
        self._buf = [r for r in self._buf if r["iteration"] <= k]
        if self._f is not None and self._n:
            its = self._dsets["iteration"][: self._n]
            bad = (its > k)
            bad[1:] |= its[1:] <= its[:-1]
            keep = int(np.argmax(bad)) if bad.any() else self._n
            if keep < self._n:
                dropped += self._n - keep
                self._dsets["iteration"].resize((keep,))
                self._f.flush()
                for col, d in self._dsets.items():
                    if col != "iteration":
                        d.resize((keep,))
                self._n = keep
                self._f.flush()
        self._cbuf = [c for c in self._cbuf if c[1] <= k]
        for name, (d_it, d_st, d_va) in self._cdsets.items():
            n = self._cn[name]
            keep = int(np.searchsorted(d_it[:n], k, side="right")) if n else 0
            if keep < n:
                assert self._f is not None  # curve datasets live in the open file
                d_it.resize((keep,))
                self._f.flush()
                d_st.resize((keep, CURVE_WIDTH))
                d_va.resize((keep, CURVE_WIDTH))
                self._cn[name] = keep
                self._f.flush()
        if self._buf:
            self._last_it = self._buf[-1]["iteration"]
        elif self._n:
            self._last_it = int(self._dsets["iteration"][self._n - 1])
        else:
            self._last_it = -1
        return dropped

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._f is not None:
                with contextlib.suppress(Exception):
                    self._f.close()
                self._f = None

    def __enter__(self) -> H5Log:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"H5Log({str(self.path)!r}, rows={self.n_rows}, {state})"
