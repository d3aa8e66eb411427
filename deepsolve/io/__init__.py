"""Training I/O: the HDF5 training log (:class:`H5Log`, :func:`read_log`), the ``report``
command's logic (:func:`report`) and the cache of a problem's derived data
(:func:`load_or_compute`). Schema and reading recipes: docs/h5-log.md."""

from .cache import cache_path, load_or_compute
from .h5log import (
    CURVE_WIDTH,
    INT_MISSING,
    SCHEMA_VERSION,
    UNITS,
    EmptyLogError,
    H5Log,
    LogData,
    LogError,
    column_to_dataset,
    curve_names,
    log_iterations,
    read_curves,
    read_log,
    to_pandas,
)
from .report import ReportError, plot_log, report, summarize

__all__ = [
    "H5Log", "LogData", "LogError", "EmptyLogError", "read_log", "read_curves", "log_iterations",
    "curve_names", "to_pandas", "CURVE_WIDTH",
    "column_to_dataset", "SCHEMA_VERSION", "INT_MISSING", "UNITS", "report", "summarize",
    "plot_log", "ReportError", "cache_path", "load_or_compute",
]
