"""The ``Schedule`` base class: a re-iterable, lazily generated stream of actions."""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action

__all__ = ["Schedule"]


class Schedule:
    """A checkpoint schedule for a chain of ``n_steps`` steps.

    Iterating a schedule yields its actions (see :mod:`deepsolve.schedules.actions`) one at
    a time; every iteration starts afresh, and no schedule materialises all its actions.

    Attributes:
        kind: short name (``"revolve"``, ``"store_all"``, ...).
        n_steps: length of the chain.
        slots: ``{level: number of snapshot slots}`` the schedule may hold at once.
    """

    kind: str = "schedule"
    n_steps: int
    slots: dict[int, int]

    def __iter__(self) -> Iterator[Action]:
        raise NotImplementedError

    def _params(self) -> str:
        return ""

    def __repr__(self) -> str:
        extra = self._params()
        return f"{self.kind}(n_steps={self.n_steps}{', ' + extra if extra else ''})"
