"""The executor: runs a checkpoint schedule as a ``torch.autograd.Function``.

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
gradients: recomputed steps replay the same RNG stream and autocast settings.

Inside the step: a *recomputation policy* shrinks what a kept recorded step holds (its tape)
by running it under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with
PyTorch's selective activation checkpointing: the outputs of the ops the policy saves are
cached, everything else is recomputed from the step's input when its backward runs. It applies
to tapes that are *kept* (``Record`` ranges and the store-all graph); a step reversed as soon
as it is recorded gains nothing from it, since its backward recomputes the full tape at once.
``snapshot_dtype`` (opt-in, inexact) stores snapshots rounded to a smaller float type.

Trust: the executor believes neither the schedule nor the step. Every action is checked
against the interpreter's state before it runs (``_Executor``), every state a step returns
against the forward sweep's structure, shapes, dtypes and devices (``_Step``), every recorded
step's graph against the tensors being differentiated (``_unseen_leaf``), and state leaves
returned as constants are checked to stay constants; each misfit is a one-line error.
"""

from __future__ import annotations

import functools
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from .schedules import Schedule
from .schedules.actions import Advance, Free, Record, Restore, Reverse, Store
from .schedules.check import ScheduleError

__all__ = ["execute", "UnrollStats", "HostStorage", "POLICIES", "EXPENSIVE_OPS",
           "save_expensive", "policy_name", "policy_context", "check_snapshot_dtype",
           "snapshot_nbytes", "CompiledPolicy", "SAVE_FFT_OPS", "saved_bytes"]


@dataclass
class UnrollStats:
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
            ``"online_snapshots"`` (with ``until=`` and ``budget=``).
    """

    n_steps: int = 0
    schedule: str = ""
    advances: int = 0
    recorded: int = 0
    snapshots_peak: int = 0
    snapshot_bytes_peak: int = 0
    state_bytes: int = 0
    forward_time: float = 0.0
    backward_time: float = 0.0
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------
# state handling


def _is_diff(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _flatten_state(state: Any) -> tuple[list[torch.Tensor], Any]:
    if isinstance(state, torch.Tensor):
        return [state], None
    leaves, spec = pytree.tree_flatten(state)
    if not leaves:
        raise TypeError("unroll: the state holds no tensors")
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"unroll: state leaf {k} is a {type(leaf).__name__}, not a tensor; every leaf "
                "of the state must be a tensor (keep constants in the step's closure)"
            )
    return leaves, spec


def _unflatten(leaves: Sequence[torch.Tensor], spec: Any) -> Any:
    return leaves[0] if spec is None else pytree.tree_unflatten(list(leaves), spec)


def _spec_str(spec: Any) -> str:
    """A one-line description of a pytree structure."""
    return " ".join(str(spec).split())


def _codec(spec: Any) -> tuple[Callable[[Any], list | None], Callable[[list], Any]]:
    """``(flatten, unflatten)`` for states of structure ``spec``.

    ``flatten(obj)`` returns the leaves of ``obj`` in ``spec``'s order, or ``None`` when
    ``obj`` does not have that structure; a dict is flattened by key, so a step that builds
    its dict in another key order still gives each leaf its place. One-level dicts, tuples
    and lists (the usual states) take a few list operations; other pytrees go through
    ``torch.utils._pytree`` and a comparison of structures."""
    if spec is None:
        return (lambda obj: [obj]), (lambda leaves: leaves[0])
    kids = spec.children()
    flat = all(c.is_leaf() for c in kids)
    n = len(kids)
    if flat and spec.type is dict:
        keys = tuple(spec.context)

        def flatten_dict(obj: Any) -> list | None:
            if type(obj) is not dict or len(obj) != n:
                return None
            try:
                return [obj[k] for k in keys]
            except KeyError:
                return None

        return flatten_dict, (lambda leaves: dict(zip(keys, leaves, strict=True)))
    if flat and spec.type in (tuple, list):
        kind = spec.type

        def flatten_seq(obj: Any) -> list | None:
            return list(obj) if type(obj) is kind and len(obj) == n else None

        return flatten_seq, kind

    def flatten_tree(obj: Any) -> list | None:
        leaves, got = pytree.tree_flatten(obj)
        return leaves if got == spec else None

    return flatten_tree, (lambda leaves: pytree.tree_unflatten(list(leaves), spec))


class _Step:
    """Calls the user's step on flat leaves and checks what comes back.

    The per-step check (:meth:`fast_check`: leaf count, shapes, dtypes, and the structure
    through the flattening) runs after every step evaluation, first or recomputed; every
    recorded step also checks devices (:meth:`check_leaves`) and its outputs
    (:meth:`check_outputs`), so that a recomputed state with other metadata than the
    forward sweep's raises instead of giving a wrong gradient."""

    def __init__(self, fn: Callable, spec: Any, proto: list[torch.Tensor],
                 has_output: bool | None):
        self.fn = fn
        self.spec = spec
        self.meta = [(t.shape, t.dtype, t.device) for t in proto]
        self.has_output = has_output
        self.out_spec: Any = None
        self.out_meta: list[tuple] = []
        self.n_out = 0
        self._flat, self._unflat = _codec(spec)
        self._sd = [(t.shape, t.dtype) for t in proto]
        self._single = len(proto) == 1
        self._shape0, self._dtype0 = proto[0].shape, proto[0].dtype

    def __call__(self, leaves: list[torch.Tensor], i: int):
        """Returns ``(next_leaves, output_leaves)``: the hot path; the structure is checked
        by the flattening, shapes and dtypes by :meth:`fast_check`."""
        spec = self.spec
        res = self.fn(leaves[0] if spec is None else self._unflat(leaves), i)
        if self.has_output:
            nxt, out = res
            out = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
        else:
            nxt, out = res, ()
        if spec is None:
            return [nxt], out
        flat = self._flat(nxt)
        if flat is None:
            self.check(nxt, i)  # raises, naming the structures
        return flat, out

    def fast_check(self, leaves: list[torch.Tensor], i: int) -> None:
        """Per-step check of shapes and dtypes (a few hundred ns per leaf); on a mismatch the
        full check names what is wrong."""
        if self._single:
            t = leaves[0]
            try:
                if t.dtype is self._dtype0 and t.shape == self._shape0:
                    return
            except AttributeError:  # not a tensor
                pass
            self.check_leaves(leaves, i)
            return
        for t, (shape, dtype) in zip(leaves, self._sd, strict=True):  # count fixed by _flat
            try:
                if t.dtype is dtype and t.shape == shape:
                    continue
            except AttributeError:
                pass
            self.check_leaves(leaves, i)
            return

    def first(self, leaves: list[torch.Tensor], i: int):
        """The first call: decide whether the step returns outputs, and check structure."""
        res = self.fn(self._unflat(leaves), i)
        if self.has_output is None:
            self.has_output = not self._matches(res) and isinstance(res, tuple) and \
                len(res) == 2 and self._matches(res[0])
        if self.has_output:
            if not (isinstance(res, tuple) and len(res) == 2):
                raise TypeError(f"unroll: step {i} must return (next_state, output) "
                                f"(has_output=True), got {type(res).__name__}")
            nxt, out = res
            out_leaves, self.out_spec = pytree.tree_flatten(out)
            for k, o in enumerate(out_leaves):
                if not isinstance(o, torch.Tensor):
                    raise TypeError(f"unroll: output leaf {k} of step {i} is a "
                                    f"{type(o).__name__}, not a tensor")
            self.n_out = len(out_leaves)
            self.out_meta = [(o.shape, o.dtype, o.device) for o in out_leaves]
        else:
            nxt, out_leaves = res, []
        nxt_leaves = self.check(nxt, i)
        return nxt_leaves, out_leaves

    def _matches(self, res: Any) -> bool:
        if self.spec is None:
            return isinstance(res, torch.Tensor)
        try:
            flat = self._flat(res)
        except Exception:  # pragma: no cover - exotic containers
            return False
        return flat is not None and all(isinstance(t, torch.Tensor) for t in flat)

    def check(self, nxt: Any, i: int) -> list[torch.Tensor]:
        """The full check of a returned state: structure, then :meth:`check_leaves`."""
        if self.spec is None:
            if not isinstance(nxt, torch.Tensor):
                raise TypeError(f"unroll: step {i} returned a {type(nxt).__name__}; expected "
                                "the next state (a tensor) or (next_state, output)")
            leaves = [nxt]
        else:
            leaves = self._flat(nxt)
            if leaves is None:
                try:
                    got = _spec_str(pytree.tree_structure(nxt))
                except Exception:  # pragma: no cover - exotic containers
                    got = type(nxt).__name__
                raise TypeError(f"unroll: step {i} returned a state of structure {got}, but "
                                f"the state has structure {_spec_str(self.spec)}")
        return self.check_leaves(leaves, i)

    def check_leaves(self, leaves: list[torch.Tensor], i: int) -> list[torch.Tensor]:
        """Every leaf a tensor of the forward sweep's shape, dtype and device."""
        for k, (t, (shape, dtype, device)) in enumerate(zip(leaves, self.meta, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"unroll: step {i} returned a {type(t).__name__} for state "
                                f"leaf {k}; expected a tensor")
            if t.shape != shape or t.dtype != dtype or t.device != device:
                raise ValueError(
                    f"unroll: step {i} changed state leaf {k} from {tuple(shape)} {dtype} on "
                    f"{device} to {tuple(t.shape)} {t.dtype} on {t.device}; a step must return "
                    "a state of the same shape, dtype and device at every call (recomputed "
                    "steps included)"
                )
        return leaves

    def recorded_check(self, y: list[torch.Tensor], out: Sequence[torch.Tensor],
                       i: int) -> None:
        """The check of a recorded step: every state leaf's shape, dtype and device, and the
        outputs' (the detailed checks name what is wrong)."""
        for t, (shape, dtype, device) in zip(y, self.meta, strict=True):
            try:
                if t.dtype is dtype and t.shape == shape and t.device == device:
                    continue
            except AttributeError:
                pass
            self.check_leaves(y, i)
        if out or self.n_out:
            self.check_outputs(out, i)

    def check_outputs(self, out: Sequence[torch.Tensor], i: int) -> None:
        """The per-step outputs of a recorded step against those of step 0."""
        if len(out) != self.n_out:
            raise TypeError(f"unroll: step {i} returned {len(out)} output tensors, step 0 "
                            f"returned {self.n_out}; a step must return the same outputs at "
                            "every call")
        for k, (o, (shape, dtype, device)) in enumerate(zip(out, self.out_meta, strict=True)):
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"unroll: output leaf {k} of step {i} is a "
                                f"{type(o).__name__}, not a tensor")
            if o.shape != shape or o.dtype != dtype or o.device != device:
                raise ValueError(
                    f"unroll: step {i} changed output leaf {k} from {tuple(shape)} {dtype} on "
                    f"{device} to {tuple(o.shape)} {o.dtype} on {o.device}; a step must return "
                    "outputs of the same shape, dtype and device at every call"
                )


