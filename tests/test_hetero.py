"""deepsolve.schedules.hetero: the heterogeneous-chain DP against an exhaustive search over
action sequences, against revolve on equal steps, memory peaks of the produced streams, block
mode, discretisation and argument errors."""

from __future__ import annotations

import heapq
import random
import time

import pytest

from deepsolve.schedules import Advance, Record, check, optimal_cost, stats
from deepsolve.schedules.hetero import (
    ChainCosts,
    Hetero,
    hetero,
    hetero_cost,
    hetero_peak,
    least_memory,
)

INF = float("inf")


# --- an independent reference: Dijkstra over interpreter states ------------------------------

def exhaustive(f, S, t, of, ob, M, charge=True, persistent=False) -> float:
    """Least weighted advances over all action sequences that fit ``M`` (one-step moves:
    Advance, Record, Store, Restore, Free, Reverse), under the memory model written out here
    from the module docstring: live states (stored, taped or current, each once) + kept tapes
    + the adjoint, plus each move's transient. ``persistent``: a snapshot may be freed only once
    its own step is recorded."""
    n = len(f)

    def size(i):
        return 0 if (i == 0 and not charge) else S[i]

    def held(cur, snaps, tapes):
        live = {i for i in range(n + 1) if snaps >> i & 1} | {i for i in range(n) if tapes >> i & 1}
        if cur >= 0:
            live.add(cur)
        return sum(size(i) for i in live) + sum(t[i] for i in range(n) if tapes >> i & 1)

    start = (0, 0, 0, n)
    dist = {start: 0}
    heap = [(0, start)]
    while heap:
        d, state = heapq.heappop(heap)
        if dist[state] < d:
            continue
        cur, snaps, tapes, adj = state
        if adj == 0 and not snaps and not tapes:
            return d
        base = held(cur, snaps, tapes) + S[adj]
        moves = []
        if 0 <= cur < n:
            if base + S[cur + 1] + of[cur] <= M:
                moves.append((f[cur], (cur + 1, snaps, tapes, adj)))
            if cur < adj and not tapes >> cur & 1 and base + t[cur] + S[cur + 1] + of[cur] <= M:
                moves.append((0, (cur + 1, snaps, tapes | 1 << cur, adj)))
            if not snaps >> cur & 1:
                moves.append((0, (cur, snaps | 1 << cur, tapes, adj)))
        for i in range(n):
            if snaps >> i & 1:
                moves.append((0, (i, snaps, tapes, adj)))
                if not persistent or tapes >> i & 1 or adj <= i:
                    moves.append((0, (cur, snaps & ~(1 << i), tapes, adj)))
        i = adj - 1
        if i >= 0:
            if tapes >> i & 1:
                if base + S[i] + ob[i] <= M:
                    moves.append((0, (-1, snaps, tapes & ~(1 << i), i)))
            elif cur == i and base + t[i] + max(S[i + 1] + of[i], S[i] + ob[i]) <= M:
                moves.append((0, (-1, snaps, tapes, i)))
        for cost, nxt in moves:
            if held(nxt[0], nxt[1], nxt[2]) + S[nxt[3]] > M:
                continue
            nd = d + cost
            if nd < dist.get(nxt, INF):
                dist[nxt] = nd
                heapq.heappush(heap, (nd, nxt))
    return INF


def random_chain(rng: random.Random, n: int):
    f = [rng.randint(1, 4) for _ in range(n)]
    S = [rng.randint(1, 3) for _ in range(n + 1)]
    t = [rng.randint(0, 4) for _ in range(n)]
    of = [rng.choice([0, 0, 1]) for _ in range(n)]
    ob = [rng.choice([0, 0, 2]) for _ in range(n)]
    return f, S, t, of, ob


def dp(f, S, t, of, ob, M, charge=True, **kw) -> float:
    try:
        return hetero(ChainCosts(f, S, t, None, of, ob), M, slots=None, charge_input=charge,
                      **kw).advance_cost
    except ValueError:
        return INF


