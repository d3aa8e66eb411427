"""deepsolve.schedules: optimality, validity, laziness, edge cases, the checker's errors."""

from __future__ import annotations

import random
import sys
import tracemalloc
from functools import lru_cache

import pytest

from deepsolve import schedules as S
from deepsolve.schedules.actions import Advance, Free, Record, Restore, Reverse, Store
from deepsolve.schedules.cost import split

sys.setrecursionlimit(20000)


# --- independent brute force: the recursive dynamic program of Griewank (1992) -----------

@lru_cache(None)
def brute_cost(m: int, c: int) -> int:
    """Minimal unrecorded steps, by exhaustive search over the first snapshot position."""
    if m <= 1:
        return 0
    if c == 1:
        return m * (m - 1) // 2
    return min(k + brute_cost(m - k, c - 1) + brute_cost(k, c) for k in range(1, m))


@lru_cache(None)
def brute_writes(m: int, c: int) -> int:
    """Fewest snapshot writes (base excluded) among schedules that are optimal in steps."""
    if m <= 1 or c == 1:
        return 0
    best = None
    for k in range(1, m):
        if k + brute_cost(m - k, c - 1) + brute_cost(k, c) == brute_cost(m, c):
            w = (m - k >= 2) + brute_writes(m - k, c - 1) + brute_writes(k, c)
            best = w if best is None else min(best, w)
    return best


def test_sanity_values():
    assert S.optimal_cost(10, 2) == 20
    assert S.optimal_cost(100, 5) == 316
    assert S.optimal_cost(1000, 10) == 3636
    assert S.optimal_cost(10000, 20) == 37976


def test_closed_form_equals_brute_force():
    for m in range(0, 90):
        for c in range(1, 11):
            assert S.optimal_cost(m, c) == brute_cost(m, c), (m, c)


def test_split_is_optimal_in_steps_and_writes():
    for m in range(2, 90):
        for c in range(2, 11):
            k = split(m, c)
            assert 1 <= k < m
            assert k + brute_cost(m - k, c - 1) + brute_cost(k, c) == brute_cost(m, c), (m, c)
            got = (m - k >= 2) + brute_writes(m - k, c - 1) + brute_writes(k, c)
            assert got == brute_writes(m, c), (m, c)


def test_revolve_optimal_on_full_grid():
    """Every n <= 300 and s <= 25: valid, optimal, s slots, every step recorded once."""
    for n in range(0, 301):
        for s in range(1, 26):
            st = S.check(S.revolve(n, s))
            assert st.advances == S.optimal_cost(n, s), (n, s)
            assert st.recorded == n
            assert int(st.peak_slots) <= s
            assert st.peak_tapes == 0


def test_revolve_writes_equal_brute_force_minimum():
    for n in range(2, 90, 3):
        for s in range(2, 11):
            # +1: the store of x_0 itself
            assert int(S.stats(S.revolve(n, s)).stores) == brute_writes(n, s) + 1, (n, s)


def test_revolve_random_large():
    rng = random.Random(1234)
    cases = [(rng.randint(301, 10**5), rng.randint(2, 200)) for _ in range(12)]
    cases += [(10**5, 200), (77777, 3), (10**4, 20)]
    for n, s in cases:
        st = S.check(S.revolve(n, s))
        assert st.advances == S.optimal_cost(n, s), (n, s)
        assert st.recorded == n and int(st.peak_slots) <= s


def test_revolve_uses_all_slots_when_needed():
    st = S.stats(S.revolve(1000, 10))
    assert int(st.peak_slots) == 10


def test_edge_cases():
    assert list(S.revolve(0, 3)) == []
    assert S.check(S.revolve(0, 1)).advances == 0
    assert list(S.revolve(1, 1)) == [Reverse(0)]  # recorded straight from x_0, no store
    st = S.check(S.revolve(5, 1))  # only x_0: quadratic recomputation
    assert st.advances == 4 + 3 + 2 + 1 and int(st.peak_slots) == 1
    for s in (10, 11, 50):  # s >= n: every step advanced once, no recomputation
        st = S.check(S.revolve(10, s))
        assert st.advances == 9 and st.recorded == 10
    with pytest.raises(ValueError, match="snapshots"):
        S.revolve(10, 0)
    with pytest.raises(ValueError, match="n_steps"):
        S.revolve(-1, 3)
    with pytest.raises(ValueError, match="n_steps"):
        S.revolve(2.5, 3)
    with pytest.raises(ValueError, match="snapshots"):
        S.optimal_cost(10, -2)


def test_store_all_and_periodic():
    st = S.check(S.store_all(7))
    assert (st.advances, st.recorded, st.peak_tapes, int(st.peak_slots)) == (0, 7, 7, 0)
    for n in (1, 2, 9, 10, 11, 100, 101):
        for k in (1, 2, 3, 10, 200):
            st = S.check(S.periodic(n, k))
            last = (n - 1) // k * k
            assert st.advances == last, (n, k)
            assert st.recorded == n
            assert int(st.peak_slots) == (n - 1) // k
            assert st.peak_tapes == min(k, n)
    assert S.periodic(100).every == 10
    with pytest.raises(ValueError, match="every"):
        S.periodic(10, 0)


