"""Heterogeneous chains: optimal checkpointing when steps differ in cost and size.

Beaumont, Eyraud-Dubois, Herrmann, Joly & Shilova, "Optimal checkpointing for heterogeneous
chains: how to train deep neural networks with limited memory", arXiv:1911.13214 (2019) (the
*rotor* dynamic program; Rockmate, Zhao et al., ICML 2023, builds on it). Revolve
(:mod:`~deepsolve.schedules.revolve`) assumes equal steps; a deep network or an
operator-splitting solver has steps whose forward cost ``f_i``, state size ``S_i`` and tape size
``t_i`` differ, and the best places to checkpoint depend on them.

The chain and its data (``i = 0 .. n-1``)::

    x_{i+1} = step_i(x_i)          f_i   forward cost of an unrecorded step (weighs Advance)
    S_i, i = 0 .. n                bytes of the state x_i (x_n is the output)
    t_i                            bytes a *recorded* step i keeps for its backward beyond its
                                   input x_i (its tape: saved activations)
    of_i, ob_i                     transient bytes of the forward / backward of step i (scratch;
                                   optional, default 0)

Two kinds of saves, as in the paper: a *snapshot* of the input state only (``Store``: rotor's
``F_ck``), or the *whole recorded layer* (``Record(i, i+1)`` whose tape is kept while the chain
advances: rotor's ``F_all``). Every step is recorded exactly once and reversed once, so their
cost is a constant; a schedule's cost to minimise is its weighted advances ``sum f_i``.

Memory model (what a schedule holds at one instant; this module's :func:`hetero_peak` interprets
a stream with it). *Live* states are those stored in a slot, the inputs of kept tapes and the
current state, each counted once however many hold it (a snapshot and the tape recorded from it
share storage). With the adjoint at ``j`` (``dL/dx_j``, ``S_j`` bytes) the base is::

    live states + sum of kept t_i + S_j

and an action adds its transient on top::

    Advance step i          + S_{i+1} + of_i                        (x_i is live as current)
    Record step i (kept)    + t_i + S_{i+1} + of_i                  (then t_i stays, x_i live)
    Reverse i, kept tape    + S_i + ob_i                            (dL/dx_i appears)
    Reverse i, no tape      + t_i + max(S_{i+1} + of_i, S_i + ob_i) (record, then backward)

``x_0`` is counted when ``charge_input`` (as revolve counts it); a caller whose input is held
anyway passes ``charge_input=False``. Parameter gradients are not counted.

The dynamic program. ``T(a, b, m)``: the least weighted advances that reverse steps
``a .. b-1`` when ``x_a`` is live (stored or current), the adjoint is at ``b`` and ``m`` bytes
are free beyond what is held (``x_a`` included). With ``F(a, c) = f_a + .. + f_{c-1}`` and
``A(a, c) = max(S_{a+1} + of_a, max_{a<l<c} S_l + S_{l+1} + of_l)`` (the peak of advancing
from ``x_a`` to ``x_c``, adjoint aside)::

    T(a, a+1, m) = 0    if m >= S_{a+1} + t_a + max(S_{a+1} + of_a, S_a + ob_a), else inf
    T(a, b, m) = min( min_{a<c<b, m >= S_b + A(a,c)} F(a, c) + T(c, b, m - S_c) + T(a, c, m),
                      T(a+1, b, m - t_a - S_{a+1})  if m >= t_a + S_{a+1} + max(S_b + of_a,
                                                                          S_a + ob_a) )

The split ("snapshot c", rotor's ``F_ck``) advances to ``x_c``, stores it, reverses the right
part with ``x_c`` held, then the left part from ``x_a``. The second term ("record a", rotor's
``F_all``) records step ``a``, keeps its tape while ``a+1 .. b-1`` are reversed from ``x_{a+1}``,
then reverses step ``a`` from the tape. (Recording step ``a`` and later *recomputing*
``x_{a+1}`` from the tape's ``x_a`` is never better: the split at the same ``c`` followed by
"record a" inside the left part has the same forward cost, more memory for the right part and
a looser advance condition.)

What is optimal. The program is exact over *persistent* schedules: every snapshot ``x_c``
stays live until step ``c`` has been recorded (rotor's class). An exhaustive search over all
action sequences (``tests/test_hetero.py``) equals it on every chain with equal steps and on
about 99.5% of small random heterogeneous chains; on the rest a non-persistent schedule (one
that drops a snapshot before its own step is recorded and recomputes it later) is cheaper,
by up to 30% on the 5-step examples found. With equal steps and tapes too large to keep
(``t >= s`` state sizes, ``S = 1``, ``memory = s + t + 3``: ``s`` snapshots, the current state,
the adjoint and one recorded step with its transient) the program's advances equal revolve's
``t(n, s)`` (:func:`~deepsolve.schedules.optimal_cost`); with cheaper tapes it does better.

Discretisation. Memory is counted in integer *units* (:meth:`ChainCosts.units`): a unit is
``memory / slots`` bytes, or a divisor of the gcd of the state sizes when that is not smaller
(states are then exact). Every size is rounded **up** to whole units and the limit **down**, so
a plan within the limit never holds more than ``memory`` bytes (it may waste up to one unit per
item held). ``slots=None`` takes the sizes as units already (exact).

Planning cost and modes. ``mode="exact"`` evaluates ``T`` for all ``n^2/2`` chains and
``slots + 1`` memory levels, each a minimum over ``b - a`` splits: ``O(n^3 slots / 6)``
work, ``O(n^2 slots)`` memory (float32). It is vectorised in numpy over the memory axis and all
chains of one length (a few array operations per split length; the advance condition is kept
out of the inner loop because the allowed splits at each memory level form a prefix in ``c``).
``n = 100`` takes 0.1-0.3 s at 256 slots, ``n = 1000`` about a minute and a gigabyte.
``mode="blocks"`` keeps the exact tables for every chain of at most ``block`` steps; longer
chains run between *block boundaries* only: each next boundary is the smallest state among the
next ``block`` positions, snapshots of long chains sit on boundaries, "record" takes a whole
block, and the least-memory strategy (keep the chain's base only, recompute every step from it)
is always an option, so block mode is feasible whenever exact is. Work: ``n block^2 slots / 2 +
N^3 slots / 6`` for ``N`` blocks. Its plans are valid and fit the memory but are optimal only
within that restricted family; ``mode="auto"`` is exact while :func:`plan_work` is small
(``n <= 151`` at 256 slots) and otherwise takes the finest blocks that plan in about half a
second. docs/sequential.md gives the measured gap to exact and the planning times.

Pure Python + numpy, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from .actions import Action, Advance, Free, Record, Restore, Reverse, Store
from .base import Schedule
from .check import check

__all__ = ["ChainCosts", "Hetero", "hetero", "hetero_cost", "hetero_peak",
           "least_memory", "plan_work"]

_F32 = np.float32
_INF = np.float32(np.inf)
EXACT_WORK = 1.5e8
"""``mode="auto"`` plans exactly while :func:`plan_work` stays below this (about 0.5 s of one
CPU core: ``n <= 151`` at 256 slots)."""
BLOCK_WORK = 2.5e8
"""Block mode's work target (about 0.6 s of one core): ``mode="auto"`` takes the smallest block
length whose :func:`plan_work` stays below it."""


# ----------------------------------------------------------------------------------------
# the chain


def _ints(name: str, values: object, length: int) -> tuple[int, ...]:
    try:
        seq = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{name} must be a sequence of {length} sizes, got "
                         f"{type(values).__name__}") from None
    if len(seq) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(seq)}")
    out = []
    for k, v in enumerate(seq):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            if isinstance(v, (float, np.floating)) and v >= 0 and float(v).is_integer():
                v = int(v)
            else:
                raise ValueError(f"{name}[{k}] must be an integer >= 0 (bytes or units), "
                                 f"got {v!r}")
        out.append(int(v))
    return tuple(out)


def _floats(name: str, values: object, length: int) -> tuple[float, ...]:
    try:
        seq = [float(v) for v in values]  # type: ignore[attr-defined]  # any object; TypeError caught
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of {length} non-negative numbers") \
            from None
    if len(seq) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(seq)}")
    for k, v in enumerate(seq):
        if not v >= 0 or math.isinf(v):
            raise ValueError(f"{name}[{k}] must be a finite number >= 0, got {v!r}")
    return tuple(seq)


@dataclass(frozen=True)
class ChainCosts:
    """Per-step costs and sizes of a chain of ``n`` steps (see the module docstring).

    Attributes:
        forward: ``f_i``, cost of one unrecorded evaluation of step ``i`` (``n`` entries).
        states: ``S_i``, size of ``x_i`` for ``i = 0 .. n`` (``n + 1`` entries).
        tapes: ``t_i``, what recorded step ``i`` keeps beyond its input (``n`` entries).
        backward: cost of recording + reversing step ``i`` (reported, not optimised: every
            schedule pays it once per step); defaults to ``forward``.
        forward_overhead, backward_overhead: transient sizes ``of_i``, ``ob_i`` (default 0).
    """

    forward: tuple[float, ...]
    states: tuple[int, ...]
    tapes: tuple[int, ...]
    backward: tuple[float, ...] | None = None
    forward_overhead: tuple[int, ...] | None = None
    backward_overhead: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        try:
            n = len(self.forward)
        except TypeError:
            raise ValueError("forward must be a sequence of per-step costs") from None
        set_ = object.__setattr__
        set_(self, "forward", _floats("forward", self.forward, n))
        set_(self, "states", _ints("states", self.states, n + 1))
        set_(self, "tapes", _ints("tapes", self.tapes, n))
        set_(self, "backward", _floats("backward", self.forward if self.backward is None
                                       else self.backward, n))
        zeros = (0,) * n
        set_(self, "forward_overhead", zeros if self.forward_overhead is None
             else _ints("forward_overhead", self.forward_overhead, n))
        set_(self, "backward_overhead", zeros if self.backward_overhead is None
             else _ints("backward_overhead", self.backward_overhead, n))

    @property
    def n_steps(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(cls, n_steps: int, *, state: int = 1, tape: int = 1, forward: float = 1.0,
                backward: float = 0.0) -> ChainCosts:
        """``n_steps`` equal steps (revolve's setting)."""
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
        return cls((forward,) * n_steps, (state,) * (n_steps + 1), (tape,) * n_steps,
                   (backward,) * n_steps)

    def units(self, memory: int, slots: int | None) -> tuple[ChainCosts, int]:
        """The chain in memory units and the limit (at most ``slots``).

        The unit is ``memory / slots`` bytes, or, when that is at most the gcd ``G`` of the
        state sizes, the smallest ``G / k`` (``k`` an integer) that is at least
        ``memory / slots``: states are then whole numbers of units, not rounded. Every size is
        rounded **up** to whole units and the limit **down**, so a plan within the limit holds
        at most ``memory`` bytes. ``slots=None``: the sizes are units already.
        """
        if slots is None:
            return self, memory
        num, den = slots, memory  # unit = den / num bytes
        g = 0
        for x in self.states:
            g = math.gcd(g, x)
        if g and g * slots >= memory:
            num, den = g * slots // memory, g
        q = lambda v: tuple(-(-x * num // den) for x in v)  # noqa: E731  ceil(x / unit)
        return ChainCosts(self.forward, q(self.states), q(self.tapes), self.backward,
                          q(self.forward_overhead), q(self.backward_overhead)), \
            memory * num // den


def _memory(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (bytes, or units with "
                         f"slots=None), got {value!r}")
    return int(value)


def least_memory(costs: ChainCosts, *, charge_input: bool = True) -> int:
    """Memory of the least-memory schedule: keep ``x_0`` only and, for ``i = n-1 .. 0``,
    advance from it to ``x_i`` and reverse step ``i``. Every feasible budget is at least the
    largest reverse peak it contains; the DP finds a schedule whenever memory >= this value.
    """
    n = costs.n_steps
    if n == 0:
        return costs.states[0] if charge_input else 0
    S = np.asarray(costs.states, dtype=np.int64)
    t = np.asarray(costs.tapes, dtype=np.int64)
    of = np.asarray(costs.forward_overhead, dtype=np.int64)
    ob = np.asarray(costs.backward_overhead, dtype=np.int64)
    h0 = int(S[0]) if charge_input else 0
    i = np.arange(n)
    rev = S[i + 1] + t + np.maximum(S[i + 1] + of, S[i] + ob) + np.where(i > 0, S[i], 0)
    worst = int(rev.max())
    if n >= 2:  # advancing from x_0 to x_i (i >= 1) with the adjoint at i + 1
        w = S[:-1] + S[1:] + of  # inner advance of step l from an unstored x_l
        a_first = int(S[1] + of[0])
        inner = np.maximum.accumulate(np.concatenate(([a_first], w[1:n - 1])))
        adv = S[2:n + 1] + inner  # for i = 1 .. n-1: S_{i+1} + A(0, i)
        worst = max(worst, int(adv.max()))
    return h0 + worst


# ----------------------------------------------------------------------------------------
# the dynamic program


def _shift(tab: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``out[r, m] = tab[r, m - shift[r]]`` (``inf`` where ``m < shift[r]``)."""
    rows, width = tab.shape
    out = np.full((rows, width), _INF, dtype=_F32)
    if rows == 0:
        return out
    uniq = np.unique(shift)
    if len(uniq) <= 8:  # periodic chains: a few distinct shifts, contiguous slices
        for s in uniq:
            s = int(s)
            if s >= width:
                continue
            sel = np.nonzero(shift == s)[0]
            out[sel, s:] = tab[sel, :width - s]
        return out
    cols = np.arange(width)[None, :] - shift[:, None]
    valid = cols >= 0
    np.maximum(cols, 0, out=cols)
    np.copyto(out, np.take_along_axis(tab, cols, axis=1), where=valid)
    return out


def _freeze(src: list, dst: list, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """``dst[q][r, lo_r:hi_r] = src[q][r, lo_r:hi_r]`` for the given rows (clipped)."""
    width = src[0].shape[1]
    lo = np.minimum(lo, width)  # thresholds are >= 0
    hi = np.minimum(hi, width)
    keep = lo < hi
    if not keep.all():
        rows, lo, hi = rows[keep], lo[keep], hi[keep]
    if rows.size == 0:
        return
    c0, c1 = int(lo.min()), int(hi.max())
    cols = np.arange(c0, c1)
    mask = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    for s_, d_ in zip(src, dst, strict=True):
        sub = d_[rows, c0:c1]
        np.copyto(sub, s_[rows, c0:c1], where=mask)
        d_[rows, c0:c1] = sub


def _split_min(lefts: list, right, fcost, first: np.ndarray, inner, sb: np.ndarray,
               K: int, width: int) -> list:
    """``min_{1<=k<K} left_q[k] + right(k) + fcost(k)`` per table ``q``, over the splits whose
    advance fits: ``m >= sb + A_k`` with ``A_1 = first``, ``A_k = max(A_{k-1}, inner(k))``.

    ``A_k`` grows with ``k``, so the splits allowed at column ``m`` are a prefix ``k <= K(m)``:
    keep an unmasked running minimum and copy a row's columns ``[thr_{k-1}, thr_k)`` out of it
    when its threshold rises (rare: a running maximum changes a few times), instead of masking
    every candidate.
    """
    rows = len(sb)
    run = [np.full((rows, width), _INF, dtype=_F32) for _ in lefts]
    out = [np.full((rows, width), _INF, dtype=_F32) for _ in lefts]
    tmp = np.empty((rows, width), dtype=_F32)
    adv = first.copy()
    prev = sb + adv
    allrows = np.arange(rows)
    for k in range(1, K):
        if k >= 2:
            np.maximum(adv, inner(k), out=adv)
            thr = sb + adv
            ch = np.nonzero(thr > prev)[0]
            if ch.size:
                _freeze(run, out, ch, prev[ch], thr[ch])
            prev = thr
        r = right(k)
        f = fcost(k)
        for q, left in enumerate(lefts):
            np.add(left[k], r, out=tmp)
            tmp += f
            np.minimum(run[q], tmp, out=run[q])
    _freeze(run, out, allrows, prev, np.full(rows, width))
    return out


def plan_work(n: int, slots: int, block: int | None = None,
              states: Sequence[int] | np.ndarray | None = None) -> float:
    """Terms ``(a, b, c, m)`` the program evaluates: ``n^3 (slots+1) / 6`` exact,
    ``n block^2 (slots+1) / 2 + N^3 (slots+1) / 6`` in block mode with ``N`` blocks (counted
    from ``states`` when given, else ``n / block``)."""
    M = slots + 1
    if block is None or block >= n:
        return n ** 3 * M / 6
    nb = len(_anchors(np.asarray(states), block)) - 1 if states is not None else -(-n // block)
    return n * block * block * M / 2 + nb ** 3 * M / 6


def _auto_block(S: np.ndarray, slots: int) -> int | None:
    """None (exact) while the exact program's work is below :data:`EXACT_WORK`; else the
    smallest block (the most block boundaries) whose work is below :data:`BLOCK_WORK`."""
    n = len(S) - 1
    if plan_work(n, slots) <= EXACT_WORK:
        return None
    for g in range(2, n):
        if plan_work(n, slots, g, S) <= BLOCK_WORK:
            return g
    return n - 1  # pragma: no cover - a handful of huge blocks


def _anchors(S: np.ndarray, g: int) -> list[int]:
    """Block boundaries ``0 = A_0 < .. < A_N = n``, blocks at most ``g`` long: each next
    boundary is the smallest state among the next ``g`` positions (the last one on ties),
    so snapshots of long chains fall on the cheapest states."""
    n = len(S) - 1
    A = [0]
    while A[-1] + g < n:
        lo = A[-1] + 1
        seg = S[lo:lo + g]
        A.append(lo + len(seg) - 1 - int(np.argmin(seg[::-1])))
    A.append(n)
    return A


class _Tables:
    """Optimal costs ``T(a, b, m)`` (float32) for the chains the mode allows; see the module
    docstring. ``fine[L][a, m] = T(a, a+L, m)`` for ``L <= block``; ``coarse[K][i, m] =
    T(A_i, A_{i+K}, m)`` between block boundaries ``A_i`` for longer chains."""

    def __init__(self, costs: ChainCosts, limit: int, block: int | None):
        n = costs.n_steps
        self.n, self.M = n, limit
        self.S = np.asarray(costs.states, dtype=np.int64)
        self.t = np.asarray(costs.tapes, dtype=np.int64)
        self.of = np.asarray(costs.forward_overhead, dtype=np.int64)
        self.ob = np.asarray(costs.backward_overhead, dtype=np.int64)
        self.P = np.concatenate(([0.0], np.cumsum(np.asarray(costs.forward, dtype=np.float64))))
        self.g = n if block is None or block >= n else block
        # W_l: advancing step l from an unstored x_l; first: advancing from the held x_a
        self.W = self.S[:-1] + self.S[1:] + self.of
        self.first = self.S[1:] + self.of
        # fine[L] / fine_r[L] for 1 <= L <= g; entry 0 is a placeholder None, never read
        self.fine = cast("list[np.ndarray]", [None] * (self.g + 1))
        self.fine_r = cast("list[np.ndarray]", [None] * (self.g + 1))
        self._build_fine()
        self.anchors: list[int] = []
        self.coarse: list[np.ndarray] = []  # coarse[K] for K >= 1 (coarse[0]: None)
        if self.g < n:
            self._build_coarse()

    # -- helpers -------------------------------------------------------------------------

    def _f(self, a, c):
        """``F(a, c)`` as float32, the same rounding in the tables and in generation."""
        return (self.P[c] - self.P[a]).astype(_F32) if isinstance(a, np.ndarray) \
            else _F32(self.P[c] - self.P[a])

    def _base_need(self, a):
        S, t, of, ob = self.S, self.t, self.of, self.ob
        return S[a + 1] + t[a] + np.maximum(S[a + 1] + of[a], S[a] + ob[a])

    # -- fine tables: every chain of at most g steps --------------------------------------

    def _record_need(self, a, b):
        """Free memory that recording step ``a`` (kept) and reversing it from its tape need."""
        S, t, of, ob = self.S, self.t, self.of, self.ob
        return t[a] + S[a + 1] + np.maximum(S[b] + of[a], S[a] + ob[a])

    def _build_fine(self) -> None:
        n, M, S, t = self.n, self.M, self.S, self.t
        mcol = np.arange(M + 1)
        a = np.arange(n)
        self.fine[1] = np.where(mcol[None, :] >= self._base_need(a)[:, None], _F32(0),
                                _INF).astype(_F32)
        self.fine_r[1] = _shift(self.fine[1], S[:n])
        for L in range(2, self.g + 1):
            rows = n - L + 1
            a = np.arange(rows)
            (best,) = _split_min(
                [[None] + [tab[:rows] for tab in self.fine[1:L]]],
                lambda k, L=L, rows=rows: self.fine_r[L - k][k:k + rows],
                lambda k, rows=rows: (self.P[k:k + rows] - self.P[:rows]).astype(_F32)[:, None],
                self.first[a], lambda k, rows=rows: self.W[k - 1:k - 1 + rows], S[a + L], L,
                M + 1)
            # record step a, keep its tape, reverse a+1 .. b-1 from x_{a+1}
            rec = _shift(self.fine[L - 1][1:rows + 1], t[a] + S[a + 1])
            rec[mcol[None, :] < self._record_need(a, a + L)[:, None]] = _INF
            np.minimum(best, rec, out=best)
            self.fine[L] = best
            self.fine_r[L] = _shift(best, S[:rows])

    # -- coarse tables: chains between block boundaries ------------------------------------

    def _build_coarse(self) -> None:
        n, g, M, S, t = self.n, self.g, self.M, self.S, self.t
        A = _anchors(S, g)
        self.anchors = A
        self.index = {x: i for i, x in enumerate(A)}
        N = len(A) - 1
        Aa = np.asarray(A, dtype=np.int64)
        lens = Aa[1:] - Aa[:-1]
        mcol = np.arange(M + 1)
        lvl1 = np.stack([self.fine[int(lens[i])][A[i]] for i in range(N)])
        lvl1_r = np.stack([self.fine_r[int(lens[i])][A[i]] for i in range(N)])
        self.coarse = cast("list[np.ndarray]", [None, lvl1])
        coarse_r = [None, lvl1_r]
        # per block: advance need A(A_i, A_{i+1}), inner max of W, tape, record/reverse needs
        first = np.empty(N, dtype=np.int64)
        bw = np.empty(N, dtype=np.int64)
        btape = np.empty(N, dtype=np.int64)
        rec = np.empty(N, dtype=np.int64)
        rev = np.empty(N, dtype=np.int64)
        for i in range(N):
            lo, hi = A[i], A[i + 1]
            first[i] = max([int(self.first[lo])] + [int(w) for w in self.W[lo + 1:hi]])
            bw[i] = int(self.W[lo:hi].max())
            ls = np.arange(lo, hi)
            held_t = np.cumsum(t[lo:hi])  # tapes lo .. l
            held_s = np.cumsum(S[lo + 1:hi + 1]) - S[lo + 1:hi + 1]  # inputs lo+1 .. l
            # recording step l: tapes lo..l, inputs lo+1..l, x_{l+1}, of_l (+ S_b outside)
            rec[i] = int((held_t + held_s + S[ls + 1] + self.of[ls]).max())
            # reversing step l from its tape: tapes lo..l, inputs lo+1..l, adjoints l+1 and l
            rev[i] = int((held_t + held_s + S[ls + 1] + S[ls] + self.ob[ls]).max())
            btape[i] = int(t[lo:hi].sum() + S[lo + 1:hi + 1].sum())
        self._blk = (first, bw, btape, rec, rev)
        PA = self.P[Aa]
        # the least-memory fallback on a long chain: keep x_a only and, for l = b-1 .. a,
        # advance from it to x_l and reverse step l: cost sum_l F(a, l), peak need_q
        l_all = np.arange(n)
        rev_l = S[l_all + 1] + t + np.maximum(S[l_all + 1] + self.of, S[l_all] + self.ob)
        self.quad_cost = np.zeros((N, N + 1))
        self.quad_need = np.zeros((N, N + 1), dtype=np.int64)
        for i in range(N):
            lo = A[i]
            ls = np.arange(lo, n)
            reach = np.empty(len(ls), dtype=np.int64)  # A(lo, l) for l > lo
            if len(ls) > 1:
                inner = np.concatenate(([self.first[lo]], self.W[lo + 1:n - 1]))
                reach[1:] = S[ls[1:] + 1] + np.maximum.accumulate(inner)
            reach[0] = 0
            peak = np.maximum(rev_l[lo:] + np.where(ls > lo, S[ls], 0), reach)
            cum_need = np.maximum.accumulate(peak)
            cum_cost = np.cumsum(self.P[ls] - self.P[lo])
            for j in range(i + 1, N + 1):
                self.quad_cost[i, j] = cum_cost[A[j] - 1 - lo]
                self.quad_need[i, j] = cum_need[A[j] - 1 - lo]
        for K in range(2, N + 1):
            rows = N - K + 1
            ix = np.arange(rows)
            jx = ix + K
            sb = S[Aa[jx]]
            best = _split_min(
                [[None] + [tab[:rows] for tab in self.coarse[1:K]]],
                lambda k, K=K, rows=rows: coarse_r[K - k][k:k + rows],
                lambda k, rows=rows: (PA[k:k + rows] - PA[:rows]).astype(_F32)[:, None],
                first[ix], lambda k, rows=rows: bw[k - 1:k - 1 + rows], sb, K, M + 1)[0]
            # record the whole first block, keep its tapes
            rec_c = _shift(self.coarse[K - 1][1:rows + 1], btape[ix])
            need = np.maximum(sb + rec[ix], rev[ix])
            rec_c[mcol[None, :] < need[:, None]] = _INF
            np.minimum(best, rec_c, out=best)
            qc = self.quad_cost[ix, ix + K].astype(_F32)
            qn = self.quad_need[ix, ix + K]
            quad = np.where(mcol[None, :] >= qn[:, None], qc[:, None], _INF)
            np.minimum(best, quad, out=best)
            for r in np.nonzero(Aa[ix + K] - Aa[ix] <= g)[0]:  # short enough: the exact value
                best[r] = self.fine[int(Aa[r + K] - Aa[r])][Aa[r]]
            self.coarse.append(best)
            coarse_r.append(_shift(best, S[Aa[:rows]]))

    # -- lookups and choices ---------------------------------------------------------------

    def cost(self, a: int, b: int, m: int) -> np.float32:
        if m < 0:
            return _INF
        L = b - a
        if L <= self.g:
            return self.fine[L][a, m]
        return self.coarse[self.index[b] - self.index[a]][self.index[a], m]

    def choose(self, a: int, b: int, m: int) -> tuple[str, int]:
        """``("base", 0)``, ``("record", steps)``, ``("split", c)`` or ``("quad", 0)``: a
        choice whose cost equals ``T(a, b, m)`` (recomputed with the tables' float32
        arithmetic, so the equality is exact)."""
        target = self.cost(a, b, m)
        L = b - a
        S = self.S
        if L == 1:
            return "base", 0
        if L <= self.g:
            if m >= int(self._record_need(a, b)) and \
                    self.cost(a + 1, b, m - int(self.t[a] + S[a + 1])) == target:
                return "record", 1
            adv = int(self.first[a])
            for c in range(a + 1, b):
                if c >= a + 2:
                    adv = max(adv, int(self.W[c - 1]))
                if m >= int(S[b]) + adv and m >= S[c]:
                    v = (self.fine[c - a][a, m] + self.fine[b - c][c, m - int(S[c])]) \
                        + self._f(a, c)
                    if v == target:
                        return "split", c
            raise AssertionError("no choice reproduces the table")  # pragma: no cover
        first, bw, btape, rec, rev = self._blk
        i, j = self.index[a], self.index[b]
        if m >= self.quad_need[i, j] and _F32(self.quad_cost[i, j]) == target:
            return "quad", 0
        if m >= max(int(S[b]) + int(rec[i]), int(rev[i])) and \
                self.cost(self.anchors[i + 1], b, m - int(btape[i])) == target:
            return "record", self.anchors[i + 1] - a
        adv = int(first[i])
        for k in range(i + 1, j):
            if k >= i + 2:
                adv = max(adv, int(bw[k - 1]))
            c = self.anchors[k]
            if m >= int(S[b]) + adv and m >= S[c]:
                v = (self.cost(a, c, m) + self.cost(c, b, m - int(S[c]))) + self._f(a, c)
                if v == target:
                    return "split", c
        raise AssertionError("no choice reproduces the table")  # pragma: no cover


# ----------------------------------------------------------------------------------------
# the schedule


class Hetero(Schedule):
    """The optimal schedule for a heterogeneous chain under a memory limit.

    Minimises the weighted advances ``sum f_i`` under the memory model of
    :mod:`deepsolve.schedules.hetero` (held snapshots, kept tapes, the current state, the
    adjoint and each action's transient never exceed ``memory``). Exact in ``mode="exact"``;
    optimal among block-aligned schedules in ``mode="blocks"`` (see the module docstring).

    Attributes:
        costs: the chain (bytes, or units when ``slots=None``).
        memory: the limit, in the same measure as ``costs``.
        units: the discretised chain and ``limit``: the program's own view.
        advance_cost: weighted advances of the plan (in ``costs.forward``'s unit).
        cost: ``advance_cost`` + one recording and one backward per step (``sum forward +
            sum backward``): the total compute.
        mode: ``"exact"`` or ``"blocks"``; ``block``: the block length in block mode.
    """

    kind = "hetero"

    def __init__(self, costs: ChainCosts, memory: int, *, slots: int | None = 256,
                 mode: str = "auto", block: int | None = None, charge_input: bool = True):
        if not isinstance(costs, ChainCosts):
            raise ValueError(f"costs must be a ChainCosts, got {type(costs).__name__}")
        memory = _memory("memory", memory)
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)
                                  or slots < 1):
            raise ValueError(f"slots must be an integer >= 1 or None, got {slots!r}")
        if slots is not None and memory == 0:
            raise ValueError("memory must be > 0 bytes to discretise it into slots")
        if mode not in ("auto", "exact", "blocks"):
            raise ValueError(f"mode must be 'auto', 'exact' or 'blocks', got {mode!r}")
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                                  or block < 2):
            raise ValueError(f"block must be an integer >= 2, got {block!r}")
        n = costs.n_steps
        self.n_steps = n
        self.costs = costs
        self.memory = memory
        self.charge_input = charge_input
        self.units, self.limit = costs.units(memory, slots)
        self.slots = {0: max(n, 1)}
        self._slots_arg = slots
        if mode == "exact":
            g = None
        elif mode == "blocks":
            g = block if block is not None else (
                _auto_block(np.asarray(self.units.states), self.limit) or 2)
        else:
            g = block if block is not None else _auto_block(np.asarray(self.units.states),
                                                              self.limit)
        if g is not None and g >= n:
            g = None
        self.mode = "exact" if g is None else "blocks"
        self.block = g
        assert costs.backward is not None  # ChainCosts.__post_init__ fills it
        self.fixed = sum(costs.forward) + sum(costs.backward)
        self._h0 = self.units.states[0] if charge_input else 0
        if n == 0:
            self._tables = None
            self.advance_cost = 0.0
            self.cost = 0.0
            return
        room = self.limit - self._h0
        self._tables = _Tables(self.units, self.limit, g) if room >= 0 else None
        value = self._tables.cost(0, n, room) if self._tables is not None else _INF
        if not np.isfinite(value):
            need = least_memory(costs, charge_input=charge_input)
            unit = "" if slots is None else " bytes"
            raise ValueError(
                f"memory {memory}{unit} cannot reverse this {n}-step chain; the least-memory "
                f"schedule (keep x_0 only, recompute every step) needs {need}{unit}"
                + ("" if slots is None else f" (sizes rounded up to memory/{slots})")
                + "; raise the memory")
        self.advance_cost = float(value)
        self.cost = self.advance_cost + self.fixed

    def _params(self) -> str:
        extra = f", block={self.block}" if self.block else ""
        return f"memory={self.memory}, slots={self._slots_arg}, mode={self.mode!r}{extra}"

    def __iter__(self) -> Iterator[Action]:
        n = self.n_steps
        if n == 0:
            return
        tab = self._tables
        assert tab is not None  # n > 0: __init__ built the tables (or raised)
        S = tab.S
        free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first
        # Frames: ("c", a, b, m, slot): reverse a .. b-1 with m free; x_a is held in `slot`,
        # or slot = -1: x_a is the current state, not stored. ("r", lo, hi): reverse the kept
        # tapes hi-1 .. lo.
        stack: list[tuple] = [("c", 0, n, self.limit - self._h0, -1)]
        current = 0
        while stack:
            frame = stack.pop()
            if frame[0] == "r":
                for i in range(frame[2] - 1, frame[1] - 1, -1):
                    yield Reverse(i)
                current = -1
                continue
            _, a, b, m, slot = frame
            kind, arg = tab.choose(a, b, m)
            if kind == "split":
                c = arg
                if slot < 0:
                    slot = free.pop()
                    yield Store(slot, a)
                elif current != a:
                    yield Restore(slot, a)
                yield Advance(a, c)
                current = c
                stack.append(("c", a, c, m, slot))
                stack.append(("c", c, b, m - int(S[c]), -1))
                continue
            if kind == "quad":  # least memory: keep x_a only, recompute every step from it
                if slot < 0:
                    slot = free.pop()
                    yield Store(slot, a)
                for i in range(b - 1, a - 1, -1):
                    if current != a:
                        yield Restore(slot, a)
                    if i > a:
                        yield Advance(a, i)
                    yield Reverse(i)
                    current = -1
                yield Free(slot, a)
                free.append(slot)
                continue
            if slot >= 0 and current != a:
                yield Restore(slot, a)
            current = a
            if kind == "base":
                yield Reverse(a)
                current = -1
                if slot >= 0:
                    yield Free(slot, a)
                    free.append(slot)
            else:  # record `arg` steps and keep their tapes (they hold x_a .. from now on)
                stop = a + arg
                yield Record(a, stop)
                current = stop
                if slot >= 0:
                    yield Free(slot, a)
                    free.append(slot)
                shift = int(tab.t[a:stop].sum() + S[a + 1:stop + 1].sum())
                stack.append(("r", a, stop))
                stack.append(("c", stop, b, m - shift, -1))

    def peak(self) -> int:
        """The schedule's peak under the memory model, in the program's units (interprets
        the stream with :func:`hetero_peak`); at most ``limit``."""
        return hetero_peak(self, self.units, charge_input=self.charge_input)


def hetero(costs: ChainCosts, memory: int, *, slots: int | None = 256, mode: str = "auto",
           block: int | None = None, charge_input: bool = True) -> Hetero:
    """The optimal schedule for a heterogeneous chain; see :class:`Hetero`.

    Args:
        costs: a :class:`ChainCosts` (sizes in bytes, or in units with ``slots=None``).
        memory: the limit in the same measure.
        slots: memory buckets for the program (sizes rounded up); ``None``: sizes are units.
        mode: ``"exact"``, ``"blocks"`` or ``"auto"`` (exact while the work is small).
        block: block length for ``mode="blocks"`` (default: chosen from the work).
        charge_input: count ``x_0`` against the memory (``False``: the caller holds it).

    Raises:
        ValueError: bad arguments, or a memory below what any schedule needs (the message
            gives the least-memory schedule's need).
    """
    return Hetero(costs, memory, slots=slots, mode=mode, block=block,
                  charge_input=charge_input)


def hetero_cost(costs: ChainCosts, memory: int, **kw) -> float:
    """Weighted advances of the optimal plan (``hetero(...).advance_cost``)."""
    return Hetero(costs, memory, **kw).advance_cost


def hetero_peak(schedule: Iterable[Action], costs: ChainCosts, *,
                charge_input: bool = True) -> int:
    """Peak memory of any schedule under the heterogeneous memory model (module docstring).

    Walks the schedule through :func:`~deepsolve.schedules.check` (so it is validated too)
    and returns the largest ``live states + kept tapes + adjoint + transient`` in the measure
    of ``costs``.
    """
    S, t = costs.states, costs.tapes
    of, ob = costs.forward_overhead, costs.backward_overhead
    assert of is not None and ob is not None  # ChainCosts.__post_init__ fills them
    n = costs.n_steps
    stored: dict[tuple[int, int], int] = {}
    refs: dict[int, int] = {}  # state index -> holders among slots and kept tapes
    kept: set[int] = set()
    st = {"cur": 0, "adj": n, "held": (S[0] if charge_input else 0), "tapes": 0, "peak": 0}

    def size(i: int) -> int:
        return 0 if (i == 0 and not charge_input) else S[i]

    def hold(i: int) -> None:
        refs[i] = refs.get(i, 0) + 1
        if refs[i] == 1 and i != st["cur"]:
            st["held"] += size(i)

    def drop(i: int) -> None:
        refs[i] -= 1
        if refs[i] == 0:
            del refs[i]
            if i != st["cur"]:
                st["held"] -= size(i)

    def set_cur(i: int) -> None:  # the current state is live unless someone else holds it
        old = st["cur"]
        if old >= 0 and old not in refs:
            st["held"] -= size(old)
        st["cur"] = i
        if i >= 0 and i not in refs:
            st["held"] += size(i)

    def base() -> int:
        return st["held"] + st["tapes"] + S[st["adj"]]

    def note(v: int) -> None:
        if v > st["peak"]:
            st["peak"] = v

    def tap() -> Iterator[Action]:
        for action in schedule:
            yield action  # check() validates it before we account for it
            if type(action) is Advance:
                for i in range(action.start, action.stop):
                    note(base() + S[i + 1] + of[i])
                    set_cur(i + 1)
            elif type(action) is Record:
                for i in range(action.start, action.stop):
                    note(base() + t[i] + S[i + 1] + of[i])
                    hold(i)
                    kept.add(i)
                    st["tapes"] += t[i]
                    set_cur(i + 1)
            elif type(action) is Reverse:
                i = action.index
                if i in kept:
                    note(base() + S[i] + ob[i])
                    kept.discard(i)
                    st["tapes"] -= t[i]
                    drop(i)
                else:
                    note(base() + t[i] + max(S[i + 1] + of[i], S[i] + ob[i]))
                set_cur(-1)
                st["adj"] = i
            elif type(action) is Store:
                stored[(action.level, action.slot)] = action.index
                hold(action.index)
            elif type(action) is Free:
                drop(stored.pop((action.level, action.slot)))
            elif type(action) is Restore:
                set_cur(action.index)
            note(base())

    check(tap(), n_steps=n, slots=getattr(schedule, "slots", None))
    return st["peak"]
