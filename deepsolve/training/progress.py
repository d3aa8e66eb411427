"""What a run prints: one-line notes on stderr, a tqdm bar on a terminal, one line per
``progress_every`` seconds off it (a batch job's output file)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["note", "progress", "Bar", "Lines"]


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


class Bar:
    """Progress on a terminal: a tqdm bar with the loss and the real peak."""

    def __init__(self, total: int, start: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True)

    def update(self, it: int, loss: float, row: Mapping[str, Any]) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3e}", mem=_fmt_mem(row.get("peak_real_memory")))

    def close(self) -> None:
        self.bar.close()


class Lines:
    """Progress off a terminal (a redirected or batch run): one line on stderr after the
    first iteration, then after any iteration that ends ``every`` seconds or more after the
    last line, and after the last iteration: iterations done, loss, seconds per iteration
    (the mean since the previous line, so a curriculum's longer stage shows at once), the
    iteration's real peak and the time left at that pace (or to ``deadline``, a
    ``time.perf_counter()`` at which a time limit stops the run, if sooner)."""

    def __init__(self, total: int, start: int, every: float, deadline: float | None = None):
        self.total, self.start, self.every, self.deadline = total, start, every, deadline
        self.last: float | None = None
        self.since, self.since_done = time.perf_counter(), start

    def update(self, it: int, loss: float, row: Mapping[str, Any]) -> None:
        now, done = time.perf_counter(), it + 1
        if self.last is not None and done < self.total and now - self.last < self.every:
            return
        self.last = now
        per = (now - self.since) / max(done - self.since_done, 1)
        self.since, self.since_done = now, done
        left = per * (self.total - done)
        if self.deadline is not None:
            left = min(left, max(self.deadline - now, 0.0))
        print(f"deepsolve train: iteration {done}/{self.total}  loss {loss:.4e}  "
              f"{per:.2f} s/it  peak {_fmt_mem(row.get('peak_real_memory'))}  "
              f"ETA {_fmt_time(left)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, start: int, quiet: bool, every: float = 30.0,
             deadline: float | None = None):
    """A tqdm bar on a terminal, one line per ``every`` seconds off it, nothing if quiet;
    ``deadline``: see :class:`Lines`."""
    if quiet:
        return None
    return Bar(total, start) if sys.stderr.isatty() else Lines(total, start, every, deadline)
