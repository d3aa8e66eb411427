"""``deepsolve report RUN_DIR``: a text summary of a training log and PNG plots of it.

Only the ``iteration`` column is required; everything else follows the column convention of
docs/h5-log.md when present (``loss``, ``loss/<term>``, ``metric/<name>``, ``time``,
``time_forward``, ``time_backward``, ``peak_real_memory``, ``peak_tracked_memory``,
``peak_device_memory``, ``peak_host_memory``, ``budget_bytes``, ``advances``, ``recorded``,
``schedule``, ``lr``, ``grad_norm``; the attributes ``device``, ``weights``,
``initial_metrics``, ``budget_bytes`` and ``threads``, the thread count the run used, which
the config table shows beside a ``threads`` setting of 0) and is skipped when absent.

The plots (:func:`figures` builds them as matplotlib figures, :func:`plot_log` saves them):
``loss.png`` the total loss and each term weighted (``w * loss/<term>``, so they add up to
the total); ``memory.png`` the real peak of the whole iteration and the tracked peak,
labelled for the device, and the budget as a dashed line labelled for what it bounds (what
the unroll adds to the peak, not the whole iteration); ``time.png``; ``metrics.png`` one
panel per group of metrics (names sharing their first ``_``-separated token) or per metric,
each on its own axis, with the value before training (``initial_metrics``) as a marker at
iteration -1; ``gradients.png`` the gradient norm before clipping (``grad_norm``) against
iteration and, for a run with ``adjoint_every``, the adjoint norms ``||dL/dx_i||`` against
step ``i``, one curve per logged iteration (at most :data:`MAX_CURVES`), both on log scales;
``evaluation.png`` the curves the problem's evaluation returns (:class:`deepsolve.Curve`,
an error against rollout step say) at the last evaluation, beside the model as built.
They are written into the run directory (or ``--out``) as a temporary file renamed over the
name, so a symbolic link planted at ``RUN_DIR/loss.png`` is replaced, never written through.

The work is bounded whatever the log holds: at most :data:`MAX_SERIES` loss terms and
metrics are drawn per plot, in at most :data:`MAX_PANELS` metric panels, and
:data:`MAX_TABLE_ROWS` listed per table (the report says how many were left out); the log
itself is read by :func:`~deepsolve.io.read_log`, which checks it before reading (see
docs/h5-log.md).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from .h5log import INT_MISSING, LogData, read_log

__all__ = ["report", "summarize", "plot_log", "figures", "ReportError", "MAX_SERIES",
           "MAX_PANELS", "MAX_TABLE_ROWS", "REAL_PEAK", "BUDGET"]

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


def _bytes(v: float) -> str:
    """Bytes in MiB (KiB below 0.1 MiB, where MiB would print 0.0)."""
    return f"{v / 1024:.1f} KiB" if abs(v) < 0.1 * _MIB else f"{v / _MIB:.1f} MiB"


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


_MAX_SCHEDULES = 10      # most schedule descriptions listed in the summary


def _summary_memory(log: LogData) -> list[tuple[str, str]]:
    """(column, label) of the memory figures in the summary: the largest peak of each."""
    kind = _device_kind(log)
    if "peak_real_memory" in log.columns:
        real = {"cpu": "real, whole iteration (RSS above baseline)",
                "cuda": "real, whole iteration (max_memory_allocated)"}.get(
                    kind or "", "real, whole iteration")
        out = [("peak_real_memory", real), ("peak_tracked_memory", "tracked")]
        if kind != "cuda":
            out.append(("peak_host_memory", "process RSS"))
        return out
    if kind == "cuda":
        return [("peak_device_memory", "real (max_memory_allocated)")]
    if kind == "cpu":
        return [("peak_device_memory", "tracked"), ("peak_host_memory", "process RSS")]
    return [("peak_device_memory", "device"), ("peak_host_memory", "host")]


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
        weights = _weights(log)
        w = min(max(len(t) for t in terms[:MAX_TABLE_ROWS]), 60)
        lines.append("")
        head = f"{'loss term':<{w}}  {'first':>12}  {'last':>12}"
        lines.append(head + (f"  {'weight':>10}" if weights is not None else ""))
        for t in terms[:MAX_TABLE_ROWS]:
            a = _numeric(log, t)
            assert a is not None  # _prefixed lists numeric columns
            f0, f1 = _first_finite(it, a), _last_finite(it, a)
            row = (f"{t:<{w}}  {_fmt(f0[0]) if f0 else 'nan':>12}  "
                   f"{_fmt(f1[0]) if f1 else 'nan':>12}")
            if weights is not None:
                row += f"  {_fmt(weights.get(t[len('loss/'):], 1.0)):>10}"
            lines.append(row)
        if len(terms) > MAX_TABLE_ROWS:
            lines.append(f"... ({len(terms) - MAX_TABLE_ROWS} more loss terms)")
        if weights is not None:
            lines.append("(terms unweighted; loss = sum of weight × term)")

    metrics = _prefixed(log, "metric/")
    if metrics:
        init = _initial_metrics(log) if "initial_metrics" in log.attrs else None
        w = max(min(max(len(m) for m in metrics[:MAX_TABLE_ROWS]), 60), 6)
        lines.append("")
        before = f"  {_BEFORE:>15}" if init is not None else ""
        lines.append(f"{'metric':<{w}}{before}  {'first':>12}  {'last':>12}  iterations")
        for m in metrics[:MAX_TABLE_ROWS]:
            a = _numeric(log, m)
            assert a is not None  # _prefixed lists numeric columns
            f0, f1 = _first_finite(it, a), _last_finite(it, a)
            row = f"{m:<{w}}"
            if init is not None:
                v = init.get(m[len("metric/"):])
                row += f"  {_fmt(v) if v is not None else '-':>15}"
            row += (f"  {_fmt(f0[0]) if f0 else 'nan':>12}  {_fmt(f1[0]) if f1 else 'nan':>12}"
                    f"  {f'{f0[1]}..{f1[1]}' if f0 and f1 else '-'}")
            lines.append(row)
        if len(metrics) > MAX_TABLE_ROWS:
            lines.append(f"... ({len(metrics) - MAX_TABLE_ROWS} more metrics)")

    extra = []
    secs = _numeric(log, "time")
    if secs is not None and _finite(secs).any():
        s = f"{'iteration time':<17}median {_fmt(float(np.median(secs[_finite(secs)])))} s"
        parts = []
        for name, label in (("time_forward", "forward"), ("time_backward", "backward")):
            a = _numeric(log, name)
            if a is not None and _finite(a).any():
                parts.append(f"{label} {_fmt(float(np.median(a[_finite(a)])))} s")
        if parts:
            s += " (" + ", ".join(parts) + ")"
        extra.append(s)
    mem = []
    for name, label in _summary_memory(log):
        a = _numeric(log, name)
        if a is not None and _finite(a).any():
            mem.append(f"{label} {_bytes(float(np.nanmax(a[_finite(a)])))}")
    budget = _budget(log)
    if mem and budget is not None:
        mem.append(f"budget of the unroll {_bytes(float(np.nanmax(budget)))}")
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
        used = [f"{kinds[i] or '(none)'} ({counts[i]} rows)" for i in order[:_MAX_SCHEDULES]]
        if len(order) > _MAX_SCHEDULES:
            used.append(f"... ({len(order) - _MAX_SCHEDULES} more schedules)")
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
            ran_with = _number(log.attrs.get("threads"))   # what the run used
            for k, v in items[:40]:
                shown = _short(v)
                if k == "threads" and ran_with is not None and _number(v) != ran_with:
                    why = "the default, OMP_NUM_THREADS or 1" if _number(v) == 0 else "asked"
                    shown = f"{int(ran_with)} (used; the setting is {shown}: {why})"
                lines.append(f"  {k:<{w}} = {shown}")
            if len(items) > 40:
                lines.append(f"  ... ({len(items) - 40} more entries)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ plots

MAX_PANELS = 12
"""Most panels of metrics.png (a grid of at most 4 rows of 3); the first ones in column order."""

_TRACKED = "tracked by deepsolve (saved tensors + snapshots)"
#: What memory.png calls the real peak and the budget: the budget bounds what the unroll adds
#: to the peak (docs/budget.md); the real peak is the whole iteration's (the unroll under its
#: budget, the optimiser, the model and data, what the step profile leaves resident), so it
#: may well lie above the budget line without the budget having been broken.
REAL_PEAK = "real peak of the whole iteration"
BUDGET = "budget: bounds what the unroll adds to the peak"
_BEFORE = "before training"

_Series = tuple[str, np.ndarray, dict]
_Built = tuple[Any, "tuple[int, int] | None"]       # (Figure or None, (drawn, of how many))


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _draw(ax, x: np.ndarray, series: list[_Series]) -> None:
    for label, y, style in series:
        ok = _finite(y)
        if not ok.any():
            continue
        sparse = ok.sum() < 0.5 * len(y)      # e.g. metrics evaluated every k iterations
        ax.plot(x[ok], y[ok], label=label, marker="o" if sparse else None,
                markersize=3, **style)


def _finish(ax, xlabel: str, ylabel: str, title: str, **legend: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))    # iterations
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, **legend)


def _values(arrays: list[Any]) -> np.ndarray:
    vals = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    vals = [v[_finite(v)] for v in vals]
    return np.concatenate(vals) if vals else np.zeros(0)


def _wide_positive(arrays: list[Any]) -> bool:
    """Whether a panel is drawn on a log axis: its finite values are all positive and span more
    than a factor of 10."""
    v = _values(arrays)
    return bool(len(v)) and bool((v > 0).all()) and float(v.max()) > 10.0 * float(v.min())


def _positive(series: list[_Series]) -> bool:
    vals = [y[_finite(y)] for _, y, _ in series]
    vals = [v for v in vals if len(v)]
    return bool(vals) and all((v > 0).all() for v in vals)


def _has_data(series: list[_Series]) -> bool:
    return any(_finite(y).any() for _, y, _ in series)


def _number(v: Any) -> float | None:
    """``v`` as a finite float, ``None`` when it is not one (attributes are data from outside)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _numbers(log: LogData, attr: str) -> dict[str, float] | None:
    """A dict attribute's finite numeric entries; ``None`` when the log has no such dict."""
    d = log.attrs.get(attr)
    if not isinstance(d, dict):
        return None
    return {str(k): f for k, v in d.items() if (f := _number(v)) is not None}


