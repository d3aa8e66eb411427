r"""Derivatives of a pointwise network :math:`u: \mathbb{R}^d \to \mathbb{R}^k` at many points.

Every helper takes ``f`` and a batch of points ``x`` of shape ``(N, d)`` and has two backends:

* ``backend="func"`` (default): ``torch.func`` transforms (``jacfwd``/``jacrev``/``jvp``)
  applied to the *pointwise* function — ``f`` maps one point ``(d,)`` to ``(k,)`` (or to a
  scalar ``()``) — and ``vmap`` over the ``N`` points. Any ``nn.Module`` made of layers that
  accept an unbatched input (``Linear``, activations, ...) is such a function. ``mode``
  selects forward (``"fwd"``, the default) or reverse (``"rev"``) differentiation for the
  innermost derivative; outer derivatives are always forward mode (``jacfwd``/``jvp``).
  ``"fwd"`` works under saved-tensor hooks (``torch.utils.checkpoint``, :class:`SavedBytes
  <deepsolve.pinn.SavedBytes>`, memory meters); ``torch.func``'s reverse transforms
  (``jacrev``/``vjp``) refuse to run under them. ``"rev"`` (forward-over-reverse) was about 2×
  faster on the 8×20 Burgers network on a CPU — use it where no such hooks are active.
* ``backend="autograd"``: ``torch.autograd.grad(..., create_graph=True)`` on the *batched*
  function — ``f`` maps ``(N, d)`` to ``(N, k)`` (or ``(N,)``). Use it where ``torch.func``
  cannot trace the module (unsupported ops, in-place updates of buffers, hooks, data-dependent
  Python control flow). It is only correct for functions that act on each point separately
  (no batch normalisation, no attention across points).

* ``backend="taylor"``: value and derivatives pushed forward through the layers in closed
  form, one pass (:class:`deepsolve.pinn.FNN`, see :mod:`deepsolve.pinn.networks`); for
  :class:`~deepsolve.pinn.FNN` networks (or any module with the same ``taylor`` method) and
  derivatives up to order 2. The fastest of the three for PINN residuals on a CPU.

All backends build differentiable results: a residual made of these derivatives can be
differentiated again with respect to the parameters the function closes over (an
``nn.Module``'s parameters; ``loss.backward()`` works through ``vmap``/``jacfwd``), or, for
``torch.func``-style training, with respect to the explicit parameters of :func:`pointwise`.

Shapes (``N`` points, ``d`` input dimensions, ``k`` output components): value ``(N, k)``,
Jacobian ``(N, k, d)``, Hessian ``(N, k, d, d)``. When ``f`` returns a scalar per point the
``k`` axis is dropped: ``(N,)``, ``(N, d)``, ``(N, d, d)``. ``component=c`` picks one output
component (and drops the axis).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch.func import functional_call, jacfwd, jacrev, jvp, vmap

__all__ = [
    "Jet",
    "pointwise",
    "jet",
    "jacobian",
    "gradient",
    "hessian",
    "partial",
    "laplacian",
    "divergence",
    "BACKENDS",
]

BACKENDS = ("func", "autograd", "taylor")
Fn = Callable[[torch.Tensor], torch.Tensor]


class Jet(NamedTuple):
    r"""Value and derivatives of ``f`` at the points: ``value (N, k)``, ``jacobian (N, k, d)``
    and ``hessian (N, k, d, d)`` (``None`` below order 2); the ``k`` axis is absent for a
    scalar ``f``.

    A jet asked for part of the second derivatives only holds those: with
    ``hessian_components`` the component axis of ``hessian`` has ``len(hessian_components)``
    entries, with ``hessian_dims`` the first derivative axis holds :math:`\partial_i` for
    ``i`` in ``hessian_dims`` only (``hessian[n, c, a, j]`` =
    :math:`\partial_{dims_a}\partial_j f_c`), and with ``hessian_pairs`` the last axis holds
    one entry per pair: ``hessian[n, c, p]`` = :math:`\partial_i\partial_j f_c` for
    ``(i, j) = hessian_pairs[p]`` (shape ``(N, k, P)``). :meth:`d` and :meth:`laplacian`
    translate the numbers, so code using them does not change."""

    value: torch.Tensor
    jacobian: torch.Tensor
    hessian: torch.Tensor | None = None
    hessian_components: tuple[int, ...] | None = None
    hessian_dims: tuple[int, ...] | None = None
    hessian_pairs: tuple[tuple[int, int], ...] | None = None

    def _comp(self, component: int | None) -> tuple:
        if component is None:
            return ()
        if self.hessian_components is None:
            return (component,)
        if component not in self.hessian_components:
            raise ValueError(f"no second derivatives of component {component} in this jet "
                             f"(hessian_components={self.hessian_components})")
        return (self.hessian_components.index(component),)

    def _row(self, i: int, j: int) -> tuple[int, ...]:
        if self.hessian_pairs is not None:
            for p, (a, b) in enumerate(self.hessian_pairs):
                if (a, b) in ((i, j), (j, i)):
                    return (p,)
            raise ValueError(f"no second derivative along {i}, {j} in this jet "
                             f"(hessian_pairs={self.hessian_pairs})")
        if self.hessian_dims is None:
            return i, j
        if i in self.hessian_dims:
            return self.hessian_dims.index(i), j
        if j in self.hessian_dims:  # symmetric
            return self.hessian_dims.index(j), i
        raise ValueError(f"no second derivative along {i}, {j} in this jet "
                         f"(hessian_dims={self.hessian_dims})")

    def d(self, component: int | None, *index: int) -> torch.Tensor:
        """Partial derivative of order ``len(index)`` (0, 1 or 2) of one component
        (``component=None`` for a scalar ``f``), shape ``(N,)``."""
        sel = (slice(None),) if component is None else (slice(None), component)
        if len(index) == 0:
            return self.value[sel]
        if len(index) == 1:
            return self.jacobian[sel + (index[0],)]
        if len(index) == 2 and self.hessian is not None:
            return self.hessian[(slice(None),) + self._comp(component) + self._row(*index)]
        raise ValueError(f"this jet holds derivatives up to order "
                         f"{1 if self.hessian is None else 2}; asked for order {len(index)}")

    def laplacian(self, component: int | None = None,
                  dims: Sequence[int] | None = None) -> torch.Tensor:
        """Sum of the second derivatives over ``dims`` (default all), shape ``(N,)`` (or
        ``(N, k)`` when ``component`` is None and ``f`` has components)."""
        if self.hessian is None:
            raise ValueError("the Laplacian needs a jet of order 2")
        h = self.hessian[(slice(None),) + self._comp(component)]
        if dims is not None:
            axes = dims
        elif self.hessian_pairs is not None:
            axes = sorted({i for i, j in self.hessian_pairs if i == j})
        else:
            axes = range(h.shape[-1])
        # sum() types its result `| Literal[0]` (the value for no axes)
        return cast(torch.Tensor, sum(h[(...,) + self._row(i, i)] for i in axes))


def pointwise(module: torch.nn.Module, params: dict | None = None,
              buffers: dict | None = None) -> Fn:
    """``module`` as a function of one point, called through
    :func:`torch.func.functional_call` with explicit ``params`` (and ``buffers``) when given
    — for ``torch.func.grad``/``vmap`` over parameters (ensembles, NTKs) — or with the
    module's own parameters otherwise (plain ``loss.backward()`` reaches them)."""
    if params is None and buffers is None:
        return module
    tensors = dict(params or {})
    tensors.update(buffers or {})

    def f(x):
        return functional_call(module, tensors, (x,))

    return f


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _check(x: torch.Tensor, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() != 2:
        raise ValueError(f"points must have shape (N, d), got {tuple(x.shape)}")


def _inner(mode: str):
    if mode == "fwd":
        return jacfwd
    if mode == "rev":
        return jacrev
    raise ValueError(f"mode must be 'fwd' or 'rev', got {mode!r}")


def _autograd(fn, *args):
    """Run an autograd-backend computation with gradients enabled (derivatives w.r.t. the
    points need a graph even under ``torch.no_grad()``); under an outer ``no_grad`` the
    result is detached, as a ``torch.func`` result would be."""
    outer = torch.is_grad_enabled()
    with torch.enable_grad():
        out = fn(*args)
    if outer:
        return out
    if isinstance(out, Jet):
        return Jet._make(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
    return out.detach()


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if autograd already tracks it, else a detached copy that requires grad."""
    return x if x.requires_grad else x.detach().requires_grad_(True)


def _grad(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``d(sum y)/dx`` with a graph; zeros where ``y`` does not depend on ``x``."""
    if not y.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True, allow_unused=True,
                               materialize_grads=True)
    return g


def _select(t: torch.Tensor, component: int | None, scalar: bool) -> torch.Tensor:
    if component is None:
        return t
    if scalar:
        raise ValueError("component was given but f returns a scalar per point")
    return t[:, component]


# --------------------------------------------------------------------------------------
# the jet: value, Jacobian and Hessian in one pass
# --------------------------------------------------------------------------------------


def jet(f: Fn, x: torch.Tensor, order: int = 2, *, backend: str = "func",
        mode: str = "fwd", hessian_components: Sequence[int] | None = None,
        hessian_dims: Sequence[int] | None = None,
        hessian_pairs: Sequence[tuple[int, int]] | None = None) -> Jet:
    r"""Value, Jacobian and (``order=2``) Hessian of ``f`` at the points ``x (N, d)`` — one
    forward evaluation of ``f`` shared by all of them. ``hessian_components`` restricts the
    second derivatives to those output components (e.g. the velocity of ``(u, v, p)``) and
    ``hessian_dims`` to derivatives along those inputs (e.g. ``(0,)`` for :math:`u_{xx}` of
    ``u(x, t)``), saving the cost of the others; ``hessian_pairs`` to the listed
    :math:`\partial_i\partial_j` only (e.g. ``((0, 0), (1, 1))`` for a 2D Laplacian: the
    ``taylor`` backend then computes just those; the others compute the rows they need and
    keep the pairs). See the module docstring for shapes and backends."""
    _check(x, backend)
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order}")
    comps = None if hessian_components is None else tuple(int(c) for c in hessian_components)
    dims = None if hessian_dims is None else tuple(int(i) for i in hessian_dims)
    if hessian_pairs is not None:
        if dims is not None:
            raise ValueError("give hessian_dims or hessian_pairs, not both")
        pairs = tuple((int(i), int(j)) for i, j in hessian_pairs)
        for i, j in pairs:
            if not (0 <= i < x.shape[1] and 0 <= j < x.shape[1]):
                raise ValueError(f"hessian pair {(i, j)} out of range for points of dimension "
                                 f"{x.shape[1]}")
        if backend == "taylor":
            return _jet_taylor(f, x, order, comps, None, pairs)
        rows = tuple(sorted({i for i, _ in pairs}))
        full = jet(f, x, order, backend=backend, mode=mode, hessian_components=comps,
                   hessian_dims=rows)
        if order == 1:
            return full
        h = full.hessian
        assert h is not None  # order 2
        picked = torch.stack([h[..., rows.index(i), j] for i, j in pairs], -1)
        return Jet(full.value, full.jacobian, picked, comps, None, pairs)
    if backend == "taylor":
        return _jet_taylor(f, x, order, comps, dims)
    if backend == "autograd":
        return _autograd(_jet_autograd, f, x, order, comps, dims)
    inner = _inner(mode)

    def value_twice(p):
        y = f(p)
        return y, y

    if order == 1:
        jac, y = vmap(inner(value_twice, has_aux=True))(x)
        return Jet(y, jac, None)

    def first(p):
        jac, y = inner(value_twice, has_aux=True)(p)
        return (jac if comps is None else jac[list(comps)]), (jac, y)

    if dims is None:
        hess, (jac, y) = vmap(jacfwd(first, has_aux=True))(x)
        return Jet(y, jac, hess, comps)
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)

    def hess_rows(p):
        out = None
        parts = []
        for i in dims:
            # torch's stub types jvp's result as 2 or 3 items; has_aux=True gives 3
            _, dj, out = cast("tuple[Any, Any, Any]", jvp(first, (p,), (eye[i],), has_aux=True))
            parts.append(dj)
        return torch.stack(parts, -2), out  # (..., len(dims), d)

    hess, (jac, y) = vmap(hess_rows)(x)
    return Jet(y, jac, hess, comps, dims)


