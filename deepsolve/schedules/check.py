"""Interpret a schedule on symbolic states: validate it and count what it does.

:func:`check` raises :class:`ScheduleError` at the first action that could not run on real
states; :func:`stats` is the same walk returning the counts. Both run in ``O(slots + tapes)``
memory, so a lazily generated schedule of ``10^6`` steps is checked without materialising it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .actions import Action, Advance, Free, Invert, Record, Restore, Reverse, Store

__all__ = ["ScheduleError", "ScheduleStats", "LevelCounts", "check", "stats"]


class ScheduleError(ValueError):
    """A schedule asks for something impossible (wrong state, empty slot, too many slots...)."""


class LevelCounts(int):
    """A count that is also split by storage level: ``int(c)`` is the total, ``c[level]`` a part."""

    by_level: dict[int, int]

    def __new__(cls, by_level: dict[int, int]) -> LevelCounts:
        self = super().__new__(cls, sum(by_level.values()))
        self.by_level = dict(by_level)
        return self

    def __getitem__(self, level: int) -> int:
        return self.by_level.get(level, 0)

    def __repr__(self) -> str:
        if len(self.by_level) <= 1:
            return str(int(self))
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_level.items()))
        return f"{int(self)} ({parts})"


@dataclass
class ScheduleStats:
    """What a schedule does.

    Attributes:
        n_steps: steps reversed.
        advances: unrecorded forward steps (first sweep included).
        recorded: steps recorded for the reverse sweep (``Record`` steps + tape-less ``Reverse``).
        peak_slots: most snapshots held at once (``peak_slots[level]`` per level; the peak of
            the total may be below the sum of per-level peaks).
        stores, restores, frees: snapshot writes, reads and releases (per level too).
        peak_tapes: most recorded steps kept at once (not counting the one being reversed).
        actions: number of actions.
        peak_slots_total: most snapshots held at once over all levels.
        peak_storage: most snapshots + kept tapes held at once (for mixed schedules, where a
            slot holds either).
        inverses: states rebuilt by the step's inverse (``Invert``).
    """

    n_steps: int
    advances: int
    recorded: int
    peak_slots: LevelCounts
    stores: LevelCounts
    restores: LevelCounts
    frees: LevelCounts
    peak_tapes: int
    actions: int
    peak_slots_total: int = field(default=0)
    peak_storage: int = field(default=0)
    inverses: int = field(default=0)

    @property
    def recompute_factor(self) -> float:
        """Forward evaluations per step: ``(advances + recorded) / n_steps``."""
        return (self.advances + self.recorded) / self.n_steps if self.n_steps else 0.0


def _walk(
    schedule: Iterable[Action],
    n_steps: int | None,
    slots: dict[int, int] | None,
    tapes: int | None,
) -> ScheduleStats:
    if n_steps is None:
        n_steps = getattr(schedule, "n_steps", None)
        if n_steps is None:
            raise TypeError("stats()/check() need n_steps= for a schedule without .n_steps")
    if slots is None:
        slots = getattr(schedule, "slots", None)
    n = n_steps
    current = 0  # x_0 is the current state before the first action
    adjoint = n  # dL/dx_n is given
    held: dict[tuple[int, int], int] = {}
    per_level: dict[int, int] = {}
    peak: dict[int, int] = {}
    peak_total = 0
    stores: dict[int, int] = {}
    restores: dict[int, int] = {}
    frees: dict[int, int] = {}
    kept: set[int] = set()
    peak_tapes = 0
    peak_storage = 0
    advances = recorded = inverses = 0
    retained = -1  # the input x_i of the reverse step just before (for an Invert)
    count = 0

    def fail(msg: str) -> ScheduleError:
        return ScheduleError(f"action {count} ({action!r}): {msg}")

    for count, action in enumerate(schedule):  # noqa: B007 (count is read by fail)
        kind = type(action)
        if kind is not Invert and kind is not Store and kind is not Free:
            retained = -1  # any other action moves on from the retained input
        if type(action) is Advance or type(action) is Record:
            a, b = action.start, action.stop
            if current != a:
                have = f"x_{current}" if current >= 0 else "no state"
                raise fail(f"needs x_{a} as the current state but holds {have}")
            if not a < b <= n:
                raise fail(f"range {a}..{b} must satisfy {a} < stop <= n_steps={n}")
            current = b
            if type(action) is Advance:
                advances += b - a
            else:
                recorded += b - a
                for i in range(a, b):
                    if i in kept:
                        raise fail(f"step {i} is already recorded")
                    kept.add(i)
                if len(kept) > peak_tapes:
                    peak_tapes = len(kept)
                if len(kept) + len(held) > peak_storage:
                    peak_storage = len(kept) + len(held)
                if tapes is not None and len(kept) > tapes:
                    raise fail(f"keeps {len(kept)} recorded steps; the limit is {tapes}")
        elif type(action) is Reverse:
            i = action.index
            if i != adjoint - 1:
                raise fail(f"the adjoint is at x_{adjoint}, so the next reverse step is "
                           f"{adjoint - 1}, not {i}")
            if i in kept:
                kept.discard(i)
            else:
                if current != i:
                    have = f"x_{current}" if current >= 0 else "no state"
                    raise fail(f"reversing step {i} needs x_{i} (or its tape) but holds {have}")
                recorded += 1
            current = -1  # after any reverse step the current state is undefined
            adjoint = i
            retained = i
        elif type(action) is Invert:
            i = action.index
            if i != adjoint - 1:
                raise fail(f"the adjoint is at x_{adjoint}, so the next reverse step is "
                           f"{adjoint - 1}, not {i}")
            if current != i + 1 and retained != i + 1:
                have = f"x_{current}" if current >= 0 else "no state"
                raise fail(f"inverting step {i} needs x_{i + 1} (the current state, or the "
                           f"input of the reverse step just before) but holds {have}")
            inverses += 1
            recorded += 1
            current = -1
            adjoint = i
            retained = i
        elif type(action) is Store:
            key = (action.level, action.slot)
            if current != action.index:
                have = f"x_{current}" if current >= 0 else "no state"
                raise fail(f"stores x_{action.index} but the current state is {have}")
            if key in held:
                raise fail(f"slot {action.slot} (level {action.level}) already holds "
                           f"x_{held[key]}; free it first")
            limit = None if slots is None else slots.get(action.level)
            if action.slot < 0 or (limit is not None and action.slot >= limit):
                raise fail(f"slot {action.slot} is outside level {action.level}'s "
                           f"{limit} slots")
            held[key] = action.index
            lv = action.level
            per_level[lv] = per_level.get(lv, 0) + 1
            stores[lv] = stores.get(lv, 0) + 1
            if per_level[lv] > peak.get(lv, 0):
                peak[lv] = per_level[lv]
            if len(held) > peak_total:
                peak_total = len(held)
            if len(kept) + len(held) > peak_storage:
                peak_storage = len(kept) + len(held)
        elif type(action) is Restore or type(action) is Free:
            key = (action.level, action.slot)
            if key not in held:
                raise fail(f"slot {action.slot} (level {action.level}) is empty")
            if held[key] != action.index:
                raise fail(f"slot {action.slot} (level {action.level}) holds "
                           f"x_{held[key]}, not x_{action.index}")
            lv = action.level
            if type(action) is Restore:
                current = action.index
                restores[lv] = restores.get(lv, 0) + 1
            else:
                del held[key]
                per_level[lv] -= 1
                frees[lv] = frees.get(lv, 0) + 1
        else:
            raise fail("is not a schedule action (Advance, Record, Store, Restore, Free, "
                       "Reverse, Invert)")
    count += 1
    if adjoint != 0:
        raise ScheduleError(
            f"schedule ended with steps 0..{adjoint - 1} never reversed (adjoint at x_{adjoint})"
        )
    if kept:
        raise ScheduleError(f"schedule ended with recorded steps never reversed: "
                            f"{sorted(kept)[:5]}")
    if held:
        (lv, sl), i = next(iter(held.items()))
        raise ScheduleError(
            f"schedule ended with slot {sl} (level {lv}) still holding x_{i}; free it"
        )
    return ScheduleStats(
        n_steps=n,
        advances=advances,
        recorded=recorded,
        peak_slots=LevelCounts(peak),
        stores=LevelCounts(stores),
        restores=LevelCounts(restores),
        frees=LevelCounts(frees),
        peak_tapes=peak_tapes,
        actions=count if n else 0,
        peak_slots_total=peak_total,
        peak_storage=peak_storage,
        inverses=inverses,
    )


def check(
    schedule: Iterable[Action],
    *,
    n_steps: int | None = None,
    slots: dict[int, int] | int | None = None,
    tapes: int | None = None,
) -> ScheduleStats:
    """Validate ``schedule`` on symbolic states and return its :class:`ScheduleStats`.

    Raises :class:`ScheduleError` naming the action when a step or reverse step is given the
    wrong state, a slot is read empty or written full, a level's slot limit is exceeded, more
    than ``tapes`` recorded steps are kept, or a step is never reversed.

    Args:
        schedule: any iterable of actions; a :class:`~deepsolve.schedules.Schedule` supplies
            ``n_steps`` and its slot limits itself.
        n_steps: chain length, for a plain iterable.
        slots: slot limit per level, ``{level: count}``, or an int for level 0. Defaults to
            the schedule's own ``slots``.
        tapes: the most recorded steps that may be kept at once (``None``: no limit).
    """
    if isinstance(slots, int):
        slots = {0: slots}
    return _walk(schedule, n_steps, slots, tapes)


def stats(schedule: Iterable[Action], *, n_steps: int | None = None) -> ScheduleStats:
    """Walk any schedule and count ``advances``, ``recorded``, ``peak_slots``, ``stores``, ...

    The walk also validates the schedule (it is :func:`check` without extra limits).
    """
    return _walk(schedule, n_steps, None, None)
