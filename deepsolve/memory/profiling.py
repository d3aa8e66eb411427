"""Measure one step: the sizes and times the planner weighs.

``profile_step(step, state)`` runs the step a few times and returns a :class:`StepProfile`.
Tensor memory is measured as *live bytes* — what the code allocates and still holds — with
:class:`~deepsolve.memory.live.LiveBytes` (the counters of CUDA's allocator or of deepsolve's
host allocator; without it, the allocation events PyTorch's CPU allocator reports to its
profiler), so it includes the temporaries of the step's forward and the buffers of its
backward, not only the tensors autograd saves. What the engine holds per snapshot, per kept
tape and per link of a chain — the tensors *and* the objects around them, which at small
states are most of the memory — is measured by running the engine itself
(:mod:`~deepsolve.memory.units`). With ``x`` the input state (already held) and ``lambda``
the adjoint seed (allocated before the step, as in the reverse sweep):

* ``state_bytes`` S — one state (its tensors' bytes);
* ``slot_bytes`` S' — what one snapshot holds: the state's tensors (or a row of the
  engine's snapshot pool for a small state), and ``slot_extra`` beside them — its record,
  the schedule's bookkeeping, the allocator's rounding, and the random generators' state
  when the step draws random numbers (``draws_random``; a deterministic step's snapshots
  share one);
* ``advance_bytes`` A — the peak of one unrecorded (``no_grad``) step beyond its input, its
  output included: the working set of an advance;
* ``kept_bytes`` K — what one *recorded* step kept for a later reverse holds in the
  engine: its tape, its output state and per-step outputs, the autograd graph's nodes and
  records, and the tensor objects;
* ``reverse_bytes`` M — the peak of recording one step and running its backward (with
  ``lambda`` as seed): tape, output, temporaries of both passes, the adjoint ``lambda_i``, the
  parameter gradients it returns, and the recorded step's objects. ``scratch_bytes`` =
  M − K is the transient of the backward beyond what the forward keeps;
* ``chain_bytes`` C — what one more recorded step adds to a plain autograd chain, objects
  included: a store-all unroll holds about ``K + (n − 1) C`` before its backward;
* ``tape_bytes`` T — the tensors autograd saves for the backward beyond the input and the
  parameters (unique storages packed by ``saved_tensors_hooks``; part of K);
* ``output_bytes`` O — one step's per-step output (the unroll stacks ``n`` of them);
* ``grad_bytes`` P — gradient buffers for the parameters the step uses;
* ``t_advance``, ``t_record``, ``t_backward`` — seconds for an unrecorded step, a recorded
  step, and the backward of a recorded step (medians of ``repeats``; taken outside the
  memory measurement, which runs once, untimed).

``profile_step(step, state, policy=p)`` measures the recorded step under a recomputation
policy (:data:`deepsolve.engine.POLICIES`, a policy function or a list of ops): K, M and C
are then those of a step recorded under it (what its selective-checkpoint cache keeps; the
backward recomputes the rest, inside M), ``tape_bytes`` is what the cache holds, and
``t_record``, ``t_backward`` include the checkpoint's work and the recomputation.
``base_tape_bytes`` is the plain tape. ``saves`` counts the ops the policy chose to keep in
one forward (``None`` for the plain profile): a named policy that keeps nothing on this step
(``"save_fft"`` on a step without FFTs) is ``"recompute_all"`` in disguise, and the planner
does not weigh it.

*The same figures in every process.* On the CPU the whole profile runs in a thread of its
own, with large blocks mapped whole pages: the C library's free blocks from this process's
history (whose order differs between processes) do not change what the step's blocks cost,
and the engine's units are medians over identical units, their objects rounded up to 1/8
of their order of magnitude and to :func:`~deepsolve.memory.units.resolution` at least. A
budget then gives one plan.

Profiles are cached per (step, state shapes, dtypes, device, policy name) so a training loop
that calls ``unroll(..., budget=...)`` every iteration profiles once; policies given as
functions or op lists are measured each time. A profile costs about ten step evaluations,
three recorded steps with one backward, and the engine's probe (a few snapshots and kept
recordings, twice for small states).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..engine import (
    CompiledPolicy,
    Recorder,
    RngState,
    Step,
    graph_leaves,
    graph_nodes,
    policy_context,
    policy_name,
    pull_back,
    save_expensive,
    save_fft,
    saved_bytes,
)
from . import hostalloc
from .live import LiveBytes, heap_in_use
from .saved import SavedTensors
from .units import (
    HEAP_RESIDENT,
    backward_bytes_per_node,
    in_fresh_thread,
    measure_units,
    probe_peak,
    quantize,
)

__all__ = ["StepProfile", "profile_step", "clear_profile_cache"]


@dataclass(frozen=True)
class StepProfile:
    """Measured sizes [bytes] and times [s] of one step; see the module docstring.

    ``t_extra`` (policy profiles): what recording and reversing a step under the policy
    costs beyond the plain step, the median of differences timed side by side.

    ``policy`` names the recomputation policy the recorded step was measured under
    (``"none"``: plain autograd); ``base_tape_bytes`` is then the plain tape (``None`` for
    ``"none"``). ``snapshot_bytes`` is the size of one stored snapshot when snapshots are
    kept in a smaller dtype (``None``: a state, ``state_bytes``); the planner sets it, it is
    not measured. ``measured`` is ``False`` when the working set could not be observed (the
    profiler was already running) and K, M, A, C are conservative estimates from the tape.

    ``units_measured`` says whether K, C and ``slot_extra`` come from the engine's probe or
    are estimated (a budget too small to warrant the probe: few units fit); ``tensors_kept``
    and ``tensors_reverse`` are K and M of the tensors alone, ``step_objects`` what the C
    library counts beside the tensors of one recorded step (its graph's nodes and records),
    ``backward_bytes`` what autograd's engine keeps per step of a chain it reverses whole
    (part of C); ``profile_peak`` is the most the profile held at once.

    ``t_inverse``: the time of the step's inverse (a reversible step, ``step.inverse``),
    set by the planner; ``None``: not measured (assumed ``t_advance``).
    """

    state_bytes: int
    tape_bytes: int
    output_bytes: int
    grad_bytes: int
    scratch_bytes: int
    t_advance: float
    t_record: float
    t_backward: float
    device: str
    policy: str = "none"
    base_tape_bytes: int | None = None
    snapshot_bytes: int | None = None
    kept_bytes: int = 0
    reverse_bytes: int = 0
    advance_bytes: int = 0
    chain_bytes: int = 0
    measured: bool = True
    saves: int | None = None
    base_reverse_bytes: int | None = None
    t_extra: float | None = None
    slot_extra: int = 0
    draws_random: bool = False
    units_measured: bool = False
    profile_peak: int = 0
    tensors_kept: int = 0
    tensors_reverse: int = 0
    step_objects: int = 0
    backward_bytes: int = 0
    t_inverse: float | None = None

    @property
    def plain_reverse_bytes(self) -> int:
        """M of the step recorded without a policy (reversed as soon as it is recorded)."""
        return self.reverse_bytes if self.base_reverse_bytes is None else self.base_reverse_bytes

    @property
    def step_bytes(self) -> int:
        """The working set of a step advanced, or recorded and reversed at once (no policy):
        ``max(A, M)``."""
        return max(self.advance_bytes, self.plain_reverse_bytes)

    @property
    def plain_tape_bytes(self) -> int:
        """What one recorded step saves without a policy."""
        return self.tape_bytes if self.base_tape_bytes is None else self.base_tape_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one snapshot slot holds: its tensors and ``slot_extra``."""
        return (self.state_bytes if self.snapshot_bytes is None else self.snapshot_bytes) + \
            self.slot_extra

    @property
    def recomputes_all(self) -> bool:
        """The policy keeps nothing of the step (``"recompute_all"``, or a named policy none
        of whose ops the step runs)."""
        return self.policy == "recompute_all" or self.saves == 0


_cache: dict[tuple, tuple[Any, StepProfile]] = {}


def clear_profile_cache() -> None:
    """Forget all cached profiles (e.g. after changing what a step closes over)."""
    _cache.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _call(step, leaves, spec, i):
    state = leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec)
    res = step(state, i)
    if isinstance(res, tuple) and len(res) == 2 and not _same(res, spec) and _same(res[0], spec):
        nxt, out = res
    else:
        nxt, out = res, ()
    return pytree.tree_leaves(nxt), [o for o in pytree.tree_leaves(out)
                                     if isinstance(o, torch.Tensor)]


