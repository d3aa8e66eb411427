"""The planner: from a measured step profile, a chain length and a memory budget to a schedule.

Memory model (bytes the unroll adds at its peak; the caller's parameters and initial state
are not counted). With S the state, T the tape of one recorded step, O one step's output,
W = 3 S + P + scratch the working set of the reverse sweep (current state, two adjoints,
parameter gradients P, measured scratch)::

    store_all        n (T + S) + W + n O          (the graph keeps every step and its input)
    revolve(s)       (s - 1) S + T + W + n O      (x_0 is the caller's; one recorded step)
    mixed(u)         u S + T + W + n O            (u units hold states or kept tapes)
    two_level(s, m)  (s - 1) S + T + W + n O      (+ m states in host RAM or on disk)
    revolve_tail(s, m) (s - 1) S + m T + W + n O  (the last m steps kept recorded)

Time model, relative to one forward + backward of the plain unroll
``n (t_record + t_backward)``: a schedule costs ``advances * t_advance + n (t_record +
t_backward)`` plus I/O for a second storage level.

The planner takes store-all when it fits; otherwise the cheapest schedule that fits; and
raises :class:`~deepsolve.memory.budget.BudgetError` with the minimum budget when nothing does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schedules import (
    Schedule,
    mixed,
    mixed_cost,
    optimal_cost,
    revolve,
    revolve_tail,
    revolve_tail_cost,
    store_all,
    two_level,
    two_level_cost,
)
from .budget import BudgetError, format_bytes
from .profiling import StepProfile

__all__ = ["Plan", "Alternative", "SlowLevel", "plan", "choose", "predicted_peak",
           "measure_level", "online_snapshots"]


@dataclass
class Alternative:
    """One schedule the planner weighed."""

    name: str
    peak: int
    time: float
    fits: bool
    note: str = ""


@dataclass
class Plan:
    """The planner's choice and its predictions.

    Attributes:
        kind: ``"store_all"``, ``"revolve"``, ``"revolve_tail"``, ``"mixed"`` or
            ``"two_level"``.
        schedule: the schedule object to execute.
        n_steps: chain length.
        snapshots: fast-memory slots (x_0 included), or ``None`` for store-all.
        budget: the budget in bytes.
        predicted_peak: bytes the unroll is predicted to add at its peak.
        predicted_time: predicted time relative to one forward + backward of the plain unroll.
        recompute_factor: step evaluations per step, ``(advances + n) / n``.
        profile: the measured step profile.
        alternatives: what was weighed, for :meth:`explain`.
        reason: why this one.
    """

    kind: str
    schedule: Schedule
    n_steps: int
    snapshots: int | None
    budget: int
    predicted_peak: int
    predicted_time: float
    recompute_factor: float
    profile: StepProfile
    alternatives: list[Alternative] = field(default_factory=list)
    reason: str = ""
    label: str = ""

    def explain(self) -> str:
        """A short table of the alternatives weighed and why this plan was chosen."""
        p = self.profile
        lines = [
            f"budget {format_bytes(self.budget)} for {self.n_steps} steps; measured step: "
            f"state {format_bytes(p.state_bytes)}, recorded step {format_bytes(p.tape_bytes)}"
            f", outputs {format_bytes(p.output_bytes)}/step, working set "
            f"{format_bytes(p.working_bytes)}; t_advance {p.t_advance * 1e3:.3g} ms, "
            f"t_record+backward {(p.t_record + p.t_backward) * 1e3:.3g} ms",
            "",
            f"  {'schedule':<34} {'peak':>12} {'time':>7}  fits",
        ]
        for a in self.alternatives:
            mark = "*" if a.name == self.describe() else " "
            lines.append(f"{mark} {a.name:<34} {format_bytes(a.peak):>12} {a.time:>6.2f}x  "
                         f"{'yes' if a.fits else 'no '}  {a.note}")
        lines += ["", f"chosen: {self.describe()} — {self.reason}",
                  f"predicted peak {format_bytes(self.predicted_peak)}, time "
                  f"{self.predicted_time:.2f}x the plain unroll, recompute factor "
                  f"{self.recompute_factor:.2f}"]
        return "\n".join(lines)

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.kind == "store_all":
            return "store_all"
        if self.kind == "revolve":
            return f"revolve(s={self.snapshots})"
        return repr(self.schedule)


def predicted_peak(profile: StepProfile, n_steps: int, kind: str, slots: int = 0) -> int:
    """Bytes the unroll adds at its peak under the memory model of this module."""
    p = profile
    outs = n_steps * p.output_bytes
    if kind == "store_all":
        return n_steps * (p.tape_bytes + p.state_bytes) + p.working_bytes + outs
    if kind in ("revolve", "two_level"):
        return max(slots - 1, 0) * p.state_bytes + p.tape_bytes + p.working_bytes + outs
    if kind == "revolve_tail":
        s, m = slots
        return max(s - 1, 0) * p.state_bytes + max(m, 1) * p.tape_bytes + p.working_bytes + outs
    if kind == "mixed":
        return slots * p.state_bytes + p.tape_bytes + p.working_bytes + outs
    raise ValueError(f"unknown schedule kind {kind!r}")


def _best_tail(p: StepProfile, n: int, budget: int) -> tuple[int, int, int] | None:
    """``(snapshots, tail, advances)`` of the fastest revolve-with-recorded-tail that fits,
    or ``None`` when no tail of two steps or more fits."""
    room = budget - p.working_bytes - n * p.output_bytes
    if p.tape_bytes <= 0 or p.state_bytes <= 0 or room < 2 * p.tape_bytes:
        return None
    m_max = min(n, room // p.tape_bytes)
    stride = max(1, m_max // 4000)  # scan at most ~4000 tail lengths
    best = None
    for m in list(range(2, m_max + 1, stride)) + [m_max]:
        s = 1 + (room - m * p.tape_bytes) // p.state_bytes
        if s < 1:
            continue
        s = int(min(s, max(n - m, 1)))
        adv = revolve_tail_cost(n, s, m)
        if best is None or adv < best[2] or (adv == best[2] and m < best[1]):
            best = (s, m, adv)
    return best


def _time(profile: StepProfile, n: int, advances: float, io: float = 0.0) -> float:
    p = profile
    plain = n * (p.t_record + p.t_backward)
    if plain <= 0:
        return 1.0
    return (advances * p.t_advance + plain + io) / plain


@dataclass(frozen=True)
class SlowLevel:
    """A second storage level the planner may use: its slot count and the seconds one state
    takes to write and to read back (measured by :func:`measure_level`)."""

    kind: str          # "host" or "disk"
    slots: int
    t_write: float
    t_read: float
    spill_dir: str | None = None


_MAX_SLOW_SLOTS = 32  # planning time of the two-level DP grows with n x slow slots
_MAX_MIXED_TABLE = 400_000  # n x units entries of the mixed DP (about 2 s per 1e5)
_MIXED_TAPE_RATIO = 2  # weigh mixed checkpointing when a tape is at most this many states


def choose(profile: StepProfile, n_steps: int, budget: int,
           slow: SlowLevel | None = None) -> Plan:
    """The fastest schedule whose predicted peak fits ``budget`` (bytes); with ``slow``, a
    cost-aware two-level schedule is weighed too."""
    p, n = profile, n_steps
    alts: list[Alternative] = []
    peak_all = predicted_peak(p, n, "store_all")
    fits_all = peak_all <= budget
    alts.append(Alternative("store_all", peak_all, _time(p, n, 0), fits_all,
                            "no recomputation"))
    # revolve with the most slots that fit (x_0's slot is free)
    room = budget - predicted_peak(p, n, "revolve", 1)
    s_max = 1 + room // p.state_bytes if room >= 0 and p.state_bytes > 0 else 0
    if p.state_bytes == 0 and room >= 0:
        s_max = n
    s_rev = int(min(s_max, max(n - 1, 1)))  # n - 1 slots already avoid all recomputation
    if fits_all:
        sched = store_all(n)
        plan = Plan("store_all", sched, n, None, budget, peak_all, _time(p, n, 0), 1.0, p,
                    alts, "everything fits: plain backpropagation, no recomputation")
        if s_rev >= 1:
            adv = optimal_cost(n, s_rev)
            alts.append(Alternative(f"revolve(s={s_rev})",
                                    predicted_peak(p, n, "revolve", s_rev),
                                    _time(p, n, adv), True, f"{adv} recomputed steps"))
        return plan
    if s_rev < 1:
        minimum = predicted_peak(p, n, "revolve", 1)
        raise BudgetError(
            f"the budget {format_bytes(budget)} is below the minimum {format_bytes(minimum)} "
            f"any schedule needs for {n} steps: one recorded step takes "
            f"{format_bytes(p.tape_bytes)}, the working set {format_bytes(p.working_bytes)}"
            + (f", the stacked outputs {format_bytes(n * p.output_bytes)}"
               if p.output_bytes else "")
            + "; raise the budget or shrink the step"
        )
    adv = optimal_cost(n, s_rev)
    t_rev = _time(p, n, adv)
    alts.append(Alternative(f"revolve(s={s_rev})", predicted_peak(p, n, "revolve", s_rev),
                            t_rev, True, f"{adv} recomputed steps, the most slots that fit"))
    best = Plan("revolve", revolve(n, s_rev), n, s_rev, budget,
                predicted_peak(p, n, "revolve", s_rev), t_rev, (adv + n) / n, p, alts,
                "store_all does not fit; revolve with the most snapshots that fit")
    tail = _best_tail(p, n, budget)
    if tail is not None:
        s_t, m, adv_t = tail
        t_tail = _time(p, n, adv_t)
        name = f"revolve(s={s_t}) + {m} recorded steps"
        peak = predicted_peak(p, n, "revolve_tail", (s_t, m))
        alts.append(Alternative(name, peak, t_tail, True,
                                f"{adv_t} recomputed steps; the last {m} steps are kept "
                                "recorded from the forward sweep"))
        if t_tail < best.predicted_time:
            best = Plan("revolve_tail", revolve_tail(n, s_t, m), n, s_t, budget, peak, t_tail,
                        (adv_t + n) / n, p, alts,
                        "store_all does not fit; memory beyond the snapshots revolve needs "
                        "keeps the last steps recorded", label=name)
    tape_units = -(-p.tape_bytes // max(p.state_bytes, 1))
    if adv > n - 1 and tape_units <= _MIXED_TAPE_RATIO and p.state_bytes > 0:
        # a slot may hold a recorded step instead of a state (Maddison's mixed checkpointing);
        # u units of S bytes, the transient tape of the step being reversed on top
        units = int((budget - predicted_peak(p, n, "mixed", 0)) // p.state_bytes)
        units = min(units, 2 * n)
        if units >= 1 and n * units <= _MAX_MIXED_TABLE:
            try:
                evals = mixed_cost(n, units, tape_units=tape_units)
            except ValueError:
                evals = None
            if evals is not None:
                t_mix = _time(p, n, evals - n)
                name = f"mixed(units={units}, tape={tape_units} states)"
                peak = predicted_peak(p, n, "mixed", units)
                alts.append(Alternative(name, peak, t_mix, True,
                                        f"{evals - n} extra evaluations; a slot holds a "
                                        "state or a recorded step"))
                if t_mix < 0.98 * best.predicted_time:
                    best = Plan("mixed", mixed(n, units, tape_units=tape_units), n, units,
                                budget, peak, t_mix, evals / n, p, alts,
                                "a recorded step costs about a state here, so keeping some "
                                "recorded steps (mixed checkpointing) saves recomputation",
                                label=name)
    if slow is not None and slow.slots > 0 and adv > n - 1 and p.t_advance > 0:
        m = min(slow.slots, n, _MAX_SLOW_SLOTS)
        unit = p.t_advance  # costs in units of one unrecorded step
        kw = dict(write_cost=slow.t_write / unit, read_cost=slow.t_read / unit,
                  forward_cost=1.0, backward_cost=(p.t_record + p.t_backward) / unit - 1.0)
        cost = two_level_cost(n, s_rev, m, **kw)
        rev_cost = two_level_cost(n, s_rev, 0, **kw)
        t_two = t_rev * cost / rev_cost if rev_cost else t_rev
        name = f"two_level(s={s_rev}, {slow.kind}={m})"
        peak = predicted_peak(p, n, "two_level", s_rev)
        note = (f"write {slow.t_write * 1e3:.3g} ms, read {slow.t_read * 1e3:.3g} ms "
                f"per state on {slow.kind}")
        alts.append(Alternative(name, peak, t_two, True, note))
        if t_two < 0.98 * t_rev:
            sched = two_level(n, s_rev, m, **kw)
            return Plan("two_level", sched, n, s_rev, budget, peak, t_two,
                        t_two / max(t_rev, 1e-300) * best.recompute_factor, p, alts,
                        f"a second level on {slow.kind} saves recomputation at its I/O cost",
                        label=name)
        best.reason += f"; the {slow.kind} level does not pay for its I/O"
    return best


def plan(step, state, n_steps: int, *, budget: int | str, params=None, device=None,
         offload: str | None = None, spill_dir: str | None = None) -> Plan:
    """Profile ``step`` on ``state`` (cached) and choose the fastest schedule for ``n_steps``
    steps whose predicted peak fits ``budget`` (bytes, ``"2GiB"``, ``"80%"``).

    ``offload="host"`` (pinned host memory, for CUDA states) or ``"disk"`` (files under
    ``spill_dir``, for CPU-only machines) lets the planner weigh a cost-aware two-level
    schedule whose write/read costs are measured on a state-sized copy.

    Raises :class:`~deepsolve.BudgetError` (a ``ValueError``) with the minimum budget when no
    schedule fits. ``Plan.explain()`` prints the alternatives weighed.
    """
    from torch.utils import _pytree as pytree

    from .budget import parse_budget
    from .profiling import profile_step

    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"plan: n_steps must be an integer >= 1, got {n_steps!r}")
    leaves = pytree.tree_leaves(state)
    dev = device if device is not None else (leaves[0].device if leaves else None)
    nbytes = parse_budget(budget, dev)
    prof = profile_step(step, state, params=params)
    slow = measure_level(offload, leaves, spill_dir) if offload else None
    return choose(prof, n_steps, nbytes, slow)


_level_cache: dict = {}


def measure_level(kind: str, leaves, spill_dir: str | None = None) -> SlowLevel:
    """Time writing and reading one state to host memory or a spill directory, and count
    how many states fit there (half of the available RAM or free disk space)."""
    import os
    import shutil
    import time

    import torch

    from ..executor import HostStorage
    from .budget import device_capacity
    from .offload import DiskStorage

    if kind not in ("host", "disk"):
        raise ValueError(f"offload must be 'host' or 'disk', got {kind!r}")
    nbytes = sum(t.numel() * t.element_size() for t in leaves)
    key = (kind, nbytes, spill_dir, tuple(str(t.device) for t in leaves))
    if key in _level_cache:
        return _level_cache[key]
    store = HostStorage() if kind == "host" else DiskStorage(spill_dir)
    meta = [(t.shape, t.dtype, t.device) for t in leaves]
    data = [t.detach() for t in leaves]
    try:
        writes, reads = [], []
        for r in range(3):
            t0 = time.perf_counter()
            store.put((1, r), data)
            if data and data[0].device.type == "cuda":
                torch.cuda.synchronize()
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.get((1, r), meta)
            if data and data[0].device.type == "cuda":
                torch.cuda.synchronize()
            reads.append(time.perf_counter() - t0)
        room = (device_capacity("cpu") if kind == "host"
                else shutil.disk_usage(spill_dir or os.path.dirname(store.dir)).free) // 2
    finally:
        store.close()
    level = SlowLevel(kind, int(room // max(nbytes, 1)), sorted(writes)[1], sorted(reads)[1],
                      spill_dir)
    _level_cache[key] = level
    return level


def online_snapshots(step, state, budget: int | str, max_steps: int | None = None,
                     params=None) -> int:
    """Snapshot slots for an unknown-length unroll under ``budget``: the most that fit beside
    one recorded step, the working set and (with ``max_steps``) the stacked outputs.
    Raises :class:`~deepsolve.BudgetError` when not even ``x_0`` and one step fit."""
    from torch.utils import _pytree as pytree

    from .budget import parse_budget
    from .profiling import profile_step

    leaves = pytree.tree_leaves(state)
    nbytes = parse_budget(budget, leaves[0].device if leaves else None)
    p = profile_step(step, state, params=params)
    outs = (max_steps or 0) * p.output_bytes
    room = nbytes - p.tape_bytes - p.working_bytes - outs
    if room < 0:
        raise BudgetError(
            f"the budget {format_bytes(nbytes)} is below the minimum "
            f"{format_bytes(nbytes - room)} an unknown-length unroll needs: one recorded step "
            f"takes {format_bytes(p.tape_bytes)}, the working set "
            f"{format_bytes(p.working_bytes)}; raise the budget or shrink the step")
    if p.state_bytes == 0:
        return 1_000_000
    # one more state than offline: the online forward holds x_{i-1} beside x_i
    return max(1, 1 + int(room // p.state_bytes) - 1)
