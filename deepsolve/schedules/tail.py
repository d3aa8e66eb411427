"""Revolve with a recorded tail: spend memory beyond the snapshots on recorded steps.

When the budget holds more than a state per step but less than every recorded step, the
cheapest use of the extra memory is to keep the *last* ``m`` steps recorded from the forward
sweep — they are reversed without recomputation — and to reverse the first ``n - m`` with
binomial checkpointing. The schedule is ``revolve(n - m + 1, s)`` whose first reverse step
(step ``n - m``, reached by the forward sweep) is replaced by ``Record(n - m, n)`` and the
reverse of the ``m`` taped steps:

* memory: ``s`` snapshots (``x_0`` included) and ``m`` recorded steps;
* unrecorded steps: ``t(n - m + 1, s)``; ``m = 0`` is plain revolve, ``m = n`` store-all.

The planner uses it to put a budget between revolve's needs and store-all's to work.
"""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action, Record, Reverse
from .base import Schedule
from .cost import _check, optimal_cost
from .revolve import Revolve

__all__ = ["RevolveTail", "revolve_tail", "revolve_tail_cost"]


class RevolveTail(Schedule):
    """``revolve`` over the first ``n - tail`` steps, the last ``tail`` steps recorded."""

    kind = "revolve_tail"

    def __init__(self, n_steps: int, snapshots: int, tail: int):
        _check(n_steps, snapshots)
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail <= n_steps:
            raise ValueError(f"tail must be an integer in [0, n_steps={n_steps}], got {tail!r}")
        self.n_steps = n_steps
        self.snapshots = snapshots
        self.tail = tail
        self.slots = {0: snapshots}

    def _params(self) -> str:
        return f"snapshots={self.snapshots}, tail={self.tail}"

    def __iter__(self) -> Iterator[Action]:
        n, m = self.n_steps, self.tail
        if m == 0:
            yield from Revolve(n, self.snapshots)
            return
        if n == 0:
            return
        head = n - m  # steps reversed by revolve; x_head is reached by its forward sweep
        replaced = False
        for a in Revolve(head + 1, self.snapshots):
            if not replaced and type(a) is Reverse:  # Reverse(head): the forward sweep's end
                replaced = True
                yield Record(head, n)
                for i in range(n - 1, head - 1, -1):
                    yield Reverse(i)
                continue
            yield a


def revolve_tail(n_steps: int, snapshots: int, tail: int) -> RevolveTail:
    """See :class:`RevolveTail`."""
    return RevolveTail(n_steps, snapshots, tail)


def revolve_tail_cost(n_steps: int, snapshots: int, tail: int) -> int:
    """Unrecorded steps of :func:`revolve_tail`: ``t(n - tail + 1, snapshots)`` (0 when the
    tail covers everything)."""
    if tail >= n_steps:
        return 0
    return optimal_cost(n_steps - tail + 1, snapshots) if tail else optimal_cost(n_steps,
                                                                                  snapshots)
