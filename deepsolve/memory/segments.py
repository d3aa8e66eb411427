"""Choosing the segment length of a compiled unroll (``unroll(..., compile=...)``).

A compiled segment runs ``k`` steps as one graph (:mod:`deepsolve.engine.segments`). What
it saves is PyTorch's per-operation dispatch; what it costs is a per-call overhead (guards,
the compiled function's wrappers, autograd's node), a tape ``k`` times a step's, and a
compile time that grows with the unrolled graph. The model, per step evaluation, from the
eager profile (:class:`~deepsolve.memory.profiling.StepProfile`) and two cheap measurements
(:func:`dispatch_cost`: ``q`` operations per step, ``d`` seconds of dispatch per operation)::

    advance   t_a(k) = O_a d + k max(t_advance - q d, f t_advance)
    record    t_r(k) = O_r d + k max(t_record + t_backward - 3 q d, f (t_record + t_backward))
    compile   C(k)   = C_0 + C_1 k q                                (a cold compile cache)
    run       T(k)   = A(m, s) t_a(k) + m t_r(k),   m = ceil(n / k)

``A(m, s)`` the strategy's unrecorded evaluations of the ``m``-segment chain; ``O_a = 30``,
``O_r = 200`` dispatches of per-call overhead, ``f = 0.1`` the floor of the arithmetic left
after dispatch, ``C_0 = 12`` s (most of it the compiler's start in a fresh process) and
``C_1 = 0.075`` s per operation: measured on the 2-core
CPU of docs/benchmarks.md ("Compiled segments"; on a faster machine all scale together).
Under a budget the tape of a segment is ``k`` tapes, so ``s`` shrinks as ``k`` grows: each
``k`` is planned with the segment's modelled profile, and the plan that runs is made from
the *measured* profile of the compiled segment, so the budget keeps its promise.

The choice: the ``k`` in ``1, 2, 4, ..., 64`` with the least ``runs T(k) + C(k)`` (``runs``:
how many unrolls of this step the compile time is spread over — the trainer passes its
iterations; ``compile=True`` without ``compile_runs`` assumes :data:`HORIZON` = 20), so a
longer run affords a longer segment. ``compile="auto"`` compiles only when that beats
``runs T_eager`` by 10 %, so a short run, or a step whose time is arithmetic rather than
dispatch, stays eager.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import cuda_devices, get_rng, set_rng
from .profiling import StepProfile

__all__ = ["SegmentChoice", "choose_segment", "dispatch_cost", "segment_profile",
           "SEGMENT_LENGTHS", "MODEL", "HORIZON"]

#: unrolls the compile time is spread over by ``compile=True`` without ``compile_runs``
HORIZON = 20

#: segment lengths weighed
SEGMENT_LENGTHS = (1, 2, 4, 8, 16, 32, 64)
#: the model's constants (module docstring): per-call overheads in dispatches, the floor of
#: compiled arithmetic, the compile time's base [s] and its cost per operation [s]
MODEL = dict(overhead_advance=30.0, overhead_record=200.0, floor=0.1, compile_base=12.0,
             compile_per_op=0.075, margin=0.9)


@dataclass
class SegmentChoice:
    """The segment length chosen and why (shown by ``Plan.explain()``).

    Attributes:
        k: steps per compiled segment (``0``: eager, not compiled).
        reason: one line.
        eager_time: predicted seconds of one eager unroll (forward and reverse).
        compiled_time: predicted seconds of one compiled unroll with ``k``.
        compile_time: predicted compile seconds (a cold cache).
        runs: unrolls the compile time is spread over.
        table: ``(k, compiled_time, compile_time, fits)`` of every length weighed.
    """

    k: int
    reason: str
    eager_time: float = 0.0
    compiled_time: float = 0.0
    compile_time: float = 0.0
    runs: int = 1
    table: list[tuple[int, float, float, bool]] = dataclasses.field(default_factory=list)

    def explain(self) -> str:
        lines = [f"compiled segments: {self.reason}",
                 f"  {'k':>4} {'unroll [s]':>11} {'compile [s]':>12}  fits",
                 f"  {'eager':>4} {self.eager_time:>11.3g} {0:>12}  yes"]
        for k, t, c, fits in self.table:
            mark = "*" if k == self.k else " "
            lines.append(f"{mark} {k:>4} {t:>11.3g} {c:>12.3g}  {'yes' if fits else 'no'}")
        return "\n".join(lines)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


_dispatch: dict[Any, tuple[int, float]] = {}


def dispatch_cost(step: Callable, state: Any) -> tuple[int, float]:
    """``(q, d)``: the operations one unrecorded step dispatches and the seconds one
    dispatch of a tiny operation costs here (cached per step; the random generators are
    left as they were)."""
    key = (getattr(step, "__func__", step), id(getattr(step, "__self__", None)))
    if key in _dispatch:
        return _dispatch[key]
    count = _Count()
    cuda = cuda_devices([t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)])
    rng = get_rng(cuda)  # a stochastic step's stream is left where it was
    try:
        with torch.no_grad(), count:
            step(state, 0)
    finally:
        set_rng(rng, cuda)
    x = torch.zeros(1)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(200):
            x = x + 1
        best = min(best, (time.perf_counter() - t0) / 200)
    try:
        _dispatch[key] = (max(count.n, 1), best)
    except TypeError:  # unhashable step
        pass
    return max(count.n, 1), best


def segment_profile(p: StepProfile, k: int, q: int, d: float) -> StepProfile:
    """The modelled profile of a compiled ``k``-step segment (module docstring): ``k``
    tapes, outputs and working-set increments; compiled times."""
    m = MODEL
    t_adv = m["overhead_advance"] * d + k * max(p.t_advance - q * d, m["floor"] * p.t_advance)
    rec = p.t_record + p.t_backward
    t_rec = m["overhead_record"] * d + k * max(rec - 3 * q * d, m["floor"] * rec)
    share = p.t_record / rec if rec > 0 else 0.5
    grow = k - 1
    return dataclasses.replace(
        p, tape_bytes=k * p.tape_bytes, kept_bytes=k * p.kept_bytes,
        chain_bytes=k * p.chain_bytes, output_bytes=k * p.output_bytes,
        reverse_bytes=p.reverse_bytes + grow * max(p.kept_bytes, p.tape_bytes),
        advance_bytes=p.advance_bytes, t_advance=t_adv, t_record=share * t_rec,
        t_backward=(1 - share) * t_rec)


def _absolute(strategy_time: float, prof: StepProfile, m: int) -> float:
    return strategy_time * m * (prof.t_record + prof.t_backward)


def choose_segment(p: StepProfile, n_steps: int, q: int, d: float, *, mode: Any = True,
                   runs: int = 1, time_of: Callable[[StepProfile, int], tuple[float, bool]],
                   lengths: tuple[int, ...] = SEGMENT_LENGTHS) -> SegmentChoice:
    """The segment length for ``n_steps`` steps (module docstring).

    ``time_of(profile, m) -> (relative time, fits)``: the strategy's (or the budget's best
    plan's) predicted time for an ``m``-step chain of that profile, relative to its plain
    unroll, and whether it fits the memory asked for. ``mode``: ``True`` (compile, the best
    ``k``), ``"auto"`` (compile only when it pays within ``runs`` unrolls)."""
    runs = max(1, int(runs))
    rel, _ = time_of(p, n_steps)
    eager = _absolute(rel, p, n_steps)
    table: list[tuple[int, float, float, bool]] = []
    for k in lengths:
        if k > max(1, n_steps):
            break
        prof = segment_profile(p, k, q, d)
        m = -(-n_steps // k)
        rel_k, fits = time_of(prof, m)
        table.append((k, _absolute(rel_k, prof, m),
                      MODEL["compile_base"] + MODEL["compile_per_op"] * k * q, fits))
    ok = [row for row in table if row[3]]
    if not ok:
        return SegmentChoice(0, "no segment length fits: eager steps", eager, runs=runs,
                             table=table)
    best = min((runs * t + c, k, t, c) for k, t, c, _ in ok)
    total, k, t, c = best
    choice = SegmentChoice(k, "", eager, t, c, runs, table)
    gain = runs * eager / total if total > 0 else 1.0
    if mode == "auto" and total > MODEL["margin"] * runs * eager:
        choice.k = 0
        choice.reason = (f"eager: compiling (best k = {k}) would save "
                         f"{max(runs * (eager - t), 0):.2g} s over {runs} unroll(s) for "
                         f"{c:.0f} s of compile — not repaid with the 10 % margin")
        return choice
    choice.reason = (f"k = {k} steps per segment: predicted {t:.3g} s per unroll against "
                     f"{eager:.3g} s eager, {c:.0f} s to compile (cold cache), {gain:.2f}x "
                     f"faster over {runs} unroll(s) compile included")
    return choice
