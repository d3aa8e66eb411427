"""The training log: one row per iteration in an HDF5 file that can be read while it is written.

Layout (``schema_version`` 1, see docs/h5-log.md):

* one resizable, chunked 1-D dataset per column (``maxshape=(None,)``), all of the same length,
  in creation order (the file is created with ``track_order=True``);
* dtypes: ``int64`` for ``iteration`` and for every column whose first value is an ``int``,
  ``float64`` for other numbers, variable-length UTF-8 strings for ``str`` columns;
* HDF5 link names cannot contain ``/``, so a column ``loss/pde`` is stored as the dataset
  ``loss.pde``; each dataset carries its column name in the attribute ``column`` (and
  ``units`` where known), and :func:`read_log` returns the column names;
* missing values: ``NaN`` (float), ``-1`` (int, :data:`INT_MISSING`), ``""`` (str);
* file attributes: ``schema_version``, ``created`` (ISO 8601, UTC), ``json_attrs`` (a JSON list
  of the attribute names stored as JSON) and the writer's ``attrs``: strings and numbers as
  they are, everything else (dicts, lists, None: ``config`` in particular) as JSON strings.

Writing: :class:`H5Log` buffers rows and appends them one block per dataset. The datasets are
created at the first flush and the file is then switched to SWMR mode (single writer, multiple
readers): ``h5py.File(path, "r", swmr=True, libver="latest")`` sees every flushed row while
training runs, and after the writer is killed (see docs/h5-log.md for what is guaranteed).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import json
import math
import os
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = [
    "H5Log", "LogData", "LogError", "read_log", "to_pandas", "SCHEMA_VERSION", "INT_MISSING",
    "column_to_dataset", "UNITS",
]

SCHEMA_VERSION = 1
"""Version of the file layout, stored as the file attribute ``schema_version``."""

INT_MISSING = -1
"""Value written into an int64 column for a row that does not give it."""

UNITS: dict[str, str] = {
    "iteration": "1",
    "time": "s", "time_forward": "s", "time_backward": "s",
    "peak_device_memory": "bytes", "peak_host_memory": "bytes",
    "advances": "step evaluations", "recorded": "step evaluations", "snapshots": "states",
}
"""Units stored as the dataset attribute ``units`` for the conventional columns."""

_CHUNK = 1024          # rows per HDF5 chunk (8 KiB for float64)
_STR = h5py.string_dtype("utf-8")


class LogError(ValueError):
    """A log cannot be read or written as asked; the message is one line and names the file."""


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


_LOCK_WAIT = 5.0     # seconds to wait for another process's lock (a reader) to go away


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


def _superblock_eof(path: Path) -> int | None:
    """End-of-file address stored in the superblock at offset 0 (None if not found)."""
    try:
        with open(path, "rb") as fh:
            b = fh.read(64)
    except OSError:
        return None
    if len(b) < 12 or b[:8] != b"\x89HDF\r\n\x1a\n":
        return None
    version = b[8]
    if version in (2, 3):
        so, start = b[9], 12
    elif version in (0, 1):
        so, start = b[13], 24 if version == 0 else 28
    else:
        return None
    if so not in (2, 4, 8) or len(b) < start + 3 * so:
        return None
    base = int.from_bytes(b[start:start + so], "little")
    eof = int.from_bytes(b[start + 2 * so:start + 3 * so], "little")
    return base + eof


def _open_for_reading(path: Path, locking: bool | None) -> h5py.File:
    """Open a log read-only: a plain open (HDF5 checks the file), or, when the file is marked
    open for writing (a live or killed SWMR writer), a SWMR open after checking the file is
    not shorter than its superblock says (HDF5 skips that check for SWMR readers, and its
    readers then retry reads of missing metadata for minutes)."""
    try:
        return _open(path, "r", locking)
    except LogError:
        raise
    except OSError as e:
        if not _is_dirty_flag_error(e):
            raise LogError(f"{path}: not a readable HDF5 log ({_one_line(e)})") from None
    for attempt in range(2):
        eof, size = _superblock_eof(path), path.stat().st_size
        if eof is None or size >= eof:
            break
        if attempt:
            raise LogError(f"{path}: truncated log (file has {size} bytes, its superblock "
                           f"says {eof})")
        time.sleep(0.2)   # a live writer may be between extending and writing the file
    try:
        return _open(path, "r", locking, swmr=True)
    except LogError:
        raise
    except OSError as e:
        if "not already open for SWMR writing" in str(e):
            raise LogError(
                f"{path}: the writer stopped before the log's first complete flush (file left "
                f"marked open for writing); `h5clear -s {path}` (HDF5 tools) clears the mark"
            ) from None
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


def _write_attrs(f: h5py.File, attrs: Mapping[str, Any]) -> None:
    enc, as_json = _encode_attrs(attrs)
    old = f.attrs.get("json_attrs")
    prev = set(json.loads(old)) if isinstance(old, str) else set()
    prev -= set(enc)
    for k, v in enc.items():
        f.attrs[k] = v
    f.attrs["json_attrs"] = json.dumps(sorted(prev | set(as_json)))


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
    """

    columns: dict[str, np.ndarray]
    attrs: dict[str, Any]
    n_rows: int
    path: str = ""
    units: dict[str, str] = field(default_factory=dict)


