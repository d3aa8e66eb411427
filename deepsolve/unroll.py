"""``deepsolve.unroll``: the public entry point for checkpointed unrolls.

It turns what the user asks for — a checkpoint strategy (:mod:`deepsolve.memory.strategies`:
``Revolve(s)``, ``Periodic(k)``, ``Budget("2GiB")``, ...) or its short forms ``snapshots=``,
``schedule="periodic"``, ``budget=`` — into a schedule and hands it to the executor
(:mod:`deepsolve.engine`), which knows nothing of budgets. See docs/unroll.md and
docs/budget.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from . import artefacts
from .engine import (
    UNROLLED_MAX,
    HostStorage,
    Segments,
    StepCache,
    Truncation,
    UnrollStats,
    check_truncate,
    default_tolerance,
    execute,
    loop_refused,
    segments,
)
from .memory import BudgetError, device_capacity, format_bytes
from .memory.agree import agree_min, agree_profile
from .memory.budget import BudgetLike, parse_budget
from .memory.offload import DiskStorage
from .memory.planner import choose, online_snapshots
from .memory.planner import plan as make_plan
from .memory.profiling import profile_step
from .memory.segments import (
    COMPILER_ESTIMATE,
    HORIZON,
    SEGMENT_LENGTHS,
    CompilerProbe,
    SegmentChoice,
    choose_segment,
    compiler_memory,
    dispatch_cost,
    loop_lengths,
)
from .memory.strategies import Budget, Online, Reversible, StoreAll, Strategy, as_strategy
from .schedules import Schedule, online, revolve, store_all
from .stability import Stability, StabilityError

__all__ = ["unroll", "UnrollStats", "DEFAULT_MAX_STEPS"]

#: The bound of an ``until=`` unroll without ``max_steps=``: a stop condition that never
#: holds ends in a one-line error after this many steps instead of running (and, without
#: snapshots, growing its recorded graph) forever.
DEFAULT_MAX_STEPS = 100_000


def unroll(
    step: Callable[[Any, int], Any],
    state: Any,
    n_steps: int | None = None,
    *,
    until: Callable[[Any, int], bool] | None = None,
    max_steps: int | None = None,
    snapshots: int | None = None,
    schedule: str | Strategy | Schedule | None = None,
    budget: BudgetLike | Budget | None = None,
    offload: str | None = None,
    spill_dir: str | None = None,
    params: Sequence[torch.Tensor] | None = None,
    has_output: bool | None = None,
    preserve_rng: bool = True,
    stats: UnrollStats | None = None,
    policy: str | Callable | Sequence | None = None,
    snapshot_dtype: torch.dtype | None = None,
    adjoint_hook: Callable[[int, Any], Any] | None = None,
    truncate: int | None = None,
    compile: bool | int | str | None = False,
    compile_runs: int | None = None,
) -> Any:
    """Run ``x_{i+1} = step(x_i, i)`` for ``n_steps`` steps with checkpointed, exact gradients.

    Args:
        step: ``step(state, i) -> next_state`` or ``-> (next_state, output)``; ``i`` is the
            step index. The state is a tensor or a pytree of tensors (tuple, list, dict,
            registered dataclass); the step must return the same structure, shapes, dtypes
            and devices, and must not modify its input in place.
        state: the initial state ``x_0``.
        n_steps: number of steps ``n >= 0``; or ``None`` with ``until``.
        until: ``stop(state, i) -> bool`` for an unroll of unknown length (adaptive time
            stepping, iterations to tolerance): called with the state after ``i`` steps
            (``i = 0`` for the initial state, under ``no_grad``); the unroll stops at the first
            ``i`` where it is true. ``snapshots=`` and ``budget=`` then choose an *online*
            checkpoint schedule (:func:`deepsolve.schedules.online`) whose memory never
            exceeds them; without either, every step is kept recorded. Step ``n - 1`` is
            evaluated once more than offline (it reveals that ``x_n`` is the end).
        max_steps: with ``until``, give up after this many steps: a ``RuntimeError`` saying
            that the stop condition was not met within ``max_steps`` steps. Default
            :data:`DEFAULT_MAX_STEPS` (100 000), so a condition that never holds cannot run
            forever; give a larger bound for longer unrolls.
        snapshots: revolve with this many snapshot slots, ``x_0`` included. Memory is
            ``snapshots`` states plus one recorded step; the step is evaluated
            ``optimal_cost(n, snapshots)`` times unrecorded and ``n`` times recorded.
        schedule: a checkpoint strategy — :class:`~deepsolve.Revolve`,
            :class:`~deepsolve.StoreAll`, :class:`~deepsolve.Periodic`,
            :class:`~deepsolve.RevolveTail`, :class:`~deepsolve.Mixed`,
            :class:`~deepsolve.TwoLevel`, :class:`~deepsolve.Online` (with ``until``),
            :class:`~deepsolve.Reversible` (a step with ``step.inverse(state, i)``: states
            rebuilt by the inverse, memory flat in ``n``; docs/reversible.md) or
            :class:`~deepsolve.Budget` — or by name: ``"revolve"`` (with ``snapshots``),
            ``"store_all"`` (plain backpropagation
            through the recorded graph), ``"periodic"`` (a snapshot every ``ceil(sqrt(n))``
            steps, or every ``ceil(n / snapshots)``), or any schedule object from
            :mod:`deepsolve.schedules`. With none of ``snapshots``, ``schedule`` and
            ``budget``: ``"store_all"``.
        budget: the memory the unroll may add at its peak — bytes, ``"512MiB"``, ``"2GB"``,
            or ``"80%"`` of the device's free memory. The step is profiled once (cached) and
            the planner picks the fastest schedule that fits (:func:`deepsolve.plan`; for a
            step with an inverse it weighs :class:`~deepsolve.Reversible` too);
            :class:`deepsolve.BudgetError` says the minimum when nothing fits.
        offload: with ``budget``, let the planner also weigh a cost-aware two-level schedule
            that keeps some snapshots in pinned host memory (``"host"``, for CUDA) or in
            files under ``spill_dir`` (``"disk"``, for CPU-only machines; removed afterwards,
            also on error). Chosen only when it is predicted to be faster.
        params: tensors the step uses whose gradients are wanted, beyond those found
            automatically. Leaf tensors that require grad (module parameters, closed-over
            leaves) are discovered from the graph of the last step, which the forward sweep
            records, and from the module whose method the step is. List here a tensor
            computed outside the step from such leaves (``p = theta.exp()``: a clear error
            says so) and one used only at some steps.
        has_output: whether the step returns ``(next_state, output)``; by default inferred
            from the first call (a 2-tuple whose first element has the state's structure).
        preserve_rng: snapshot the CPU/CUDA RNG state with each stored state so that
            recomputed steps draw the same random numbers (dropout, stochastic forcing).
        stats: an :class:`UnrollStats` to fill with counts and timings.
        policy: what a *kept* recorded step saves for its backward (selective activation
            checkpointing, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``):
            ``"none"`` (plain autograd), ``"save_expensive"`` (keep the outputs of matrix
            products, convolutions, FFTs, attention and dense solves; recompute pointwise
            ops), ``"save_fft"`` (keep FFT outputs only), ``"recompute_all"`` (keep only
            the step's input), a policy function
            ``(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``, a
            list of op overloads to save, or any of these in
            :class:`deepsolve.CompiledPolicy` (applied by ``torch.compile``'s partitioner:
            no per-op dispatch at run time, one compilation per step function). It
            applies to the tapes a schedule keeps (every step of ``store_all``, ``Record``
            ranges of ``revolve_tail``, ``periodic``, ``mixed``), not to a step reversed as
            soon as it is recorded. Gradients stay exact (compiled: up to the compiled
            kernels' rounding). Default: ``"none"``, or with ``budget`` the planner's choice.
        snapshot_dtype: opt-in, *inexact*: store snapshots (``x_0`` excepted) with their
            floating-point leaves cast to this dtype, e.g. ``torch.bfloat16`` (half the
            memory of float32 snapshots); restored states are cast back, so recomputed steps
            start from rounded states and the gradients carry that error (measured in
            docs/inside-step.md). The budget planner counts the smaller snapshots.

        adjoint_hook: ``fn(i, adjoint) -> adjoint | None``, called in the reverse sweep on
            the adjoint ``dL/dx_i`` (the state's structure; ``i = n .. 0``) before it flows
            into step ``i - 1``: clip, rescale or mask it. The same gradients as
            ``x_i.register_hook`` on every state of a plain loop. Norms of the adjoints:
            ``stats=UnrollStats(adjoint_norms=True)``.
        truncate: ``K``: truncated backpropagation — the adjoint does not cross ``x_K,
            x_2K, ...`` (the gradients of a plain loop that detaches the state there; losses
            come from per-step outputs and the final state). Each window is reversed on its
            own with the strategy's schedule for ``K`` steps (``budget=`` plans one window),
            so memory is that of one window, whatever ``n``; the windows before the last
            cost one more unrecorded forward sweep.
        compile: run ``k`` consecutive steps as one compiled graph (``torch.compile``, the
            loop unrolled; docs/compile.md): ``True`` — compile, the segment length ``k``
            the fastest by the model of :mod:`deepsolve.memory.segments` over
            ``compile_runs`` unrolls, compile time included (per-call overhead, dispatch
            saved, a segment's tape ``k`` steps' under ``budget=``); an integer
            ``k`` — that length; ``"auto"`` — compile only when the model says the compile
            time is repaid against the fastest eager unroll of this step measured so far
            (over ``compile_runs`` unrolls; without it, once the unrolls of
            this step so far would have repaid it: a training loop compiles after a few
            iterations, a single call stays eager); ``False`` (default) — eager steps, or
            what the strategy's ``compile`` field says; ``None`` — eager steps. The
            strategy then checkpoints the chain of ``ceil(n / k)`` segments (``truncate=``
            takes a ``k`` that divides it). A step the compiler cannot take whole or whose
            compiled result differs from the eager one runs eagerly with one warning line; a
            step that draws random numbers is refused with a one-line error (``"auto"``:
            the warning). ``until=``, ``adjoint_hook=``, adjoint norms, a schedule object and
            a reversible strategy see every state: they run compiled single steps. Gradients
            are those of the compiled forward (the eager ones up to rounding). A strategy's
            ``compile`` field (``Revolve(8).compiled()``, ``Budget("1GiB", compile=True)``)
            gives the same when this argument is not set.
        compile_runs: how many unrolls of this step the compile time is spread over (a
            training run's iterations), for ``compile="auto"`` and ``True`` (which then
            assumes 20).

    Returns:
        ``x_n``, or ``(x_n, outputs)`` where ``outputs`` stacks the per-step outputs along a
        new leading dimension of size ``n`` (leaf-wise for pytrees).

    Under ``torch.no_grad()`` (or when nothing requires grad) this is the plain loop.

    Raises:
        TypeError: ``step`` is not a function of ``(state, i)`` (one line naming it), or the
            arguments are not in the order ``unroll(step, x0, n_steps)``.
        RuntimeError: the step modified its input state in place (found at step 0).
    """
    _check_step(step)
    rep = _stability(step, state, n_steps, until, max_steps)
    if compile is False:  # the strategy's field (None: eager whatever it says)
        compile = getattr(schedule, "compile", False) or getattr(budget, "compile", False)
    if compile == "auto" and stats is None:
        stats = UnrollStats()  # "auto" measures an eager unroll's time to decide
    if stats is not None:
        stats.segment, stats.compile_time = 1, 0.0  # this unroll's (a reused object too)
    if compile is not False and compile is not None:
        done = _segmented(step, state, n_steps, compile, compile_runs, until=until,
                          max_steps=max_steps, snapshots=snapshots, schedule=schedule,
                          budget=budget, offload=offload, spill_dir=spill_dir, params=params,
                          has_output=has_output, preserve_rng=preserve_rng, stats=stats,
                          policy=policy, snapshot_dtype=snapshot_dtype,
                          adjoint_hook=adjoint_hook, truncate=truncate)
        if done is not _EAGER:
            return done
    if until is not None:
        if truncate is not None:
            raise ValueError("unroll: truncate= needs a known n_steps, not until=")
        return _unroll_until(step, state, until, max_steps, snapshots, schedule, budget,
                             params, has_output, preserve_rng, stats, n_steps, policy,
                             snapshot_dtype, adjoint_hook, _diagnosis(rep))
    if n_steps is None:
        raise ValueError("unroll: give n_steps, or until=stop for an unroll of unknown length")
    if truncate is not None:
        check_truncate(truncate)
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
        raise ValueError(f"unroll: n_steps must be an integer >= 0, got {n_steps!r}")
    how = as_strategy(schedule, snapshots, budget, offload, spill_dir)
    storage = None
    chosen: Any = how
    if truncate is not None and n_steps > 0 and torch.is_grad_enabled():
        window, storage, policy, chosen = _windows(step, state, n_steps, truncate, how,
                                                   params, policy, snapshot_dtype, stats, rep)
        return execute(step, state, None, params=params, has_output=has_output,
                       preserve_rng=preserve_rng, stats=stats, storage=storage, policy=policy,
                       snapshot_dtype=snapshot_dtype, adjoint_hook=adjoint_hook,
                       truncate=Truncation(n_steps, truncate, window),
                       diagnose=_diagnosis(rep),
                       **_reversal(chosen, step, None, rep, stats, state))
    sched: Schedule
    if isinstance(how, Budget):
        if n_steps == 0 or not torch.is_grad_enabled():
            sched = store_all(n_steps)
        else:
            p = make_plan(step, state, n_steps, budget=how.budget, params=params,
                          offload=how.offload, spill_dir=how.spill_dir, policy=policy,
                          snapshot_dtype=snapshot_dtype, group=how.group, stability=rep)
            sched = p.schedule
            policy = p.policy
            chosen = p.strategy
            storage = _second_level(p, how)
            if stats is not None:
                stats.extra["plan"] = p
    else:
        # as_strategy(online=False) gives neither None nor an online schedule
        sched = _schedule_of(cast("Strategy | Schedule", how), n_steps)
        if sched.kind == "store_all" and n_steps >= _CHECK_STORE_ALL_FROM and \
                torch.is_grad_enabled():
            _check_store_all_fits(step, state, n_steps, params)
    return execute(step, state, sched, params=params, has_output=has_output,
                   preserve_rng=preserve_rng, stats=stats, storage=storage, policy=policy,
                   snapshot_dtype=snapshot_dtype, adjoint_hook=adjoint_hook,
                   diagnose=_diagnosis(rep), **_reversal(chosen, step, sched, rep, stats, state))


_EAGER = object()  # _segmented's answer when the steps run eagerly


def _compile_mode(compile: Any) -> bool | int | str:
    if compile is True or compile == "auto":
        return compile
    if isinstance(compile, int) and not isinstance(compile, bool) and compile >= 1:
        return compile
    raise ValueError(f"unroll: compile must be True, False, 'auto' or a segment length >= 1, "
                     f"got {compile!r}")


def _segmented(step, state, n_steps, compile, runs, *, until, truncate, stats, **kw) -> Any:
    """``unroll`` over compiled segments of ``k`` steps (:mod:`deepsolve.engine.segments`),
    ``k`` from :func:`deepsolve.memory.segments.choose_segment`; :data:`_EAGER` when the
    model says eager (``compile="auto"``)."""
    mode = _compile_mode(compile)
    if runs is not None and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
        raise ValueError(f"unroll: compile_runs must be an integer >= 1, got {runs!r}")
    how: Any = kw["schedule"]
    single = (until is not None or kw["adjoint_hook"] is not None
              or (stats is not None and stats.adjoint_norms is not False)
              or isinstance(how, Schedule) or getattr(how, "kind", None) == "reversible")
    choice = None
    probe = CompilerProbe() if torch.is_grad_enabled() else None  # before the choice of k
    if mode is not True and isinstance(mode, int):
        k = 1 if single else mode
    elif n_steps is None or n_steps == 0 or not torch.is_grad_enabled():
        k = 1 if mode is True else 0  # no chain to model: "auto" stays eager
    else:
        measured = None
        if mode == "auto":
            # "auto" runs the first unroll of a step eagerly and decides at the next one from
            # its measured time (the model's eager prediction misses the executor's own
            # per-step work): over the runs left of compile_runs, or as many as so far
            rec = _auto_seen.get(step)
            if rec is None:
                rec = _AutoSeen()
                _auto_seen.put(step, rec)
            rec.calls += 1
            if rec.last is None or rec.n_steps != n_steps:
                rec.last, rec.n_steps, rec.choice = stats, n_steps, None  # measure this one
                rec.fastest = None
                return _EAGER
            if rec.choice is not None:  # compiled already: keep its k (a new k recompiles)
                return _segment_with(step, state, n_steps, rec.choice.k, rec.choice, mode,
                                     probe, until=until, truncate=truncate, stats=stats,
                                     **kw)
            # the fastest eager unroll seen, not the last: a pause (a GC pass, another
            # process) only ever makes eager look slower, and one slow sample must not buy
            # a compile that the step's real time never repays
            last = rec.last.forward_time + rec.last.backward_time
            if last > 0:
                rec.fastest = last if rec.fastest is None else min(rec.fastest, last)
            measured = rec.fastest
            runs = rec.calls - 1 if runs is None else max(runs - rec.calls + 1, 1)
        choice = _choose_k(step, state, n_steps, mode, runs or HORIZON, kw,
                           (1,) if single else SEGMENT_LENGTHS, measured)
        k = choice.k
        if mode == "auto":
            if k == 0:
                rec.last = stats  # measure again: the next call decides with one run fewer
            else:
                rec.choice = choice
    return _segment_with(step, state, n_steps, k, choice, mode, probe, until=until,
                         truncate=truncate, stats=stats, **kw)


def _segment_with(step, state, n_steps, k: int, choice, mode, probe: CompilerProbe | None, *,
                  until, truncate, stats, **kw) -> Any:
    """``unroll`` over segments of ``k`` steps (``0``: :data:`_EAGER`); ``probe`` (started
    before the choice of ``k``) measures the process's first compiled preparation."""
    if k == 0:
        if stats is not None and choice is not None:
            stats.extra["compile"] = choice
        return _EAGER
    if truncate is not None and n_steps is not None:
        K = check_truncate(truncate)
        k = max(d for d in range(1, min(k, K) + 1) if K % d == 0)
    budgeted = _host_budget(state, kw)
    known = compiler_memory()
    compiler = COMPILER_ESTIMATE if known is None else max(known)
    if budgeted is not None and mode == "auto" and 8 * compiler > budgeted:
        if stats is not None:
            about = format_bytes(compiler)
            stats.extra["compile"] = SegmentChoice(
                0, f"eager: the compiler's one-time host memory (about {about}) is more than "
                "1/8 of the budget")
        return _EAGER
    form = _form_of(step, k, choice)
    seg = segments(step, k, n_steps if until is None else None, has_output=kw["has_output"],
                   strict=mode != "auto", form=form)
    if kw["policy"] is None:  # the compiled backward keeps what the compiler chose to save:
        kw = {**kw, "policy": "none"}  # recomputation policies are not weighed
    if not seg.ready and seg.compiled and seg.eager_reason is None:
        artefacts.load_for(step)  # an earlier process's compiled graphs, checked
    if torch.is_grad_enabled():
        if not seg.ready:  # compile before the unroll (and profile the segment)
            _warm(seg, state)
            if seg.compile_time > 0 and seg.eager_reason is None:
                artefacts.save_for(step)  # for the next process
        if probe is not None and probe.active:  # the first compiled preparation: measured
            profile_step(seg, state, params=kw["params"])  # cached for the plan
            resident, peak = probe.finish()
        else:
            resident, peak = compiler_memory() or (0, 0)
        if budgeted is not None:
            if max(resident, peak) >= budgeted:
                raise BudgetError(
                    f"unroll: the budget {format_bytes(budgeted)} cannot hold the compiler's "
                    f"one-time host memory ({format_bytes(resident)} resident, "
                    f"{format_bytes(peak)} at its peak); raise the budget or give "
                    "compile=False")
            kw = _less_budget(kw, budgeted - resident)
            if stats is not None:
                stats.extra["compiler_memory"] = resident
    m = seg.segments if until is None else None
    if stats is not None and choice is not None:
        stats.extra["compile"] = choice
    res = unroll(seg, state, m, until=until, truncate=None if truncate is None else
                 truncate // k, stats=stats, compile=None,
                 **{**kw, "has_output": seg.has_output})
    if stats is not None:
        stats.segment = k
        stats.compile_time = seg.compile_time  # this unroll's (a reused stats object too)
        plan = stats.extra.get("plan")
        if plan is not None and choice is not None:
            plan.segment = choice
    if seg.has_output:
        x, outs = res
        return x, seg.outputs(outs)
    return res


def _host_budget(state: Any, kw: dict) -> int | None:
    """The budget in bytes when the unroll is budgeted on the CPU (where the compiler's own
    memory is part of what the budget bounds), else ``None``."""
    how = kw["budget"] if kw["budget"] is not None else kw["schedule"]
    if how is None or (not isinstance(how, Budget) and kw["budget"] is None):
        return None
    leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].device.type != "cpu":
        return None
    return parse_budget(how.budget if isinstance(how, Budget) else how, leaves[0].device)


def _less_budget(kw: dict, nbytes: int) -> dict:
    """``kw`` with its budget lowered to ``nbytes`` (the compiler's resident bytes taken off)."""
    how = kw["budget"] if kw["budget"] is not None else kw["schedule"]
    if isinstance(how, Budget):
        lowered = Budget(nbytes, how.offload, how.spill_dir, how.group)
    else:
        lowered = Budget(nbytes, kw["offload"], kw["spill_dir"])
    return {**kw, "budget": lowered, "schedule": None, "offload": None, "spill_dir": None}


def _warm(seg: Segments, state: Any) -> None:
    """Compile the first segment in both grad modes (its backward too) before the unroll
    and its profile run: compilation is not timed as a step, nor counted as its memory."""
    with torch.no_grad():  # as the executor advances: detached states (a state that
        seg(pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                            state), 0)  # requires grad would be a graph of its own)
    x = pytree.tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()
                                                            or t.is_complex())
                        if isinstance(t, torch.Tensor) else t, state)
    res = seg(x, 0)
    ins = [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)
            and t.requires_grad]
    if ins and outs:
        torch.autograd.grad([o.real.sum() if o.is_complex() else o.sum() for o in outs], ins,
                            allow_unused=True)


