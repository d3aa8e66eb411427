"""deepsolve.schedules.online: validity, cost against the offline optimum, the controller."""

from __future__ import annotations

import random
import sys
from functools import lru_cache

import pytest

from deepsolve.schedules import check, optimal_cost, stats
from deepsolve.schedules.actions import Advance, Free, Restore, Reverse, Store
from deepsolve.schedules.cost import beta
from deepsolve.schedules.online import Online, OnlineController, OnlineSchedule, online

SIZES = (3, 5, 10, 20, 50)
N_MAX = 10_000


@lru_cache(None)
def advances(s: int, n_max: int = N_MAX) -> tuple[int, ...]:
    """advances[n] = stats(online(s).for_length(n)).advances (cross-checked below)."""
    return tuple(online(s).advances(n_max))


def worst(s: int, lo: int, hi: int, plus: int) -> float:
    """max over lo <= n <= hi of (advances + plus) / optimal_cost."""
    adv = advances(s)
    return max((adv[n] + plus) / optimal_cost(n, s) for n in range(max(lo, 2), hi + 1))


# --- validity ------------------------------------------------------------------------------

def test_valid_for_every_small_case_and_cost_function_matches():
    """check() passes for all n <= 200, s <= 8, within s slots; advances() is exact."""
    for s in range(1, 9):
        adv = online(s).advances(200)
        for n in range(0, 201):
            st = check(online(s).for_length(n), slots=s)
            assert st.recorded == n
            assert int(st.peak_slots) <= s
            assert st.peak_tapes == 0
            assert st.advances == adv[n], (s, n)


def test_valid_samples_up_to_1e4():
    rng = random.Random(0)
    for s in SIZES:
        ns = {beta(s, 2), beta(s, 2) + 1, N_MAX} | {rng.randrange(2, N_MAX) for _ in range(2)}
        if beta(s, 3) < N_MAX:
            ns |= {beta(s, 3) + 1}
        for n in sorted(ns):
            st = check(online(s).for_length(n), slots=s)
            assert st.recorded == n
            assert st.advances == stats(online(s).for_length(n)).advances == advances(s)[n]


def test_for_length_attributes_and_reiteration():
    sched = online(4).for_length(37)
    assert isinstance(sched, OnlineSchedule)
    assert sched.kind == "online" and sched.n_steps == 37 and sched.slots == {0: 4}
    assert sched.extra_advances == Online.extra_advances == 1
    assert list(sched) == list(sched)
    assert repr(sched) == "online(n_steps=37, snapshots=4)"
    assert repr(online(4)) == "online(snapshots=4)"
    assert list(online(3).for_length(0)) == []
    # maximal Advance ranges: never two Advances in a row
    acts = list(online(6).for_length(500))
    kinds = [type(a) for a in acts]
    assert not any(a is Advance and b is Advance for a, b in zip(kinds, kinds[1:], strict=False))


def test_bad_snapshots():
    for bad in (0, -1, True, 2.5, "3", None):
        with pytest.raises(ValueError):
            online(bad)
    with pytest.raises(ValueError):
        online(3).for_length(-1)
    with pytest.raises(ValueError):
        online(3).advances(-1)


# --- the controller protocol ---------------------------------------------------------------

def test_finish_one_and_two_steps():
    ctl = online(3).start()
    assert ctl.at(0) == (Store(0, 0),)
    assert list(ctl.finish(1)) == [Reverse(0), Free(0, 0)]

    ctl = online(3).start()
    assert ctl.at(0) == (Store(0, 0),)
    assert ctl.at(1) == (Store(1, 1),)
    assert list(ctl.finish(2)) == [Reverse(1), Free(1, 1), Restore(0, 0), Reverse(0), Free(0, 0)]

    ctl = online(1).start()
    assert ctl.at(0) == (Store(0, 0),)
    assert ctl.at(1) == ()
    assert list(ctl.finish(2)) == [Reverse(1), Restore(0, 0), Reverse(0), Free(0, 0)]
    for s in (1, 2, 5):
        assert check(online(s).for_length(1), slots=s).advances == 0
        assert check(online(s).for_length(2), slots=s).advances == 1


def test_protocol_errors():
    ctl = online(3).start()
    with pytest.raises(ValueError):
        ctl.at(1)  # must start at 0
    ctl.at(0)
    ctl.at(1)
    with pytest.raises(ValueError):
        ctl.finish(3)  # at(2) was not called
    with pytest.raises(ValueError):
        ctl.at(3)
    list(ctl.finish(2))
    with pytest.raises(ValueError):
        ctl.at(2)
    with pytest.raises(ValueError):
        ctl.finish(2)


