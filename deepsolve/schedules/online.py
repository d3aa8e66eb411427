"""Online checkpointing: reverse a chain whose length is unknown until it ends.

``deepsolve.unroll(step, x0, until=stop, snapshots=s)`` runs until ``stop(x_i, i)`` holds, so
the number of steps ``n`` is unknown during the forward sweep. An offline schedule such as
:func:`~deepsolve.schedules.revolve` cannot be used; :class:`Online` decides *during* the
forward sweep which states to keep, and plans the reverse sweep once ``n`` is known.

Protocol (used by the executor)::

    ctl = online(s).start()
    for i = 0, 1, 2, ...:                   # the current state is x_i
        apply ctl.at(i)                     # () or (Store,) or (Free, Store), on x_i
        x_{i+1} = step(x_i, i)              # unrecorded
        if stop(x_{i+1}, i + 1):
            n = i + 1
            apply ctl.finish(n)             # the current state is still x_{n-1}
            break

``finish(n)`` starts with ``Reverse(n-1)`` recorded from the held ``x_{n-1}``; the step
``n-1`` was thus evaluated once unrecorded (to learn that ``x_n`` is the last state) and once
recorded. That one inherent extra evaluation is not part of the action stream:
:attr:`Online.extra_advances` is 1.

Placement policy ("skeleton + rightmost fitting merge"). Let ``r`` be the repetition number of
the current length (``optimal_cost``). Write the held checkpoints ``0 = p_0 < p_1 < ...`` and
let segment ``j`` (``[p_j, p_{j+1})``, the last one ending at the newest state) be reversed
offline with ``c_j = s - j`` slots. For lengths with repetition number ``r`` the offline optimum
is reached exactly by the configurations whose segment lengths lie in the boxes
``[beta(c_j, r-2), beta(c_j, r-1)]`` (the last segment counted without its final step), and at
``n = beta(s, r)`` by exactly one of them, the *skeleton* with lengths ``beta(c, r-1)``,
``c = s .. 1``. The controller

* stores every state that is a checkpoint position of the skeleton of the current ``r`` (they
  are never dropped while ``r`` lasts), so that at every ``n = beta(s, r)`` the held set is
  exactly optimal;
* otherwise stores the current state only when the last segment would leave its box (its
  length would exceed ``beta(1, r-1) = r``);
* when all slots are full, frees the *rightmost non-skeleton checkpoint whose two adjacent
  segments, merged, still fit in the merged segment's box* (``<= beta(c, r-1)``); the
  segments after it gain a slot, which never lengthens their reverse sweep.

A store with all slots full leaves an empty newest segment behind, which costs
``C(r, 2)`` advances more than the offline optimum until it has grown (1 for ``r = 2``, 3
for ``r = 3``); no online policy avoids it (exact optimality for every ``n <= beta(s, 2)`` is
impossible online: some held set of the run is suboptimal at ``n = s + 3``). Equality holds
for ``n <= s + 1``. Checked (``s <= 30`` and ``s = 40, 50``): ``advances <= optimal_cost + 1``
for ``n <= beta(s, 2)``, ``+ 4`` for ``n <= beta(s, 3)``, and equality at every
``n = beta(s, r)`` tested. Just past ``beta(s, 2)`` the worst ratio is within 0.3 % of what any
online policy can reach for ``s = 10, 20, 50``. See docs/schedules.md (online section).

Cost of ``at(i)``: ``O(1)`` integer operations when nothing is stored; a store scans held
checkpoints from the newest backwards until the first fitting one (measured: fewer than one
checkpoint scanned per step on average, e.g. 0.7 for ``s = 50`` over ``10^5`` steps). The
state is ``O(s)``: the held positions, their slots, and one table of ``s`` binomials per
repetition number. The reverse sweep is planned segment by segment with :class:`Revolve`
(binomial splitting, :func:`~deepsolve.schedules.cost.split`).

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action, Advance, Free, Record, Restore, Reverse, Store
from .base import Schedule
from .cost import _check, beta, optimal_cost
from .revolve import Revolve

__all__ = ["Online", "OnlineController", "OnlineSchedule", "online"]

_NOTHING: tuple[Action, ...] = ()


def _check_snapshots(snapshots: int) -> None:
    _check(0, snapshots)


class Online:
    """Online checkpoint schedule for a chain of unknown length, with ``snapshots`` slots.

    ``snapshots`` counts every state held at once, ``x_0`` included (as for
    :func:`~deepsolve.schedules.revolve`). Use :meth:`start` for a fresh controller (one per
    run), :meth:`for_length` for the complete action stream of a run that stops at ``n``.

    Attributes:
        kind: ``"online"``.
        snapshots: the slot count ``s``.
        slots: ``{0: s}``.
        extra_advances: 1, the unrecorded evaluation of step ``n-1`` that reveals that ``x_n``
            is the last state; it is not in the action stream (``Reverse(n-1)`` then records
            the step again from the held ``x_{n-1}``). A run costs
            ``stats(for_length(n)).advances + extra_advances`` unrecorded steps.
    """

    kind = "online"
    extra_advances = 1

    def __init__(self, snapshots: int):
        _check_snapshots(snapshots)
        self.snapshots = snapshots
        self.slots = {0: snapshots}

    def start(self) -> OnlineController:
        """A fresh controller for one run (see :class:`OnlineController`)."""
        return OnlineController(self.snapshots)

    def for_length(self, n_steps: int) -> OnlineSchedule:
        """The fixed-length schedule that the controller produces for a run stopping at ``n``."""
        return OnlineSchedule(n_steps, self.snapshots)

    def advances(self, n_max: int) -> list[int]:
        """``[stats(for_length(n)).advances for n in range(n_max + 1)]``, computed in one run.

        Runs one controller to ``n_max`` and adds, for each ``n``, the ``n - 1`` forward steps
        and the optimal offline cost of each held segment; much cheaper than generating and
        walking every ``for_length(n)``. The extra evaluation (:attr:`extra_advances`) is not
        included.
        """
        _check(n_max, self.snapshots)
        s = self.snapshots
        out = [0]
        if n_max == 0:
            return out

        def cost(m: int, c: int) -> int:
            return m * (m - 1) // 2 if c == 1 else optimal_cost(m, c)

        ctl = self.start()
        pos = ctl._pos
        fixed = 0  # sum over all segments but the last
        fixed_for = -1  # the store count `fixed` was computed for
        for i in range(n_max):
            ctl.at(i)
            if ctl._stores != fixed_for:
                fixed = sum(cost(pos[j + 1] - pos[j], s - j) for j in range(len(pos) - 1))
                fixed_for = ctl._stores
            # termination at n = i + 1: the last segment is [pos[-1], i) plus the held x_i
            out.append(i + fixed + cost(i - pos[-1], s - len(pos) + 1))
        return out

    def __repr__(self) -> str:
        return f"online(snapshots={self.snapshots})"


class OnlineController:
    """The forward-sweep decisions of :class:`Online` for one run.

    Call :meth:`at` with ``i = 0, 1, 2, ...`` while ``x_i`` is the current state and apply the
    returned actions to it before advancing; when ``x_n`` turns out to be the last state, call
    :meth:`finish` with ``n`` (the current state is still ``x_{n-1}``) and apply the returned
    actions. Memory ``O(snapshots)``.
    """

    __slots__ = (
        "_s", "_i", "_done", "_pos", "_slot", "_skel", "_free", "_r", "_bound", "_hi", "_hi1",
        "_skeleton", "_next", "_stores",
    )

    def __init__(self, snapshots: int):
        _check_snapshots(snapshots)
        s = snapshots
        self._s = s
        self._i = 0  # the index the next at() must have
        self._done = False
        self._pos: list[int] = []  # held indices, increasing
        self._slot: list[int] = []  # their slots
        self._skel: list[bool] = []  # whether each is a skeleton position of the current r
        self._free = list(range(s - 1, -1, -1))  # free slots; pop() gives slot 0 first
        self._r = 0
        self._bound = 0  # beta(s, r): the current r holds for i + 1 <= _bound
        self._hi: list[int] = []  # _hi[c] = beta(c, r - 1), the longest segment with c slots
        self._hi1 = 0
        self._skeleton: list[int] = []  # skeleton positions of the current r, decreasing
        self._next = 0  # the next skeleton position >= i (-1: none left)
        self._stores = 0

    @property
    def held(self) -> tuple[int, ...]:
        """Indices of the states held now, increasing."""
        return tuple(self._pos)

    def _new_repetition(self, i: int) -> None:
        """Enter the repetition number of length ``i + 1``."""
        s = self._s
        if s == 1:  # x_0 is the only snapshot ever held
            self._r = self._bound = self._hi1 = 1 << 62
            self._next = 0 if i == 0 else -1
            return
        r = max(1, self._r)
        bound = beta(s, r)
        while bound < i + 1:  # usually once: r grows by one at i = beta(s, r)
            r += 1
            bound = bound * (s + r) // r
        self._r = r
        self._bound = bound
        self._hi = [0] + [beta(c, r - 1) for c in range(1, s + 1)]
        self._hi1 = self._hi[1]
        sk = []
        p = 0
        for c in range(s, 0, -1):
            sk.append(p)
            p += self._hi[c]
        # the first new skeleton position is beta(s, r-1) = i (or 0 when r == 1): none is
        # behind us except 0, so every held state but x_0 becomes an ordinary checkpoint
        sk.reverse()
        while sk and sk[-1] < i:
            sk.pop()
        self._skeleton = sk
        self._next = sk.pop() if sk else -1
        skel = self._skel
        for j in range(1, len(skel)):
            skel[j] = False

    def at(self, i: int) -> tuple[Action, ...]:
        """Actions to apply to the current state ``x_i`` before advancing it (often none).

        Only ``Free`` (an older checkpoint) and ``Store(slot, i)``. Indices must come as
        ``0, 1, 2, ...``.
        """
        if i != self._i or self._done:
            raise ValueError(
                f"at({i}): expected at({self._i})" if not self._done else "at() after finish()"
            )
        self._i = i + 1
        if i >= self._bound:
            self._new_repetition(i)
        if i == self._next:
            sk = self._skeleton
            self._next = sk.pop() if sk else -1
            return self._store(i, True)
        if i - self._pos[-1] > self._hi1:
            return self._store(i, False)
        return _NOTHING

    def _store(self, i: int, skeleton: bool) -> tuple[Action, ...]:
        pos, slot, skel = self._pos, self._slot, self._skel
        self._stores += 1
        if self._free:
            sl = self._free.pop()
            pos.append(i)
            slot.append(sl)
            skel.append(skeleton or len(pos) == 1)
            return (Store(sl, i),)
        k = len(pos)
        if k == 1:  # s == 1: x_0 is the only snapshot
            self._stores -= 1
            return _NOTHING
        hi, s = self._hi, self._s
        # the rightmost non-skeleton checkpoint j whose segments j-1 and j merged fit into
        # the merged segment's box (c = s - j + 1 slots)
        found = fallback = -1
        right = i
        j = k - 1
        while j >= 1:
            left = pos[j - 1]
            if not skel[j]:
                if right - left <= hi[s - j + 1]:
                    found = j
                    break
                if fallback < 0:
                    fallback = j
            right = pos[j]
            j -= 1
        if found < 0:  # not met in practice; keep going with the newest ordinary checkpoint
            found = fallback if fallback > 0 else k - 1
        sl = slot[found]
        p = pos[found]
        del pos[found], slot[found], skel[found]
        pos.append(i)
        slot.append(sl)
        skel.append(skeleton)
        return (Free(sl, p), Store(sl, i))

    def finish(self, n: int) -> Iterator[Action]:
        """The reverse sweep once ``x_n`` is known to be the last state.

        Requires ``at(0) .. at(n-1)`` to have been called and ``x_{n-1}`` to be the current
        state. The actions start with ``Reverse(n-1)``, then reverse each segment between held
        checkpoints, newest first, with :class:`Revolve` (segment ``j`` may use ``s - j``
        slots), and free every slot. ``n = 0`` (no step at all) frees what is held.
        """
        if self._done:
            raise ValueError("finish() was already called")
        if isinstance(n, bool) or not isinstance(n, int) or n != self._i:
            raise ValueError(f"finish({n!r}): at(0) .. at({self._i - 1}) were called, so "
                             f"the run has n = {self._i} steps")
        self._done = True
        return _reverse(n, self._s, list(self._pos), list(self._slot), list(self._free))


def _reverse(n: int, s: int, pos: list[int], slot: list[int], free: list[int]) -> Iterator[Action]:
    if n == 0:
        for j in range(len(pos) - 1, -1, -1):
            yield Free(slot[j], pos[j])
        return
    yield Reverse(n - 1)
    end = n - 1
    for j in range(len(pos) - 1, -1, -1):
        a = pos[j]
        if end > a:
            yield from _reverse_segment(a, end - a, s - j, slot[j], free)
        else:  # the held state was x_{n-1} itself
            yield Free(slot[j], a)
        free.append(slot[j])
        end = a


def _reverse_segment(a: int, m: int, c: int, base: int, free: list[int]) -> Iterator[Action]:
    """Reverse steps ``a .. a+m-1`` (``m >= 1``) with :class:`Revolve`'s optimal plan.

    ``x_a`` is held in slot ``base``; ``c`` slots may be used, ``base`` included, the others
    taken from ``free`` (which must hold at least ``c - 1``). The current state is undefined on
    entry. Revolve's slot ``0`` is mapped to ``base`` and its slot ``j`` to ``free[-j]``;
    indices are shifted by ``a``. Ends with ``Free(base, a)``.
    """
    yield Restore(base, a)
    if m == 1:
        yield Reverse(a)
        yield Free(base, a)
        return
    c = min(c, m)
    slots = [base] + [free[-j] for j in range(1, c)]
    actions = iter(Revolve(m, c))
    first = next(actions)
    if first != Store(0, 0):  # pragma: no cover - Revolve's documented start
        raise AssertionError(f"unexpected first revolve action {first!r}")
    for act in actions:
        if type(act) is Advance:
            yield Advance(a + act.start, a + act.stop)
        elif type(act) is Reverse:
            yield Reverse(a + act.index)
        elif type(act) is Store:
            yield Store(slots[act.slot], a + act.index)
        elif type(act) is Restore:
            yield Restore(slots[act.slot], a + act.index)
        elif type(act) is Free:
            yield Free(slots[act.slot], a + act.index)
        elif type(act) is Record:  # pragma: no cover - revolve keeps no tapes
            yield Record(a + act.start, a + act.stop)
        else:  # pragma: no cover
            raise AssertionError(f"unexpected revolve action {act!r}")


class OnlineSchedule(Schedule):
    """The complete action stream of :class:`Online` for a run that stops at ``n_steps``.

    Forward part: the controller's ``Store``/``Free`` actions interleaved with maximal
    ``Advance`` ranges up to ``x_{n-1}``; then ``finish(n)``. The real run evaluates step
    ``n-1`` once more, unrecorded (:attr:`Online.extra_advances`); that evaluation is not in
    the stream.
    """

    kind = "online"
    extra_advances = 1

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
        ctl = OnlineController(self.snapshots)
        start = 0  # the pending advance runs start .. i
        for i in range(n):
            acts = ctl.at(i)
            if acts:
                if i > start:
                    yield Advance(start, i)
                start = i
                yield from acts
        if n - 1 > start:
            yield Advance(start, n - 1)
        yield from ctl.finish(n)


def online(snapshots: int) -> Online:
    """Online checkpointing with ``snapshots`` slots (``x_0`` included); see :class:`Online`."""
    return Online(snapshots)


def _ratio_table(sizes: tuple[int, ...] = (3, 5, 10, 20, 50), n_max: int = 10_000) -> str:
    """Markdown table: worst ``advances / optimal_cost`` (without / with the +1) per range."""
    rows = [
        "| s | n <= C(s+2,2): max excess | n <= C(s+2,2) | C(s+2,2) < n <= C(s+3,3) "
        f"| C(s+3,3) < n <= {n_max} |",
        "|---:|---:|---|---|---|",
    ]
    for s in sizes:
        adv = Online(s).advances(n_max)
        b2, b3 = beta(s, 2), beta(s, 3)
        exc = max(adv[n] - optimal_cost(n, s) for n in range(1, min(b2, n_max) + 1))

        def worst(lo: int, hi: int, adv=adv, s=s) -> str:
            ns = range(max(lo, 2), hi + 1)
            if not ns:
                return "-"
            w0 = max(adv[n] / optimal_cost(n, s) for n in ns)
            w1, n1 = max(((adv[n] + 1) / optimal_cost(n, s), n) for n in ns)
            return f"{w0:.4f} / {w1:.4f} (n={n1})"

        rows.append(f"| {s} | {exc} | {worst(2, min(b2, n_max))} | "
                    f"{worst(b2 + 1, min(b3, n_max))} | {worst(b3 + 1, n_max)} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m deepsolve.schedules.online
    print(_ratio_table())