class _AutoSeen:
    """What ``compile="auto"`` has seen of a step: its unrolls so far, the statistics of the
    last one run eagerly (its measured forward and backward time), the fastest eager unroll
    of this length so far (seconds, what the decision uses) and its length."""

    def __init__(self) -> None:
        self.calls = 0
        self.last: UnrollStats | None = None
        self.fastest: float | None = None
        self.n_steps: int | None = None
        self.choice: SegmentChoice | None = None  # the decision to compile, once taken


_auto_seen = StepCache()  # per step, without keeping the step alive


def _form_of(step: Any, k: int, choice: SegmentChoice | None) -> str:
    """The compiled form of a ``k``-step segment: the model's, or for a length given as
    ``compile=k``, a loop beyond :data:`~deepsolve.engine.segments.UNROLLED_MAX` steps
    (an unrolled graph of that length would compile for minutes) unless the loop form has
    failed on this step."""
    if choice is not None and choice.k == k:
        return choice.form
    return "loop" if k > UNROLLED_MAX and loop_refused(step) is None else "unrolled"


def _choose_k(step, state, n_steps: int, mode, runs: int, kw,
              lengths: tuple[int, ...], measured: float | None = None) -> SegmentChoice:
    """The segment length and form by the model, for the strategy or budget asked for:
    unrolled segments of ``lengths`` and, beside single steps, loops
    (:func:`~deepsolve.memory.segments.loop_lengths`: up to the interval between two
    snapshots, longer for a small state) unless the loop form has failed on this step."""
    how = as_strategy(kw["schedule"], kw["snapshots"], kw["budget"], kw["offload"],
                      kw["spill_dir"])
    prof = profile_step(step, state, params=kw["params"])
    cost = dispatch_cost(step, state)
    loops: tuple[int, ...] = ()
    if lengths != (1,) and loop_refused(step) is None:
        slots = None if isinstance(how, (Budget, StoreAll)) else getattr(how, "snapshots", None)
        loops = loop_lengths(n_steps, prof.state_bytes,
                             slots if isinstance(slots, int) else None)
    if isinstance(how, Budget):
        leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
        nbytes = parse_budget(how.budget, leaves[0].device if leaves else None)

        def time_of(p, m):
            try:
                return choose(p, m, nbytes).predicted_time, True
            except BudgetError:
                return float("inf"), False
    else:
        strategy = how if isinstance(how, Strategy) else StoreAll()  # a schedule object: 1.0

        def time_of(p, m):
            return strategy.predicted_time(p, m), True
    return choose_segment(prof, n_steps, cost.q, cost.d, mode=mode, runs=runs, time_of=time_of,
                          lengths=lengths, heavy=cost.heavy, t_step=cost.t_step,
                          eager=measured or None, loops=loops)


