"""``deepsolve.sequential``: a chain of modules whose layers differ, checkpointed optimally.

``y = sequential(layers, x, budget="64MiB")`` computes ``y = layer_{n-1}( .. layer_0(x))`` and
returns ``y`` with exact gradients with respect to ``x`` and every layer's parameters, holding
at most ``budget`` bytes for states, recorded layers and adjoints at any time. Which inputs
to keep as snapshots, which layers to keep recorded and what to recompute is the optimal
heterogeneous schedule of :mod:`deepsolve.schedules.hetero` (Beaumont et al.,
arXiv:1911.13214, the rotor dynamic program) for the layers' measured costs: unlike
``torch.utils.checkpoint.checkpoint_sequential`` (equal segments, every segment input stored,
one segment recorded at a time) it places snapshots on small states, keeps cheap layers
recorded, and recomputes expensive layers least.

Costs. Each layer is profiled once per (layers, input shape, dtype, device) and cached
(:func:`profile_chain`): its forward time without recording, its record + backward time, the
bytes of its input and output, the bytes it saves for backward beyond its input, output and
parameters (``torch.autograd.graph.saved_tensors_hooks``), and an estimate of its transient
scratch (its largest saved tensor, plus its parameter gradients in the backward). Give ``costs=`` (a
:class:`~deepsolve.schedules.ChainCosts` in bytes and seconds) to skip profiling.

Memory accounting (what ``budget`` bounds; see the memory model of
:mod:`deepsolve.schedules.hetero`): stored inputs of layers, kept records, the current state,
the adjoint, each layer's transient (the estimate above) and the output's incoming gradient,
which autograd holds for the whole reverse sweep. Not counted: the caller's ``x``, the
parameters and their ``.grad``, and the returned output once the caller owns it. A budget
below what the least-memory schedule needs raises :class:`~deepsolve.BudgetError`.

The chain is run by the engine's one action interpreter
(:class:`deepsolve.engine.Interpreter`), like :func:`deepsolve.unroll`; only its steps differ
(states change shape from layer to layer), and layers with dropout replay the same random
numbers when recomputed.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import get_gradient_edge

from .engine import (
    GradSum,
    Interpreter,
    Replay,
    SweepStats,
    cuda_devices,
    graph_leaves,
    is_diff,
)
from .memory.budget import BudgetError, format_bytes, parse_budget
from .memory.saved import SavedTensors
from .schedules import Schedule
from .schedules.actions import Advance
from .schedules.hetero import ChainCosts, Hetero, hetero_peak

__all__ = ["sequential", "SequentialStats", "ChainProfile", "profile_chain",
           "clear_sequential_cache"]


@dataclass
class SequentialStats(SweepStats):
    """What one :func:`sequential` call did; pass an instance as ``stats=`` to have it filled.

    Attributes:
        n_layers: length of the chain.
        budget: the budget in bytes (0 without a budget).
        schedule: ``repr`` of the plan (``"plain"`` when no checkpointing was needed).
        mode, block: the planner's mode (``"exact"`` or ``"blocks"``) and block length.
        predicted_peak: bytes the plan holds at its peak under the memory model.
        predicted_time: predicted compute of forward + backward [s] (advances + one record
            and one backward per layer, from the profile).
        advances: unrecorded layer evaluations (forward sweep and recomputation).
        recorded: recorded layer evaluations (each layer once).
        profile_time, plan_time: seconds spent profiling and planning (0 when cached).
        forward_time, backward_time: wall time of the two sweeps [s].
    """

    n_layers: int = 0
    budget: int = 0
    mode: str = ""
    block: int | None = None
    predicted_peak: int = 0
    predicted_time: float = 0.0
    profile_time: float = 0.0
    plan_time: float = 0.0


# ----------------------------------------------------------------------------------------
# profiling


@dataclass(frozen=True)
class ChainProfile:
    """Measured costs of a chain (see :func:`profile_chain`).

    Attributes:
        costs: sizes [bytes] and times [s] as a :class:`~deepsolve.schedules.ChainCosts`:
            ``forward`` (no recording), ``backward`` (record + backward), ``states``
            (input and output bytes of each layer), ``tapes`` (saved bytes beyond the input, the
            output and the parameters: the input and output are states, counted as such),
            ``forward_overhead`` (scratch estimate: the largest saved tensor) and
            ``backward_overhead`` (that, the layer's parameter bytes for the gradients autograd
            allocates, and the output when the layer saves it: a kept tape holds it after the
            next state is dead).
        params: per layer, the tensors requiring grad it uses (its parameters).
        shapes: the shape of each state ``x_0 .. x_n``.
    """

    costs: ChainCosts
    params: tuple[tuple[torch.Tensor, ...], ...]
    shapes: tuple[tuple[int, ...], ...]


_profiles: dict[tuple, tuple[list, ChainProfile]] = {}
_plans: dict[tuple, tuple] = {}
_MAX_PLANS = 16


def clear_sequential_cache() -> None:
    """Forget cached profiles and plans (e.g. after changing what a layer closes over)."""
    _profiles.clear()
    _plans.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _module_params(layer) -> list[torch.Tensor]:
    if isinstance(layer, torch.nn.Module):
        return [p for p in layer.parameters() if p.requires_grad]
    return []


def _check_out(y: Any, i: int) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"sequential: layer {i} returned a {type(y).__name__}; each layer must "
                        "map a tensor to a tensor (wrap layers that return tuples)")
    return y


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_key(layers: Sequence, x: torch.Tensor) -> tuple:
    return (tuple(id(l) for l in layers), tuple(x.shape), x.dtype, str(x.device))


def profile_chain(layers: Sequence[Callable], x: torch.Tensor, *, repeats: int = 2,
                  cache: bool = True) -> ChainProfile:
    """Measure every layer of the chain on the states ``x`` produces (one pass, layer by
    layer, so memory stays at one recorded layer). Times are medians of ``repeats`` runs after
    a warm-up; the random number generators are left as they were. Cached per (layers,
    input shape, dtype, device).
    """
    layers = _check_layers(layers)
    x = _check_x(x)
    key = _cache_key(layers, x)
    for k, (refs, _) in list(_profiles.items()):  # forget dead layers (and their parameters)
        if any(r() is None for r in refs):
            del _profiles[k]
            for pk in [pk for pk in _plans if pk[0] == k]:
                del _plans[pk]
    if cache and key in _profiles:
        refs, prof = _profiles[key]
        if all(r() is l for r, l in zip(refs, layers, strict=True)):
            return prof
    cuda = cuda_devices([x])
    with torch.random.fork_rng(devices=cuda):
        prof = _profile(layers, x, repeats)
    if cache:
        try:
            _profiles[key] = ([weakref.ref(l) for l in layers], prof)
        except TypeError:  # a layer that cannot be weakly referenced: do not cache
            pass
    return prof


def _profile(layers: list, x: torch.Tensor, repeats: int) -> ChainProfile:
    dev = x.device
    fwd, bwd, states, tapes, scratch, grad_bytes, params = [], [], [_nbytes(x)], [], [], [], []
    shapes = [tuple(x.shape)]
    cur = x.detach()
    key = SavedTensors.key  # (key, nbytes) of a tensor's storage, as the tape is keyed
    for i, layer in enumerate(layers):
        rng = torch.get_rng_state()
        with torch.no_grad():
            nxt = _check_out(layer(cur), i)  # warm-up; its output is the next state
            times = []
            for _ in range(repeats):
                torch.set_rng_state(rng)
                _sync(dev)
                t0 = time.perf_counter()
                layer(cur)
                _sync(dev)
                times.append(time.perf_counter() - t0)
        fwd.append(statistics.median(times) if times else 0.0)
        # one recorded run: saved tensors, parameters, record + backward time
        x_in = cur.detach().requires_grad_(is_diff(cur))
        # its tape: what it saves, not its input (skipped by storage: views of it too)
        tape = SavedTensors(skip={key(x_in)[0]}, record=True)
        torch.set_rng_state(rng)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.enable_grad(), tape:
            y = _check_out(layer(x_in), i)
        found = list(_module_params(layer))
        if y.requires_grad and y.grad_fn is not None:
            ids = {id(p) for p in found} | {id(x_in)}
            found += [p for p in graph_leaves([y], {}, 0, {id(x_in)}) if id(p) not in ids]
        found = list({id(p): p for p in found if p.requires_grad}.values())
        inputs = ([x_in] if x_in.requires_grad else []) + found
        if y.requires_grad and inputs:
            torch.autograd.grad(y, inputs, torch.ones_like(y), allow_unused=True)
        _sync(dev)
        bwd.append(time.perf_counter() - t0)
        # weights are saved as views (a transposed weight is not a leaf): drop the storages of
        # parameters and buffers, which exist whether or not the layer is recorded
        own = {key(p)[0] for p in found}
        if isinstance(layer, torch.nn.Module):
            own |= {key(t)[0] for t in (*layer.parameters(), *layer.buffers())}
        out_ptr = key(y)[0]
        assert tape.seen is not None  # record=True
        saved = {ptr: nb for ptr, nb in tape.seen.items() if ptr not in own}
        keeps_out = out_ptr in saved  # e.g. ReLU, tanh: the output is the next state
        states.append(_nbytes(nxt))
        shapes.append(tuple(nxt.shape))
        tapes.append(sum(nb for ptr, nb in saved.items() if ptr != out_ptr))
        scratch.append(max(saved.values(), default=0))
        grad_bytes.append(sum(_nbytes(p) for p in found) + (_nbytes(nxt) if keeps_out else 0))
        params.append(tuple(found))
        del y, x_in, tape
        cur = nxt
    # backward transient: the gradient of the largest intermediate, the layer's parameter
    # gradients (autograd.grad allocates them before they are added to .grad) and, for a layer
    # that saves its own output, that output: the tape keeps it after the next state is dead
    costs = ChainCosts(tuple(fwd), tuple(states), tuple(tapes), tuple(bwd), tuple(scratch),
                       tuple(a + b for a, b in zip(scratch, grad_bytes, strict=True)))
    return ChainProfile(costs, tuple(params), tuple(shapes))


# ----------------------------------------------------------------------------------------
# the executor


class LayerTape(NamedTuple):
    """One recorded layer: its detached input ``x_in``, the gradient edge of its output (not
    the output itself, whose storage may be freed; ``None`` when nothing requires grad) and
    whether the layer is the identity (the adjoint then passes through)."""

    x_in: torch.Tensor
    edge: Any
    identity: bool


class _Chain(Interpreter):
    """Runs a schedule over the layers with the engine's interpreter
    (:class:`~deepsolve.engine.Interpreter`): the forward sweep in ``forward``, the reverse
    sweep in ``backward`` (each reverse step: ``torch.autograd.grad`` on the recorded layer).
    States are one-tensor lists whose shape changes from layer to layer."""

    who = "sequential"
    unit = "layer"
    check_hint = ""
    double_backward_hint = "run the layers without a budget for higher-order derivatives"
    once = ("sequential: backward can run only once per call; call sequential again for a "
            "second backward pass")

    def __init__(self, layers: list, layer_params: list[list[int]], params: list,
                 schedule, preserve_rng: bool, cuda: list[int], stats: SequentialStats | None):
        super().__init__(schedule, len(layers), Replay(cuda, preserve_rng))
        self.layers = layers
        self.lp = layer_params  # indices into params, per layer
        self.params = params
        self.stats = stats
        self.known = {id(p) for p in params}

    def _advance(self, cur: list, a: int, b: int, outs) -> list:
        x = cur[0]
        layers = self.layers
        with torch.no_grad():
            for i in range(a, b):
                x = layers[i](x)
        self.advances += b - a
        return [x]

    def _record(self, cur: torch.Tensor, i: int) -> tuple[LayerTape, torch.Tensor]:
        """Run layer ``i`` with grad from a detached input: its tape and its output."""
        x_in = cur.detach().requires_grad_(is_diff(cur))
        try:
            with torch.enable_grad():
                y = _check_out(self.layers[i](x_in), i)
        except RuntimeError as e:
            if "in-place" not in str(e):
                raise
            raise RuntimeError(f"sequential: layer {i} modified its input in place ({e}); a "
                               "layer must return a new tensor") from e
        self.recorded += 1
        if y is x_in:  # an identity layer: the adjoint passes through
            return LayerTape(x_in, None, True), y.detach()
        if not y.requires_grad:
            return LayerTape(x_in, None, False), y.detach()
        if y.grad_fn is not None:
            extra = [p for p in graph_leaves([y], {}, 0, {id(x_in)}) if id(p) not in self.known]
            if extra:
                raise ValueError(
                    f"sequential: layer {i} uses {len(extra)} tensor(s) requiring grad that are "
                    "not parameters of a layer module; pass them as params=[...] so their "
                    "gradients can flow")
        return LayerTape(x_in, get_gradient_edge(y), False), y.detach()

    def _keep(self, cur: list, i: int, outs) -> list:
        tape, y = self._record(cur[0], i)
        self.tapes[i] = tape
        return [y]

    def _reverse(self, cur: list | None, i: int) -> None:
        tape = self.tapes.pop(i, None)
        if tape is None:
            assert cur is not None  # the interpreter checked that x_i is the current state
            tape = self._record(cur[0], i)[0]
        self._pull(tape, i)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        cur, rev = self._to_first_reverse([x0.detach()], None)
        tape = self.tapes.pop(rev.index, None)
        if tape is None:
            tape, out = self._record(cur[0], rev.index)
        else:  # pragma: no cover - the last layer is never kept recorded before its reverse
            out = None
        self.at, self.adj = -1, rev.index
        self.pending = (rev.index, tape)
        self.output = out
        if self.stats is not None:
            self.stats.forward_time = time.perf_counter() - t0
            self._fill()
        assert out is not None  # the branch above that leaves it None is never taken
        return out

    def backward(self, g: torch.Tensor | None):
        self.grad = g
        self.grads = GradSum(len(self.params))
        self.route = _routes(self.params)
        self.reverse_sweep()
        if self.stats is not None:
            self.stats.backward_time = self.backward_time
            self._fill()
        return self.grad, self.grads.grads

    def _pull(self, tape: LayerTape, i: int) -> None:
        """adjoint_i = J_i^T adjoint_{i+1}; accumulate layer i's parameter gradients."""
        x_in, edge, ident = tape
        g = self.grad
        if ident:
            return  # the adjoint passes through unchanged
        idx = [k for k in self.lp[i] if self.route[k] != _SKIP]
        inputs = ([x_in] if x_in.requires_grad else []) + [self.params[k] for k in idx]
        if edge is None or g is None or not inputs:
            self.grad = None
            return
        res = torch.autograd.grad([edge], inputs, [g], allow_unused=True)
        it = iter(res)
        self.grad = next(it) if x_in.requires_grad else None
        for k, gk in zip(idx, it, strict=True):
            if gk is None:
                continue
            if self.route[k] == _DIRECT:  # .backward(): accumulate now, hold nothing
                p = self.params[k]
                if p.grad is None:
                    p.grad = gk
                else:
                    p.grad.add_(gk)
            else:
                self.grads.add(k, gk)

    def _fill(self) -> None:
        assert self.stats is not None  # callers check
        self.stats.advances = self.advances
        self.stats.recorded = self.recorded


