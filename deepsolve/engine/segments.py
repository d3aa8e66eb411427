"""Compiled step segments: ``k`` consecutive steps run as one compiled graph.

Contract. ``Segments(step, k, n_steps)`` is itself a step of a chain of
``m = ceil(n_steps / k)`` segments: ``seg(x, j)`` runs the user's steps
``jk, jk + 1, ..., min(jk + k, n) - 1`` and returns the state after them, so that

    x_{(j+1)k} = seg(x_{jk}, j) = step(... step(step(x_{jk}, jk), jk + 1) ..., jk + k - 1),

the last segment running the ``n - (m - 1)k`` remaining steps (eagerly: a compiled graph of
its own would cost a compile for a few evaluations per unroll). A step with per-step outputs
gives a segment whose output stacks its steps' outputs along a new leading dimension of
size ``k`` (the last segment's padded with zeros); :meth:`Segments.outputs` turns the
executor's ``(m, k, ...)`` stack back into the ``(n, ...)`` stack of the plain loop. A
checkpoint schedule over the ``m`` segments then keeps segment-boundary snapshots, and a
recorded segment is one compiled forward and one compiled backward (AOTAutograd): the
gradient is the exact gradient of the compiled forward.

Compilation (``torch.compile(fullgraph=True)``, the loop over the ``k`` steps unrolled by
the compiler; on CUDA under CUDA graphs, one launch per segment) happens at the first call
of each segment length and grad mode; the segment's
start index is a dynamic integer (``torch.compiler.config.dynamic_sources`` names it), so
the step index does not recompile per segment. Compiled code is cached per step (the same
function, the same bound method's object and function) and reused across unrolls.

Trust. At the first call of each segment length the compiled segment runs beside the eager
one from the same state, its result and its vector-Jacobian product for a fixed cotangent
compared: a step the compiler cannot take whole (a graph
break, data-dependent Python control flow, a recompile storm, no C++ compiler) or whose
compiled result differs from the eager one beyond rounding runs eagerly from then on, with
one warning line naming the reason. A segment that draws random numbers (compiled random
streams are not the eager ones, and the forward and recorded graphs draw differently) is
refused with a one-line :class:`CompileError` (``strict``) or, not strict, runs eagerly with
the warning. A compiled call that fails later (a new guard, the recompile limit) is rerun
eagerly and the step stays eager. Never a wrong gradient.

Cost (measured in docs/benchmarks.md "Compiled segments"): the per-call overhead of a
compiled graph is tens of microseconds, its per-step arithmetic a fraction of the eager
dispatch; compile time grows with ``k`` (the unrolled graph), which
:mod:`deepsolve.memory.segments` weighs against the run.
"""

from __future__ import annotations

import time
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .replay import cuda_devices
from .rng import RngState
from .state import returns_output

__all__ = ["Segments", "segments", "CompileError", "INDEX", "FORMS", "UNROLLED_MAX",
           "segment_count", "step_identity", "StepCache", "forget_step", "loop_refused"]

#: the name of a segment's start index inside the compiled function: marked dynamic
INDEX = "deepsolve_segment_start"
#: a segment's compiled forms: the steps traced one after another, or the step as a loop body
FORMS = ("unrolled", "loop")
#: the longest unrolled segment weighed, or fallen back to when the loop form cannot take a
#: step: Inductor's compile of an unrolled chain can grow exponentially with its length
#: (``y + 0.01 (F c - y)``: 13 s at 8 steps, 19 s at 10, 54 s at 12, over 400 s at 16)
UNROLLED_MAX = 8
_loop_reasons: dict[Any, str] = {}  # per step: why the loop form cannot take it
_CACHE_SIZE = 32  # compiled steps kept across unrolls (least recently used dropped)
_cache: OrderedDict[Any, Segments] = OrderedDict()
_compiled: dict[Any, dict[int, Callable]] = {}  # per (step, k, strict): length -> compiled
_eager_reasons: dict[Any, str] = {}  # per (step, k, strict): why it runs eagerly
#: Inductor settings of a segment's compile. A pointwise value used twice (``x - c x``) is
#: inlined into each use unless it reads more than ``realize_reads_threshold`` buffers, and
#: Inductor evaluates the inlined definition once per use: over ``k`` unrolled steps of such a
#: chain, 2^k evaluations (exponential decay: 12 steps 140 s of compile, 16 steps over 400 s,
#: 32 over 200 s). At 1, a value read twice that reads two buffers or more is stored
#: once: 32 steps of that chain compile in 14 s (benchmarks/segment_inlining.py).
INDUCTOR_OPTIONS: dict[str, Any] = {"realize_reads_threshold": 1}


