"""deepsolve.schedules.two_level: anchors, validity, optimality, reductions, makespan."""

from __future__ import annotations

import heapq
import math
import random
from fractions import Fraction

import pytest

from deepsolve.schedules import (
    Advance,
    Free,
    Record,
    Restore,
    Reverse,
    ScheduleError,
    Store,
    check,
    optimal_cost,
    revolve,
    stats,
    store_all,
)
from deepsolve.schedules.two_level import TwoLevel, makespan, two_level, two_level_cost


def revolve_makespan(n: int, c: int, f=1, b=1) -> float:
    """Fast-only revolve: every step recorded once, ``t(n, c)`` advances, free I/O."""
    return f * (optimal_cost(n, c) + n) + b * n if n else 0


def checked(n, c0, c1, w, r, f=1, b=1):
    """Build, validate against every level's limit, and return (schedule, stats)."""
    s = two_level(n, c0, c1, write_cost=w, read_cost=r, forward_cost=f, backward_cost=b)
    assert s.slots == {0: c0, 1: c1}
    st = check(s)  # the schedule's own limits, per level
    assert st.peak_slots[0] <= c0, (n, c0, c1, st.peak_slots)
    assert st.peak_slots[1] <= c1, (n, c0, c1, st.peak_slots)
    assert st.peak_tapes == 0
    assert st.recorded == n
    return s, st


# --- anchors (H-Revolve's optimum + n: its backward step includes the recording step) -------

@pytest.mark.parametrize(
    ("n", "c0", "c1", "io", "expected"),
    [(500, 5, 20, 2, 2416), (500, 3, 10, 10, 3230)],
)
def test_anchors(n, c0, c1, io, expected):
    assert two_level_cost(n, c0, c1, write_cost=io, read_cost=io) == expected
    s, st = checked(n, c0, c1, io, io)
    assert s.cost == expected == makespan(s, io, io)
    assert s.uses_slow and st.stores[1] > 0
    assert st.peak_slots[0] == c0 and st.peak_slots[1] == c1


def test_anchor_breakdown():
    s, st = checked(500, 5, 20, 2, 2)
    assert st.advances + st.recorded + 500 + 2 * st.stores[1] + 2 * st.restores[1] == 2416


# --- validity and the makespan equality on a grid --------------------------------------------

COSTS = [(2, 2, 1, 1), (0, 0, 1, 1), (5, 1, 1, 2), (1, 7, 2, 1), (30, 30, 1, 1)]


@pytest.mark.parametrize(("w", "r", "f", "b"), COSTS)
def test_grid_valid_and_makespan_equals_prediction(w, r, f, b):
    for n in range(0, 26):
        for c0 in range(1, 5):
            for c1 in range(0, 5):
                s, st = checked(n, c0, c1, w, r, f, b)
                predicted = two_level_cost(n, c0, c1, write_cost=w, read_cost=r,
                                           forward_cost=f, backward_cost=b)
                assert s.cost == predicted == makespan(s, w, r, f, b), (n, c0, c1)
                # never worse than fast-only revolve, never better than free I/O
                assert predicted <= revolve_makespan(n, c0, f, b)
                assert predicted >= revolve_makespan(n, c0 + c1, f, b)


def test_larger_random_instances():
    rng = random.Random(7)
    for _ in range(12):
        n = rng.randint(50, 700)
        c0, c1 = rng.randint(1, 6), rng.randint(0, 12)
        w, r = rng.choice([0, 1, 2, 5, 20]), rng.choice([0, 1, 2, 5, 20])
        f, b = rng.choice([1, 2]), rng.choice([0, 1, 3])
        s, _ = checked(n, c0, c1, w, r, f, b)
        assert s.cost == makespan(s, w, r, f, b), (n, c0, c1, w, r, f, b)


def test_fractional_costs_exact():
    w, r, f, b = 0.1, 0.3, 1.5, 0.7
    for n, c0, c1 in [(40, 2, 3), (123, 3, 6), (300, 4, 9)]:
        s, _ = checked(n, c0, c1, w, r, f, b)
        assert s.cost == makespan(s, w, r, f, b)
    # Fractions are accepted too
    s, _ = checked(60, 2, 4, Fraction(1, 3), Fraction(2, 3))
    assert s.cost == makespan(s, Fraction(1, 3), Fraction(2, 3))


def test_slot_limits_bite():
    """The checker enforces each level's limit: one slow slot fewer must fail."""
    s, st = checked(200, 3, 6, 1, 1)
    assert st.peak_slots[1] == 6
    with pytest.raises(ScheduleError):
        check(s, slots={0: 3, 1: 5})
    with pytest.raises(ScheduleError):
        check(s, slots={0: 2, 1: 6})


def test_slow_slots_freed_and_peak_total():
    for n, c0, c1 in [(100, 2, 5), (333, 4, 8), (64, 1, 7)]:
        s, st = checked(n, c0, c1, 1, 1)
        assert st.frees[1] == st.stores[1]  # check() also rejects a slot left full
        assert st.peak_slots_total <= c0 + c1


