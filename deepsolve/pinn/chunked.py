r"""Residual losses over large collocation sets, in chunks under a memory budget.

A PINN loss :math:`\frac1N \sum_n |r(x_n)|^2` over ``N`` points keeps, for its backward, the
derivative graph of the network at every point: for a 4×50 network and second derivatives
this is several kB per point, so :math:`10^5`–:math:`10^6` points do not fit. Here the points
are split into chunks; each chunk's residual is reduced to its contribution to the loss
(``sum r^2 / N``) *inside* a recomputed region, so the forward pass keeps only the chunk's
input points and the backward pass rebuilds one chunk's graph at a time. The gradient equals
the unchunked one up to the order of floating-point summation.

Two implementations (``impl=``):

* ``"recompute"`` (default) — a custom autograd function: the forward pass evaluates every
  chunk and keeps only the points; the backward pass re-evaluates one chunk at a time with
  gradients and calls ``torch.autograd.grad`` for the given ``params`` (and the points, if they
  require grad). What the recomputation saves passes through the saved-tensor hooks active
  during the backward, so :class:`SavedBytes` (and deepsolve's memory meter) see the true peak.
  It needs the list of tensors requiring grad that the residual uses (a model's parameters)
  and is differentiable once (no double backward).
* ``"checkpoint"`` — ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` per
  chunk: finds the captured parameters itself, but its recomputed tensors are stored outside
  the saved-tensor hooks, so hook-based meters under-report it (RSS and CUDA counters do not).

The chunk size follows from a budget (:func:`deepsolve.memory.parse_budget` strings:
``"256MiB"``, ``"2GB"``, ``"10%"``): :func:`bytes_per_point` evaluates the residual on two small
probes under :class:`SavedBytes` and takes the slope (bytes saved for backward per point,
without the fixed part such as views of the weights); ``chunk = budget // bytes_per_point``.
The budget thus bounds the saved-tensor bytes of one chunk's graph (the CPU measure deepsolve
checks budgets against); the backward of a chunk needs transient buffers of similar size on
top.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..memory.budget import parse_budget
from ..memory.saved import SavedTensors

__all__ = ["SavedBytes", "bytes_per_point", "chunk_size_for_budget", "chunked_sum",
           "chunked_mse", "ChunkedResidual", "IMPLS"]

IMPLS = ("recompute", "checkpoint")


# --------------------------------------------------------------------------------------
# measuring saved tensors
# --------------------------------------------------------------------------------------


# the saved-tensor meter (unique storages, leaves requiring grad not counted, torch.func
# wrappers by their storage; ``live``, ``peak``): deepsolve's one, under its PINN name
SavedBytes = SavedTensors


def _as_terms(out) -> tuple[tuple[str, ...] | None, tuple[torch.Tensor, ...]]:
    if isinstance(out, Mapping):
        return tuple(out), tuple(v.reshape(()) for v in out.values())
    if isinstance(out, torch.Tensor):  # a scalar, or a tensor summed elementwise
        return None, (out.reshape(()) if out.numel() == 1 else out,)
    raise TypeError(f"a chunk function must return a tensor or a dict of scalar tensors, got "
                    f"{type(out).__name__}")


def bytes_per_point(fn: Callable, x: torch.Tensor, probe: tuple[int, int] = (64, 128)
                    ) -> tuple[float, float]:
    """``(per_point, fixed)``: bytes saved for backward by ``fn`` (a scalar or dict of
    scalars, e.g. a chunk's loss contribution) per collocation point, and the size-independent
    part, from two probes of ``probe`` points (the first points of ``x``, repeated if ``x``
    has fewer)."""
    n1, n2 = (int(p) for p in probe)
    if not 0 < n1 < n2:
        raise ValueError(f"probe sizes must satisfy 0 < n1 < n2, got {probe}")
    if x.shape[0] < n2:
        reps = math.ceil(n2 / max(x.shape[0], 1))
        x = x.repeat(reps, *([1] * (x.dim() - 1)))
    sizes = []
    for n in (n1, n2):
        with torch.enable_grad(), SavedBytes() as meter:
            try:
                out = fn(x[:n].clone())
            except RuntimeError as e:
                if "saved tensor hooks" in str(e):
                    raise RuntimeError(
                        "measuring the residual's memory needs saved-tensor hooks, which "
                        "torch.func's reverse transforms (jacrev, vjp, grad) refuse; use "
                        "mode='fwd' or backend='autograd' in the residual's derivatives, or "
                        "give a chunk size instead of a budget") from e
                raise
            del out
            sizes.append(meter.peak)
    per_point = max((sizes[1] - sizes[0]) / (n2 - n1), 1.0)
    return per_point, max(sizes[0] - per_point * n1, 0.0)


def chunk_size_for_budget(fn: Callable, x: torch.Tensor, budget: int | float | str,
                          probe: tuple[int, int] = (64, 128), minimum: int = 1) -> int:
    """Points per chunk so that one chunk's saved tensors fit ``budget`` (bytes or a
    :func:`~deepsolve.memory.parse_budget` string): ``budget // bytes_per_point``, at least
    ``minimum``, at most ``len(x)``."""
    nbytes = parse_budget(budget, x.device)
    per_point, _ = bytes_per_point(fn, x, probe)
    return int(min(max(nbytes // per_point, minimum), max(x.shape[0], 1)))


# --------------------------------------------------------------------------------------
# chunked sums
# --------------------------------------------------------------------------------------


class _ChunkedSum(torch.autograd.Function):
    """Sum over chunks of ``run(chunk) -> tuple of scalars``, recomputed in backward."""

    @staticmethod
    def forward(ctx, run, chunk, n_params, x, *params):
        ctx.run, ctx.chunk = run, chunk
        ctx.params = params  # leaves (parameters): no reference cycle through the output
        ctx.save_for_backward(x)
        totals = None
        for xc in x.split(chunk):
            with torch.enable_grad():  # autograd-based derivatives need a graph in x
                outs = run(xc.detach())
            outs = tuple(o.detach() for o in outs)
            totals = outs if totals is None else tuple(a + b for a, b in zip(totals, outs,
                                                                              strict=True))
        assert totals is not None  # x.split() yields at least one chunk, even for no points
        return totals if len(totals) > 1 else totals[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outs):
        (x,) = ctx.saved_tensors
        params = ctx.params
        want_x = ctx.needs_input_grad[3]
        live = [i for i, g in enumerate(grad_outs) if g is not None]
        grads_p = [torch.zeros_like(p) if ctx.needs_input_grad[4 + i] else None
                   for i, p in enumerate(params)]
        grads_x: list[torch.Tensor] = []  # filled when want_x
        inputs = [p for i, p in enumerate(params) if ctx.needs_input_grad[4 + i]]
        for xc in x.split(ctx.chunk):
            xc = xc.detach().requires_grad_(want_x)
            with torch.enable_grad():
                outs = ctx.run(xc)
                ins = inputs + ([xc] if want_x else [])
                gs = torch.autograd.grad([outs[i] for i in live], ins,
                                         [grad_outs[i] for i in live], allow_unused=True,
                                         materialize_grads=True)
            k = 0
            for i in range(len(params)):
                g = grads_p[i]
                if g is not None:
                    g.add_(gs[k])
                    k += 1
            if want_x:
                grads_x.append(gs[-1])
            del outs, gs
        gx = torch.cat(grads_x) if want_x else None
        return (None, None, None, gx, *grads_p)


def chunked_sum(fn: Callable, x: torch.Tensor, chunk_size: int,
                params: Iterable[torch.Tensor] | None = None, impl: str = "recompute"):
    """``sum_c fn(x_c)`` over chunks ``x_c`` of ``chunk_size`` points, with the chunk graphs
    recomputed in the backward pass (see the module docstring). ``fn`` returns a scalar, a
    tensor of the same shape for every chunk (summed elementwise, e.g. per-slice sums), or a
    dict of scalars (the same keys for every chunk); so does the result. ``params``: the
    tensors requiring grad that ``fn`` uses (required for ``impl="recompute"``)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    chunk = max(int(chunk_size), 1)
    probe_names: list = []

    def run(xc):
        names, vals = _as_terms(fn(xc))
        if not probe_names:
            probe_names.append(names)
        return vals

    if impl == "checkpoint":
        totals = None
        for xc in x.split(chunk):
            outs = checkpoint(run, xc, use_reentrant=False)
            totals = outs if totals is None else tuple(a + b for a, b in zip(totals, outs,
                                                                              strict=True))
    else:
        if params is None:
            raise ValueError("impl='recompute' needs params= (e.g. model.parameters())")
        params = tuple(params)
        grad_on = torch.is_grad_enabled() and (x.requires_grad
                                               or any(p.requires_grad for p in params))
        if not grad_on:
            with torch.no_grad():
                totals = None
                for xc in x.split(chunk):
                    with torch.enable_grad():
                        outs = tuple(o.detach() for o in run(xc))
                    totals = outs if totals is None else tuple(
                        a + b for a, b in zip(totals, outs, strict=True))
        else:
            out = _ChunkedSum.apply(run, chunk, len(params), x, *params)
            totals = out if isinstance(out, tuple) else (out,)
    assert totals is not None  # x.split() yields at least one chunk, even for no points
    names = probe_names[0] if probe_names else None
    if names is None:
        return totals[0]
    return dict(zip(names, totals, strict=True))