class CompileError(RuntimeError):
    """A compiled segment that cannot be trusted, with ``compile=True`` (one line)."""


def segment_count(n_steps: int, k: int) -> int:
    """``ceil(n / k)``: the length of the chain of ``k``-step segments."""
    return -(-n_steps // k)


def _mark_index_dynamic() -> None:
    """Name the segment start as a dynamic integer source (inert for every other source)."""
    cfg = torch.compiler.config
    entry = f"L['{INDEX}']"
    have = [s for s in cfg.dynamic_sources.split(",") if s]
    if entry not in have:
        cfg.dynamic_sources = ",".join([*have, entry])


def step_identity(step: Any) -> Any:
    """What stays the same for the same step across calls: a bound method is new at every
    attribute access, its object and function are not."""
    if isinstance(step, types.MethodType):
        return ("method", step.__self__, step.__func__)
    return ("callable", step)


class StepCache:
    """What is learnt about a step (its dispatch cost, whether compiling it paid), kept per
    step without keeping the step alive: entries hang off the step weakly (a bound method:
    its object, under its function), so a step that is dropped — a closure over a model, a
    trainer's context and its process groups — takes its entries with it. Values must not
    refer to the step. A step that cannot be weakly referenced is not cached."""

    def __init__(self) -> None:
        self._d: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def _split(step: Any) -> tuple[Any, Any]:
        if isinstance(step, types.MethodType):
            return step.__self__, step.__func__
        return step, None

    def get(self, step: Any, key: Any = None) -> Any:
        owner, sub = self._split(step)
        try:
            return self._d.get(owner, {}).get((sub, key))
        except TypeError:  # not weakly referenceable
            return None

    def put(self, step: Any, value: Any, key: Any = None) -> None:
        owner, sub = self._split(step)
        try:
            self._d.setdefault(owner, {})[(sub, key)] = value
        except TypeError:
            pass


def loop_refused(step: Any) -> str | None:
    """Why the loop form could not take ``step`` when it was tried (``None``: not tried, or
    it could): the model weighs only unrolled segments for such a step."""
    return _loop_reasons.get(step_identity(step))


def forget_step(step: Any) -> None:
    """Drop the compiled segments of ``step`` (a function, or an object and its bound
    methods), which hold the step and what it closes over: the trainer does at the end of a
    run, so that a finished run's model and process groups are freed with it."""
    owner = step.__self__ if isinstance(step, types.MethodType) else step
    for table in (_cache, _compiled, _eager_reasons):   # keyed by (step_identity, ...)
        for key in [k for k in table if k[0][1] is owner]:
            del table[key]
    for key in [k for k in _loop_reasons if k[1] is owner]:
        del _loop_reasons[key]


def segments(step: Callable, k: int, n_steps: int | None, *, has_output: bool | None = None,
             compiled: bool = True, strict: bool = False, form: str = "unrolled") -> Segments:
    """The :class:`Segments` of ``step`` for this ``(k, n_steps, form)``, reused across
    unrolls of the same step (the same function, or the same object's method): its compiled
    code, its trust checks and the step profile the planner caches for it. ``compile_time``
    is reset."""
    key = (step_identity(step), k, n_steps, has_output, compiled, strict, form)
    seg = _cache.get(key)
    if seg is None:
        seg = _cache[key] = Segments(step, k, n_steps, has_output=has_output,
                                     compiled=compiled, strict=strict, form=form)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
        while len(_compiled) > _CACHE_SIZE:
            _eager_reasons.pop(first := next(iter(_compiled)), None)
            del _compiled[first]
    else:
        _cache.move_to_end(key)
    seg.compile_time = 0.0
    return seg


def _stack(outs: list, pad: int) -> Any:
    def leaf(*xs: torch.Tensor) -> torch.Tensor:
        t = torch.stack(xs)
        if pad:
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
        return t
    return pytree.tree_map(leaf, outs[0], *outs[1:])


def _segment(step: Callable, length: int, has_output: bool, pad: int, stack: bool) -> Callable:
    """The eager segment of ``length`` steps as a fresh function (its own code object, so
    that each compiled segment has its own compile cache and recompile count)."""

    def seg(state, deepsolve_segment_start):
        outs = []
        for m in range(length):
            res = step(state, deepsolve_segment_start + m)
            if has_output:
                state, out = res
                outs.append(out)
            else:
                state = res
        if not has_output:
            return state
        if not stack:
            return state, outs[0]
        return state, _stack(outs, pad)

    code = seg.__code__.replace(co_name=f"segment_{length}_of_{type(step).__name__}")
    return types.FunctionType(code, seg.__globals__, code.co_name, None, seg.__closure__)


def _loop(step: Callable, length: int, has_output: bool) -> Callable:
    """The ``length`` steps as the body of one loop, :func:`torch._higher_order_ops.scan`:
    the compiler traces and compiles the step once, whatever ``length``. The step index is a
    0-d float64 tensor holding the integer (the scanned sequence ``start, start + 1, ...``):
    float64 so that ``t0 + i * dt`` is computed as with a Python ``int`` (an int64 tensor
    times a Python float gives the default dtype, float32); a leaf the step
    returns as it came in (or an output that is a state leaf) is copied, since a loop body
    may not alias its carry. Per-step outputs come out stacked along a new leading
    dimension, as the unrolled segment's."""
    from torch._higher_order_ops.scan import scan  # the compiler's machinery: when compiling

    def seg(state, deepsolve_segment_start):
        leaves = _leaves(state)
        device = leaves[0].device if leaves else None
        index = torch.arange(length, dtype=torch.float64, device=device) + \
            deepsolve_segment_start

        def body(carry, i):
            res = step(carry, i)
            nxt, out = res if has_output else (res, None)
            held = _leaves(carry)
            nxt = _unaliased(nxt, held)
            if out is None:  # a loop returns something per iteration: a floating scalar
                # (an integer one breaks the loop's autograd in this PyTorch)
                leaves = _leaves(nxt)
                proto = next((t for t in leaves if _floating(t)), leaves[0])
                return nxt, proto.new_zeros(())
            return nxt, _unaliased(out, held + _leaves(nxt))

        final, outs = scan(body, state, index)
        return (final, outs) if has_output else final

    code = seg.__code__.replace(co_name=f"loop_{length}_of_{type(step).__name__}")
    return types.FunctionType(code, seg.__globals__, code.co_name, None, seg.__closure__)


def _scan_cacheable() -> None:
    """Let Inductor's and AOTAutograd's caches keep graphs with a loop (``scan``), which this
    PyTorch bypasses by default ("Can't cache HigherOrderOperator: scan"): without it every
    process compiles a loop segment afresh. The key still hashes the loop body's graph (a
    changed body misses the cache, checked in tests/test_segments.py), and a compiled
    segment, cached or not, is checked against the eager steps at its first call in each
    process (:meth:`Segments._check`), so a wrong entry is refused, never used."""
    marked = getattr(torch._inductor.config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        marked.setdefault("torch.ops.higher_order.scan", torch.__version__)


def _unaliased(tree: Any, held: list[torch.Tensor]) -> Any:
    """``tree`` with every tensor leaf that is one of ``held`` (by identity) copied."""
    return pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) and any(t is h for h in held)
        else t, tree)


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _misfit(got: Any, ref: Any, length: int) -> str | None:
    """Why a compiled result is not the eager one up to rounding (``None``: it is)."""
    a, b = _leaves(got), _leaves(ref)
    if len(a) != len(b):
        return f"it returns {len(a)} tensors where the eager segment returns {len(b)}"
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"it returns {tuple(x.shape)} {x.dtype} where the eager segment returns " \
                   f"{tuple(y.shape)} {y.dtype}"
        if not (y.is_floating_point() or y.is_complex()):
            if not torch.equal(x, y):
                return "an integer leaf differs from the eager segment's"
            continue
        if y.numel() == 0:
            continue
        eps = torch.finfo(y.real.dtype if y.is_complex() else y.dtype).eps
        tol = 1000 * max(1, length) * eps
        scale = float(y.abs().max())
        err = float((x - y).abs().max())
        err = err / scale if scale > 0 else err
        if not err <= tol:
            return f"its result differs from the eager segment's by {err:.1e} relative " \
                   f"(rounding allows {tol:.0e})"
    return None


