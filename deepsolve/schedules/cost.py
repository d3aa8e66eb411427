"""Closed-form costs of binomial checkpointing (Griewank 1992; Griewank & Walther 2000).

Notation: ``n`` steps, ``s`` snapshot slots with the initial state counted as one.

* ``beta(s, r) = C(s + r, s)``: the longest chain that ``s`` slots reverse when no step is
  advanced more than ``r`` times.
* The repetition number ``r(n, s)`` is the smallest ``r`` with ``beta(s, r) >= n``.
* The minimal number of *unrecorded* forward steps (first sweep included; every step is
  also recorded once in the reverse sweep) is ::

      t(n, s) = r n - beta(s + 1, r - 1)

  e.g. t(10, 2) = 20, t(100, 5) = 316, t(1000, 10) = 3636, t(10000, 20) = 37976.

Pure Python, no torch.
"""

from __future__ import annotations

from math import comb

__all__ = ["beta", "repetitions", "optimal_cost", "split"]


def beta(s: int, r: int) -> int:
    """``C(s + r, s)``, and 0 for ``r < 0``."""
    return comb(s + r, s) if r >= 0 else 0


def _check(n_steps: int, snapshots: int) -> None:
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
        raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
    if isinstance(snapshots, bool) or not isinstance(snapshots, int) or snapshots < 1:
        raise ValueError(
            f"snapshots must be an integer >= 1 (the initial state takes one slot), "
            f"got {snapshots!r}"
        )


def repetitions(n_steps: int, snapshots: int) -> int:
    """The repetition number: the smallest ``r`` with ``beta(snapshots, r) >= n_steps``."""
    _check(n_steps, snapshots)
    if n_steps <= 1:
        return 0
    # beta grows with r: double r until it reaches n, then bisect (O(log r) binomials, so
    # n = 10^12 with two slots, r ~ 1.4e6, takes microseconds)
    lo, hi = 0, 1
    while beta(snapshots, hi) < n_steps:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if beta(snapshots, mid) >= n_steps:
            hi = mid
        else:
            lo = mid
    return hi


def optimal_cost(n_steps: int, snapshots: int) -> int:
    """Minimal number of unrecorded forward steps to reverse ``n_steps`` with ``snapshots`` slots.

    ``t(n, s) = r n - beta(s + 1, r - 1)`` with ``r = repetitions(n, s)``; 0 for ``n <= 1``.
    ``snapshots`` counts every state held at once, the initial state included.
    """
    _check(n_steps, snapshots)
    if n_steps <= 1:
        return 0
    r = repetitions(n_steps, snapshots)
    return r * n_steps - beta(snapshots + 1, r - 1)


def split(m: int, c: int) -> int:
    """Where to place the next snapshot when reversing ``m >= 2`` steps from a held base.

    ``c`` slots are available, the one holding the base included. Returns ``k`` in
    ``[1, m-1]``: advance ``k`` steps, store ``x_{a+k}``, reverse the right part (``m - k``
    steps, ``c - 1`` slots), then the left part (``k`` steps, ``c`` slots).

    Every ``k`` with ``k + t(m-k, c-1) + t(k, c) = t(m, c)`` is optimal; they form the interval
    ``[max(beta(c, r-2), m - beta(c-1, r)), min(beta(c, r-1), m - beta(c-1, r-1))]``
    (Griewank & Walther 2000, Fig. 4). Inside it we take the point that also minimises the
    number of snapshot writes (a store is needed only when the right part has two steps or
    more): with ``c`` capped at ``m - 1``, ``r = r(m, c)`` and ``B(a, b) = beta(a, b)``,

    * right part ``B(c-1, r-1)`` steps          if ``m <= B(c, r-1) + B(c-1, r-2)``,
    * left part ``B(c, r-2) + B(c-1, r-2)``     if ``m <= B(c, r-1) + B(c-2, r-1) + B(c-1, r-2)``,
    * right part ``B(c-1, r-1) + B(c-2, r-1)``  if ``m <= B(c, r-1) + B(c-1, r-1) + B(c-2, r-1)``,
    * left part ``B(c, r-1)``                   otherwise.

    ``tests/test_schedules.py`` checks by exhaustive dynamic programming that this choice is
    optimal in steps and, among optimal splits, in writes.
    """
    c = min(c, m - 1)
    if c <= 1:
        return m - 1
    # r = repetitions(m, c), computed with the binomials we need on the way
    r, b_r, b_r1, b_r2 = 0, 1, 0, 0  # beta(c, r), beta(c, r-1), beta(c, r-2)
    while b_r < m:
        r += 1
        b_r2, b_r1 = b_r1, b_r
        b_r = b_r * (c + r) // r
    # beta(c-1, r-1) = beta(c, r-1) * c / (c + r - 1); beta(c-1, r-2), beta(c-2, r-1) likewise
    e = b_r1 * c // (c + r - 1)
    b = b_r2 * c // (c + r - 2) if r >= 2 else 0
    g = e * (c - 1) // (c + r - 2) if c + r - 2 > 0 else 1
    if m <= b_r1 + b:
        return m - b_r1 + b_r2
    if m <= b_r1 + g + b:
        return b_r2 + b
    if m <= b_r1 + e + g:
        return m - e - g
    return b_r1