def _reversal(how: Any, step: Any, sched: Schedule | None = None,
              rep: Stability | None = None, stats: UnrollStats | None = None,
              state: Any = None) -> dict[str, Any]:
    """The executor's arguments for a reversible unroll (the step's inverse, the drift
    tolerance, what to do beyond it, and the advice for a drift error: the window the
    step's stability analysis ``rep`` allows, its coupling, and the planner's choice) when
    the strategy or schedule rebuilds states; a one-line error when the step has no
    inverse."""
    kind = how.kind if isinstance(how, (Strategy, Schedule)) else None
    if kind != "reversible" and (sched is None or sched.kind != "reversible"):
        return {}
    inverse = getattr(step, "inverse", None)
    if not callable(inverse):
        raise TypeError("unroll: the reversible schedule needs a step with an inverse, "
                        "step.inverse(state, i) -> the state before; build the step with "
                        "deepsolve.reversible (coupled, explicit, leapfrog, reversible_heun, "
                        "invertible) or use another schedule")
    out: dict[str, Any] = dict(inverse=inverse)
    if isinstance(how, Reversible):
        out.update(tolerance=how.tolerance, on_drift=how.on_drift)
    advice = []
    if rep is not None and state is not None:
        leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
        meta = [(t.shape, t.dtype, t.device) for t in leaves]
        tol = out.get("tolerance") or default_tolerance(meta)
        eps = max((torch.finfo(m[1]).eps for m in meta
                   if m[1].is_floating_point or m[1].is_complex),
                  default=torch.finfo(torch.float64).eps)
        window = rep.window(tol, eps)
        lam = getattr(step, "lam", None)
        coupling = (f", a coupling lam closer to 1 (now {lam:g})"
                    if isinstance(lam, float) and lam < 1 else "")
        advice.append(f"the inverse of {rep.scheme} amplifies rounding by up to "
                      f"{rep.inverse_growth:.4g} per step, so windows of at most "
                      f"{max(window, 0)} steps stay within the tolerance: use "
                      f"Reversible(every={max(window, 1)}) or shorter{coupling}, or Revolve(s)")
    else:
        advice.append("store snapshots more often (Reversible(every=k) with a smaller k), "
                      "raise tolerance=, or give on_drift='recompute'")
    plan = stats.extra.get("plan") if stats is not None else None
    if plan is not None and getattr(plan, "kind", None) == "reversible":
        advice.append(f"the budget planner chose {plan.schedule!r} for "
                      f"{format_bytes(plan.budget)}")
    out["advice"] = "; ".join(advice)
    return out