def test_schedules_are_lazy_and_reiterable():
    sched = S.revolve(10**9, 100)  # would never fit as a list
    it = iter(sched)
    first = [next(it) for _ in range(5)]
    assert first[0] == Store(0, 0) and type(first[1]) is Advance
    assert [next(iter(sched)) for _ in range(1)] == [Store(0, 0)]  # re-iteration starts afresh
    tracemalloc.start()
    S.stats(S.revolve(20_000, 50))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 200_000, f"planning 2e4 steps took {peak} bytes"


# --- the checker -----------------------------------------------------------------------

def _bad(actions, n, match, **kw):
    with pytest.raises(S.ScheduleError, match=match):
        S.check(actions, n_steps=n, **kw)


def test_checker_accepts_hand_written_schedule():
    acts = [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0), Advance(0, 1), Reverse(1),
            Restore(0, 0), Free(0, 0), Reverse(0)]
    st = S.check(acts, n_steps=3, slots=1)
    assert st.advances == 3 and st.recorded == 3 and st.restores == 2


def test_checker_errors():
    _bad([Advance(0, 1), Reverse(0)], 2, "next reverse step is 1")
    _bad([Advance(0, 1), Reverse(1), Reverse(0)], 2, "needs x_0 .* holds no state")
    _bad([Store(0, 0), Advance(0, 1), Reverse(1), Restore(1, 0)], 2, "slot 1 .* is empty")
    _bad([Store(0, 0), Store(0, 0)], 2, "already holds x_0")
    _bad([Store(0, 0), Advance(0, 1), Store(1, 1)], 3, "outside level 0's 1 slots", slots=1)
    _bad([Advance(0, 2), Reverse(1)], 2, r"needs x_1 \(or its tape\) but holds x_2")
    _bad([Advance(0, 1), Reverse(1)], 2, r"steps 0..0 never reversed")
    _bad([Store(0, 0), Advance(0, 1), Reverse(1), Restore(0, 0), Reverse(0)], 2,
         "still holding x_0")
    _bad([Record(0, 2), Reverse(1)], 2, r"steps 0..0 never reversed")
    _bad([Store(0, 0), Record(0, 1), Reverse(0), Restore(0, 0), Free(0, 0), Record(0, 1)], 1,
         r"recorded steps never reversed: \[0\]")
    _bad([Record(0, 3)], 3, "keeps 3 recorded steps; the limit is 2", tapes=2)
    _bad([Advance(1, 2)], 2, "needs x_1 as the current state but holds x_0")
    _bad([Advance(0, 5)], 3, "stop <= n_steps=3")
    _bad([Store(0, 1)], 3, "stores x_1 but the current state is x_0")
    _bad([Store(0, 0), Advance(0, 1), Free(0, 1)], 3, "holds x_0, not x_1")
    _bad(["advance"], 1, "is not a schedule action")


def test_checker_catches_a_broken_revolve():
    """Mutating one action of a valid schedule must be caught."""
    acts = list(S.revolve(30, 4))
    for i, a in enumerate(acts):
        if type(a) is Restore:
            broken = acts[:i] + [Restore(a.slot, a.index + 1)] + acts[i + 1:]
            _bad(broken, 30, "holds x_")
            break
    else:  # pragma: no cover
        pytest.fail("no restore in revolve(30, 4)")


def test_level_counts():
    c = S.LevelCounts({0: 3, 1: 4})
    assert c == 7 and c[0] == 3 and c[1] == 4 and c[2] == 0


def test_revolve_tail_counts():
    for n in range(0, 45):
        for s in range(1, 6):
            for m in range(0, n + 1):
                st = S.check(S.revolve_tail(n, s, m))
                expect = 0 if m >= n else S.optimal_cost(n - m + 1 if m else n, s)
                assert st.advances == expect == S.revolve_tail_cost(n, s, m), (n, s, m)
                assert st.recorded == n and int(st.peak_slots) <= s
                assert st.peak_tapes == (m if n else 0)
    with pytest.raises(ValueError, match="tail"):
        S.revolve_tail(10, 2, 11)


def test_repetitions_by_bisection_equal_the_definition():
    """r(n, s) is the smallest r with beta(s, r) >= n; bisection gives it for huge n."""
    for s in (1, 2, 3, 7, 40):
        for n in list(range(0, 200)) + [10**4 + 7, 123457]:
            r = S.repetitions(n, s)
            assert S.beta(s, r) >= n and (r == 0 or S.beta(s, r - 1) < n), (n, s)
    r = S.repetitions(10**12, 2)  # ~1.4e6 repetitions: found at once
    assert S.beta(2, r) >= 10**12 > S.beta(2, r - 1)


def test_summary_of_long_schedules_from_closed_forms(monkeypatch):
    """``plan --steps 1000000000`` counts from closed forms; they equal the streamed counts."""
    from deepsolve.schedules import diagram

    cases = (S.revolve(3000, 7), S.periodic(3001, 40), S.periodic(3000, 40), S.store_all(500))
    streamed = [diagram.summary(c) for c in cases]
    monkeypatch.setattr(diagram, "_MAX_STREAMED", 10)
    closed = [diagram.summary(c) for c in cases]

    def counts(text):
        rows = dict(line.split(None, 1) for line in text.splitlines() if line.strip())
        return [rows[k].split()[0] for k in ("advances", "recorded", "peak")]

    for a, b in zip(streamed, closed, strict=True):
        assert "closed forms" in b and "closed forms" not in a
        assert counts(a) == counts(b)
    monkeypatch.undo()
    text = diagram.summary(S.revolve(10**9, 2))
    assert f"advances         {S.optimal_cost(10**9, 2)}" in text
