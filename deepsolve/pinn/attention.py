r"""Pointwise residual weights: residual-based attention (RBA) and its variational form (vRBA).

A PINN's residual loss :math:`\frac1N\sum_i r_i^2` weighs every collocation point alike, so
a few points where the residual stays large (a shock, a front) barely move it.
Residual-based attention keeps one weight :math:`\lambda_i` per point and minimises

.. math::

    \mathcal L_r = \frac1N \sum_i (\lambda_i\, r_i)^2,

updating the weights between optimiser steps from the residuals (not by gradient):

.. math::

    \rho_i = \frac{|r_i|}{\max_j |r_j|},\qquad
    q_i = \frac{\Phi'(\rho_i/\epsilon)}{\max_j \Phi'(\rho_j/\epsilon)},\qquad
    \lambda_i \leftarrow \gamma\,\lambda_i + \eta\, q_i ,

from :math:`\lambda_i = 1`; the weights tend to :math:`\eta\, q_i / (1-\gamma)` where the
residuals settle (10 for the defaults). The potential :math:`\Phi` sets what the weights aim
at (Toscano, Chen, Oommen, Darbon & Karniadakis, "A variational framework for residual-based
adaptivity in neural PDE solvers and operator learning", arXiv:2509.14198, 2025): the
weighted loss is an estimate of the primal objective under the tilted distribution
:math:`q \propto \Phi'(r/\epsilon)`.

* ``"linear"`` — :math:`\Phi(r) = r^2/2`, :math:`q_i = \rho_i`: the mean-square error; the
  update of RBA (Anagnostopoulos, Toscano, Stergiopulos & Karniadakis, "Residual-based
  attention in physics-informed neural networks", CMAME 421, 116805, 2024), whose
  :math:`\gamma = 0.999`, :math:`\eta = 0.01` are the defaults here.
* ``"exponential"`` — :math:`\Phi(r) = e^r`, :math:`q_i = \exp((\rho_i - 1)/\epsilon)`: a
  softmax of the residuals at temperature :math:`\epsilon` (relative to the largest
  residual), which aims at the uniform (maximum) error; a smaller :math:`\epsilon`
  concentrates the weight on fewer points.

The weights are detached: they are data, not parameters, so the loss the optimiser sees is
an ordinary least-squares loss in the network's parameters between two updates, and every
optimiser applies (Adam, L-BFGS, the quasi-Newton methods of :mod:`.quasi_newton`, the
Gauss–Newton of :mod:`.gauss_newton`, whose Jacobian is then that of :math:`\lambda_i r_i`).
They *ride along with the points*: :meth:`ResidualAttention.attach` appends them as the last
column of the points ``(N, d) -> (N, d + 1)``, and :meth:`ResidualAttention.weighted` turns
a residual function of ``(n, d)`` points into one of ``(n, d + 1)`` points that returns
:math:`\lambda_i r_i`. Chunked residuals (:class:`.ChunkedResidual`) and Jacobians
(:class:`.LeastSquaresTerm`) split points and weights together. A new collocation set
(resampling, RAD, RAR) starts its weights again at 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["ResidualAttention", "POTENTIALS"]

POTENTIALS = ("linear", "exponential")


class ResidualAttention:
    """Pointwise residual weights, updated from the residuals (see the module docstring).

    Args:
        potential: ``"linear"`` (RBA, the mean-square error) or ``"exponential"`` (vRBA's
            uniform-error tilt).
        gamma: memory of the update, in ``[0, 1)``.
        eta: step of the update, ``> 0``.
        temperature: :math:`\\epsilon` of ``"exponential"``, relative to the largest
            residual, ``> 0``.
    """

    def __init__(self, potential: str = "linear", gamma: float = 0.999, eta: float = 0.01,
                 temperature: float = 0.1):
        if potential not in POTENTIALS:
            raise ValueError(f"ResidualAttention: potential={potential!r} is not one of "
                             f"{', '.join(POTENTIALS)}")
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"ResidualAttention: gamma={gamma} must be in [0, 1)")
        if not (eta > 0 and math.isfinite(eta)):
            raise ValueError(f"ResidualAttention: eta={eta} must be a finite number > 0")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"ResidualAttention: temperature={temperature} must be a finite "
                             "number > 0")
        self.potential, self.gamma, self.eta = potential, float(gamma), float(eta)
        self.temperature = float(temperature)
        self.points: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None
        self.updates = 0
        self.iteration: int | None = None   # the trainer iteration of the last update

    def _follow(self, x: torch.Tensor) -> torch.Tensor:
        """The weights of points ``x``: the current ones if ``x`` is the set they belong to,
        else ones (a new set)."""
        same = (self.points is not None and self.points.shape == x.shape
                and self.points.dtype == x.dtype and self.points.device == x.device
                and (self.points is x or bool(torch.equal(self.points, x.detach()))))
        if not same or self.weights is None:
            self.points = x.detach()
            self.weights = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
            self.updates = 0
        assert self.weights is not None
        return self.weights

    def tilt(self, residual: torch.Tensor) -> torch.Tensor:
        """:math:`q`, ``(N,)``, from residuals ``(N,)`` or ``(N, k)`` (a point's residual is
        then the norm of its ``k`` components), scaled to a largest value of 1."""
        r = residual.detach()
        a = r.abs() if r.dim() == 1 else r.reshape(r.shape[0], -1).norm(dim=1)
        top = a.max() if a.numel() else a.new_zeros(())
        if not bool(top > 0) or not bool(torch.isfinite(top)):
            return torch.ones_like(a)
        rho = a / top
        if self.potential == "linear":
            return rho
        return torch.exp((rho - 1.0) / self.temperature)

    def update(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """One update of the weights of points ``x`` ``(N, d)`` from their residuals;
        returns the new weights ``(N,)``."""
        w = self._follow(x)
        if residual.shape[0] != x.shape[0]:
            raise ValueError(f"ResidualAttention.update: {residual.shape[0]} residuals for "
                             f"{x.shape[0]} points")
        self.weights = self.gamma * w + self.eta * self.tilt(residual).to(w.dtype)
        self.updates += 1
        return self.weights

    def update_from(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                    chunk_size: int | None = None) -> torch.Tensor:
        """Evaluate ``fn`` (the unweighted residual of ``(n, d)`` points) on ``x`` in chunks,
        keeping no graph, and :meth:`update` from it."""
        parts = []
        for xc in x.detach().split(int(chunk_size or max(x.shape[0], 1))):
            with torch.enable_grad():   # derivatives in x need autograd
                parts.append(fn(xc).detach())
        r = torch.cat(parts) if parts else x.new_zeros(0)
        return self.update(x, r)

    def step(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             iteration: int, every: int = 1, chunk_size: int | None = None) -> torch.Tensor:
        """Update the weights of ``x`` from ``fn`` once in trainer iteration ``iteration``
        when ``iteration % every == 0`` (an optimiser with a line search evaluates the loss
        several times per iteration: the first call updates, the others see the same
        weights), and return the weighted points (:meth:`attach`)."""
        if self.iteration != iteration and every > 0 and iteration % every == 0:
            self.update_from(fn, x, chunk_size)
            self.iteration = iteration
        return self.attach(x)

    def attach(self, x: torch.Tensor) -> torch.Tensor:
        """The points ``(N, d)`` with their weights as the last column ``(N, d + 1)``."""
        w = self._follow(x)
        return torch.cat([x.detach(), w.unsqueeze(1).to(x.dtype)], 1)

    @staticmethod
    def weighted(fn: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``fn`` of ``(n, d)`` points as a function of ``(n, d + 1)`` points with weights
        (:meth:`attach`): :math:`\\lambda_i\\, r_i` (each component of a point's residual
        times its weight)."""
        def weighted_fn(p: torch.Tensor) -> torch.Tensor:
            r = fn(p[:, :-1])
            w = p[:, -1]
            return r * (w if r.dim() == 1 else w.reshape(-1, *([1] * (r.dim() - 1))))

        return weighted_fn

    def state_dict(self) -> dict:
        """The weights and the points they belong to (a restart file's)."""
        return {"points": self.points, "weights": self.weights, "updates": self.updates,
                "iteration": -1 if self.iteration is None else self.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.points, self.weights = state.get("points"), state.get("weights")
        self.updates = int(state.get("updates", 0))
        it = int(state.get("iteration", -1))
        self.iteration = None if it < 0 else it