def _stability(step: Any, state: Any, n_steps: int | None, until: Any,
               max_steps: int | None) -> Stability | None:
    """The step's linear stability at ``state`` (``step.stability``: the reversible steppers
    of :mod:`deepsolve.reversible`), checked for the unroll's length (``until=``: for
    ``max_steps``, or :data:`UNTIL_HORIZON` steps): a one-line
    :class:`~deepsolve.stability.StabilityError` when a mode grows beyond the solution;
    ``None`` for a step without an analysis (or one that fails here: the unroll's own checks
    name the problem). Not under ``torch.distributed`` with several ranks: a step whose
    field exchanges halos would run a different number of collectives on each rank."""
    analyse = getattr(step, "stability", None)
    if not callable(analyse):
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None  # a step that exchanges halos would see the ranks' analyses diverge
    if until is None:
        if not (isinstance(n_steps, int) and not isinstance(n_steps, bool) and n_steps > 0):
            return None  # nothing to run (or a bad length, refused below)
        n = n_steps
    else:
        n = max_steps if isinstance(max_steps, int) and max_steps > 0 else UNTIL_HORIZON
    try:
        rep = analyse(state, 0, n)
    except StabilityError:
        raise
    except Exception:
        return None
    if not isinstance(rep, Stability):
        return None
    rep.check(n)
    return rep