def _datasets(f: h5py.File) -> list[tuple[str, h5py.Dataset]]:
    """(column name, dataset) of every 1-D dataset at the root, in creation order."""
    out = []
    for key in f:
        obj = f.get(key)
        if isinstance(obj, h5py.Dataset) and obj.ndim == 1:
            col = obj.attrs.get("column", key)
            if isinstance(col, bytes):
                col = col.decode("utf-8", "replace")
            out.append((str(col), obj))
    return out


def _read_dataset(d: h5py.Dataset, n: int | None = None) -> np.ndarray:
    sl = slice(None) if n is None else slice(0, n)
    if h5py.check_string_dtype(d.dtype) is not None:
        vals = d.asstr()[sl]
        return np.asarray(vals, dtype=str) if len(vals) else np.zeros(0, dtype=str)
    return np.asarray(d[sl])


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "log.h5"
    return p


def read_log(path: str | os.PathLike, *, locking: bool | None = None) -> LogData:
    """Read a whole log (``path`` or a run directory holding ``log.h5``).

    Opens read-only; a log marked open for writing (a trainer is writing it, or its writer
    was killed) is opened in SWMR mode and reads as of its last flush. ``locking``: as for
    :class:`H5Log`.

    Raises:
        LogError: (one line naming the file) missing file, not an HDF5 file, truncated or
            corrupt file, no ``iteration`` column, columns of different lengths.
    """
    p = _resolve(path)
    if not p.exists():
        raise LogError(f"{p}: no such log file")
    f = _open_for_reading(p, locking)
    try:
        with f:
            attrs = _decode_attrs(f.attrs)
            dsets = _datasets(f)
            names = [c for c, _ in dsets]
            if "iteration" not in names:
                what = "no columns (no row was ever flushed)" if not dsets else \
                    f"no 'iteration' column (columns: {', '.join(names)})"
                raise LogError(f"{p}: {what}")
            lengths = {c: d.shape[0] for c, d in dsets}
            if len(set(lengths.values())) > 1:
                detail = ", ".join(f"{c}: {n}" for c, n in lengths.items())
                raise LogError(f"{p}: columns of different lengths ({detail})")
            columns = {c: _read_dataset(d) for c, d in dsets}
            units = {}
            for c, d in dsets:
                u = d.attrs.get("units")
                if u is not None:
                    units[c] = u.decode() if isinstance(u, bytes) else str(u)
    except LogError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:
        raise LogError(f"{p}: corrupt or truncated log ({_one_line(e)})") from None
    n = len(columns["iteration"])
    return LogData(columns=columns, attrs=attrs, n_rows=n, path=str(p), units=units)


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


