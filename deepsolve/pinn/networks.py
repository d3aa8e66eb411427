r"""Fully connected networks whose input derivatives come from one forward pass (Taylor mode).

A PINN residual needs the value, the first and some second derivatives of the network with
respect to its input at every collocation point. Nested automatic differentiation (reverse
over reverse, or ``torch.func``'s forward over forward) builds them as graphs of graphs; for
the multilayer perceptrons PINNs use, the derivatives can instead be pushed forward through
the layers in closed form, together with the value (forward-mode Taylor propagation,
Griewank & Walther, *Evaluating Derivatives*, 2nd ed., SIAM 2008, ch. 13; Bettencourt,
Johnson & Duvenaud, "Taylor-mode automatic differentiation for higher-order derivatives in
JAX", 2019).

For a layer :math:`z = W h + b` followed by an elementwise activation :math:`a = \sigma(z)`,
with :math:`\partial_i` a derivative along input coordinate :math:`i`:

.. math::

    \partial_i z = W\,\partial_i h, \qquad \partial_{ij} z = W\,\partial_{ij} h,

    \partial_i a = \sigma'(z)\,\partial_i z, \qquad
    \partial_{ij} a = \sigma'(z)\,\partial_{ij} z + \sigma''(z)\,\partial_i z\,\partial_j z .

The value, the ``d`` first derivatives and the ``P`` requested second derivatives (pairs
:math:`(i, j)`) travel as one tensor of *streams* ``(N, 1 + d + P, width)``, so each layer
is one matrix product and a few elementwise operations; the result is an ordinary autograd
graph, differentiable with respect to the parameters (``loss.backward()``). Asking only for
the pairs a residual uses (``(0, 0), (1, 1)`` for a 2D Laplacian) saves the others.

:class:`FNN` is such a network; :func:`deepsolve.pinn.jet` with ``backend="taylor"`` calls
its :meth:`FNN.taylor`. The results equal nested autograd to round-off (the tests: 1e-12 in
float64). Only the activations in :data:`ACTIVATIONS` are supported (their first and second
derivatives are written out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

__all__ = ["FNN", "ACTIVATIONS"]


def _tanh(z):
    t = torch.tanh(z)
    s1 = 1 - t * t
    return t, s1, -2 * t * s1


def _sin(z):
    s = torch.sin(z)
    return s, torch.cos(z), -s


def _sigmoid(z):
    s = torch.sigmoid(z)
    s1 = s * (1 - s)
    return s, s1, s1 * (1 - 2 * s)


def _softplus(z):
    s = torch.sigmoid(z)
    return torch.nn.functional.softplus(z), s, s * (1 - s)


def _silu(z):
    s = torch.sigmoid(z)
    ds = s * (1 - s)
    return z * s, s + z * ds, ds * (2 + z * (1 - 2 * s))


ACTIVATIONS: dict[str, Callable] = {
    "tanh": _tanh, "sin": _sin, "sigmoid": _sigmoid, "softplus": _softplus, "silu": _silu,
}
"""Activation name → function returning :math:`(\\sigma(z), \\sigma'(z), \\sigma''(z))`."""

_PLAIN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "sin": torch.sin, "sigmoid": torch.sigmoid,
    "softplus": torch.nn.functional.softplus, "silu": torch.nn.functional.silu}


class FNN(torch.nn.Module):
    r"""``in_dim → width × depth (activation) → out_dim``, a fully connected network with
    Glorot-normal weights and zero biases (as in DeepXDE and Raissi et al.).

    ``lo``/``hi`` map the input box affinely onto :math:`[-1, 1]^d` first (a fixed buffer,
    part of the network, so derivatives include its scale). ``scalar=True`` (with
    ``out_dim=1``) drops the output axis: ``(N,)`` for ``(N, d)`` points, ``()`` for one.
    :meth:`forward` works on one point ``(d,)`` and on batches ``(N, d)``, so the network
    also serves ``torch.func`` and autograd derivatives; :meth:`taylor` computes value and
    derivatives in one pass (module docstring).
    """

    scale: torch.Tensor  # buffers registered in __init__
    shift: torch.Tensor

    def __init__(self, in_dim: int, out_dim: int, width: int, depth: int,
                 activation: str = "tanh", *, lo: Sequence[float] | None = None,
                 hi: Sequence[float] | None = None, scalar: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                             f"{activation!r}")
        if min(in_dim, out_dim, width) < 1 or depth < 1:
            raise ValueError(f"FNN needs positive sizes, got in_dim={in_dim}, out_dim={out_dim}, "
                             f"width={width}, depth={depth}")
        if scalar and out_dim != 1:
            raise ValueError(f"scalar=True needs out_dim=1, got {out_dim}")
        self.activation, self.scalar = activation, scalar
        self._act = ACTIVATIONS[activation]
        self._plain = _PLAIN[activation]
        dims = [in_dim] + [width] * depth + [out_dim]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b)
                                          for a, b in zip(dims[:-1], dims[1:], strict=True))
        for layer in self._linears():
            torch.nn.init.xavier_normal_(layer.weight)
            torch.nn.init.zeros_(layer.bias)
        scale, shift = torch.ones(in_dim), torch.zeros(in_dim)
        if (lo is None) != (hi is None):
            raise ValueError("give both lo and hi (the input box), or neither")
        if lo is not None:
            lo_t = torch.as_tensor(lo, dtype=torch.float64)
            hi_t = torch.as_tensor(hi, dtype=torch.float64)
            if lo_t.shape != (in_dim,) or hi_t.shape != (in_dim,) or not bool((hi_t > lo_t).all()):
                raise ValueError(f"lo and hi must be {in_dim} numbers with lo < hi, got {lo}, {hi}")
            scale = (2.0 / (hi_t - lo_t)).float()
            shift = (-1.0 - lo_t * 2.0 / (hi_t - lo_t)).float()
        self.register_buffer("scale", scale)
        self.register_buffer("shift", shift)

    def _linears(self) -> Sequence[torch.nn.Linear]:
        # self.layers holds only Linear layers; ModuleList's items are typed as Module
        return cast("Sequence[torch.nn.Linear]", self.layers)

    @property
    def in_dim(self) -> int:
        return self._linears()[0].in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale + self.shift
        layers = self._linears()
        for layer in layers[:-1]:
            h = self._plain(layer(h))
        y = layers[-1](h)
        return y[..., 0] if self.scalar else y

    def taylor(self, x: torch.Tensor, order: int = 2,
               pairs: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor | None]:
        r"""Value ``(N, k)``, Jacobian ``(N, k, d)`` and the second derivatives
        :math:`\partial_i\partial_j` for each ``(i, j)`` in ``pairs``, ``(N, k, P)`` (``None``
        for ``order=1``), at the points ``x (N, d)``, in one pass (module docstring). The
        output axis ``k`` is kept even for ``scalar=True``."""
        if x.dim() != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"points must have shape (N, {self.in_dim}), got {tuple(x.shape)}")
        if order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {order}")
        d = x.shape[1]
        pairs = [(int(i), int(j)) for i, j in pairs] if order == 2 else []
        for i, j in pairs:
            if not (0 <= i < d and 0 <= j < d):
                raise ValueError(f"second-derivative pair {(i, j)} out of range for d={d}")
        act = self._act
        layers = self._linears()
        first = layers[0]
        z = torch.addmm(first.bias, x * self.scale + self.shift, first.weight.t())
        # first layer: the input's derivatives are the unit vectors, so dz/dx_i is the
        # (scaled) weight column, the same at every point, and d2z = 0
        gz = (first.weight * self.scale).t()                         # (d, w)
        a, s1, s2 = act(z)
        parts = [a.unsqueeze(1), s1.unsqueeze(1) * gz]
        if pairs:
            parts.append(s2.unsqueeze(1) * torch.stack([gz[i] * gz[j] for i, j in pairs]))
        streams = torch.cat(parts, 1)                                 # (N, 1 + d + P, w)
        for layer in layers[1:-1]:
            zz = streams @ layer.weight.t()
            a, s1, s2 = act(zz[:, 0] + layer.bias)
            g = zz[:, 1:1 + d]
            parts = [a.unsqueeze(1), s1.unsqueeze(1) * g]
            if pairs:
                gg = torch.stack([g[:, i] * g[:, j] for i, j in pairs], 1)
                parts.append(s1.unsqueeze(1) * zz[:, 1 + d:] + s2.unsqueeze(1) * gg)
            streams = torch.cat(parts, 1)
        last = layers[-1]
        out = streams @ last.weight.t()                               # (N, 1 + d + P, k)
        value = out[:, 0] + last.bias
        jac = out[:, 1:1 + d].transpose(1, 2)
        hess = out[:, 1 + d:].transpose(1, 2) if order == 2 else None
        return value, jac, hess

    def extra_repr(self) -> str:
        dims = [self.layers[0].in_features] + [layer.out_features for layer in self.layers]
        return f"sizes={dims}, activation={self.activation!r}, scalar={self.scalar}"

