"""``deepsolve report RUN_DIR``: a text summary of a training log and PNG plots of it.

Only the ``iteration`` column is required; everything else follows the column convention of
docs/h5-log.md when present (``loss``, ``loss/<term>``, ``metric/<name>``, ``time``,
``time_forward``, ``time_backward``, ``peak_device_memory``, ``peak_host_memory``,
``advances``, ``recorded``, ``schedule``, ``lr``, ``grad_norm``) and is skipped when absent.

The work is bounded whatever the log holds: at most :data:`MAX_SERIES` loss terms and
metrics are drawn per plot and :data:`MAX_TABLE_ROWS` listed per table (the report says how
many were left out); the log itself is read by :func:`~deepsolve.io.read_log`, which checks
it before reading (see docs/h5-log.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .h5log import INT_MISSING, LogData, read_log

__all__ = ["report", "summarize", "plot_log", "ReportError", "MAX_SERIES", "MAX_TABLE_ROWS"]

_MIB = 2.0**20

MAX_SERIES = 20
"""Most loss terms (and most metrics) drawn in one plot; the first ones in column order."""

MAX_TABLE_ROWS = 50
"""Most loss terms (and most metrics) listed in the summary."""


class ReportError(ValueError):
    """The report cannot be written where asked; the message is one line."""


def _fmt(v: float) -> str:
    if v is None or not np.isfinite(v):
        return "nan"
    a = abs(v)
    if a != 0 and (a < 1e-3 or a >= 1e5):
        return f"{v:.4e}"
    return f"{v:.6g}"


def _finite(a: np.ndarray) -> np.ndarray:
    return np.isfinite(a)


def _numeric(log: LogData, name: str) -> np.ndarray | None:
    a = log.columns.get(name)
    if a is None or a.dtype.kind not in "iuf":
        return None
    out = a.astype(np.float64)
    if a.dtype.kind in "iu":
        out[a == INT_MISSING] = np.nan        # int columns mark a missing value with -1
    return out


def _last_finite(it: np.ndarray, a: np.ndarray) -> tuple[float, int] | None:
    ok = np.flatnonzero(_finite(a))
    if not len(ok):
        return None
    return float(a[ok[-1]]), int(it[ok[-1]])


def _first_finite(it: np.ndarray, a: np.ndarray) -> tuple[float, int] | None:
    ok = np.flatnonzero(_finite(a))
    if not len(ok):
        return None
    return float(a[ok[0]]), int(it[ok[0]])


def _prefixed(log: LogData, prefix: str) -> list[str]:
    return [c for c in log.columns if c.startswith(prefix) and len(c) > len(prefix)
            and log.columns[c].dtype.kind in "iuf"]


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.extend(_flatten(v, f"{prefix}{k}."))
        return out
    return [(prefix[:-1], d)]


def _short(v: Any, width: int = 60) -> str:
    s = repr(v) if isinstance(v, str) and not v else str(v)
    s = " ".join(s.split())
    return s if len(s) <= width else s[: width - 3] + "..."


def summarize(log: LogData) -> str:
    """The summary table of a log (what :func:`report` prints, without the file list)."""
    it = log.columns["iteration"]
    lines = []
    first_it = int(it[0]) if len(it) else None
    last_it = int(it[-1]) if len(it) else None
    span = f"iterations {first_it}..{last_it}" if len(it) else "no iterations"
    sv = log.attrs.get("schema_version", "?")
    lines.append(f"{'log':<17}{log.path}")
    lines.append(f"{'rows':<17}{log.n_rows} ({span}, schema {sv})")

    loss = _numeric(log, "loss")
    if loss is not None:
        last = _last_finite(it, loss)
        ok = np.flatnonzero(_finite(loss))
        if last is not None:
            b = ok[np.argmin(loss[ok])]
            lines.append(f"{'loss':<17}last {_fmt(last[0])} (iteration {last[1]}), "
                         f"best {_fmt(float(loss[b]))} (iteration {int(it[b])})")
        else:
            lines.append(f"{'loss':<17}no finite value")

    terms = _prefixed(log, "loss/")
    if terms:
        w = min(max(len(t) for t in terms[:MAX_TABLE_ROWS]), 60)
        lines.append("")
        lines.append(f"{'loss term':<{w}}  {'first':>12}  {'last':>12}")
        for t in terms[:MAX_TABLE_ROWS]:
            a = _numeric(log, t)
            f0, f1 = _first_finite(it, a), _last_finite(it, a)
            lines.append(f"{t:<{w}}  {_fmt(f0[0]) if f0 else 'nan':>12}  "
                         f"{_fmt(f1[0]) if f1 else 'nan':>12}")
        if len(terms) > MAX_TABLE_ROWS:
            lines.append(f"... ({len(terms) - MAX_TABLE_ROWS} more loss terms)")

    metrics = _prefixed(log, "metric/")
    if metrics:
        w = min(max(len(m) for m in metrics[:MAX_TABLE_ROWS]), 60)
        lines.append("")
        lines.append(f"{'metric (last finite)':<{max(w, 20)}}  {'value':>12}  iteration")
        for m in metrics[:MAX_TABLE_ROWS]:
            last = _last_finite(it, _numeric(log, m))
            val, at = (_fmt(last[0]), str(last[1])) if last else ("nan", "-")
            lines.append(f"{m:<{max(w, 20)}}  {val:>12}  {at}")
        if len(metrics) > MAX_TABLE_ROWS:
            lines.append(f"... ({len(metrics) - MAX_TABLE_ROWS} more metrics)")

    extra = []
    t = _numeric(log, "time")
    if t is not None and _finite(t).any():
        s = f"{'iteration time':<17}median {_fmt(float(np.median(t[_finite(t)])))} s"
        parts = []
        for name, label in (("time_forward", "forward"), ("time_backward", "backward")):
            a = _numeric(log, name)
            if a is not None and _finite(a).any():
                parts.append(f"{label} {_fmt(float(np.median(a[_finite(a)])))} s")
        if parts:
            s += " (" + ", ".join(parts) + ")"
        extra.append(s)
    mem = []
    for name, label in (("peak_device_memory", "device"), ("peak_host_memory", "host")):
        a = _numeric(log, name)
        if a is not None and _finite(a).any():
            mem.append(f"{label} {np.nanmax(a[_finite(a)]) / _MIB:.1f} MiB")
    if mem:
        extra.append(f"{'peak memory':<17}" + ", ".join(mem))
    evals = []
    for name, label in (("advances", "unrecorded"), ("recorded", "recorded")):
        a = _numeric(log, name)
        if a is not None:
            good = _finite(a) & (a >= 0)
            evals.append(f"{int(a[good].sum())} {label}")
    if evals:
        extra.append(f"{'step evaluations':<17}" + ", ".join(evals))
    for name, label in (("lr", "last lr"), ("grad_norm", "last grad_norm")):
        a = _numeric(log, name)
        if a is not None:
            last = _last_finite(it, a)
            if last is not None:
                extra.append(f"{label:<17}{_fmt(last[0])}")
    sched = log.columns.get("schedule")
    if sched is not None and sched.dtype.kind in "US" and len(sched):
        kinds, counts = np.unique(sched, return_counts=True)
        order = np.argsort(-counts, kind="stable")
        used = [f"{kinds[i] or '(none)'} ({counts[i]} rows)" for i in order]
        extra.append(f"{'schedules':<17}" + ", ".join(used))
    if extra:
        lines.append("")
        lines.extend(extra)

    config = log.attrs.get("config")
    if config is not None:
        lines.append("")
        lines.append("config")
        items = _flatten(config) if isinstance(config, dict) else [("config", config)]
        items = [(k, v) for k, v in items if k]
        if items:
            w = min(max(len(k) for k, _ in items), 32)
            for k, v in items[:40]:
                lines.append(f"  {k:<{w}} = {_short(v)}")
            if len(items) > 40:
                lines.append(f"  ... ({len(items) - 40} more entries)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ plots


def _plot(path: Path, it: np.ndarray, series: list[tuple[str, np.ndarray, dict]],
          ylabel: str, title: str, logy: bool) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = it.astype(np.float64)
    for label, y, style in series:
        ok = _finite(y)
        if not ok.any():
            continue
        sparse = ok.sum() < 0.5 * len(y)      # e.g. metrics evaluated every k iterations
        ax.plot(x[ok], y[ok], label=label, marker="o" if sparse else None,
                markersize=3, **style)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _positive(series: list[tuple[str, np.ndarray, dict]]) -> bool:
    vals = [y[_finite(y)] for _, y, _ in series]
    vals = [v for v in vals if len(v)]
    return bool(vals) and all((v > 0).all() for v in vals)


def _has_data(series: list[tuple[str, np.ndarray, dict]]) -> bool:
    return any(_finite(y).any() for _, y, _ in series)


def _out_dir(out_dir: str | os.PathLike, make: bool) -> Path:
    """The directory for the plots: refuse a path that is not a directory; make it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: not a directory; give a directory for the plots")
    if make:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ReportError(f"--out {out}: cannot make the directory "
                              f"({e.strerror or e})") from None
    return out