def _weights(log: LogData) -> dict[str, float] | None:
    """The ``weights`` attribute (term -> weight); ``None`` when the log has none."""
    return _numbers(log, "weights")


def _initial_metrics(log: LogData) -> dict[str, float]:
    """The ``initial_metrics`` attribute (metric -> value before training); ``{}`` without."""
    return _numbers(log, "initial_metrics") or {}


def _device_kind(log: LogData) -> str | None:
    """``"cuda"``, ``"cpu"``, or ``None`` where the ``device`` attribute does not say."""
    dev = log.attrs.get("device")
    if isinstance(dev, str):
        for kind in ("cuda", "cpu"):
            if dev.strip().lower().startswith(kind):
                return kind
    return None


def _loss_figure(log: LogData, x: np.ndarray) -> _Built:
    """The total loss and its terms, each term weighted (``w * loss/<term>``, w from the
    ``weights`` attribute, 1 where it has none) so that they add up to the total."""
    series: list[_Series] = []
    a = _numeric(log, "loss")
    if a is not None:
        series.append(("loss (total)", a, {"color": "black", "lw": 1.8}))
    terms = _prefixed(log, "loss/")
    weights = _weights(log)
    for t in terms[:MAX_SERIES]:
        name = t[len("loss/"):]
        a = _numeric(log, t)
        assert a is not None  # _prefixed lists numeric columns
        if weights is None:
            series.append((name, a, {"lw": 1.0}))
        else:
            w = weights.get(name, 1.0)
            series.append((f"{w:g} × {name}", w * a, {"lw": 1.0}))
    if not _has_data(series):
        return None, None
    if not terms:
        title = "training loss"
    elif weights is None:
        title = "training loss and its terms (the log has no weights: drawn as logged)"
    else:
        title = "training loss and its weighted terms (weight × term; they add up to the total)"
    cut = None
    if len(terms) > MAX_SERIES:
        cut = (MAX_SERIES, len(terms))
        title += f"\n(first {MAX_SERIES} of {len(terms)} terms)"
    fig = _new_figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, x, series)
    if _positive(series):
        ax.set_yscale("log")
    _finish(ax, "iteration", "loss", title)
    return fig, cut


