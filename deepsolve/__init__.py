"""deepsolve: train through long iterative computations with exact, memory-bounded gradients.

Public surface:

* :func:`unroll` — run ``x_{i+1} = step(x_i, i)`` for ``n`` steps with a checkpoint schedule
  and exact gradients (:class:`UnrollStats` reports what it did);
* :func:`fixed_point` — equilibrium solvers (Picard, Anderson, Broyden) with implicit,
  unrolled (checkpointed) or phantom backward (:class:`Implicit`, :class:`Unrolled`,
  :class:`Phantom`, :class:`Auto` or their names);
* checkpoint strategies — :class:`Revolve`, :class:`StoreAll`, :class:`Periodic`,
  :class:`Online`, :class:`TwoLevel`, :class:`RevolveTail`, :class:`Mixed` and
  :class:`Budget`: ``unroll(..., schedule=Revolve(20))``; each builds its schedule for any
  length, predicts its peak and time, and names itself;
* :class:`Reversible` and :mod:`reversible` — reversible steppers (McCallum–Foster coupled
  explicit Runge–Kutta, leapfrog, reversible Heun) whose states the reverse sweep rebuilds
  by their inverse: memory flat in the step count, drift measured and bounded
  (:class:`ReconstructionError`), their stability checked for the step at hand before any
  unroll (:mod:`stability`, :class:`StabilityError`);
* :class:`NonFiniteError` — every unroll names the first step whose state became NaN or inf;
* :func:`plan` — profile a step and pick the fastest schedule under a memory budget
  (:class:`Plan`, :class:`BudgetError`);
* :func:`sequential` — a chain of layers with different costs and shapes, checkpointed
  optimally under a memory budget (heterogeneous dynamic program, :class:`SequentialStats`);
* :mod:`schedules` — checkpoint schedules as lazy action streams (revolve, store_all,
  periodic, mixed, two-level, online, heterogeneous), their costs and a checker;
* :func:`check_gradients` — an unroll's gradients under its schedule (and revolve, periodic)
  against store_all, replayed twice, with escaped randomness caught (docs/check.md).
"""

import sys as _sys

from ._process import cli_start as _cli_start
from ._version import __version__

try:
    from . import reversible, schedules, stability
    from .engine import CompiledPolicy, NonFiniteError, ReconstructionError
    from .fixed_point import (
        Auto,
        FixedPointError,
        FixedPointStats,
        FixedPointWarning,
        Implicit,
        Phantom,
        Unrolled,
        fixed_point,
    )
    from .gradcheck import check_gradients
    from .memory import BudgetError, Plan, plan
    from .memory.strategies import (
        Budget,
        Mixed,
        Online,
        Periodic,
        Reversible,
        Revolve,
        RevolveTail,
        StoreAll,
        Strategy,
        TwoLevel,
    )
    from .problem import Context, Curve, Problem
    from .sequential import SequentialStats, sequential
    from .settings import Setting
    from .stability import StabilityError
    from .unroll import UnrollStats, unroll
except KeyboardInterrupt:
    if not _cli_start():
        raise
    print("deepsolve: interrupted", file=_sys.stderr)
    from ._process import shutdown_signals as _shutdown_signals

    raise SystemExit(_shutdown_signals(130)) from None

__all__ = [
    "schedules", "unroll", "UnrollStats", "CompiledPolicy", "plan", "Plan", "BudgetError",
    "Strategy", "StoreAll", "Revolve", "Periodic", "Online", "TwoLevel", "RevolveTail", "Mixed",
    "Budget", "Reversible", "reversible", "stability", "StabilityError", "NonFiniteError",
    "ReconstructionError",
    "Problem", "Context", "Curve", "Setting",
    "fixed_point", "FixedPointStats", "FixedPointError", "FixedPointWarning",
    "Implicit", "Unrolled", "Phantom", "Auto",
    "sequential", "SequentialStats",
    "check_gradients",
    "__version__",
]
