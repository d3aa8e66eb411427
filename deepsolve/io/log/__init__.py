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

One concern per module, each importing only those before it (h5py and numpy only, no torch:
a log is read without importing deepsolve's numerics):

* :mod:`.files` — opening a log file safely; :class:`LogError`;
* :mod:`.schema` — columns, kinds, fill values, file attributes;
* :mod:`.read` — :func:`read_log`, :func:`read_curves`, :func:`log_iterations`;
* :mod:`.write` — :class:`H5Log`, rows and curves.

:class:`Log` is what the trainer writes to: an :class:`H5Log`, a log mirrored to TensorBoard
(:class:`deepsolve.io.tracking.MirroredLog`), or the nothing of ranks other than 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .files import EmptyLogError, LogError
from .read import LogData, curve_names, log_iterations, read_curves, read_log, to_pandas
from .schema import (
    CURVE_UNWRITTEN,
    CURVE_WIDTH,
    INT_MISSING,
    SCHEMA_VERSION,
    UNITS,
    column_to_dataset,
)
from .write import H5Log

__all__ = [
    "Log", "H5Log", "LogData", "LogError", "EmptyLogError", "read_log", "to_pandas",
    "SCHEMA_VERSION", "INT_MISSING", "column_to_dataset", "UNITS", "log_iterations",
    "read_curves", "curve_names", "CURVE_WIDTH", "CURVE_UNWRITTEN",
]


@runtime_checkable
class Log(Protocol):
    """What a run writes its rows and curves to (see :class:`H5Log` for the semantics)."""

    @property
    def columns(self) -> list[str]:
        """The column names, in order (empty before the first row)."""
        ...

    def append(self, row: Mapping[str, Any]) -> None:
        """Add one row (an ``iteration`` and any other columns)."""
        ...

    def append_curve(self, name: str, iteration: int, steps: Any, values: Any) -> None:
        """Add one curve (``values`` at ``steps``) for ``iteration``."""
        ...

    def flush(self, sync: bool = False) -> None:
        """Write the buffered rows; ``sync``: to the disk (fsync)."""
        ...

    def truncate_after(self, iteration: int) -> int:
        """Drop the rows after ``iteration``; returns how many were dropped."""
        ...

    def close(self) -> None:
        """Flush and close; the log stays readable."""
        ...