def _jet_autograd(f: Fn, x: torch.Tensor, order: int, comps: tuple[int, ...] | None = None,
                  dims: tuple[int, ...] | None = None) -> Jet:
    x = _leaf(x)
    y = f(x)
    scalar = y.dim() == 1
    if scalar and comps is not None:
        raise ValueError("hessian_components was given but f returns a scalar per point")
    cols = [y] if scalar else list(y.unbind(1))
    rows = range(x.shape[1]) if dims is None else dims
    jacs, hessians = [], {}
    for k, c in enumerate(cols):
        g = _grad(c, x)  # (N, d)
        jacs.append(g)
        if order == 2 and (comps is None or k in comps):
            hessians[k] = torch.stack([_grad(g[:, i], x) for i in rows], 1)
    jac = jacs[0] if scalar else torch.stack(jacs, 1)
    hess = None
    if order == 2:
        if scalar:
            hess = hessians[0]
        else:
            keys = range(len(cols)) if comps is None else comps
            hess = torch.stack([hessians[k] for k in keys], 1)
    return Jet(y, jac, hess, comps, dims)


def _jet_taylor(f: Fn, x: torch.Tensor, order: int, comps: tuple[int, ...] | None,
                dims: tuple[int, ...] | None,
                pairs: tuple[tuple[int, int], ...] | None = None) -> Jet:
    taylor = getattr(f, "taylor", None)
    if taylor is None:
        raise ValueError(f"backend='taylor' needs a deepsolve.pinn.FNN (or a module with its "
                         f"taylor() method), got {type(f).__name__}; use backend='func' or "
                         f"'autograd' for other networks")
    d = x.shape[1]
    scalar = bool(getattr(f, "scalar", False))
    if scalar and comps is not None:
        raise ValueError("hessian_components was given but f returns a scalar per point")
    if pairs is not None:
        want = list(pairs)
    else:  # rows i in dims, all j: compute each unordered pair once
        rows = range(d) if dims is None else dims
        want = sorted({(min(i, j), max(i, j)) for i in rows for j in range(d)})
    value, jac, hess = taylor(x, order, want if order == 2 else ())
    if hess is not None and pairs is None:
        rows = tuple(range(d)) if dims is None else dims
        table = [want.index((min(i, j), max(i, j))) for i in rows for j in range(d)]
        index = torch.tensor(table, device=hess.device)
        hess = hess.index_select(-1, index).unflatten(-1, (len(rows), d))
    if hess is not None and comps is not None:
        hess = hess[:, list(comps)]
    if scalar:
        value, jac = value[:, 0], jac[:, 0]
        hess = None if hess is None else hess[:, 0]
    if order == 1:
        return Jet(value, jac, None)
    return Jet(value, jac, hess, comps, dims, pairs)


