r"""Hard constraints: the ansatz :math:`u(x) = g(x) + b(x) \odot N(x)`, with Taylor mode.

A boundary (or initial) condition holds exactly, for any network :math:`N`, when the network
enters the solution through an ansatz (Lagaris, Likas & Fotiadis, IEEE Trans. Neural Netw. 9,
1998; Sukumar & Srivastava, CMAME 389, 2022)

.. math::

    u_c(x) = g_c(x) + b_c(x)\, N_c(x),

with a *lift* :math:`g` that takes the prescribed values on the constrained part of the
boundary and a *factor* :math:`b` that vanishes there (a distance-like function). The loss
then holds the PDE residual only.

:class:`Ansatz` wraps the network and a lift function ``lift(x) -> (g, b)`` (both
``(N, k)`` for points ``(N, d)``, free of parameters). Its :meth:`Ansatz.forward` works on
batches and single points like :class:`~deepsolve.pinn.FNN`, so ``torch.func`` and autograd
derivatives apply to it; its :meth:`Ansatz.taylor` lets :func:`deepsolve.pinn.jet` with
``backend="taylor"`` keep the one-pass derivatives of the network: the lift's value,
gradient and second derivatives come from ``torch.func`` (forward over forward, on the lift
only, which holds no parameters), the network's from its own ``taylor``, joined by the
product rule

.. math::

    \partial_i u = \partial_i g + \partial_i b\, N + b\, \partial_i N, \qquad
    \partial_{ij} u = \partial_{ij} g + \partial_{ij} b\, N + \partial_i b\, \partial_j N
        + \partial_j b\, \partial_i N + b\, \partial_{ij} N .

The tests compare :meth:`Ansatz.taylor` with ``torch.func`` derivatives of the whole ansatz
to round-off.

A symmetry of the solution is a constraint of the same kind. :class:`Symmetric` makes any
network even or odd under the reflection :math:`R` of one coordinate about a plane,
:math:`(Rx)_a = 2c - x_a`,

.. math::

    N_\pm(x) = \tfrac12\big(N(x) \pm N(Rx)\big),\qquad N_\pm(Rx) = \pm N_\pm(x),

one pass of the network over the points and their mirror images. Its derivatives follow from
the network's by the chain rule: :math:`\partial_a` of :math:`N(Rx)` changes sign, a second
derivative :math:`\partial_{ij}` changes sign when exactly one of :math:`i, j` is :math:`a`.
The residual of an equation that keeps the symmetry (Burgers' equation with an odd initial
condition: :math:`u_t`, :math:`u u_x`, :math:`u_{xx}` are all odd) then has a definite parity
too, and collocation points on one side of the plane carry the whole loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .derivatives import jet

__all__ = ["Ansatz", "Symmetric", "transfinite"]

Lift = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LiftJet = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class Ansatz(torch.nn.Module):
    r""":math:`u = g(x) + b(x) \odot N(x)`: ``net`` maps points ``(N, d)`` to ``(N, k)``
    (or ``(N,)`` for a scalar network, ``scalar=True`` on an :class:`~deepsolve.pinn.FNN`);
    ``lift(x)`` returns the lift ``g`` and the factor ``b``, each ``(N, k)`` (``(N,)`` for a
    scalar network), without parameters. ``forward`` also takes one point ``(d,)`` (for
    ``torch.func``). The network's parameters are the ansatz's (``net.`` prefix in the
    state dict)."""

    def __init__(self, net: torch.nn.Module, lift: Lift):
        super().__init__()
        if not callable(lift):
            raise TypeError(f"Ansatz: lift must be a function x -> (g, b), got "
                            f"{type(lift).__name__}")
        self.net = net
        self.lift = lift
        self.scalar = bool(getattr(net, "scalar", False))
        self._cached: tuple[torch.Tensor, int, list, tuple] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, b = self.lift(x)
        return g + b * self.net(x)

    @torch.compiler.disable
    def lift_jet(self, x: torch.Tensor, order: int = 2,
                 pairs: Sequence[tuple[int, int]] = ()) -> LiftJet:
        """Value, Jacobian and the ``pairs`` of second derivatives of the stacked
        ``(g, b)``: ``(N, 2, k)``, ``(N, 2, k, d)``, ``(N, 2, k, P)`` (``None`` for
        ``order=1``). The lift holds no parameters and a PINN evaluates it at the same points
        again and again, so the last result is kept and reused for points equal to the last
        ones (compared exactly). ``torch.compile`` cannot trace the nested ``torch.func``
        transforms, so this runs eagerly: under ``torch.compile`` compute it outside the
        compiled function and pass it to :meth:`taylor` (``lift=``)."""
        x = x.detach()
        pairs = [(int(i), int(j)) for i, j in pairs] if order == 2 else []
        c = self._cached
        if (c is not None and c[1] == order and c[2] == pairs and c[0].shape == x.shape
                and c[0].dtype == x.dtype and c[0].device == x.device
                and torch.equal(c[0], x)):
            return c[3]
        out = self._lift_jet_uncached(x, order, pairs)
        self._cached = (x.clone(), order, list(pairs), out)  # a copy: x may change in place
        return out

    def _lift_jet_uncached(self, x: torch.Tensor, order: int, pairs: list[tuple[int, int]]):
        def gb(p):
            g, b = self.lift(p)
            return torch.stack([g, b]).reshape(-1)                    # (2k,)

        j = jet(gb, x, 2 if order == 2 and pairs else 1, backend="func",
                hessian_pairs=pairs if order == 2 and pairs else None)
        n = x.shape[0]
        val = j.value.reshape(n, 2, -1)
        jac = j.jacobian.reshape(n, 2, -1, x.shape[1])
        hess = None if j.hessian is None else j.hessian.reshape(n, 2, -1, len(pairs))
        return val, jac, hess

    def taylor(self, x: torch.Tensor, order: int = 2,
               pairs: Sequence[tuple[int, int]] = (), *,
               lift: LiftJet | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None]:
        """Value ``(N, k)``, Jacobian ``(N, k, d)`` and second derivatives ``(N, k, P)`` for
        each pair (``None`` for ``order=1``), as :meth:`deepsolve.pinn.FNN.taylor` returns
        them; needs a network with a ``taylor`` method (an ``FNN``). ``lift``: the result of
        :meth:`lift_jet` for the same points, order and pairs (computed here otherwise)."""
        taylor = getattr(self.net, "taylor", None)
        if taylor is None:
            raise ValueError(f"Ansatz.taylor needs a network with a taylor() method (an FNN), "
                             f"got {type(self.net).__name__}; use backend='func' or 'autograd'")
        pairs = [(int(i), int(j)) for i, j in pairs] if order == 2 else []
        n, jn, hn = taylor(x, order, pairs)                 # (N, k), (N, k, d), (N, k, P)
        val, jac, hess = self.lift_jet(x, order, pairs) if lift is None else lift
        if val.shape[0] != x.shape[0] or jac.shape[-1] != x.shape[1] or (
                order == 2 and pairs and (hess is None or hess.shape[-1] != len(pairs))):
            raise ValueError(f"Ansatz.taylor: lift= does not match the points, order and "
                             f"pairs (lift values {tuple(val.shape)}, points "
                             f"{tuple(x.shape)}, {len(pairs)} pairs); pass "
                             f"lift_jet(x, order, pairs)")
        g, b = val[:, 0], val[:, 1]
        jg, jb = jac[:, 0], jac[:, 1]
        value = g + b * n
        jacobian = jg + jb * n.unsqueeze(-1) + b.unsqueeze(-1) * jn
        if order == 1:
            return value, jacobian, None
        if not pairs:
            return value, jacobian, n.new_zeros(n.shape + (0,))
        assert hess is not None and hn is not None
        hg, hb = hess[:, 0], hess[:, 1]
        ii = [i for i, _ in pairs]
        jj = [j for _, j in pairs]
        second = (hg + hb * n.unsqueeze(-1) + jb[..., ii] * jn[..., jj]
                  + jb[..., jj] * jn[..., ii] + b.unsqueeze(-1) * hn)
        return value, jacobian, second

    def extra_repr(self) -> str:
        return f"lift={getattr(self.lift, '__name__', type(self.lift).__name__)}"


class Symmetric(torch.nn.Module):
    r""":math:`\tfrac12(N(x) + \text{parity}\,N(Rx))`, even (``parity=1``) or odd
    (``parity=-1``) under the reflection of coordinate ``axis`` about ``center``
    (:math:`(Rx)_a = 2c - x_a`); the module docstring. ``net`` maps points ``(N, d)`` to
    ``(N, k)`` or ``(N,)``; ``forward`` also takes one point ``(d,)`` (for ``torch.func``),
    :meth:`taylor` needs a network with a ``taylor`` method (an ``FNN``). With ``parity=-1``
    a constant in :math:`N` cancels: the network's output bias gets a zero gradient and
    stays where it starts."""

    def __init__(self, net: torch.nn.Module, axis: int = 0, parity: int = -1,
                 center: float = 0.0):
        super().__init__()
        if parity not in (1, -1):
            raise ValueError(f"Symmetric: parity must be 1 (even) or -1 (odd), got {parity!r}")
        if int(axis) < 0:
            raise ValueError(f"Symmetric: axis must be a coordinate index >= 0, got {axis}")
        self.net = net
        self.axis, self.parity, self.center = int(axis), int(parity), float(center)
        self.scalar = bool(getattr(net, "scalar", False))

    def mirror(self, x: torch.Tensor) -> torch.Tensor:
        """The reflected points :math:`Rx`, same shape as ``x``."""
        if x.shape[-1] <= self.axis:
            raise ValueError(f"Symmetric: points have {x.shape[-1]} coordinates, the "
                             f"reflection is of coordinate {self.axis}")
        a = x[..., self.axis:self.axis + 1]
        return torch.cat([x[..., :self.axis], 2 * self.center - a, x[..., self.axis + 1:]], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:  # one point (torch.func)
            y = self.net(torch.stack([x, self.mirror(x)]))
            return 0.5 * (y[0] + self.parity * y[1])
        n = x.shape[0]
        y = self.net(torch.cat([x, self.mirror(x)]))
        return 0.5 * (y[:n] + self.parity * y[n:])

    def taylor(self, x: torch.Tensor, order: int = 2,
               pairs: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor | None]:
        """Value ``(N, k)``, Jacobian ``(N, k, d)`` and second derivatives ``(N, k, P)`` for
        each pair (``None`` for ``order=1``), as :meth:`deepsolve.pinn.FNN.taylor` returns
        them: one Taylor pass over the points and their mirror images."""
        taylor = getattr(self.net, "taylor", None)
        if taylor is None:
            raise ValueError(f"Symmetric.taylor needs a network with a taylor() method (an "
                             f"FNN), got {type(self.net).__name__}; use backend='func' or "
                             f"'autograd'")
        pairs = [(int(i), int(j)) for i, j in pairs] if order == 2 else []
        n, a, p = x.shape[0], self.axis, float(self.parity)
        v, jac, hess = taylor(torch.cat([x, self.mirror(x)]), order, pairs)
        flip = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        flip[a] = -1.0
        value = 0.5 * (v[:n] + p * v[n:])
        jacobian = 0.5 * (jac[:n] + p * jac[n:] * flip)
        if hess is None:
            return value, jacobian, None
        sign = torch.tensor([(-1.0) ** ((i == a) + (j == a)) for i, j in pairs],
                            dtype=x.dtype, device=x.device)
        return value, jacobian, 0.5 * (hess[:n] + p * hess[n:] * sign)

    def extra_repr(self) -> str:
        kind = "odd" if self.parity < 0 else "even"
        return f"{kind} in coordinate {self.axis} about {self.center}"


def transfinite(f: Callable[[torch.Tensor], torch.Tensor], lo: Sequence[float],
                hi: Sequence[float]) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""The transfinite (Coons) interpolant of boundary values on the rectangle
    ``[lo0, hi0] × [lo1, hi1]``: with :math:`\xi, \eta \in [0, 1]` the scaled coordinates,

    .. math::

        g = (1 - \xi) f(x_0, y) + \xi f(x_1, y) + (1 - \eta) f(x, y_0) + \eta f(x, y_1)
            - \sum_{\text{corners}} w\, f(\text{corner}),

    the corner weights bilinear (:math:`(1 - \xi)(1 - \eta)` at :math:`(x_0, y_0)`, ...).
    It equals ``f`` on all four edges (Gordon & Hall, Int. J. Numer. Meth. Eng. 7, 1973) and
    calls ``f`` only at boundary points, so an ansatz built on it uses the boundary data
    alone. ``f`` maps points ``(..., 2)`` to ``(..., k)``; so does the result."""
    if len(lo) != 2 or len(hi) != 2 or not (hi[0] > lo[0] and hi[1] > lo[1]):
        raise ValueError(f"transfinite: lo and hi must be 2 numbers each with lo < hi, got "
                         f"{lo}, {hi}")
    x0, y0 = float(lo[0]), float(lo[1])
    x1, y1 = float(hi[0]), float(hi[1])

    def g(p: torch.Tensor) -> torch.Tensor:
        x, y = p[..., 0], p[..., 1]
        xi = ((x - x0) / (x1 - x0)).unsqueeze(-1)
        eta = ((y - y0) / (y1 - y0)).unsqueeze(-1)

        def at(a, b):
            a = torch.full_like(y, a) if isinstance(a, float) else a
            b = torch.full_like(x, b) if isinstance(b, float) else b
            return f(torch.stack([a, b], -1))

        edges = ((1 - xi) * at(x0, y) + xi * at(x1, y)
                 + (1 - eta) * at(x, y0) + eta * at(x, y1))
        corners = ((1 - xi) * (1 - eta) * at(x0, y0) + xi * (1 - eta) * at(x1, y0)
                   + (1 - xi) * eta * at(x0, y1) + xi * eta * at(x1, y1))
        return edges - corners

    return g