def test_lazy_and_reiterable():
    s = two_level(3000, 4, 12, write_cost=3, read_cost=3)
    it = iter(s)
    assert iter(it) is it
    first = [next(it) for _ in range(50)]
    assert first == [a for _, a in zip(range(50), s, strict=False)]
    assert isinstance(s, TwoLevel) and repr(s).startswith("two_level(n_steps=3000")


def test_long_chain_no_recursion():
    s, st = checked(3000, 3, 30, 2, 2)
    assert s.cost == makespan(s, 2, 2)


# --- optimality against an exhaustive search over all schedules ------------------------------

def brute_force(n, c0, c1, w, r, f, b):
    """Dijkstra over every schedule: Advance by one step, Store/Restore/Free, Reverse.

    A state is (current, adjoint, fast snapshots, slow snapshots); snapshots at or beyond the
    adjoint are dropped (they can never be useful). Slot counts include x_0; x_0 starts as the
    current state, in no slot.
    """
    start = (0, n, frozenset(), frozenset())
    dist = {start: 0}
    heap = [(0, 0, start)]
    tick = 0
    while heap:
        d, _, state = heapq.heappop(heap)
        if d > dist[state]:
            continue
        cur, j, fast, slow = state
        if j == 0:
            return d
        moves = []
        if 0 <= cur < j - 1:
            moves.append((f, (cur + 1, j, fast, slow)))
        if cur == j - 1:  # record step j-1 and reverse it
            jj = j - 1
            moves.append((f + b, (-1, jj, frozenset(i for i in fast if i < jj),
                                  frozenset(i for i in slow if i < jj))))
        if cur >= 0:
            if len(fast) < c0 and cur not in fast:
                moves.append((0, (cur, j, fast | {cur}, slow)))
            if len(slow) < c1 and cur not in slow:
                moves.append((w, (cur, j, fast, slow | {cur})))
        for i in fast:
            moves.append((0, (i, j, fast, slow)))
            moves.append((0, (cur, j, fast - {i}, slow)))
        for i in slow:
            moves.append((r, (i, j, fast, slow)))
            moves.append((0, (cur, j, fast, slow - {i})))
        for c, nxt in moves:
            nd = d + c
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                tick += 1
                heapq.heappush(heap, (nd, tick, nxt))
    raise AssertionError("no schedule found")


@pytest.mark.parametrize(("w", "r", "f", "b"), [(2, 2, 1, 1), (1, 6, 1, 2), (7, 1, 2, 1)])
def test_optimal_against_exhaustive_search(w, r, f, b):
    for n in range(1, 8):
        for c0 in range(1, 4):
            for c1 in range(0, 3):
                best = brute_force(n, c0, c1, w, r, f, b)
                got = two_level_cost(n, c0, c1, write_cost=w, read_cost=r,
                                     forward_cost=f, backward_cost=b)
                assert got == best, (n, c0, c1, got, best)


def test_optimal_against_exhaustive_search_more_slow_slots():
    for n, c0, c1, w, r in [(8, 1, 3, 1, 1), (8, 2, 3, 2, 3), (9, 1, 2, 1, 2)]:
        best = brute_force(n, c0, c1, w, r, 1, 1)
        assert two_level_cost(n, c0, c1, write_cost=w, read_cost=r) == best


# --- reductions ------------------------------------------------------------------------------

def test_no_slow_slots_is_revolve():
    for n in [*range(0, 61), 100, 500]:
        for c0 in range(1, 9):
            s = two_level(n, c0, 0, write_cost=3, read_cost=3)
            st = stats(s)
            assert st.advances == optimal_cost(n, c0), (n, c0)
            assert st.stores[1] == 0 and not s.uses_slow
            assert s.cost == revolve_makespan(n, c0)
    assert list(two_level(77, 4, 0, write_cost=1, read_cost=1)) == list(revolve(77, 4))


@pytest.mark.parametrize("io", [10**6, 1e9])
def test_expensive_io_falls_back_to_revolve(io):
    for n, c0, c1 in [(10, 2, 3), (100, 3, 10), (500, 5, 20), (1000, 2, 30)]:
        s = two_level(n, c0, c1, write_cost=io, read_cost=io)
        assert s.cost == makespan(s, io, io) == revolve_makespan(n, c0)
        assert not s.uses_slow and stats(s).stores[1] == 0
        assert list(s) == list(revolve(n, c0))


def test_free_io_matches_revolve_with_all_slots():
    for n in [1, 2, 3, 10, 57, 200, 600]:
        for c0, c1 in [(1, 1), (2, 3), (3, 10), (5, 20)]:
            for f, b in [(1, 1), (2, 3)]:
                got = two_level_cost(n, c0, c1, write_cost=0, read_cost=0,
                                     forward_cost=f, backward_cost=b)
                assert got <= revolve_makespan(n, c0 + c1, f, b)
                assert got == revolve_makespan(n, c0 + c1, f, b)  # and no better


def test_more_slots_never_hurt():
    for n in (30, 150):
        costs = {(c0, c1): two_level_cost(n, c0, c1, write_cost=3, read_cost=4)
                 for c0 in range(1, 5) for c1 in range(0, 6)}
        for (c0, c1), v in costs.items():
            if c1 + 1 <= 5:
                assert costs[c0, c1 + 1] <= v
            if c0 + 1 <= 4:
                assert costs[c0 + 1, c1] <= v