def weighted_advances(schedule, f) -> float:
    return sum(sum(f[i] for i in range(a.start, a.stop)) for a in schedule if type(a) is Advance)


# --- optimality ---------------------------------------------------------------------------

def test_equals_exhaustive_persistent_optimum_on_random_chains():
    rng = random.Random(1)
    checked = 0
    for _ in range(120):
        n = rng.randint(1, 5)
        chain = random_chain(rng, n)
        M = rng.randint(4, 20)
        charge = rng.random() < 0.7
        ref = exhaustive(*chain, M, charge, persistent=True)
        assert dp(*chain, M, charge, mode="exact") == ref, (chain, M, charge)
        checked += ref < INF
    assert checked > 50


def test_never_below_the_unrestricted_optimum_and_the_known_gap():
    rng = random.Random(2)
    for _ in range(60):
        n = rng.randint(1, 5)
        chain = random_chain(rng, n)
        M = rng.randint(4, 20)
        assert dp(*chain, M) >= exhaustive(*chain, M)
    # a chain where dropping a snapshot before its step is recorded (non-persistent) wins:
    # the program is optimal over persistent schedules only (module docstring)
    chain = ([3, 3, 2, 3, 4], [1, 3, 2, 3, 2, 3], [1, 2, 2, 4, 2], [1, 1, 0, 0, 1],
             [2, 0, 0, 0, 0])
    assert exhaustive(*chain, 14, persistent=True) == dp(*chain, 14) == 25
    assert exhaustive(*chain, 14) == 19


def test_record_option_is_used_and_optimal():
    """Chains where the optimum keeps a recorded step's tape while later steps are reversed
    (the "whole recorded layer" save): the program finds them and matches the search."""
    rng = random.Random(3)
    found = 0
    for _ in range(150):
        n = rng.randint(3, 5)
        chain = random_chain(rng, n)
        M = rng.randint(6, 16)
        try:
            h = hetero(ChainCosts(chain[0], chain[1], chain[2], None, chain[3], chain[4]), M,
                       slots=None, mode="exact")
        except ValueError:
            continue
        acts = list(h)
        if any(type(a) is Record for a in acts) and any(type(a) is Advance for a in acts):
            found += 1
            assert h.advance_cost == exhaustive(*chain, M, persistent=True)
    assert found >= 5


def test_uniform_chains_equal_exhaustive_optimum():
    for n in range(1, 6):
        for tape in range(0, 4):
            for M in range(3, 12, 2 if n == 5 else 1):
                chain = ([1] * n, [1] * (n + 1), [tape] * n, [0] * n, [0] * n)
                assert dp(*chain, M) == exhaustive(*chain, M), (n, tape, M)


@pytest.mark.parametrize("tape_extra", [0, 3])
def test_equal_steps_reduce_to_revolve(tape_extra):
    """Unit states, a tape too large to keep (t >= s): memory s + t + 3 (s snapshots, the
    current state, the adjoint, one recorded step and its transient) gives t(n, s)."""
    for s in range(1, 8):
        tape = s + tape_extra
        for n in [*range(1, 14), 16, 20, 25, 33, 40, 64, 100]:
            h = hetero(ChainCosts.uniform(n, tape=tape), s + tape + 3, slots=None, mode="exact")
            assert h.advance_cost == optimal_cost(n, s), (n, s, tape)
            if n in (7, 40, 100):
                st = check(h)
                assert st.advances == optimal_cost(n, s)
                assert st.recorded == n


def test_cheap_tapes_never_worse_than_revolve():
    better = 0
    for s in range(2, 7):
        for tape in range(0, s):
            for n in range(2, 41, 5):
                cost = hetero_cost(ChainCosts.uniform(n, tape=tape), s + tape + 3, slots=None,
                                   mode="exact")
                assert cost <= optimal_cost(n, s)
                better += cost < optimal_cost(n, s)
    assert better > 30


