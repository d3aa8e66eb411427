"""Choosing the segment length of a compiled unroll (``unroll(..., compile=...)``).

A compiled segment runs ``k`` steps as one graph (:mod:`deepsolve.engine.segments`). What
it saves is PyTorch's per-operation dispatch and, where the step is pointwise arithmetic,
memory traffic (the compiler fuses the operations into a few loops); what it costs is a
per-call overhead (guards, the compiled function's wrappers, autograd's node), a tape ``k``
times a step's, and a compile time that grows with the unrolled graph. The model, per step
evaluation, from the eager profile (:class:`~deepsolve.memory.profiling.StepProfile`, its
times scaled to the step's eager time ``t`` measured outside the profiler) and cheap
measurements (:class:`Dispatch`: ``q`` operations per step, ``d`` seconds of dispatch per
operation, whether the step has heavy operations — products, convolutions, FFTs, solves)::

    arithmetic  a = t_advance - q d           (r = t_record + t_backward: r - 3 q d)
    advance     t_a(k) = O_a d + k max(phi a, f t_advance)
    record      t_r(k) = O_r d + k max(phi (r - 3 q d), f r)
    compile     C(k)   = C_0 + C_1 (k q)^1.15                  (an empty compile cache)
    run         T(k)   = A(m, s) t_a(k) + m t_r(k),   m = ceil(n / k)

``A(m, s)`` the strategy's unrecorded evaluations of the ``m``-segment chain; ``O_a = 30``,
``O_r = 200`` dispatches of per-call overhead; ``phi = 1/4`` the arithmetic left after
fusing a step of pointwise operations (``1`` for a step with heavy operations, which the
compiler calls as they are); ``f = 0.1`` a floor; ``C_0 = 12`` s (most of it the compiler's
start in a fresh process), ``C_1 = 0.036`` s. Measured on the 2-core CPU of
docs/benchmarks.md ("Compiled segments beside diffrax": Lorenz-96, finite-difference PDEs
of 4k and 64k points, the Navier–Stokes step); on a faster machine all scale together.
Under a budget the tape of a segment is ``k`` tapes, so ``s`` shrinks as ``k`` grows: each
``k`` is planned with the segment's modelled profile, and the plan that runs is made from
the *measured* profile of the compiled segment, so the budget keeps its promise.

The choice: the ``k`` in ``1, 2, 4, ..., 64`` with the least ``runs T(k) + C(k)`` (``runs``:
how many unrolls of this step the compile time is spread over — the trainer passes its
iterations; ``compile=True`` without ``compile_runs`` assumes :data:`HORIZON` = 20), so a
longer run affords a longer segment. ``compile="auto"`` compiles only when that beats
``runs T_eager`` by 10 %, so a short run, or a step whose time is heavy arithmetic rather
than dispatch, stays eager.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import EXPENSIVE_OPS, RngState, StepCache, cuda_devices
from .meter import process_status
from .profiling import StepProfile

__all__ = ["SegmentChoice", "Dispatch", "choose_segment", "dispatch_cost", "segment_profile",
           "compile_seconds", "loop_lengths",
           "SEGMENT_LENGTHS", "LOOP_LENGTHS", "LOOP_FREE_BYTES", "MODEL", "HORIZON",
           "COMPILER_ESTIMATE", "compiler_memory", "measure_compiler", "CompilerProbe"]

#: unrolls the compile time is spread over by ``compile=True`` without ``compile_runs``
HORIZON = 20
#: host bytes assumed for the compiler's first use in a process before it is measured
#: (measured on the benchmarks' steps: 240-350 MiB of resident growth, CPU, torch 2.13)
COMPILER_ESTIMATE = 320 * 2**20
_compiler: dict[str, int] = {}  # the first measured compile in this process: resident, peak


def compiler_memory() -> tuple[int, int] | None:
    """``(resident, peak)`` host bytes of the first compile measured in this process (what
    stays resident, and its transient peak above the resident size before it); ``None``
    before one was measured."""
    if not _compiler:
        return None
    return _compiler["resident"], _compiler["peak"]


class CompilerProbe:
    """Measures the one-time host memory of the process's first compiled unroll.

    Started before the unroll prepares its compiled path (the choice of ``k``, which profiles
    and counts the eager step) and finished after the first segment is compiled and
    profiled: what that preparation leaves resident (growth of ``VmRSS``) and its transient
    peak above the resident size at the start, each rounded up to a MiB, are kept for the
    process (:func:`compiler_memory`). Later compiles keep the first figures, so that a
    warmed call plans as the first did (as :mod:`~deepsolve.memory.library` does for the
    policy machinery). Measured on the 64x64 Navier–Stokes step (float64, CPU): 60 MiB for
    the choice, 80 MiB for the compile, 40 MiB for the segment's first profile.

    The high-water mark is read, never reset: a caller's own meter around the unroll (the
    trainer's per-iteration real peak) keeps what it measured before the compile. The peak
    is exact when the preparation raised the mark (a fresh process); when an earlier peak
    of the process stays above it, the resident growth stands in for it.
    """

    def __init__(self) -> None:
        self.active = not _compiler
        if self.active:
            self.before = process_status("VmRSS:")
            self.mark = process_status("VmHWM:")

    def finish(self) -> tuple[int, int]:
        """Record the figures (once per process) and return :func:`compiler_memory`."""
        if self.active and not _compiler:
            resident = max(process_status("VmRSS:") - self.before, 0)
            mark = process_status("VmHWM:")
            peak = max(mark - self.before, resident) if mark > self.mark else resident
            _compiler["resident"] = -(-resident // 2**20) * 2**20
            _compiler["peak"] = -(-peak // 2**20) * 2**20
        got = compiler_memory()
        assert got is not None
        return got


def measure_compiler(run: Callable[[], Any]) -> tuple[int, int]:
    """Run ``run()`` (the first compile of a segment) inside a :class:`CompilerProbe` and
    return :func:`compiler_memory`."""
    probe = CompilerProbe()
    run()
    return probe.finish()

#: segment lengths weighed for the unrolled form (no longer: its compile can grow
#: exponentially with the length, :data:`deepsolve.engine.segments.UNROLLED_MAX`)
SEGMENT_LENGTHS = (1, 2, 4, 8)
#: segment lengths weighed for the loop form (up to the chain's length and the tape rule)
LOOP_LENGTHS = tuple(2**j for j in range(3, 13))
#: a loop segment's tape (``k`` states) may exceed the snapshots' memory up to this many
#: bytes: a cheap, small step gets long loops, a large state loops no further than the
#: interval between two snapshots
LOOP_FREE_BYTES = 4 * 2**20
#: the model's constants (module docstring): per-call overheads in dispatches, the floor of
#: compiled arithmetic, what fusion leaves of pointwise arithmetic, the compile time's base
#: [s], its cost per operation [s] and the power of the graph size it grows with; for the
#: loop form its per-call and per-iteration overheads in dispatches, and the unrolled steps
#: its compile costs as
MODEL = dict(overhead_advance=30.0, overhead_record=200.0, floor=0.1, fused=0.25,
             compile_base=12.0, compile_per_op=0.036, compile_power=1.15, margin=0.9,
             loop_call_advance=40.0, loop_call_record=150.0, loop_step_advance=2.0,
             loop_step_record=6.0, loop_compile_steps=4.0)


@dataclass
class SegmentChoice:
    """The segment length and form chosen and why (shown by ``Plan.explain()``).

    Attributes:
        k: steps per compiled segment (``0``: eager, not compiled).
        reason: one line.
        eager_time: predicted seconds of one eager unroll (forward and reverse).
        compiled_time: predicted seconds of one compiled unroll with ``k``.
        compile_time: predicted compile seconds (a cold cache).
        runs: unrolls the compile time is spread over.
        table: ``(k, form, compiled_time, compile_time, fits)`` of every segment weighed.
        form: ``"unrolled"`` or ``"loop"`` (:data:`deepsolve.engine.segments.FORMS`).
    """

    k: int
    reason: str
    eager_time: float = 0.0
    compiled_time: float = 0.0
    compile_time: float = 0.0
    runs: int = 1
    table: list[tuple[int, str, float, float, bool]] = dataclasses.field(default_factory=list)
    form: str = "unrolled"

    def explain(self) -> str:
        lines = [f"compiled segments: {self.reason}",
                 f"  {'k':>5} {'form':>9} {'unroll [s]':>11} {'compile [s]':>12}  fits",
                 f"  {'eager':>5} {'':>9} {self.eager_time:>11.3g} {0:>12}  yes"]
        for k, form, t, c, fits in self.table:
            mark = "*" if (k, form) == (self.k, self.form) else " "
            lines.append(f"{mark} {k:>5} {form:>9} {t:>11.3g} {c:>12.3g}  "
                         f"{'yes' if fits else 'no'}")
        return "\n".join(lines)


class Dispatch(NamedTuple):
    """What :func:`dispatch_cost` measures of a step."""

    q: int  #: operations one unrecorded step dispatches
    d: float  #: seconds one dispatch of a tiny operation costs here
    heavy: bool  #: the step has products, convolutions, FFTs or solves (not fused away)
    t_step: float  #: seconds of one unrecorded eager step, measured in the calling thread


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.heavy = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.heavy = self.heavy or func in EXPENSIVE_OPS
        return func(*args, **(kwargs or {}))


_dispatch = StepCache()  # per step, without keeping the step alive


def dispatch_cost(step: Callable, state: Any) -> Dispatch:
    """The step's :class:`Dispatch` (cached per step; the random generators are left as they
    were): its operations counted in one unrecorded step, then three more timed."""
    known = _dispatch.get(step)
    if known is not None:
        return known
    count = _Count()
    cuda = cuda_devices([t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)])
    rng = RngState.capture(cuda)  # a stochastic step's stream is left where it was
    t_step = float("inf")
    try:
        with torch.no_grad():
            with count:
                step(state, 0)
            for _ in range(3):
                t0 = time.perf_counter()
                step(state, 0)
                if cuda:
                    torch.cuda.synchronize()
                t_step = min(t_step, time.perf_counter() - t0)
    finally:
        rng.restore()
    x = torch.zeros(1)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(200):
            x = x + 1
        best = min(best, (time.perf_counter() - t0) / 200)
    got = Dispatch(max(count.n, 1), best, count.heavy, t_step)
    _dispatch.put(step, got)
    return got


def _scaled(p: StepProfile, t_step: float | None) -> StepProfile:
    """The profile's times scaled to the eager step time measured outside the profiler (the
    profiler's own thread and allocator counters slow large steps)."""
    if not t_step or p.t_advance <= 0:
        return p
    c = t_step / p.t_advance
    return dataclasses.replace(p, t_advance=t_step, t_record=c * p.t_record,
                               t_backward=c * p.t_backward)