def _mse_contribution(res, n_total: int):
    """``sum |r|^2 / (N * components)`` per residual (dict or tensor)."""
    def one(r):
        per_point = r[0].numel() if r.dim() > 1 else 1
        return r.pow(2).sum() / (n_total * per_point)

    if isinstance(res, Mapping):
        return {k: one(v) for k, v in res.items()}
    return one(res)


def chunked_mse(residual_fn: Callable, x: torch.Tensor, chunk_size: int | None = None,
                params: Iterable[torch.Tensor] | None = None, impl: str = "recompute"):
    """Mean squared residual(s) over all points of ``x``: ``residual_fn(x_c)`` returns the
    per-point residual ``(n,)``/``(n, c)`` or a dict of them; the result is a scalar or a dict
    of scalars. ``chunk_size=None`` (or ``>= len(x)``) evaluates everything at once."""
    n = x.shape[0]
    if chunk_size is None or chunk_size >= n:
        return _mse_contribution(residual_fn(x), n)
    return chunked_sum(lambda xc: _mse_contribution(residual_fn(xc), n), x, chunk_size,
                       params=params, impl=impl)


class ChunkedResidual:
    """Mean squared residuals over a collocation set under a memory budget.

    ``loss = ChunkedResidual(residual_fn, params=model.parameters(), budget="256MiB")(x)``
    measures the saved bytes per point once (on the first call; again when the dtype or
    device of the points changes), picks the chunk size and evaluates :func:`chunked_mse`.
    Without a budget (``None`` or ``""``) and without ``chunk_size`` it evaluates the whole set
    at once. ``chunk_size`` overrides the budget.
    """

    def __init__(self, residual_fn: Callable, params: Iterable[torch.Tensor] | None = None,
                 budget: int | float | str | None = None, chunk_size: int | None = None,
                 impl: str = "recompute", probe: tuple[int, int] = (64, 128)):
        self.residual_fn = residual_fn
        self.params = tuple(params) if params is not None else None
        self.budget = budget or None
        self.fixed_chunk = chunk_size
        self.impl = impl
        self.probe = probe
        self.per_point: float | None = None
        self._key: tuple[torch.dtype, torch.device] | None = None

    def chunk_size(self, x: torch.Tensor) -> int | None:
        if self.fixed_chunk:
            return int(self.fixed_chunk)
        if self.budget is None:
            return None
        key = (x.dtype, x.device)
        if self.per_point is None or key != self._key:
            n = x.shape[0]
            self.per_point, _ = bytes_per_point(
                lambda xc: _mse_contribution(self.residual_fn(xc), n), x, self.probe)
            self._key = key
        nbytes = parse_budget(self.budget, x.device)
        return int(max(nbytes // self.per_point, 1))

    def __call__(self, x: torch.Tensor):
        return chunked_mse(self.residual_fn, x, self.chunk_size(x), params=self.params,
                           impl=self.impl)
