"""The action vocabulary of a checkpoint schedule.

A schedule reverses a chain of ``n`` steps ``x_{i+1} = step(x_i, i)``, ``i = 0 .. n-1``.
It is a stream of the small records below; an executor (``deepsolve.unroll``) or the
symbolic checker (:func:`deepsolve.schedules.check`) interprets it.

The interpreter holds

* a *current state* ``x_i`` (or none),
* *slots* ``(level, slot) -> x_i`` holding snapshots (level 0 is the fast memory of the
  device; level 1 a second, larger store such as host RAM or disk),
* *tapes*: recorded steps kept for the reverse sweep (a step's saved activations),
* an *adjoint* position ``j``: the adjoint ``dL/dx_j`` is held; it starts at ``j = n``.

Semantics:

``Advance(start, stop)``
    requires the current state ``x_start``; runs steps ``start .. stop-1`` *without*
    recording; the current state becomes ``x_stop``. Costs ``stop - start`` unrecorded steps.
``Record(start, stop)``
    as ``Advance`` but records each step and keeps its tape for a later ``Reverse``.
``Store(slot, index, level)``
    copies the current state ``x_index`` into a free slot.
``Restore(slot, index, level)``
    makes the snapshot ``x_index`` held in the slot the current state (the slot stays full).
``Free(slot, index, level)``
    empties the slot.
``Reverse(index)``
    the adjoint step: requires the adjoint at ``index + 1``; uses the tape kept for
    step ``index`` if there is one, otherwise *records* step ``index`` from the current
    state (which must be ``x_index``) and reverses it at once. Afterwards the adjoint is at
    ``index`` and the current state is undefined; the reversed step's input ``x_index`` is
    *retained* until the next action that moves the state (for an ``Invert``).
``Invert(index)``
    the adjoint step of a reversible step: requires the adjoint at ``index + 1`` and
    ``x_{index+1}`` — the current state, or the input retained by the reverse step just
    before; computes ``x_index`` by the step's *inverse*, records step ``index`` from it and
    reverses it at once. Afterwards the adjoint is at ``index``, the current state is
    undefined and ``x_index`` is retained. Costs one inverse and one recorded step.

Every schedule records each step exactly once (``Record``, tape-less ``Reverse`` or
``Invert``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

__all__ = ["Action", "Advance", "Record", "Store", "Restore", "Free", "Reverse", "Invert"]

FAST = 0
"""Storage level 0: the device's own memory."""


@final
@dataclass(frozen=True, slots=True)
class Advance:
    """Run steps ``start .. stop-1`` without recording."""

    start: int
    stop: int


@final
@dataclass(frozen=True, slots=True)
class Record:
    """Run steps ``start .. stop-1`` recording them; keep each tape for ``Reverse``."""

    start: int
    stop: int


@final
@dataclass(frozen=True, slots=True)
class Store:
    """Store the current state ``x_index`` in ``slot`` of storage ``level``."""

    slot: int
    index: int
    level: int = FAST


@final
@dataclass(frozen=True, slots=True)
class Restore:
    """Make the snapshot ``x_index`` held in ``slot`` (of ``level``) the current state."""

    slot: int
    index: int
    level: int = FAST


@final
@dataclass(frozen=True, slots=True)
class Free:
    """Empty ``slot`` of ``level`` (it held ``x_index``)."""

    slot: int
    index: int
    level: int = FAST


@final
@dataclass(frozen=True, slots=True)
class Reverse:
    """The adjoint step through step ``index``: ``dL/dx_index = J_index^T dL/dx_{index+1}``."""

    index: int


@final
@dataclass(frozen=True, slots=True)
class Invert:
    """The adjoint step through step ``index``, its input rebuilt by the step's inverse
    from ``x_{index+1}``."""

    index: int


Action = Advance | Record | Store | Restore | Free | Reverse | Invert
