"""Checkpoint strategies: objects that build their schedule, price it and name themselves.

``unroll(step, x0, n, schedule=Revolve(20))`` says *how* to checkpoint, independently of
``n``: a strategy builds the schedule for any chain length (:meth:`Strategy.build`), predicts
the peak bytes it adds and its time relative to plain backpropagation from a measured step
profile (:meth:`Strategy.peak_terms`, :meth:`Strategy.predicted_time`, the memory model of
:mod:`deepsolve.memory.planner`), and describes itself as the planner's tables and the
HDF5 log name it. The planner weighs candidate strategies, keeps those whose predicted peak
fits the budget and takes the fastest; :class:`Budget` is the strategy that asks the planner.
(Models: diffrax's ``RecursiveCheckpointAdjoint(checkpoints=...)``.)

The short forms stay: ``snapshots=20`` is ``Revolve(20)``, ``budget="64MiB"`` is
``Budget("64MiB")``, ``schedule="periodic"`` is ``Periodic()``; a schedule object from
:mod:`deepsolve.schedules` (built for one ``n``) is accepted as it is. Note the names:
``deepsolve.Revolve(20)`` is a strategy, ``deepsolve.schedules.Revolve`` the schedule it builds
for one ``n``.

Memory model (bytes; S a state, S' a snapshot, W the working set of a step advanced or
recorded and reversed at once, K a kept recorded step, M recording plus reverse, C one more
step of a plain autograd chain, P parameter gradients, O one step's outputs)::

    StoreAll()              (n - 1) C + M + S + 2 P + 2 n O
    Revolve(s)              (s - 1) S' + W + 4 S + 2 P + 2 n O
    TwoLevel(s, ...)        as Revolve(s), plus the states on the second level
    Mixed(u, t)             u S + W + 4 S + 2 P + 2 n O
    RevolveTail(s, m)       max((s - 1) S' + m K + (M - K) + 3 S, Revolve(s)'s) + 2 P + 2 n O
    Periodic(k)             as RevolveTail(ceil(n / k), k): the snapshots and one segment kept
    Online(s)               as Revolve(s), plus the state the online forward holds beside x_i
    Reversible(k)           (ceil((n - 1) / k) - 1) S' + W + 5 S + 2 P + 2 n O
                            (on_drift="recompute": + 7 S' + P for recomputing a window)

Time model: ``(advances * t_advance + n (t_record + t_backward)) / (n (t_record +
t_backward))`` with the schedule's exact count of unrecorded steps (closed forms where they
exist: Griewank & Walther 2000 for revolve); a reversible schedule adds ``n - 1`` inverses
at ``t_inverse`` (measured by the planner; ``t_advance`` when not).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from .. import schedules as S
from ..engine import policy_name
from .budget import BudgetLike, parse_budget
from .profiling import StepProfile

__all__ = ["Strategy", "StoreAll", "Revolve", "Periodic", "Online", "TwoLevel", "RevolveTail",
           "Mixed", "Reversible", "Budget", "as_strategy", "strategy_for"]


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _tag(policy: Any) -> str:
    name = policy_name(policy)
    return "" if name == "none" else f" [{name}]"


class Strategy:
    """A way to checkpoint a chain of any length; see the module docstring.

    Subclasses give :attr:`kind`, :meth:`build`, :meth:`advances` and :meth:`_terms` (the
    schedule-specific terms of the predicted peak); the parameter-gradient and stacked-output
    terms, the sum and the time model are common."""

    kind: ClassVar[str] = ""
    #: whether :meth:`build` needs the chain length (False: an online strategy, ``until=``)
    offline: ClassVar[bool] = True
    policy: Any = None
    #: compiled segments for the unrolls of this strategy (``unroll``'s ``compile=``:
    #: ``True``, a segment length, ``"auto"``); ``False``: eager steps. Set by
    #: :meth:`compiled`, or ``Budget(..., compile=)``.
    compile: Any = False

    def compiled(self, compile: bool | int | str = True) -> Strategy:
        """This strategy with compiled segments (docs/compile.md): ``Revolve(8).compiled()``
        checkpoints a chain of compiled ``k``-step segments with 8 snapshots."""
        new = copy.copy(self)
        new.compile = compile
        return new

    def build(self, n_steps: int) -> S.Schedule:
        raise NotImplementedError

    def advances(self, n_steps: int) -> int:
        """Unrecorded step evaluations of the schedule for ``n_steps`` steps (each step is
        also recorded once)."""
        raise NotImplementedError

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        raise NotImplementedError

    def peak_terms(self, profile: StepProfile, n_steps: int) -> dict[str, int]:
        """The terms of the predicted peak [bytes] (they sum to :meth:`predicted_peak`)."""
        terms = self._terms(profile, n_steps)
        terms["parameter gradients"] = 2 * profile.grad_bytes
        terms["stacked outputs"] = 2 * n_steps * profile.output_bytes
        return terms

    def predicted_peak(self, profile: StepProfile, n_steps: int) -> int:
        """Bytes the unroll adds to the process's peak under the memory model."""
        return sum(self.peak_terms(profile, n_steps).values())

    def predicted_time(self, profile: StepProfile, n_steps: int) -> float:
        """Predicted time relative to one forward + backward of the plain unroll."""
        p = profile
        plain = n_steps * (p.t_record + p.t_backward)
        if plain <= 0:
            return 1.0
        return (self.advances(n_steps) * p.t_advance + plain) / plain

    def describe(self) -> str:
        """The name the planner's table and the log give this strategy."""
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))


