"""The planner: from a measured step profile, a chain length and a memory budget to a schedule.

Memory model (bytes the unroll adds at its peak; the caller's parameters and initial state
are not counted). With S the state, S' a snapshot (S, or less with ``snapshot_dtype``), T the
tape of one recorded step, O one step's output, W = 3 S + P + scratch the working set of the
reverse sweep (current state, two adjoints, parameter gradients P, measured scratch)::

    store_all        n (T + S) + W + n O          (the graph keeps every step and its input)
    revolve(s)       (s - 1) S' + T + W + n O     (x_0 is the caller's; one recorded step)
    mixed(u)         u S + T + W + n O            (u units hold states or kept tapes)
    two_level(s, m)  (s - 1) S' + T + W + n O     (+ m states in host RAM or on disk)
    revolve_tail(s, m) (s - 1) S' + m (T + S) + W + n O  (the last m steps kept recorded)

A recomputation policy p (selective activation checkpointing of kept tapes) replaces T by its
smaller kept tape T_p in ``store_all`` and ``revolve_tail``, and adds the transient T of
recomputing the tape being reversed: ``n (T_p + S) + T + W + n O`` and
``(s - 1) S' + m (T_p + S) + T + W + n O``. Steps reversed as soon as they are recorded
(revolve, two-level, mixed) run without a policy.

Time model, relative to one forward + backward of the plain unroll
``n (t_record + t_backward)``: a schedule costs ``advances * t_advance + n (t_record +
t_backward)`` plus I/O for a second storage level; the ``m`` kept steps under a policy cost
its ``t_record + t_backward`` instead.

The planner takes store-all when it fits; otherwise the cheapest (schedule, policy) pair that
fits; and raises :class:`~deepsolve.memory.budget.BudgetError` with the minimum budget when
nothing does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
        policy: the recomputation policy for kept tapes (``"none"``, a name from
            :data:`deepsolve.executor.POLICIES`, or the policy object the caller gave).
        policies: profiles of the recorded step under the policies weighed.
        snapshot_dtype: the dtype snapshots are stored in (``None``: the state's own).
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

    def explain(self) -> str:
        """A short table of the alternatives weighed and why this plan was chosen."""
        p = self.profile
        lines = [
            f"budget {format_bytes(self.budget)} for {self.n_steps} steps; measured step: "
            f"state {format_bytes(p.state_bytes)}, recorded step {format_bytes(p.tape_bytes)}"
            f", outputs {format_bytes(p.output_bytes)}/step, working set "
            f"{format_bytes(p.working_bytes)}; t_advance {p.t_advance * 1e3:.3g} ms, "
            f"t_record+backward {(p.t_record + p.t_backward) * 1e3:.3g} ms",
        ]
        for q in self.policies:
            lines.append(
                f"recorded step under policy {q.policy}: keeps {format_bytes(q.tape_bytes)} "
                f"({q.tape_bytes / max(p.tape_bytes, 1):.0%} of the plain tape; its backward "
                f"recomputes up to {format_bytes(q.reverse_extra)} more), t_record+backward "
                f"{(q.t_record + q.t_backward) * 1e3:.3g} ms")
        if p.snapshot_bytes is not None:
            lines.append(f"snapshots stored as {self.snapshot_dtype or 'a smaller dtype'}: "
                         f"{format_bytes(p.slot_bytes)} each (gradients no longer exact)")
        lines += ["", f"  {'schedule':<52} {'peak':>12} {'time':>7}  fits"]
        for a in self.alternatives:
            mark = "*" if a.name == self.describe() else " "
            lines.append(f"{mark} {a.name:<52} {format_bytes(a.peak):>12} {a.time:>6.2f}x  "
                         f"{'yes' if a.fits else 'no '}  {a.note}")
        lines += ["", f"chosen: {self.describe()} — {self.reason}",
                  f"recomputation policy for kept tapes: {_name(self.policy)}",
                  f"predicted peak {format_bytes(self.predicted_peak)}, time "
                  f"{self.predicted_time:.2f}x the plain unroll, recompute factor "
                  f"{self.recompute_factor:.2f}"]
        return "\n".join(lines)

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.kind == "store_all":
            return "store_all" + _tag(_name(self.policy))
        if self.kind == "revolve":
            return f"revolve(s={self.snapshots})"
        return repr(self.schedule)


def _name(policy: Any) -> str:
    from ..executor import policy_name

    return policy_name(policy)


def _tag(policy: str) -> str:
    return "" if policy == "none" else f" [{policy}]"


def predicted_peak(profile: StepProfile, n_steps: int, kind: str, slots: Any = 0) -> int:
    """Bytes the unroll adds at its peak under the memory model of this module. For a
    profile measured under a policy, ``store_all`` and ``revolve_tail`` keep its tapes."""
    p = profile
    outs = n_steps * p.output_bytes
    if kind == "store_all":
        return (n_steps * (p.tape_bytes + p.state_bytes) + p.reverse_extra + p.working_bytes
                + outs)
    if kind in ("revolve", "two_level"):
        return max(slots - 1, 0) * p.slot_bytes + p.plain_tape_bytes + p.working_bytes + outs
    if kind == "revolve_tail":
        s, m = slots
        return (max(s - 1, 0) * p.slot_bytes + max(m, 1) * p.tape_bytes + m * p.state_bytes
                + p.reverse_extra + p.working_bytes + outs)
    if kind == "mixed":
        return slots * p.state_bytes + p.plain_tape_bytes + p.working_bytes + outs
    raise ValueError(f"unknown schedule kind {kind!r}")


def _best_tail(p: StepProfile, n: int, budget: int,
               q: StepProfile | None = None) -> tuple[int, int, int] | None:
    """``(snapshots, tail, advances)`` of the fastest revolve-with-recorded-tail that fits,
    its tail recorded under ``q``'s policy (default: ``p``'s), or ``None`` when no tail of two
    steps or more fits."""
    q = p if q is None else q
    kept = q.tape_bytes + q.state_bytes  # a kept tape holds its input state too
    room = budget - p.working_bytes - n * p.output_bytes - q.reverse_extra
    if kept <= 0 or p.slot_bytes <= 0 or room < 2 * kept:
        return None
    m_max = min(n, room // kept)
    stride = max(1, m_max // 4000)  # scan at most ~4000 tail lengths
    best, best_t = None, 0.0
    for m in list(range(2, m_max + 1, stride)) + [m_max]:
        s = 1 + (room - m * kept) // p.slot_bytes
        if s < 1:
            continue
        s = int(min(s, max(n - m, 1)))
        adv = revolve_tail_cost(n, s, m)
        t = _time(p, n, adv, kept=m, q=q)
        if best is None or t < best_t or (t == best_t and m < best[1]):
            best, best_t = (s, m, adv), t
    return best


def _time(profile: StepProfile, n: int, advances: float, io: float = 0.0, kept: int = 0,
          q: StepProfile | None = None) -> float:
    """Predicted time relative to the plain unroll; ``kept`` steps recorded under ``q``.

    A kept step under a policy costs its measured record + backward time, but never less
    than the plain step's (recomputation is not free; this keeps timing noise from making a
    policy look free), and under ``"recompute_all"`` at least one unrecorded step more."""
    p = profile
    plain = n * (p.t_record + p.t_backward)
    if plain <= 0:
        return 1.0
    extra = 0.0
    if q is not None and kept and q.policy != "none":
        floor = p.t_advance if q.policy == "recompute_all" else 0.0
        extra = kept * max((q.t_record + q.t_backward) - (p.t_record + p.t_backward), floor)
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


def choose(profile: StepProfile, n_steps: int, budget: int,
           slow: SlowLevel | None = None,
           policies: Sequence[StepProfile] | None = None) -> Plan:
    """The fastest schedule whose predicted peak fits ``budget`` (bytes); with ``slow``, a
    cost-aware two-level schedule is weighed too.

    ``profile`` is the plain (no policy) profile. ``policies`` are profiles of the recorded
    step under recomputation policies (:func:`~deepsolve.memory.profile_step` with
    ``policy=``) whose kept tapes ``store_all`` and ``revolve_tail`` may use; ``None`` weighs
    the plain tape only. When ``policies`` is given and lacks a ``"none"`` profile, kept tapes
    always use a policy (the caller fixed it). A policy is taken only when predicted at least
    2 % faster than the best plan without it (measured times are noisy)."""
    p, n = profile, n_steps
    keep = [p] if policies is None else list(policies)
    plain_ok = any(q.policy == "none" for q in keep)
    others = [q for q in keep if q.policy != "none"]
    alts: list[Alternative] = []
    peak_all = predicted_peak(p, n, "store_all")
    fits_all = peak_all <= budget and plain_ok
    if plain_ok:
        alts.append(Alternative("store_all", peak_all, _time(p, n, 0), fits_all,
                                "no recomputation"))
    # revolve with the most slots that fit (x_0's slot is free)
    room = budget - predicted_peak(p, n, "revolve", 1)
    s_max = 1 + room // p.slot_bytes if room >= 0 and p.slot_bytes > 0 else 0
    if p.slot_bytes == 0 and room >= 0:
        s_max = n
    s_rev = int(min(s_max, max(n - 1, 1)))  # n - 1 slots already avoid all recomputation
    extra = dict(policies=others, snapshot_dtype=None)
    if fits_all:
        sched = store_all(n)
        plan = Plan("store_all", sched, n, None, budget, peak_all, _time(p, n, 0), 1.0, p,
                    alts, "everything fits: plain backpropagation, no recomputation", **extra)
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
                "store_all does not fit; revolve with the most snapshots that fit", **extra)

    def tail_plan(q: StepProfile, bar: float) -> Plan | None:
        """The fastest recorded tail kept under ``q``'s policy, if faster than ``bar``."""
        tail = _best_tail(p, n, budget, q)
        if tail is None:
            return None
        s_t, m, adv_t = tail
        t_tail = _time(p, n, adv_t, kept=m, q=q)
        name = f"revolve(s={s_t}) + {m} recorded steps" + _tag(q.policy)
        peak = predicted_peak(q, n, "revolve_tail", (s_t, m))
        alts.append(Alternative(name, peak, t_tail, True,
                                f"{adv_t} recomputed steps; the last {m} steps are kept "
                                "recorded from the forward sweep"))
        if t_tail >= bar:
            return None
        why = ("store_all does not fit; memory beyond the snapshots revolve needs keeps the "
               "last steps recorded")
        if q.policy != "none":
            why += f", their tapes shrunk by the policy {q.policy}"
        return Plan("revolve_tail", revolve_tail(n, s_t, m), n, s_t, budget, peak, t_tail,
                    (adv_t + n) / n, p, alts, why, label=name, policy=q.policy, **extra)

    if plain_ok:
        best = tail_plan(p, best.predicted_time) or best
    # a policy must beat the best plan without one by 2 % (measured times are noisy)
    plain_time = best.predicted_time if plain_ok else float("inf")
    for q in others:
        bar = min(best.predicted_time, 0.98 * plain_time)
        peak = predicted_peak(q, n, "store_all")  # every step kept recorded under the policy
        t_q = _time(p, n, 0, kept=n, q=q)
        fits = peak <= budget
        alts.append(Alternative("store_all" + _tag(q.policy), peak, t_q, fits,
                                "no recomputation of states; each step's backward "
                                "recomputes what the policy drops"))
        if fits and t_q < bar:
            best = Plan("store_all", store_all(n), n, None, budget, peak, t_q, 1.0, p, alts,
                        f"the policy {q.policy} shrinks each recorded step enough for all "
                        "of them to fit", policy=q.policy, **extra)
            bar = t_q
        best = tail_plan(q, bar) or best
    tape_units = -(-p.tape_bytes // max(p.state_bytes, 1))
    if (adv > n - 1 and tape_units <= _MIXED_TAPE_RATIO and p.state_bytes > 0 and plain_ok
            and p.slot_bytes == p.state_bytes):
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
                                label=name, **extra)
    if slow is not None and slow.slots > 0 and adv > n - 1 and p.t_advance > 0:
        m = min(slow.slots, n, _MAX_SLOW_SLOTS)
        unit = p.t_advance  # costs in units of one unrecorded step
        # timing noise can make a recorded step look cheaper than an unrecorded one: clamp
        back = max((p.t_record + p.t_backward) / unit - 1.0, 0.0)
        kw = dict(write_cost=slow.t_write / unit, read_cost=slow.t_read / unit,
                  forward_cost=1.0, backward_cost=back)
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
                        label=name, **extra)
        best.reason += f"; the {slow.kind} level does not pay for its I/O"
    return best


