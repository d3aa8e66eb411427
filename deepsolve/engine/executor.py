"""The executor of :func:`deepsolve.unroll`: a checkpoint schedule as an autograd Function.

``final = execute(step, x0, schedule)`` computes ``x_{i+1} = step(x_i, i)`` for ``i = 0 .. n-1``
and returns ``x_n`` so that ``final`` (and per-step outputs) can be differentiated with
respect to ``x0``, to the parameters of the modules the step uses and to tensors it closes
over. Instead of keeping every step's activations (``n`` recorded steps), it follows a
checkpoint schedule from :mod:`deepsolve.schedules`: the forward sweep keeps only the
snapshots the schedule asks for, and the reverse sweep restores them, recomputes, records
one step at a time and pulls the adjoint through it::

    lambda_n = dL/dx_n,
    lambda_i = J_i(x_i)^T lambda_{i+1} + (dL/dy_i)^T dy_i/dx_i,
    dL/dtheta = sum_i (dx_{i+1}/dtheta)^T lambda_{i+1} + (dy_i/dtheta)^T dL/dy_i,

each term from ``torch.autograd.grad`` on the recorded step ``i`` (``y_i`` are per-step
outputs). Memory: ``s`` snapshots + one recorded step; time: ``t(n, s)`` unrecorded and ``n``
recorded steps (Griewank & Walther, ACM TOMS 26(1), 2000). The gradients are those of plain
backpropagation, bit for bit up to the order of floating-point summation of parameter
gradients: recomputed steps replay the same RNG stream and autocast settings
(:class:`~deepsolve.engine.replay.Replay`).

:class:`UnrollRun` supplies the steps to the one action interpreter
(:class:`~deepsolve.engine.interpreter.Interpreter`): unrecorded steps with per-step
outputs, kept recordings (under a recomputation policy,
:mod:`deepsolve.engine.policies`), the recorded reverse step, and the forward sweep of an
unknown-length (online) unroll. It knows nothing of budgets or files.

Trust: every action is checked against the interpreter's state before it runs, every state
a step returns against the forward sweep's structure, shapes, dtypes and devices
(:class:`~deepsolve.engine.state.Step`), every recorded step's graph against the tensors
being differentiated (:func:`~deepsolve.engine.graph.unseen_leaf`), and state leaves returned
as constants are checked to stay constants; each misfit is a one-line error.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch.utils import _pytree as pytree

from ..schedules import Online, Schedule, revolve, shifted
from ..schedules.actions import Free, Reverse, Store
from ..schedules.check import ScheduleError
from .finite import EVERY, FiniteCheck, all_finite
from .graph import constant_leaves, discover, pull_back, sequence_marker, unseen_leaf
from .interpreter import GradSum, Interpreter, Misfit, SweepStats
from .policies import CompiledPolicy, Recorder, policy_context, policy_name
from .replay import Replay, cuda_devices
from .reversal import ReconstructionError, Reversal, relative_error
from .state import Step, flatten_state, is_diff, unflatten
from .storage import check_snapshot_dtype

__all__ = ["execute", "Truncation", "UnrollStats", "UnrollRun", "Tape", "check_truncate"]


@dataclass
class UnrollStats(SweepStats):
    """What one unroll did; pass an instance as ``unroll(..., stats=s)`` to have it filled.

    The forward fields are set when ``unroll`` returns, the backward ones when the reverse
    sweep has run.

    Attributes:
        n_steps: length of the chain.
        schedule: ``repr`` of the schedule used.
        advances: unrecorded step evaluations (forward sweep and recomputation).
        recorded: recorded step evaluations (each step once).
        snapshots_peak: most snapshots held at once, over all storage levels (the initial
            state included).
        snapshot_bytes_peak: most device-memory (level 0) snapshot bytes held at once, the
            caller's initial state excluded.
        state_bytes: bytes of one state.
        forward_time, backward_time: wall time of the two sweeps [s].
        extra: further facts: ``"params"`` (number of tensors differentiated), ``"policy"``
            (the recomputation policy of kept tapes, when one is set), ``"snapshot_dtype"``
            (when snapshots are stored in a smaller dtype), ``"plan"`` (with ``budget=``),
            ``"online_snapshots"`` (with ``until=`` and ``budget=``), ``"truncate"``
            (the window length of a truncated unroll), ``"recomputed_windows"`` (windows of
            a reversible unroll recomputed because their rebuilt states drifted).
        inverses: states rebuilt by the step's inverse (a reversible unroll).
        reconstruction_error: the largest relative drift (:func:`~deepsolve.engine.reversal.
            relative_error`) of a state rebuilt by the inverse against its stored snapshot,
            over the snapshots of a reversible unroll; ``None`` when nothing was rebuilt.
        adjoint_norms: give ``True`` to have it filled: after the backward, a float64 CPU
            tensor of length ``n_steps + 1`` whose entry ``i`` is the 2-norm over all state
            leaves of the adjoint ``dL/dx_i`` as the reverse sweep computed it (before an
            ``adjoint_hook`` changes it; NaN where autograd computes none: ``x_0`` of a
            store-all unroll that does not require grad). ``False`` (default): nothing is
            computed.
        segment: steps per compiled segment (``unroll(..., compile=...)``); the counts
            above are then segment evaluations, each ``segment`` steps (the last fewer).
            ``1``: single steps.
        compile_time: seconds this unroll spent compiling segments and checking them against
            the eager steps (first calls); ``0`` when the compiled code was reused.
    """

    n_steps: int = 0
    snapshots_peak: int = 0
    snapshot_bytes_peak: int = 0
    state_bytes: int = 0
    inverses: int = 0
    reconstruction_error: float | None = None
    adjoint_norms: Any = False
    segment: int = 1
    compile_time: float = 0.0

    def __repr__(self) -> str:
        """One line: the counts, the times and the names of the ``extra`` facts (the plan
        and the profile in full: :meth:`explain`)."""
        extra = f", extra=[{', '.join(map(str, self.extra))}]" if self.extra else ""
        return (f"UnrollStats(n_steps={self.n_steps}, schedule={self.schedule!r}, "
                f"advances={self.advances}, recorded={self.recorded}, "
                f"snapshots_peak={self.snapshots_peak}, "
                f"snapshot_bytes_peak={self.snapshot_bytes_peak}, "
                f"forward_time={self.forward_time:.4g}, backward_time={self.backward_time:.4g}"
                f"{extra})")

    __str__ = __repr__

    def explain(self) -> str:
        """Everything, one fact per line: the counts and times, then each ``extra`` entry
        (a plan's own ``explain()`` text in full)."""
        lines = [f"unroll of {self.n_steps} steps: {self.schedule or '(not run)'}",
                 f"  step evaluations: {self.advances} unrecorded, {self.recorded} recorded",
                 f"  snapshots: at most {self.snapshots_peak} held, "
                 f"{self.snapshot_bytes_peak} bytes at most in device memory; one state "
                 f"{self.state_bytes} bytes",
                 f"  time: forward {self.forward_time:.4g} s, backward {self.backward_time:.4g} s"]
        if self.segment > 1 or self.compile_time:
            lines.append(f"  compiled segments of {self.segment} step(s); first calls "
                         f"(compile and check) {self.compile_time:.3g} s")
        if self.inverses or self.reconstruction_error is not None:
            err = self.reconstruction_error
            lines.append(f"  reversible: {self.inverses} states rebuilt by the inverse, "
                         f"largest relative drift at a snapshot "
                         f"{'-' if err is None else format(err, '.3g')}")
        if isinstance(self.adjoint_norms, torch.Tensor):
            a = self.adjoint_norms
            lines.append(f"  adjoint norms: {a.numel()} values, |dL/dx_n| {float(a[-1]):.4g}, "
                         f"|dL/dx_0| {float(a[0]):.4g}")
        for k, v in self.extra.items():
            text = v.explain() if callable(getattr(v, "explain", None)) else repr(v)
            head, *rest = str(text).splitlines() or [""]
            lines.append(f"  {k}: {head}")
            lines.extend(f"    {ln}" for ln in rest)
        return "\n".join(lines)


class Tape(NamedTuple):
    """One recorded step: its detached inputs ``x_in`` (leaves that are differentiated
    require grad), the next state ``y`` and the outputs ``out``, with their graph."""

    x_in: list[torch.Tensor]
    y: list[torch.Tensor]
    out: Sequence[torch.Tensor]


class UnrollRun(Interpreter):
    """One unroll: the forward sweep in ``forward`` (or ``forward_online``), the reverse
    sweep in ``backward``; the action loop is :class:`Interpreter`'s."""

    who = "unroll"
    unit = "step"
    final: list[torch.Tensor] | None  # the forward sweep's results, until _UnrollFunction
    outs: list | None                 # takes them (set by forward*)

    def __init__(self, step: Step, schedule: Schedule, n_steps: int, n_state: int,
                 replay: Replay, stats: UnrollStats | None, storage: dict | None = None,
                 recorder: Recorder | None = None, snapshot_dtype: torch.dtype | None = None,
                 x0: Sequence[torch.Tensor] = (), reversal: Reversal | None = None):
        # x0: the caller's initial leaves (which require grad decides the constants)
        state_bytes = stats.state_bytes if stats is not None else 0
        # snapshots (x_0 excepted) of floating leaves stored as snapshot_dtype: inexact
        lower = None
        if snapshot_dtype is not None:
            lower = [snapshot_dtype if dt.is_floating_point and dt != snapshot_dtype else None
                     for _, dt, _ in step.meta]
            if all(d is None for d in lower):
                lower = None
        slot_bytes = state_bytes
        if lower is not None:
            slot_bytes = sum(torch.Size(shape).numel() * (d or dt).itemsize
                             for (shape, dt, _), d in zip(step.meta, lower, strict=True))
        super().__init__(schedule, n_steps, replay, storage, step.meta, lower, slot_bytes)
        self.step = step
        self.params: list[torch.Tensor] = []
        self.n_state = n_state
        self.stats = stats
        self.state_bytes = state_bytes
        self.recorder = recorder  # None: kept tapes are plain autograd graphs
        # which leaves of a recorded step's input require grad; leaves of x_0 that do not
        # require grad are candidates for constants (found at the first recording)
        self.rg = [is_diff(t) for t in x0]
        self.candidates = tuple(k for k, t in enumerate(x0)
                                if is_diff(t) and not t.requires_grad)
        self.const: tuple[int, ...] = ()  # leaves that stay constants (requires_grad=False)
        self.const_from = -1  # the step whose recording found them
        # the backward's check of every recorded step's graph (set once params are known)
        self.known: set[int] | None = None
        self.stop: dict = {}
        self.marker = 0
        self.frontier = 0  # outputs of steps < frontier are in the stacked outputs
        # the reverse sweep's watch on the adjoints: norms, the user's hook
        self.norms: list | None = None
        self.hook: Callable | None = None
        self.watch = False
        self.want_norms = False
        # a truncated unroll: window length K, the window schedules, x_0, its RNG state
        self.window: Callable[[int], Schedule] | None = None
        self.K = 0
        self.last = 0
        # a reversible run: the inverse, the drift seen, the window being rebuilt (its top
        # x_top; with on_drift="recompute" the adjoint there and the sums outside it)
        self.rev = reversal
        self.inverses = 0
        self.drift: float | None = None
        self.win_top = -1
        self.win_grad: list | None = None
        self.win_outer: GradSum | None = None
        self.redone = 0
        # the forward sweep's watch for NaN or inf states (set by execute)
        self.finite: FiniteCheck | None = None

    def _new_snapshot_peak(self) -> None:
        if self.stats is not None:
            self.stats.snapshot_bytes_peak = self.snap_bytes

    # -- helpers ---------------------------------------------------------------------------

    def _advance(self, cur: list[torch.Tensor], a: int, b: int, outs) -> list[torch.Tensor]:
        step = self.step
        lo = a
        with torch.no_grad():
            if a == 0 and self.frontier == 0:  # the very first call: infer outputs, check
                cur, out = step.first(cur, 0)
                self._put(outs, 0, out)
                lo = 1
            if outs is not None and b > self.frontier:  # the first sweep: keep outputs
                for i in range(lo, b):
                    cur, out = step(cur, i)
                    step.fast_check(cur, i)
                    if i >= self.frontier:
                        self._put(outs, i, out)
            elif step._single:  # recomputation of a one-tensor state: the check inlined
                dtype, shape = step._dtype0, step._shape0
                for i in range(lo, b):
                    cur, _ = step(cur, i)
                    t = cur[0]
                    try:
                        if t.dtype is dtype and t.shape == shape:
                            continue
                    except AttributeError:  # not a tensor
                        pass
                    step.check_leaves(cur, i)
            else:
                check = step.fast_check
                for i in range(lo, b):
                    cur, _ = step(cur, i)
                    check(cur, i)
        self.advances += b - a
        if outs is not None and self.finite is not None:  # the forward sweep: watched
            self.finite(cur, b)
        return cur

    def _put(self, outs, i, out):
        if i < self.frontier:
            return
        self.frontier = i + 1
        if not outs and out:
            outs.extend(torch.empty((self.n, *o.shape), dtype=o.dtype, device=o.device)
                        for o in out)
        for buf, o in zip(outs, out, strict=True):
            buf[i].copy_(o.detach())

    def _record(self, cur: list[torch.Tensor], i: int, keep: bool = False):
        """Run step ``i`` with grad from detached inputs; returns the tape (x_in, y, out).
        A tape that is kept for a later ``Reverse`` (``keep``) is recorded under the policy.

        Checks what the step returned (structure, shapes, dtypes, devices, outputs); at the
        first recording finds the state leaves that stay constants (:func:`constant_leaves`),
        at later ones checks that they did; in the reverse sweep checks that the graph
        reaches no tensor requiring grad beyond the differentiated ones."""
        x_in = [t.detach().requires_grad_(r) for t, r in zip(cur, self.rg, strict=True)]
        first = i == 0 and self.frontier == 0
        fn = self.step.first if first else self.step
        try:
            with torch.enable_grad():
                if keep and self.recorder is not None:
                    y, out = self.recorder(fn, x_in, i)
                else:
                    y, out = fn(x_in, i)
        except RuntimeError as e:
            if "in-place" not in str(e):
                raise
            raise RuntimeError(f"unroll: step {i} modified its input state in place ({e}); "
                               "a step must return new tensors") from e
        step = self.step
        if not first:
            step.recorded_check(y, out, i)
        if self.candidates:  # the first recording: which leaves stay constants
            const = constant_leaves(x_in, y, self.candidates, self.marker)
            if len(const) == sum(self.rg):  # not all: see constant_leaves
                const = ()
            self.const = const
            self.const_from = i
            self.candidates = ()
            for k in self.const:
                self.rg[k] = False
        elif self.const:
            for k in self.const:
                if y[k].requires_grad:
                    raise ValueError(
                        f"unroll: step {i} made state leaf {k} depend on a tensor that requires "
                        f"grad, but that leaf of x_0 does not require grad and step "
                        f"{self.const_from}'s recording kept it constant, so the "
                        "unroll returned it with requires_grad=False; make that leaf of x_0 "
                        "require grad (x0_leaf.requires_grad_()) or use schedule='store_all'"
                    )
        if self.known is not None:
            what = unseen_leaf(y, out, self.known, x_in, self.stop, self.marker)
            if what is not None:
                raise ValueError(
                    f"unroll: step {i} uses {what} that requires grad but was not found when "
                    "the unroll started (from the step's closure, its module and the steps "
                    "the forward sweep recorded), so its gradient would be lost; pass it "
                    "with params=[...]"
                )
        return Tape(x_in, y, out)

    def forward(self, x0: list[torch.Tensor]):
        t0 = time.perf_counter()
        self.marker = sequence_marker()  # graph nodes older than this are the caller's
        self.frontier = 0
        outs: list[torch.Tensor] = []
        if self.rev is not None:
            self.rev.check_pair([t.detach() for t in x0], self.replay)
        cur, rev = self._to_first_reverse([t.detach() for t in x0], outs)
        return self._forward_end(cur, rev, outs, t0)

    def forward_truncated(self, x0: list[torch.Tensor], K: int,
                          window: Callable[[int], Schedule]):
        """The forward sweep of a truncated unroll (windows ``[a, a + K)``, no adjoint across
        ``i = K, 2K, ...``): steps ``0 .. last - 1`` unrecorded (``last``: the start of the
        last window), then the last window's schedule up to its first Reverse. The other
        windows are reversed in the backward, in forward order from ``x_0``, each with its
        own schedule, so that only one window's snapshots and tapes are held at a time."""
        t0 = time.perf_counter()
        self.marker = sequence_marker()
        self.frontier = 0
        self.K, self.window = K, window
        self.last = last = ((self.n - 1) // K) * K
        self.x0 = [t.detach() for t in x0]
        if self.rev is not None:
            self.rev.check_pair(self.x0, self.replay)
        self.rng0 = self.replay.capture()
        outs: list[torch.Tensor] = []
        cur = self.x0
        if last:
            cur = self._advance(list(cur), 0, last, outs)
        self.schedule = shifted(window(self.n - last), last)
        self.actions = iter(self.schedule)
        self.at, self.adj, self.pos = last, self.n, 0
        cur, rev = self._run(cur, outs, until_reverse=True)
        if rev is None:
            raise ScheduleError(f"unroll: the window schedule {self.schedule!r} has no Reverse")
        return self._forward_end(cur, rev, outs, t0)

    def _forward_end(self, cur, rev, outs, t0):
        """The first Reverse of the forward sweep: its step's tape is the pending one."""
        if rev.index in self.tapes:
            tape = self.tapes.pop(rev.index)
        else:
            tape = self._record(cur, rev.index)
            self.recorded += 1
            self._put(outs, rev.index, [o.detach() for o in tape.out])
        if self.finite is not None:
            self.finite(tape.y, rev.index + 1)
        self.at = -1
        self.adj = rev.index
        self.pending = (rev.index, tape)
        self.final = [y.detach() for y in tape.y]
        self.outs = outs
        if self.stats is not None:
            self.stats.forward_time = time.perf_counter() - t0
            self._fill_stats()
        return tape

    def forward_online(self, x0: list[torch.Tensor], ctl, stop, max_steps: int | None):
        """The forward sweep of an unknown-length unroll: step until ``stop(x_i, i)``, letting
        the online controller store and free snapshots; then plan the reverse sweep
        (``ctl.finish(n)``) and record step ``n - 1`` from the held ``x_{n-1}``."""
        t0 = time.perf_counter()
        self.marker = sequence_marker()
        step, spec = self.step, self.step.spec
        cur = [t.detach() for t in x0]
        outs: list = []
        i = 0
        rng = None
        with torch.no_grad():
            while True:
                for a in ctl.at(i):
                    try:
                        if type(a) is Store:
                            if a.index != i:
                                raise Misfit(f"stores x_{a.index} but the executor holds x_{i}")
                            self._store(cur, a)
                        elif type(a) is Free:
                            self._free(a)
                        else:
                            raise Misfit("is neither a Store nor a Free")
                    except Misfit as e:
                        raise ScheduleError(f"unroll: online controller action {a!r} at step "
                                            f"{i} does not fit: {e}") from None
                rng = self.replay.capture()
                if i == 0:
                    nxt, out = step.first(cur, 0)
                else:
                    nxt, out = step(cur, i)
                    step.fast_check(nxt, i)
                if out:
                    outs.append([o.detach() for o in out])
                i += 1
                if not i % EVERY and self.finite is not None:
                    self.finite(nxt, i)
                if stop(unflatten(nxt, spec), i):
                    break
                if max_steps is not None and i >= max_steps:
                    raise RuntimeError(
                        f"unroll: the stop condition was not met within max_steps={max_steps} "
                        "steps; raise max_steps or check the condition"
                    )
                cur = nxt
        self.advances += i
        n = self.n = self.frontier = i
        self.actions = iter(ctl.finish(n))
        first = next(self.actions)
        if type(first) is not Reverse or first.index != n - 1:  # pragma: no cover
            raise RuntimeError(f"unroll: online schedule must start with Reverse({n - 1})")
        self.replay.restore(rng)  # replay step n-1's random numbers
        tape = self._record(cur, n - 1)
        self.recorded += 1
        if self.finite is not None:
            self.finite(tape.y, n)
        self.at, self.adj, self.pos = -1, n - 1, 1
        self.pending = (n - 1, tape)
        self.final = [y.detach() for y in tape.y]
        self.outs = [torch.stack(col) for col in zip(*outs, strict=True)] if outs else []
        if self.stats is not None:
            self.stats.n_steps = n
            self.stats.forward_time = time.perf_counter() - t0
            self._fill_stats()
        return tape

    def backward(self, g_final: Sequence, g_outs: Sequence):
        """The reverse sweep (:meth:`Interpreter.reverse_sweep`) from the adjoints of the
        final state and of the stacked outputs; returns ``(dL/dx_0, dL/dparams)``."""
        self.g_outs = g_outs
        self.grad = list(g_final)
        self.pgrads = GradSum(len(self.params))
        if self.want_norms:
            self.norms = [None] * (self.n + 1)
        self.reverse_sweep()
        if self.rev is not None:
            self._check_gradient()
        if self.stats is not None:
            self.stats.backward_time = self.backward_time
            self._fill_stats()
            if self.norms is not None:
                self.stats.adjoint_norms = _gather(self.norms)
        return self.grad, self.pgrads.grads

    def _reverse_rest(self) -> None:
        if self.window is None:
            return super()._reverse_rest()
        self._run(None, None, until_reverse=False)  # the last window
        self._check_reversed(self.last)
        grad0 = self.grad
        rng, cur, K = self.rng0, self.x0, self.K
        for a in range(0, self.last, K):  # the other windows, in forward order from x_0
            b = a + K
            self.replay.restore(rng)
            nxt = self._advance(list(cur), a, b, None)  # the next window's start
            rng_b = self.replay.capture()
            self.replay.restore(rng)
            self._clear_slots()
            self.schedule = shifted(self.window(K), a)
            self.actions = iter(self.schedule)
            self.at, self.adj, self.pos = a, b, 0
            self.grad = [None] * self.n_state  # the adjoint does not cross x_b
            self._run(list(cur), None, until_reverse=False)
            self._check_reversed(a)
            if a == 0:
                grad0 = self.grad
            cur, rng = nxt, rng_b
        self.grad = grad0

    def _clear_slots(self) -> None:
        """Forget the snapshots a finished window schedule left stored."""
        for key, slot in self.slots.items():
            if key[0] != 0:
                self._backend(key[0]).drop(key)
            elif slot.row >= 0 and self.pool is not None:
                self.pool.drop(slot.row)
        self.slots.clear()
        self.n_slots = 0
        self.snap_bytes = 0
        self.retained = None  # a window's rebuilding starts afresh
        self.win_top = -1

    def _watch(self, i: int) -> None:
        """The adjoint ``dL/dx_i`` just computed: its norm, and the user's hook."""
        g = self.grad
        if self.norms is not None:
            self.norms[i] = _norm(g, self.step.meta[0][2])
        if self.hook is not None:
            meta = self.step.meta
            leaves = [t if t is not None else torch.zeros(m[0], dtype=m[1], device=m[2])
                      for t, m in zip(g, meta, strict=True)]
            new = self.hook(i, unflatten(leaves, self.step.spec))
            if new is not None:
                self.grad = self._hooked(new, i)

    def _hooked(self, new: Any, i: int) -> list:
        flat = [new] if self.step.spec is None else self.step._flat(new)
        if flat is None or len(flat) != len(self.step.meta):
            raise TypeError(f"unroll: adjoint_hook returned a {type(new).__name__} at step {i};"
                            " it must return the adjoint with the state's structure, or None")
        out = []
        for k, (t, (shape, dtype, device)) in enumerate(zip(flat, self.step.meta, strict=True)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or \
                    t.device != device:
                got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"unroll: adjoint_hook returned {got} for state leaf {k} at "
                                 f"step {i}; expected {tuple(shape)} {dtype} on {device}")
            out.append(t if self.rg[k] else None)
        return out

    def _keep(self, cur: list[torch.Tensor], i: int, outs) -> list[torch.Tensor]:
        tape = self._record(cur, i, True)
        self.tapes[i] = tape
        self.recorded += 1
        if outs is not None:
            self._put(outs, i, [o.detach() for o in tape.out])
        return [y.detach() for y in tape.y]

    def _reverse(self, cur, i: int):
        tape = self.tapes.pop(i, None)
        if tape is None:
            tape = self._record(cur, i)
            self.recorded += 1
        self._pull(tape, i)

    def _pull(self, tape, i: int):
        """adjoint_i = J_i^T adjoint_{i+1} (+ output terms); accumulate parameter grads."""
        x_in, y, out = tape
        o_roots, o_seeds = [], []  # the outputs with an incoming gradient
        for k, o in enumerate(out):
            g = self.g_outs[k] if k < len(self.g_outs) else None
            if g is not None and o.requires_grad:
                o_roots.append(o)
                o_seeds.append(g[i])
        lam = self.grad
        if self.watch:
            lam = self._watch_next(y, o_roots, o_seeds, i)
        roots, seeds = [], []
        for t, g in zip(y, lam, strict=True):
            if g is not None and t.requires_grad:
                roots.append(t)
                seeds.append(g)
        roots += o_roots
        seeds += o_seeds
        inputs = [t for t in x_in if t.requires_grad] + self.params
        if not roots or not inputs:
            self.grad = [None] * self.n_state
        else:
            grads = pull_back(roots, inputs, seeds)
            it = iter(grads)
            self.grad = [next(it) if t.requires_grad else None for t in x_in]
            add = self.pgrads.add
            for k, g in enumerate(it):
                if g is not None:
                    add(k, g)
        if self.watch and (i == 0 or (self.window is not None and i % self.K == 0)):
            self._watch(i)  # x_0, or a window's start (a leaf of the detaching loop)
        if self.rev is not None:
            self.retained = x_in  # x_i, for an Invert of step i - 1

    # -- reversible steps ------------------------------------------------------------------

    def _check_gradient(self) -> None:
        """A reversible unroll returns no non-finite gradient silently: its states were
        rebuilt by the inverse (or windows recomputed), and a NaN or inf in ``dL/dx_0`` or a
        parameter gradient raises :class:`ReconstructionError` naming where."""
        for what, grads in (("dL/dx_0", self.grad), ("a parameter gradient",
                                                       self.pgrads.grads)):
            for g in grads:
                if g is not None and not all_finite(g):
                    rev = self.rev
                    assert rev is not None  # called for reversible runs
                    advice = rev.advice or ("check the loss and the step; Revolve(s) or "
                                            "budget= recompute states instead of inverting")
                    recomputed = (f" ({self.redone} window(s) recomputed after drifting)"
                                  if self.redone else "")
                    raise ReconstructionError(
                        f"unroll: the reverse sweep of the reversible unroll gave a non-finite "
                        f"gradient (NaN or inf in {what}){recomputed}, although the forward "
                        f"sweep's states were finite; {advice}")

    def _invert(self, nxt: list[torch.Tensor], i: int) -> None:
        rev = self.rev
        if rev is None:
            raise Misfit("the schedule rebuilds states by the step's inverse, but the step has "
                         "none; give the step an inverse (step.inverse = fn, or a stepper from "
                         "deepsolve.reversible)")
        if self.win_top < 0:  # the first step of a window rebuilt from its top x_{i+1}
            self.win_top = i + 1
            if rev.on_drift == "recompute":  # its gradient terms held apart until checked
                self.win_grad = self.grad
                self.win_outer = self.pgrads
                self.pgrads = GradSum(len(self.params))
        with torch.no_grad():
            x = rev.leaves(nxt, i)
        del nxt
        self.inverses += 1
        tape = self._record(x, i)
        self.recorded += 1
        self._pull(tape, i)

    def _rebuilt(self, rebuilt: list, exact: list, a: int) -> None:
        """The window ``[a, top)`` rebuilt down to ``x_a``: its drift against the snapshot;
        beyond the tolerance, raise or recompute the window from the snapshot."""
        rev = self.rev
        top = self.win_top
        if rev is None or top < 0:
            return
        self.win_top = -1
        err = relative_error(rebuilt, exact)
        if self.drift is None or not err <= self.drift:
            self.drift = err
        outer = self.win_outer
        self.win_outer = None
        if err <= rev.tolerance:
            if outer is not None:  # the window's parameter gradients join the sum
                for k, g in enumerate(self.pgrads.grads):
                    if g is not None:
                        outer.add(k, g)
                self.pgrads = outer
            return
        if math.isfinite(err):
            where = (f"rebuilding steps {a}..{top - 1} by the step's inverse drifted by "
                     f"{err:.3g} (relative, at x_{a}), above the tolerance "
                     f"{rev.tolerance:.3g}")
        else:
            where = (f"rebuilding steps {a}..{top - 1} by the step's inverse gave non-finite "
                     f"states (NaN or inf at x_{a}, where the forward sweep's snapshot is "
                     "finite): the inverse is unstable over this window")
        if outer is None:
            advice = rev.advice or ("store snapshots more often (Reversible(every=k) with a "
                                    "smaller k), raise tolerance=, or give "
                                    "on_drift='recompute'")
            raise ReconstructionError(f"unroll: {where}; {advice}")
        self._recompute(exact, a, top, outer)

    def _recompute(self, exact: list, a: int, top: int, outer: GradSum) -> None:
        """Reverse steps ``a .. top - 1`` again from the exact ``x_a`` by revolve (at most
        :data:`RECOMPUTE_SNAPSHOTS` slots beside the schedule's), the adjoint and the
        parameter gradients taken back to what they were at ``x_top``."""
        self.pgrads = outer
        assert self.win_grad is not None  # set when the window opened
        self.grad, self.win_grad = self.win_grad, None
        self.retained = None
        m = top - a
        sub = shifted(revolve(m, min(RECOMPUTE_SNAPSHOTS, m)), a,
                      sum(self.schedule.slots.values()))
        outer_state = (self.actions, self.schedule, self.pos)
        self.actions, self.schedule = iter(sub), sub
        self.at, self.adj, self.pos = a, top, 0
        rev, self.rev = self.rev, None  # plain reverse steps: nothing retained or rebuilt
        try:
            self._run(list(exact), None, until_reverse=False)
        finally:
            self.rev = rev
            self.actions, self.schedule, self.pos = outer_state
        self._check_reversed(a)
        if not self.redone and rev is not None:
            warnings.warn(f"unroll: rebuilding steps {a}..{top - 1} by the step's inverse "
                          f"drifted beyond the tolerance {rev.tolerance:.3g}; recomputed that "
                          "window from its snapshot (UnrollStats.extra['recomputed_windows'] "
                          "counts them)", RuntimeWarning, stacklevel=2)
        self.redone += 1

    def _watch_next(self, y, roots: list, seeds: list, i: int) -> list:
        """The adjoint of ``x_{i+1}`` as plain autograd holds it — the adjoint pulled back so
        far plus what step ``i``'s outputs add through ``y = x_{i+1}`` — watched (norm,
        hook); returns the seed for ``y`` (the watched adjoint less the outputs' part, which
        the pull adds through their own graph). ``roots``/``seeds``: the step's outputs with
        an incoming gradient, and those gradients."""
        j = i + 1
        lam = self.grad
        if self.window is not None and j < self.n and j % self.K == 0:
            return lam  # a cut: x_j's adjoint flows nowhere (its window watches it)
        gy = None
        ys = [t for t in y if t.requires_grad]
        if roots and ys:
            found = iter(pull_back(roots, ys, seeds, retain_graph=True))
            gy = [next(found) if t.requires_grad else None for t in y]
            self.grad = [a if b is None else (b if a is None else a + b)
                         for a, b in zip(lam, gy, strict=True)]
        self._watch(j)
        lam = self.grad
        if gy is not None:
            lam = [a if b is None else (-b if a is None else a - b)
                   for a, b in zip(lam, gy, strict=True)]
        return lam

    def _fill_stats(self):
        s = self.stats
        assert s is not None  # callers check
        s.advances = self.advances
        s.recorded = self.recorded
        s.snapshots_peak = self.peak_slots
        s.snapshot_bytes_peak = self.peak_snap_bytes
        if self.rev is not None:
            s.inverses = self.inverses
            s.reconstruction_error = self.drift
            if self.redone:
                s.extra["recomputed_windows"] = self.redone


#: the revolve slots that recompute a drifting window of a reversible unroll (its start
#: included), beside the reversible schedule's own
RECOMPUTE_SNAPSHOTS = 8



def _norm(g: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The 2-norm over all leaves of an adjoint (float64, on ``device``; no host sync)."""
    parts = [t.detach().abs().double().square().sum().to(device) for t in g if t is not None]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(parts).sum().sqrt()


def _gather(norms: list) -> torch.Tensor:
    """The per-state norms as one float64 CPU tensor (one copy), NaN where none was
    computed."""
    out = torch.full((len(norms),), float("nan"), dtype=torch.float64)
    idx = [i for i, v in enumerate(norms) if v is not None]
    if idx:
        out[idx] = torch.stack([norms[i] for i in idx]).cpu()
    return out


class _UnrollFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: UnrollRun, *inputs):
        ctx.ex = ex
        ctx.set_materialize_grads(False)
        final, outs = ex.final, ex.outs
        assert final is not None and outs is not None  # computed by ex.forward before apply
        ctx.n_final = len(final)
        if ex.const:  # state leaves that depend on nothing requiring grad
            ctx.mark_non_differentiable(*[final[k] for k in ex.const])
        out = (*final, *outs)
        # the outputs now carry this node as grad_fn; the run must not hold them too, or
        # outputs -> node -> ctx.ex -> outputs is a cycle through C++ that Python's gc cannot
        # see, and every checkpointed unroll would keep its final state and outputs for good
        ex.final = ex.outs = None
        return out

    @staticmethod
    def backward(ctx, *grads):
        ex: UnrollRun = ctx.ex
        adj, pgrads = ex.backward(grads[:ctx.n_final], grads[ctx.n_final:])
        return (None, *adj, *pgrads)


def execute(
    step: Callable[[Any, int], Any],
    state: Any,
    schedule: Schedule | Any,
    *,
    params: Sequence[torch.Tensor] | None = None,
    has_output: bool | None = None,
    preserve_rng: bool = True,
    stats: UnrollStats | None = None,
    storage: dict[int, Any] | None = None,
    until: Callable[[Any, int], bool] | None = None,
    max_steps: int | None = None,
    policy: Any = None,
    snapshot_dtype: torch.dtype | None = None,
    adjoint_hook: Callable[[int, Any], Any] | None = None,
    truncate: Truncation | None = None,
    inverse: Callable[[Any, int], Any] | None = None,
    tolerance: float | None = None,
    on_drift: str = "raise",
    advice: str = "",
    diagnose: Callable[[], str] | None = None,
    watch_finite: bool = True,
) -> Any:
    """Run ``schedule.n_steps`` steps of ``step`` from ``state`` following ``schedule``.

    The executor behind :func:`deepsolve.unroll` (which documents the arguments); it knows
    nothing of budgets or files. ``schedule`` is any :class:`~deepsolve.schedules.Schedule`.
    ``storage`` maps a storage level >= 1 to a backend with ``put(key, tensors)``,
    ``get(key, meta)``, ``drop(key)`` and ``close()`` (default: :class:`HostStorage`); the
    executor closes every backend when the reverse sweep ends, when the forward sweep fails,
    and when the unroll's graph is freed without a backward.

    With ``until=stop`` the length is unknown: ``schedule`` is an online schedule
    (:func:`deepsolve.schedules.online`) or ``None`` (keep every step recorded), and the
    unroll runs until ``stop(x_i, i)`` is true (at most ``max_steps`` steps).

    ``policy`` (see :data:`POLICIES` and :func:`policy_context`) records every kept tape —
    ``Record`` ranges, and each step of a store-all unroll — under selective activation
    checkpointing; ``None``/``"none"`` costs nothing extra. ``snapshot_dtype`` stores the
    snapshots other than ``x_0`` with their floating leaves cast to that dtype (inexact).

    ``adjoint_hook(i, adjoint) -> adjoint | None`` is called in the reverse sweep on each
    ``dL/dx_i`` (``i = n .. 0``, the state's structure) before it flows into step ``i - 1``;
    ``stats.adjoint_norms=True`` records their norms. ``truncate``: truncated
    backpropagation (a :class:`Truncation`: its length, its window length ``K`` and the
    builder of each window's schedule), no adjoint across ``x_K, x_2K, ...``; ``schedule`` is
    then ``None``. Both keep every step on the interpreter (store-all included) so the
    adjoints are explicit.

    ``inverse(state, i) -> state`` (``x_i`` from ``x_{i+1}``) makes the step reversible for
    schedules with ``Invert`` actions (:func:`deepsolve.schedules.reversible`): it is checked
    on the first step pair, rebuilt states are compared with the stored snapshots, and a
    drift beyond ``tolerance`` (:mod:`~deepsolve.engine.reversal`) raises or, with
    ``on_drift="recompute"``, has the window recomputed; ``advice`` (one clause) is added to
    the drift error: what the caller knows of the inverse and of how the schedule was chosen.

    Every forward state is watched for NaN and inf (:mod:`~deepsolve.engine.finite`): a
    one-line :class:`~deepsolve.engine.finite.NonFiniteError` names the first step whose
    result is not finite, with ``diagnose()`` (the caller's diagnosis of the step, one
    clause) when given; ``watch_finite=False`` turns the watch off, for chains that are not
    the user's trajectory (the memory probes of :mod:`deepsolve.memory.units`, which run a
    step again and again from one state).
    """
    context_fn = policy_context(policy)
    recorder = None if context_fn is None else Recorder(
        context_fn, preserve_rng, policy if isinstance(policy, CompiledPolicy) else None)
    snapshot_dtype = check_snapshot_dtype(snapshot_dtype)
    x0, spec = flatten_state(state)
    if torch.is_grad_enabled():
        for k, t in enumerate(x0):
            if t.is_inference():
                raise ValueError(
                    f"unroll: state leaf {k} of x0 is an inference tensor (made under "
                    "torch.inference_mode()), which autograd cannot record; make x0 outside "
                    "inference_mode, or pass a copy made outside it (x0.clone()), or run the "
                    "unroll under torch.inference_mode() / torch.no_grad() as well")
    watch = adjoint_hook is not None or bool(stats is not None and stats.adjoint_norms is True)
    cut = None  # the truncation when it cuts (more than one window)
    if truncate is not None:
        if until is not None:
            raise ValueError("unroll: truncate= needs a known n_steps, not until=")
        if schedule is not None:
            raise TypeError("execute: with truncate=, the windows' schedules come from "
                            "truncate.window; give schedule=None")
        n, K = truncate.n_steps, truncate.K
        schedule = truncate.window(n) if n <= K else _Windows(truncate)
        cut = truncate if n > K else None
    if watch and until is not None and schedule is None:
        raise ValueError("unroll: adjoint_norms/adjoint_hook with until= need snapshots= or "
                         "budget= (an online schedule)")
    sched = schedule
    fn = Step(step, spec, x0, has_output)
    state_bytes = sum(t.numel() * t.element_size() for t in x0)
    if stats is not None:
        stats.schedule = repr(sched)
        stats.state_bytes = state_bytes
        if recorder is not None:
            stats.extra["policy"] = policy_name(policy)
        if snapshot_dtype is not None:
            stats.extra["snapshot_dtype"] = str(snapshot_dtype)
    if until is not None:
        with torch.no_grad():
            if until(state, 0):
                if stats is not None:
                    stats.n_steps = 0
                return state
        n_steps = -1  # unknown
    else:
        n_steps = schedule.n_steps
        if stats is not None:
            stats.n_steps = n_steps
        if n_steps == 0:
            return state
    explicit = list(params or [])
    for k, p in enumerate(explicit):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"unroll: params[{k}] is a {type(p).__name__}, not a tensor")

    grad_on = torch.is_grad_enabled()
    check = (FiniteCheck(fn, x0, cuda_devices(x0 + explicit), hint=diagnose)
             if watch_finite else None)
    if not grad_on or sched is None or (sched.kind == "store_all" and not watch):
        return _plain_loop(fn, x0, n_steps, spec, grad_on, stats, until, max_steps,
                           recorder if grad_on else None, check)

    reversal = None
    if inverse is not None:
        if until is not None:
            raise ValueError("unroll: a reversible unroll needs a known n_steps, not until=")
        if snapshot_dtype is not None:
            raise ValueError("unroll: snapshot_dtype= with a reversible schedule: its snapshots "
                             "are the exact states the drift is measured against and rebuilt "
                             "from; leave snapshot_dtype unset")
        reversal = Reversal(inverse, fn, tolerance, on_drift, advice)
    ex = UnrollRun(fn, sched, n_steps, len(x0), Replay.of(x0 + explicit, preserve_rng), stats,
                   storage, recorder, snapshot_dtype, x0, reversal)
    ex.finite = check
    if watch:
        ex.watch = True
        ex.hook = adjoint_hook
        ex.want_norms = bool(stats is not None and stats.adjoint_norms is True)
    try:
        if until is not None:
            tape = ex.forward_online(x0, cast(Online, sched).start(), until, max_steps)
        elif cut is not None:
            if stats is not None:
                stats.extra["truncate"] = cut.K
            tape = ex.forward_truncated(x0, cut.K, cut.window)
        else:
            tape = ex.forward(x0)
        tapes = [tape, *ex.tapes.values()]  # every step the forward sweep recorded
        params, stop = discover(step, tapes, explicit, ex.marker)
    except BaseException:
        ex.release()
        raise
    weakref.finalize(ex, _close_all, list(ex.storage.values()))
    params = [p for p in params if p.requires_grad]
    if not params and not any(t.requires_grad for t in x0):  # nothing to differentiate
        assert ex.final is not None and ex.outs is not None  # set by the forward sweep
        res = (*ex.final, *ex.outs)
        ex.release()
    else:
        ex.params = params
        ex.known = {id(p) for p in params} | {id(p) for p in explicit}
        ex.stop = stop
        if stats is not None:
            stats.extra["params"] = len(params)
        res = _UnrollFunction.apply(ex, *x0, *params)
    final = unflatten(res[:len(x0)], spec)
    if not fn.has_output:
        return final
    return final, pytree.tree_unflatten(list(res[len(x0):]), fn.out_spec)


def check_truncate(K: Any) -> int:
    """``truncate=K``: an integer >= 1 (the window length); a one-line error otherwise."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"unroll: truncate must be an integer >= 1 (the window length), got "
                         f"{K!r}")
    return K


@dataclass(frozen=True)
class Truncation:
    """Truncated backpropagation through ``n_steps`` steps: windows ``[0, K), [K, 2K), ...``
    (the last may be shorter), each reversed on its own by the schedule ``window(length)``
    builds; no adjoint crosses ``x_K, x_2K, ...``. ``K`` is checked (:func:`check_truncate`)."""

    n_steps: int
    K: int
    window: Callable[[int], Schedule]

    def __post_init__(self) -> None:
        check_truncate(self.K)
        if isinstance(self.n_steps, bool) or not isinstance(self.n_steps, int) or \
                self.n_steps < 0:
            raise ValueError(f"unroll: n_steps must be an integer >= 0, got {self.n_steps!r}")


class _Windows(Schedule):
    """The name of a truncated unroll's schedule (its windows' schedules are built as they
    run): ``n`` steps in windows of ``K``, each reversed by ``window(K)``."""

    kind = "truncated"

    def __init__(self, cut: Truncation):
        self.n_steps, self.K, self.window = cut.n_steps, cut.K, cut.window
        self.slots = dict(cut.window(cut.K).slots)

    def __iter__(self):
        raise TypeError("a truncated unroll's schedule is run window by window")

    def __repr__(self) -> str:
        return f"truncated(n_steps={self.n_steps}, K={self.K}, window={self.window(self.K)!r})"


def _close_all(backends) -> None:
    for b in backends:
        b.close()



def _plain_loop(fn: Step, x0: list[torch.Tensor], n: int, spec, grad_on: bool,
                stats: UnrollStats | None, until=None, max_steps: int | None = None,
                recorder: Recorder | None = None, check: FiniteCheck | None = None):
    """The plain loop: under no_grad, or store_all (autograd keeps the whole graph, each
    step's part under the policy's ``recorder`` if one is given); with ``until``, until
    ``until(x_i, i)`` holds. ``check`` watches the states every :data:`EVERY` steps and at
    the end."""
    t0 = time.perf_counter()
    cur = x0
    outs = []
    i = 0
    while until is not None or i < n:
        if recorder is not None:
            cur, out = recorder(fn.first if i == 0 else fn, cur, i)
            if i:
                fn.fast_check(cur, i)
        elif i == 0:
            cur, out = fn.first(cur, 0)
        else:
            cur, out = fn(cur, i)
            fn.fast_check(cur, i)
        if fn.has_output:
            outs.append(out)
        i += 1
        if not i % EVERY and check is not None:
            check(cur, i)
        if until is not None:
            with torch.no_grad():
                if until(unflatten(cur, spec), i):
                    break
            if max_steps is not None and i >= max_steps:
                raise RuntimeError(
                    f"unroll: the stop condition was not met within max_steps={max_steps} "
                    "steps; raise max_steps or check the condition")
    n = i
    if check is not None and n % EVERY:
        check(cur, n)
    if stats is not None:
        stats.n_steps = n
        stats.forward_time = time.perf_counter() - t0
        if grad_on:
            stats.recorded = n
        else:
            stats.advances = n
    final = unflatten(cur, spec)
    if not fn.has_output:
        return final
    stacked = [torch.stack(col) for col in zip(*outs, strict=True)] if outs else []
    return final, pytree.tree_unflatten(stacked, fn.out_spec)