class StoreAll(Strategy):
    """Plain backpropagation: every step's tape kept (under ``policy``, if given)."""

    kind = "store_all"

    def __init__(self, policy: Any = None):
        self.policy = policy

    def build(self, n_steps: int) -> S.Schedule:
        return S.store_all(n_steps)

    def advances(self, n_steps: int) -> int:
        return 0

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        return {"kept tapes": max(n - 1, 0) * p.chain_bytes,
                "working set of the step": p.reverse_bytes,
                "adjoints and states": p.state_bytes}

    def describe(self) -> str:
        return "store_all" + _tag(self.policy)

    def __repr__(self) -> str:
        return "StoreAll()" if self.policy is None else f"StoreAll(policy={self.policy!r})"


class Revolve(Strategy):
    """Binomial checkpointing with ``snapshots`` slots, ``x_0`` included (Griewank &
    Walther, ACM TOMS 26(1), 2000): ``t(n, s)`` unrecorded steps, the minimum."""

    kind = "revolve"

    def __init__(self, snapshots: int):
        self.snapshots = _count("Revolve: snapshots", snapshots, 1)

    def build(self, n_steps: int) -> S.Schedule:
        return S.revolve(n_steps, self.snapshots)

    def advances(self, n_steps: int) -> int:
        return S.optimal_cost(n_steps, self.snapshots)

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        return {"snapshots": max(self.snapshots - 1, 0) * p.slot_bytes,
                "working set of the step": p.step_bytes,
                "adjoints and states": 4 * p.state_bytes}

    def describe(self) -> str:
        return f"revolve(s={self.snapshots})"

    def __repr__(self) -> str:
        return f"Revolve({self.snapshots})"


class TwoLevel(Revolve):
    """Revolve's ``snapshots`` in device memory plus ``slow_slots`` on a second level
    (``level``: ``"host"`` or ``"disk"``) with the given write/read costs in units of one
    unrecorded step (Stumm & Walther 2009; Aupy et al. 2016): the cost-optimal two-level
    schedule. Device memory as :class:`Revolve`'s."""

    kind = "two_level"

    def __init__(self, snapshots: int, slow_slots: int, *, write_cost: float = 1.0,
                 read_cost: float = 1.0, forward_cost: float = 1.0,
                 backward_cost: float = 0.0, level: str = "host"):
        super().__init__(snapshots)
        self.slow_slots = _count("TwoLevel: slow_slots", slow_slots, 0)
        self.costs = dict(write_cost=write_cost, read_cost=read_cost,
                          forward_cost=forward_cost, backward_cost=backward_cost)
        self.level = level

    def build(self, n_steps: int) -> S.Schedule:
        return S.two_level(n_steps, self.snapshots, self.slow_slots, **self.costs)

    def advances(self, n_steps: int) -> int:
        return S.stats(self.build(n_steps)).advances

    def predicted_time(self, profile: StepProfile, n_steps: int) -> float:
        """Revolve's time scaled by the two-level makespan (recomputation and I/O in units of
        one unrecorded step) against that of revolve alone."""
        t_rev = Revolve(self.snapshots).predicted_time(profile, n_steps)
        cost = S.two_level_cost(n_steps, self.snapshots, self.slow_slots, **self.costs)
        base = S.two_level_cost(n_steps, self.snapshots, 0, **self.costs)
        return t_rev * cost / base if base else t_rev

    def describe(self) -> str:
        return f"two_level(s={self.snapshots}, {self.level}={self.slow_slots})"

    def __repr__(self) -> str:
        return f"TwoLevel({self.snapshots}, {self.slow_slots}, level={self.level!r})"