class Segments:
    """``k`` steps of ``step`` as one step (see the module's contract).

    Args:
        step: ``step(state, i) -> state`` or ``-> (state, output)``.
        k: steps per segment, ``>= 1``.
        n_steps: the unroll's length (``None``: unknown, ``k`` must be 1).
        has_output: whether the step returns ``(state, output)``; ``None``: found at the
            first call.
        compiled: compile the segments (``False``: the eager loop, the same contract).
        strict: a step that draws random numbers raises :class:`CompileError` instead of
            running eagerly with a warning.
        form: ``"unrolled"`` (the ``k`` steps traced one after another into one graph: the
            compiler fuses across steps, and compiles longer as ``k`` grows) or ``"loop"``
            (the step compiled once as the body of a loop, whatever ``k``; its index a 0-d
            float64 tensor). A step the loop form cannot take runs as unrolled segments when ``k``
            is at most :data:`UNROLLED_MAX`, eagerly otherwise (``form`` then says which).

    Attributes:
        compile_time: seconds spent in first calls (compilation and the eager check), summed
            over the segment lengths and grad modes this instance compiled; ``0`` when the
            compiled code came from the cache of an earlier unroll.
        eager_reason: why the segments run eagerly (``None`` while compiled).
    """

    def __init__(self, step: Callable, k: int, n_steps: int | None, *,
                 has_output: bool | None = None, compiled: bool = True, strict: bool = False,
                 form: str = "unrolled"):
        if form not in FORMS:
            raise ValueError(f"compiled segments: form must be one of {', '.join(FORMS)}, got "
                             f"{form!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"compiled segments: the segment length must be an integer >= 1, "
                             f"got {k!r}")
        if n_steps is None and k != 1:
            raise ValueError("compiled segments: an unroll of unknown length (until=) runs "
                             "one-step segments")
        self.step = step
        self.k = k
        self.n_steps = n_steps
        self.has_output = has_output
        self.compiled = compiled
        self.strict = strict
        self.form = "unrolled" if k == 1 else form  # one step: nothing to loop over
        self.loop_reason: str | None = None  # why the loop form could not be used
        self.compile_time = 0.0
        self.eager_reason: str | None = None
        self._fns: dict[tuple[int, bool], Callable] = {}
        if self.form == "loop" and compiled:
            self.loop_reason = loop_refused(step)
            if self.loop_reason is not None:
                self.form = "unrolled"
        # compiled functions per segment length, shared by the instances of this step, k
        # and form
        self._key = (step_identity(step), k, strict, self.form)
        self._compiled: dict[int, Callable] = \
            _compiled.setdefault(self._key, {}) if compiled else {}
        if compiled:
            self.eager_reason = _eager_reasons.get(self._key)
            if self.eager_reason is None and self.form == "unrolled" and k > UNROLLED_MAX \
                    and self.loop_reason is not None:
                self.eager_reason = (f"the loop form cannot take it ({self.loop_reason}) "
                                     f"and {k} unrolled steps would compile too long")
        inverse = getattr(step, "inverse", None)
        if k == 1 and callable(inverse):
            self.inverse = inverse

    @property
    def ready(self) -> bool:
        """Whether a full segment has run in both grad modes (compiled, or found eager)."""
        return (self.k, True) in self._fns and (self.k, False) in self._fns

    @property
    def segments(self) -> int | None:
        """The chain's length ``ceil(n / k)`` (``None`` for an unknown length)."""
        return None if self.n_steps is None else segment_count(self.n_steps, self.k)

    def length(self, j: int) -> int:
        """The steps in segment ``j``."""
        if self.n_steps is None:
            return 1
        return min(self.k, self.n_steps - j * self.k)

    def eager_steps(self, state: Any, j: int):
        """The user's steps of segment ``j`` run eagerly one by one from its start
        ``state``: ``(i, x_{i+1})`` for each (a diagnosis, :mod:`~deepsolve.engine.finite`)."""
        x = state
        for i in range(j * self.k, j * self.k + self.length(j)):
            res = self.step(x, i)
            x = res[0] if self.has_output else res
            yield i, x

    def steps_of(self, j: int) -> str:
        """Segment ``j`` in words, by the steps it runs (for error messages)."""
        a = j * self.k
        return f"segment {j} (steps {a}..{a + self.length(j) - 1})"

    def __call__(self, state: Any, j: int) -> Any:
        start = j * self.k
        length = self.k if self.n_steps is None else min(self.k, self.n_steps - start)
        fn = self._fns.get((length, torch.is_grad_enabled()))
        if fn is None:
            return self._first(state, start, length)
        try:
            return fn(state, start)
        except Exception as e:  # a guard failure that cannot recompile: eager from now on
            if not self.compiled or self.eager_reason is not None:
                raise
            res = self._eager(length)(state, start)  # the user's own error raises here
            self._fall_back(f"a later compiled call failed: {_first_line(e)}")
            return res

    # -- first calls ------------------------------------------------------------------------

    def _eager(self, length: int) -> Callable:
        pad = self.k - length
        return _segment(self.step, length, bool(self.has_output), pad, self.k > 1)

    def _first(self, state: Any, start: int, length: int) -> Any:
        """The first call of a segment length in a grad mode: find the output structure,
        compile, check against the eager segment, time it all."""
        t0 = time.perf_counter()
        if self.has_output is None:
            self.has_output = self._find_output(state, start)
        grad = torch.is_grad_enabled()
        if not self.compiled or self.eager_reason is not None or length != self.k:
            # the remainder (fewer than k steps, the last segment) runs eagerly: a graph of
            # its own would cost a compile for a few step evaluations per unroll
            eager = self._eager(length)
            self._fns[(length, grad)] = eager
            return eager(state, start)
        known = self._compiled.get(length)
        if known is None:
            checked = self._check(state, start, length)
            if checked is None:  # fell back to eager
                return self._first(state, start, length)
            self._compiled[length] = known = checked  # one compiled function, both grad modes
        try:
            res = known(state, start)
        except Exception as e:
            self._fall_back(f"it does not compile with gradients: {_first_line(e)}")
            return self._first(state, start, length)
        self._fns[(length, grad)] = known
        self.compile_time += time.perf_counter() - t0
        return res

    def _find_output(self, state: Any, start: int) -> bool:
        """Whether the step returns ``(state, output)``: one eager step, RNG put back."""
        cuda = cuda_devices(_leaves(state))
        rng = RngState.capture(cuda)
        try:
            with torch.no_grad():
                res = self.step(state, start)
        finally:
            rng.restore()
        spec = pytree.tree_structure(state)
        return returns_output(res, lambda x: pytree.tree_structure(x) == spec)

    def _compile(self, length: int, cuda: bool = False,
                 device: torch.device | None = None) -> Callable:
        """``torch.compile`` of the ``length``-step segment in this :attr:`form`; on CUDA
        under CUDA graphs (``mode="reduce-overhead"``: one graph launch per segment), its
        outputs copied out of the graph's memory, which the next replay overwrites."""
        _mark_index_dynamic()
        config = torch._inductor.config  # a release without a setting: skipped
        options = {k: v for k, v in INDUCTOR_OPTIONS.items() if hasattr(config, k)}
        if self.form == "loop":
            _scan_cacheable()
            fn = _loop(self.step, length, bool(self.has_output))
        else:
            fn = self._eager(length)
        if not cuda:
            compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
        else:
            graphed = torch.compile(
                fn, fullgraph=True, dynamic=False,
                options={**torch._inductor.list_mode_options("reduce-overhead"), **options})

            def compiled(state, start):
                torch.compiler.cudagraph_mark_step_begin()
                return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor)
                                       else t, graphed(state, start))
        if self.form != "loop":
            return compiled
        def looped(state, start):  # the start as a tensor: a value is never specialised
            return compiled(state, torch.tensor(start, dtype=torch.float64,
                                                device=device or "cpu"))
        return looped

    def _check(self, state: Any, start: int, length: int) -> Callable | None:
        """Run the eager segment, then the compiled one, from ``state`` under ``no_grad``;
        the compiled function, or ``None`` (after falling back) when it cannot be trusted.
        A segment that draws random numbers is refused before anything is compiled."""
        cuda = cuda_devices(_leaves(state))
        rng = RngState.capture(cuda)
        with torch.no_grad():
            try:
                ref = self._eager(length)(state, start)
            finally:
                after = RngState.capture(cuda)
                rng.restore()
            if not rng.same_torch(after):
                self._fall_back("the step draws random numbers, which a compiled segment does "
                                "not replay as the eager steps do (compile=False keeps them "
                                "exact)", refuse=True)
                return None
            leaves = _leaves(state)
            fn = self._compile(length, bool(cuda), leaves[0].device if leaves else None)
            try:
                got = fn(state, start)
            except Exception as e:
                rng.restore()
                if self.form == "loop":
                    return self._unrolled_instead(
                        f"the compiler cannot take it as a loop body: {_first_line(e)}",
                        state, start, length)
                self._fall_back(f"the compiler cannot take it whole: {_first_line(e)}")
                return None
            rng.restore()
        try:
            why = _misfit(got, ref, length) or self._grad_misfit(fn, state, start, length)
        except Exception as e:  # the compiled backward
            if self.form != "loop":
                raise
            return self._unrolled_instead(f"its compiled backward fails: {_first_line(e)}",
                                          state, start, length)
        if why is not None:
            if self.form == "loop":
                return self._unrolled_instead(f"the compiled loop is not the eager segment: "
                                              f"{why}", state, start, length)
            self._fall_back(f"the compiled segment is not the eager one: {why}")
            return None
        return fn

    def _unrolled_instead(self, reason: str, state: Any, start: int,
                          length: int) -> Callable | None:
        """The loop form failed (``reason``): remember it for this step and check the
        unrolled form instead when ``k`` is at most :data:`UNROLLED_MAX` (not a warning: the
        step still runs compiled), else run eagerly with the warning."""
        self.loop_reason = reason
        _loop_reasons[step_identity(self.step)] = reason
        self.form = "unrolled"
        self._key = (*self._key[:3], "unrolled")
        self._compiled = _compiled.setdefault(self._key, {})
        if self.k > UNROLLED_MAX:
            self._fall_back(f"{reason}; {self.k} unrolled steps would compile too long")
            return None
        return self._check(state, start, length)

    def _grad_misfit(self, fn: Callable, state: Any, start: int, length: int) -> str | None:
        """Why the compiled segment's vector-Jacobian product with respect to its input
        state differs from the eager one's (``None``: it does not), for a fixed cotangent."""
        x = pytree.tree_map(lambda t: t.detach().requires_grad_(_floating(t))
                            if isinstance(t, torch.Tensor) else t, state)
        ins = [t for t in _leaves(x) if t.requires_grad]
        if not ins:
            return None
        with torch.enable_grad():
            res = [fn(x, start), self._eager(length)(x, start)]
        vjps = []
        for out in res:
            outs = [t for t in _leaves(out) if t.requires_grad]
            if not outs:
                return None
            cot = [torch.cos(torch.arange(t.numel(), device=t.device, dtype=torch.float64))
                   .to(t.dtype).reshape(t.shape) for t in outs]
            g = torch.autograd.grad(outs, ins, cot, allow_unused=True)
            vjps.append([torch.zeros_like(a) if b is None else b for a, b in zip(ins, g,
                                                                                  strict=True)])
        why = _misfit(vjps[0], vjps[1], length)
        return None if why is None else f"its gradient: {why}"

    def _fall_back(self, reason: str, refuse: bool = False) -> None:
        if self.loop_reason is not None and self.loop_reason not in reason:
            reason += f" (nor as a loop body: {self.loop_reason})"
        msg = f"deepsolve: compiled segments of {_name(self.step)}: {reason}"
        if refuse and self.strict:
            raise CompileError(msg + "; compile='auto' runs such a step eagerly")
        warnings.warn(msg + "; running it eagerly", RuntimeWarning, stacklevel=4)
        self.eager_reason = reason
        self._fns.clear()
        self._compiled.clear()
        _eager_reasons[self._key] = reason

    # -- outputs ----------------------------------------------------------------------------

    def outputs(self, stacked: Any) -> Any:
        """The executor's ``(m, k, ...)`` stack of segment outputs as the plain loop's
        ``(n, ...)`` stack (padding dropped)."""
        if self.k == 1 or self.n_steps is None:
            return stacked
        n = self.n_steps
        return pytree.tree_map(
            lambda t: t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])[:n], stacked)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    line = f"{type(e).__name__}: {line}"
    return line if len(line) <= 200 else line[:197] + "..."


def _name(step: Any) -> str:
    fn = getattr(step, "__func__", step)
    return getattr(fn, "__qualname__", None) or type(step).__name__

