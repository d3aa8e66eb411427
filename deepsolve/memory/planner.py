"""The planner: from a measured step profile, a chain length and a memory budget to a schedule.

Memory model (bytes the unroll adds at its peak; the caller's parameters and initial state
are not counted). With S the state, T the tape of one recorded step, O one step's output,
W = 3 S + P + scratch the working set of the reverse sweep (current state, two adjoints,
parameter gradients P, measured scratch)::

    store_all        n (T + S) + W + n O          (the graph keeps every step and its input)
    revolve(s)       (s - 1) S + T + W + n O      (x_0 is the caller's; one recorded step)
    mixed(u)         u S + T + W + n O            (u units hold states or kept tapes)
    two_level(s, m)  (s - 1) S + T + W + n O      (+ m states in host RAM or on disk)

Time model, relative to one forward + backward of the plain unroll
``n (t_record + t_backward)``: a schedule costs ``advances * t_advance + n (t_record +
t_backward)`` plus I/O for a second storage level.

The planner takes store-all when it fits; otherwise the cheapest schedule that fits; and
raises :class:`~deepsolve.memory.budget.BudgetError` with the minimum budget when nothing does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schedules import Schedule, optimal_cost, revolve, store_all
from .budget import BudgetError, format_bytes
from .profiling import StepProfile

__all__ = ["Plan", "Alternative", "plan", "choose", "predicted_peak"]


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
        kind: ``"store_all"``, ``"revolve"``, ``"mixed"`` or ``"two_level"``.
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
    if kind == "mixed":
        return slots * p.state_bytes + p.tape_bytes + p.working_bytes + outs
    raise ValueError(f"unknown schedule kind {kind!r}")


def _time(profile: StepProfile, n: int, advances: float, io: float = 0.0) -> float:
    p = profile
    plain = n * (p.t_record + p.t_backward)
    if plain <= 0:
        return 1.0
    return (advances * p.t_advance + plain + io) / plain


def choose(profile: StepProfile, n_steps: int, budget: int) -> Plan:
    """The fastest schedule whose predicted peak fits ``budget`` (bytes)."""
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
    sched = revolve(n, s_rev)
    return Plan("revolve", sched, n, s_rev, budget, predicted_peak(p, n, "revolve", s_rev),
                t_rev, (adv + n) / n, p, alts,
                "store_all does not fit; revolve with the most snapshots that fit")


def plan(step, state, n_steps: int, *, budget: int | str, params=None, device=None) -> Plan:
    """Profile ``step`` on ``state`` (cached) and choose the fastest schedule for ``n_steps``
    steps whose predicted peak fits ``budget`` (bytes, ``"2GiB"``, ``"80%"``).

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
    return choose(prof, n_steps, nbytes)