# ----------------------------------------------------------------------------------------
# parameter discovery


def saved_bytes(roots: Sequence[torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the unique storages the autograd graph behind ``roots`` keeps for its
    backward, storages of ``exclude`` (inputs, parameters) left out.

    Reads the saved tensors of every node: ``saved_tensors`` of custom functions (compiled
    steps are one such node) and the ``_saved_*`` attributes of built-in nodes. Slow (it
    inspects every node); for profiling only."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    held: dict[int, int] = {}
    seen: set = set()
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found: list = []
        try:
            found.extend(getattr(node, "saved_tensors", None) or ())
        except RuntimeError:  # freed already
            pass
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    val = getattr(node, name)
                except RuntimeError:
                    continue
                found.extend(val if isinstance(val, (tuple, list)) else (val,))
        for t in found:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in skip:
                    held[st.data_ptr()] = st.nbytes()
        todo.extend(f for f, _ in node.next_functions)
    return sum(held.values())


def _graph_leaves(roots: Sequence[torch.Tensor], stop: dict, marker: int,
                  inputs: set) -> list[torch.Tensor]:
    """Leaf tensors requiring grad reached from ``roots``' graph, stopping at ``stop`` nodes.

    A node older than ``marker`` (created before the step ran) that is not a leaf means the
    step uses a tensor computed outside it, which needs ``params=``.
    """
    found: list[torch.Tensor] = []
    seen: set = set()
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in stop:
            continue
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf
            if id(var) not in inputs:
                found.append(var)
            continue
        if node._sequence_nr() < marker and node.name() not in _SAFE_OUTER_NODES:
            raise ValueError(
                f"unroll: the step uses a tensor that requires grad and was computed outside "
                f"it (its graph node is {node.name()}); pass such tensors explicitly with "
                "params=[...] so their gradients can flow"
            )
        todo.extend(f for f, _ in node.next_functions)
    return found


# Nodes of the caller's graph that may be traversed any number of times because they save
# nothing: dtype/device casts, such as those autocast caches for a region's weights.
_SAFE_OUTER_NODES = frozenset({"ToCopyBackward0"})


def _sequence_marker() -> int:
    with torch.enable_grad():
        return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


def _describe(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {t.dtype} tensor"


def _unseen_leaf(y: Sequence[torch.Tensor], out: Sequence[torch.Tensor], known: set[int],
                 x_in: Sequence[torch.Tensor], stop: dict, marker: int) -> str | None:
    """What a recorded step's graph reaches that the unroll does not differentiate, or None.

    Walks the graph behind the step's results ``y`` and outputs ``out`` (each node once,
    stopping at ``stop`` nodes: explicit non-leaf ``params``) and returns a description of
    the first leaf that requires grad and is neither an input ``x_in`` nor in ``known`` (ids
    of the differentiated tensors), or of a node older than ``marker`` (a tensor computed
    outside the step). The reverse sweep runs it on every step it records, so whether a
    gradient is found does not depend on which steps the forward sweep happened to record;
    it costs about half a microsecond per graph node (a recorded step's own autograd work
    is several times that per node)."""
    seen: set = set()
    todo = []
    for r in (*y, *out):
        if r.requires_grad:
            node = r.grad_fn
            if node is not None:
                todo.append(node)
            elif id(r) not in known:
                for t in x_in:
                    if r is t:
                        break
                else:
                    return _describe(r)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        nxt = node.next_functions
        if nxt:
            if stop and node in stop:
                continue
            if node._sequence_nr() < marker and node.name() not in _SAFE_OUTER_NODES:
                return f"a tensor computed outside the step (graph node {node.name()})"
            for f, _ in nxt:
                if f is not None:
                    todo.append(f)
        else:
            var = getattr(node, "variable", None)  # AccumulateGrad: a leaf
            if var is not None and id(var) not in known:
                for t in x_in:
                    if var is t:
                        break
                else:
                    return _describe(var)
    return None


def _dependence(t: torch.Tensor, index: dict[int, int], marker: int) -> set[int] | None:
    """The inputs ``x_in[j]`` (``index``: id -> j) that ``t`` depends on in its graph, or
    ``None`` when it also reaches another tensor that requires grad (a parameter, a tensor
    computed outside the step)."""
    found: set[int] = set()
    if not t.requires_grad:
        return found
    if t.grad_fn is None:
        j = index.get(id(t))
        return None if j is None else {j}
    seen: set = set()
    todo = [t.grad_fn]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        nxt = node.next_functions
        if nxt:
            if node._sequence_nr() < marker:
                return None
            todo.extend(f for f, _ in nxt if f is not None)
        else:
            var = getattr(node, "variable", None)
            if var is not None:
                j = index.get(id(var))
                if j is None:
                    return None
                found.add(j)
    return found


def _constant_leaves(x_in: Sequence[torch.Tensor], y: Sequence[torch.Tensor],
                     candidates: Sequence[int], marker: int) -> tuple[int, ...]:
    """The largest set ``C`` of ``candidates`` such that each ``y[k]``, ``k`` in ``C``,
    depends on nothing but ``x_in[j]``, ``j`` in ``C``: a fixed point of
    ``C <- {k in C : deps(y[k]) <= C}``. If the leaves ``C`` of ``x_0`` do not require grad
    and every step maps such states to such states, no leaf in ``C`` ever depends on
    anything that requires grad (``x_i[C]`` are constants for autograd, as plain
    backpropagation finds them).

    The executor claims this from the first step it records and checks the claim at every
    later recording (the reverse sweep records every step), raising when a step breaks it.
    The claim is made only while some state leaf stays differentiable: otherwise a step
    that reaches a parameter at other steps only (a control applied at the first steps)
    would come back wholly constant and no reverse sweep would ever run to notice."""
    index = {id(t): j for j, t in enumerate(x_in)}
    deps: dict[int, set[int]] = {}
    for k in candidates:
        d = _dependence(y[k], index, marker)
        if d is not None:
            deps[k] = d
    keep = set(deps)
    changed = True
    while changed:
        changed = False
        for k in list(keep):
            if not deps[k] <= keep:
                keep.discard(k)
                changed = True
    return tuple(sorted(keep))


_SCAN_DEPTH = 4
_SCAN_ITEMS = 1024


def _closure_leaves(fn: Any) -> list[torch.Tensor]:
    """Leaf tensors that require grad reachable from the step *function itself*: its closure
    cells, the globals its code names, default arguments, a bound method's object, a
    ``functools.partial``'s arguments, a callable object's attributes, containers of these
    (up to ``_SCAN_DEPTH`` levels and ``_SCAN_ITEMS`` items each), and all parameters of any
    ``nn.Module`` met on the way.

    This makes parameter discovery independent of the schedule: a tensor used only at some
    steps is found whether or not the forward sweep records one of them. Tensors found but
    unused get no gradient (``None``), as in plain autograd."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(fn, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad and obj.grad_fn is None:
                found[id(obj)] = obj
            continue
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                if p.requires_grad:
                    found[id(p)] = p
            continue
        if depth >= _SCAN_DEPTH or isinstance(obj, _SCAN_SKIP):
            continue
        kids: list = []
        if isinstance(obj, types.FunctionType):
            kids.extend(c.cell_contents for c in obj.__closure__ or () if _full(c))
            glob = obj.__globals__
            kids.extend(glob[name] for name in _code_names(obj.__code__) if name in glob)
            kids.extend(obj.__defaults__ or ())
            kids.extend((obj.__kwdefaults__ or {}).values())
        elif isinstance(obj, types.MethodType):
            kids.extend((obj.__self__, obj.__func__))
        elif isinstance(obj, functools.partial):
            kids.extend((obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            if len(obj) <= _SCAN_ITEMS:
                kids.extend(obj)
        elif isinstance(obj, dict):
            if len(obj) <= _SCAN_ITEMS:
                kids.extend(obj.values())
        else:
            try:
                attrs = vars(obj)
            except TypeError:  # no __dict__ (slots, builtins)
                attrs = None
            if isinstance(attrs, dict) and len(attrs) <= _SCAN_ITEMS:
                kids.extend(attrs.values())
            for klass in type(obj).__mro__[:-1]:  # a callable object's own __call__
                call = vars(klass).get("__call__")
                if isinstance(call, types.FunctionType):
                    kids.append(call)
                    break
        todo.extend((k, depth + 1) for k in kids)
    return list(found.values())


_SCAN_SKIP = (types.ModuleType, type, str, bytes, int, float, complex, bool, type(None),
              types.BuiltinFunctionType, types.CodeType, torch.dtype, torch.device)


def _full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


@functools.lru_cache(maxsize=256)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """Global names a code object (and the functions, lambdas, comprehensions defined in it)
    may read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.update(_code_names(c))
    return tuple(sorted(names))


# ----------------------------------------------------------------------------------------
# RNG and autocast


def _devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _get_rng(cuda: list[int]):
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda]


def _set_rng(rng, cuda: list[int]) -> None:
    cpu, gpu = rng
    torch.set_rng_state(cpu)
    for d, st in zip(cuda, gpu, strict=True):
        torch.cuda.set_rng_state(st, d)


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    out = []
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError):  # pragma: no cover - backend missing
            pass
    return out


class _Autocast:
    def __init__(self, state: list[tuple[str, torch.dtype]], cache: bool = True):
        self.ctx = [torch.autocast(dev, dtype=dt, cache_enabled=cache) for dev, dt in state]

    def __enter__(self):
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


# ----------------------------------------------------------------------------------------
# recomputation policies for a recorded step (selective activation checkpointing)

POLICIES = ("none", "save_expensive", "save_fft", "recompute_all")
"""Built-in recomputation policies for a kept recorded step:

* ``"none"`` — autograd keeps what each op saves (today's tape);
* ``"save_expensive"`` — keep the outputs of matrix products, convolutions, FFTs, attention
  and dense factorisations/solves (:data:`EXPENSIVE_OPS`); recompute everything else
  (pointwise ops, reductions, copies) from the step's input in its backward;
* ``"save_fft"`` — keep the outputs of FFTs only (:data:`SAVE_FFT_OPS`): for spectral
  solvers with a small network inside, whose convolutions are cheaper to recompute than to
  keep;
* ``"recompute_all"`` — keep only the step's input; its backward re-runs the whole step
  (``torch.utils.checkpoint`` of one step).

Wrap any of them in :class:`CompiledPolicy` to apply it inside ``torch.compile`` (no per-op
dispatch at run time).
"""


def _ops(*names: str) -> frozenset:
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:  # ops missing from this torch build are skipped
            found.add(op)
    return frozenset(found)


EXPENSIVE_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_int_mm", "convolution", "_convolution",
    "_fft_r2c", "_fft_c2r", "_fft_c2c",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_linalg_solve_ex", "linalg_lu_factor_ex", "_linalg_eigh", "_linalg_svd",
    "linalg_cholesky_ex", "linalg_solve_triangular", "triangular_solve", "linalg_qr",
)
"""The aten ops whose outputs ``"save_expensive"`` keeps: products, convolutions, FFTs,
attention, dense factorisations and solves — ops that cost more than a pass over their output."""


