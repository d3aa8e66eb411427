"""The log's layout: its columns, their kinds and fill values, and its file attributes.

``schema_version`` 1 (docs/h5-log.md): one resizable, chunked 1-D dataset per column, in
creation order, ``iteration`` first; ``int64`` for ``iteration`` and for every column whose
first value is an ``int``, ``float64`` for other numbers, variable-length UTF-8 strings for
``str`` columns; a column ``loss/pde`` is the dataset ``loss.pde`` (HDF5 link names cannot
hold ``/``) with its name in the attribute ``column`` (and ``units`` where known); missing
values ``NaN``, ``-1`` (:data:`INT_MISSING`) and ``""``. File attributes: ``schema_version``,
``created``, ``json_attrs`` (the names stored as JSON) and the writer's own: strings and
numbers as they are, everything else as JSON strings.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from .files import LogError

__all__ = ["CURVE_WIDTH", "CURVE_UNWRITTEN", "SCHEMA_VERSION", "INT_MISSING", "UNITS",
           "column_to_dataset"]


CURVE_WIDTH = 512
"""Points of one logged curve at most (see :meth:`H5Log.append_curve`)."""

CURVE_UNWRITTEN = np.iinfo(np.int64).min
"""The ``iteration`` of a curve entry not yet written (a live log is read while its writer
appends). Logs written before iteration -1 could carry a curve used -1; readers take the
dataset's own fill value."""


SCHEMA_VERSION = 1
"""Version of the file layout, stored as the file attribute ``schema_version``."""


INT_MISSING = -1
"""Value written into an int64 column for a row that does not give it."""


UNITS: dict[str, str] = {
    "iteration": "1",
    "time": "s", "time_forward": "s", "time_backward": "s", "elapsed": "s",
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