def _memory_columns(log: LogData) -> list[tuple[str, str, dict]]:
    """(column, label, style) of the memory curves, labelled for what they measured."""
    kind = _device_kind(log)
    real = {"cpu": REAL_PEAK + " (RSS above the run's baseline)",
            "cuda": REAL_PEAK + " (max_memory_allocated)"}.get(kind or "", REAL_PEAK)
    rss = {"color": "0.45", "ls": ":", "lw": 1.2}
    if "peak_real_memory" in log.columns:
        cols: list[tuple[str, str, dict]] = [("peak_real_memory", real, {"color": "C0", "lw": 1.6}),
                ("peak_tracked_memory", _TRACKED, {"color": "C1"})]
        if kind != "cuda":      # on CUDA the RSS is the host's, a running mark of the run
            cols.append(("peak_host_memory", "process RSS peak in the iteration (absolute)",
                         rss))
        return cols
    # a log from before peak_real_memory: the old columns, for what they held
    if kind == "cuda":
        return [("peak_device_memory", real, {"color": "C0", "lw": 1.6})]
    if kind == "cpu":
        return [("peak_device_memory", _TRACKED, {"color": "C1"}),
                ("peak_host_memory", "process RSS high-water mark (absolute)", rss)]
    return [("peak_device_memory", "peak_device_memory", {"color": "C0"}),
            ("peak_host_memory", "peak_host_memory", {"color": "C2"})]