SAVE_FFT_OPS = _ops("_fft_r2c", "_fft_c2r", "_fft_c2c")
"""The aten ops whose outputs ``"save_fft"`` keeps."""


def save_fft(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"save_fft"`` policy: save FFT outputs, prefer to recompute everything else."""
    if op in SAVE_FFT_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"save_expensive"`` policy as a selective-checkpoint policy function: save the
    outputs of :data:`EXPENSIVE_OPS`, prefer to recompute everything else. Compose your own
    policy from it: ``lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op is X else
    save_expensive(ctx, op, *a, **k)``."""
    if op in EXPENSIVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def policy_name(policy: Any) -> str:
    """A short label for a policy: its name, the function's name, or ``"ops[k]"``."""
    if policy is None:
        return "none"
    if isinstance(policy, CompiledPolicy):
        return f"compiled:{policy_name(policy.policy)}"
    if isinstance(policy, str):
        return policy
    if isinstance(policy, (list, tuple, set, frozenset)):
        return f"ops[{len(policy)}]"
    return getattr(policy, "__name__", type(policy).__name__)


def policy_context(policy: Any) -> Callable[[], tuple] | None:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that implements
    ``policy``, or ``None`` for ``"none"`` (no checkpoint at all). ``policy`` is a name from
    :data:`POLICIES`, a callable ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or bool)
    or a list of op overloads to save (``torch.ops.aten.mm.default``)."""
    if isinstance(policy, CompiledPolicy):
        return policy.context_fn
    if policy is None or policy == "none":
        return None
    if policy == "recompute_all":
        return noop_context_fn
    if policy == "save_expensive":
        return functools.partial(create_selective_checkpoint_contexts, save_expensive)
    if policy == "save_fft":
        return functools.partial(create_selective_checkpoint_contexts, save_fft)
    if isinstance(policy, str):
        raise ValueError(f"unroll: unknown policy {policy!r}; use one of {', '.join(POLICIES)}, "
                         "a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or a list "
                         "of ops to save")
    if isinstance(policy, (list, tuple, set, frozenset)):
        ops = list(policy)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise ValueError(f"unroll: a policy list holds op overloads such as "
                                 f"torch.ops.aten.mm.default, got {op!r}")
        return functools.partial(create_selective_checkpoint_contexts, ops)
    if callable(policy):
        return functools.partial(create_selective_checkpoint_contexts, policy)
    raise ValueError(f"unroll: policy must be a name ({', '.join(POLICIES)}), a callable or a "
                     f"list of ops, got {type(policy).__name__}")


class CompiledPolicy:
    """A recomputation policy applied by ``torch.compile``: a kept step is recorded by the
    compiled function ``torch.compile(lambda i, *x: checkpoint(step, i, *x, context_fn=...))``,
    so the compiler's partitioner decides from the policy which intermediates the compiled
    forward saves for its backward and which the backward recomputes (in fused kernels).

    Eager selective checkpointing routes every aten op of the step through a Python dispatch
    mode twice (forward and recomputation); with ``CompiledPolicy`` that decision is made once, at
    compile time, and the recorded step runs as one compiled forward and one compiled
    backward. The first kept step pays the compilation (seconds to a minute); later steps
    and later unrolls of the same step reuse it (the compiled function is cached on this
    object per step function and state structure, so keep the object and pass it again).

    Args:
        policy: the policy inside: a name from :data:`POLICIES` other than ``"none"``, a
            policy function or a list of ops (as for ``unroll(policy=...)``).
        **options: keyword arguments for ``torch.compile`` (``mode``, ``backend``,
            ``dynamic``, ``fullgraph``...).

    Gradients equal plain autograd's up to the rounding of the compiled kernels (fused
    pointwise ops sum in another order: about 1e-6 relative in float32, 1e-15 in float64).
    A step that draws random numbers gets the compiler's random stream, not eager PyTorch's,
    in its kept steps: use an eager policy when the noise must match a plain run.
    """

    def __init__(self, policy: Any = "save_expensive", **options: Any):
        if policy is None or policy == "none" or isinstance(policy, CompiledPolicy):
            raise ValueError("CompiledPolicy: give the policy to compile in, e.g. "
                             "CompiledPolicy('save_fft'); 'none' and a nested CompiledPolicy "
                             "are not policies to compile")
        self.policy = policy
        self.context_fn = policy_context(policy)
        if policy == "recompute_all":  # torch.compile takes only selective-checkpoint contexts
            self.context_fn = functools.partial(create_selective_checkpoint_contexts,
                                                _recompute_everything)
        self.options = options
        self._cache: dict = {}

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"CompiledPolicy({self.policy!r}{opts})"

    def compiled_step(self, step: _Step, preserve_rng: bool) -> Callable:
        """The compiled ``(i, *leaves) -> (next_leaves, outputs)`` of ``step``'s user
        function under this policy, created on first use and cached."""
        # the compiled function keeps its step (and so the step function) alive: an id in
        # the key cannot be reused by another function while the entry exists
        key = (id(step.fn), repr(step.spec), bool(step.has_output), preserve_rng)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        context_fn = self.context_fn

        def record(i, *leaves):  # later unrolls with the same key reuse this first step
            return checkpoint(lambda j, *x: step(list(x), j), i, *leaves, use_reentrant=False,
                              context_fn=context_fn, preserve_rng_state=preserve_rng)

        compiled = self._cache[key] = torch.compile(record, **self.options)
        return compiled


class _Recorder:
    """Records a step under ``torch.utils.checkpoint`` (non-reentrant) with a policy's
    ``context_fn``; the checkpoint stashes the RNG and autocast state and replays them when
    the step's backward recomputes it.

    Under autocast the step runs with autocast's cast cache off: with the cache, a weight is
    cast once per autocast region, so the forward and the recomputation would run different
    numbers of casts and selective checkpointing could not match them. Each step then casts
    its weights itself, and its weight gradients are summed in the weights' own dtype."""

    __slots__ = ("context_fn", "preserve_rng", "compiled")

    def __init__(self, context_fn: Callable[[], tuple], preserve_rng: bool,
                 compiled: CompiledPolicy | None = None):
        self.context_fn = context_fn
        self.preserve_rng = preserve_rng
        self.compiled = compiled  # kept steps (not the structure-checking first call) compiled

    @staticmethod
    def _call(fn: Callable, i: int, *leaves: torch.Tensor):
        return fn(list(leaves), i)

    def __call__(self, fn: Callable, leaves: list[torch.Tensor], i: int):
        autocast = _autocast_state()
        if not autocast:
            return self._record(fn, leaves, i)
        with _Autocast(autocast, cache=False):
            return self._record(fn, leaves, i)

    def _record(self, fn: Callable, leaves: list[torch.Tensor], i: int):
        if self.compiled is not None and isinstance(fn, _Step):
            return self.compiled.compiled_step(fn, self.preserve_rng)(i, *leaves)
        return checkpoint(self._call, fn, i, *leaves, use_reentrant=False,
                          context_fn=self.context_fn, preserve_rng_state=self.preserve_rng)


