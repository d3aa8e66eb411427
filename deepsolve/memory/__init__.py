"""Memory: budgets, step profiles, the planner that maps (profile, n, budget) to a schedule,
and peak-memory meters (:class:`SavedTensors`: the bytes saved for backward)."""

from .budget import (
    BudgetError,
    MemoryBudget,
    device_capacity,
    format_bytes,
    parse_budget,
    read_budget,
)
from .planner import Alternative, Plan, choose, plan, predicted_peak
from .profiling import StepProfile, clear_profile_cache, profile_step
from .saved import SavedTensors

__all__ = [
    "BudgetError", "MemoryBudget", "read_budget", "parse_budget", "device_capacity",
    "format_bytes",
    "Plan", "Alternative", "plan", "choose", "predicted_peak",
    "StepProfile", "profile_step", "clear_profile_cache", "SavedTensors",
]
