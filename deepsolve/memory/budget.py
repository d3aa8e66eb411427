"""Memory budgets: ``2GiB``, ``"512 MB"``, ``80%`` of the device, or plain bytes.

A budget is read once (:func:`read_budget`) into a :class:`MemoryBudget`: the form as
written, its bytes, and for a percentage the fraction of the device's free memory it stands
for. Everything downstream of a run's settings (the run configuration, the problem's
context, the unroll, the log row) takes that one type; :func:`parse_budget` resolves any form,
a :class:`MemoryBudget` included, to bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

__all__ = ["BudgetError", "BudgetLike", "MemoryBudget", "read_budget", "parse_budget",
           "budget_form", "no_budget", "device_capacity", "format_bytes"]


class BudgetError(ValueError):
    """No schedule fits the memory budget; the message states the minimum that would."""


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")


def device_capacity(device: torch.device | str | None = None) -> int:
    """Bytes available to a budget given as a percentage.

    CUDA: free memory reported by ``torch.cuda.mem_get_info`` (what other processes and the
    caching allocator leave). CPU: ``MemAvailable`` from /proc/meminfo (or total RAM from
    ``os.sysconf`` where /proc is missing).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True, repr=False)
class MemoryBudget:
    """A budget read once: ``text`` as the user wrote it (``"12GiB"``, ``"80%"``, bytes),
    ``nbytes`` the bytes it meant when it was read, and ``fraction`` (``0.8`` for ``"80%"``,
    ``None`` otherwise) when it is a share of the device's free memory.

    :meth:`resolve` gives the bytes now: ``nbytes``, or for a percentage the share of the
    device's free memory at this moment; :meth:`fixed` is the same budget held at the bytes it
    was read as (the trainer's ``budget_once``: every iteration plans with the same bytes)."""

    text: str | int | float
    nbytes: int
    fraction: float | None = None

    def resolve(self, device: torch.device | str | None = None) -> int:
        if self.fraction is None:
            return self.nbytes
        return int(device_capacity(device) * self.fraction)

    def fixed(self) -> MemoryBudget:
        return self if self.fraction is None else replace(self, fraction=None)

    def __str__(self) -> str:
        return str(self.text)

    def __repr__(self) -> str:  # as the user wrote it: messages name the budget so
        return repr(self.text)


#: Every form a budget may be given in.
BudgetLike = int | float | str | MemoryBudget


def no_budget(value: object) -> bool:
    """Whether a budget setting says "no budget": ``""`` (or blanks), ``None`` or 0."""
    return value in ("", None, 0) or (isinstance(value, str) and not value.strip())


def read_budget(budget: BudgetLike,
                device: torch.device | str | None = None) -> MemoryBudget:
    """The :class:`MemoryBudget` of any budget form (a percentage resolved on ``device``);
    ``ValueError`` of one line for a form that is not a budget (see :func:`parse_budget`)."""
    if isinstance(budget, MemoryBudget):
        return budget
    nbytes, fraction = budget_form(budget)
    if fraction is not None:
        nbytes = int(device_capacity(device) * fraction)
    return MemoryBudget(budget, nbytes, fraction)


def parse_budget(budget: BudgetLike,
                 device: torch.device | str | None = None) -> int:
    """Bytes from a budget: an int (bytes), ``"512MiB"``, ``"2GB"``, ``"12 GiB"``, ``"80%"``,
    or a :class:`MemoryBudget` (:meth:`MemoryBudget.resolve` on ``device``).

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers
    of 1024; a percentage is of :func:`device_capacity` of ``device``.
    """
    if isinstance(budget, MemoryBudget):
        return budget.resolve(device)
    return read_budget(budget, device).nbytes


def budget_form(budget: int | float | str) -> tuple[int, float | None]:
    """A budget's form read without resolving it: ``(bytes, None)``, or ``(0, fraction)`` for
    a percentage of the device; ``ValueError`` of one line for anything else."""
    if isinstance(budget, bool):
        raise ValueError(f"budget must be bytes or a string such as '2GiB' or '80%', "
                         f"got {budget!r}")
    if isinstance(budget, (int, float)):
        if budget <= 0 or budget != budget or budget == float("inf"):
            raise ValueError(f"budget must be a positive, finite number of bytes, got {budget!r}")
        return int(budget), None
    if not isinstance(budget, str):
        raise ValueError(f"budget must be bytes or a string such as '2GiB' or '80%', "
                         f"got {type(budget).__name__}")
    m = _PATTERN.match(budget)
    if not m:
        raise ValueError(f"cannot read the budget {budget!r}: write a number with a unit, "
                         "such as '512MiB', '2GB', '12 GiB' or '80%'")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"a percentage budget must be in (0, 100], got {budget!r}")
        return 0, value / 100
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} in budget {budget!r}; use B, kB, MB, GB, "
                         "KiB, MiB, GiB or %")
    if value == float("inf"):
        raise ValueError(f"budget {budget!r} is not a finite number of bytes; write it with a "
                         "unit, such as '12GiB'")
    nbytes = int(value * factor)
    if nbytes <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return nbytes, None


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