def _budget(log: LogData) -> np.ndarray | float | None:
    """The budget in bytes: the ``budget_bytes`` column (per iteration) where it has values,
    else the ``budget_bytes`` attribute; ``None`` without a budget."""
    b = _numeric(log, "budget_bytes")
    if b is not None and (_finite(b) & (b > 0)).any():
        return b
    v = _number(log.attrs.get("budget_bytes"))
    return v if v is not None and v > 0 else None


def _memory_figure(log: LogData, x: np.ndarray) -> _Built:
    series: list[_Series] = []
    for name, label, style in _memory_columns(log):
        a = _numeric(log, name)
        if a is not None:
            series.append((label, a / _MIB, style))
    if not _has_data(series):
        return None, None
    budget = _budget(log)
    data = [y for _, y, _ in series]
    b = None if budget is None else np.asarray(budget, dtype=np.float64) / _MIB
    logy = _wide_positive(data + ([b] if b is not None else []))
    fig = _new_figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, x, series)
    top = float(_values(data).max()) if len(_values(data)) else 0.0
    if b is not None:
        bv = _values([b])
        label = BUDGET
        cut_axis = not logy and top > 0 and float(bv.min()) > 10 * top
        if cut_axis:            # a linear axis up to the budget would flatten every curve
            label = f"{BUDGET} ({_fmt(float(bv.max()))} MiB, above the plot)"
        style = {"color": "red", "ls": "--", "lw": 1.2}
        if b.ndim == 0 or float(bv.min()) == float(bv.max()):
            ax.axhline(float(bv.max()), label=label, **style)
        else:
            ok = _finite(b)
            ax.plot(x[ok], b[ok], label=label, drawstyle="steps-post", **style)
        if cut_axis:
            ax.set_ylim(0, 1.15 * top)
    if logy:
        ax.set_yscale("log")
    dev = log.attrs.get("device")
    where = f" ({_short(dev, 20)})" if isinstance(dev, str) and dev else ""
    title = f"peak memory per iteration{where}"
    if b is not None and "peak_real_memory" in log.columns:
        title += ("\nthe budget bounds what the unroll adds; the real peak is the whole "
                  "iteration's")
    _finish(ax, "iteration", "MiB", title)
    return fig, None