def check_snapshot_dtype(dtype: Any) -> torch.dtype | None:
    """``None`` or a floating-point ``torch.dtype``; a one-line error otherwise."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unroll: snapshot_dtype must be a floating-point torch.dtype such as "
                         f"torch.bfloat16, got {dtype!r}")
    return dtype


def snapshot_nbytes(leaves: Sequence[torch.Tensor], dtype: torch.dtype | None) -> int:
    """Bytes of one snapshot of a state whose floating leaves are stored as ``dtype``."""
    return sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point()
                            else t.element_size()) for t in leaves)


# ----------------------------------------------------------------------------------------
# the executor


class HostStorage:
    """A second storage level in host memory: device tensors are copied to (pinned) CPU
    memory with ``non_blocking=True`` so the copy overlaps compute; restored on demand."""

    def __init__(self):
        self.data: dict = {}

    def put(self, key, tensors: list[torch.Tensor]) -> None:
        out = []
        for t in tensors:
            if t.device.type == "cuda":
                h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                h.copy_(t, non_blocking=True)
            else:
                h = t.clone()
            out.append(h)
        self.data[key] = out

    def get(self, key, meta) -> list[torch.Tensor]:
        return [t.to(m[2], non_blocking=True) for t, m in zip(self.data[key], meta, strict=True)]

    def drop(self, key) -> None:
        del self.data[key]

    def close(self) -> None:
        self.data.clear()


class _Misfit(Exception):
    """An action that does not fit the executor's state; :meth:`_Executor._run` turns it into
    a :class:`ScheduleError` naming the action and its position in the stream."""


def _holding(at: int) -> str:
    return f"x_{at}" if at >= 0 else "no state (a Reverse leaves none; Restore a snapshot)"


class _Executor:
    """Runs one schedule: the forward sweep in ``forward``, the reverse sweep in ``backward``.

    Every action is checked against the executor's state before it runs, as
    :func:`deepsolve.schedules.check` does on symbolic states: the index ``at`` of the state
    held (``-1``: none), the slots' contents, and the adjoint position ``adj`` (the adjoint
    ``dL/dx_adj`` is held; it starts at ``n``). ``Advance(a, b)``/``Record(a, b)`` need
    ``at == a`` and ``0 <= a < b <= n`` (``b <= adj`` for ``Record``: steps ``>= adj`` are
    reversed already), ``Store(s, i)`` needs ``at == i >= 0`` and an empty slot,
    ``Restore``/``Free(s, i)`` a slot holding ``x_i``, ``Reverse(i)`` needs
    ``i == adj - 1 >= 0`` and ``at == i`` or a kept tape of step ``i``; at the end
    ``adj == 0``, so every step was reversed exactly once. Each check is one or two integer
    comparisons (plus the slot lookup the action makes anyway); a misfit raises a
    :class:`ScheduleError`."""

    def __init__(self, step: _Step, schedule: Schedule, n_steps: int, n_state: int,
                 preserve_rng: bool, stats: UnrollStats | None, cuda: list[int],
                 autocast: list, storage: dict | None = None,
                 recorder: _Recorder | None = None, snapshot_dtype: torch.dtype | None = None,
                 x0: Sequence[torch.Tensor] = ()):
        # x0: the caller's initial leaves (which require grad decides the constants)
        self.step = step
        self.schedule = schedule
        self.n = n_steps
        self.params: list[torch.Tensor] = []
        self.n_state = n_state
        self.preserve_rng = preserve_rng
        self.stats = stats
        self.cuda = cuda
        self.autocast = autocast
        self.slots: dict[tuple[int, int], tuple] = {}
        self.tapes: dict[int, tuple] = {}
        self.actions: Iterator | None = None
        self.pending: Reverse | None = None
        self.advances = 0
        self.recorded = 0
        self.n_slots = 0
        self.peak_slots = 0
        self.at = 0  # index of the state held (-1: none)
        self.adj = n_steps  # the adjoint dL/dx_adj is held
        self.pos = 0  # actions consumed
        self.state_bytes = stats.state_bytes if stats is not None else 0
        self.recorder = recorder  # None: kept tapes are plain autograd graphs
        # which leaves of a recorded step's input require grad; leaves of x_0 that do not
        # require grad are candidates for constants (found at the first recording)
        self.rg = [_is_diff(t) for t in x0]
        self.candidates = tuple(k for k, t in enumerate(x0)
                                if _is_diff(t) and not t.requires_grad)
        self.const: tuple[int, ...] = ()  # leaves that stay constants (requires_grad=False)
        self.const_from = -1  # the step whose recording found them
        # the backward's check of every recorded step's graph (set once params are known)
        self.known: set[int] | None = None
        self.stop: dict = {}
        self.marker = 0
        # snapshots (x_0 excepted) of floating leaves stored as snapshot_dtype: inexact
        self.lower = None
        if snapshot_dtype is not None:
            lower = [snapshot_dtype if dt.is_floating_point and dt != snapshot_dtype else None
                     for _, dt, _ in step.meta]
            if any(d is not None for d in lower):
                self.lower = lower
        self.slot_bytes = self.state_bytes
        if self.lower is not None:
            self.slot_bytes = sum(torch.Size(shape).numel() * (d or dt).itemsize
                                  for (shape, dt, _), d in zip(step.meta, self.lower,
                                                               strict=True))
        self.snap_bytes = 0  # level-0 snapshot bytes held now, x_0 excluded
        self.peak_snap_bytes = 0
        self.storage: dict = dict(storage or {})
        self.done = False

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
        first recording finds the state leaves that stay constants (:func:`_constant_leaves`),
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
            const = _constant_leaves(x_in, y, self.candidates, self.marker)
            if len(const) == sum(self.rg):  # not all: see _constant_leaves
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
            what = _unseen_leaf(y, out, self.known, x_in, self.stop, self.marker)
            if what is not None:
                raise ValueError(
                    f"unroll: step {i} uses {what} that requires grad but was not found when "
                    "the unroll started (from the step's closure, its module and the steps "
                    "the forward sweep recorded), so its gradient would be lost; pass it "
                    "with params=[...]"
                )
        return x_in, y, out

    def _store(self, cur, a: Store):
        key = (a.level, a.slot)
        if key in self.slots:
            raise _Misfit(f"slot {a.slot} (level {a.level}) already holds "
                          f"x_{self.slots[key][3]}; Free it first")
        rng = None
        if self.preserve_rng:
            rng = _get_rng(self.cuda)
        lowered = self.lower is not None and a.index != 0  # x_0 is always held exactly
        data = cur
        if lowered:
            data = [t if d is None else t.to(d) for t, d in zip(cur, self.lower, strict=True)]
        if a.level == 0:
            if a.index != 0:  # x_0 is the caller's tensor: holding it costs nothing
                self.snap_bytes += self.slot_bytes
                if self.snap_bytes > self.peak_snap_bytes:
                    self.peak_snap_bytes = self.snap_bytes
                    if self.stats is not None:
                        self.stats.snapshot_bytes_peak = self.snap_bytes
        else:  # a second storage level (host memory, disk): the backend keeps the data
            self._backend(a.level).put(key, data)
            data = None
        self.slots[key] = (data, [t._version for t in cur] if data is cur else None, rng,
                           a.index, lowered)
        self.n_slots += 1
        if self.n_slots > self.peak_slots:
            self.peak_slots = self.n_slots

    def _held(self, a: Restore | Free) -> tuple:
        entry = self.slots.get((a.level, a.slot))
        if entry is None:
            raise _Misfit(f"slot {a.slot} (level {a.level}) is empty")
        if entry[3] != a.index:
            raise _Misfit(f"slot {a.slot} (level {a.level}) holds x_{entry[3]}, "
                          f"not x_{a.index}")
        return entry

    def _free(self, a: Free):
        self._held(a)
        key = (a.level, a.slot)
        del self.slots[key]
        self.n_slots -= 1
        if a.level == 0:
            if a.index != 0:
                self.snap_bytes -= self.slot_bytes
        else:
            self._backend(a.level).drop(key)

    def _backend(self, level: int):
        backend = self.storage.get(level)
        if backend is None:
            backend = self.storage[level] = HostStorage()
        return backend

    def _restore(self, a: Restore):
        data, versions, rng, _, lowered = self._held(a)
        if a.level != 0:
            data = self._backend(a.level).get((a.level, a.slot), self.step.meta)
        elif versions is not None and any(t._version != v
                                          for t, v in zip(data, versions, strict=True)):
            raise RuntimeError(
                f"unroll: the snapshot of x_{a.index} was modified in place after it was "
                "stored; the step must not modify its input state in place (return new tensors)"
            )
        if rng is not None:
            _set_rng(rng, self.cuda)
        if lowered:
            return [t.to(m[1]) for t, m in zip(data, self.step.meta, strict=True)]
        return list(data)

    def _run(self, cur, outs, until_reverse: bool):
        """Interpret actions until the first Reverse (forward) or the end (backward),
        checking each against the state (see the class docstring)."""
        n = self.n
        at = self.at
        k = self.pos
        a = None
        try:
            for a in self.actions:
                t = type(a)
                if t is Advance:
                    lo, hi = a.start, a.stop
                    if lo != at or not 0 <= lo < hi <= n:
                        raise _Misfit(self._range_misfit(lo, hi, at, n))
                    cur = self._advance(cur, lo, hi, outs)
                    at = hi
                elif t is Reverse:
                    i = a.index
                    if i != self.adj - 1 or i < 0:
                        raise _Misfit(f"the adjoint is at x_{self.adj}, so the next reverse "
                                      f"step is Reverse({self.adj - 1})" if self.adj else
                                      "every step is already reversed")
                    if at != i and i not in self.tapes:
                        raise _Misfit(f"reversing step {i} needs x_{i} (or a Record of step "
                                      f"{i}) but the executor holds {_holding(at)}")
                    if until_reverse:
                        self.at, self.pos = at, k + 1
                        return cur, a
                    self._reverse(cur, i)
                    self.adj = i
                    cur = None
                    at = -1
                elif t is Store:
                    if a.index != at or at < 0:
                        raise _Misfit(f"stores x_{a.index} but the executor holds "
                                      f"{_holding(at)}")
                    self._store(cur, a)
                elif t is Restore:
                    cur = self._restore(a)
                    at = a.index
                elif t is Free:
                    self._free(a)
                elif t is Record:
                    lo, hi = a.start, a.stop
                    if lo != at or not 0 <= lo < hi <= self.adj:
                        raise _Misfit(self._range_misfit(lo, hi, at, self.adj))
                    for i in range(lo, hi):
                        if i in self.tapes:
                            raise _Misfit(f"step {i} is already recorded")
                        tape = self._record(cur, i, True)
                        self.tapes[i] = tape
                        self.recorded += 1
                        cur = [y.detach() for y in tape[1]]
                        if outs is not None:
                            self._put(outs, i, [o.detach() for o in tape[2]])
                    at = hi
                else:
                    raise _Misfit("is not a schedule action (Advance, Record, Store, Restore, "
                                  "Free, Reverse)")
                k += 1
        except _Misfit as e:
            raise ScheduleError(
                f"unroll: action {k} ({a!r}) of schedule {self.schedule!r} does not fit: {e}; "
                "check a custom schedule with deepsolve.schedules.check(schedule)"
            ) from None
        self.at, self.pos = at, k
        return cur, None

    def _range_misfit(self, lo: int, hi: int, at: int, limit: int) -> str:
        if lo != at or at < 0:
            return f"it starts at x_{lo} but the executor holds {_holding(at)}"
        if hi > limit and limit < self.n:
            return (f"steps {limit}..{self.n - 1} are already reversed, so a Record must stop "
                    f"at or before {limit}, not {hi}")
        return f"its range {lo}..{hi} must satisfy {lo} < stop <= n_steps={self.n}"

    # -- the two sweeps --------------------------------------------------------------------

    def forward(self, x0: list[torch.Tensor]):
        t0 = time.perf_counter()
        self.marker = _sequence_marker()  # graph nodes older than this are the caller's
        self.frontier = 0
        self.actions = iter(self.schedule)
        outs: list[torch.Tensor] = []
        cur, rev = self._run([t.detach() for t in x0], outs, until_reverse=True)
        if rev is None:
            raise ScheduleError(f"unroll: schedule {self.schedule!r} ended after {self.pos} "
                                f"actions without a Reverse; its forward part must reach "
                                f"Reverse({self.n - 1}); check it with "
                                "deepsolve.schedules.check(schedule)")
        if rev.index in self.tapes:
            tape = self.tapes.pop(rev.index)
        else:
            tape = self._record(cur, rev.index)
            self.recorded += 1
            self._put(outs, rev.index, [o.detach() for o in tape[2]])
        self.at = -1
        self.adj = rev.index
        self.pending = (rev.index, tape)
        self.final = [y.detach() for y in tape[1]]
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
        self.marker = _sequence_marker()
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
                                raise _Misfit(f"stores x_{a.index} but the executor holds x_{i}")
                            self._store(cur, a)
                        elif type(a) is Free:
                            self._free(a)
                        else:
                            raise _Misfit("is neither a Store nor a Free")
                    except _Misfit as e:
                        raise ScheduleError(f"unroll: online controller action {a!r} at step "
                                            f"{i} does not fit: {e}") from None
                if self.preserve_rng:
                    rng = _get_rng(self.cuda)
                if i == 0:
                    nxt, out = step.first(cur, 0)
                else:
                    nxt, out = step(cur, i)
                    step.fast_check(nxt, i)
                if out:
                    outs.append([o.detach() for o in out])
                i += 1
                if stop(_unflatten(nxt, spec), i):
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
        if rng is not None:  # replay step n-1's random numbers
            _set_rng(rng, self.cuda)
        tape = self._record(cur, n - 1)
        self.recorded += 1
        self.at, self.adj, self.pos = -1, n - 1, 1
        self.pending = (n - 1, tape)
        self.final = [y.detach() for y in tape[1]]
        self.outs = [torch.stack(col) for col in zip(*outs, strict=True)] if outs else []
        if self.stats is not None:
            self.stats.n_steps = n
            self.stats.forward_time = time.perf_counter() - t0
            self._fill_stats()
        return tape

    def backward(self, g_final: Sequence, g_outs: Sequence):
        if self.done:
            raise RuntimeError("unroll: backward through a checkpointed unroll can run only "
                               "once; call unroll again for a second backward pass")
        if torch.is_grad_enabled():
            raise RuntimeError("unroll: double backward (create_graph=True) through a "
                               "checkpointed unroll is not supported; use schedule='store_all' "
                               "for higher-order derivatives")
        self.done = True
        t0 = time.perf_counter()
        self.g_outs = g_outs
        self.grad = list(g_final)
        self.pgrads: list[torch.Tensor | None] = [None] * len(self.params)
        self.owned = [False] * len(self.params)
        fork = torch.random.fork_rng(devices=self.cuda) if self.preserve_rng else None
        try:
            if fork is not None:
                fork.__enter__()
            with _Autocast(self.autocast):
                i, tape = self.pending
                self.pending = None
                self._pull(tape, i)
                del tape  # x_{n-1} and the last step's output: not needed any more
                self._run(None, None, until_reverse=False)
                if self.adj != 0:
                    raise ScheduleError(
                        f"unroll: schedule {self.schedule!r} ended with steps "
                        f"0..{self.adj - 1} never reversed (the adjoint is at x_{self.adj}); "
                        "every step must be reversed exactly once; check it with "
                        "deepsolve.schedules.check(schedule)")
        finally:
            if fork is not None:
                fork.__exit__(None, None, None)
            self.release()
        if self.stats is not None:
            self.stats.backward_time = time.perf_counter() - t0
            self._fill_stats()
        return self.grad, self.pgrads

    def release(self) -> None:
        """Drop every snapshot and tape and close the storage backends (remove spill files)."""
        self.slots.clear()
        self.tapes.clear()
        self.pending = None
        for backend in self.storage.values():
            backend.close()

    def _reverse(self, cur, i: int):
        tape = self.tapes.pop(i, None)
        if tape is None:
            tape = self._record(cur, i)
            self.recorded += 1
        self._pull(tape, i)

    def _pull(self, tape, i: int):
        """adjoint_i = J_i^T adjoint_{i+1} (+ output terms); accumulate parameter grads."""
        x_in, y, out = tape
        roots, seeds = [], []
        for t, g in zip(y, self.grad, strict=True):
            if g is not None and t.requires_grad:
                roots.append(t)
                seeds.append(g)
        for k, o in enumerate(out):
            g = self.g_outs[k] if k < len(self.g_outs) else None
            if g is not None and o.requires_grad:
                roots.append(o)
                seeds.append(g[i])
        inputs = [t for t in x_in if t.requires_grad] + self.params
        if not roots or not inputs:
            self.grad = [None] * self.n_state
            return
        grads = torch.autograd.grad(roots, inputs, seeds, allow_unused=True)
        it = iter(grads)
        self.grad = [next(it) if t.requires_grad else None for t in x_in]
        pg, owned = self.pgrads, self.owned
        for k, g in enumerate(it):
            if g is None:
                continue
            if pg[k] is None:
                pg[k] = g  # may alias autograd's buffers: not ours to modify in place
            elif owned[k]:
                pg[k].add_(g)
            else:
                pg[k] = pg[k] + g
                owned[k] = True

    def _fill_stats(self):
        s = self.stats
        s.advances = self.advances
        s.recorded = self.recorded
        s.snapshots_peak = self.peak_slots
        s.snapshot_bytes_peak = self.peak_snap_bytes


class _UnrollFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: _Executor, *inputs):
        ctx.ex = ex
        ctx.set_materialize_grads(False)
        ctx.n_final = len(ex.final)
        if ex.const:  # state leaves that depend on nothing requiring grad
            ctx.mark_non_differentiable(*[ex.final[k] for k in ex.const])
        return (*ex.final, *ex.outs)  # computed by ex.forward before apply

    @staticmethod
    def backward(ctx, *grads):
        ex: _Executor = ctx.ex
        adj, pgrads = ex.backward(grads[:ctx.n_final], grads[ctx.n_final:])
        return (None, *adj, *pgrads)


# ----------------------------------------------------------------------------------------
# public entry point


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
    """
    context_fn = policy_context(policy)
    recorder = None if context_fn is None else _Recorder(
        context_fn, preserve_rng, policy if isinstance(policy, CompiledPolicy) else None)
    snapshot_dtype = check_snapshot_dtype(snapshot_dtype)
    x0, spec = _flatten_state(state)
    if torch.is_grad_enabled():
        for k, t in enumerate(x0):
            if t.is_inference():
                raise ValueError(
                    f"unroll: state leaf {k} of x0 is an inference tensor (made under "
                    "torch.inference_mode()), which autograd cannot record; make x0 outside "
                    "inference_mode, or pass a copy made outside it (x0.clone()), or run the "
                    "unroll under torch.inference_mode() / torch.no_grad() as well")
    sched = schedule
    fn = _Step(step, spec, x0, has_output)
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
    if not grad_on or sched is None or sched.kind == "store_all":
        return _plain_loop(fn, x0, n_steps, spec, grad_on, stats, until, max_steps,
                           recorder if grad_on else None)

    cuda = _devices(x0 + explicit)
    ex = _Executor(fn, sched, n_steps, len(x0), preserve_rng, stats, cuda, _autocast_state(),
                   storage, recorder, snapshot_dtype, x0)
    try:
        if until is not None:
            tape = ex.forward_online(x0, sched.start(), until, max_steps)
        else:
            tape = ex.forward(x0)
        tapes = [tape, *ex.tapes.values()]  # every step the forward sweep recorded
        params, stop = _discover(step, tapes, explicit, ex.marker)
    except BaseException:
        ex.release()
        raise
    weakref.finalize(ex, _close_all, list(ex.storage.values()))
    params = [p for p in params if p.requires_grad]
    if not params and not any(t.requires_grad for t in x0):  # nothing to differentiate
        res = (*ex.final, *ex.outs)
        ex.release()
    else:
        ex.params = params
        ex.known = {id(p) for p in params} | {id(p) for p in explicit}
        ex.stop = stop
        if stats is not None:
            stats.extra["params"] = len(params)
        res = _UnrollFunction.apply(ex, *x0, *params)
    final = _unflatten(res[:len(x0)], spec)
    if not fn.has_output:
        return final
    return final, pytree.tree_unflatten(list(res[len(x0):]), fn.out_spec)


