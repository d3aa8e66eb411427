"""deepsolve.schedules.mixed: optimality (anchor, exhaustive search, full recurrence, peer),
validity and storage limits, never worse than revolve, laziness, argument errors."""

from __future__ import annotations

import heapq
import importlib
import tracemalloc
import warnings
from functools import lru_cache

import pytest

from deepsolve.schedules import (
    Advance,
    Free,
    Record,
    Restore,
    Reverse,
    Store,
    check,
    optimal_cost,
    revolve,
    stats,
    store_all,
)
from deepsolve.schedules.mixed import Mixed, mixed, mixed_cost, peak_units

mixed_module = importlib.import_module("deepsolve.schedules.mixed")

INF = float("inf")
SIZES = [(1, 1), (2, 1), (1, 2), (3, 2), (2, 3), (5, 1), (1, 4), (4, 6)]  # (tape, state)


def evaluations(schedule) -> int:
    st = stats(schedule)
    return st.advances + st.recorded


def feasible(n: int, units: int, tu: int, su: int) -> bool:
    return n <= 1 or (n - 1) * tu <= units or units >= su


# --- independent references ---------------------------------------------------------------

def exhaustive(n: int, units: int, tu: int, su: int) -> float:
    """Fewest evaluations over *all* action sequences (Dijkstra on interpreter states).

    A state is (current index or -1, snapshot bitmask, tape bitmask, adjoint position); the
    moves are one-step Advance/Record, Store, Restore, Free and Reverse, under the storage limit.
    """
    start = (0, 0, 0, n)
    dist = {start: 0}
    heap = [(0, start)]
    while heap:
        d, state = heapq.heappop(heap)
        if dist[state] < d:
            continue
        cur, snaps, tapes, adj = state
        if adj == 0:
            return d
        moves = []
        if 0 <= cur < n:
            moves.append(((cur + 1, snaps, tapes, adj), 1))  # Advance
            if not tapes >> cur & 1:
                moves.append(((cur + 1, snaps, tapes | 1 << cur, adj), 1))  # Record
            if not snaps >> cur & 1:
                moves.append(((cur, snaps | 1 << cur, tapes, adj), 0))  # Store
        for i in range(n + 1):
            if snaps >> i & 1:
                moves.append(((i, snaps, tapes, adj), 0))  # Restore
                moves.append(((cur, snaps & ~(1 << i), tapes, adj), 0))  # Free
        i = adj - 1
        if tapes >> i & 1:
            moves.append(((-1, snaps, tapes & ~(1 << i), i), 0))  # Reverse with the tape
        elif cur == i:
            moves.append(((-1, snaps, tapes, i), 1))  # Reverse, recording on the fly
        for new, cost in moves:
            if bin(new[1]).count("1") * su + bin(new[2]).count("1") * tu > units:
                continue
            if d + cost < dist.get(new, INF):
                dist[new] = d + cost
                heapq.heappush(heap, (d + cost, new))
    return INF


def full_recurrence(n_max: int, units: int, tu: int, su: int):
    """The fuller program: F (x_a current, not stored) and G (x_a stored), where any sub-chain
    may tape its first step and go on from x_{a+1}, or (G) split like revolve."""

    @lru_cache(None)
    def F(m: int, c: int) -> float:
        if m <= 1:
            return m
        best = INF
        if c >= su:
            best = G(m, c)
        if c >= tu:
            best = min(best, 1 + F(m - 1, c - tu))
        return best

    @lru_cache(None)
    def G(m: int, c: int) -> float:  # x_a held (c >= su)
        if m <= 1:
            return m
        best = 1 + F(m - 1, c - tu) if c >= tu else INF  # free x_a, tape step a
        for k in range(1, m):
            best = min(best, k + G(k, c) + F(m - k, c - su))
        return best

    for c in range(units + 1):  # fill bottom-up (keeps the recursion shallow)
        for m in range(n_max + 1):
            F(m, c)
    return F


# --- the anchor -----------------------------------------------------------------------------

def test_anchor_1000_steps_20_units():
    """Maddison (2024): 2823 forward evaluations at n = 1000 with 20 units, revolve 3747."""
    assert mixed_cost(1000, 20) == 2823
    s = mixed(1000, 20)
    st = check(s)
    assert st.advances + st.recorded == 2823 == s.cost
    assert st.peak_storage <= 20
    assert optimal_cost(1000, 20) + 1000 == 3747 == evaluations(revolve(1000, 20))