def compile_seconds(k: int, q: int, form: str = "unrolled") -> float:
    """The predicted compile time of a ``k``-step segment of ``q`` operations per step: of
    ``k`` steps unrolled, or of one loop body whatever ``k`` (``form="loop"``)."""
    m = MODEL
    if form == "loop":
        k = int(m["loop_compile_steps"])
    return m["compile_base"] + m["compile_per_op"] * (k * q) ** m["compile_power"]


def segment_profile(p: StepProfile, k: int, q: int, d: float,
                    heavy: bool = True, form: str = "unrolled") -> StepProfile:
    """The modelled profile of a compiled ``k``-step segment (module docstring). Unrolled:
    ``k`` tapes, outputs and working-set increments, compiled times. A loop: its tape the
    ``k`` states it carries (the backward runs each step again from its state), per-call
    and per-iteration overheads, the step's own arithmetic fused but not across steps."""
    m = MODEL
    phi = 1.0 if heavy else m["fused"]
    rec = p.t_record + p.t_backward
    share = p.t_record / rec if rec > 0 else 0.5
    arith_adv = max(phi * (p.t_advance - q * d), m["floor"] * p.t_advance)
    if form == "loop":
        t_adv = m["loop_call_advance"] * d + k * (m["loop_step_advance"] * d + arith_adv)
        arith_rec = max(phi * (rec - 3 * q * d), m["floor"] * rec) + arith_adv
        t_rec = m["loop_call_record"] * d + k * (m["loop_step_record"] * d + arith_rec)
        carried = k * p.state_bytes
        return dataclasses.replace(
            p, tape_bytes=carried + p.tape_bytes, kept_bytes=carried + p.kept_bytes,
            chain_bytes=carried + p.chain_bytes, output_bytes=k * p.output_bytes,
            reverse_bytes=p.reverse_bytes + carried, advance_bytes=p.advance_bytes,
            t_advance=t_adv, t_record=share * t_rec, t_backward=(1 - share) * t_rec)
    t_adv = m["overhead_advance"] * d + k * arith_adv
    t_rec = m["overhead_record"] * d + k * max(phi * (rec - 3 * q * d), m["floor"] * rec)
    grow = k - 1
    return dataclasses.replace(
        p, tape_bytes=k * p.tape_bytes, kept_bytes=k * p.kept_bytes,
        chain_bytes=k * p.chain_bytes, output_bytes=k * p.output_bytes,
        reverse_bytes=p.reverse_bytes + grow * max(p.kept_bytes, p.tape_bytes),
        advance_bytes=p.advance_bytes, t_advance=t_adv, t_record=share * t_rec,
        t_backward=(1 - share) * t_rec)