def _close_all(backends) -> None:
    for b in backends:
        b.close()


def _discover(step, tapes: Sequence[tuple], explicit: Sequence[torch.Tensor],
              marker: int) -> tuple[list[torch.Tensor], dict]:
    """The tensors to differentiate, ``explicit`` first, and the graph nodes of the explicit
    ones (where a graph walk stops).

    Found: leaves requiring grad in the graphs of the steps the forward sweep recorded
    (``tapes``: ``(x_in, y, out)``), the parameters of the module the step is or is a method
    of, and the leaves reachable from the step function itself (:func:`_closure_leaves`),
    so that a tensor used only at some steps is found under every schedule. The reverse
    sweep checks each step it records against this set (:func:`_unseen_leaf`)."""
    stop = {}
    for p in explicit:
        node = p.grad_fn if p.grad_fn is not None else (
            torch.autograd.graph.get_gradient_edge(p).node if p.requires_grad else None)
        if node is not None:
            stop[node] = p
    ids = {id(p) for p in explicit}
    for x_in, _, _ in tapes:
        ids.update(id(t) for t in x_in)
    roots = [t for _, y, out in tapes for t in (*y, *out) if t.requires_grad]
    found = _graph_leaves(roots, stop, marker, ids)
    owner = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.extend(p for p in owner.parameters() if id(p) not in ids)
    found.extend(p for p in _closure_leaves(step) if id(p) not in ids)
    found = list({id(p): p for p in found}.values())
    return list(explicit) + found, stop


def _plain_loop(fn: _Step, x0: list[torch.Tensor], n: int, spec, grad_on: bool,
                stats: UnrollStats | None, until=None, max_steps: int | None = None,
                recorder: _Recorder | None = None):
    """The plain loop: under no_grad, or store_all (autograd keeps the whole graph, each
    step's part under the policy's ``recorder`` if one is given); with ``until``, until
    ``until(x_i, i)`` holds."""
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
        if until is not None:
            with torch.no_grad():
                if until(_unflatten(cur, spec), i):
                    break
            if max_steps is not None and i >= max_steps:
                raise RuntimeError(
                    f"unroll: the stop condition was not met within max_steps={max_steps} "
                    "steps; raise max_steps or check the condition")
    n = i
    if stats is not None:
        stats.n_steps = n
        stats.forward_time = time.perf_counter() - t0
        if grad_on:
            stats.recorded = n
        else:
            stats.advances = n
    final = _unflatten(cur, spec)
    if not fn.has_output:
        return final
    stacked = [torch.stack(col) for col in zip(*outs, strict=True)] if outs else []
    return final, pytree.tree_unflatten(stacked, fn.out_spec)
