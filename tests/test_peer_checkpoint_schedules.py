"""Cross-check ``deepsolve.schedules.revolve`` against the peer library ``checkpoint_schedules``.

``checkpoint_schedules`` (LGPL) is used here only as a test oracle. Its
``MultistageCheckpointSchedule(max_n, snapshots_in_ram, 0)`` counts ``x_0`` as a snapshot, as
``revolve`` does. In its stream, ``Forward`` actions with ``write_adj_deps=False`` are unrecorded
advances of ``len(action)`` steps, and ``write_ics=True`` is one snapshot write.
"""

from __future__ import annotations

import pytest

from deepsolve.schedules import optimal_cost, revolve, stats

cs = pytest.importorskip("checkpoint_schedules")

NS = [*range(1, 121), 500, 1000, 4000]
SMALL_S = range(1, 31)


def _snapshot_counts(n: int) -> list[int]:
    """s = 1..30, plus large s around and beyond n (more slots than steps)."""
    return sorted({*SMALL_S, max(n - 1, 1), n, n + 1, 2 * n, 10 * n})


def peer_counts(n: int, s: int) -> tuple[int, int]:
    """(unrecorded advances, snapshot writes) of the peer's binomial schedule."""
    advances = writes = 0
    for action in cs.MultistageCheckpointSchedule(n, s, 0):
        if isinstance(action, cs.Forward):
            if not action.write_adj_deps:
                advances += len(action)
            if action.write_ics:
                writes += 1
        elif isinstance(action, cs.EndReverse):
            break
    return advances, writes


@pytest.mark.parametrize("n", NS)
def test_advances_match_peer_and_optimum(n):
    for s in _snapshot_counts(n):
        ours = stats(revolve(n, s)).advances
        theirs, _ = peer_counts(n, s)
        assert ours == theirs == optimal_cost(n, s), (n, s, ours, theirs)


@pytest.mark.parametrize("n", NS)
def test_writes_at_most_peer(n):
    for s in _snapshot_counts(n):
        ours = int(stats(revolve(n, s)).stores)  # counts the store of x_0
        _, theirs = peer_counts(n, s)
        assert ours <= theirs, (n, s, ours, theirs)


@pytest.mark.parametrize(("n", "s", "writes"), [(10_000, 20, 8229), (100, 50, 50)])
def test_writes_anchor(n, s, writes):
    """The peer's write counts quoted in the issue; ours are equal."""
    assert peer_counts(n, s)[1] == writes
    assert int(stats(revolve(n, s)).stores) == writes
    assert stats(revolve(n, s)).advances == optimal_cost(n, s)