def test_small_cases():
    assert two_level_cost(0, 1, 5, write_cost=1, read_cost=1) == 0
    assert list(two_level(0, 1, 5, write_cost=1, read_cost=1)) == []
    assert two_level_cost(1, 1, 5, write_cost=1, read_cost=1, backward_cost=2) == 3
    assert list(two_level(1, 1, 5, write_cost=1, read_cost=1)) == [Reverse(0)]


def test_hand_example_uses_slow_level():
    """n=5, one fast and one slow slot, unit costs: x_0 goes slow, x_2 fast (18 < 20)."""
    s, st = checked(5, 1, 1, 1, 1)
    assert s.uses_slow
    assert list(s) == [
        Store(0, 0, 1), Advance(0, 2), Store(0, 2, 0), Advance(2, 4), Reverse(4),
        Restore(0, 2, 0), Advance(2, 3), Reverse(3), Restore(0, 2, 0), Reverse(2),
        Free(0, 2, 0), Restore(0, 0, 1), Free(0, 0, 1), Store(0, 0, 0), Advance(0, 1),
        Reverse(1), Restore(0, 0, 0), Reverse(0), Free(0, 0, 0),
    ]
    # 6 advances + 5 recorded + 5 backward + 1 write + 1 read; fast-only revolve costs 20
    assert s.cost == makespan(s, 1, 1) == brute_force(5, 1, 1, 1, 1, 1, 1) == 18
    assert revolve_makespan(5, 1) == 20


# --- makespan on other schedules -------------------------------------------------------------

def test_makespan_of_other_schedules():
    st = stats(revolve(100, 10))
    assert makespan(revolve(100, 10), 5, 5) == st.advances + 100 + 100
    assert makespan(store_all(20), 9, 9, forward_cost=2, backward_cost=3) == 2 * 20 + 3 * 20
    plain = [Store(0, 0, 1), Record(0, 2), Reverse(1), Reverse(0), Free(0, 0, 1)]
    assert makespan(plain, 4, 9, n_steps=2) == 2 + 2 + 4
    reread = [Store(0, 0, 1), Advance(0, 1), Reverse(1), Restore(0, 0, 1), Reverse(0),
              Free(0, 0, 1)]
    assert makespan(reread, 4, 9, 2, 1, n_steps=2) == 2 * 3 + 2 + 4 + 9
    with pytest.raises(ValueError, match="levels 0 and 1"):
        makespan([Store(0, 0, 2), Reverse(0), Free(0, 0, 2)], 1, 1, n_steps=1)


# --- argument checking -----------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_steps=-1),
        dict(n_steps=2.0),
        dict(n_steps=True),
        dict(fast_slots=0),
        dict(fast_slots=-2),
        dict(slow_slots=-1),
        dict(slow_slots=1.5),
        dict(write_cost=-1),
        dict(read_cost=-0.5),
        dict(forward_cost=-1),
        dict(backward_cost=-1),
        dict(write_cost=math.nan),
        dict(read_cost=math.inf),
        dict(write_cost="1"),
        dict(read_cost=True),
    ],
)
def test_bad_arguments(kwargs):
    args = dict(n_steps=10, fast_slots=2, slow_slots=3, write_cost=1, read_cost=1)
    args.update(kwargs)
    n, c0, c1 = args.pop("n_steps"), args.pop("fast_slots"), args.pop("slow_slots")
    with pytest.raises(ValueError):
        two_level(n, c0, c1, **args)
    with pytest.raises(ValueError):
        two_level_cost(n, c0, c1, **args)


def test_makespan_bad_costs():
    with pytest.raises(ValueError):
        makespan(revolve(5, 2), -1, 1)
    with pytest.raises(ValueError):
        makespan(revolve(5, 2), 1, 1, forward_cost=-1)


# --- cross-check with the peer library's H-Revolve table -------------------------------------

def test_matches_peer_hrevolve_table():
    """H-Revolve's optimum for l = n-1 with u_f = F, u_b = F + B equals ours.

    Only the peer's cost table is compared (its schedule generator is not used); the peer
    is an optional, LGPL test oracle.
    """
    hr = pytest.importorskip("checkpoint_schedules.hrevolve_sequences.hrevolve")
    rng = random.Random(11)
    for _ in range(40):
        n = rng.randint(2, 60)
        c0, c1 = rng.randint(1, 4), rng.randint(0, 5)
        w, r = rng.randint(0, 12), rng.randint(0, 12)
        f, b = rng.randint(1, 3), rng.randint(0, 3)
        # the peer's signature is (lmax, cvect, wvect, rvect, ub, uf)
        _, opt = hr.get_hopt_table(n - 1, (c0, c1), (0, w), (0, r), f + b, f)
        ours = two_level_cost(n, c0, c1, write_cost=w, read_cost=r,
                              forward_cost=f, backward_cost=b)
        assert ours == opt[1][n - 1][c1], (n, c0, c1, w, r, f, b)