class RevolveTail(Strategy):
    """Revolve with ``snapshots`` slots whose last ``tail`` steps stay recorded from the
    forward sweep (their tapes kept, under ``policy`` if given)."""

    kind = "revolve_tail"

    def __init__(self, snapshots: int, tail: int, policy: Any = None):
        self.snapshots = _count("RevolveTail: snapshots", snapshots, 1)
        self.tail = _count("RevolveTail: tail", tail, 1)
        self.policy = policy

    def build(self, n_steps: int) -> S.Schedule:
        return S.revolve_tail(n_steps, self.snapshots, self.tail)

    def advances(self, n_steps: int) -> int:
        return S.revolve_tail_cost(n_steps, self.snapshots, self.tail)

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        return _tail_terms(p, self.snapshots, self.tail)

    def describe(self) -> str:
        return f"revolve(s={self.snapshots}) + {self.tail} recorded steps" + _tag(self.policy)

    def __repr__(self) -> str:
        extra = "" if self.policy is None else f", policy={self.policy!r}"
        return f"RevolveTail({self.snapshots}, {self.tail}{extra})"


def _tail_terms(p: StepProfile, s: int, m: int) -> dict[str, int]:
    """``s`` snapshots and ``m`` kept tapes reversed one by one, or the revolve part after
    them, whichever holds more."""
    S_ = p.state_bytes
    terms = {"snapshots": max(s - 1, 0) * p.slot_bytes}
    tail = m * p.kept_bytes + max(p.reverse_bytes - p.kept_bytes, 0) + 3 * S_
    head = p.step_bytes + 4 * S_
    if tail >= head:
        terms["kept tapes"] = m * p.kept_bytes
        terms["working set of the step"] = max(p.reverse_bytes - p.kept_bytes, 0)
        terms["adjoints and states"] = 3 * S_
    else:  # the revolve part after the tail is the larger
        terms["kept tapes"] = 0
        terms["working set of the step"] = p.step_bytes
        terms["adjoints and states"] = 4 * S_
    return terms


