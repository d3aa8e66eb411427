"""Checkpoint schedules as lazily generated streams of actions (pure Python, no torch).

A schedule says how to reverse a chain of ``n`` steps ``x_{i+1} = step(x_i, i)`` under a
memory limit: which states to keep as snapshots, which steps to recompute, when to record a
step and pull the adjoint through it. See :mod:`deepsolve.schedules.actions` for the
vocabulary and docs/schedules.md for a guide.

>>> from deepsolve import schedules
>>> s = schedules.revolve(10, snapshots=2)
>>> schedules.stats(s).advances == schedules.optimal_cost(10, 2) == 20
True
"""

from .actions import Action, Advance, Free, Invert, Record, Restore, Reverse, Store
from .base import Schedule
from .basic import Periodic, Shifted, StoreAll, periodic, shifted, store_all
from .check import LevelCounts, ScheduleError, ScheduleStats, check, stats
from .cost import beta, optimal_cost, repetitions
from .hetero import ChainCosts, Hetero, hetero, hetero_cost, hetero_peak, least_memory
from .mixed import Mixed, mixed, mixed_cost, peak_units
from .online import Online, OnlineController, OnlineSchedule, online
from .reversible import Reversible, reversible
from .revolve import Revolve, revolve
from .tail import RevolveTail, revolve_tail, revolve_tail_cost
from .two_level import TwoLevel, makespan, two_level, two_level_cost

__all__ = [
    "ChainCosts", "Hetero", "hetero", "hetero_cost", "hetero_peak", "least_memory",
    "Action", "Advance", "Record", "Store", "Restore", "Free", "Reverse", "Invert",
    "Schedule", "Revolve", "StoreAll", "Periodic", "TwoLevel", "Mixed", "Shifted", "shifted",
    "revolve", "store_all", "periodic", "two_level", "two_level_cost", "makespan",
    "mixed", "mixed_cost", "peak_units", "RevolveTail", "revolve_tail", "revolve_tail_cost",
    "Online", "OnlineController", "OnlineSchedule", "online", "Reversible", "reversible",
    "optimal_cost", "repetitions", "beta",
    "check", "stats", "ScheduleStats", "ScheduleError", "LevelCounts",
]
