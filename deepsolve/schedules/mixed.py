"""Mixed checkpointing: a storage unit holds either a state snapshot or a recorded step.

J. R. Maddison, "Step-based checkpointing with high-level algorithmic differentiation",
J. Comput. Sci. 82 (2024) 102405; arXiv:2305.09568 (2023, first titled "On the implementation of
checkpointing with high-level algorithmic differentiation"): "mixed" checkpointing. The data
that reverse one step (its tape: ``Record(i, i+1)`` kept until ``Reverse(i)``) can stand in for
a state snapshot. When a tape and a snapshot cost the same memory, an optimal mixed schedule needs
fewer forward evaluations than revolve: 2823 against 3747 for 1000 steps and 20 units.

The model (the semantics of :mod:`deepsolve.schedules.actions`): storage at any instant is
``state_units`` per snapshot held (``x_0`` included when it is stored) plus ``tape_units`` per
kept tape; the current state and the step being reversed by a tape-less ``Reverse`` are free.
The cost is the number of forward step evaluations, ``advances + recorded``.

The dynamic program (derived here; ``T(m, c)``: the fewest evaluations that reverse ``m`` steps
from the current state ``x_a`` with ``c`` free units, ``x_a`` not yet stored)::

    T(m, c) = m                                       if m <= 1 or (m - 1) * tape_units <= c
            = min_{1<=k<m} k + T(k, c) + T(m - k, c - state_units)     if c >= state_units
            = infinity                                 otherwise

The first line is a *leaf*: record steps ``a .. a+m-2`` keeping their tapes, reverse the last
one straight from the current state, then the taped ones. The second is revolve's split: store
``x_a``, advance ``k`` steps, reverse the right part with ``x_a`` held, then the left part from
``x_a`` (whose own storage lets it become a leaf: ``x_a`` is freed before the tapes are
recorded). A fuller program that may also tape the first step of any sub-chain and go on from
``x_{a+1}`` gives the same values; the tests check both against an exhaustive search over all
action sequences on tiny chains.

Planning: the table ``T`` and the first split ``K`` (``O(n * units)`` integers) are built once per
``(tape_units, state_units)`` and reused for any smaller chain or budget. The split search is
exact but pruned: each row is nearly convex (with equal sizes it stays within one unit of its
lower convex envelope), so only the splits whose convex *envelope* bound does not exceed a known
cost are scanned: about 100 per entry, some 15-25 us per ``(m, c)`` in all.
Generation is a lazy iterative walk of the tables over an explicit stack.

Pure Python, no torch.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from math import gcd
from operator import add

from .actions import Action, Advance, Free, Record, Restore, Reverse, Store
from .base import Schedule
from .check import check

__all__ = ["Mixed", "mixed", "mixed_cost", "peak_units"]

_INF = 1 << 62
_EPS = 1e-6  # float slack on the envelope bound (exact in rationals): errs towards scanning more


def _positive_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _normalise(
    n_steps: object, units: object, tape_units: object, state_units: object
) -> tuple[int, int, int, int]:
    """Validate; divide the unit sizes by their gcd (the budget rounded down with them)."""
    n = _positive_int("n_steps", n_steps, 0)
    u = _positive_int("units", units, 1)
    tu = _positive_int("tape_units", tape_units, 1)
    su = _positive_int("state_units", state_units, 1)
    g = gcd(tu, su)
    return n, u // g, tu // g, su // g


def _hull_push(hx: list[int], hy: list[int], x: int, y: int) -> None:
    """Append ``(x, y)`` (``x`` increasing) to the lower convex hull ``hx, hy`` (exact ints)."""
    while len(hx) >= 2 and (hy[-1] - hy[-2]) * (x - hx[-2]) >= (y - hy[-2]) * (hx[-1] - hx[-2]):
        hx.pop()
        hy.pop()
    hx.append(x)
    hy.append(y)


def _envelope(row: list[int], hi: int) -> list[float]:
    """Values at ``1 .. hi`` of the lower convex envelope of ``(j, row[j])``; index 0 unused."""
    hx: list[int] = []
    hy: list[int] = []
    for x in range(1, hi + 1):
        _hull_push(hx, hy, x, row[x])
    env = [0.0] * (hi + 1)
    env[hx[0]] = float(hy[0])
    for i in range(1, len(hx)):
        x0, y0, x1, y1 = hx[i - 1], hy[i - 1], hx[i], hy[i]
        slope = (y1 - y0) / (x1 - x0)
        for x in range(x0 + 1, x1 + 1):
            env[x] = y0 + slope * (x - x0)
    return env


class _Table:
    """Optimal costs ``cost[c][m]`` and first splits ``split[c][m]`` (0: a leaf).

    Rows ``c = 0 .. rows``; columns ``m = 0 .. n``. Rows above ``(n - 1) * tape_units`` would be
    all leaves and are not stored.
    """

    def __init__(self, n: int, units: int, tu: int, su: int):
        self.n, self.units, self.tu, self.su = n, units, tu, su
        self.rows = min(units, max(n - 1, 0) * tu)
        self.cost: list[array] = []  # 8-byte integers: 16 bytes per (m, c) in all
        self.split: list[array] = []
        for c in range(self.rows + 1):
            row, ks = self._row(c)
            self.cost.append(array("q", row))
            self.split.append(array("q", ks))

    def leaf(self, m: int, c: int) -> bool:
        return m <= 1 or (m - 1) * self.tu <= c

    def lookup(self, m: int, c: int) -> tuple[int, int]:
        """``(T(m, c), first split)`` for ``m <= n``, ``c <= units``."""
        if self.leaf(m, c):
            return m, 0
        return self.cost[c][m], self.split[c][m]

    def _row(self, c: int) -> tuple[list[int], list[int]]:
        n, tu, su = self.n, self.tu, self.su
        leafmax = min(c // tu + 1, n)
        row = list(range(leafmax + 1)) + [_INF] * (n - leafmax)
        ks = [0] * (n + 1)
        if c < su or leafmax >= n:
            return row, ks
        right = list(self.cost[c - su])  # T(., c - su), complete
        jmax = n if c - su >= su else min((c - su) // tu + 1, n)  # finite on 0 .. jmax
        rev = right[::-1]  # rev[n - j] = right[j]
        env = _envelope(right, jmax)  # convex minorant of the right part's cost
        a_val = [k + row[k] for k in range(leafmax + 1)]  # A(k) = k + T(k, c): left part + advance
        # lower convex hull of the points (k, A(k)), k = 1 .. m-1: a convex minorant of A
        hx: list[int] = []
        hy: list[int] = []
        for k in range(1, leafmax + 1):
            _hull_push(hx, hy, k, a_val[k])

        def bound(k: int, m: int) -> float:
            """Lower bound on ``A(k) + T(m - k, c - su)``, convex in ``k``."""
            i = bisect_right(hx, k) - 1
            x0 = hx[i]
            lo: float
            if x0 == k:
                lo = hy[i]
            else:
                lo = hy[i] + (hy[i + 1] - hy[i]) * (k - x0) / (hx[i + 1] - x0)
            return lo + env[m - k]

        lo = hi = 1  # the window of splits scanned for the previous m
        for m in range(leafmax + 1, n + 1):
            dlo, dhi = max(1, m - jmax), m - 1
            off = n - m  # rev[off + k] = T(m - k, c - su)
            # scan a guess (the previous window, one step wider), exactly
            lo = min(max(lo, dlo), dhi)
            hi = max(min(hi + 1, dhi), lo)
            vals = list(map(add, a_val[lo:hi + 1], rev[off + lo:off + hi + 1]))
            best = min(vals)
            k = lo + vals.index(best)  # the smallest optimal split found so far
            limit = best + _EPS + best * 1e-12
            # certify: every split outside [lo, hi] has bound > best (the bound is convex in k
            # and below the cost, so its sublevel set is an interval holding k); else widen
            step = 1
            while lo > dlo and bound(lo - 1, m) <= limit:
                new = max(dlo, lo - step)
                step *= 2
                vals = list(map(add, a_val[new:lo], rev[off + new:off + lo]))
                v = min(vals)
                if v <= best:  # ties: prefer the smaller split
                    best, k, limit = v, new + vals.index(v), v + _EPS + v * 1e-12
                lo = new
            step = 1
            while hi < dhi and bound(hi + 1, m) <= limit:
                new = min(dhi, hi + step)
                step *= 2
                vals = list(map(add, a_val[hi + 1:new + 1], rev[off + hi + 1:off + new + 1]))
                v = min(vals)
                if v < best:
                    best, k, limit = v, hi + 1 + vals.index(v), v + _EPS + v * 1e-12
                hi = new
            row[m] = best
            ks[m] = k
            a_val.append(m + best)
            _hull_push(hx, hy, m, m + best)
            # shrink the window (the next m's first guess) past splits whose bound exceeds best
            step = 1
            while lo + step < k and bound(lo + step, m) > limit:
                lo += step + 1
                step *= 2
            step = 1
            while hi - step > k and bound(hi - step, m) > limit:
                hi -= step + 1
                step *= 2
        return row, ks


_TABLES: dict[tuple[int, int], _Table] = {}


def _table(n: int, units: int, tu: int, su: int) -> _Table:
    """A table covering ``(n, units)`` for these unit sizes, cached and grown on demand.

    A table answers every smaller chain and budget. When a request needs a bigger one, the new
    table covers the old requests too and grows by half at least, so a planner that walks up
    ``n`` or ``units`` rebuilds only a logarithmic number of times.
    """
    t = _TABLES.get((tu, su))
    if t is not None and t.n >= n and (t.units >= units or t.rows >= (n - 1) * tu):
        return t
    if t is not None:
        if t.n < n:
            n = max(n, t.n + t.n // 2)
        units = max(units, t.units + t.units // 2) if t.units < units else t.units
    t = _Table(n, units, tu, su)
    _TABLES[(tu, su)] = t
    return t


def _infeasible(n_steps: int, units: int, tape_units: int, state_units: int) -> ValueError:
    return ValueError(
        f"{units} units cannot reverse {n_steps} steps: a snapshot needs {state_units} units "
        f"and taping all steps but the last needs {(n_steps - 1) * tape_units}"
    )


def mixed_cost(n_steps: int, units: int, tape_units: int = 1, state_units: int = 1) -> int:
    """Fewest forward evaluations (``advances + recorded``) of a mixed schedule.

    ``units`` is the storage budget: snapshots held (``x_0`` included) times ``state_units``
    plus kept tapes times ``tape_units`` never exceeds it. Equals
    ``stats(mixed(...)).advances + stats(mixed(...)).recorded``. Tables are cached per unit
    sizes, so repeated calls (a planner scanning budgets) cost a lookup.

    Raises:
        ValueError: bad arguments, or a budget that cannot reverse the chain at all (fewer
            units than one snapshot and too few to tape all steps but the last).
    """
    n, u, tu, su = _normalise(n_steps, units, tape_units, state_units)
    if n <= 1 or (n - 1) * tu <= u:
        return n
    if u < su:
        raise _infeasible(n, units, tape_units, state_units)
    return _table(n, u, tu, su).lookup(n, u)[0]


class Mixed(Schedule):
    """Optimal mixed schedule: ``units`` of storage, each snapshot or tape taking its size.

    Minimises forward evaluations (``advances + recorded``) such that at every instant
    ``state_units * snapshots + tape_units * kept tapes <= units`` (snapshots include ``x_0``
    when it is stored; with equal sizes, ``stats(...).peak_storage <= units``). Never more
    evaluations than revolve with ``units // state_units`` slots, and the same when a tape
    costs more than the whole budget.

    Snapshots use level-0 slots ``0 .. units // state_units - 1`` (``slots = {0: units}``).
    Planning builds (or reuses) ``O(n * units)`` tables; iteration then yields actions lazily
    with an explicit stack of at most ``units // state_units`` frames.
    """

    kind = "mixed"

    def __init__(self, n_steps: int, units: int, *, tape_units: int = 1, state_units: int = 1):
        n, u, tu, su = _normalise(n_steps, units, tape_units, state_units)
        if n >= 2 and (n - 1) * tu > u and u < su:
            raise _infeasible(n, units, tape_units, state_units)
        self.n_steps = n
        self.units = units
        self.tape_units = tape_units
        self.state_units = state_units
        self.slots = {0: units}
        self._u, self._tu, self._su = u, tu, su
        self._table = None if n <= 1 or (n - 1) * tu <= u else _table(n, u, tu, su)

    def _params(self) -> str:
        extra = ""
        if self.tape_units != 1 or self.state_units != 1:
            extra = f", tape_units={self.tape_units}, state_units={self.state_units}"
        return f"units={self.units}{extra}"

    @property
    def cost(self) -> int:
        """Forward evaluations, ``advances + recorded`` (without generating the actions)."""
        if self._table is None:
            return self.n_steps
        return self._table.lookup(self.n_steps, self._u)[0]

    def __iter__(self) -> Iterator[Action]:
        n, su, tu = self.n_steps, self._su, self._tu
        if n == 0:
            return
        table = self._table
        free = list(range(self._u // su - 1, -1, -1))  # pop() hands out slot 0 first
        # A frame (a, m, c, slot): reverse steps a .. a+m-1 with c free units; x_a is held in
        # `slot`, or slot = -1: x_a is the current state and is not stored.
        stack = [(0, n, self._u, -1)]
        current = 0  # index of the current state, -1 when undefined
        while stack:
            a, m, c, slot = stack.pop()
            while True:
                if m <= 1 or (m - 1) * tu <= c:  # a leaf: tape all but the last step
                    if slot >= 0:
                        if current != a:
                            yield Restore(slot, a)
                        yield Free(slot, a)
                        free.append(slot)
                    if m >= 2:
                        yield Record(a, a + m - 1)
                    for i in range(a + m - 1, a - 1, -1):
                        yield Reverse(i)
                    current = -1
                    break
                assert table is not None  # built whenever the first frame is not a leaf
                k = table.split[c][m]
                if slot < 0:
                    slot = free.pop()
                    yield Store(slot, a)
                elif current != a:
                    yield Restore(slot, a)
                yield Advance(a, a + k)
                current = a + k
                stack.append((a, k, c, slot))  # the left part, from x_a held in `slot`
                a, m, c, slot = a + k, m - k, c - su, -1  # the right part, from x_{a+k}


def mixed(n_steps: int, units: int, *, tape_units: int = 1, state_units: int = 1) -> Mixed:
    """The optimal mixed (snapshot-or-tape) schedule; see :class:`Mixed`."""
    return Mixed(n_steps, units, tape_units=tape_units, state_units=state_units)


def peak_units(
    schedule: Iterable[Action],
    state_units: int = 1,
    tape_units: int = 1,
    *,
    n_steps: int | None = None,
) -> int:
    """Most storage held at once: ``state_units * snapshots + tape_units * kept tapes``.

    Walks the schedule through :func:`~deepsolve.schedules.check` (so it is validated too,
    against its own slot limits) while tracking the weighted storage. With unit sizes 1 this is
    ``stats(schedule).peak_storage``.
    """
    su = _positive_int("state_units", state_units, 0)
    tu = _positive_int("tape_units", tape_units, 0)
    held: dict[tuple[int, int], int] = {}
    kept: set[int] = set()
    peak = 0

    def tap() -> Iterator[Action]:
        nonlocal peak
        for action in schedule:
            yield action  # check() validates it before asking for the next one
            if type(action) is Record:
                kept.update(range(action.start, action.stop))
            elif type(action) is Reverse:
                kept.discard(action.index)
            elif type(action) is Store:
                held[(action.level, action.slot)] = action.index
            elif type(action) is Free:
                held.pop((action.level, action.slot), None)
            used = su * len(held) + tu * len(kept)
            if used > peak:
                peak = used

    if n_steps is None:
        n_steps = getattr(schedule, "n_steps", None)
    check(tap(), n_steps=n_steps, slots=getattr(schedule, "slots", None))
    return peak