def _save(p: Path, *args: Any) -> None:
    try:
        _plot(p, *args)
    except OSError as e:
        raise ReportError(f"--out {p.parent}: cannot write {p.name} "
                          f"({e.strerror or ' '.join(str(e).split())})") from None


def plot_log(log: LogData, out_dir: str | os.PathLike) -> list[Path]:
    """Write loss.png, memory.png, time.png and metrics.png (each when it has data). At most
    :data:`MAX_SERIES` loss terms and metrics are drawn (the first ones in column order).

    Raises:
        ReportError: ``out_dir`` is not a directory or cannot be written.
    """
    return _plot_all(log, out_dir)[0]


def _plot_all(log: LogData,
              out_dir: str | os.PathLike) -> tuple[list[Path], dict[str, tuple[int, int]]]:
    """:func:`plot_log`, and what it left out: plot file name -> (drawn, of how many)."""
    out = _out_dir(out_dir, make=True)
    it = log.columns["iteration"]
    written: list[Path] = []
    left_out: dict[str, tuple[int, int]] = {}

    loss = []
    a = _numeric(log, "loss")
    if a is not None:
        loss.append(("loss (total)", a, {"color": "black", "lw": 1.8}))
    terms = _prefixed(log, "loss/")
    for t in terms[:MAX_SERIES]:
        loss.append((t[len("loss/"):], _numeric(log, t), {"lw": 1.0}))
    if _has_data(loss):
        p = out / "loss.png"
        title = "training loss"
        if len(terms) > MAX_SERIES:
            left_out[p.name] = (MAX_SERIES, len(terms))
            title += f" (first {MAX_SERIES} of {len(terms)} terms)"
        _save(p, it, loss, "loss", title, _positive(loss))
        written.append(p)

    mem = []
    for name, label in (("peak_device_memory", "peak device"), ("peak_host_memory", "peak host")):
        a = _numeric(log, name)
        if a is not None:
            mem.append((label, a / _MIB, {}))
    if _has_data(mem):
        p = out / "memory.png"
        _save(p, it, mem, "MiB", "peak memory per iteration", False)
        written.append(p)

    times = []
    for name, label in (("time", "iteration"), ("time_forward", "forward"),
                        ("time_backward", "backward")):
        a = _numeric(log, name)
        if a is not None:
            times.append((label, a, {}))
    if _has_data(times):
        p = out / "time.png"
        _save(p, it, times, "seconds", "time per iteration", False)
        written.append(p)

    names = _prefixed(log, "metric/")
    metrics = [(m[len("metric/"):], _numeric(log, m), {}) for m in names[:MAX_SERIES]]
    if _has_data(metrics):
        p = out / "metrics.png"
        title = "metrics"
        if len(names) > MAX_SERIES:
            left_out[p.name] = (MAX_SERIES, len(names))
            title += f" (first {MAX_SERIES} of {len(names)})"
        _save(p, it, metrics, "value", title, _positive(metrics))
        written.append(p)
    return written, left_out