# --- validity and memory ------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_streams_are_valid_fit_the_memory_and_cost_what_they_say(seed):
    rng = random.Random(10 + seed)
    done = 0
    for _ in range(40):
        n = rng.randint(2, 40)
        f = [rng.randint(1, 5) for _ in range(n)]
        S = [rng.randint(1, 6) for _ in range(n + 1)]
        t = [rng.randint(0, 8) for _ in range(n)]
        of = [rng.choice([0, 1]) for _ in range(n)]
        ob = [rng.choice([0, 2]) for _ in range(n)]
        c = ChainCosts(f, S, t, None, of, ob)
        M = rng.randint(least_memory(c), 80)
        charge = rng.random() < 0.5
        exact = hetero(c, M, slots=None, charge_input=charge, mode="exact")
        block = hetero(c, M, slots=None, charge_input=charge, mode="blocks",
                       block=rng.randint(2, 6))
        for h in (exact, block):
            assert hetero_peak(h, c, charge_input=charge) <= M
            assert h.peak() <= M
            assert weighted_advances(h, f) == h.advance_cost
            st = stats(h)
            assert st.recorded == n and st.peak_slots_total <= n
        assert exact.advance_cost <= block.advance_cost
        done += 1
    assert done == 40


def test_least_memory_is_enough_in_every_mode():
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(8, 40)
        c = ChainCosts([rng.randint(1, 5) for _ in range(n)],
                       [rng.randint(1, 6) for _ in range(n + 1)],
                       [rng.randint(0, 8) for _ in range(n)])
        m = least_memory(c)
        for mode in ("exact", "blocks"):
            h = hetero(c, m, slots=None, mode=mode, block=rng.randint(2, 6))
            assert hetero_peak(h, c) <= m
        with pytest.raises(ValueError, match="least-memory schedule"):
            hetero(c, m - max(c.states) - max(c.tapes) - 1, slots=None)


def test_discretised_plans_fit_the_byte_budget():
    rng = random.Random(4)
    for _ in range(20):
        n = rng.randint(5, 60)
        S = [rng.choice([1, 3, 4]) * 10_000 + rng.randint(0, 999) for _ in range(n + 1)]
        t = [rng.randint(0, 4) * 10_000 + rng.randint(0, 999) for _ in range(n)]
        c = ChainCosts([rng.uniform(0.1, 2.0) for _ in range(n)], S, t)
        memory = int(least_memory(c) * rng.uniform(1.3, 4.0))
        for slots in (40, 256):
            h = hetero(c, memory, slots=slots)
            assert hetero_peak(h, c) <= memory  # in bytes, not only in units
            assert h.peak() <= slots
            units, limit = c.units(memory, slots)
            assert limit == slots and all(u * memory >= x * slots
                                          for u, x in zip(units.states, c.states, strict=True))


def test_units_keep_states_exact_when_the_slots_resolve_them():
    """States that are multiples of 256 KiB under a 63.7 MiB budget and 256 slots: a unit of
    memory/slots (0.2489 MiB) would round every 0.25 MiB state up to 2 units; the unit is a
    divisor of their gcd instead, so they stay exact and more fits."""
    KiB = 1024
    S = [256 * KiB, 1024 * KiB, 512 * KiB] * 20 + [256 * KiB]
    c = ChainCosts([1.0] * 60, S, [0] * 60, None, [300 * KiB] * 60, [2100 * KiB] * 60)
    memory = int(63.7 * 1024 * KiB)
    units, limit = c.units(memory, 256)
    assert limit <= 256 and limit * 256 * KiB <= memory
    assert [u * 256 * KiB for u in units.states] == S
    assert units.backward_overhead[0] * 256 * KiB >= 2100 * KiB  # others rounded up
    odd = ChainCosts([1.0] * 3, [1000, 3000, 7001, 1000], [0] * 3)
    units, limit = odd.units(10_000, 16)  # gcd 1 < 10000/16: plain memory/slots units
    assert limit == 16 and units.states == (2, 5, 12, 2)


