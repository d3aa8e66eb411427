"""Cost-aware two-level checkpointing: fast slots (free I/O) and slow slots (paid I/O).

The problem solved optimally by H-Revolve (Herrmann & Pallez, "H-Revolve: a framework for
adjoint computation on synchronous hierarchical platforms", ACM TOMS 46(2), 2020) for two
storage levels, the setting of Aupy, Herrmann, Hovland & Robert, "Optimal multistage algorithm
for adjoint computation", SIAM J. Sci. Comput. 38(3), 2016. The dynamic program below is our
own formulation and implementation.

Model
-----
Level 0 holds ``fast_slots`` snapshots (device memory: writes and reads are free), level 1
holds ``slow_slots`` (host RAM or disk: each ``Store`` at level 1 costs ``write_cost``, each
``Restore`` from level 1 costs ``read_cost``). Both counts include ``x_0`` wherever it is
stored; ``x_0`` starts as the current state, in no slot (storing it in a slow slot costs a
write). The working state and the step being recorded come on top. The cost minimised is the
makespan::

    forward_cost * (advances + recorded) + backward_cost * n
        + write_cost * (level-1 stores) + read_cost * (level-1 restores)

which :func:`makespan` computes from any schedule's :func:`~deepsolve.schedules.stats`.
This equals H-Revolve's cost with ``u_f = forward_cost`` and ``u_b = forward_cost +
backward_cost`` on a chain of ``l = n - 1`` (H-Revolve's backward step includes the
recording forward step of the step it reverses).

Dynamic program
---------------
``M(m) = F (t(m, c0) + m) + B m`` is a fast-only revolve over ``m`` steps with its base in a
fast slot (``t`` = :func:`~deepsolve.schedules.optimal_cost`). ``D_s(m)`` reverses ``m`` steps
whose base ``x_a`` is in a slow slot, ``s`` further slow slots free, every fast slot free and
``x_a`` the current state::

    D_s(m) = min( M(m),                                   # copy x_a to fast, fast revolve
                  min_{1<=k<m} k F + R_s(m - k) + r + D_s(k) )
    R_0(j) = M(j),   R_s(j) = min(M(j), w + D_{s-1}(j))   # right part: fast or slow base

(advance ``k`` steps, store ``x_{a+k}`` in a fast or a slow slot, reverse the right part, read
``x_a`` back, reverse the left part). The optimum is ``M(n)`` (``x_0`` fast) or
``w + D_{c1-1}(n)`` (``x_0`` slow). An exhaustive search over *all* schedules (tests: every instance
of up to 9 steps tried) confirms that this hierarchical form, slow snapshots outside, fast
ones inside, loses nothing.

Speed: for fixed ``m`` the term ``A(k) + R(m - k)`` with ``A(k) = k F + r + D_s(k)`` can only
reach its minimum at ``k = 1``, ``k = m - 1``, a convex kink of ``A`` or a mirrored convex kink
of ``R`` (its smallest minimiser is always one of those points). Only those candidates are
evaluated, in exact integer arithmetic (costs are scaled to integers), so the minimum is the
exact one. Tables are ``O(n x slow_slots)``; ``n = 5000`` with 5 + 20 slots plans in
1.3-1.7 s, ``n = 1000`` in 0.1-0.15 s (one core of a shared machine).
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from fractions import Fraction
from functools import lru_cache

from .actions import Action, Advance, Free, Invert, Record, Restore, Reverse, Store
from .base import Schedule
from .check import stats
from .cost import optimal_cost
from .revolve import Revolve

__all__ = ["TwoLevel", "two_level", "two_level_cost", "makespan"]

FAST = 0
SLOW = 1


# --- arguments ------------------------------------------------------------------------------

def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _cost(name: str, value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number >= 0, got {value!r}")
    if isinstance(value, numbers.Rational):
        q = Fraction(value)
    else:
        x = float(value)
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {value!r}")
        q = Fraction(x)
    if q < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return q


def _costs(write_cost, read_cost, forward_cost, backward_cost) -> tuple[Fraction, ...]:
    return (
        _cost("forward_cost", forward_cost),
        _cost("backward_cost", backward_cost),
        _cost("write_cost", write_cost),
        _cost("read_cost", read_cost),
    )


# --- the dynamic program --------------------------------------------------------------------

class _Plan:
    """The tables of the dynamic program for one ``(n, c0, c1, costs)``, in scaled integers.

    ``scale * cost`` is an integer for each of the four costs, so every table entry is an
    exact integer and ``value / scale`` the makespan.
    """

    def __init__(self, n: int, c0: int, c1: int, costs: tuple[Fraction, ...]):
        scale = 1
        for q in costs:
            scale = scale * q.denominator // math.gcd(scale, q.denominator)
        f, b, w, r = (int(q * scale) for q in costs)
        self.scale = scale
        self.w = w
        # M[m]: fast-only revolve over m steps (base x_a stored in a free fast slot)
        self.M = M = [0] * (n + 1)
        for m in range(1, n + 1):
            M[m] = f * (optimal_cost(m, c0) + m) + b * m
        self.D: list[list[int]] = []  # D[s][m]
        self.arg: list[list[int]] = []  # first split k, 0 for "fast-only"
        rows = min(c1, n)
        for s in range(rows):
            if s == 0:
                R = M
            else:
                prev = self.D[s - 1]
                R = [min(M[j], w + prev[j]) for j in range(n + 1)]
            D, arg = _row(n, f, r, M, R)
            if s and D == self.D[s - 1]:
                break  # saturated: every further row would be identical
            self.D.append(D)
            self.arg.append(arg)
        best = M[n]
        self.slow_top = False
        if c1 >= 1 and n >= 2 and self.D:
            alt = w + self.row(c1 - 1)[n]
            if alt < best:
                best, self.slow_top = alt, True
        self.value = best

    def row(self, s: int) -> list[int]:
        return self.D[min(s, len(self.D) - 1)]

    def split(self, s: int, m: int) -> int:
        return self.arg[min(s, len(self.arg) - 1)][m]

    def right_is_fast(self, s: int, j: int) -> bool:
        """Whether a right part of ``j`` steps takes a fast base (ties go to fast)."""
        return s == 0 or self.M[j] <= self.w + self.row(s - 1)[j]

    @property
    def makespan(self) -> float:
        return float(Fraction(self.value, self.scale))


def _convex_kinks(g: list[int]) -> list[int]:
    """Indices ``j >= 2`` where ``g`` bends upwards: ``g[j+1] - g[j] > g[j] - g[j-1]``."""
    return [j for j in range(2, len(g) - 1) if g[j + 1] - g[j] > g[j] - g[j - 1]]


def _row(n: int, f: int, r: int, M: list[int], R: list[int]) -> tuple[list[int], list[int]]:
    """``D_s(m)`` for ``m = 0..n`` and its first split, given the right-part costs ``R``.

    ``D(m) = min(M(m), min_k A(k) + R(m-k))`` with ``A(k) = k f + r + D(k)``. Between two
    consecutive points that are neither an end (``k = 1``, ``k = m-1``), a convex kink of
    ``A`` at ``k`` nor a convex kink of ``R`` at ``m - k``, the sum bends only downwards or
    not at all, so its minimum over ``1..m-1`` is at one of those points.
    """
    D = [0] * (n + 1)
    A = [0] * (n + 1)
    arg = [0] * (n + 1)
    CR = _convex_kinks(R)
    CA: list[int] = []  # convex kinks of D (hence of A), found as D grows
    if n >= 1:
        D[1] = M[1]
        A[1] = f + r + M[1]
    for m in range(2, n + 1):
        best, bk = M[m], 0
        v = A[1] + R[m - 1]
        if v < best:
            best, bk = v, 1
        v = A[m - 1] + R[1]
        if v < best:
            best, bk = v, m - 1
        if CA:
            vals = [A[k] + R[m - k] for k in CA]
            v = min(vals)
            if v < best:
                best, bk = v, CA[vals.index(v)]
        hi = bisect_left(CR, m)
        if hi:
            js = CR[:hi]
            vals = [A[m - j] + R[j] for j in js]
            v = min(vals)
            if v < best:
                best, bk = v, m - js[vals.index(v)]
        D[m] = best
        A[m] = m * f + r + best
        arg[m] = bk
        k = m - 1
        if k >= 2 and best - D[k] > D[k] - D[k - 1]:
            CA.append(k)
    return D, arg


@lru_cache(maxsize=16)
def _plan(n: int, c0: int, c1: int, costs: tuple[Fraction, ...]) -> _Plan:
    return _Plan(n, c0, c1, costs)


def two_level_cost(
    n_steps: int,
    fast_slots: int,
    slow_slots: int,
    *,
    write_cost: float,
    read_cost: float,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
) -> float:
    """The optimal makespan of :func:`two_level` without generating its actions (cached).

    Equals ``makespan(two_level(...), ...)``; see the module docstring for the model.
    """
    n = _count("n_steps", n_steps, 0)
    c0 = _count("fast_slots", fast_slots, 1)
    c1 = _count("slow_slots", slow_slots, 0)
    costs = _costs(write_cost, read_cost, forward_cost, backward_cost)
    return _plan(n, c0, c1, costs).makespan


# --- the schedule ---------------------------------------------------------------------------

def _shifted(actions: Iterable[Action], a: int) -> Iterator[Action]:
    """``actions`` of a chain starting at ``x_0``, moved to start at ``x_a`` (fast level)."""
    if a == 0:
        yield from actions
        return
    for act in actions:
        if type(act) is Advance:
            yield Advance(act.start + a, act.stop + a)
        elif type(act) is Reverse:
            yield Reverse(act.index + a)
        else:  # Store, Restore, Free (revolve records nothing ahead, inverts nothing)
            assert type(act) is not Record and type(act) is not Invert
            yield type(act)(act.slot, act.index + a, act.level)


class TwoLevel(Schedule):
    """Optimal two-level schedule: ``fast_slots`` free-I/O slots, ``slow_slots`` paid ones.

    Minimises the makespan (see :func:`makespan`) by the dynamic program of the module
    docstring. Slow snapshots are taken outermost (``x_0`` among them when that pays); each
    innermost segment copies its base into a fast slot and is reversed by a fast-only
    :class:`~deepsolve.schedules.Revolve`. With ``slow_slots = 0``, or when I/O is too dear
    to pay off, it is exactly ``revolve(n_steps, fast_slots)``.

    Attributes:
        cost: the predicted optimal makespan (``== makespan(self, ...)``).
        uses_slow: whether ``x_0`` goes to a slow slot (otherwise no slow slot is used).

    Planning builds ``O(n_steps x slow_slots)`` tables once (cached); iteration then streams
    the actions from an explicit stack of at most ``2 slow_slots`` frames.
    """

    kind = "two_level"

    def __init__(
        self,
        n_steps: int,
        fast_slots: int,
        slow_slots: int,
        *,
        write_cost: float,
        read_cost: float,
        forward_cost: float = 1.0,
        backward_cost: float = 1.0,
    ):
        self.n_steps = _count("n_steps", n_steps, 0)
        self.fast_slots = _count("fast_slots", fast_slots, 1)
        self.slow_slots = _count("slow_slots", slow_slots, 0)
        costs = _costs(write_cost, read_cost, forward_cost, backward_cost)
        self.write_cost, self.read_cost = write_cost, read_cost
        self.forward_cost, self.backward_cost = forward_cost, backward_cost
        self.slots = {FAST: self.fast_slots, SLOW: self.slow_slots}
        self._plan = _plan(self.n_steps, self.fast_slots, self.slow_slots, costs)
        self.cost = self._plan.makespan
        self.uses_slow = self._plan.slow_top

    def _params(self) -> str:
        return (f"fast_slots={self.fast_slots}, slow_slots={self.slow_slots}, "
                f"write_cost={self.write_cost}, read_cost={self.read_cost}, "
                f"forward_cost={self.forward_cost}, backward_cost={self.backward_cost}")

    def __iter__(self) -> Iterator[Action]:
        n, c0, plan = self.n_steps, self.fast_slots, self._plan
        if n == 0:
            return
        if not plan.slow_top:
            yield from Revolve(n, c0)
            return
        free = list(range(self.slow_slots - 1, 0, -1))  # slow slot 0 holds x_0
        yield Store(0, 0, SLOW)
        # A frame (a, m, s, slot): reverse steps a .. a+m-1; x_a is in slow `slot`; s more
        # slow slots are free; every fast slot is free.
        stack = [(0, n, self.slow_slots - 1, 0)]
        current = 0  # index of the current state, -1 when undefined
        while stack:
            a, m, s, slot = stack.pop()
            if current != a:
                yield Restore(slot, a, SLOW)
                current = a
            k = plan.split(s, m)
            if k == 0:  # copy x_a to fast memory and reverse the segment there
                yield Free(slot, a, SLOW)
                free.append(slot)
                yield from _shifted(Revolve(m, c0), a)
                current = -1
                continue
            yield Advance(a, a + k)
            stack.append((a, k, s, slot))  # the left part, after the right one
            j = m - k
            if plan.right_is_fast(s, j):
                yield from _shifted(Revolve(j, c0), a + k)
                current = -1
            else:
                sl = free.pop()
                yield Store(sl, a + k, SLOW)
                stack.append((a + k, j, s - 1, sl))
                current = a + k


def two_level(
    n_steps: int,
    fast_slots: int,
    slow_slots: int,
    *,
    write_cost: float,
    read_cost: float,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
) -> TwoLevel:
    """The optimal cost-aware two-level schedule; see :class:`TwoLevel`."""
    return TwoLevel(n_steps, fast_slots, slow_slots, write_cost=write_cost,
                    read_cost=read_cost, forward_cost=forward_cost,
                    backward_cost=backward_cost)


def makespan(
    schedule: Iterable[Action],
    write_cost: float,
    read_cost: float,
    forward_cost: float = 1,
    backward_cost: float = 1,
    *,
    n_steps: int | None = None,
) -> float:
    """The makespan of any schedule, from its :func:`~deepsolve.schedules.stats`::

        forward_cost * (advances + recorded) + backward_cost * n_steps
            + write_cost * stores[1] + read_cost * restores[1]

    Level-0 stores and restores are free; a schedule using a level above 1 is rejected.
    Recorded steps kept as tapes cost nothing beyond their forward step. Computed exactly
    (in fractions) and returned as a float, so it equals :func:`two_level_cost` bit for bit.
    """
    f, b, w, r = _costs(write_cost, read_cost, forward_cost, backward_cost)
    st = stats(schedule, n_steps=n_steps)
    for counts in (st.stores, st.restores):
        extra = sorted(lv for lv, c in counts.by_level.items() if c and lv not in (FAST, SLOW))
        if extra:
            raise ValueError(f"makespan() knows storage levels 0 and 1, not {extra}")
    total = (f * (st.advances + st.recorded) + b * st.n_steps
             + w * st.stores[SLOW] + r * st.restores[SLOW])
    return float(total)