def test_at_returns_only_free_and_store_of_the_current_state():
    s = 7
    ctl = online(s).start()
    held = set()
    for i in range(5000):
        acts = ctl.at(i)
        assert len(acts) <= 2
        for a in acts:
            assert type(a) in (Free, Store)
            if type(a) is Store:
                assert a.index == i and 0 <= a.slot < s
                held.add(a.index)
            else:
                held.remove(a.index)
        assert len(held) <= s and set(ctl.held) == held and 0 in held


def _controller_lines(s: int, n: int) -> tuple[int, int]:
    """``(lines executed by the controller's code, actions returned)`` over ``at(0..n-1)``:
    an operation count (line events of ``OnlineController.at``, ``_store`` and
    ``_new_repetition``), deterministic whatever the machine's load."""
    codes = {OnlineController.at.__code__, OnlineController._store.__code__,
             OnlineController._new_repetition.__code__}
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return local

    def calls(frame, event, arg):
        return local if frame.f_code in codes else None

    ctl = online(s).start()
    at = ctl.at
    total = 0
    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        for i in range(n):
            total += len(at(i))
    finally:
        sys.settrace(previous)
    return lines, total


def test_controller_is_amortised_constant_time():
    """Amortised O(1) per step, counted, not timed: the controller's lines per step do not
    grow from n = 10^4 to 4 * 10^4 (a store's backward scan is paid for by the steps between
    stores) and stay below a constant at every s; at most one Store (+ one Free) per ~2
    steps. (Measured: 6.6, 16.5 and 34.2 lines per step at n = 4 * 10^4 for s = 3, 50, 200.)"""
    for s in (3, 50, 200):
        short, _ = _controller_lines(s, 10_000)
        lines, total = _controller_lines(s, 40_000)
        assert total <= 40_000, (s, total)
        assert lines / 40_000 <= short / 10_000, (s, lines, short)
        assert lines / 40_000 <= 40, (s, lines)


# --- cost ----------------------------------------------------------------------------------

@pytest.mark.parametrize("s", SIZES)
def test_cost_guarantees(s):
    """Exact for n <= s+1 and at n = beta(s, r); +1 at most up to beta(s,2), +4 up to beta(s,3)."""
    adv = advances(s)
    for n in range(1, min(N_MAX, beta(s, 3)) + 1):
        t = optimal_cost(n, s)
        assert adv[n] >= t
        if n <= s + 1:
            assert adv[n] == t, n
        elif n <= beta(s, 2):
            assert adv[n] <= t + 1, n
        else:
            assert adv[n] <= t + 4, n
    for r in (1, 2, 3, 4):
        if beta(s, r) <= N_MAX:
            assert adv[beta(s, r)] == optimal_cost(beta(s, r), s), r


def test_range1_excess_at_most_one_for_many_sizes():
    for s in range(1, 41):
        adv = online(s).advances(beta(s, 2))
        assert all(adv[n] <= optimal_cost(n, s) + 1 for n in range(1, beta(s, 2) + 1)), s


@pytest.mark.parametrize("s", SIZES)
@pytest.mark.xfail(strict=True, reason=(
    "exact optimality up to C(s+2,2) is impossible online: at n = s+3 every reachable held "
    "set costs >= optimal_cost + 1 (see test_exact_optimality_is_impossible_online); "
    "measured max excess: 1 for every s"))
def test_target_exact_up_to_beta2(s):
    adv = advances(s)
    assert all(adv[n] == optimal_cost(n, s) for n in range(1, beta(s, 2) + 1))


# measured worst advances / optimal_cost for C(s+2,2) < n <= C(s+3,3): (without, with the +1)
RANGE2_MEASURED = {3: (1.1667, 1.2222), 5: (1.0789, 1.1053), 10: (1.0244, 1.0325),
                   20: (1.0068, 1.0090), 50: (1.0012, 1.0015)}


def _range2(s, plus):
    return worst(s, beta(s, 2) + 1, min(beta(s, 3), N_MAX), plus)


@pytest.mark.parametrize("s", [20, 50])
def test_target_range2_within_1_01(s):
    assert _range2(s, 1) <= 1.01


@pytest.mark.parametrize("s", [3, 5, 10])
@pytest.mark.xfail(strict=True, reason=(
    "1.01 (with the +1) is below what any online policy can reach for small s "
    "(lower bounds 1.1333, 1.0800, 1.0296 for s = 3, 5, 10; see "
    "test_range2_lower_bound); measured 1.2222, 1.1053, 1.0325"))
def test_target_range2_within_1_01_small_s(s):
    assert _range2(s, 1) <= 1.01