# --- optimality -------------------------------------------------------------------------------

@pytest.mark.parametrize(("tu", "su"), [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_dp_equals_exhaustive_search(tu, su):
    for n in range(0, 7):
        for units in range(1, 6):
            best = exhaustive(n, units, tu, su)
            if best == INF:
                assert not feasible(n, units, tu, su)
                with pytest.raises(ValueError):
                    mixed_cost(n, units, tu, su)
            else:
                assert mixed_cost(n, units, tu, su) == best, (n, units, tu, su)
                assert evaluations(mixed(n, units, tape_units=tu, state_units=su)) == best


@pytest.mark.parametrize(("tu", "su"), SIZES)
def test_dp_equals_full_recurrence(tu, su):
    """The leaf-or-split program (with its pruned split search) equals the fuller one."""
    n_max, units = 90, 12
    F = full_recurrence(n_max, units, tu, su)
    for c in range(1, units + 1):
        for m in range(n_max + 1):
            if F(m, c) == INF:
                with pytest.raises(ValueError):
                    mixed_cost(m, c, tu, su)
            else:
                assert mixed_cost(m, c, tu, su) == F(m, c), (m, c, tu, su)


def test_pruned_search_on_larger_rows():
    """Exhaustive split search (no pruning) on a bigger equal-size table."""
    n, units = 400, 9
    cost = [[m for m in range(n + 1)] for _ in range(units + 1)]
    cost[0][2:] = [INF] * (n - 1)  # no storage: only a single step can be reversed
    for c in range(1, units + 1):
        for m in range(c + 2, n + 1):
            cost[c][m] = min(k + cost[c][k] + cost[c - 1][m - k] for k in range(1, m))
    mixed_module._TABLES.clear()
    for c in range(1, units + 1):
        for m in range(n + 1):
            assert mixed_cost(m, c) == cost[c][m], (m, c)


# --- validity and storage ---------------------------------------------------------------------

def test_valid_and_within_budget_equal_sizes():
    cases = [(n, u) for n in range(0, 61) for u in range(1, 13)]
    cases += [(200, 3), (257, 7), (500, 5), (999, 12), (1000, 1000), (300, 299)]
    for n, units in cases:
        s = mixed(n, units)
        st = check(s)  # also the slot limit {0: units}
        assert st.advances + st.recorded == mixed_cost(n, units) == s.cost, (n, units)
        assert st.peak_storage <= units, (n, units, st.peak_storage)
        assert peak_units(s) == st.peak_storage


@pytest.mark.parametrize(("tu", "su"), SIZES[1:])
def test_valid_and_within_budget_unequal_sizes(tu, su):
    for n in range(0, 41):
        for units in range(1, 15):
            if not feasible(n, units, tu, su):
                with pytest.raises(ValueError):
                    mixed(n, units, tape_units=tu, state_units=su)
                continue
            s = mixed(n, units, tape_units=tu, state_units=su)
            used = peak_units(s, state_units=su, tape_units=tu)  # validates via check()
            assert used <= units, (n, units, tu, su, used)
            assert evaluations(s) == mixed_cost(n, units, tu, su), (n, units, tu, su)


def test_peak_units_walker():
    assert peak_units(store_all(5), state_units=3, tape_units=2) == 10  # 5 tapes kept
    assert peak_units(revolve(20, 4), state_units=3, tape_units=2) == 12
    mine = [
        Store(0, 0), Advance(0, 2), Record(2, 4), Reverse(3), Reverse(2),
        Restore(0, 0), Free(0, 0), Record(0, 2), Reverse(1), Reverse(0),
    ]
    assert peak_units(mine, 5, 1, n_steps=4) == 7  # x_0 and two tapes
    assert peak_units(mine, 1, 5, n_steps=4) == 11
    assert peak_units(mine, n_steps=4) == stats(mine, n_steps=4).peak_storage == 3
    with pytest.raises(ValueError):  # the walk validates
        peak_units(mine[:3] + [mine[4], mine[3]] + mine[5:], n_steps=4)


# --- against revolve ------------------------------------------------------------------------

def test_never_worse_than_revolve():
    better = 0
    for su in (1, 2, 3):
        for n in [*range(1, 70), 100, 250, 600]:
            for units in range(su, 31):
                ours = mixed_cost(n, units, 1, su)
                binomial = optimal_cost(n, units // su) + n
                assert ours <= binomial, (n, units, su)
                better += ours < binomial
    assert better > 1000


@pytest.mark.parametrize("su", [1, 2])
def test_equals_revolve_when_tapes_are_large(su):
    for n in [*range(1, 50), 200, 700]:
        for units in range(su, 16):
            tu = units + 1  # a tape is larger than the whole budget
            assert mixed_cost(n, units, tu, su) == optimal_cost(n, units // su) + n
    s = mixed(700, 12, tape_units=50)
    st = check(s)
    assert st.peak_tapes == 0 and st.advances == optimal_cost(700, 12)


# --- the peer library -----------------------------------------------------------------------

def peer_evaluations(n: int, units: int) -> int:
    cs = pytest.importorskip("checkpoint_schedules")
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Numba not available -- using memoization"
        for action in cs.MixedCheckpointSchedule(n, units):
            if isinstance(action, cs.Forward):
                total += len(action)  # recorded (write_adj_deps) or not, one evaluation a step
            elif isinstance(action, cs.EndReverse):
                break
    return total


def test_at_most_peer_equal_sizes():
    pytest.importorskip("checkpoint_schedules")
    diffs = []
    for n in [*range(1, 61), 100, 200, 300]:
        for units in sorted({*range(1, 13), 16, 20, max(n - 1, 1), n, 2 * n}):
            ours, theirs = mixed_cost(n, units), peer_evaluations(n, units)
            assert ours <= theirs, (n, units, ours, theirs)
            if ours != theirs:
                diffs.append((n, units, ours, theirs))
    assert diffs == []  # equal everywhere tested


# --- laziness, caching, API ---------------------------------------------------------------------

def test_lazy_generation():
    s = mixed(3000, 16)  # plans here
    it = iter(s)
    assert next(it) == Store(0, 0)
    assert isinstance(next(it), Advance)
    tracemalloc.start()
    st = stats(s)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert st.advances + st.recorded == mixed_cost(3000, 16)
    assert peak < 200_000  # O(units) live state, nothing like the action list


def test_table_cache_serves_smaller_requests():
    mixed_module._TABLES.clear()
    big = mixed_cost(500, 15)
    table = mixed_module._TABLES[(1, 1)]
    small = [mixed_cost(n, u) for n in (10, 100, 499) for u in (2, 9, 15)]
    assert mixed_module._TABLES[(1, 1)] is table
    mixed_module._TABLES.clear()
    assert mixed_cost(500, 15) == big
    assert small == [mixed_cost(n, u) for n in (10, 100, 499) for u in (2, 9, 15)]
    assert mixed_cost(600, 15) >= big  # grows the cached table, by half at least
    assert mixed_module._TABLES[(1, 1)].n == 750
    # sizes with a common factor plan as the reduced ones
    assert mixed_cost(300, 20, 2, 2) == mixed_cost(300, 10) == mixed_cost(300, 21, 2, 2)


def test_small_and_degenerate_chains():
    assert list(mixed(0, 3)) == []
    assert list(mixed(1, 1)) == [Reverse(0)]
    assert list(mixed(3, 2)) == [Record(0, 2), Reverse(2), Reverse(1), Reverse(0)]  # a leaf
    assert list(mixed(3, 1)) == [
        Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0), Free(0, 0),
        Record(0, 1), Reverse(1), Reverse(0),
    ]
    s = mixed(10, 3, tape_units=2)
    assert s.kind == "mixed" and s.slots == {0: 3} and s.n_steps == 10
    assert repr(s) == "mixed(n_steps=10, units=3, tape_units=2, state_units=1)"
    assert repr(mixed(10, 3)) == "mixed(n_steps=10, units=3)"
    assert isinstance(s, Mixed)


def test_bad_arguments():
    for args, kwargs in [
        ((-1, 3), {}), ((1.5, 3), {}), ((True, 3), {}), ((10, 0), {}), ((10, -2), {}),
        ((10, 2.0), {}), ((10, True), {}), ((10, 3), {"tape_units": 0}),
        ((10, 3), {"state_units": 0}), ((10, 3), {"state_units": 1.5}),
        ((10, 3), {"tape_units": None}),
        ((5, 1), {"tape_units": 2, "state_units": 2}),  # infeasible: no snapshot, too few tapes
        ((5, 3), {"tape_units": 1, "state_units": 4}),
    ]:
        with pytest.raises(ValueError):
            mixed(*args, **kwargs)
        with pytest.raises(ValueError):
            mixed_cost(*args, **kwargs)
    assert mixed_cost(4, 3, tape_units=1, state_units=4) == 4  # taping all but one fits