def _same(x, spec) -> bool:
    if spec is None:
        return isinstance(x, torch.Tensor)
    try:
        return pytree.tree_structure(x) == spec
    except Exception:  # pragma: no cover
        return False


def _key(step, leaves) -> tuple:
    fn = getattr(step, "__func__", step)
    owner = getattr(step, "__self__", None)
    return (id(fn), id(owner), tuple((tuple(t.shape), t.dtype, str(t.device)) for t in leaves))


def profile_step(step, state, *, params: list[torch.Tensor] | None = None, repeats: int = 3,
                 cache: bool = True, policy: Any = "none",
                 gate: Callable[[StepProfile], bool] | None = None) -> StepProfile:
    """Measure ``step`` on ``state`` (see :class:`StepProfile`), its recorded step under
    ``policy`` (default ``"none"``: plain autograd). Runs the step ``1 + 2 * repeats`` times
    and the memory measurement (three recorded steps, one backward); under a policy,
    ``repeats`` recorded steps more and the policy's memory measurement. The CPU and CUDA
    random number generators are left as they were, so profiling does not shift a
    stochastic step's stream.

    ``gate(profile)`` is called as soon as one recorded step and its backward are measured
    (and with a cached profile): a planner raises there when the budget cannot hold one
    recorded step, before the engine's units, the timings and the policies are measured,
    and returns whether the budget warrants measuring the engine's units (which holds a few
    snapshots and recorded steps: :mod:`~deepsolve.memory.units`); when it does not, they
    are estimated (few fit such a budget, so their error is small in bytes) and measured by
    a later call whose budget does.
    On the CPU the profile installs deepsolve's host allocator
    (:mod:`~deepsolve.memory.hostalloc`) and reads its counters, with large blocks mapped,
    in a thread of its own (:func:`~deepsolve.memory.units.in_fresh_thread`): the figures
    are then the same in every process.
    """
    leaves = [state] if isinstance(state, torch.Tensor) else pytree.tree_leaves(state)
    cuda = sorted({t.device.index or 0 for t in leaves
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    context_fn = policy_context(policy)  # a one-line error for an unknown policy
    if cuda:
        return _profile(step, state, params, repeats, cache, gate, policy, context_fn, cuda)
    hostalloc.install()
    with hostalloc.mapping():  # in a thread of its own: the same figures in every process
        return in_fresh_thread(_profile, step, state, params, repeats, cache, gate, policy,
                               context_fn, cuda)


def _profile(step, state, params, repeats, cache, gate, policy, context_fn, cuda):
    with torch.random.fork_rng(devices=cuda):
        base = _profile_step(step, state, params, repeats, cache, gate)
        if context_fn is None:
            return base
        return _profile_policy(step, state, params, repeats, cache, policy, context_fn, base)


def _record_plain(step, spec, leaves, i):
    return _call(step, leaves, spec, i)


def _flatten(state) -> tuple[list[torch.Tensor], Any]:
    if isinstance(state, torch.Tensor):
        return [state], None
    return pytree.tree_flatten(state)


def _cached(key, step) -> StepProfile | None:
    """The cached profile for ``key`` if it was measured for this very step function."""
    entry = _cache.get(key)
    if entry is not None and entry[0]() is getattr(step, "__func__", step):
        return entry[1]
    return None


def _store(key, step, prof: StepProfile) -> None:
    try:
        _cache[key] = (weakref.ref(getattr(step, "__func__", step)), prof)
    except TypeError:  # not weakly referenceable: do not cache
        pass


def _fresh(x: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state as new leaves that require grad (aliases: no copy)."""
    return [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in x]


def _roots_and_inputs(y, out, x_in, params):
    roots = [t for t in (*y, *out) if t.requires_grad]
    in_ids = {id(t) for t in x_in}
    found = [p for p in (graph_leaves(roots, {}, 0, set()) if params is None else list(params))
             if id(p) not in in_ids]
    inputs = [t for t in x_in if t.requires_grad] + [p for p in found if p.requires_grad]
    return roots, found, inputs


@dataclass
class _Memory:
    """What :func:`_measure` observed of one recorded step (tensor bytes)."""

    kept: int = 0
    reverse: int = 0
    tape: int = 0
    output: int = 0
    grads: int = 0
    measured: bool = True
    objects: int = 0
    nodes: int = 0


def _measure(record, x: list[torch.Tensor], params, device: torch.device,
             count_tape: bool = True) -> _Memory:
    """Live tensor bytes of one step recorded by ``record(leaves, i) -> (next, outputs)``:
    kept once its forward returns, and at the peak of its backward; the tape by
    :class:`SavedTensors`."""
    x_in = _fresh(x)
    seeds = [torch.ones_like(t) for t in x]  # lambda_{i+1}: alive before the step
    # the tape: every storage the step saves, freed or not during the step; not the state's
    # (a view of the input saved is the input) nor, as leaves, the inputs and parameters
    tape = SavedTensors(skip={SavedTensors.key(t)[0] for t in x}, record=True)

    mem = _Memory()
    # first a recorded step and its backward, not measured: the caches the first one fills
    # (kernel plans, engine state) are not the step's; its saved tensors give the tape
    with torch.enable_grad():
        warm = _fresh(x)
        if count_tape:
            with tape:
                y, out = record(warm, 0)
        else:
            y, out = record(warm, 0)
        mem.nodes = graph_nodes([t for t in (*y, *out) if t.requires_grad])
        _backward(y, out, warm, params)
        del y, out, warm
    if device.type == "cpu" and hostalloc.active():
        # the C library's count beyond the tensors of a recorded step — its graph's nodes,
        # records and tensor objects: the median of three, one step held at a time
        def objects() -> int:
            seen = []
            for _ in range(3):
                h0, t0 = heap_in_use() or 0, hostalloc.live()
                with torch.enable_grad():
                    y, out = record(_fresh(x), 0)
                seen.append(max((heap_in_use() or 0) - h0 - (hostalloc.live() - t0), 0))
                del y, out
            return int(statistics.median(seen))

        collecting = gc.isenabled()
        gc.disable()  # a collection would free others' garbage between the readings
        try:
            mem.objects = in_fresh_thread(objects)  # an arena as new: the same everywhere
        finally:
            if collecting:
                gc.enable()
    with LiveBytes(device) as lb:  # no hooks here: they would add objects of their own
        with torch.enable_grad():
            y, out = record(x_in, 0)
        k = lb.mark()
        roots, found, inputs = _roots_and_inputs(y, out, x_in, params)
        if roots and inputs:
            seed = [seeds[j] if j < len(y) else torch.ones_like(t)
                    for j, t in enumerate((*y, *out)) if t.requires_grad]
            grads = pull_back(roots, inputs, seed)
            del seed
        else:
            grads = ()
        mem.output = sum(_nbytes(o) for o in out)
        mem.grads = sum(_nbytes(p) for p in found if p.requires_grad)
        del y, out, roots, grads
    mem.measured = lb.measured
    mem.kept = lb.at(k)
    # the output seeds were allocated inside the window; in an unroll they are slices of
    # the caller's output gradients, counted with the stacked outputs
    mem.reverse = max(lb.peak - mem.output, mem.kept)
    assert tape.seen is not None  # record=True
    mem.tape = sum(tape.seen.values())
    return mem


def _timed(record, x: list[torch.Tensor], params, cuda: bool) -> tuple[float, float]:
    """Seconds to record one step with ``record(leaves, i)`` and to run its backward."""
    x_in = _fresh(x)
    _sync(cuda)
    t0 = time.perf_counter()
    with torch.enable_grad():
        y, out = record(x_in, 0)
    _sync(cuda)
    t1 = time.perf_counter()
    _backward(y, out, x_in, params)
    _sync(cuda)
    return t1 - t0, time.perf_counter() - t1


def _backward(y, out, x_in, params) -> None:
    """The backward of a recorded step, seeded with ones, gradients discarded."""
    roots, _, inputs = _roots_and_inputs(y, out, x_in, params)
    if roots and inputs:
        pull_back(roots, inputs, [torch.ones_like(t) for t in roots])


def _estimate(mem: _Memory, state_bytes: int) -> _Memory:
    """Conservative figures from the tape when the working set could not be observed."""
    kept = mem.tape + state_bytes + mem.output
    return dataclasses.replace(mem, kept=kept, reverse=kept + 3 * state_bytes + mem.grads,
                               measured=False)


def _profile_step(step, state, params, repeats: int, cache: bool,
                  gate: Callable[[StepProfile], bool] | None = None) -> StepProfile:
    leaves, spec = _flatten(state)
    key = _key(step, leaves)
    if cache and (prof := _cached(key, step)) is not None:
        if gate is not None and gate(prof) and not prof.units_measured:
            prof = _with_units(prof, step, state, params)  # a budget that warrants them now
            _store(key, step, prof)
        return prof
    device = leaves[0].device
    cuda = device.type == "cuda"
    devices = sorted({t.device.index or 0 for t in leaves if t.device.type == "cuda"})
    x = [t.detach() for t in leaves]
    state_bytes = sum(_nbytes(t) for t in x)
    rng = RngState.capture(devices)
    with torch.no_grad():
        with LiveBytes(device) as lb:  # the warm-up, measured: the advance's working set
            _call(step, x, spec, 0)
        draws = not rng.same_torch(RngState.capture(devices))
        advance = lb.peak if lb.measured else 3 * state_bytes
        t_adv = []
        for _ in range(repeats):
            _sync(cuda)
            t0 = time.perf_counter()
            _call(step, x, spec, 0)
            _sync(cuda)
            t_adv.append(time.perf_counter() - t0)
    plain = functools.partial(_record_plain, step, spec)
    mem = _measure(plain, x, params, device)
    if not mem.measured:
        mem = _estimate(mem, state_bytes)
    # until the engine's units are measured: the tensors, and as much again for the
    # objects around them (the ratio on the tests' smallest steps is 4:1; where this
    # estimate is used the budget holds few units, see the gate)
    step_objects = quantize(HEAP_RESIDENT * mem.objects)  # the recorded step's graph
    prof = StepProfile(
        state_bytes=state_bytes, tape_bytes=mem.tape, output_bytes=mem.output,
        grad_bytes=mem.grads, scratch_bytes=max(mem.reverse - mem.kept, 0),
        t_advance=statistics.median(t_adv), t_record=0.0, t_backward=0.0,
        device=str(device), kept_bytes=mem.kept, reverse_bytes=mem.reverse + step_objects,
        advance_bytes=advance, chain_bytes=mem.kept, measured=mem.measured,
        draws_random=draws, profile_peak=max(advance, mem.reverse), tensors_kept=mem.kept,
        tensors_reverse=mem.reverse, step_objects=step_objects,
        backward_bytes=mem.nodes * backward_bytes_per_node() if device.type == "cpu" else 0)
    units = True if gate is None else gate(prof)  # one recorded step is known: refuse now
    t_rec, t_bwd = zip(*(_timed(plain, x, params, cuda) for _ in range(repeats)), strict=True)
    prof = dataclasses.replace(prof, t_record=statistics.median(t_rec),
                               t_backward=statistics.median(t_bwd))
    prof = _with_units(prof, step, state, params) if units else _estimated_units(prof)
    if cache:
        _store(key, step, prof)
    return prof


def _estimated_units(prof: StepProfile) -> StepProfile:
    """Units from one recorded step — its tensors and the objects the C library counted
    beside them — where the budget is too small to warrant the engine's probe (few fit)."""
    kept = prof.tensors_kept + prof.step_objects
    return dataclasses.replace(prof, kept_bytes=kept, chain_bytes=kept + prof.backward_bytes,
                               slot_extra=1024, units_measured=False)


def _with_units(prof: StepProfile, step, state, params) -> StepProfile:
    """``prof`` (tensor figures) completed by the engine's units, objects included."""
    tensors_kept, S_ = prof.tensors_kept, prof.state_bytes
    units = measure_units(step, state, params, S_, tensors_kept,
                          device=torch.device(prof.device))
    working = max(prof.advance_bytes, prof.reverse_bytes)
    return dataclasses.replace(
        prof, kept_bytes=max(units.kept, tensors_kept),
        chain_bytes=units.link + prof.backward_bytes,
        slot_extra=max(units.slot - S_, 0), units_measured=units.measured,
        profile_peak=max(working, units.peak or probe_peak(units.slot, units.kept, units.link,
                                                           S_, working)))


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _counting(policy: Any, counter: list[int]):
    """A selective-checkpoint ``context_fn`` for a *named* policy that counts the ops it
    keeps in the forward; ``None`` for policies that are not counted."""
    fn = {"save_expensive": save_expensive, "save_fft": save_fft}.get(policy) \
        if isinstance(policy, str) else None
    if fn is None:
        return None
    keep = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    def counted(ctx, op, *args, **kwargs):
        decision = fn(ctx, op, *args, **kwargs)
        if decision in keep and not ctx.is_recompute:
            counter[0] += 1
        return decision

    return functools.partial(create_selective_checkpoint_contexts, counted)


def _profile_policy(step, state, params, repeats: int, cache: bool, policy, context_fn,
                    base: StepProfile) -> StepProfile:
    """Memory and record/backward times of ``step`` recorded under ``policy``."""
    from torch.utils.checkpoint import checkpoint

    name = policy_name(policy)
    leaves, spec = _flatten(state)
    key = (*_key(step, leaves), name)
    cacheable = cache and isinstance(policy, str)
    if cacheable and (prof := _cached(key, step)) is not None:
        return prof
    device = leaves[0].device
    cuda = device.type == "cuda"
    x = [t.detach() for t in leaves]

    compiled = None
    if isinstance(policy, CompiledPolicy):  # record as the executor does: the compiled step
        compiled = Step(step, spec, x, None)
        recorder = Recorder(context_fn, True, policy)
        with torch.enable_grad():
            compiled.first(_fresh(x), 0)  # decides whether the step has outputs
            for i in (1, 0):  # compile; recompile with the step index dynamic, so that an
                recorder(compiled, _fresh(x), i)  # unroll's later steps do not recompile

        def record(xs, i, fn=None):  # fn: as the variant below (never passed here)
            return recorder(compiled, xs, i)
    else:
        def record(xs, i, fn=context_fn):
            return checkpoint(_call, step, xs, spec, i, use_reentrant=False, context_fn=fn)

    counter = [0]
    counting = _counting(policy, counter)
    measure_record = record if counting is None else functools.partial(record, fn=counting)
    mem = _measure(measure_record, x, params, device, count_tape=False)
    saves = counter[0] if counting is not None else None
    if compiled is not None:  # the compiled backward node holds the tape: read it there
        with torch.enable_grad():
            x_in = _fresh(x)
            y, out = record(x_in, 0)
            roots, found, _ = _roots_and_inputs(y, out, x_in, params)
            mem.tape = saved_bytes(roots, (*x_in, *found))
            del y, out, roots
    else:  # what the cache keeps: the kept bytes less the step's output state and outputs
        mem.tape = max(mem.kept - base.state_bytes - base.output_bytes, 0)
    if not mem.measured:
        mem = _estimate(mem, base.state_bytes)
    # the engine's kept tape and chain link under the policy, objects included
    units = measure_units(step, state, params, base.state_bytes, mem.kept, policy=policy,
                          device=device)
    objects = max(units.kept - units.kept_tensors, 0)
    # timed interleaved with the plain step, so that the policy's extra time per kept step
    # is a median of paired differences: a load that drifts during profiling cancels
    plain = functools.partial(_record_plain, step, spec)
    t_rec, t_bwd, t_extra = [], [], []
    for r in range(repeats + 1):  # the first run is a warm-up
        a = _timed(plain, x, params, cuda)
        b = _timed(record, x, params, cuda)
        if r:
            t_rec.append(b[0])
            t_bwd.append(b[1])
            t_extra.append(b[0] + b[1] - a[0] - a[1])
    prof = dataclasses.replace(
        base, policy=name, tape_bytes=mem.tape, base_tape_bytes=base.tape_bytes,
        base_reverse_bytes=base.reverse_bytes,
        t_record=statistics.median(t_rec), t_backward=statistics.median(t_bwd),
        kept_bytes=max(units.kept, mem.kept), reverse_bytes=mem.reverse + objects,
        chain_bytes=units.link + base.backward_bytes,
        scratch_bytes=max(mem.reverse - mem.kept, 0), measured=mem.measured and base.measured,
        saves=saves, t_extra=statistics.median(t_extra))
    if cacheable:
        _store(key, step, prof)
    return prof