def report(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None,
           locking: bool | None = None) -> str:
    """Summarize ``run_dir/log.h5`` (``run_dir`` may also be the log file itself).

    Returns the summary table followed by the list of PNG files written into ``out_dir``
    (default: the run directory): ``loss.png``, ``memory.png``, ``time.png`` and
    ``metrics.png``, each when the log has the columns it plots.

    Raises:
        LogError: (one line) the log is missing, truncated, corrupt or has no iterations.
        ReportError: (one line) ``out_dir`` is not a directory or cannot be written.
    """
    rd = Path(run_dir)
    log_path = rd if rd.suffix in (".h5", ".hdf5") and not rd.is_dir() else rd / "log.h5"
    target = Path(out_dir) if out_dir is not None else log_path.parent
    if out_dir is not None:
        _out_dir(target, make=False)          # fail before reading when it cannot work
    log = read_log(log_path, locking=locking)
    files, left_out = _plot_all(log, target)
    text = summarize(log)
    lines = [text, "", "plots"]
    if files:
        for p in files:
            drawn = left_out.get(p.name)
            what = "terms" if p.name == "loss.png" else "metrics"
            lines.append(f"  {p}" + (f" (the first {drawn[0]} of {drawn[1]} {what})"
                                      if drawn else ""))
    else:
        lines.append("  (none: the log has no plottable columns)")
    return "\n".join(lines)
