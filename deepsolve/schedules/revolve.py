"""Binomial checkpointing ("revolve"): the offline optimal single-level schedule.

Griewank, "Achieving logarithmic growth of temporal and spatial complexity in reverse
automatic differentiation", Optim. Methods Softw. 1 (1992); Griewank & Walther,
"Algorithm 799: revolve", ACM TOMS 26(1) (2000).
"""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action, Advance, Free, Restore, Reverse, Store
from .base import Schedule
from .cost import _check, split

__all__ = ["Revolve", "revolve"]


class Revolve(Schedule):
    """Optimal binomial schedule for ``n_steps`` steps and ``snapshots`` slots.

    ``snapshots`` counts every state held at once, the initial state ``x_0`` included (so
    ``snapshots=1`` keeps only ``x_0`` and recomputes quadratically). The working state and
    the one recorded step come on top. The number of unrecorded forward steps equals the
    minimum ``t(n, s) = r n - beta(s+1, r-1)`` (:func:`~deepsolve.schedules.optimal_cost`);
    among optimal schedules it writes the fewest snapshots of the binomial family.

    Generation is iterative over an explicit stack of at most ``2 s`` frames: memory is
    ``O(s)`` whatever ``n_steps``, and each action costs ``O(r)`` integer operations.
    """

    kind = "revolve"

    def __init__(self, n_steps: int, snapshots: int):
        _check(n_steps, snapshots)
        self.n_steps = n_steps
        self.snapshots = snapshots
        self.slots = {0: snapshots}

    def _params(self) -> str:
        return f"snapshots={self.snapshots}"

    def __iter__(self) -> Iterator[Action]:
        n = self.n_steps
        if n == 0:
            return
        if n == 1:  # record step 0 straight from x_0: nothing to store
            yield Reverse(0)
            return
        free = list(range(self.snapshots - 1, 0, -1))  # slot 0 holds x_0
        yield Store(0, 0)
        # A frame (a, m, c, slot): reverse steps a .. a+m-1; x_a is held in `slot`;
        # c slots may be used, that one included.
        stack = [(0, n, self.snapshots, 0)]
        current = 0  # index of the current state, -1 when undefined
        while stack:
            a, m, c, slot = stack.pop()
            while m > 1:
                k = split(m, c)
                if current != a:
                    yield Restore(slot, a)
                yield Advance(a, a + k)
                if m - k == 1:  # reverse the last step straight from the current state
                    yield Reverse(a + k)
                    current = -1
                    m = k
                    continue
                j = free.pop()
                yield Store(j, a + k)
                current = a + k
                stack.append((a, k, c, slot))
                stack.append((a + k, m - k, c - 1, j))
                break
            else:
                if current != a:
                    yield Restore(slot, a)
                yield Reverse(a)
                current = -1
                yield Free(slot, a)
                free.append(slot)


def revolve(n_steps: int, snapshots: int) -> Revolve:
    """The optimal binomial schedule; see :class:`Revolve`."""
    return Revolve(n_steps, snapshots)
