"""The planner: from a measured step profile, a chain length and a memory budget to a schedule.

Memory model: the bytes the unroll adds to the process's peak, everything included — what
the schedule keeps, the working set of the step being run, and the adjoints, states and
gradients around it (the caller's parameters and initial state are not counted). From the
profile (:mod:`deepsolve.memory.profiling`, all *measured* as live allocator bytes): S a
state, S' a snapshot (S, or less with ``snapshot_dtype``), A the peak of an unrecorded step,
K what a recorded step keeps once its forward returns, M the peak of recording a step and
running its backward, C what one more step adds to a plain autograd chain, P the parameter
gradients, O one step's outputs; W = max(A, M) the working set of a step advanced, or
recorded and reversed at once::

    store_all        (n - 1) C + M + S + 2 P + 2 n O
    revolve(s)       (s - 1) S' + W + 4 S + 2 P + 2 n O
    two_level(s, m)  (s - 1) S' + W + 4 S + 2 P + 2 n O    (+ m states in host RAM or on disk)
    reversible(k)    (ceil((n - 1) / k) - 1) S' + W + 5 S + 2 P + 2 n O    (a step with an inverse)
    mixed(u)         u S + W + 4 S + 2 P + 2 n O           (u units hold states or kept tapes)
    revolve_tail(s, m)  max((s - 1) S' + m K + (M - K) + 3 S,  revolve(s)'s)  + 2 P + 2 n O

``4 S`` are the state being advanced or recorded, the final state ``x_n`` the caller holds,
the caller's adjoint of it (held by autograd through the whole reverse sweep) and the adjoint
``lambda_{i+1}`` being pulled; ``2 P`` the accumulated parameter gradients and the sum being
formed; ``2 n O`` the stacked per-step outputs and their gradients. A store-all chain holds
its states inside its tapes (C), a recorded tail holds ``m`` kept steps (``m K``, the first
input ``S`` beside them) and reverses each with ``M - K`` on top.

A recomputation policy p (selective activation checkpointing of kept tapes) replaces K, C
and M by those measured with the step recorded under it (``K_p``, ``C_p``, ``M_p``; its
backward recomputes what the policy drops) in ``store_all`` and ``revolve_tail``. Steps
reversed as soon as they are recorded (revolve, two-level, mixed) run without a policy.

Time model, relative to one forward + backward of the plain unroll
``n (t_record + t_backward)``: a schedule costs ``advances * t_advance + n (t_record +
t_backward)`` plus I/O for a second storage level; the ``m`` kept steps under a policy cost
its ``t_record + t_backward`` instead, but at least the plain step's plus a floor for the
recomputation (``t_advance`` for a policy that keeps nothing, a quarter of it times the
dropped fraction of the kept bytes otherwise).

Choosing: store-all when it fits; otherwise revolve with the most snapshots that fit, a
recorded tail when it needs fewer recomputations, mixed checkpointing when it needs fewer
evaluations — these compare exact step counts, so the choice does not depend on timing
noise —, and a policy or a second storage level only when predicted at least 10 % faster
(measured times are noisy; a budget gives one plan). A policy is weighed only where it
changes something: one that keeps nothing on this step (``"save_fft"`` without FFTs) is
``"recompute_all"`` and weighed once, one that keeps as much as plain autograd not at all.
:class:`~deepsolve.memory.budget.BudgetError` states the minimum budget when nothing fits.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..engine import (
    POLICIES,
    HostStorage,
    RngState,
    check_snapshot_dtype,
    cuda_devices,
    default_tolerance,
    policy_context,
    policy_name,
    relative_error,
    snapshot_nbytes,
)
from ..schedules import Schedule, mixed_cost, revolve_tail_cost
from ..stability import window as drift_window
from .agree import (
    agree_level,
    agree_max,
    agree_max_time,
    agree_min,
    agree_profile,
    group_size,
)
from .allocator import hold_to_budget, release_budget
from .budget import BudgetError, BudgetLike, device_capacity, format_bytes, parse_budget
from .library import affordable, load_policy_machinery, policy_machinery
from .offload import DiskStorage
from .profiling import StepProfile, profile_step
from .strategies import (
    Mixed,
    Reversible,
    Revolve,
    RevolveTail,
    StoreAll,
    Strategy,
    TwoLevel,
    strategy_for,
)
from .units import probe_peak

__all__ = ["Plan", "Alternative", "SlowLevel", "plan", "choose", "predicted_peak", "minimum_budget",
           "peak_terms", "weighed_policies", "measure_level", "online_snapshots", "Reversibility",
    "reversibility"]


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
        kind: ``"store_all"``, ``"revolve"``, ``"revolve_tail"``, ``"mixed"``,
            ``"two_level"`` or ``"reversible"``.
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
        policy: the recomputation policy for kept tapes (``"none"``, a name from
            :data:`deepsolve.engine.POLICIES`, or the policy object the caller gave).
        policies: profiles of the recorded step under the policies weighed.
        snapshot_dtype: the dtype snapshots are stored in (``None``: the state's own).
        terms: the predicted peak's terms (:func:`peak_terms`: snapshots, kept tapes, the
            step's working set, adjoints and states, parameter gradients, stacked outputs);
            they sum to ``predicted_peak``.
        segment: with ``unroll(..., compile=...)``, the
            :class:`~deepsolve.memory.segments.SegmentChoice` (``k`` and why); the plan is
            then over ``n_steps`` segments of ``k`` steps, profiled compiled.
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
    policy: Any = "none"
    policies: list[StepProfile] = field(default_factory=list)
    snapshot_dtype: Any = None
    terms: dict[str, int] = field(default_factory=dict)
    strategy: Strategy | None = None
    library_bytes: int = 0
    segment: Any = None

    def explain(self) -> str:
        """A short table of the alternatives weighed, the chosen plan's peak term by term,
        and why it was chosen."""
        p = self.profile
        how = "measured" if p.measured else "estimated (the profiler was busy)"
        lines = [
            f"budget {format_bytes(self.budget)} for {self.n_steps} steps; measured step: "
            f"state {format_bytes(p.state_bytes)}, tape {format_bytes(p.tape_bytes)}, kept "
            f"after recording {format_bytes(p.kept_bytes)}, outputs "
            f"{format_bytes(p.output_bytes)}/step; working set ({how}): advance "
            f"{format_bytes(p.advance_bytes)}, record + reverse {format_bytes(p.reverse_bytes)}"
            f"; t_advance {p.t_advance * 1e3:.3g} ms, "
            f"t_record+backward {(p.t_record + p.t_backward) * 1e3:.3g} ms",
        ]
        for q in self.policies:
            lines.append(
                f"recorded step under policy {q.policy}: keeps {format_bytes(q.kept_bytes)} "
                f"({q.kept_bytes / max(p.kept_bytes, 1):.0%} of the plain step), record + "
                f"reverse {format_bytes(q.reverse_bytes)}, t_record+backward "
                f"{(q.t_record + q.t_backward) * 1e3:.3g} ms")
        lines.append(
            f"a snapshot holds {format_bytes(p.slot_bytes)}: "
            + (f"the state, snapshots stored as {self.snapshot_dtype or 'a smaller dtype'} "
               f"({format_bytes(p.snapshot_bytes)}, gradients no longer exact)"
               if p.snapshot_bytes is not None else f"the state ({format_bytes(p.state_bytes)})")
            + f" and {format_bytes(p.slot_extra)} beside it (tensor objects, the allocator's "
            "rounding, the snapshot's record"
            + (", the random generators' state: the step draws random numbers)"
               if p.draws_random else "; the step draws no random numbers, so no generator "
               "state is kept)")
            + f"; a kept tape {format_bytes(p.kept_bytes)}, a link of a plain chain "
            f"{format_bytes(p.chain_bytes)} (measured in the engine, objects included)")
        lines += ["", f"  {'schedule':<52} {'peak':>12} {'time':>7}  fits"]
        for a in self.alternatives:
            mark = "*" if a.name == self.describe() else " "
            lines.append(f"{mark} {a.name:<52} {format_bytes(a.peak):>12} {a.time:>6.2f}x  "
                         f"{'yes' if a.fits else 'no '}  {a.note}")
        lines += ["", f"chosen: {self.describe()} — {self.reason}",
                  f"recomputation policy for kept tapes: {_name(self.policy)}",
                  f"predicted peak {format_bytes(self.predicted_peak)} (what the unroll adds "
                  f"to the process's peak), time {self.predicted_time:.2f}x the plain unroll, "
                  f"recompute factor {self.recompute_factor:.2f}"]
        lines += [f"  {name:<28} {format_bytes(v):>12}" for name, v in self.terms.items()]
        if self.segment is not None:
            lines += ["", f"the chain is {self.n_steps} compiled segments of "
                      f"{self.segment.k} steps; the profile above is a segment's",
                      self.segment.explain()]
        return "\n".join(lines)

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.strategy is not None:
            return self.strategy.describe()
        return repr(self.schedule)

    def __repr__(self) -> str:
        """One line; :meth:`explain` gives the whole table."""
        return (f"Plan({self.describe()}, {self.n_steps} steps, budget "
                f"{format_bytes(self.budget)}, predicted peak "
                f"{format_bytes(self.predicted_peak)}, time {self.predicted_time:.2f}x)")

    __str__ = __repr__


_name = policy_name


def peak_terms(profile: StepProfile, n_steps: int, kind: str, slots: Any = 0) -> dict[str, int]:
    """The terms of the predicted peak (bytes) of a schedule of ``kind`` under the memory
    model of this module; they sum to :func:`predicted_peak`. ``slots``: snapshot slots
    ``s`` (revolve, two-level), ``(s, m)`` (revolve_tail), units ``u`` (mixed). For a
    profile measured under a policy, ``store_all`` and ``revolve_tail`` keep their tapes
    under it."""
    return strategy_for(kind, slots).peak_terms(profile, n_steps)


def predicted_peak(profile: StepProfile, n_steps: int, kind: str, slots: Any = 0) -> int:
    """Bytes the unroll adds at its peak under the memory model of this module (the sum of
    :func:`peak_terms`)."""
    return sum(peak_terms(profile, n_steps, kind, slots).values())


def minimum_budget(p: StepProfile, n: int) -> int:
    """The smallest budget any schedule fits for ``n`` steps: revolve with one slot (a
    recorded step's working set, adjoints and states, gradients, stacked outputs). Measuring
    the step stays within it: the engine's units are probed only where the probe holds no
    more than this, or under a budget 8 times what it holds (:func:`_warrants_units`)."""
    return Revolve(1).predicted_peak(p, n)


def _below_minimum(p: StepProfile, n: int, budget: int) -> BudgetError:
    minimum = minimum_budget(p, n)
    return BudgetError(
        f"the budget {format_bytes(budget)} is below the minimum {format_bytes(minimum)} "
        f"any schedule needs for {n} steps: one recorded step takes "
        f"{format_bytes(p.step_bytes)} at its peak (its tape {format_bytes(p.tape_bytes)})"
        f", adjoints and states {format_bytes(4 * p.state_bytes)}"
        + (f", the stacked outputs {format_bytes(2 * n * p.output_bytes)}"
           if p.output_bytes else "")
        + "; raise the budget or shrink the step")


def _gate(p: StepProfile, n: int, budget: int, refuse: bool = True) -> bool:
    """Called from inside the profile once one recorded step is measured: raises when the
    budget is below the minimum (``refuse``; not where ranks must first agree on the
    profile); returns whether it is large enough (8 times what the probe of the engine's
    units would hold) to measure those units."""
    if refuse and budget < minimum_budget(p, n):
        raise _below_minimum(p, n, budget)
    return _warrants_units(p, budget, Revolve(1).predicted_peak(p, n))


def _warrants_units(p: StepProfile, budget: int, least: int) -> bool:
    """Whether to measure the engine's units under ``budget``: always when their probe holds
    no more than the least any schedule needs (``least``), else when the budget is 8 times
    what it holds — below that, few units fit and their estimate errs by few bytes."""
    if p.units_measured:
        return True
    kept = p.tensors_kept + p.step_objects
    estimate = probe_peak(p.state_bytes + 1024, kept, kept, p.state_bytes,
                          max(p.advance_bytes, p.reverse_bytes))
    return estimate <= least or budget >= 8 * estimate


def _refuse_before_profiling(leaves, n: int, budget: int) -> None:
    """Before any step runs: an unroll holds at least four states (the state being stepped,
    the final state, its adjoint and the adjoint being pulled)."""
    floor = 4 * sum(t.numel() * t.element_size() for t in leaves)
    if budget < floor:
        raise BudgetError(
            f"the budget {format_bytes(budget)} is below the minimum any schedule needs for "
            f"{n} steps: four states alone (the state stepped, x_n and two adjoints) take "
            f"{format_bytes(floor)}, before the step's own working set; raise the budget "
            "or shrink the state")


def _fixed(p: StepProfile, n: int) -> int:
    """The terms every schedule pays whatever it keeps: gradients and stacked outputs."""
    return 2 * p.grad_bytes + 2 * n * p.output_bytes


def _revolve_slots(p: StepProfile, n: int, budget: int) -> int:
    """The most snapshot slots (``x_0`` included) whose revolve fits; 0 when none does."""
    room = budget - Revolve(1).predicted_peak(p, n)
    if room < 0:
        return 0
    if p.slot_bytes <= 0:
        return max(n - 1, 1)
    return int(min(1 + room // p.slot_bytes, max(n - 1, 1)))  # n - 1 slots: no recomputation


def _best_tail(p: StepProfile, n: int, budget: int,
               q: StepProfile | None = None) -> tuple[int, int, int] | None:
    """``(snapshots, tail, advances)`` of the revolve-with-recorded-tail that fits with the
    fewest recomputations, its tail recorded under ``q``'s policy (default: ``p``'s), or
    ``None`` when no tail of two steps or more fits. Ties go to the shorter tail."""
    q = p if q is None else q
    kept, S = q.kept_bytes, p.state_bytes
    if kept <= 0 or p.slot_bytes <= 0:
        return None
    s_head = _revolve_slots(p, n, budget)  # the revolve part after the tail
    if s_head < 1:
        return None
    room = budget - _fixed(p, n) - max(q.reverse_bytes - kept, 0) - 3 * S
    if room < 2 * kept:
        return None
    m_max = int(min(n, room // kept))
    stride = max(1, m_max // 4000)  # scan at most ~4000 tail lengths
    best = None
    for m in list(range(2, m_max + 1, stride)) + [m_max]:
        s = int(min(1 + (room - m * kept) // p.slot_bytes, s_head, max(n - m, 1)))
        if s < 1:
            continue
        adv = revolve_tail_cost(n, s, m)
        if best is None or adv < best[2]:
            best = (s, m, adv)
    return best


def _drop_fraction(p: StepProfile, q: StepProfile) -> float:
    """The fraction of the plain kept step (beyond its output state) that ``q`` drops."""
    if q.recomputes_all:
        return 1.0
    plain = max(p.kept_bytes - p.state_bytes, 1)
    return min(max(1.0 - (q.kept_bytes - p.state_bytes) / plain, 0.0), 1.0)


def _time(profile: StepProfile, n: int, advances: float, io: float = 0.0, kept: int = 0,
          q: StepProfile | None = None) -> float:
    """Predicted time relative to the plain unroll; ``kept`` steps recorded under ``q``.

    A kept step under a policy costs the plain step's plus its measured extra time (timed
    side by side with the plain step, ``t_extra``), but at least a floor for the
    recomputation of what the policy drops: a whole unrecorded step for a policy that keeps
    nothing, a quarter of ``t_advance`` times the dropped fraction of the kept bytes
    otherwise (the ops a policy drops are the cheap ones).
    Recomputation is not free, and the floor keeps timing noise from making a policy look
    free."""
    p = profile
    plain = n * (p.t_record + p.t_backward)
    if plain <= 0:
        return 1.0
    extra = 0.0
    if q is not None and kept and q.policy != "none":
        floor = p.t_advance * (1.0 if q.recomputes_all else 0.25 * _drop_fraction(p, q))
        measured = q.t_extra if q.t_extra is not None else \
            (q.t_record + q.t_backward) - (p.t_record + p.t_backward)
        extra = kept * max(measured, floor)
    return (advances * p.t_advance + plain + io + extra) / plain


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
_MARGIN = 0.9  # a policy or a second level must be predicted this much faster than the rest


def weighed_policies(profile: StepProfile,
                     policies: Sequence[StepProfile]) -> list[StepProfile]:
    """The policy profiles worth weighing beside ``profile`` (plain): not ``"none"``, keeping
    less than plain autograd (at least 5 % less), one per distinct kept size, a named policy
    that keeps nothing on this step counted as ``"recompute_all"``."""
    out: list[StepProfile] = []
    for q in sorted((q for q in policies if q.policy != "none"),
                    key=lambda q: (not q.recomputes_all, q.policy != "recompute_all")):
        if q.kept_bytes > 0.95 * profile.kept_bytes:
            continue  # keeps about what plain autograd keeps: changes nothing
        if any(abs(q.kept_bytes - o.kept_bytes) <= 0.01 * max(o.kept_bytes, 1)
               or (q.recomputes_all and o.recomputes_all) for o in out):
            continue  # the same tape as one already weighed (the simpler one)
        out.append(q)
    return out


def choose(profile: StepProfile, n_steps: int, budget: int,
           slow: SlowLevel | None = None,
           policies: Sequence[StepProfile] | None = None, library: int = 0,
           reversible: bool | int = False) -> Plan:
    """See :func:`_choose`; the chosen plan carries its peak's terms (``Plan.terms``).
    ``reversible``: the step has an inverse, so :class:`Reversible` is weighed too — ``True``
    with windows of any length, an integer ``w`` with windows of at most ``w`` steps.

    ``library``: one-time bytes this call keeps resident beside the schedule
    (:mod:`.library`); the schedule fits ``budget - library``, and the plan's terms and
    predicted peak include it."""
    if library and library >= budget:
        raise BudgetError(
            f"the budget {format_bytes(budget)} cannot hold the one-time library memory "
            f"of the recomputation policies asked for ({format_bytes(library)}); raise "
            "the budget or give policy='none'")
    best = _choose(profile, n_steps, budget - library, slow, policies, reversible)
    best.budget = budget
    assert best.strategy is not None  # every plan _choose makes has one
    q = next((o for o in policies or () if o.policy == best.policy), profile)
    best.terms = best.strategy.peak_terms(
        q if best.kind in ("store_all", "revolve_tail") else profile, n_steps)
    if library:
        best.terms["one-time library memory"] = library
        best.predicted_peak += library
        for a in best.alternatives:
            a.peak += library
    best.library_bytes = library
    return best


def _choose(profile: StepProfile, n_steps: int, budget: int,
            slow: SlowLevel | None = None,
            policies: Sequence[StepProfile] | None = None,
            reversible: bool | int = False) -> Plan:
    """The fastest schedule whose predicted peak fits ``budget`` (bytes); with ``slow``, a
    cost-aware two-level schedule is weighed too.

    ``profile`` is the plain (no policy) profile. ``policies`` are profiles of the recorded
    step under recomputation policies (:func:`~deepsolve.memory.profile_step` with
    ``policy=``) whose kept tapes ``store_all`` and ``revolve_tail`` may use; ``None`` weighs
    the plain tape only. When ``policies`` is given and lacks a ``"none"`` profile, kept tapes
    always use a policy (the caller fixed it). Plain alternatives are compared by their exact
    recomputation counts; a policy or a second level is taken only when predicted at least
    10 % faster than the best plan without it (measured times are noisy). With
    ``reversible`` (the step has an inverse) the reversible schedule with the most snapshots
    that fit (the shortest windows of drift) is weighed beside them and taken when predicted
    10 % faster (its inverse time is measured, but noisy too)."""
    p, n = profile, n_steps
    rev_plan = None
    if reversible:
        window = n if reversible is True else int(reversible)
        rev_plan = _reversible_alternative(p, n, budget, window)
    keep = [p] if policies is None else list(policies)
    plain_ok = any(q.policy == "none" for q in keep)
    fixed_policy = not plain_ok
    others = [q for q in keep if q.policy != "none"]
    if not fixed_policy:
        others = weighed_policies(p, others)
    alts: list[Alternative] = []
    extra: dict[str, Any] = dict(policies=others, snapshot_dtype=None)

    def make(strategy: Strategy, peak: int, t: float, factor: float, why: str,
             **kw: Any) -> Plan:
        """The plan that runs ``strategy``: its schedule for n steps and its predictions."""
        return Plan(strategy.kind, strategy.build(n), n, getattr(strategy, "snapshots", None),
                    budget, peak, t, factor, p, alts, why, strategy=strategy, **kw, **extra)

    everything = StoreAll()
    peak_all = everything.predicted_peak(p, n)
    fits_all = peak_all <= budget and plain_ok
    if plain_ok:
        alts.append(Alternative(everything.describe(), peak_all, _time(p, n, 0), fits_all,
                                "no recomputation"))
    s_rev = _revolve_slots(p, n, budget)
    if fits_all:
        plan = make(everything, peak_all, _time(p, n, 0), 1.0,
                    "everything fits: plain backpropagation, no recomputation")
        if s_rev >= 1:
            rev = Revolve(s_rev)
            adv = rev.advances(n)
            alts.append(Alternative(rev.describe(), rev.predicted_peak(p, n),
                                    _time(p, n, adv), True, f"{adv} recomputed steps"))
        if rev_plan is not None:
            alts.append(rev_plan[1])
        return plan
    if s_rev < 1 or budget < minimum_budget(p, n):
        raise _below_minimum(p, n, budget)
    rev = Revolve(s_rev)
    adv = rev.advances(n)
    t_rev = _time(p, n, adv)
    alts.append(Alternative(rev.describe(), rev.predicted_peak(p, n), t_rev, True,
                            f"{adv} recomputed steps, the most slots that fit"))
    best = make(rev, rev.predicted_peak(p, n), t_rev, (adv + n) / n,
                "store_all does not fit; revolve with the most snapshots that fit")
    best_adv = adv  # recomputations of the best plain plan: exact, noise-free

    def tail_plan(q: StepProfile) -> tuple[Plan, int] | None:
        """The recorded tail kept under ``q``'s policy with the fewest recomputations."""
        tail = _best_tail(p, n, budget, q)
        if tail is None:
            return None
        s_t, m, adv_t = tail
        t_tail = _time(p, n, adv_t, kept=m, q=q)
        strategy = RevolveTail(s_t, m, None if q.policy == "none" else q.policy)
        name = strategy.describe()
        peak = strategy.predicted_peak(q, n)
        alts.append(Alternative(name, peak, t_tail, True,
                                f"{adv_t} recomputed steps; the last {m} steps are kept "
                                "recorded from the forward sweep"))
        why = ("store_all does not fit; memory beyond the snapshots revolve needs keeps the "
               "last steps recorded")
        if q.policy != "none":
            why += f", their tapes shrunk by the policy {q.policy}"
        return make(strategy, peak, t_tail, (adv_t + n) / n, why, policy=q.policy), adv_t

    if plain_ok:
        found = tail_plan(p)
        if found is not None and found[1] < best_adv:
            best, best_adv = found
    tape_units = -(-p.kept_bytes // max(p.state_bytes, 1))
    if (best_adv > n - 1 and tape_units <= _MIXED_TAPE_RATIO and p.state_bytes > 0
            and plain_ok and p.slot_bytes == p.state_bytes):
        # a slot may hold a recorded step instead of a state (Maddison's mixed checkpointing);
        # u units of S bytes, the working set of the step being reversed on top
        units = int((budget - strategy_for("mixed", 0).predicted_peak(p, n)) // p.state_bytes)
        units = min(units, 2 * n)
        if units >= 1 and n * units <= _MAX_MIXED_TABLE:
            try:
                evals = mixed_cost(n, units, tape_units=tape_units)
            except ValueError:
                evals = None
            if evals is not None:
                t_mix = _time(p, n, evals - n)
                mix = Mixed(units, tape_units)
                peak = mix.predicted_peak(p, n)
                alts.append(Alternative(mix.describe(), peak, t_mix, True,
                                        f"{evals - n} extra evaluations; a slot holds a "
                                        "state or a recorded step"))
                if evals - n < best_adv:
                    best = make(mix, peak, t_mix, evals / n,
                                "a recorded step costs about a state here, so keeping some "
                                "recorded steps (mixed checkpointing) saves recomputation")
                    best.snapshots = units
                    best_adv = evals - n
    # a policy must beat the best plan without one by 10 % (measured times are noisy)
    bar = best.predicted_time * (1.0 if fixed_policy else _MARGIN)
    for q in others:
        kept_all = StoreAll(q.policy)
        peak = kept_all.predicted_peak(q, n)  # every step kept recorded under the policy
        t_q = _time(p, n, 0, kept=n, q=q)
        fits = peak <= budget
        alts.append(Alternative(kept_all.describe(), peak, t_q, fits,
                                "no recomputation of states; each step's backward "
                                "recomputes what the policy drops"))
        if fits and t_q < bar:
            best = make(kept_all, peak, t_q, 1.0,
                        f"the policy {q.policy} shrinks each recorded step enough for all "
                        "of them to fit", policy=q.policy)
            bar = t_q if fixed_policy else min(bar, _MARGIN * t_q)
        found = tail_plan(q)
        if found is not None and found[0].predicted_time < bar:
            best = found[0]
            bar = best.predicted_time if fixed_policy else _MARGIN * best.predicted_time
    if rev_plan is not None:
        strategy, row = rev_plan
        alts.append(row)
        if row.fits and row.time < _MARGIN * best.predicted_time:
            return make(strategy, row.peak, row.time, (2 * n - 1) / n,
                        "the step is reversible: its inverse rebuilds the states, cheaper than "
                        "revolve's recomputation in this budget")
    if slow is not None and slow.slots > 0 and adv > n - 1 and p.t_advance > 0:
        m = min(slow.slots, n, _MAX_SLOW_SLOTS)
        unit = p.t_advance  # costs in units of one unrecorded step
        # timing noise can make a recorded step look cheaper than an unrecorded one: clamp
        back = max((p.t_record + p.t_backward) / unit - 1.0, 0.0)
        two = TwoLevel(s_rev, m, write_cost=slow.t_write / unit, read_cost=slow.t_read / unit,
                       forward_cost=1.0, backward_cost=back, level=slow.kind)
        t_two = two.predicted_time(p, n)
        name = two.describe()
        peak = two.predicted_peak(p, n)
        note = (f"write {slow.t_write * 1e3:.3g} ms, read {slow.t_read * 1e3:.3g} ms "
                f"per state on {slow.kind}")
        alts.append(Alternative(name, peak, t_two, True, note))
        if t_two < _MARGIN * best.predicted_time:
            return make(two, peak, t_two, t_two / max(t_rev, 1e-300) * best.recompute_factor,
                        f"a second level on {slow.kind} saves recomputation at its I/O cost")
        best.reason += f"; the {slow.kind} level does not pay for its I/O"
    return best


def _reversible_alternative(p: StepProfile, n: int, budget: int,
                            window: int) -> tuple[Reversible, Alternative] | None:
    """The reversible schedule with the most snapshots that fit ``budget`` (``x_0`` alone
    when none more does), its windows no longer than ``window`` steps (the longest the
    inverse rebuilds within the drift tolerance), and its row in the plan's table; ``None``
    for a one-step chain."""
    if n < 2:
        return None
    one = Reversible(every=n)  # x_0 alone: the least memory
    room = budget - one.predicted_peak(p, n)
    extra = int(room // p.slot_bytes) if p.slot_bytes > 0 and room > 0 else 0
    every = max(1, -(-(n - 1) // (1 + extra))) if extra < n else 1
    bounded = every > window
    every = min(every, max(window, 1))
    strategy = Reversible(every=every)
    peak = strategy.predicted_peak(p, n)
    t = strategy.predicted_time(p, n)
    how = "measured" if p.t_inverse is not None else "assumed to cost one step"
    note = f"{n - 1} inverses ({how}); drift bounded to {every} steps"
    if bounded:
        note += (f" (the inverse rebuilds at most {window} steps within the drift "
                 "tolerance, so snapshots at least that often)")
    return strategy, Alternative(strategy.describe(), peak, t, peak <= budget, note)


@dataclass(frozen=True)
class Reversibility:
    """What the planner found of a step's inverse: the longest window the reversible
    schedule may rebuild (``0``: not weighed, ``why`` says why), and the inverse's time."""

    window: int
    why: str
    t_inverse: float | None = None


#: steps of the forward-then-inverse round trip that bounds an unanalysed inverse's drift
_ROUND_TRIP = 16


def reversibility(step, state, n: int, stability: Any = None) -> Reversibility | None:
    """Whether the reversible schedule may be weighed for ``step`` (``None``: the step has
    no inverse): a step that draws random numbers (torch's, numpy's or Python's global
    generators) is not, nor one found unstable for ``n`` steps by its linear stability
    analysis (``step.stability(state, 0, n)``, :mod:`deepsolve.stability`; ``stability``: the
    report when the caller has it). The window is what the analysis allows
    (:meth:`~deepsolve.stability.Stability.window`); a step without one (your own
    ``invertible``) is run forward and back over :data:`_ROUND_TRIP` steps, and its drift
    there bounds the window. The inverse's time is measured on ``step(state, 0)``."""
    inverse = getattr(step, "inverse", None)
    if not callable(inverse):
        return None
    leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    meta = [(t.shape, t.dtype, t.device) for t in leaves]
    devices = cuda_devices(leaves)
    tol = default_tolerance(meta)
    floating = [m[1] for m in meta if m[1].is_floating_point or m[1].is_complex]
    eps = max((torch.finfo(d).eps for d in floating), default=torch.finfo(torch.float64).eps)
    with torch.random.fork_rng(devices=devices):
        before = RngState.capture(devices, host=True)
        try:
            with torch.no_grad():
                x1 = _next_state(step, state, 0)
        except Exception:
            return Reversibility(0, "not weighed: the step fails outside the unroll")
        after = RngState.capture(devices, host=True)
        moved = (["torch's"] if not before.same_torch(after) else []) + \
            before.moved_host(after)
        if moved:
            return Reversibility(0, f"not weighed: the step draws random numbers "
                                    f"({', '.join(moved)}), which an inverse cannot give back")
        t_inv = _time_inverse(inverse, x1, state)
        if t_inv is None:
            return Reversibility(0, "not weighed: the step's inverse fails on step(x_0, 0)")
        rep = stability
        if rep is None and callable(getattr(step, "stability", None)):
            try:
                rep = step.stability(state, 0, n)
            except Exception:
                rep = None
        if rep is not None:
            if not rep.stable(n):
                return Reversibility(0, f"not weighed: {rep.scheme} is unstable for this step "
                                        f"(a mode grows by {rep.excess:.4g} per step at "
                                        f"{rep.worst})", t_inv)
            window = rep.window(tol, eps)
            growth = rep.inverse_growth
        else:
            found = _round_trip(step, inverse, state, min(n - 1, _ROUND_TRIP), tol)
            if isinstance(found, str):
                return Reversibility(0, f"not weighed: {found}", t_inv)
            err, m = found
            growth = max(1.0, (err / (10 * eps)) ** (1 / m)) if err > 0 else 1.0
            window = drift_window(growth, tol, eps)
    if window < 2:
        return Reversibility(0, f"not weighed: the inverse amplifies rounding by up to "
                                f"{growth:.4g} per step, so a window may hold at most "
                                f"{window} step(s) within the drift tolerance {tol:.2g}",
                             t_inv)
    return Reversibility(window, f"windows of at most {window} steps (the inverse amplifies "
                                 f"rounding by up to {growth:.4g} per step)", t_inv)


def _next_state(step, state, i: int):
    """``step(state, i)`` without its output, if it returns ``(next_state, output)``."""
    x1 = step(state, i)
    if pytree.tree_structure(x1) != pytree.tree_structure(state) and \
            isinstance(x1, tuple) and len(x1) == 2:
        x1 = x1[0]
    return x1


def _round_trip(step, inverse, state, m: int, tol: float) -> tuple[float, int] | str:
    """``m`` steps forward from ``state`` and ``m`` inverses back: ``(drift, m)``, or why the
    round trip fails (a non-finite state, a drift beyond ``tol``)."""
    m = max(m, 1)
    with torch.no_grad():
        xs = [state]
        for i in range(m):
            xs.append(_next_state(step, xs[-1], i))
        cur = xs[-1]
        for i in reversed(range(m)):
            cur = inverse(cur, i)
    a = [t for t in pytree.tree_leaves(cur) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return "the step's inverse returns another structure than the step"
    err = relative_error(a, b)
    if not err <= tol:
        return (f"{m} steps forward and {m} inverses back drift by {err:.3g} (relative), "
                f"above the tolerance {tol:.2g}")
    return err, m


def _time_inverse(inverse, x1, state, repeats: int = 3) -> float | None:
    """The median time of the step's inverse on ``x1 = step(state, 0)`` [s], or ``None`` when
    it fails here (the unroll's own check names the problem)."""
    try:
        with torch.no_grad():
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                inverse(x1, 0)
                _sync(state)
                times.append(time.perf_counter() - t0)
    except Exception:
        return None
    return sorted(times)[len(times) // 2]


def _sync(state) -> None:
    leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    if leaves and leaves[0].device.type == "cuda":
        torch.cuda.synchronize(leaves[0].device)


def plan(step, state, n_steps: int, *, budget: BudgetLike, params=None, device=None,
         offload: str | None = None, spill_dir: str | None = None, policy: Any = None,
         snapshot_dtype: Any = None, group: Any = None, stability: Any = None) -> Plan:
    """Profile ``step`` on ``state`` (cached) and choose the fastest schedule for ``n_steps``
    steps whose predicted peak fits ``budget`` (bytes, ``"2GiB"``, ``"80%"``).

    ``offload="host"`` (pinned host memory, for CUDA states) or ``"disk"`` (files under
    ``spill_dir``, for CPU-only machines) lets the planner weigh a cost-aware two-level
    schedule whose write/read costs are measured on a state-sized copy.

    ``policy=None`` lets the planner choose the recomputation policy of kept tapes together
    with the schedule: when plain store-all does not fit, the recorded step is also profiled
    under ``"save_expensive"`` and ``"recompute_all"`` (cached) and the fastest fitting
    (schedule, policy) pair wins. A given policy (a name, a policy function, a list of ops)
    is used for every kept tape; ``"none"`` keeps today's tapes. ``snapshot_dtype`` counts
    snapshots at that dtype's size (see :func:`deepsolve.unroll`).

    ``group`` (a ``torch.distributed`` process group): every rank of it calls ``plan`` with
    its own step and state (its block of a decomposed field); the profiles, budgets and
    second levels are reduced to the worst case over the ranks before choosing, so every
    rank gets the same plan, the one that fits the tightest rank (:mod:`.agree`).

    A step with an inverse (``step.inverse``) gets the reversible schedule weighed only when
    it draws no random numbers and is found stable: by its linear stability analysis
    (``step.stability(state)``, or ``stability``, the report the caller computed already;
    :mod:`deepsolve.stability`), whose inverse growth also bounds the windows, or, for a
    step without one, by a forward-and-back round trip (:func:`reversibility`).

    Raises :class:`~deepsolve.BudgetError` (a ``ValueError``) with the minimum budget when no
    schedule fits. ``Plan.explain()`` prints the alternatives weighed.
    """
    if not callable(step):
        raise TypeError(f"plan: step must be callable as step(state, i), got "
                        f"{type(step).__name__}")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"plan: n_steps must be an integer >= 1, got {n_steps!r}")
    leaves = pytree.tree_leaves(state)
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise TypeError(f"plan: the state must be a tensor or a pytree of tensors (the "
                        f"unroll's x_0), got {type(state).__name__}")
    snapshot_dtype = check_snapshot_dtype(snapshot_dtype)
    policy_context(policy)  # a one-line error for an unknown policy, before profiling
    dev = device if device is not None else (leaves[0].device if leaves else None)
    nbytes = agree_min(parse_budget(budget, dev), group)
    if dev is None or torch.device(dev).type == "cpu":
        hold_to_budget(nbytes)  # RSS must follow the live bytes the budget bounds
    _refuse_before_profiling(leaves, n_steps, nbytes)
    gate = functools.partial(_gate, n=n_steps, budget=nbytes, refuse=group_size(group) == 1)
    prof = agree_profile(profile_step(step, state, params=params, gate=gate), group)
    if snapshot_dtype is not None:
        prof = dataclasses.replace(prof, snapshot_bytes=snapshot_nbytes(leaves, snapshot_dtype))
    policies, failed = None, []
    candidates: tuple[Any, ...]
    library = 0
    skipped = ""
    if policy is None:
        candidates = POLICIES[1:] if predicted_peak(prof, n_steps, "store_all") > nbytes else ()
        if candidates and not agree_min(int(affordable(nbytes)), group):
            skipped = (f"recomputation policies not weighed: loading their machinery "
                       f"(torch._dynamo) would keep about "
                       f"{format_bytes(policy_machinery())} resident, more than 1/8 of the "
                       "budget")
            candidates = ()
    else:
        candidates = () if _name(policy) == "none" else (policy,)
    if candidates:
        library = agree_max(load_policy_machinery(), group)
        policies = [prof] if policy is None else []
        for q in candidates:
            why = "on another rank"
            try:
                measured = profile_step(step, state, params=params, policy=q)
            except Exception as e:  # a step that checkpointing cannot replay
                if policy is not None:
                    raise
                measured, why = None, type(e).__name__
            measured = agree_profile(measured, group)  # failed on one rank: failed on all
            if measured is None:
                failed.append(Alternative(f"policy {q}", 0, 0.0, False,
                                          f"not weighed: the step fails under it "
                                          f"({why})"))
                continue
            policies.append(dataclasses.replace(measured, snapshot_bytes=prof.snapshot_bytes))
    slow = agree_level(measure_level(offload, leaves, spill_dir), group) if offload else None
    # a reversible schedule keeps its snapshots exact (the drift is measured against them)
    rev = reversibility(step, state, n_steps, stability) if snapshot_dtype is None else None
    if group_size(group) > 1:  # every rank weighs the same windows at the same cost
        window = agree_min(rev.window if rev is not None else 0, group)
        if rev is not None:
            t = agree_max_time(rev.t_inverse or 0.0, group) if window else None
            why = rev.why if (window or not rev.window) else \
                "not weighed: another rank of the group did not find the step reversible"
            rev = dataclasses.replace(rev, window=window, t_inverse=t, why=why)
    t_inv = rev.t_inverse if rev is not None else None
    if t_inv is not None:
        prof = dataclasses.replace(prof, t_inverse=t_inv)
        if policies:
            policies = [dataclasses.replace(q, t_inverse=t_inv) for q in policies]
    window = rev.window if rev is not None else 0
    result = choose(prof, n_steps, nbytes, slow, policies, library=library,
                    reversible=window or False)
    if rev is not None and not window:
        failed.append(Alternative("reversible", 0, 0.0, False, rev.why))
    result.alternatives.extend(failed)
    if skipped:
        result.reason += f"; {skipped}"
    result.snapshot_dtype = snapshot_dtype
    if policy is not None and not isinstance(policy, str) and result.policy != "none":
        result.policy = policy  # the caller's function or op list, for the executor
    if result.kind == "store_all" and result.policy == "none":
        release_budget()  # plain backpropagation: the C library's own behaviour, no cache
    return result


_level_cache: dict = {}


def measure_level(kind: str, leaves, spill_dir: str | None = None) -> SlowLevel:
    """Time writing and reading one state to host memory or a spill directory, and count
    how many states fit there (half of the available RAM or free disk space)."""
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
        room = (device_capacity("cpu") if isinstance(store, HostStorage)  # kind == "host"
                else shutil.disk_usage(spill_dir or os.path.dirname(store.dir)).free) // 2
    finally:
        store.close()
    level = SlowLevel(kind, int(room // max(nbytes, 1)), sorted(writes)[1], sorted(reads)[1],
                      spill_dir)
    _level_cache[key] = level
    return level


def online_snapshots(step, state, budget: BudgetLike, max_steps: int | None = None,
                     params=None, snapshot_dtype: Any = None) -> int:
    """Snapshot slots for an unknown-length unroll under ``budget``: the most that fit beside
    one recorded step, the working set and (with ``max_steps``) the stacked outputs; with
    ``snapshot_dtype``, snapshots are counted at that dtype's size.
    Raises :class:`~deepsolve.BudgetError` when not even ``x_0`` and one step fit."""
    leaves = pytree.tree_leaves(state)
    nbytes = parse_budget(budget, leaves[0].device if leaves else None)
    if not leaves or leaves[0].device.type == "cpu":
        hold_to_budget(nbytes)
    p = profile_step(step, state, params=params,
                     gate=lambda q: _warrants_units(q, nbytes, Revolve(1).predicted_peak(q, 0)))
    # as revolve(1), with the outputs also listed during the forward sweep, and one state
    # more: the online forward holds x_{i-1} beside x_i
    need = (Revolve(1).predicted_peak(p, max_steps or 0) + (max_steps or 0) * p.output_bytes
            + p.state_bytes)
    room = nbytes - need
    if room < 0:
        raise BudgetError(
            f"the budget {format_bytes(nbytes)} is below the minimum {format_bytes(need)} an "
            f"unknown-length unroll needs: one recorded step takes {format_bytes(p.step_bytes)}"
            f" at its peak (its tape {format_bytes(p.tape_bytes)}), adjoints and states "
            f"{format_bytes(5 * p.state_bytes)}; raise the budget or shrink the step")
    slot = (snapshot_nbytes(leaves, snapshot_dtype) if snapshot_dtype is not None
            else p.state_bytes) + p.slot_extra  # a snapshot's objects beside its tensors
    if slot == 0:
        return 1_000_000
    return 1 + int(room // slot)  # x_0's slot is free
