"""Measure one step: the sizes and times the planner weighs.

``profile_step(step, state)`` runs the step a few times and returns a :class:`StepProfile`:

* ``state_bytes`` S — one state;
* ``tape_bytes`` T — what one *recorded* step keeps for its backward beyond its input state
  and the parameters (unique storages packed by ``torch.autograd.graph.saved_tensors_hooks``);
* ``output_bytes`` O — one step's per-step output (the unroll stacks ``n`` of them);
* ``grad_bytes`` P — gradient accumulators for the parameters the step uses;
* ``scratch_bytes`` — on CUDA, the transient peak of a recorded step and its backward beyond
  the above (``torch.cuda.max_memory_allocated``); on CPU 0 (the allocator is not observable);
* ``t_advance``, ``t_record``, ``t_backward`` — seconds for an unrecorded step, a recorded
  step, and the backward of a recorded step (medians).

``profile_step(step, state, policy=p)`` measures the recorded step under a recomputation
policy (:data:`deepsolve.executor.POLICIES`, a policy function or a list of ops): ``tape_bytes``
is then what the kept step holds — the outputs the selective-checkpoint cache keeps, read from
its storage, unique storages, the input and parameters excluded — and ``t_record``,
``t_backward`` include the checkpoint's work and the recomputation in the backward. Its
``base_tape_bytes`` is the plain tape ``T``: when a kept step's backward runs, the recomputation
rebuilds what plain autograd would have saved, so reversing it needs up to ``T`` more
(``reverse_extra``; an upper bound, since the cached outputs are counted twice).

Profiles are cached per (step, state shapes, dtypes, device, policy name) so a training loop
that calls ``unroll(..., budget=...)`` every iteration profiles once; policies given as
functions or op lists are measured each time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..executor import (
    CompiledPolicy,
    _graph_leaves,
    _Recorder,
    _Step,
    policy_context,
    policy_name,
    saved_bytes,
)

__all__ = ["StepProfile", "profile_step", "clear_profile_cache"]


@dataclass(frozen=True)
class StepProfile:
    """Measured sizes [bytes] and times [s] of one step; see the module docstring.

    ``policy`` names the recomputation policy the tape and record/backward times were measured
    under (``"none"``: plain autograd); ``base_tape_bytes`` is then the plain tape ``T`` (``None``
    for ``"none"``: ``tape_bytes`` itself). ``snapshot_bytes`` is the size of one stored
    snapshot when snapshots are kept in a smaller dtype (``None``: a state,
    ``state_bytes``); the planner sets it, it is not measured.
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

    @property
    def working_bytes(self) -> int:
        """Fixed overhead of the reverse sweep beyond snapshots and the tape: the working
        state, two adjoints, the parameter gradients and the measured scratch."""
        return 3 * self.state_bytes + self.grad_bytes + self.scratch_bytes

    @property
    def plain_tape_bytes(self) -> int:
        """``T``: what one recorded step saves without a policy (a step reversed at once)."""
        return self.tape_bytes if self.base_tape_bytes is None else self.base_tape_bytes

    @property
    def reverse_extra(self) -> int:
        """Bytes that reversing a kept tape adds on top of it: 0 without a policy, else the
        recomputation of the plain tape, ``T``."""
        return 0 if self.policy == "none" else self.plain_tape_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one snapshot slot holds."""
        return self.state_bytes if self.snapshot_bytes is None else self.snapshot_bytes


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
                 cache: bool = True, policy: Any = "none") -> StepProfile:
    """Measure ``step`` on ``state`` (see :class:`StepProfile`), its recorded step under
    ``policy`` (default ``"none"``: plain autograd). Runs the step ``1 + 2 * repeats`` times
    (the first call is a warm-up), and ``1 + repeats`` more recorded under a policy. The CPU
    and CUDA random number generators are left as they were, so profiling does not shift a
    stochastic step's stream.
    """
    leaves = [state] if isinstance(state, torch.Tensor) else pytree.tree_leaves(state)
    cuda = sorted({t.device.index or 0 for t in leaves
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    context_fn = policy_context(policy)  # a one-line error for an unknown policy
    with torch.random.fork_rng(devices=cuda):
        base = _profile_step(step, state, params, repeats, cache)
        if context_fn is None:
            return base
        return _profile_policy(step, state, params, repeats, cache, policy, context_fn, base)


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


def _profile_step(step, state, params, repeats: int, cache: bool) -> StepProfile:
    leaves, spec = _flatten(state)
    key = _key(step, leaves)
    if cache and (prof := _cached(key, step)) is not None:
        return prof
    device = leaves[0].device
    cuda = device.type == "cuda"
    x = [t.detach() for t in leaves]
    with torch.no_grad():
        _call(step, x, spec, 0)  # warm-up
        t_adv = []
        for _ in range(repeats):
            _sync(cuda)
            t0 = time.perf_counter()
            _call(step, x, spec, 0)
            _sync(cuda)
            t_adv.append(time.perf_counter() - t0)

    state_bytes = sum(_nbytes(t) for t in x)
    t_rec, t_bwd = [], []
    tape_bytes = out_bytes = grad_bytes = scratch = 0
    for r in range(repeats):
        x_in = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in x]
        skip = {t.untyped_storage().data_ptr() for t in x_in}
        seen: dict[int, int] = {}

        def pack(t, seen=seen, skip=skip):
            if not (t.is_leaf and t.requires_grad):  # inputs and parameters are not the tape's
                ptr = t.untyped_storage().data_ptr()
                if ptr not in skip:
                    seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
            return t.detach() if t.grad_fn is not None else t  # no cycle via grad_fn

        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, out = _call(step, x_in, spec, 0)
        _sync(cuda)
        t1 = time.perf_counter()
        roots = [t for t in (*y, *out) if t.requires_grad]
        in_ids = {id(t) for t in x_in}
        found = [p for p in (_graph_leaves(roots, {}, 0, set()) if params is None else list(params))
                 if id(p) not in in_ids]
        inputs = [t for t in x_in if t.requires_grad] + [p for p in found if p.requires_grad]
        if roots and inputs:
            torch.autograd.grad(roots, inputs, [torch.ones_like(t) for t in roots],
                                allow_unused=True)
        _sync(cuda)
        t2 = time.perf_counter()
        t_rec.append(t1 - t0)
        t_bwd.append(t2 - t1)
        if r == 0:
            tape_bytes = sum(seen.values())
            out_bytes = sum(_nbytes(o) for o in out)
            grad_bytes = sum(_nbytes(p) for p in found if p.requires_grad)
            if cuda:
                peak = torch.cuda.max_memory_allocated(device) - base
                scratch = max(0, peak - tape_bytes - 3 * state_bytes - grad_bytes)
        del y, out, roots
    prof = StepProfile(
        state_bytes=state_bytes, tape_bytes=tape_bytes, output_bytes=out_bytes,
        grad_bytes=grad_bytes, scratch_bytes=scratch,
        t_advance=statistics.median(t_adv), t_record=statistics.median(t_rec),
        t_backward=statistics.median(t_bwd), device=str(device),
    )
    if cache:
        try:
            _cache[key] = (weakref.ref(getattr(step, "__func__", step)), prof)
        except TypeError:  # not weakly referenceable: do not cache
            pass
    return prof


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _cached_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors a selective-checkpoint cache holds (its ``storage``: dicts and lists of
    wrappers with a ``val`` tensor, depending on the torch version)."""
    found, todo = [], [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        else:
            val = getattr(o, "val", None)
            if isinstance(val, torch.Tensor):
                found.append(val)
    return found


def _profile_policy(step, state, params, repeats: int, cache: bool, policy, context_fn,
                    base: StepProfile) -> StepProfile:
    """Tape bytes and record/backward times of ``step`` recorded under ``policy``."""
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
    modes: list = []

    def capture():  # keep the forward context: its storage is the policy's tape
        ctx = context_fn()
        modes.append(ctx[0])
        return ctx

    def fresh():  # the state as new leaves that require grad
        return [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in x]

    compiled = None
    if isinstance(policy, CompiledPolicy):  # record as the executor does: the compiled step
        compiled = _Step(step, spec, x, None)
        recorder = _Recorder(context_fn, True, policy)
        with torch.enable_grad():
            compiled.first(fresh(), 0)  # decides whether the step has outputs
            for i in (1, 0):  # compile; recompile with the step index dynamic, so that an
                recorder(compiled, fresh(), i)  # unroll's later steps do not recompile
    t_rec, t_bwd, tapes = [], [], []
    for r in range(repeats + 1):  # the first run is a warm-up (and the compilation)
        modes.clear()
        x_in = fresh()
        _sync(cuda)
        t0 = time.perf_counter()
        with torch.enable_grad():
            if compiled is not None:
                y, out = recorder(compiled, x_in, 0)
            else:
                y, out = checkpoint(_call, step, x_in, spec, 0, use_reentrant=False,
                                    context_fn=capture)
        _sync(cuda)
        t1 = time.perf_counter()
        roots = [t for t in (*y, *out) if t.requires_grad]
        in_ids = {id(t) for t in x_in}
        found = [p for p in (_graph_leaves(roots, {}, 0, set()) if params is None
                             else list(params)) if id(p) not in in_ids]
        if compiled is not None:  # the compiled backward node holds the tape
            tapes.append(saved_bytes(roots, (*x_in, *found)))
        else:
            skip = {t.untyped_storage().data_ptr() for t in (*x_in, *found)}
            held: dict[int, int] = {}
            for m in modes:
                for t in _cached_tensors(getattr(m, "storage", None)):
                    st = t.untyped_storage()
                    if st.data_ptr() not in skip:
                        held[st.data_ptr()] = st.nbytes()
            tapes.append(sum(held.values()))
            del held
        inputs = [t for t in x_in if t.requires_grad] + [p for p in found if p.requires_grad]
        if roots and inputs:
            torch.autograd.grad(roots, inputs, [torch.ones_like(t) for t in roots],
                                allow_unused=True)
        _sync(cuda)
        t2 = time.perf_counter()
        if r:
            t_rec.append(t1 - t0)
            t_bwd.append(t2 - t1)
        del y, out, roots
    modes.clear()
    prof = dataclasses.replace(
        base, policy=name, tape_bytes=tapes[-1], base_tape_bytes=base.tape_bytes,
        t_record=statistics.median(t_rec), t_backward=statistics.median(t_bwd))
    if cacheable:
        try:
            _cache[key] = (weakref.ref(getattr(step, "__func__", step)), prof)
        except TypeError:  # not weakly referenceable: do not cache
            pass
    return prof