@pytest.mark.parametrize("s", SIZES)
def test_range2_measured_values(s):
    """Regression guard on the measured worst ratios (without and with the +1)."""
    excl, incl = RANGE2_MEASURED[s]
    assert _range2(s, 0) <= excl + 1e-4
    assert _range2(s, 1) <= incl + 1e-4


@pytest.mark.parametrize("s", [3, 5, 10, 20])
def test_target_range3_within_1_15(s):
    assert worst(s, beta(s, 3) + 1, N_MAX, 1) <= 1.15
    assert worst(s, beta(s, 3) + 1, N_MAX, 0) <= 1.13


# --- what no online policy can do (exhaustive search over held sets) -----------------------

def _online_cost(held, n, s):
    """advances of the reverse plan for held set `held` (sorted, x_0 first) and length n."""
    k = len(held)
    tot = n - 1
    for j in range(k - 1):
        tot += optimal_cost(held[j + 1] - held[j], s - j)
    return tot + optimal_cost(n - 1 - held[-1], s - k + 1)


def _policy_exists(s, n_max, limit):
    """Is there an online policy with cost(n) <= limit(n) for 2 <= n <= n_max? (exhaustive)"""
    sets = {(0,)}
    for n in range(2, n_max + 1):
        i = n - 1  # at(i) may store x_i, freeing one older checkpoint if all slots are full
        nxt = set()
        for p in sets:
            nxt.add(p)
            if len(p) < s:
                nxt.add(p + (i,))
            else:
                nxt.update(p[:j] + p[j + 1:] + (i,) for j in range(1, len(p)))
        sets = {p for p in nxt if _online_cost(p, n, s) <= limit(n)}
        if not sets:
            return False
    return True


def test_exhaustive_search_agrees_with_the_cost_function():
    s = 4
    ctl = online(s).start()
    adv = advances(s)
    for i in range(200):
        ctl.at(i)
        assert _online_cost(ctl.held, i + 1, s) == adv[i + 1]


def test_exact_optimality_is_impossible_online():
    for s in range(2, 7):
        assert _policy_exists(s, s + 2, lambda n, s=s: optimal_cost(n, s))
        assert not _policy_exists(s, s + 3, lambda n, s=s: optimal_cost(n, s))
        assert _policy_exists(s, beta(s, 2), lambda n, s=s: optimal_cost(n, s) + 1)


def test_range2_lower_bound():
    """No online policy keeps (advances + 1) / optimal_cost <= 1.01 past C(s+2,2) for s <= 5."""
    for s, bound in ((3, 1.1333), (4, 1.1025), (5, 1.0800)):
        b2 = beta(s, 2)
        assert not _policy_exists(
            s, beta(s, 3), lambda n, s=s, b2=b2, r=bound - 1e-3: (
                10**9 if n <= b2 else r * optimal_cost(n, s) - 1))
        assert _policy_exists(
            s, beta(s, 3), lambda n, s=s, b2=b2, r=bound + 1e-3: (
                10**9 if n <= b2 else r * optimal_cost(n, s) - 1))


def _range2_lower_bound(s, plus):
    """A lower bound on max (advances + plus) / optimal_cost over C(s+2,2) < n, any policy.

    For n with repetition number 3 write cost - optimal_cost as a sum of per-segment excesses
    (each >= 0, by convexity of optimal_cost in the length). With fewer than s states held the
    unused slots alone cost >= 3. With s held, the newest segment (1 slot, trimmed length L)
    costs (L-2)(L-3)/2, which is 3 right after a store (L = 0) and grows quadratically when
    no store happens. Minimise over the length L0 at n = C(s+2,2) and the first store.
    """
    b2 = beta(s, 2)

    def ratio(n, e):
        return (optimal_cost(n, s) + e + plus) / optimal_cost(n, s)

    best = float("inf")
    for l0 in (0, 1, 2):  # longer is never better
        for nb in range(b2 + 1, b2 + 40):
            w = ratio(nb, 3)
            for n in range(b2 + 1, nb):
                length = l0 + n - b2
                w = max(w, ratio(n, (length - 2) * (length - 3) // 2))
            best = min(best, w)
    return best


def test_range2_lower_bound_analytic():
    bounds = {s: _range2_lower_bound(s, 1) for s in SIZES}
    assert bounds[3] == pytest.approx(1.1333, abs=1e-4)  # = the exhaustive search above
    assert bounds[5] == pytest.approx(1.0800, abs=1e-4)
    for s in (3, 5, 10):
        assert bounds[s] > 1.01, (s, bounds[s])
    for s in SIZES:
        assert bounds[s] <= _range2(s, 1) + 1e-12
        assert _range2_lower_bound(s, 0) <= _range2(s, 0) + 1e-12