_RETURN, _DIRECT, _SKIP = 0, 1, 2


def _routes(params: list[torch.Tensor]) -> list[int]:
    """How each parameter's gradient leaves the reverse sweep.

    Under ``loss.backward()`` the engine reports (``torch._C._will_engine_execute_node``, as
    ``torch.autograd.graph.register_multi_grad_hook`` uses it) whether a leaf's ``.grad`` will
    be accumulated: then a hook-free leaf gets each layer's gradient added to ``.grad`` at once
    (``_DIRECT``: no parameter-sized buffer is held until the sweep ends), and a leaf left out
    by ``backward(inputs=...)`` is not differentiated (``_SKIP``). Under
    ``torch.autograd.grad`` (where the query is refused) and for parameters with hooks or that
    are not leaves, the gradients are summed and returned from the Function (``_RETURN``).
    """
    out = []
    for p in params:
        route = _RETURN
        if p.is_leaf and p.requires_grad:
            try:
                will = torch._C._will_engine_execute_node(get_gradient_edge(p).node)
            except (RuntimeError, AttributeError):  # autograd.grad(), or an older torch
                will = None
            if will is False:
                route = _SKIP
            elif will and not p._backward_hooks and \
                    not getattr(p, "_post_accumulate_grad_hooks", None):
                route = _DIRECT
        out.append(route)
    return out