# --------------------------------------------------------------------------------------
# individual operators
# --------------------------------------------------------------------------------------


def jacobian(f: Fn, x: torch.Tensor, *, backend: str = "func", mode: str = "fwd"
             ) -> torch.Tensor:
    """Jacobian ``(N, k, d)`` (``(N, d)`` for a scalar ``f``)."""
    _check(x, backend)
    if backend == "autograd":
        return _autograd(_jet_autograd, f, x, 1).jacobian
    if backend == "taylor":
        return jet(f, x, 1, backend="taylor").jacobian
    return vmap(_inner(mode)(f))(x)


def gradient(f: Fn, x: torch.Tensor, component: int | None = None, *, backend: str = "func",
             mode: str = "fwd") -> torch.Tensor:
    """Gradient ``(N, d)`` of a scalar ``f``, or of output ``component`` of a vector ``f``."""
    _check(x, backend)
    if backend == "autograd":
        return _autograd(_partial_autograd, f, x, (), component, True)
    if backend == "taylor":
        jac = jet(f, x, 1, backend="taylor").jacobian
        if component is None and jac.dim() == 3:
            raise ValueError("f has several components: give component=")
        return _select(jac, component, jac.dim() == 2)
    g = _component_fn(f, component)
    out = vmap(_inner(mode)(g))(x)
    if out.dim() != 2:
        raise ValueError("f has several components: give component=")
    return out


