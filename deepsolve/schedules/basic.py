"""Baseline schedules: keep everything, or checkpoint uniformly every ``k`` steps."""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action, Advance, Free, Invert, Record, Restore, Reverse, Store
from .base import Schedule
from .cost import _check

__all__ = ["StoreAll", "Periodic", "Shifted", "store_all", "periodic", "shifted"]


class StoreAll(Schedule):
    """Plain backpropagation: record all ``n`` steps in the forward sweep, then reverse them.

    No recomputation; memory is ``n`` recorded steps. Actions: ``Record(0, n)`` then
    ``Reverse(n-1) .. Reverse(0)``.
    """

    kind = "store_all"

    def __init__(self, n_steps: int):
        _check(n_steps, 1)
        self.n_steps = n_steps
        self.slots = {0: 0}

    def __iter__(self) -> Iterator[Action]:
        if self.n_steps == 0:
            return
        yield Record(0, self.n_steps)
        for i in range(self.n_steps - 1, -1, -1):
            yield Reverse(i)


class Periodic(Schedule):
    """Uniform checkpointing, a snapshot every ``every`` steps (``checkpoint_sequential``).

    The forward sweep stores ``x_0, x_k, x_2k, ...`` and records the last segment directly;
    the reverse sweep restores each segment's start, records the whole segment and reverses
    it. Memory: ``ceil(n/k)`` snapshots plus ``k`` recorded steps (about ``2 sqrt(n)`` at
    ``k = sqrt(n)``); cost: one extra forward sweep less the last segment,
    ``n - (n - k floor((n-1)/k))`` unrecorded steps. ``every=None`` takes ``ceil(sqrt(n))``.
    """

    kind = "periodic"

    def __init__(self, n_steps: int, every: int | None = None):
        _check(n_steps, 1)
        if every is None:
            every = max(1, _isqrt_ceil(n_steps))
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.n_steps = n_steps
        self.every = every
        starts = (n_steps - 1) // every + 1 if n_steps else 0
        self.slots = {0: max(starts - 1, 0)}

    def _params(self) -> str:
        return f"every={self.every}"

    def __iter__(self) -> Iterator[Action]:
        n, k = self.n_steps, self.every
        if n == 0:
            return
        last = (n - 1) // k * k  # start of the last segment
        for slot, a in enumerate(range(0, last, k)):
            yield Store(slot, a)
            yield Advance(a, a + k)
        yield Record(last, n)
        for i in range(n - 1, last - 1, -1):
            yield Reverse(i)
        for slot in range(last // k - 1, -1, -1):
            a = slot * k
            yield Restore(slot, a)
            yield Free(slot, a)
            yield Record(a, a + k)
            for i in range(a + k - 1, a - 1, -1):
                yield Reverse(i)


def _isqrt_ceil(n: int) -> int:
    from math import isqrt

    r = isqrt(n)
    return r if r * r == n else r + 1


def store_all(n_steps: int) -> StoreAll:
    """Record every step; see :class:`StoreAll`."""
    return StoreAll(n_steps)


def periodic(n_steps: int, every: int | None = None) -> Periodic:
    """Uniform checkpoints every ``every`` steps; see :class:`Periodic`."""
    return Periodic(n_steps, every)


class Shifted(Schedule):
    """``schedule`` for steps ``offset .. offset + n - 1`` of a longer chain: every action's
    step indices moved by ``offset`` and its slot numbers by ``slot_offset`` (levels
    unchanged). A truncated unroll reverses each window ``[a, a + K)`` with the window's own
    schedule shifted by ``a``; a reversible unroll recomputes a drifting window with revolve
    in slots beside its own."""

    def __init__(self, schedule: Schedule, offset: int, slot_offset: int = 0):
        for name, v in (("offset", offset), ("slot_offset", slot_offset)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.schedule = schedule
        self.offset = offset
        self.slot_offset = slot_offset
        self.n_steps = schedule.n_steps
        self.slots = {lv: c + slot_offset for lv, c in schedule.slots.items()}
        self.kind = schedule.kind

    def __iter__(self) -> Iterator[Action]:
        d, ds = self.offset, self.slot_offset
        if d == 0 and ds == 0:
            yield from self.schedule
            return
        for a in self.schedule:
            if type(a) is Advance or type(a) is Record:
                yield type(a)(a.start + d, a.stop + d)
            elif type(a) is Reverse or type(a) is Invert:
                yield type(a)(a.index + d)
            else:
                yield type(a)(a.slot + ds, a.index + d, a.level)

    def _params(self) -> str:
        return f"offset={self.offset}, schedule={self.schedule!r}"

    def __repr__(self) -> str:
        extra = f", slot_offset={self.slot_offset}" if self.slot_offset else ""
        return f"shifted({self.schedule!r}, offset={self.offset}{extra})"


def shifted(schedule: Schedule, offset: int, slot_offset: int = 0) -> Shifted:
    """``schedule`` moved to steps ``offset ..`` of a longer chain and its slots to
    ``slot_offset ..`` (see :class:`Shifted`)."""
    return Shifted(schedule, offset, slot_offset)