class Periodic(Strategy):
    """A snapshot every ``every`` steps (default ``ceil(sqrt(n))``), each segment recorded
    whole in the reverse sweep: ``n / every`` states plus ``every`` kept tapes, one extra
    forward sweep (what ``torch.utils.checkpoint_sequential`` does)."""

    kind = "periodic"

    def __init__(self, every: int | None = None):
        self.every = None if every is None else _count("Periodic: every", every, 1)

    def build(self, n_steps: int) -> S.Periodic:
        return S.periodic(n_steps, self.every)

    def advances(self, n_steps: int) -> int:
        return S.stats(self.build(n_steps)).advances

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        k = min(self.build(n).every if n else 1, max(n, 1))
        return _tail_terms(p, -(-n // k), k)

    def describe(self) -> str:
        return "periodic" if self.every is None else f"periodic(every={self.every})"

    def __repr__(self) -> str:
        return "Periodic()" if self.every is None else f"Periodic({self.every})"


class Mixed(Strategy):
    """Mixed checkpointing with ``units`` slots of one state each, a slot holding a state
    or a recorded step of ``tape_units`` states (Maddison's mixed checkpointing)."""

    kind = "mixed"

    def __init__(self, units: int, tape_units: int = 1):
        self.units = _count("Mixed: units", units, 1)
        self.tape_units = _count("Mixed: tape_units", tape_units, 1)

    def build(self, n_steps: int) -> S.Schedule:
        return S.mixed(n_steps, self.units, tape_units=self.tape_units)

    def advances(self, n_steps: int) -> int:
        return S.mixed_cost(n_steps, self.units, tape_units=self.tape_units) - n_steps

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        return {"snapshots and kept tapes": self.units * p.state_bytes,
                "working set of the step": p.step_bytes,
                "adjoints and states": 4 * p.state_bytes}

    def describe(self) -> str:
        return f"mixed(units={self.units}, tape={self.tape_units} states)"

    def __repr__(self) -> str:
        return f"Mixed({self.units}, tape_units={self.tape_units})"


class Online(Revolve):
    """Online checkpointing for unknown lengths (``unroll(..., until=stop)``) with
    ``snapshots`` slots (Stumm & Walther 2010; Wang, Moin & Iaccarino 2009)."""

    kind = "online"
    offline = False

    # an online strategy builds a controller, not a Schedule (no length is known); on
    # purpose not Strategy.build's contract: as_strategy keeps it out of known-length unrolls
    def build(self, n_steps: int | None = None) -> S.Online:  # type: ignore[override]
        return S.online(self.snapshots)

    def advances(self, n_steps: int) -> int:
        """At least revolve's optimum (the length is not known when snapshots are placed;
        docs/online.md measures the excess)."""
        return S.optimal_cost(n_steps, self.snapshots)

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        terms = super()._terms(p, n)
        terms["adjoints and states"] += p.state_bytes  # x_{i-1} beside x_i while stepping
        return terms

    def describe(self) -> str:
        return f"online(s={self.snapshots})"

    def __repr__(self) -> str:
        return f"Online({self.snapshots})"


class Reversible(Strategy):
    """Rebuild states by the step's inverse (``step.inverse(state, i)``; steppers in
    :mod:`deepsolve.reversible`): memory independent of ``n`` apart from the snapshots, one
    inverse per step instead of revolve's recomputations (:mod:`deepsolve.schedules.
    reversible`). A snapshot every ``every`` steps, or ``snapshots`` of them spread over the
    chain (``x_0`` included; default 8), bounds the drift of rebuilt states to one window:
    it is measured at every snapshot, its maximum is ``UnrollStats.reconstruction_error``,
    and above ``tolerance`` (default ``sqrt(eps)`` of the state's dtype) the unroll raises
    (``on_drift="raise"``) or recomputes that window from its snapshot with revolve
    (``"recompute"``: 7 more snapshots and a parameter-gradient buffer of memory)."""

    kind = "reversible"
    #: snapshots when neither ``every`` nor ``snapshots`` is given
    DEFAULT_SNAPSHOTS: ClassVar[int] = 8

    def __init__(self, every: int | None = None, *, snapshots: int | None = None,
                 tolerance: float | None = None, on_drift: str = "raise"):
        if every is not None and snapshots is not None:
            raise ValueError("Reversible: give every= (steps between snapshots) or "
                             "snapshots= (how many), not both")
        self.every = None if every is None else _count("Reversible: every", every, 1)
        self.snapshots = None if snapshots is None else _count("Reversible: snapshots",
                                                                snapshots, 1)
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(
                tolerance, (int, float)) or not tolerance > 0):
            raise ValueError(f"Reversible: tolerance must be a number > 0, got {tolerance!r}")
        if on_drift not in ("raise", "recompute"):
            raise ValueError(f"Reversible: on_drift must be 'raise' or 'recompute', got "
                             f"{on_drift!r}")
        self.tolerance = tolerance
        self.on_drift = on_drift

    def interval(self, n_steps: int) -> int:
        """Steps between snapshots for a chain of ``n_steps``."""
        if self.every is not None:
            return self.every
        s = self.snapshots or self.DEFAULT_SNAPSHOTS
        return max(1, -(-(n_steps - 1) // s))

    def slots(self, n_steps: int) -> int:
        """Snapshots held at the peak, ``x_0`` included."""
        return max(1, -(-(n_steps - 1) // self.interval(n_steps)))

    def build(self, n_steps: int) -> S.Schedule:
        return S.reversible(n_steps, self.interval(n_steps))

    def advances(self, n_steps: int) -> int:
        """The forward sweep's unrecorded steps (the inverses are priced apart)."""
        return max(n_steps - 1, 0)

    def predicted_time(self, profile: StepProfile, n_steps: int) -> float:
        p = profile
        plain = n_steps * (p.t_record + p.t_backward)
        if plain <= 0:
            return 1.0
        t_inv = p.t_advance if p.t_inverse is None else p.t_inverse
        # the forward sweep, the first pair's check, and one inverse per step
        return ((self.advances(n_steps) + 1) * p.t_advance + n_steps * t_inv + plain) / plain

    def _terms(self, p: StepProfile, n: int) -> dict[str, int]:
        terms = {"snapshots": (self.slots(n) - 1) * p.slot_bytes,
                 "working set of the step": p.step_bytes,
                 "adjoints and states": 5 * p.state_bytes}
        if self.on_drift == "recompute":
            terms["recomputing a drifting window"] = 7 * p.slot_bytes + p.grad_bytes
        return terms

    def describe(self) -> str:
        return (f"reversible(every={self.every})" if self.every is not None else
                f"reversible(snapshots={self.snapshots or self.DEFAULT_SNAPSHOTS})")

    def __repr__(self) -> str:
        args = [f"every={self.every}" if self.every is not None else
                f"snapshots={self.snapshots}" if self.snapshots is not None else ""]
        if self.tolerance is not None:
            args.append(f"tolerance={self.tolerance:g}")
        if self.on_drift != "raise":
            args.append(f"on_drift={self.on_drift!r}")
        return f"Reversible({', '.join(a for a in args if a)})"


class Budget(Strategy):
    """Let the planner choose: the fastest strategy whose predicted peak fits ``budget``
    (bytes, ``"512MiB"``, ``"2GB"``, ``"80%"`` of the device's free memory), from a measured
    profile of one step (:func:`deepsolve.plan`). ``offload`` (``"host"``/``"disk"``, with
    ``spill_dir``) lets it weigh a second storage level too. The budget's form is checked
    when the strategy is made; a percentage is resolved on the unroll's device.

    ``group`` (a ``torch.distributed`` process group) makes the ranks of a domain
    decomposition agree on one plan: each profiles its own step and the plan fits the
    tightest rank (:mod:`deepsolve.memory.agree`); every rank of the group must unroll."""

    kind = "budget"

    def __init__(self, budget: BudgetLike, offload: str | None = None,
                 spill_dir: str | None = None, group: Any = None,
                 compile: bool | int | str = False):
        parse_budget(budget, "cpu" if isinstance(budget, str) and budget.strip().endswith("%")
                     else None)
        if offload not in (None, "host", "disk"):
            raise ValueError(f"Budget: offload must be 'host', 'disk' or None, got {offload!r}")
        if spill_dir is not None and offload != "disk":
            raise ValueError("Budget: spill_dir= is where offload='disk' writes; give "
                             "offload='disk' with it")
        self.budget = budget
        self.offload = offload
        self.spill_dir = spill_dir
        self.group = group
        if compile is not False:
            self.compile = compile

    def build(self, n_steps: int) -> S.Schedule:
        raise TypeError("Budget: the planner builds the schedule from a profile of the step; "
                        "use deepsolve.plan(step, x0, n, budget=...) or unroll(..., budget=)")

    def describe(self) -> str:
        return f"budget {self.budget}"

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("offload", self.offload),
                                                     ("spill_dir", self.spill_dir)) if v)
        return f"Budget({self.budget!r}{extra})"


def strategy_for(kind: str, slots: Any = 0, policy: Any = None) -> Strategy:
    """The strategy of a schedule kind and its sizes, as the planner's tables name them:
    ``slots`` is ``s`` (revolve, two_level, online), ``(s, m)`` (revolve_tail), the units
    ``u`` (mixed)."""
    if kind == "store_all":
        return StoreAll(policy)
    if kind in ("revolve", "two_level"):
        return Revolve(max(int(slots), 1))
    if kind == "online":
        return Online(max(int(slots), 1))
    if kind == "revolve_tail":
        s, m = slots
        return RevolveTail(max(int(s), 1), max(int(m), 1), policy)
    if kind == "mixed":
        return _MixedUnits(int(slots))
    raise ValueError(f"unknown schedule kind {kind!r}")


class _MixedUnits(Mixed):
    """Mixed's memory terms for any unit count, 0 included (the planner's fixed part)."""

    def __init__(self, units: int):
        self.units, self.tape_units = units, 1


def as_strategy(schedule: Any = None, snapshots: int | None = None, budget: Any = None,
                offload: str | None = None, spill_dir: str | None = None,
                online: bool = False) -> Strategy | S.Schedule | S.Online | None:
    """The strategy (or the fixed schedule object) ``unroll``'s arguments ask for: the short
    forms ``snapshots=``, ``budget=``, ``schedule="revolve" | "periodic" | "store_all"``, a
    :class:`Strategy` or a schedule object. Every bad combination is one line.

    Returns ``None`` when nothing is asked (store_all; online: keep every step recorded)."""
    if budget is not None:
        if snapshots is not None or (schedule is not None and not isinstance(schedule, Budget)):
            raise ValueError("unroll: give budget= or snapshots=/schedule=, not both")
        if isinstance(budget, Budget):
            if offload is not None or spill_dir is not None:
                raise ValueError("unroll: give offload=/spill_dir= inside Budget(...), not "
                                 "beside it")
            return budget
        return Budget(budget, offload, spill_dir)
    if isinstance(schedule, Budget):
        if snapshots is not None:
            raise ValueError("unroll: give budget= or snapshots=/schedule=, not both")
        return schedule
    if offload is not None or spill_dir is not None:
        raise ValueError("unroll: offload= works with budget=, which lets the planner weigh it")
    if online:
        if isinstance(schedule, Online):
            if snapshots is not None:
                raise ValueError("unroll: give either snapshots= or a strategy, not both")
            return schedule
        if schedule is not None and not isinstance(schedule, S.Online):
            raise ValueError("unroll: with until= the schedule is online; give snapshots= or "
                             "budget= (or Online(s) / an online(...) schedule object)")
        if snapshots is not None:
            return Online(snapshots)
        return schedule
    if schedule is not None and snapshots is not None and not isinstance(schedule, str):
        raise ValueError("unroll: give either snapshots= or a schedule object, not both")
    if isinstance(schedule, (Strategy, S.Schedule)):
        if isinstance(schedule, Online):
            raise ValueError("unroll: Online(s) is for unrolls of unknown length (until=); "
                             "use Revolve(s) for a known n_steps")
        return schedule
    if schedule is None:
        return Revolve(snapshots) if snapshots is not None else StoreAll()
    if schedule == "revolve":
        if snapshots is None:
            raise ValueError("unroll: schedule='revolve' needs snapshots=S (S >= 1, the "
                             "initial state included)")
        return Revolve(snapshots)
    if schedule == "store_all":
        return StoreAll()
    if schedule == "periodic":
        return _PeriodicSlots(snapshots) if snapshots is not None else Periodic()
    raise ValueError(f"unroll: unknown schedule {schedule!r}; use 'revolve', 'store_all', "
                     "'periodic', a strategy (Revolve(s), Periodic(k), ...) or a schedule "
                     "object from deepsolve.schedules")


class _PeriodicSlots(Periodic):
    """``schedule="periodic", snapshots=s``: a snapshot every ``ceil(n / s)`` steps."""

    def __init__(self, snapshots: int):
        self.every = None
        self.slots = _count("unroll: snapshots", snapshots, 1)

    def build(self, n_steps: int) -> S.Periodic:
        return S.periodic(n_steps, max(1, -(-n_steps // self.slots)))

    def describe(self) -> str:
        return f"periodic(snapshots={self.slots})"

    def __repr__(self) -> str:
        return f"Periodic(every=ceil(n/{self.slots}))"