class _ChainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Chain, x: torch.Tensor, *params):
        ctx.run = run
        ctx.set_materialize_grads(False)
        return run.output  # computed by run.forward before apply

    @staticmethod
    def backward(ctx, g):
        gx, gp = ctx.run.backward(g)
        return (None, gx, *gp)


# ----------------------------------------------------------------------------------------
# public entry point


def _check_layers(layers) -> list:
    if isinstance(layers, torch.nn.Module) and not isinstance(
            layers, (torch.nn.Sequential, torch.nn.ModuleList)):
        raise TypeError("sequential: layers must be a sequence of modules or functions "
                        "(a list, nn.Sequential or nn.ModuleList), not a single module")
    try:
        out = list(layers)
    except TypeError:
        raise TypeError(f"sequential: layers must be a sequence of callables, got "
                        f"{type(layers).__name__}") from None
    if not out:
        raise ValueError("sequential: layers is empty; pass at least one layer")
    for i, l in enumerate(out):
        if not callable(l):
            raise TypeError(f"sequential: layers[{i}] is a {type(l).__name__}, not callable")
    return out


def _check_x(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"sequential: x must be a tensor, got {type(x).__name__}")
    return x


def _plain(layers: list, x: torch.Tensor) -> torch.Tensor:
    for i, layer in enumerate(layers):
        x = _check_out(layer(x), i)
    return x


