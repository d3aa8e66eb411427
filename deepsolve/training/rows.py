"""One iteration's log row: its loss terms checked, its memory columns and step counts, the
largest peaks over the ranks, and the adjoint-norm curve.

The row's columns (docs/problems.md, "The log"): ``iteration``, ``loss``, ``loss/<term>``,
``time``, ``time_forward``, ``time_backward``, ``peak_device_memory``, ``peak_real_memory``
(``max_memory_allocated`` above the iteration's start on CUDA, the RSS high-water mark above
the run's baseline on the CPU), ``peak_tracked_memory``, ``peak_host_memory``, ``advances``,
``recorded``, ``snapshots``, ``schedule``, ``compile_time``, ``lr``, ``grad_norm``, then
``budget_bytes``, ``n_steps`` (curricula), ``*_max`` (distributed runs) and ``metric/<name>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..problem import Context, ProblemError

__all__ = ["check_terms", "budget_bytes", "log_adjoint_norms", "add_rank_peaks", "StatsSum"]


def check_terms(terms: Any, it: int) -> dict[str, torch.Tensor]:
    if not isinstance(terms, Mapping) or not terms:
        raise ProblemError(f"residuals() must return a non-empty dict of named loss terms, got "
                           f"{type(terms).__name__} at iteration {it}")
    for k, v in terms.items():
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            raise ProblemError(f"loss term {k!r} must be a scalar tensor, got "
                               f"{type(v).__name__}{tuple(getattr(v, 'shape', ()))}")
    return dict(terms)


def log_adjoint_norms(log, it: int, stats) -> None:
    """The adjoint norms of the iteration's first unroll, at most ``CURVE_WIDTH`` points
    evenly spread over its steps ``0..n`` (the first and the last included)."""
    from ..io.h5log import CURVE_WIDTH

    norms = next((s.adjoint_norms for s in stats if isinstance(s.adjoint_norms, torch.Tensor)),
                 None)
    if norms is None:
        return
    n = len(norms) - 1
    steps = np.unique(np.round(np.linspace(0, n, min(n + 1, CURVE_WIDTH))).astype(np.int64))
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