def _time_figure(log: LogData, x: np.ndarray) -> _Built:
    times: list[_Series] = []
    for name, label in (("time", "iteration"), ("time_forward", "forward"),
                        ("time_backward", "backward")):
        a = _numeric(log, name)
        if a is not None:
            times.append((label, a, {}))
    if not _has_data(times):
        return None, None
    fig = _new_figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, x, times)
    _finish(ax, "iteration", "seconds", "time per iteration")
    return fig, None


def _common_prefix(names: list[str]) -> str:
    """The underscore-separated tokens all ``names`` start with (``rel_err`` for
    ``rel_err_closure`` and ``rel_err_coarse``)."""
    out = []
    for parts in zip(*(n.split("_") for n in names), strict=False):
        if any(p != parts[0] for p in parts):
            break
        out.append(parts[0])
    return "_".join(out)


def _metric_panels(log: LogData) -> tuple[list[tuple[str, list[str], int]], list[str], int]:
    """How metrics.png groups the metrics: ``(panels, with_values, total)``, ``panels`` a list
    of ``(title, metric names drawn in it, metrics in its group)``, ``with_values`` the names of
    the metrics that have values, ``total`` the number of metric columns.

    Metrics whose names share their first underscore-separated token with at least one other
    metric share a panel, titled by the tokens they all start with; every other metric has
    its own panel, titled by its name. Metrics with no finite value (and no value before
    training) are not drawn. At most :data:`MAX_PANELS` panels and :data:`MAX_SERIES`
    metrics are drawn, the first ones in column order."""
    cols = _prefixed(log, "metric/")
    init = _initial_metrics(log)
    names = [c[len("metric/"):] for c in cols
             # _prefixed lists numeric columns: _numeric gives an array
             if _finite(cast(np.ndarray, _numeric(log, c))).any() or c[len("metric/"):] in init]
    first = [n.split("_", 1)[0] for n in names]
    count: dict[str, int] = {}
    for f in first:
        count[f] = count.get(f, 0) + 1
    groups: dict[tuple[str, str], list[str]] = {}    # in the order of their first member
    for n, f in zip(names, first, strict=True):
        groups.setdefault(("group", f) if count[f] > 1 else ("metric", n), []).append(n)
    panels = []
    drawn = 0
    for (how, key), members in list(groups.items())[:MAX_PANELS]:
        take = members[:MAX_SERIES - drawn]
        if not take:
            break
        title = (_common_prefix(members) or key) if how == "group" else key
        panels.append((title, take, len(members)))
        drawn += len(take)
    return panels, names, len(cols)