def hessian(f: Fn, x: torch.Tensor, component: int | None = None, *, backend: str = "func",
            mode: str = "fwd") -> torch.Tensor:
    """Hessian ``(N, k, d, d)``, ``(N, d, d)`` for a scalar ``f`` or one ``component``."""
    _check(x, backend)
    if backend == "autograd":
        if component is None:
            return _autograd(_jet_autograd, f, x, 2).hessian
        return _autograd(_jet_autograd, _component_fn(f, component, batched=True), x, 2).hessian
    if backend == "taylor":
        h = jet(f, x, 2, backend="taylor").hessian
        assert h is not None  # order 2
        return _select(h, component, h.dim() == 3)
    g = _component_fn(f, component)
    return vmap(jacfwd(_inner(mode)(g)))(x)


def partial(f: Fn, x: torch.Tensor, index: int | Sequence[int], component: int | None = None,
            *, backend: str = "func", mode: str = "fwd") -> torch.Tensor:
    r"""The partial derivative :math:`\partial_{i_1}\partial_{i_2}\cdots f` for
    ``index = (i_1, i_2, ...)`` (any order; ``()`` is the value; an int is order 1), shape
    ``(N, k)`` or ``(N,)`` (scalar ``f`` or one ``component``).

    ``func``: nested directional derivatives along the unit vectors (forward mode, one
    Jacobian-vector product per order, ``mode="fwd"``) or nested ``jacrev`` picking one
    column per order (``mode="rev"``). ``autograd``: repeated ``torch.autograd.grad``.
    """
    _check(x, backend)
    idx = (index,) if isinstance(index, int) else tuple(int(i) for i in index)
    d = x.shape[1]
    for i in idx:
        if not 0 <= i < d:
            raise ValueError(f"partial index {i} out of range for points of dimension {d}")
    if backend == "autograd":
        return _autograd(_partial_autograd, f, x, idx, component)
    if backend == "taylor":
        if len(idx) > 2:
            raise ValueError(f"backend='taylor' gives derivatives up to order 2, asked for "
                             f"order {len(idx)}; use backend='func' or 'autograd'")
        j = jet(f, x, max(len(idx), 1), backend="taylor",
                hessian_pairs=[idx] if len(idx) == 2 else None)
        scalar = j.value.dim() == 1
        if len(idx) == 0:
            out = j.value
        elif len(idx) == 1:
            out = j.jacobian[..., idx[0]]
        else:
            assert j.hessian is not None  # order 2
            out = j.hessian[..., 0]
        return _select(out, component, scalar)
    g = _component_fn(f, component)
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    for i in idx:
        g = _directional(g, eye[i], i, mode)
    return vmap(g)(x)


