"""The action interpreter: one loop that runs a checkpoint schedule, checking every action.

A schedule (:mod:`deepsolve.schedules`) is a stream of actions on a chain of ``n`` steps (or
layers) ``x_{i+1} = f_i(x_i)``: ``Advance(a, b)`` (run steps ``a..b-1`` unrecorded),
``Record(a, b)`` (run them recorded and keep their tapes), ``Store(slot, i)`` /
``Restore(slot, i)`` / ``Free(slot, i)`` (snapshots of ``x_i``, on a storage level) and
``Reverse(i)`` (pull the adjoint through step ``i``:
``lambda_i = J_i(x_i)^T lambda_{i+1}``, accumulating the parameter gradients) and
``Invert(i)`` (the same for a reversible step, its input ``x_i`` rebuilt from ``x_{i+1}`` by
the step's inverse).

:class:`Interpreter` is the one interpreter of the library: :func:`deepsolve.unroll`'s
executor (:class:`~deepsolve.engine.executor.UnrollRun`, states of fixed structure with
per-step outputs) and :func:`deepsolve.sequential`'s chain (layers whose states change shape)
both drive it and supply only what differs, their steps: ``_advance`` (unrecorded steps),
``_keep`` (a kept recording), ``_reverse`` (record if needed and pull the adjoint through
one step) and, for reversible steps, ``_invert`` and ``_rebuilt`` (the drift of a rebuilt
state against its snapshot). Snapshots (:class:`~deepsolve.engine.storage.Slot`), their
storage levels, the random-number replay (:class:`~deepsolve.engine.replay.Replay`), the
checks and the reverse sweep's frame live here, once.

Trust: the interpreter believes no schedule. Each action is checked against its state
before it runs, as :func:`deepsolve.schedules.check` does on symbolic states: the index
``at`` of the state held (``-1``: none), the slots' contents, and the adjoint position
``adj`` (``dL/dx_adj`` is held; it starts at ``n``). ``Advance(a, b)``/``Record(a, b)`` need
``at == a`` and ``0 <= a < b <= n`` (``b <= adj`` for ``Record``: steps ``>= adj`` are
reversed already), ``Store(s, i)`` needs ``at == i >= 0`` and an empty slot,
``Restore``/``Free(s, i)`` a slot holding ``x_i``, ``Reverse(i)`` needs ``i == adj - 1 >= 0``
and ``at == i`` or a kept tape of step ``i``, ``Invert(i)`` needs ``i == adj - 1 >= 0`` and
``x_{i+1}``: ``at == i + 1`` or the input ``ret == i + 1`` that the reverse step just before
retained (a reverse step retains its input only while the run has an inverse, until the
next action that moves the state); at the end ``adj == 0``, so every step was reversed
exactly once. Each check is one or two integer comparisons; a misfit raises a
one-line :class:`~deepsolve.schedules.check.ScheduleError` naming the action and its
position in the stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..schedules.actions import Advance, Free, Invert, Record, Restore, Reverse, Store
from ..schedules.check import ScheduleError
from .replay import Replay
from .storage import POOL_BELOW, HostStorage, Slot, SnapshotPool

__all__ = ["Interpreter", "Misfit", "GradSum", "holding", "SweepStats"]


@dataclass
class SweepStats:
    """What one run of a schedule did (the fields every interpreter fills; the unroll's and
    the chain's statistics add their own).

    Attributes:
        schedule: ``repr`` of the schedule (or plan) run.
        advances: unrecorded step evaluations (forward sweep and recomputation).
        recorded: recorded step evaluations (each step once).
        forward_time, backward_time: wall time of the two sweeps [s].
        extra: further facts, by name.
    """

    schedule: str = ""
    advances: int = 0
    recorded: int = 0
    forward_time: float = 0.0
    backward_time: float = 0.0
    extra: dict = field(default_factory=dict)


class Misfit(Exception):
    """An action that does not fit the interpreter's state; :meth:`Interpreter._run` turns
    it into a :class:`ScheduleError` naming the action and its position in the stream."""


def holding(at: int) -> str:
    """What the interpreter holds, in words, for error messages."""
    return f"x_{at}" if at >= 0 else "no state (a Reverse leaves none; Restore a snapshot)"


class GradSum:
    """The sum over steps of one parameter list's gradients, ``dL/dtheta_k = sum_i g_ik``.

    The first term of a parameter is kept as autograd returned it (it may alias autograd's
    buffers, so it is not modified in place); the second makes an own sum that later terms
    are added into."""

    __slots__ = ("grads", "owned")

    def __init__(self, n: int):
        self.grads: list[torch.Tensor | None] = [None] * n
        self.owned = [False] * n

    def add(self, k: int, g: torch.Tensor) -> None:
        cur = self.grads[k]
        if cur is None:
            self.grads[k] = g
        elif self.owned[k]:
            cur.add_(g)
        else:
            self.grads[k] = cur + g
            self.owned[k] = True


class Interpreter:
    """Runs one schedule over ``n`` steps; see the module docstring.

    Subclasses set :attr:`who` (the error prefix), :attr:`unit` (``"step"``/``"layer"``) and
    implement ``_advance(cur, a, b, outs)``, ``_keep(cur, i, outs)`` (record step ``i``, keep
    its tape in ``self.tapes``, return ``x_{i+1}``) and ``_reverse(cur, i)``. States are lists
    of leaf tensors. ``meta`` (``[(shape, dtype, device)]`` of the leaves) is needed for
    storage levels ``>= 1`` and lowered snapshots.
    """

    who = "unroll"
    unit = "step"
    check_hint = "; check a custom schedule with deepsolve.schedules.check(schedule)"

    def __init__(self, schedule: Any, n_steps: int, replay: Replay,
                 storage: dict | None = None, meta: Sequence[tuple] = (),
                 lower: list | None = None, slot_bytes: int = 0):
        self.schedule = schedule
        self.n = n_steps
        self.replay = replay
        self.meta = list(meta)
        self.slots: dict[tuple[int, int], Slot] = {}
        self.tapes: dict[int, Any] = {}
        self.actions: Iterator | None = None
        self.pending: tuple[int, Any] | None = None
        self.advances = 0
        self.recorded = 0
        self.n_slots = 0
        self.peak_slots = 0
        self.at = 0  # index of the state held (-1: none)
        self.adj = n_steps  # the adjoint dL/dx_adj is held
        self.pos = 0  # actions consumed
        self.lower = lower  # per leaf: the snapshot dtype, or None (stored as it is)
        self.slot_bytes = slot_bytes  # level-0 bytes of one snapshot other than x_0
        self.snap_bytes = 0  # level-0 snapshot bytes held now, x_0 excluded
        self.peak_snap_bytes = 0
        self.storage: dict = dict(storage or {})
        self.pool: SnapshotPool | None = None
        if self.meta and all(m[2].type == "cpu" for m in self.meta) and \
                sum(torch.Size(m[0]).numel() * m[1].itemsize for m in self.meta) < POOL_BELOW:
            stored = [(m[0], (lower[k] if lower is not None and lower[k] is not None else m[1]),
                       m[2]) for k, m in enumerate(self.meta)]
            self.pool = SnapshotPool(stored)
        self.done = False
        self.backward_time = 0.0
        # a reversible run: the input x_ret of the last reverse step, kept for an Invert
        self.retained: list | None = None

    # -- what subclasses supply --------------------------------------------------------------

    def _advance(self, cur: list, a: int, b: int, outs) -> list:  # pragma: no cover
        raise NotImplementedError

    def _keep(self, cur: list, i: int, outs) -> list:  # pragma: no cover
        raise NotImplementedError

    def _reverse(self, cur: list | None, i: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _pull(self, tape: Any, i: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _invert(self, nxt: list, i: int) -> None:
        """Rebuild ``x_i`` from ``x_{i+1}`` (``nxt``) by the step's inverse, record step ``i``
        from it, pull the adjoint through it and retain ``x_i`` in :attr:`retained`."""
        raise Misfit(f"{self.who} has no inverse {self.unit}s to run an Invert")

    def _rebuilt(self, rebuilt: list, exact: list, i: int) -> None:
        """``x_i`` rebuilt by inverse steps, beside its stored snapshot ``exact`` (Restore
        after Invert): where a reversible run measures and acts on the drift."""

    def _new_snapshot_peak(self) -> None:
        """Called when the level-0 snapshot bytes reach a new peak (stats hooks)."""

    # -- snapshots -----------------------------------------------------------------------

    def _store(self, cur: list, a: Store) -> None:
        key = (a.level, a.slot)
        if key in self.slots:
            raise Misfit(f"slot {a.slot} (level {a.level}) already holds "
                         f"x_{self.slots[key].index}; Free it first")
        rng = self.replay.capture()
        lowered = self.lower is not None and a.index != 0  # x_0 is always held exactly
        data: list | None = cur
        if lowered:
            assert self.lower is not None  # lowered implies it
            data = [t if d is None else t.to(d) for t, d in zip(cur, self.lower, strict=True)]
        row = -1
        if a.level == 0:
            if a.index != 0:  # x_0 is the caller's tensor: holding it costs nothing
                self.snap_bytes += self.slot_bytes
                if self.snap_bytes > self.peak_snap_bytes:
                    self.peak_snap_bytes = self.snap_bytes
                    self._new_snapshot_peak()
                if self.pool is not None:  # a small state: packed into the pool
                    assert data is not None  # the state held (checked above)
                    row = self.pool.put(data, a.index)
                    data = None
        else:  # a second storage level (host memory, disk): the backend keeps the data
            self._backend(a.level).put(key, data)
            data = None
        self.slots[key] = Slot(data, [t._version for t in cur] if data is cur else None, rng,
                               a.index, lowered, row)
        self.n_slots += 1
        if self.n_slots > self.peak_slots:
            self.peak_slots = self.n_slots

    def _held(self, a: Restore | Free) -> Slot:
        entry = self.slots.get((a.level, a.slot))
        if entry is None:
            raise Misfit(f"slot {a.slot} (level {a.level}) is empty")
        if entry.index != a.index:
            raise Misfit(f"slot {a.slot} (level {a.level}) holds x_{entry.index}, "
                         f"not x_{a.index}")
        return entry

    def _free(self, a: Free) -> None:
        self._held(a)
        key = (a.level, a.slot)
        slot = self.slots.pop(key)
        self.n_slots -= 1
        if a.level == 0:
            if a.index != 0:
                self.snap_bytes -= self.slot_bytes
            if slot.row >= 0:
                assert self.pool is not None  # rows come from it
                self.pool.drop(slot.row)
        else:
            self._backend(a.level).drop(key)

    def _backend(self, level: int):
        backend = self.storage.get(level)
        if backend is None:
            backend = self.storage[level] = HostStorage()
        return backend

    def _modified_in_place(self, index: int) -> str:
        return (f"{self.who}: the snapshot of x_{index} was modified in place after it was "
                f"stored; the {self.unit} must not modify its input state in place (return "
                "new tensors)")

    def _restore(self, a: Restore) -> list:
        slot = self._held(a)
        data = slot.data
        if a.level != 0:
            data = self._backend(a.level).get((a.level, a.slot), self.meta)
        elif slot.row >= 0:
            assert self.pool is not None  # rows come from it
            data = self.pool.get(slot.row)
        assert data is not None  # a level-0 slot holds its leaves
        if a.level == 0 and slot.versions is not None and any(
                t._version != v for t, v in zip(data, slot.versions, strict=True)):
            raise RuntimeError(self._modified_in_place(a.index))
        self.replay.restore(slot.rng)
        if slot.lowered:
            return [t.to(m[1]) for t, m in zip(data, self.meta, strict=True)]
        return list(data)

    def release(self) -> None:
        """Drop every snapshot and tape and close the storage backends (remove spill files)."""
        self.slots.clear()
        self.tapes.clear()
        self.pending = None
        self.retained = None
        if self.pool is not None:
            self.pool.close()
        for backend in self.storage.values():
            backend.close()

    # -- the loop ------------------------------------------------------------------------

    def _run(self, cur, outs, until_reverse: bool):
        """Interpret actions until the first Reverse (forward) or the end (backward),
        checking each against the state (see the module docstring)."""
        n = self.n
        at = self.at
        # the index of the retained input (self.retained), -1: none; set after a reverse step
        ret = self.adj if self.retained is not None else -1
        k = self.pos
        a = None
        unit = self.unit
        assert self.actions is not None  # set by _to_first_reverse
        try:
            for a in self.actions:
                t = type(a)
                if t is Advance:
                    lo, hi = a.start, a.stop
                    if lo != at or not 0 <= lo < hi <= n:
                        raise Misfit(self._range_misfit(lo, hi, at, n))
                    cur = self._advance(cur, lo, hi, outs)
                    at = hi
                    if ret >= 0:
                        ret, self.retained = -1, None
                elif t is Reverse:
                    i = a.index
                    if i != self.adj - 1 or i < 0:
                        raise Misfit(self._order_misfit())
                    if at != i and i not in self.tapes:
                        raise Misfit(f"reversing {unit} {i} needs x_{i} (or a Record of "
                                     f"{unit} {i}) but the executor holds {holding(at)}")
                    if until_reverse:
                        self.at, self.pos = at, k + 1
                        return cur, a
                    self._reverse(cur, i)
                    self.adj = i
                    cur = None
                    at = -1
                    ret = i if self.retained is not None else -1
                elif t is Invert:
                    i = a.index
                    if i != self.adj - 1 or i < 0:
                        raise Misfit(self._order_misfit())
                    if at == i + 1:
                        nxt = cur
                    elif ret == i + 1:
                        nxt = self.retained
                    else:
                        raise Misfit(f"inverting {unit} {i} needs x_{i + 1} (the current state "
                                     f"or the input of the reverse {unit} just before) but the "
                                     f"executor holds {holding(at)}")
                    cur = None
                    self._invert(nxt, i)
                    self.adj = i
                    at = -1
                    ret = i
                elif t is Store:
                    if a.index != at or at < 0:
                        raise Misfit(f"stores x_{a.index} but the executor holds {holding(at)}")
                    self._store(cur, a)
                elif t is Restore:
                    cur = self._restore(a)
                    at = a.index
                    if ret >= 0:
                        if ret == at and self.retained is not None:
                            self._rebuilt(self.retained, cur, at)
                        ret, self.retained = -1, None
                elif t is Free:
                    self._free(a)
                elif t is Record:
                    lo, hi = a.start, a.stop
                    if lo != at or not 0 <= lo < hi <= self.adj:
                        raise Misfit(self._range_misfit(lo, hi, at, self.adj))
                    for i in range(lo, hi):
                        if i in self.tapes:
                            raise Misfit(f"{unit} {i} is already recorded")
                        cur = self._keep(cur, i, outs)
                    at = hi
                    if ret >= 0:
                        ret, self.retained = -1, None
                else:
                    raise Misfit("is not a schedule action (Advance, Record, Store, Restore, "
                                 "Free, Reverse, Invert)")
                k += 1
        except Misfit as e:
            raise ScheduleError(
                f"{self.who}: action {k} ({a!r}) of schedule {self.schedule!r} does not fit: "
                f"{e}{self.check_hint}") from None
        self.at, self.pos = at, k
        return cur, None

    def _order_misfit(self) -> str:
        """A reverse step (Reverse or Invert) out of order: which one comes next."""
        if not self.adj:
            return f"every {self.unit} is already reversed"
        return (f"the adjoint is at x_{self.adj}, so the next reverse {self.unit} is "
                f"Reverse({self.adj - 1}) (or Invert({self.adj - 1}) for a reversible step)")

    def _range_misfit(self, lo: int, hi: int, at: int, limit: int) -> str:
        if lo != at or at < 0:
            return f"it starts at x_{lo} but the executor holds {holding(at)}"
        if hi > limit and limit < self.n:
            return (f"{self.unit}s {limit}..{self.n - 1} are already reversed, so a Record "
                    f"must stop at or before {limit}, not {hi}")
        return f"its range {lo}..{hi} must satisfy {lo} < stop <= n_steps={self.n}"

    def _to_first_reverse(self, cur: list, outs) -> tuple[list, Reverse]:
        """The forward sweep: interpret actions up to the first Reverse."""
        self.actions = iter(self.schedule)
        cur, rev = self._run(cur, outs, until_reverse=True)
        if rev is None:
            raise ScheduleError(f"{self.who}: schedule {self.schedule!r} ended after {self.pos} "
                                f"actions without a Reverse; its forward part must reach "
                                f"Reverse({self.n - 1}){self.check_hint}")
        return cur, rev

    # -- the reverse sweep ---------------------------------------------------------------

    def reverse_sweep(self) -> None:
        """Pull the adjoint through the pending tape (the step the forward sweep reversed
        first), then interpret the rest of the schedule; every step must be reversed once.
        Everything held is released at the end, also on error."""
        if self.done:
            raise RuntimeError(self.once)
        if torch.is_grad_enabled():
            raise RuntimeError(f"{self.who}: double backward (create_graph=True) through a "
                               f"checkpointed {self.who} is not supported; "
                               f"{self.double_backward_hint}")
        self.done = True
        t0 = time.perf_counter()
        try:
            with self.replay.reverse_sweep():
                assert self.pending is not None  # set by the forward sweep
                i, tape = self.pending
                self.pending = None
                self._pull(tape, i)
                del tape  # x_{n-1} and the last step's output: not needed any more
                self._reverse_rest()
        finally:
            self.release()
        self.backward_time = time.perf_counter() - t0

    def _reverse_rest(self) -> None:
        """The rest of the reverse sweep after the pending tape: interpret the actions left."""
        self._run(None, None, until_reverse=False)
        self._check_reversed(0)

    def _check_reversed(self, down_to: int) -> None:
        """Every step from ``down_to`` on has been reversed (the adjoint is at ``down_to``)."""
        if self.adj != down_to:
            raise ScheduleError(
                f"{self.who}: schedule {self.schedule!r} ended with {self.unit}s "
                f"{down_to}..{self.adj - 1} never reversed (the adjoint is at x_{self.adj}); "
                f"every {self.unit} must be reversed exactly once{self.check_hint}")

    double_backward_hint = "use schedule='store_all' for higher-order derivatives"
    once = ("unroll: backward through a checkpointed unroll can run only once; call unroll "
            "again for a second backward pass")
