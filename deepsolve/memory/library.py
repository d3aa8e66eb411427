"""One-time library memory: what a budgeted call must load and keep, measured and counted.

A budget is what a call adds to the process's memory, and the first call of a batch job is a
call like the others: whatever deepsolve loads there stays resident and counts. What the
plain path needs is already loaded with ``import deepsolve`` (measured: the first budgeted
call of the three test steps keeps under 1 MiB beside its cached blocks); the exception is
the machinery of *recomputation policies* (:mod:`deepsolve.engine.policies`): PyTorch's
``torch.utils.checkpoint`` with a selective policy imports ``torch._dynamo`` and with it
sympy on its first call — 48.5 MiB resident (torch 2.13, CPU), more than a small budget.

So the planner weighs policies only where that is cheap: when the machinery is already
loaded (by an earlier call, or by the user's own ``torch.compile``), or when loading it
would take at most 1/8 of the budget, judged from :data:`ESTIMATE` before anything is
loaded. When deepsolve loads it, :func:`load_policy_machinery` measures the resident growth
of the import (``VmRSS``), rounds it up to a MiB and remembers it for the process: the plan
shows it as its own term, ``one-time library memory``, and the schedule fits the budget less
that term — in this call and in every later call of the process, so a warmed call makes the
same plan as the first. A process whose user loaded the machinery first pays nothing for it.
"""

from __future__ import annotations

import sys

from .meter import process_status

__all__ = ["ESTIMATE", "policy_machinery_loaded", "load_policy_machinery", "policy_machinery",
           "affordable"]

ESTIMATE = 64 * 2**20
"""Bytes assumed for the policy machinery before it is loaded (measured: 48.5 MiB)."""

_MiB = 2**20
_measured: int | None = None  # what deepsolve's own import of the machinery cost, once known


def policy_machinery_loaded() -> bool:
    """Whether ``torch._dynamo`` (what selective checkpointing loads) is imported."""
    return "torch._dynamo" in sys.modules


def policy_machinery() -> int:
    """The one-time bytes counted for the policy machinery in this process: what deepsolve's
    import of it measured, 0 when it was loaded before deepsolve needed it, and
    :data:`ESTIMATE` while it is not loaded."""
    if _measured is not None:
        return _measured
    return 0 if policy_machinery_loaded() else ESTIMATE


def affordable(budget: int) -> bool:
    """Whether weighing recomputation policies is worth its one-time memory under
    ``budget``: loaded already, or at most 1/8 of the budget."""
    return policy_machinery() * 8 <= budget


def load_policy_machinery() -> int:
    """Import the policy machinery now (if it is not loaded) and return its one-time bytes
    (:func:`policy_machinery`), measured as the growth of the resident set, rounded up to a
    MiB."""
    global _measured
    if _measured is None and not policy_machinery_loaded():
        before = process_status("VmRSS:")
        import torch._dynamo  # noqa: F401  (what torch.utils.checkpoint's policies import)
        grown = max(process_status("VmRSS:") - before, 0)
        _measured = -(-grown // _MiB) * _MiB
    return policy_machinery()
