"""Mirror the training log to TensorBoard while training.

The HDF5 log (:mod:`deepsolve.io.h5log`) stays the record; :class:`TensorBoardMirror` writes
the same scalars of every row — loss terms, time, real and tracked peak memory, step counts,
metrics — as TensorBoard event files, with the row's ``iteration`` as the global step, so a
run can be watched with ``tensorboard --logdir RUN_DIR/tensorboard``. Missing values (NaN: a
metric on an iteration without evaluation; ``None``) are left out rather than drawn as gaps;
text columns (``schedule``) are written as text when they change.

A resumed run opens the writer with ``purge_step`` at its first iteration: the events a
killed run wrote after its restart file are hidden by TensorBoard, as the HDF5 log drops those
rows. Optional dependency: ``pip install 'deepsolve[tensorboard]'`` (the writer is
:class:`torch.utils.tensorboard.SummaryWriter`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["TensorBoardMirror", "MirroredLog", "TrackingError"]


class TrackingError(ValueError):
    """A tracking backend cannot be used (not installed, unwritable directory): a setting
    that cannot be met, reported by the CLI as one line."""


class TensorBoardMirror:
    """Write log rows as TensorBoard scalars under ``logdir``.

    Args:
        logdir: the event-file directory (created).
        purge_step: hide events at or after this step left by an earlier writer (resume).
    """

    def __init__(self, logdir: str, *, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackingError("--tensorboard needs the tensorboard package: pip install "
                                f"'deepsolve[tensorboard]' ({e})") from None
        try:
            self.writer = SummaryWriter(logdir, purge_step=purge_step)
        except OSError as e:
            raise TrackingError(f"--tensorboard: cannot write event files in {logdir}: "
                                f"{e}") from None
        self.logdir = logdir
        self._text: dict[str, str] = {}

    def append(self, row: Mapping[str, Any]) -> None:
        """One log row; ``row["iteration"]`` is the step."""
        step = int(row["iteration"])
        for name, value in row.items():
            if name == "iteration" or value is None:
                continue
            if isinstance(value, str):
                if self._text.get(name) != value:
                    self._text[name] = value
                    self.writer.add_text(name, value, step)
                continue
            if hasattr(value, "item"):   # numpy / torch scalars
                value = value.item()
            if not isinstance(value, numbers.Real) or math.isnan(value):
                continue
            self.writer.add_scalar(name, float(value), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MirroredLog:
    """A log (:class:`~deepsolve.io.H5Log`) whose rows also go to mirrors: ``append``,
    ``flush`` and ``close`` reach both; columns, curves and truncation are the log's (a
    :class:`~deepsolve.io.log.Log`). The log is written first, so a mirror that fails never
    loses a row of the record."""

    def __init__(self, log: Any, *mirrors: TensorBoardMirror) -> None:
        self.log = log
        self.mirrors = mirrors

    @property
    def columns(self) -> list[str]:
        return self.log.columns

    def append(self, row: Mapping[str, Any]) -> None:
        self.log.append(row)
        for m in self.mirrors:
            m.append(row)

    def append_curve(self, name: str, iteration: int, steps: Any, values: Any) -> None:
        self.log.append_curve(name, iteration, steps, values)

    def truncate_after(self, iteration: int) -> int:
        return self.log.truncate_after(iteration)

    def flush(self, sync: bool = False) -> None:
        self.log.flush(sync=sync)
        for m in self.mirrors:
            m.flush()

    def close(self) -> None:
        try:
            self.log.close()
        finally:
            for m in self.mirrors:
                m.close()