#: the length an unroll of unknown length (``until=`` without ``max_steps``) is checked for
UNTIL_HORIZON = 1000


def _diagnosis(rep: Stability | None) -> Callable[[], str] | None:
    """The diagnosis a non-finite state's error adds: the stepper's stability at ``x_0``."""
    if rep is None:
        return None

    def diagnose() -> str:
        if rep.excess > 1:
            return (f"{rep.scheme} at x_0: a mode grows by {rep.excess:.4g} per step beyond "
                    f"the solution (at {rep.worst}); {rep.fix}")
        return (f"{rep.scheme} was found stable at x_0 (linearised), so the step left that "
                "region later (a nonlinear step): reduce dt, or check the step at that state")

    return diagnose


def _check_step(step: Any) -> None:
    """A one-line ``TypeError`` unless ``step`` can be called as ``step(state, i)``."""
    if not callable(step):
        raise TypeError(f"unroll: step must be a function step(state, i) -> next state, got "
                        f"{type(step).__name__} {' '.join(repr(step).split())[:40]}; the "
                        "arguments are unroll(step, x0, n_steps)")
    fn = step.forward if isinstance(step, torch.nn.Module) else step
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension function: nothing to check
        return
    try:
        sig.bind(None, 0)
    except TypeError:
        name = getattr(fn, "__name__", None) or type(step).__name__
        raise TypeError(f"unroll: the step {name}{sig} cannot be called as step(state, i); "
                        "unroll passes the state and the step index i: write it as "
                        "def step(state, i) (i may be unused)") from None


