"""The reversible schedule: rebuild states by the step's inverse, snapshots every ``k`` steps.

A reversible step has an algebraic inverse ``x_i = step^{-1}(x_{i+1}, i)``. The reverse sweep
then needs no stored trajectory: from ``x_n`` it rebuilds ``x_{n-1}, x_{n-2}, ...`` one by
one, recording each step from its rebuilt input and pulling the adjoint through it
(``Invert``): memory independent of ``n``, one inverse and one recorded step per step,
against revolve's ``r`` recomputations per step with ``s`` slots where ``beta(s, r) >= n``.

Rebuilding in floating point drifts. The forward sweep therefore stores a snapshot every
``every`` steps (``x_0, x_k, x_2k, ...``); the reverse sweep rebuilds one window ``[a, a+k)``
from its top, and at ``x_a`` restores the stored snapshot (where the executor measures the
drift of the rebuilt state against it) and goes on from that exact state, so an error
cannot accumulate over more than ``k`` steps. Memory: ``ceil((n - 1) / k)`` snapshots. Actions for
``n`` steps::

    Store(0, 0), Advance(0, k), Store(1, k), ..., Advance(., n - 1), Reverse(n - 1),
    Invert(n - 2), ..., Invert(a), Restore(j, a), Free(j, a), Invert(a - 1), ...

(McCallum & Foster, "Efficient, accurate and stable gradients for Neural ODEs", 2024;
Gomez et al., "The reversible residual network", NeurIPS 2017.)
"""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action, Advance, Free, Invert, Restore, Reverse, Store
from .base import Schedule

__all__ = ["Reversible", "reversible"]


class Reversible(Schedule):
    """The reversible schedule for ``n_steps`` steps with a snapshot every ``every`` steps
    (``x_0`` included: ``ceil((n - 1) / every)`` slots); see the module docstring."""

    kind = "reversible"

    def __init__(self, n_steps: int, every: int):
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"reversible: n_steps must be an integer >= 0, got {n_steps!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"reversible: every must be an integer >= 1, got {every!r}")
        self.n_steps = n_steps
        self.every = every
        self.slots = {0: max(1, -(-(n_steps - 1) // every))}

    def _params(self) -> str:
        return f"every={self.every}"

    def __iter__(self) -> Iterator[Action]:
        n, k = self.n_steps, self.every
        if n == 0:
            return
        # the windows' first states x_a, held in slot a // k (x_{n-1} is the last step's
        # input, recorded at once: no window starts there)
        starts = list(range(0, max(n - 1, 1), k))
        for j, a in enumerate(starts):
            yield Store(j, a)
            stop = min(a + k, n - 1)
            if stop > a:
                yield Advance(a, stop)
        yield Reverse(n - 1)
        for j in range(len(starts) - 1, -1, -1):
            a = starts[j]
            top = min(a + k, n - 1)  # the window's steps a .. top - 1 (n - 1 is reversed)
            for i in range(top - 1, a - 1, -1):
                yield Invert(i)
            yield Restore(j, a)  # the exact x_a: where the drift is measured
            yield Free(j, a)


def reversible(n_steps: int, every: int) -> Reversible:
    """The reversible schedule; see :class:`Reversible`."""
    return Reversible(n_steps, every)