def _metrics_figure(log: LogData, x: np.ndarray) -> _Built:
    panels, with_values, total = _metric_panels(log)
    if not panels:
        return None, None
    init = _initial_metrics(log)
    n = len(panels)
    ncols = 1 if n == 1 else 2 if n <= 4 else 3
    nrows = -(-n // ncols)
    fig = _new_figure(7.5 if ncols == 1 else 5.0 * ncols, 3.4 * nrows + 0.6)
    any_before = False
    for k, (title, members, of) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        values: list[Any] = []
        colors = {m: f"C{j % 10}" for j, m in enumerate(members)}
        for m in members:
            y = _numeric(log, "metric/" + m)
            assert y is not None  # a metric column (from _prefixed)
            _draw(ax, x, [(m, y, {"color": colors[m]})])
            values.append(y)
        labelled = False
        for m in members:       # the model as built: a marker at iteration -1
            if m in init:
                ax.plot([-1.0], [init[m]], ls="none", marker="D", markersize=6,
                        markerfacecolor="white", markeredgecolor=colors[m],
                        markeredgewidth=1.5, label=_BEFORE if not labelled else "_" + _BEFORE)
                values.append([init[m]])
                labelled = any_before = True
        if _wide_positive(values):
            ax.set_yscale("log")
        if len(members) < of:
            title += f" (first {len(members)} of {of})"
        _finish(ax, "iteration", "", title)
        legend = ax.get_legend()
        if legend is not None and len(legend.get_texts()) < 2:   # one curve: titled by it
            legend.remove()
    header = "metrics"
    if any_before:
        header += f" (◇ at iteration -1: {_BEFORE})"
    cut = None
    shown = {m for _, members, _ in panels for m in members}
    if len(shown) < len(with_values):
        cut = (len(shown), total)
        rest = [m for m in with_values if m not in shown]
        header += (f"\nfirst {len(shown)} of {total} metrics drawn (at most {MAX_SERIES} in "
                   f"{MAX_PANELS} panels); not drawn: {_short(', '.join(rest[:4]), 50)}"
                   + (f" and {len(rest) - 4} more" if len(rest) > 4 else ""))
    fig.suptitle(header, fontsize=11)
    return fig, cut


MAX_CURVES = 12
"""Adjoint-norm curves drawn in gradients.png at most (spread over the logged iterations)."""


def _gradients_figure(log: LogData, x: np.ndarray) -> _Built:
    """The global gradient norm (before clipping) against iteration and, where the run
    logged them (``adjoint_every``), the adjoint norms ``||dL/dx_i||`` against step ``i``,
    one curve per logged iteration (log scales)."""
    from .h5log import LogError, read_curves

    g = _numeric(log, "grad_norm")
    curves = None
    if log.path:
        with contextlib.suppress(LogError, OSError):
            curves = read_curves(log.path, "adjoint_norms")
            if not len(curves["iteration"]):
                curves = None
    has_g = g is not None and _finite(g).any()
    if not has_g and curves is None:
        return None, None
    panels = int(has_g) + int(curves is not None)
    fig = _new_figure(6.0 * panels, 4.5)
    k = 1
    if curves is not None:
        ax = fig.add_subplot(1, panels, k)
        k += 1
        its = curves["iteration"]
        pick = np.unique(np.round(np.linspace(0, len(its) - 1, min(len(its), MAX_CURVES))))
        from matplotlib import colormaps

        cmap = colormaps["viridis"]
        for j, r in enumerate(pick.astype(int)):
            s, v = curves["step"][r], curves["value"][r]
            ok = (s >= 0) & np.isfinite(v) & (v > 0)
            ax.plot(s[ok], v[ok], color=cmap(j / max(len(pick) - 1, 1)),
                    label=f"iteration {int(its[r])}")
        ax.set_yscale("log")
        title = "adjoint norm ||dL/dx_i||"
        if len(pick) < len(its):
            title += f" ({len(pick)} of {len(its)} logged iterations)"
        _finish(ax, "step i", "norm", title)
    if has_g:
        assert g is not None  # has_g
        ax = fig.add_subplot(1, panels, k)
        _draw(ax, x, [("grad_norm", g, {})])
        if _positive([("grad_norm", g, {})]):
            ax.set_yscale("log")
        _finish(ax, "iteration", "norm", "gradient norm (before clipping)")
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
    return fig, None


def _curve_points(c: Mapping[str, np.ndarray], r: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ``r`` of a curve group without its padding."""
    s, v = c["step"][r], c["value"][r]
    ok = (s >= 0) & np.isfinite(v)
    return s[ok], v[ok]


def _evaluation_figure(log: LogData, x: np.ndarray) -> _Built:
    """The curves the problem's evaluation returned (:class:`deepsolve.Curve`, the log's
    groups ``eval_<name>``; an error against rollout step, say): each at the last evaluated
    iteration (solid) and, where it differs, as the model was built (iteration -1, dashed),
    in one panel."""
    from .h5log import LogError, curve_names, read_curves

    if not log.path:
        return None, None
    try:
        names = [n for n in curve_names(log.path) if n.startswith("eval_")]
        curves = {n[len("eval_"):]: read_curves(log.path, n) for n in names}
    except (LogError, OSError):
        return None, None
    curves = {k: c for k, c in curves.items() if len(c["iteration"])}
    if not curves:
        return None, None
    from matplotlib import colormaps

    fig = _new_figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["tab10"]
    last_it = None
    for j, (name, c) in enumerate(sorted(curves.items())[:MAX_CURVES]):
        its = c["iteration"]
        color = cmap(j % 10)

        last = int(np.argmax(its))
        s1, v1 = _curve_points(c, last)
        last_it = int(its[last])
        ax.plot(s1, v1, color=color, label=name if last_it >= 0 else f"{name} (as built)")
        first = np.flatnonzero(its == -1)
        if len(first) and last_it >= 0:
            s0, v0 = _curve_points(c, int(first[0]))
            if s0.shape != s1.shape or not np.allclose(v0, v1, equal_nan=True):
                ax.plot(s0, v0, color=color, linestyle="--", label=f"{name} (as built)")
    title = "evaluation"
    if last_it is not None and last_it >= 0:
        title += f" after iteration {last_it + 1}"
    _finish(ax, "step", "value", title)
    return fig, None


def figures(log: LogData) -> dict[str, Any]:
    """The report's plots as matplotlib ``Figure`` objects, by file name (``loss.png``,
    ``memory.png``, ``time.png``, ``metrics.png``, ``gradients.png``, ``evaluation.png``),
    each when the log has data for it; what
    :func:`plot_log` saves. Made without pyplot (no global state, no display needed)."""
    return _figures(log)[0]


def _figures(log: LogData) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    x = log.columns["iteration"].astype(np.float64)
    figs: dict[str, Any] = {}
    left_out: dict[str, tuple[int, int]] = {}
    for name, build in (("loss.png", _loss_figure), ("memory.png", _memory_figure),
                        ("time.png", _time_figure), ("metrics.png", _metrics_figure),
                        ("gradients.png", _gradients_figure),
                        ("evaluation.png", _evaluation_figure)):
        fig, cut = build(log, x)
        if fig is not None:
            figs[name] = fig
            if cut:
                left_out[name] = cut
    return figs, left_out


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


def _save(p: Path, fig: Any) -> None:
    """Write ``fig`` as ``p`` without ever writing through a link: into a new temporary file
    in ``p``'s directory (``O_EXCL | O_NOFOLLOW``), renamed over ``p`` with ``os.replace``,
    which replaces a symbolic link planted at ``p`` instead of following it out of the
    directory."""
    if p.is_dir() and not p.is_symlink():
        raise ReportError(f"--out {p.parent}: cannot write {p.name} (a directory has that "
                          "name)")
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileExistsError:   # left by a killed report of this pid, or planted
            os.remove(tmp)
            fd = os.open(tmp, flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ReportError(f"--out {p.parent}: cannot write {p.name} "
                          f"({e.strerror or ' '.join(str(e).split())})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def plot_log(log: LogData, out_dir: str | os.PathLike) -> list[Path]:
    """Write loss.png, memory.png, time.png and metrics.png (each when it has data; the
    figures of :func:`figures`). At most :data:`MAX_SERIES` loss terms and metrics are drawn,
    and at most :data:`MAX_PANELS` metric panels (the first ones in column order).

    Raises:
        ReportError: ``out_dir`` is not a directory or cannot be written.
    """
    return _plot_all(log, out_dir)[0]


def _plot_all(log: LogData,
              out_dir: str | os.PathLike) -> tuple[list[Path], dict[str, tuple[int, int]]]:
    """:func:`plot_log`, and what it left out: plot file name -> (drawn, of how many)."""
    out = _out_dir(out_dir, make=True)
    figs, left_out = _figures(log)
    written: list[Path] = []
    for name, fig in figs.items():
        p = out / name
        _save(p, fig)
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