def _second_level(p, how: Budget) -> dict | None:
    """The storage level 1 a two-level plan writes to (host memory or the spill directory)."""
    if p.kind != "two_level":
        return None
    return {1: HostStorage() if how.offload == "host" else DiskStorage(how.spill_dir)}


def _windows(step, state, n_steps: int, K: int, how, params, policy, snapshot_dtype, stats,
             rep: Stability | None = None):
    """``(window schedule builder, storage, policy, strategy)`` of ``truncate=K``: each window
    of ``K`` steps is reversed on its own, so a strategy builds a ``K``-step schedule, and a budget
    plans one window — beside it the next window's start state and the stacked outputs of
    all ``n`` steps (the window plan counts ``K`` of them)."""
    if isinstance(how, Schedule):
        raise ValueError("unroll: truncate= builds one schedule per window; give a strategy "
                         "(Revolve(s), Periodic(k), ...), snapshots= or budget=, not a "
                         "schedule object built for n_steps")
    m = min(K, n_steps)
    if not isinstance(how, Budget):
        return how.build, None, policy, how
    leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    nbytes = agree_min(parse_budget(how.budget, leaves[0].device if leaves else None),
                       how.group)
    prof = agree_profile(profile_step(step, state, params=params), how.group)
    extra = prof.state_bytes + 2 * (n_steps - m) * prof.output_bytes
    if nbytes - extra <= 0:
        raise BudgetError(
            f"unroll: the budget {format_bytes(nbytes)} cannot hold a truncated unroll of "
            f"{n_steps} steps: the next window's start state and the stacked outputs alone "
            f"take {format_bytes(extra)}; raise the budget")
    p = make_plan(step, state, m, budget=nbytes - extra, params=params, offload=how.offload,
                  spill_dir=how.spill_dir, policy=policy, snapshot_dtype=snapshot_dtype,
                  group=how.group, stability=rep)
    if stats is not None:
        stats.extra["plan"] = p
    storage = _second_level(p, how)
    strategy = p.strategy
    assert strategy is not None  # every plan has its strategy

    def window(length: int) -> Schedule:
        if length == m:
            return p.schedule
        try:  # the last window may be shorter
            return strategy.build(length)
        except ValueError:
            return revolve(length, max(1, min(p.snapshots or 1, length)))

    return window, storage, p.policy, strategy


