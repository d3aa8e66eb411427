"""What a run prints: one-line notes on stderr, a tqdm bar on a terminal, one line per
``progress_every`` seconds off it (a batch job's output file).

The time left is estimated from the work left, not the iterations: under a horizon
curriculum (``--set curriculum=0:100,30:300,60:1000``) an iteration of the 1000-step stage
unrolls ten times as many steps as one of the 100-step stage and takes about ten times as
long. The pace is measured per unrolled step (:func:`work`: the iterations' horizons
summed) and multiplied by the steps the remaining iterations unroll, so the estimate does
not jump up at each stage.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["note", "progress", "Bar", "Lines", "work"]

#: A horizon curriculum as :func:`deepsolve.config.parse_curriculum` gives it:
#: ``((start_iteration, steps), ...)``, the starts increasing, the first stage also covering
#: the iterations before its start; ``()``: no curriculum.
Stages = Sequence[tuple[int, int]]


def note(msg: str) -> None:
    """One line on stderr (the trainer's notes and warnings)."""
    print(f"deepsolve train: {msg}", file=sys.stderr, flush=True)


def _fmt_mem(x) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x / 2**20:.0f}MiB"


def _fmt_time(seconds: float) -> str:
    s = max(int(round(seconds)), 0)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def work(stages: Stages, first: int, end: int) -> float:
    """The work of iterations ``first <= i < end`` in unrolled steps: the sum of their
    horizons under the curriculum ``stages`` (in closed form, stage by stage, as
    :func:`deepsolve.config.horizon` assigns them), or ``end - first`` without one (each
    iteration one unit)."""
    if end <= first:
        return 0.0
    if not stages:
        return float(end - first)
    total = 0.0
    for j, (begin, steps) in enumerate(stages):
        lo = -math.inf if j == 0 else begin          # the first stage: everything before it
        hi = stages[j + 1][0] if j + 1 < len(stages) else math.inf
        n = min(end, hi) - max(first, lo)
        if n > 0:
            total += n * steps
    return total


class Bar:
    """Progress on a terminal: a tqdm bar with the loss and the real peak. Under a
    curriculum (``stages``) the bar counts unrolled steps (:func:`work`), so that its rate
    and the time left weigh each iteration by its horizon; the iteration is in the
    postfix."""

    def __init__(self, total: int, start: int, stages: Stages = ()):
        from tqdm import tqdm

        self.stages, self.total = tuple(stages), total
        if self.stages:
            self.bar = tqdm(total=work(self.stages, 0, total),
                            initial=work(self.stages, 0, start), unit="step",
                            dynamic_ncols=True,
                            bar_format="{percentage:3.0f}%|{bar}| [{elapsed}<{remaining}"
                                       "{postfix}]")
        else:
            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True)

    def update(self, it: int, loss: float, row: Mapping[str, Any]) -> None:
        self.bar.update(work(self.stages, it, it + 1))
        extra = {"it": f"{it + 1}/{self.total}"} if self.stages else {}
        self.bar.set_postfix(**extra, loss=f"{loss:.3e}",
                             mem=_fmt_mem(row.get("peak_real_memory")))

    def close(self) -> None:
        self.bar.close()


class Lines:
    """Progress off a terminal (a redirected or batch run): one line on stderr after the
    first iteration, then after any iteration that ends ``every`` seconds or more after the
    last line, and after the last iteration: iterations done, loss, seconds per iteration
    (the mean since the previous line, so a curriculum's longer stage shows at once), the
    iteration's real peak and the time left: the seconds per unrolled step since the
    previous line times the steps the remaining iterations unroll under the curriculum
    ``stages`` (:func:`work`; without one, seconds per iteration times the iterations
    left), or the time to ``deadline``, a ``time.perf_counter()`` at which a time limit
    stops the run, if sooner."""

    def __init__(self, total: int, start: int, every: float, deadline: float | None = None,
                 stages: Stages = ()):
        self.total, self.start, self.every, self.deadline = total, start, every, deadline
        self.stages = tuple(stages)
        self.last: float | None = None
        self.since, self.since_done = time.perf_counter(), start

    def update(self, it: int, loss: float, row: Mapping[str, Any]) -> None:
        now, done = time.perf_counter(), it + 1
        if self.last is not None and done < self.total and now - self.last < self.every:
            return
        self.last = now
        per = (now - self.since) / max(done - self.since_done, 1)
        units = work(self.stages, self.since_done, done)
        per_unit = (now - self.since) / units if units > 0 else per
        self.since, self.since_done = now, done
        left = per_unit * work(self.stages, done, self.total)
        if self.deadline is not None:
            left = min(left, max(self.deadline - now, 0.0))
        print(f"deepsolve train: iteration {done}/{self.total}  loss {loss:.4e}  "
              f"{per:.2f} s/it  peak {_fmt_mem(row.get('peak_real_memory'))}  "
              f"ETA {_fmt_time(left)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, start: int, quiet: bool, every: float = 30.0,
             deadline: float | None = None, stages: Stages = ()) -> Bar | Lines | None:
    """A tqdm bar on a terminal, one line per ``every`` seconds off it, nothing if quiet;
    ``deadline``: see :class:`Lines`; ``stages``: the horizon curriculum, whose stages
    weigh the iterations left in the time left (:func:`work`)."""
    if quiet:
        return None
    if sys.stderr.isatty():
        return Bar(total, start, stages)
    return Lines(total, start, every, deadline, stages)