def _plan(layers: list, x: torch.Tensor, costs: ChainCosts, nbytes: int, slots: int,
          mode: str, block: int | None, key: tuple | None) -> tuple:
    """``(actions, advance_cost, predicted_peak, repr, mode, block)``, cached per key."""
    full = (key, nbytes, slots, mode, block) if key is not None else None
    if full is not None and full in _plans:
        return _plans[full]
    # autograd holds the output's incoming gradient until the whole reverse sweep returns
    room = nbytes - costs.states[-1]
    try:
        if room <= 0:
            raise ValueError("cannot reverse")
        sched = Hetero(costs, room, slots=slots, mode=mode, block=block, charge_input=False)
    except ValueError as e:
        if "cannot reverse" not in str(e):
            raise
        from .schedules.hetero import least_memory

        need = least_memory(costs, charge_input=False) + costs.states[-1]
        raise BudgetError(
            f"sequential: the budget {format_bytes(nbytes)} cannot hold the {len(layers)}-layer "
            f"chain: the least-memory schedule (keep the input only, recompute every layer) "
            f"needs {format_bytes(need)} before rounding to {slots} slots; raise the budget"
        ) from None
    actions = tuple(sched)
    peak = hetero_peak(_Listed(actions, sched), costs, charge_input=False) + costs.states[-1]
    plan = (actions, sched.advance_cost, peak, repr(sched), sched.mode, sched.block)
    if full is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.pop(next(iter(_plans)))
        _plans[full] = plan
    return plan