def _columns(f: Fn, x: torch.Tensor, component: int | None):
    xl = _leaf(x)
    y = f(xl)
    scalar = y.dim() == 1
    if component is not None:
        return xl, [_select(y, component, scalar)], True
    return xl, ([y] if scalar else list(y.unbind(1))), scalar


def _partial_autograd(f: Fn, x: torch.Tensor, idx: tuple[int, ...], component: int | None,
                      gradient: bool = False) -> torch.Tensor:
    xl, cols, single = _columns(f, x, component)
    if gradient:  # the full gradient of one scalar
        if not single:
            raise ValueError("f has several components: give component=")
        return _grad(cols[0], xl)
    outs = []
    for c in cols:
        for i in idx:
            c = _grad(c, xl)[:, i]
        outs.append(c)
    return outs[0] if single else torch.stack(outs, 1)


def _laplacian_autograd(f: Fn, x: torch.Tensor, axes: list[int], component: int | None
                        ) -> torch.Tensor:
    xl, cols, single = _columns(f, x, component)
    outs = []
    for c in cols:
        g = _grad(c, xl)
        outs.append(cast(torch.Tensor, sum(_grad(g[:, i], xl)[:, i] for i in axes)))
    return outs[0] if single else torch.stack(outs, 1)


def _directional(g: Fn, e: torch.Tensor, i: int, mode: str) -> Fn:
    if mode == "fwd":
        def h(p):
            return jvp(g, (p,), (e,))[1]
    elif mode == "rev":
        def h(p):
            return jacrev(g)(p)[..., i]
    else:
        raise ValueError(f"mode must be 'fwd' or 'rev', got {mode!r}")
    return h


