"""Reading a log, also while it is written or after its writer was killed.

:func:`read_log` takes no HDF5 file locks (so no reader can make a writer fail), follows no
links out of the file, refuses external-storage and virtual datasets, checks the schema
version and every dataset's declared size against the file before reading it, and reads a
live log as of its last complete flush: the rows counted by the ``iteration`` column.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .files import EmptyLogError, LogError, _one_line, _open_for_reading, _resolve
from .schema import _MAX_COLUMNS, _READ_SLACK, _SIZE_SLACK, SCHEMA_VERSION, _decode_attrs

__all__ = ["LogData", "curve_names", "read_curves", "read_log", "log_iterations", "to_pandas"]


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


def curve_names(path: str | os.PathLike, *, locking: bool | None = None) -> list[str]:
    """The names of a log's curve groups (:meth:`H5Log.append_curve`), in the file's order."""
    p = _resolve(path)
    f, _ = _open_for_reading(p, locking)
    with f:
        return [k for k, g in f.items()
                if isinstance(g, h5py.Group) and g.attrs.get("kind") == "curve"]


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
        # the entries not yet written hold the fill value (-1 in logs written before
        # iteration -1 could carry a curve, CURVE_UNWRITTEN since)
        unwritten = it == d_it.fillvalue
        k = int(np.argmax(unwritten)) if unwritten.any() else len(it)
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