def loop_lengths(n_steps: int, state_bytes: int, snapshots: int | None) -> tuple[int, ...]:
    """The loop lengths weighed for ``n_steps`` steps: :data:`LOOP_LENGTHS` up to ``n``,
    each loop's tape (``k`` states) within the snapshots' memory (``snapshots`` states)
    or :data:`LOOP_FREE_BYTES` — long loops for a small state, none longer than the
    interval between two snapshots for a large one. ``snapshots=None`` (a chain kept
    whole, or a budget, which weighs the tape itself): up to ``n``."""
    room = None
    if snapshots is not None:
        room = max(snapshots * state_bytes, LOOP_FREE_BYTES)
    return tuple(k for k in LOOP_LENGTHS if k <= n_steps and
                 (room is None or k * state_bytes <= room))


def _absolute(strategy_time: float, prof: StepProfile, m: int) -> float:
    return strategy_time * m * (prof.t_record + prof.t_backward)


def choose_segment(p: StepProfile, n_steps: int, q: int, d: float, *, mode: Any = True,
                   runs: int = 1, time_of: Callable[[StepProfile, int], tuple[float, bool]],
                   lengths: tuple[int, ...] = SEGMENT_LENGTHS, heavy: bool = True,
                   t_step: float | None = None, eager: float | None = None,
                   loops: tuple[int, ...] = ()) -> SegmentChoice:
    """The segment length and form for ``n_steps`` steps (module docstring).

    ``time_of(profile, m) -> (relative time, fits)``: the strategy's (or the budget's best
    plan's) predicted time for an ``m``-step chain of that profile, relative to its plain
    unroll, and whether it fits the memory asked for. ``mode``: ``True`` (compile, the best
    ``k``), ``"auto"`` (compile only when it pays within ``runs`` unrolls). ``heavy`` and
    ``t_step``: from :class:`Dispatch` (default: no fusion gain, the profile's times).
    ``eager``: the measured seconds of an eager unroll, in place of the model's; the
    compiled predictions are scaled by the same measured / modelled ratio. ``lengths``: the
    unrolled segments weighed; ``loops``: the loop segments (:func:`loop_lengths`)."""
    runs = max(1, int(runs))
    p = _scaled(p, t_step)
    rel, _ = time_of(p, n_steps)
    modelled = _absolute(rel, p, n_steps)
    # a measured eager unroll scales the compiled predictions alike: what the model misses
    # (the executor's per-step work) is not removed by compiling
    scale = eager / modelled if eager and modelled > 0 else 1.0
    eager = modelled if eager is None else eager
    table: list[tuple[int, str, float, float, bool]] = []
    weighed = [(k, "unrolled") for k in lengths if k <= max(1, n_steps)] + \
        [(k, "loop") for k in loops if 1 < k <= n_steps]
    for k, form in weighed:
        prof = segment_profile(p, k, q, d, heavy, form)
        m = -(-n_steps // k)
        rel_k, fits = time_of(prof, m)
        table.append((k, form, scale * _absolute(rel_k, prof, m),
                      compile_seconds(k, q, form), fits))
    ok = [row for row in table if row[4]]
    if not ok:
        return SegmentChoice(0, "no segment length fits: eager steps", eager, runs=runs,
                             table=table)
    total, k, form, t, c = min((runs * t + c, k, form, t, c) for k, form, t, c, _ in ok)
    choice = SegmentChoice(k, "", eager, t, c, runs, table, form)
    gain = runs * eager / total if total > 0 else 1.0
    what = f"a loop of {k} steps" if form == "loop" else f"k = {k} steps unrolled"
    if mode == "auto" and total > MODEL["margin"] * runs * eager:
        choice.k = 0
        choice.reason = (f"eager: compiling (best: {what}) would save "
                         f"{max(runs * (eager - t), 0):.2g} s over {runs} unroll(s) for "
                         f"{c:.0f} s of compile — not repaid with the 10 % margin")
        return choice
    why = (" (the step compiled once as a loop body: its compile does not grow with k)"
           if form == "loop" else "")
    choice.reason = (f"{what} per segment{why}: predicted {t:.3g} s per unroll against "
                     f"{eager:.3g} s eager, {c:.0f} s to compile (cold cache), {gain:.2f}x "
                     f"faster over {runs} unroll(s) compile included")
    return choice
