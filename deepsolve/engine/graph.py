"""Graph inspection: what a recorded step's autograd graph reaches.

Parameter discovery (:func:`discover`: leaves requiring grad in the recorded steps' graphs,
the step's module and its closure, :func:`closure_leaves`), the per-recording check that a
step reaches nothing the unroll does not differentiate (:func:`unseen_leaf`), the state
leaves that stay constants (:func:`constant_leaves`), and the bytes a graph saves for its
backward (:func:`saved_bytes`, for profiling). Graph nodes carry a sequence number; nodes
older than the unroll's marker (:func:`sequence_marker`) belong to the caller's graph.
:func:`pull_back` is the vector-Jacobian product of a recorded step.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["saved_bytes", "graph_leaves", "graph_nodes", "sequence_marker", "unseen_leaf",
           "constant_leaves", "closure_leaves", "discover", "pull_back"]


def _engine_run():
    try:
        from torch.autograd.graph import _engine_run_backward

        return _engine_run_backward
    except ImportError:  # pragma: no cover - another torch
        return None


_run_backward = _engine_run()


def pull_back(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
              seeds: Sequence[torch.Tensor], retain_graph: bool = False
              ) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, inputs, seeds, allow_unused=True)``: the vector-Jacobian
    product ``sum_k seeds_k^T d roots_k / d inputs`` (``None`` for an input the roots do not
    reach), through autograd's engine directly.

    The seeds are the executor's own adjoints, of the roots' shapes and dtypes by
    construction, so the checks ``torch.autograd.grad`` makes of each seed are skipped — and
    with them the import they trigger on their first call (``torch.fx``'s symbolic shapes
    and sympy, about 21 MiB resident, which a budget would have to pay at its first call)
    and a few microseconds per reversed step."""
    if _run_backward is None:  # pragma: no cover
        return torch.autograd.grad(roots, inputs, seeds, retain_graph=retain_graph,
                                   allow_unused=True)
    return _run_backward(tuple(roots), tuple(seeds), retain_graph, False, tuple(inputs), True,
                         False)


def saved_bytes(roots: Sequence[torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the unique storages the autograd graph behind ``roots`` keeps for its
    backward, storages of ``exclude`` (inputs, parameters) left out.

    Reads the saved tensors of every node: ``saved_tensors`` of custom functions (compiled
    steps are one such node) and the ``_saved_*`` attributes of built-in nodes. Slow (it
    inspects every node); for profiling only."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    held: dict[int, int] = {}

    def visit(node) -> bool:
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
        return True

    _walk(roots, visit)
    return sum(held.values())


def _walk(roots: Sequence[torch.Tensor], visit) -> None:
    """Visit every node of the graph behind ``roots`` once (depth first); ``visit(node)``
    says whether to go on to the node's inputs."""
    seen: set = set()
    todo: list[torch.autograd.graph.Node | None] = [r.grad_fn for r in roots
                                                    if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if visit(node):
            todo.extend(f for f, _ in node.next_functions)


def graph_nodes(roots: Sequence[torch.Tensor]) -> int:
    """The number of autograd nodes behind ``roots`` (for profiling)."""
    count = [0]

    def visit(node) -> bool:
        count[0] += 1
        return True

    _walk(roots, visit)
    return count[0]


def graph_leaves(roots: Sequence[torch.Tensor], stop: dict, marker: int,
                  inputs: set) -> list[torch.Tensor]:
    """Leaf tensors requiring grad reached from ``roots``' graph, stopping at ``stop`` nodes.

    A node older than ``marker`` (created before the step ran) that is not a leaf means the
    step uses a tensor computed outside it, which needs ``params=``.
    """
    found: list[torch.Tensor] = []

    def visit(node) -> bool:
        if node in stop:
            return False
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf
            if id(var) not in inputs:
                found.append(var)
            return False
        if node._sequence_nr() < marker and node.name() not in SAFE_OUTER_NODES:
            raise ValueError(
                f"unroll: the step uses a tensor that requires grad and was computed outside "
                f"it (its graph node is {node.name()}); pass such tensors explicitly with "
                "params=[...] so their gradients can flow"
            )
        return True

    _walk(roots, visit)
    return found


# Nodes of the caller's graph that may be traversed any number of times because they save
# nothing: dtype/device casts, such as those autocast caches for a region's weights.
SAFE_OUTER_NODES = frozenset({"ToCopyBackward0"})


def sequence_marker() -> int:
    with torch.enable_grad():
        node = (torch.zeros((), requires_grad=True) * 1).grad_fn
        assert node is not None  # a product with a leaf that requires grad
        return node._sequence_nr() + 1


def _describe(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {t.dtype} tensor"


def unseen_leaf(y: Sequence[torch.Tensor], out: Sequence[torch.Tensor], known: set[int],
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
            if node._sequence_nr() < marker and node.name() not in SAFE_OUTER_NODES:
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


def constant_leaves(x_in: Sequence[torch.Tensor], y: Sequence[torch.Tensor],
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


def closure_leaves(fn: Any) -> list[torch.Tensor]:
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

def discover(step, tapes: Sequence[tuple], explicit: Sequence[torch.Tensor],
              marker: int) -> tuple[list[torch.Tensor], dict]:
    """The tensors to differentiate, ``explicit`` first, and the graph nodes of the explicit
    ones (where a graph walk stops).

    Found: leaves requiring grad in the graphs of the steps the forward sweep recorded
    (``tapes``: ``(x_in, y, out)``), the parameters of the module the step is or is a method
    of, and the leaves reachable from the step function itself (:func:`closure_leaves`),
    so that a tensor used only at some steps is found under every schedule. The reverse
    sweep checks each step it records against this set (:func:`unseen_leaf`)."""
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
    found = graph_leaves(roots, stop, marker, ids)
    owner = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.extend(p for p in owner.parameters() if id(p) not in ids)
    found.extend(p for p in closure_leaves(step) if id(p) not in ids)
    found = list({id(p): p for p in found}.values())
    return list(explicit) + found, stop