class _Listed(Schedule):
    """A materialised schedule (the cached plan's actions)."""

    kind = "hetero"

    def __init__(self, actions: tuple, like: Schedule | None = None, n: int | None = None):
        self.actions = actions
        if like is not None:
            self.n_steps = like.n_steps
            self.slots = like.slots
        else:
            assert n is not None  # given when `like` is not
            self.n_steps = n
            self.slots = {0: max(n or 1, 1)}

    def __iter__(self):
        return iter(self.actions)


def sequential(
    layers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    *,
    budget: int | str | None = None,
    slots: int = 256,
    costs: ChainCosts | None = None,
    mode: str = "auto",
    block: int | None = None,
    params: Sequence[torch.Tensor] | None = None,
    preserve_rng: bool = True,
    stats: SequentialStats | None = None,
) -> torch.Tensor:
    """Run ``layers`` on ``x`` with exact gradients, holding at most ``budget`` bytes.

    Args:
        layers: a list, ``nn.Sequential`` or ``nn.ModuleList`` of modules or functions, each
            mapping a tensor to a tensor (shapes may change from layer to layer). Layers must
            not modify their input in place.
        x: the input tensor (its gradient is computed when it requires grad).
        budget: bytes, ``"64MiB"``, ``"2GB"`` or ``"80%"`` of the device's free memory for
            what the chain holds at once (see the module docstring); ``None``: plain autograd
            (every layer recorded, nothing recomputed).
        slots: memory buckets of the planner; sizes are rounded up to ``budget / slots``.
        costs: a :class:`~deepsolve.schedules.ChainCosts` (bytes, seconds) instead of
            profiling. Layers that are functions closing over tensors that require grad then
            need ``params=``.
        mode, block: the planner's mode (``"auto"``, ``"exact"``, ``"blocks"``) and block
            length; see :class:`~deepsolve.schedules.Hetero`.
        params: extra tensors requiring grad that the layers use (parameters of layers that
            are modules, and those found when profiling, are found automatically).
        preserve_rng: replay the CPU (and CUDA) random number streams when a layer is
            recomputed, so dropout masks match the first run.
        stats: a :class:`SequentialStats` to fill.

    Returns:
        the output of the last layer.

    Raises:
        BudgetError: the budget is below what the least-memory schedule needs.
        ValueError, TypeError: empty or non-callable layers, a non-tensor input or output.
    """
    layers = _check_layers(layers)
    x = _check_x(x)
    n = len(layers)
    if stats is not None:
        stats.n_layers = n
    explicit = list(params or [])
    for k, p in enumerate(explicit):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"sequential: params[{k}] is a {type(p).__name__}, not a tensor")
    if budget is None or not torch.is_grad_enabled():
        if stats is not None:
            stats.schedule = "plain"
        return _plain(layers, x)
    nbytes = parse_budget(budget, x.device)
    if stats is not None:
        stats.budget = nbytes
    t0 = time.perf_counter()
    key = None
    if costs is None:
        prof = profile_chain(layers, x)
        costs = prof.costs
        found = [list(p) for p in prof.params]
        key = _cache_key(layers, x)
    else:
        if not isinstance(costs, ChainCosts) or costs.n_steps != n:
            raise ValueError(f"sequential: costs must be a ChainCosts for {n} layers")
        found = [_module_params(l) for l in layers]
        key = ("costs", costs)  # the plan depends on the costs only
    t1 = time.perf_counter()
    actions, adv_cost, peak, desc, pmode, pblock = _plan(layers, x, costs, nbytes, slots, mode,
                                                         block, key)
    t2 = time.perf_counter()
    if stats is not None:
        stats.profile_time, stats.plan_time = t1 - t0, t2 - t1
        stats.schedule, stats.mode, stats.block = desc, pmode, pblock
        stats.predicted_peak = peak
        assert costs.backward is not None  # ChainCosts.__post_init__ fills it
        stats.predicted_time = adv_cost + sum(costs.forward) + sum(costs.backward)
    # every parameter once, with per-layer indices (a module may appear in several layers)
    all_params: list[torch.Tensor] = []
    index: dict[int, int] = {}
    layer_params: list[list[int]] = []
    for i in range(n):
        mine = []
        for p in [*found[i], *explicit]:
            if not p.requires_grad:
                continue
            if id(p) not in index:
                index[id(p)] = len(all_params)
                all_params.append(p)
            if index[id(p)] not in mine:
                mine.append(index[id(p)])
        layer_params.append(mine)
    if not all_params and not x.requires_grad:
        if stats is not None:
            stats.schedule = "plain"
        with torch.no_grad():
            return _plain(layers, x)
    if adv_cost == 0 and peak <= nbytes and all(type(a) is not Advance for a in actions):
        if stats is not None:  # everything fits recorded: plain autograd does the same
            stats.schedule = "plain"
            stats.recorded = n
        return _plain(layers, x)
    run = _Chain(layers, layer_params, all_params, _Listed(actions, n=n), preserve_rng,
                 cuda_devices([x, *all_params]), stats)
    try:
        run.forward(x)
    except BaseException:
        run.release()
        raise
    return _ChainFunction.apply(run, x, *all_params)
