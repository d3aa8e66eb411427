"""One iteration's log row: its loss terms checked, its memory columns and step counts, the
largest peaks over the ranks, and the adjoint-norm curve.

The row's columns (docs/problems.md, "The log"): ``iteration``, ``loss``, ``loss/<term>``,
``time``, ``time_forward``, ``time_backward``, ``peak_device_memory``, ``peak_real_memory``
(``max_memory_allocated`` above the iteration's start on CUDA, the RSS high-water mark above
the run's baseline on the CPU), ``peak_tracked_memory``, ``peak_host_memory``, ``advances``,
``recorded``, ``snapshots``, ``schedule``, ``compile_time``, ``lr``, ``grad_norm``, then
``budget_bytes``, ``n_steps`` (curricula), ``*_max`` (distributed runs) and ``metric/<name>``;
the curves an evaluation returns (:class:`deepsolve.Curve`) go to the groups ``eval_<name>``;
``elapsed`` and ``stopped`` (:mod:`.stopping`). Where rows go: rank 0's log, :func:`mirrored`
to TensorBoard, or :class:`NoLog` on the other ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..problem import Context, Curve, ProblemError

__all__ = ["check_terms", "budget_bytes", "log_adjoint_norms", "add_rank_peaks", "StatsSum",
           "split_evaluation", "log_evaluation_curves", "NoLog", "mirrored"]


def check_terms(terms: Any, it: int) -> dict[str, torch.Tensor]:
    if not isinstance(terms, Mapping) or not terms:
        raise ProblemError(f"residuals() must return a non-empty dict of named loss terms, got "
                           f"{type(terms).__name__} at iteration {it}")
    for k, v in terms.items():
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            raise ProblemError(f"loss term {k!r} must be a scalar tensor, got "
                               f"{type(v).__name__}{tuple(getattr(v, 'shape', ()))}")
    return dict(terms)


def split_evaluation(values: Any) -> tuple[dict[str, float], dict[str, Curve]]:
    """What :meth:`Problem.evaluate` returned, as ``(numbers, curves)``; a value that is
    neither a number nor a :class:`~deepsolve.Curve` of as many steps as values is a
    one-line :class:`ProblemError`."""
    numbers: dict[str, float] = {}
    curves: dict[str, Curve] = {}
    for k, v in (values or {}).items():
        if isinstance(v, Curve):
            s, y = np.asarray(v.steps).reshape(-1), np.asarray(v.values).reshape(-1)
            if s.shape != y.shape or not np.issubdtype(s.dtype, np.integer):
                raise ProblemError(f"evaluate(): curve {k!r} needs integer steps and as many "
                                   f"values; got {s.dtype} steps ({s.size}) and {y.size} values")
            curves[k] = Curve(s.astype(np.int64), y.astype(np.float64))
            continue
        try:
            numbers[k] = float(v)
        except (TypeError, ValueError):
            raise ProblemError(f"evaluate(): metric {k!r} must be a number or a "
                               f"deepsolve.Curve, got {type(v).__name__}") from None
    return numbers, curves


def _thin(n: int) -> np.ndarray:
    """At most ``CURVE_WIDTH`` indices evenly spread over ``0..n-1`` (both ends kept)."""
    from ..io.h5log import CURVE_WIDTH

    return np.unique(np.round(np.linspace(0, n - 1, min(n, CURVE_WIDTH))).astype(np.int64))


def log_evaluation_curves(log, it: int, curves: Mapping[str, Curve]) -> None:
    """Each curve of an evaluation as the log's group ``eval_<name>`` for iteration ``it``
    (-1: the model as built), thinned to ``CURVE_WIDTH`` points."""
    for name, c in curves.items():
        keep = _thin(len(c.steps))
        log.append_curve(f"eval_{name}", it, c.steps[keep], c.values[keep])


def log_adjoint_norms(log, it: int, stats) -> None:
    """The adjoint norms of the iteration's first unroll, at most ``CURVE_WIDTH`` points
    evenly spread over its steps ``0..n`` (the first and the last included)."""
    norms = next((s.adjoint_norms for s in stats if isinstance(s.adjoint_norms, torch.Tensor)),
                 None)
    if norms is None:
        return
    steps = _thin(len(norms))
    log.append_curve("adjoint_norms", it, steps, norms.numpy()[steps])


def add_rank_peaks(dist, row, device) -> None:
    """Distributed runs: ``peak_device_memory_max``, ``peak_host_memory_max``,
    ``peak_real_memory_max`` and ``peak_tracked_memory_max``, the largest peak over the
    ranks (the columns without ``_max`` stay rank 0's)."""
    from ..distributed import gather_floats, nanmax

    if not dist.enabled:
        return
    keys = ("peak_device_memory", "peak_host_memory", "peak_real_memory",
            "peak_tracked_memory")
    per_rank = gather_floats(dist, [row[k] for k in keys], device)   # every rank takes part
    if per_rank is None:
        return
    for j, k in enumerate(keys):
        row[f"{k}_max"] = nanmax([r[j] for r in per_rank])


def budget_bytes(ctx: Context) -> float:
    """The run's budget in bytes for the log row (NaN without one): the bytes resolved once
    at the start, or, with ``budget_once`` off, a ``"%"`` budget resolved again at the end of
    the iteration (what the next unroll will be given, up to memory that changes meanwhile)."""
    return math.nan if ctx.budget is None else float(ctx.budget.resolve(ctx.device))


class StatsSum:
    """The snapshot bytes of the unrolls of one loss evaluation, for the memory meter: those
    from ``start`` on (an L-BFGS iteration evaluates the loss several times, one after the
    other; their unrolls never hold snapshots at once)."""

    def __init__(self, stats):
        self.stats = stats
        self.start = 0

    @property
    def snapshot_bytes_peak(self) -> int:
        return sum(s.snapshot_bytes_peak for s in self.stats[self.start:])


class NoLog:
    """The log of ranks other than 0: they write nothing."""

    columns: list[str] = []

    def append(self, row):
        pass

    def flush(self, sync: bool = False):
        pass

    def close(self):
        pass

    def truncate_after(self, iteration):
        return 0

    def append_curve(self, *args):
        pass


def mirrored(log, logdir: str, start: int):
    """The log with its rows mirrored to TensorBoard event files in ``logdir`` (a resumed
    run hides the events a killed run wrote from ``start`` on)."""
    from ..io.tracking import MirroredLog, TensorBoardMirror

    try:
        return MirroredLog(log, TensorBoardMirror(logdir, purge_step=start or None))
    except BaseException:
        log.close()
        raise