def test_more_memory_never_costs_more():
    rng = random.Random(5)
    n = 30
    c = ChainCosts([rng.uniform(0.5, 2) for _ in range(n)],
                   [rng.randint(1, 6) for _ in range(n + 1)],
                   [rng.randint(0, 8) for _ in range(n)])
    top = sum(c.states) + sum(c.tapes) + 2 * max(c.states)  # enough to record everything
    costs = [hetero_cost(c, m, slots=None, mode="exact")
             for m in [*range(least_memory(c), 60), *range(60, top, 9), top]]
    assert all(a >= b for a, b in zip(costs[:-1], costs[1:], strict=True))
    assert costs[-1] == 0  # everything recorded: plain backpropagation
    assert costs[0] > costs[-1]


def test_block_mode_is_auto_for_long_chains_and_plans_1000_layers():
    widths = [256, 1024, 512]
    n = 1000
    S = [256 * widths[i % 3] * 4 for i in range(n + 1)]
    t = [256 * widths[(i + 1) % 3] * 4 for i in range(n)]
    c = ChainCosts([widths[i % 3] * widths[(i + 1) % 3] * 1e-9 for i in range(n)], S, t)
    memory = least_memory(c) * 6
    t0 = time.process_time()
    h = hetero(c, memory)
    elapsed = time.process_time() - t0
    assert h.mode == "blocks" and h.block is not None
    assert elapsed < 5  # about 0.5 s of one core; generous for loaded CI machines
    assert hetero_peak(h, c) <= memory
    small = hetero(ChainCosts.uniform(50, tape=2), 10, slots=None)
    assert small.mode == "exact"


def test_lazy_and_reiterable():
    h = hetero(ChainCosts.uniform(30, tape=1), 7, slots=None)
    assert list(h) == list(h)
    it = iter(h)
    first = next(it)
    assert first == next(iter(h))
    assert "hetero(n_steps=30" in repr(h)
    assert list(hetero(ChainCosts.uniform(0), 1, slots=None)) == []


def test_total_cost_adds_the_fixed_part():
    c = ChainCosts([1.0, 2.0, 3.0], [1, 1, 1, 1], [5, 5, 5], backward=[2.0, 2.0, 2.0])
    h = hetero(c, 9, slots=None, mode="exact")
    assert h.cost == h.advance_cost + 6 + 6
    assert isinstance(h, Hetero)


# --- errors -------------------------------------------------------------------------------

def test_argument_errors():
    c = ChainCosts.uniform(4)
    with pytest.raises(ValueError, match="states must have 5 entries"):
        ChainCosts([1, 1, 1, 1], [1, 1, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"tapes\[1\] must be an integer >= 0"):
        ChainCosts([1, 1], [1, 1, 1], [1, -2])
    with pytest.raises(ValueError, match=r"forward\[0\] must be a finite number >= 0"):
        ChainCosts([float("nan"), 1], [1, 1, 1], [1, 1])
    with pytest.raises(ValueError, match="costs must be a ChainCosts"):
        hetero([1, 2], 10)
    with pytest.raises(ValueError, match="memory must be an integer >= 0"):
        hetero(c, -1)
    with pytest.raises(ValueError, match="slots must be an integer >= 1 or None"):
        hetero(c, 10, slots=0)
    with pytest.raises(ValueError, match="mode must be 'auto', 'exact' or 'blocks'"):
        hetero(c, 10, mode="fast")
    with pytest.raises(ValueError, match="block must be an integer >= 2"):
        hetero(c, 10, block=1)
    with pytest.raises(ValueError, match="cannot reverse this 4-step chain.*needs 5"):
        hetero(c, 4, slots=None)