def plan(step, state, n_steps: int, *, budget: int | str, params=None, device=None,
         offload: str | None = None, spill_dir: str | None = None, policy: Any = None,
         snapshot_dtype: Any = None) -> Plan:
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

    Raises :class:`~deepsolve.BudgetError` (a ``ValueError``) with the minimum budget when no
    schedule fits. ``Plan.explain()`` prints the alternatives weighed.
    """
    import dataclasses

    from torch.utils import _pytree as pytree

    from ..executor import POLICIES, check_snapshot_dtype, policy_context, snapshot_nbytes
    from .budget import parse_budget
    from .profiling import profile_step

    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"plan: n_steps must be an integer >= 1, got {n_steps!r}")
    snapshot_dtype = check_snapshot_dtype(snapshot_dtype)
    policy_context(policy)  # a one-line error for an unknown policy, before profiling
    leaves = pytree.tree_leaves(state)
    dev = device if device is not None else (leaves[0].device if leaves else None)
    nbytes = parse_budget(budget, dev)
    prof = profile_step(step, state, params=params)
    if snapshot_dtype is not None:
        prof = dataclasses.replace(prof, snapshot_bytes=snapshot_nbytes(leaves, snapshot_dtype))
    policies, failed = None, []
    if policy is None:
        candidates = POLICIES[1:] if predicted_peak(prof, n_steps, "store_all") > nbytes else ()
    else:
        candidates = () if _name(policy) == "none" else (policy,)
    if candidates:
        policies = [prof] if policy is None else []
        for q in candidates:
            try:
                measured = profile_step(step, state, params=params, policy=q)
            except Exception as e:  # a step that checkpointing cannot replay
                if policy is not None:
                    raise
                failed.append(Alternative(f"policy {q}", 0, 0.0, False,
                                          f"not weighed: the step fails under it "
                                          f"({type(e).__name__})"))
                continue
            policies.append(dataclasses.replace(measured, snapshot_bytes=prof.snapshot_bytes))
    slow = measure_level(offload, leaves, spill_dir) if offload else None
    result = choose(prof, n_steps, nbytes, slow, policies)
    result.alternatives.extend(failed)
    result.snapshot_dtype = snapshot_dtype
    if policy is not None and not isinstance(policy, str) and result.policy != "none":
        result.policy = policy  # the caller's function or op list, for the executor
    return result


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
                     params=None, snapshot_dtype: Any = None) -> int:
    """Snapshot slots for an unknown-length unroll under ``budget``: the most that fit beside
    one recorded step, the working set and (with ``max_steps``) the stacked outputs; with
    ``snapshot_dtype``, snapshots are counted at that dtype's size.
    Raises :class:`~deepsolve.BudgetError` when not even ``x_0`` and one step fit."""
    from torch.utils import _pytree as pytree

    from ..executor import snapshot_nbytes
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
    slot = snapshot_nbytes(leaves, snapshot_dtype) if snapshot_dtype is not None \
        else p.state_bytes
    if slot == 0:
        return 1_000_000
    # x_0's slot is free; one full-size state more than offline: the online forward holds
    # x_{i-1} beside x_i
    return max(1, 1 + int((room - p.state_bytes) // slot))
