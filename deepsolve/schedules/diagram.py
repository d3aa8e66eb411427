"""Draw a schedule: the classic revolve diagram (time down, step index across)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from .actions import Advance, Free, Record, Restore, Reverse, Store
from .base import Schedule

if TYPE_CHECKING:
    from .basic import Periodic
    from .revolve import Revolve

__all__ = ["text_diagram", "png_diagram"]

_MAX_TEXT_STEPS = 80


def _describe(a) -> str:
    t = type(a)
    if t is Advance:
        return f"advance {a.start}..{a.stop}"
    if t is Record:
        return f"record {a.start}..{a.stop}"
    if t is Reverse:
        return f"reverse step {a.index}"
    lv = f" (level {a.level})" if a.level else ""
    verb = {Store: "store", Restore: "restore", Free: "free"}[t]
    arrow = "->" if t is Store else "<-" if t is Restore else "  "
    return f"{verb} x_{a.index} {arrow} slot {a.slot}{lv}"


def text_diagram(schedule: Schedule) -> str:
    """One line per action: ``-->`` advances, ``==>`` records, ``<#`` reverse steps,
    ``S``/``R`` stores and restores at the state's index. For at most 80 steps."""
    n = schedule.n_steps
    if n > _MAX_TEXT_STEPS:
        raise ValueError(f"text diagrams are for at most {_MAX_TEXT_STEPS} steps, got {n}; "
                         "use --png for longer chains")
    w = 2 * n + 1
    head = [" "] * w
    for i in range(0, n + 1, 5 if n > 20 else 1):
        for j, ch in enumerate(str(i)):
            if 2 * i + j < w:
                head[2 * i + j] = ch
    lines = ["".join(head)]
    for a in schedule:
        row = [" "] * w
        if type(a) is Advance or type(a) is Record:
            fill = "-" if type(a) is Advance else "="
            for x in range(2 * a.start, 2 * a.stop):
                row[x] = fill
            row[2 * a.stop] = ">"
        elif type(a) is Reverse:
            row[2 * a.index] = "<"
            row[2 * a.index + 1] = "#"
            row[2 * a.index + 2] = "#"
        elif type(a) is Store or type(a) is Restore:
            row[2 * a.index] = "S" if type(a) is Store else "R"
        elif type(a) is Free:
            continue
        lines.append("".join(row) + "   " + _describe(a))
    return "\n".join(lines)


def png_diagram(schedule: Schedule, path: str) -> None:
    """Draw the schedule with matplotlib into ``path`` (any format matplotlib knows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segs: dict[str, list] = {"advance": [], "record": [], "reverse": []}
    pts: dict[str, list] = {"store": [], "restore": []}
    y = 0
    for a in schedule:
        if type(a) is Advance:
            segs["advance"].append((a.start, a.stop, y))
        elif type(a) is Record:
            segs["record"].append((a.start, a.stop, y))
        elif type(a) is Reverse:
            segs["reverse"].append((a.index + 1, a.index, y))
        elif type(a) is Store:
            pts["store"].append((a.index, y))
        elif type(a) is Restore:
            pts["restore"].append((a.index, y))
        else:
            continue
        y += 1
    fig, ax = plt.subplots(figsize=(7, max(3.0, min(0.06 * y, 40.0))))
    style = {"advance": ("0.45", 1.2), "record": ("tab:orange", 2.0), "reverse": ("tab:red", 2.5)}
    for name, rows in segs.items():
        color, lw = style[name]
        for k, (x0, x1, yy) in enumerate(rows):
            ax.plot([x0, x1], [yy, yy], color=color, lw=lw, label=name if k == 0 else None)
    for name, marker, color in (("store", "o", "tab:blue"), ("restore", "^", "tab:green")):
        if pts[name]:
            xs, ys = zip(*pts[name], strict=True)
            ax.scatter(xs, ys, marker=marker, color=color, s=14, zorder=3, label=name)
    ax.invert_yaxis()
    ax.set_xlabel("step index")
    ax.set_ylabel("action (time runs down)")
    ax.set_title(repr(schedule))
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_MAX_STREAMED = 200_000  # longer revolve, periodic and store-all schedules: closed forms


def _closed_form(schedule: Schedule) -> str | None:
    """The counts of a long revolve, periodic or store-all schedule from closed forms (their
    action streams are too long to walk: ``plan --steps 1000000000``)."""
    from .cost import optimal_cost

    n, kind = schedule.n_steps, schedule.kind
    if n <= _MAX_STREAMED or kind not in ("revolve", "periodic", "store_all"):
        return None
    if kind == "store_all":
        adv, slots, tapes = 0, 0, n
    elif kind == "revolve":
        s = cast("Revolve", schedule).snapshots  # kind "revolve": a Revolve
        slots = min(s, n)
        adv, tapes = optimal_cost(n, s), 0
    else:
        k = cast("Periodic", schedule).every  # kind "periodic": a Periodic
        last = (n - 1) // k * k
        adv, slots, tapes = last, last // k, max(k, n - last)
    return "\n".join([
        f"schedule         {schedule!r}",
        f"steps            {n}",
        f"advances         {adv}  (unrecorded forward steps; closed form)",
        f"recorded         {n}",
        f"recompute factor {(adv + n) / n:.3f}  (forward evaluations per step)",
        f"peak slots       {slots}" + ("  (x_0 included)" if kind == "revolve" else ""),
        f"peak tapes       {tapes}  (recorded steps kept at once)",
        f"(counted from closed forms: the schedule has over {_MAX_STREAMED} steps)",
    ])


def summary(schedule: Schedule) -> str:
    """A few lines: the schedule's counts beside the optimum (the ``plan --steps`` output).
    Revolve, periodic and store-all schedules of more than 200,000 steps are counted from
    closed forms instead of by walking their actions."""
    from .check import stats
    from .cost import optimal_cost

    closed = _closed_form(schedule)
    if closed is not None:
        return closed
    st = stats(schedule)
    n = schedule.n_steps
    lines = [
        f"schedule         {schedule!r}",
        f"steps            {n}",
        f"advances         {st.advances}  (unrecorded forward steps)",
        f"recorded         {st.recorded}",
        f"recompute factor {st.recompute_factor:.3f}  (forward evaluations per step)",
        f"peak slots       {st.peak_slots!r}",
        f"peak tapes       {st.peak_tapes}  (recorded steps kept at once)",
        f"stores/restores  {st.stores!r} / {st.restores!r}",
    ]
    if n > 1 and st.peak_slots_total >= 1:
        opt = optimal_cost(n, st.peak_slots_total)
        lines.append(f"optimum          t({n}, {st.peak_slots_total}) = {opt} advances for "
                     f"{st.peak_slots_total} slots")
    return "\n".join(lines)