_CHECK_STORE_ALL_FROM = 10_000  # steps; the profile costs a few step evaluations (cached)


def _schedule_of(how: Strategy | Schedule, n_steps: int) -> Schedule:
    """The schedule a strategy builds for ``n_steps`` steps, or a schedule object checked
    against ``n_steps``."""
    if isinstance(how, Strategy):
        return how.build(n_steps)
    if how.n_steps != n_steps:
        raise ValueError(f"unroll: the schedule is for {how.n_steps} steps but "
                         f"n_steps={n_steps}")
    return how


def _check_store_all_fits(step, state, n_steps: int, params) -> None:
    """A long store-all unroll (plain backpropagation keeps every step) whose predicted
    peak exceeds the device's available memory is refused before it starts, not killed
    by the system halfway through."""
    leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    if not leaves:
        return
    need = StoreAll().predicted_peak(profile_step(step, state, params=params), n_steps)
    have = device_capacity(leaves[0].device)
    if need > have:
        raise BudgetError(
            f"unroll: store_all for {n_steps} steps needs about {format_bytes(need)}, more "
            f"than the {format_bytes(have)} available on {leaves[0].device}; give budget= "
            "(or snapshots=) so that the unroll is checkpointed")


def _unroll_until(step, state, until, max_steps, snapshots, schedule, budget, params,
                  has_output, preserve_rng, stats, n_steps, policy, snapshot_dtype,
                  adjoint_hook=None, diagnose=None):
    if n_steps is not None:
        raise ValueError("unroll: give n_steps or until=, not both (cap an open-ended unroll "
                         "with max_steps=)")
    if not callable(until):
        raise TypeError(f"unroll: until must be callable as until(state, i), got "
                        f"{type(until).__name__}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 1):
        raise ValueError(f"unroll: max_steps must be an integer >= 1, got {max_steps!r}")
    bound = DEFAULT_MAX_STEPS if max_steps is None else max_steps
    how = as_strategy(schedule, snapshots, budget, None, None, online=True)
    sched = how
    if isinstance(how, Online):
        sched = how.build()
    elif isinstance(how, Budget):
        sched = None
        if torch.is_grad_enabled():
            sched = online(agree_min(online_snapshots(step, state, how.budget, max_steps,
                                                      params, snapshot_dtype), how.group))
            if stats is not None:
                stats.extra["online_snapshots"] = sched.snapshots
    try:
        return execute(step, state, sched, params=params, has_output=has_output,
                       preserve_rng=preserve_rng, stats=stats, until=until, max_steps=bound,
                       policy=policy, snapshot_dtype=snapshot_dtype, adjoint_hook=adjoint_hook,
                       diagnose=diagnose)
    except RuntimeError as e:
        if max_steps is not None or "stop condition was not met" not in str(e):
            raise
        raise RuntimeError(f"unroll: the stop condition was not met within {bound} steps, the "
                           "default bound of an until= unroll without max_steps=; give "
                           "max_steps=N for a longer unroll, or check the condition") from None