def _component_fn(f: Fn, component: int | None, batched: bool = False) -> Fn:
    if component is None:
        return f

    def g(p):
        y = f(p)
        if y.dim() == (1 if batched else 0):
            raise ValueError("component was given but f returns a scalar per point")
        return y[..., component]

    return g


def laplacian(f: Fn, x: torch.Tensor, component: int | None = None,
              dims: Sequence[int] | None = None, *, backend: str = "func",
              mode: str = "fwd") -> torch.Tensor:
    r""":math:`\sum_{i \in dims} \partial_i^2 f` (default: all dimensions), shape ``(N, k)``
    or ``(N,)``. ``dims`` restricts it to, e.g., the spatial coordinates of a space-time
    point. ``func`` takes forward-over-``mode`` second directional derivatives along each
    axis (no full Hessian); ``autograd`` one gradient per component and axis."""
    _check(x, backend)
    axes = list(range(x.shape[1])) if dims is None else [int(i) for i in dims]
    if backend == "autograd":
        return _autograd(_laplacian_autograd, f, x, axes, component)
    if backend == "taylor":
        j = jet(f, x, 2, backend="taylor", hessian_pairs=[(i, i) for i in axes])
        lap = j.laplacian()
        return _select(lap, component, j.value.dim() == 1)
    g = _component_fn(f, component)
    d = x.shape[1]
    eye = torch.eye(d, dtype=x.dtype, device=x.device)

    def lap_at(p):
        total: torch.Tensor | int = 0
        for i in axes:
            h = _directional(_directional(g, eye[i], i, mode), eye[i], i, "fwd")
            total = total + h(p)
        return total

    return vmap(lap_at)(x)


def divergence(f: Fn, x: torch.Tensor, components: Sequence[int] | None = None,
               dims: Sequence[int] | None = None, *, backend: str = "func",
               mode: str = "fwd") -> torch.Tensor:
    r""":math:`\sum_j \partial_{dims_j} f_{components_j}`, shape ``(N,)``. By default
    ``components = dims = range(d)`` (``f`` maps ``R^d`` to at least ``d`` components); for
    a velocity stored in the first two of the outputs ``(u, v, p)`` and points ``(x, y)``
    the default is right, for ``(x, y, t)`` give ``dims=(0, 1)``."""
    _check(x, backend)
    d = x.shape[1]
    dims = list(range(d)) if dims is None else [int(i) for i in dims]
    comps = list(dims) if components is None else [int(c) for c in components]
    if len(comps) != len(dims):
        raise ValueError(f"divergence needs as many components as dims, got {comps} and {dims}")
    jac = jacobian(f, x, backend=backend, mode=mode)
    if jac.dim() != 3:
        raise ValueError("the divergence needs a vector-valued f")
    return cast(torch.Tensor, sum(jac[:, c, i] for c, i in zip(comps, dims, strict=True)))