class H5Log:
    """Append-only training log, one row per iteration (see the module docstring).

    Args:
        path: the ``.h5`` file. Without ``resume`` it is created (an existing file is
            replaced) and closed again at once; the datasets are created at the first flush.
        attrs: file attributes (strings and numbers as they are; dicts, lists, None as JSON
            strings: ``config`` is JSON). With ``resume`` they are added to / overwrite the
            existing ones.
        resume: open an existing log for appending. A log whose writer was killed (left
            marked open for SWMR writing) is recovered: its flushed rows are copied into a
            fresh file that replaces it (a ``RuntimeWarning`` says so; ``recovered`` is True).
        locking: HDF5 file locking; ``None`` follows ``HDF5_USE_FILE_LOCKING`` (``FALSE``:
            off). ``False`` is needed on filesystems that refuse locks (Lustre, GPFS, NFS).
        flush_seconds: flush automatically once this long has passed since the last flush
            (checked at each :meth:`append`).
        block_rows: flush automatically once this many rows are buffered.

    Columns are fixed by the first row appended to a log without datasets: give every column
    in that row (``NaN`` for a metric not evaluated at that iteration). A later row with an
    unknown column raises :class:`LogError`; a missing column is written as NaN, ``-1`` for
    int64 columns, ``""`` for strings. ``iteration`` is required and strictly increasing.

    Only one writer may use a log at a time.
    """

    def __init__(self, path: str | os.PathLike, *, attrs: dict | None = None,
                 resume: bool = False, locking: bool | None = None,
                 flush_seconds: float = 5.0, block_rows: int = 64) -> None:
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
        if resume:
            self._resume(attrs or {})
        else:
            self._create(attrs or {})

    # ---------------------------------------------------------------- setup

    def _create(self, attrs: Mapping[str, Any]) -> None:
        _encode_attrs(attrs)  # fail on bad attributes before touching the file
        try:
            with _open(self.path, "w", self.locking, track_order=True) as f:
                f.attrs["schema_version"] = SCHEMA_VERSION
                f.attrs["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(
                    timespec="seconds")
                _write_attrs(f, attrs)
        except OSError as e:
            raise LogError(f"{self.path}: cannot create the log ({_one_line(e)})") from None

    def _resume(self, attrs: Mapping[str, Any]) -> None:
        if not self.path.exists():
            raise LogError(f"{self.path}: no log to resume")
        _encode_attrs(attrs)
        try:
            f = _open(self.path, "r+", self.locking)
        except LogError:
            raise
        except OSError as e:
            if not _is_dirty_flag_error(e):
                raise LogError(f"{self.path}: cannot open the log to resume "
                               f"({_one_line(e)})") from None
            self._recover()
            f = _open(self.path, "r+", self.locking)
        try:
            if attrs:
                _write_attrs(f, attrs)
            dsets = _datasets(f)
        except Exception:
            f.close()
            raise
        if not dsets:
            f.close()                      # no rows yet: behave as a new log
            return
        names = [c for c, _ in dsets]
        if "iteration" not in names:
            f.close()
            raise LogError(f"{self.path}: no 'iteration' column, cannot resume")
        lengths = {d.shape[0] for _, d in dsets}
        if len(lengths) > 1:
            f.close()
            raise LogError(f"{self.path}: columns of different lengths, cannot resume")
        self._f = f
        for c, d in dsets:
            self._dsets[c] = d
            self._kinds[c] = "s" if h5py.check_string_dtype(d.dtype) is not None else \
                ("i" if d.dtype.kind in "iu" else "f")
        self._n = lengths.pop()
        self._last_it = int(self._dsets["iteration"][-1]) if self._n else -1
        f.swmr_mode = True

    def _recover(self) -> None:
        """Copy the flushed rows of a log whose writer died into a fresh file replacing it."""
        p = self.path
        try:
            src = _open_for_reading(p, self.locking)
        except LogError as e:
            raise LogError(f"{e} (the log was not closed cleanly and cannot be recovered)") \
                from None
        tmp = p.with_name(p.name + ".recover.tmp")
        with src:
            dsets = _datasets(src)
            n = min((d.shape[0] for _, d in dsets), default=0)
            raw_attrs = dict(src.attrs)
            with _open(tmp, "w", self.locking, track_order=True) as dst:
                for k, v in raw_attrs.items():
                    dst.attrs[k] = v
                for col, d in dsets:
                    data = _read_dataset(d, n)
                    kind = "s" if h5py.check_string_dtype(d.dtype) is not None else \
                        ("i" if d.dtype.kind in "iu" else "f")
                    nd = self._create_dataset(dst, col, kind)
                    if n:
                        nd.resize((n,))
                        nd[:] = data.astype(object) if kind == "s" else data
        os.replace(tmp, p)
        self.recovered = True
        warnings.warn(f"{p} was not closed cleanly (writer killed?); recovered its {n} "
                      f"flushed rows", RuntimeWarning, stacklevel=3)

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

    def _create_datasets(self) -> None:
        """First flush of a log without datasets: create them all, then switch SWMR on."""
        try:
            f = _open(self.path, "r+", self.locking)
        except LogError:
            raise
        except OSError as e:
            raise LogError(f"{self.path}: cannot open the log ({_one_line(e)})") from None
        try:
            for col, kind in self._kinds.items():
                self._dsets[col] = self._create_dataset(f, col, kind)
        except Exception:
            f.close()
            raise
        self._f = f
        f.swmr_mode = True

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

    def flush(self) -> None:
        """Write the buffered rows (one block per dataset) and flush the file to disk."""
        if self._closed:
            return
        if self._buf:
            if self._f is None:
                self._create_datasets()
            rows, m = self._buf, len(self._buf)
            n0, n1 = self._n, self._n + len(self._buf)
            for col, d in self._dsets.items():
                kind = self._kinds[col]
                fill = _FILL[kind]
                vals = [r.get(col, fill) for r in rows]
                arr = np.array(vals, dtype=object if kind == "s" else _DTYPE[kind])
                assert arr.shape == (m,)
                d.resize((n1,))
                d[n0:n1] = arr
            self._n = n1
            self._buf = []
        if self._f is not None:
            self._f.flush()
        self._last_flush = time.monotonic()

    def truncate_after(self, iteration: int) -> int:
        """Drop the rows whose iteration is greater than ``iteration`` (buffered or written);
        returns how many were dropped. Use when resuming from a restart file written at
        ``iteration``: the rows after it will be logged again."""
        if self._closed:
            raise LogError(f"{self.path}: log is closed")
        k = int(iteration)
        dropped = sum(1 for r in self._buf if r["iteration"] > k)
        self._buf = [r for r in self._buf if r["iteration"] <= k]
        if self._f is not None and self._n:
            its = self._dsets["iteration"][: self._n]
            # rows are strictly increasing by construction; keep the increasing prefix <= k
            bad = (its > k)
            bad[1:] |= its[1:] <= its[:-1]
            keep = int(np.argmax(bad)) if bad.any() else self._n
            if keep < self._n:
                dropped += self._n - keep
                for d in self._dsets.values():
                    d.resize((keep,))
                self._n = keep
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
                self._f.close()
                self._f = None

    def __enter__(self) -> H5Log:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"H5Log({str(self.path)!r}, rows={self.n_rows}, {state})"

