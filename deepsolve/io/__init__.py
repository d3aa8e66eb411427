"""Training I/O: the HDF5 training log (:class:`H5Log`, :func:`read_log`) and the ``report``
command's logic (:func:`report`). Schema and reading recipes: docs/h5-log.md."""

from .h5log import (
    INT_MISSING,
    SCHEMA_VERSION,
    UNITS,
    EmptyLogError,
    H5Log,
    LogData,
    LogError,
    column_to_dataset,
    log_iterations,
    read_log,
    to_pandas,
)
from .report import ReportError, plot_log, report, summarize

__all__ = [
    "H5Log", "LogData", "LogError", "EmptyLogError", "read_log", "log_iterations", "to_pandas",
    "column_to_dataset", "SCHEMA_VERSION", "INT_MISSING", "UNITS", "report", "summarize",
    "plot_log", "ReportError",
]
