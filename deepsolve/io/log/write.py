"""Writing the log: :class:`H5Log`, rows and curves.

:class:`H5Log` buffers rows and appends them one block per dataset. Every change of the
file's structure (creating it, its first rows, resuming it) is made in a temporary file
``<log>.tmp-<pid>`` that replaces the log with ``os.replace`` once complete, so the log's path
never holds a half-made file. The file is in SWMR mode (single writer, multiple readers) from
its first row on; the writer extends every other column first, flushes, and extends
``iteration`` last, so a reader that trusts its length reads a consistent prefix of complete
rows, even after the writer was killed mid-flush.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .files import (
    EmptyLogError,
    LogError,
    _one_line,
    _open,
    _open_for_reading,
    _remove,
    _tmp_path,
    replaced_link,
)
from .read import _check_schema, _read, read_curves
from .schema import (
    _CHUNK,
    _DTYPE,
    _FILL,
    CURVE_UNWRITTEN,
    CURVE_WIDTH,
    SCHEMA_VERSION,
    UNITS,
    _convert,
    _encode_attrs,
    _kind_of,
    _scalar,
    column_to_dataset,
)

__all__ = ["H5Log"]


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
            bytes, no columns) resumes as a new one. A symbolic link is refused
            (:class:`LogError`): the fresh file would replace the link, not its target.
        keep_through: with ``resume``: keep only the rows up to this iteration (the restart
            file's iteration - 1); ``None`` keeps them all.
        locking: HDF5 file locking of the writer; ``None`` follows ``HDF5_USE_FILE_LOCKING``
            (``FALSE``: off). ``False`` is needed on filesystems that refuse locks (Lustre,
            GPFS, NFS).
        flush_seconds: flush automatically once this long has passed since the last flush
            (checked at each :meth:`append`).
        block_rows: flush automatically once this many rows are buffered.

    A row may bring a new column: the rows before it get NaN there (``-1`` in int64 columns,
    ``""`` in strings), and so does a later row that leaves a column out. Its kind (int64,
    float64, string) is fixed by its first value. A new column after the first rows have been
    written publishes the file again (like a resume), so it costs a copy of the log: add
    columns rarely, not every iteration. ``iteration`` is required and strictly increasing.

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
        linked = replaced_link(p)
        if linked is not None:   # its rows would be read through the link, then replace it
            raise LogError(linked)
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
        """The group ``name`` of a curve: ``iteration`` (k,) (filled with
        :data:`CURVE_UNWRITTEN` until written, so iteration -1, the model as built, is a
        curve's own), ``step`` (k, CURVE_WIDTH) int64 (-1 padding) and ``value`` (k,
        CURVE_WIDTH) float64 (NaN padding)."""
        g = f.create_group(name)
        g.attrs["kind"] = "curve"
        k = 0 if old is None else len(old["iteration"])
        w = CURVE_WIDTH
        it = g.create_dataset("iteration", shape=(k,), maxshape=(None,), dtype=np.int64,
                              chunks=(_CHUNK,), fillvalue=CURVE_UNWRITTEN)
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
            LogError: missing or non-increasing ``iteration``, a column name that is not a
                string or maps to another column's dataset, a value of the wrong type for its
                column.
        """
        if self._closed:
            raise LogError(f"{self.path}: log is closed")
        if "iteration" not in row:
            raise LogError(f"{self.path}: every row needs an 'iteration'")
        unknown = [k for k in row if k not in self._kinds]
        new_kinds = self._new_kinds(row, unknown) if unknown else {}
        kinds = {**self._kinds, **new_kinds}
        out = {k: _convert(kinds[k], k, v) for k, v in row.items()}
        it = out["iteration"]
        if it < 0 or it <= self._last_it:
            raise LogError(
                f"{self.path}: iteration {it} after iteration {self._last_it}: iterations must "
                f"be >= 0 and strictly increasing (call truncate_after() when resuming)")
        if new_kinds:
            self._add_columns(new_kinds)
        self._buf.append(out)
        self._last_it = it
        if len(self._buf) >= self.block_rows or \
                time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def _new_kinds(self, row: Mapping[str, Any], names: list[str]) -> dict[str, str]:
        """The kinds of the columns ``names`` that ``row`` adds (``iteration`` first in a new
        log); a name that is not a string, or maps to a dataset another column has, fails."""
        taken = {column_to_dataset(c): c for c in self._kinds}
        kinds = {} if self._kinds else {"iteration": "i"}
        for k in names:
            if not isinstance(k, str):
                raise LogError(f"column names must be strings, got {k!r}")
            ds = column_to_dataset(k)
            if ds in taken:
                raise LogError(f"{self.path}: columns {taken[ds]!r} and {k!r} map to the same "
                               f"dataset {ds!r}")
            taken[ds] = k
            if k != "iteration":
                kinds[k] = _kind_of(_scalar(row[k]))
        return kinds

    def _add_columns(self, kinds: dict[str, str]) -> None:
        """Add columns: the rows already written get NaN (-1, ``""``) in them. Before the
        file has datasets the buffer simply grows them; after, the written rows and curves
        are flushed and the file is published again with the new datasets (SWMR allows no
        new dataset in an open file), so readers see the old or the new file, whole."""
        if self._f is None:
            self._kinds.update(kinds)
            return
        self.flush()
        assert self._f is not None
        n = self._n
        data = {c: (d.asstr()[:n] if self._kinds[c] == "s" else d[:n])
                for c, d in self._dsets.items()}
        for name, (d_it, d_st, d_va) in self._cdsets.items():
            k = self._cn[name]
            self._old_curves[name] = {"iteration": d_it[:k], "step": d_st[:k],
                                      "value": d_va[:k]}
        self._f.close()
        self._f = None
        for c, kind in kinds.items():
            data[c] = np.full(n, _FILL[kind], dtype=_DTYPE[kind]) if kind != "s" else \
                np.array([""] * n, dtype=object)
        self._kinds.update(kinds)
        self._publish(data)

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
