"""The training log (:mod:`deepsolve.io.log`), where its names have always been imported from:
``from deepsolve.io.h5log import read_log``. See the package's modules for the layout, the
file safety, reading and writing."""

from __future__ import annotations

from .log import (
    CURVE_WIDTH,
    INT_MISSING,
    SCHEMA_VERSION,
    UNITS,
    EmptyLogError,
    H5Log,
    Log,
    LogData,
    LogError,
    column_to_dataset,
    curve_names,
    log_iterations,
    read_curves,
    read_log,
    to_pandas,
)

__all__ = [
    "Log", "H5Log", "LogData", "LogError", "EmptyLogError", "read_log", "to_pandas",
    "SCHEMA_VERSION", "INT_MISSING", "column_to_dataset", "UNITS", "log_iterations",
    "read_curves", "curve_names", "CURVE_WIDTH",
]
