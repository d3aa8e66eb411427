r"""Causal training of time-dependent PINNs: residuals weighted by what came before in time.

A PINN for an evolution equation minimises the residual at all times at once, and may fit
late times with a wrong solution before the early times (which determine them) are right.
Wang, Sankaran & Perdikaris, "Respecting causality is all you need for training
physics-informed neural networks", Comput. Methods Appl. Mech. Engrg. 421, 116813 (2024),
arXiv:2203.07404, split the time interval into :math:`M` slices
:math:`t_1 < \dots < t_M` and weight the mean squared residual :math:`\mathcal{L}_i` of
slice :math:`i` by how well all earlier slices are resolved:

.. math::

    w_1 = 1,\qquad w_i = \exp\Big(-\varepsilon \sum_{k=1}^{i-1} \mathcal{L}_k\Big),\qquad
    \mathcal{L}_r = \frac1M \sum_{i=1}^{M} w_i\, \mathcal{L}_i ,

with the weights computed *without* gradient (the gradient is
:math:`\frac1M \sum_i w_i \nabla_\theta \mathcal{L}_i` for fixed :math:`w`). The weights are
non-increasing in :math:`i`; slice :math:`i` only gets weight once the slices before it are
fitted. The *causality parameter* :math:`\varepsilon` sets how strictly: the paper raises it
through a list (e.g. :math:`10^{-2}, 10^{-1}, 1, 10, 100`) whenever
:math:`\min_i w_i > \delta = 0.99`, i.e. when the residual is small at every time for the
current :math:`\varepsilon`.

* :func:`causal_weights`, :func:`causal_loss` — the formula, on squared residuals laid out
  as ``(M, N)`` (slice, point) or on per-slice means ``(M,)``.
* :class:`CausalWeighting` — the loss with the :math:`\varepsilon` schedule, for a problem's
  ``residuals``: it advances at most once per trainer iteration and, with
  ``freeze=True``, keeps one iteration's weights for every evaluation of that iteration (an
  L-BFGS step then minimises one fixed objective). It records the last weights
  (``min_weight``) and its state goes into restart files (``state_dict``).
* :func:`slice_mse` — the per-slice mean squared residuals ``(M,)`` of such a point set,
  optionally in chunks recomputed in the backward pass (a memory budget, as
  :class:`~deepsolve.pinn.ChunkedResidual` does for a plain mean);
* :func:`sample_time_slices` — collocation points as ``M`` time slices × ``N`` points:
  space coordinates from :func:`deepsolve.pinn.unit_samples` (uniform or quasi-random), time
  stratified, uniform within each slice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .chunked import chunked_sum
from .geometry import unit_samples

__all__ = ["causal_weights", "causal_loss", "CausalWeighting", "sample_time_slices",
           "slice_mse", "PAPER_EPS"]

#: The causality parameters of Wang, Sankaran & Perdikaris (2024), raised in this order.
PAPER_EPS: tuple[float, ...] = (1e-2, 1e-1, 1.0, 10.0, 100.0)


def _check_eps(eps: float) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"causal eps must be a number, got {eps!r}") from None
    if not (math.isfinite(e) and e >= 0):
        raise ValueError(f"causal eps must be finite and >= 0, got {eps!r}")
    return e


def _slice_losses(residual_sq: torch.Tensor) -> torch.Tensor:
    """Per-slice mean squares ``(M,)`` from ``(M, N)`` squared residuals (or ``(M,)`` as
    is)."""
    if not isinstance(residual_sq, torch.Tensor):
        raise ValueError(f"causal loss needs a tensor, got {type(residual_sq).__name__}")
    if residual_sq.dim() == 2 and residual_sq.shape[0] >= 1 and residual_sq.shape[1] >= 1:
        return residual_sq.mean(dim=1)
    if residual_sq.dim() == 1 and residual_sq.shape[0] >= 1:
        return residual_sq
    raise ValueError(f"causal loss needs squared residuals (M, N) or per-slice means (M,) with "
                     f"M, N >= 1, got shape {tuple(residual_sq.shape)}")


def causal_weights(slice_losses: torch.Tensor, eps: float) -> torch.Tensor:
    r"""The causal weights :math:`w_i = \exp(-\varepsilon \sum_{k<i} \mathcal{L}_k)`, ``(M,)``,
    of per-slice mean squared residuals ``slice_losses (M,)`` (or of squared residuals
    ``(M, N)``, averaged over each row first); detached (no gradient flows
    through them), in the dtype of the losses. ``w[0] == 1``; non-increasing for
    non-negative losses."""
    e = _check_eps(eps)
    losses = _slice_losses(slice_losses).detach()
    before = torch.cumsum(losses, 0) - losses  # sum over k < i (exclusive prefix sum)
    return torch.exp(-e * before.clamp_min(0))


def causal_loss(residual_sq: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Causally weighted residual loss :math:`\frac1M \sum_i w_i \mathcal{L}_i` (module
    docstring; Wang, Sankaran & Perdikaris 2024).

    Args:
        residual_sq: squared residuals ``(M, N)`` — row ``i`` the ``N`` points of time slice
            ``i``, slices in increasing time — or per-slice mean squares ``(M,)``.
        eps: the causality parameter :math:`\varepsilon \ge 0` (0: plain mean over slices).

    Returns:
        ``(loss, weights)``: the scalar loss (differentiable through the residuals, with the
        weights held fixed) and the detached weights ``(M,)``.
    """
    losses = _slice_losses(residual_sq)
    w = causal_weights(losses, eps)
    return (w * losses).mean(), w


class CausalWeighting:
    r"""The causal residual loss with the :math:`\varepsilon` schedule of the paper.

    ``loss = cw(residual_sq, iteration)`` returns :math:`\frac1M \sum_i w_i \mathcal{L}_i`
    (:func:`causal_loss`) for the current :math:`\varepsilon`. When a call brings a new
    ``iteration`` and the last weights had :math:`\min_i w_i >` ``threshold``,
    :math:`\varepsilon` first moves to the next value of ``eps`` (at most one step per
    iteration; the last value stays). With ``freeze=True`` the weights of an iteration's first
    call are reused by its later calls (an L-BFGS step's line search: one fixed objective);
    ``freeze=False`` recomputes them every call, as the paper does. Without ``iteration``
    every call recomputes the weights and nothing advances; call :meth:`advance` yourself.

    Args:
        eps: one causality parameter or the increasing list to go through (default
            :data:`PAPER_EPS`).
        threshold: :math:`\delta`, advance when :math:`\min_i w_i` exceeds it (0.99 in the
            paper).
        freeze: keep the weights fixed within an iteration.

    Attributes:
        weights: the last weights ``(M,)`` (``None`` before the first call).
        slice_losses: the last per-slice mean squares ``(M,)``, detached.
        history: ``(iteration, eps)`` for every advance.
    """

    def __init__(self, eps: float | Sequence[float] = PAPER_EPS, threshold: float = 0.99,
                 freeze: bool = False):
        values = [eps] if isinstance(eps, (int, float)) else list(eps)
        if not values:
            raise ValueError("causal eps schedule is empty; give at least one value")
        self.eps_values = tuple(_check_eps(e) for e in values)
        if any(b < a for a, b in zip(self.eps_values[:-1], self.eps_values[1:], strict=True)):
            raise ValueError(f"causal eps schedule must be non-decreasing, got "
                             f"{list(self.eps_values)}")
        th = float(threshold)
        if not 0 < th <= 1:
            raise ValueError(f"causal threshold must be in (0, 1], got {threshold!r}")
        self.threshold = th
        self.freeze = bool(freeze)
        self.index = 0
        self.weights: torch.Tensor | None = None
        self.slice_losses: torch.Tensor | None = None
        self.history: list[tuple[int, float]] = []
        self._iteration: int | None = None

    @property
    def eps(self) -> float:
        """The current causality parameter."""
        return self.eps_values[self.index]

    @property
    def min_weight(self) -> float:
        """:math:`\\min_i w_i` of the last call (``nan`` before the first)."""
        return math.nan if self.weights is None else float(self.weights.min())

    @property
    def done(self) -> bool:
        """The last ``eps`` is active and its minimum weight is above the threshold (the
        paper's stopping criterion)."""
        return self.index == len(self.eps_values) - 1 and self.min_weight > self.threshold

    def advance(self, iteration: int | None = None) -> bool:
        """Move to the next ``eps`` if the last weights allow it; returns whether it moved."""
        if self.index + 1 >= len(self.eps_values) or not self.min_weight > self.threshold:
            return False
        self.index += 1
        self.history.append((-1 if iteration is None else int(iteration), self.eps))
        self.weights = None  # the old eps's weights say nothing about the new one
        return True

    def __call__(self, residual_sq: torch.Tensor, iteration: int | None = None) -> torch.Tensor:
        losses = _slice_losses(residual_sq)
        same = iteration is not None and iteration == self._iteration
        if not same:
            if iteration is not None:
                self.advance(iteration)
            self._iteration = None if iteration is None else int(iteration)
        if not (same and self.freeze and self.weights is not None
                and self.weights.shape == losses.shape):
            self.weights = causal_weights(losses, self.eps)
        self.slice_losses = losses.detach()
        w = self.weights.to(losses)
        return (w * losses).mean()

    def state_dict(self) -> dict[str, Any]:
        """``index``, the last iteration and weights: what a restart needs to continue
        with the same :math:`\\varepsilon` and the same advance decision."""
        return {"index": self.index,
                "iteration": -1 if self._iteration is None else self._iteration,
                "weights": self.weights if self.weights is not None else torch.zeros(0),
                "history": [[i, e] for i, e in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        index = int(state["index"])
        if not 0 <= index < len(self.eps_values):
            raise ValueError(f"causal state has eps index {index}, but the schedule has "
                             f"{len(self.eps_values)} values")
        self.index = index
        it = int(state.get("iteration", -1))
        self._iteration = None if it < 0 else it
        w = state.get("weights")
        self.weights = w if isinstance(w, torch.Tensor) and w.numel() else None
        self.history = [(int(i), float(e)) for i, e in state.get("history", [])]


def sample_time_slices(n_slices: int, n_points: int, lo: Sequence[float], hi: Sequence[float],
                       t0: float, t1: float, method: str = "uniform", seed: int | None = 0,
                       dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    r"""Collocation points ``(M, N, d + 1)`` of ``(x..., t)`` laid out by time slice.

    Slice ``i`` (``0 <= i < M``) holds ``N`` points with :math:`x` in the box ``[lo, hi]``
    and :math:`t \in [t_0 + i\Delta, t_0 + (i+1)\Delta)`, :math:`\Delta = (t_1 - t_0)/M`;
    all ``M·N`` points come from one :func:`~deepsolve.pinn.unit_samples` draw of
    ``method`` (``"uniform"``, ``"sobol"``, ``"halton"``, ``"lhs"``) with ``seed``, the
    time coordinate stretched into the slice. ``reshape(M * N, d + 1)`` gives the flat set;
    a residual computed on it ``reshape(M, N)`` is what :func:`causal_loss` takes."""
    m, n = int(n_slices), int(n_points)
    if m < 1 or n < 1:
        raise ValueError(f"need at least one slice and one point per slice, got "
                         f"n_slices={n_slices}, n_points={n_points}")
    lo_t, hi_t = [float(v) for v in lo], [float(v) for v in hi]
    if (len(lo_t) != len(hi_t) or not lo_t
            or any(not h > l for l, h in zip(lo_t, hi_t, strict=True))):
        raise ValueError(f"lo and hi must be the same positive length with lo < hi, got "
                         f"{lo}, {hi}")
    if not float(t1) > float(t0):
        raise ValueError(f"need t0 < t1, got {t0}, {t1}")
    d = len(lo_t)
    u = torch.as_tensor(unit_samples(m * n, d + 1, method, seed), dtype=torch.float64)
    u = u.reshape(m, n, d + 1)
    lo_x = torch.tensor(lo_t, dtype=torch.float64)
    span = torch.tensor(hi_t, dtype=torch.float64) - lo_x
    x = lo_x + u[..., :d] * span
    dt = (float(t1) - float(t0)) / m
    t = float(t0) + (torch.arange(m, dtype=torch.float64)[:, None] + u[..., d]) * dt
    pts = torch.cat([x, t[..., None]], -1)
    return pts.to(dtype=dtype or torch.get_default_dtype(), device=device)


def slice_mse(residual_fn, x: torch.Tensor, n_slices: int, chunk_size: int | None = None,
              params=None) -> torch.Tensor:
    r"""Per-slice mean squared residuals :math:`\mathcal{L}_i`, ``(M,)``, of points ``x``
    ``(M N, d)`` laid out slice by slice (``sample_time_slices(...).reshape(-1, d)``):
    :math:`\mathcal{L}_i = \frac{1}{N c}\sum_{p \in i} |r(x_p)|^2` for a residual of ``c``
    components (``residual_fn(x)`` returns ``(n,)`` or ``(n, c)``).

    With ``chunk_size`` smaller than ``M N`` the points are evaluated in chunks whose graphs
    are recomputed in the backward pass (:func:`~deepsolve.pinn.chunked_sum`; ``params``
    required: the tensors requiring grad that ``residual_fn`` uses), so memory follows the
    chunk, not the set; values and gradients equal the unchunked ones. Chunks need not align
    with slices: each point carries its slice index."""
    n, m = x.shape[0], int(n_slices)
    if m < 1 or n % m:
        raise ValueError(f"slice_mse: {n} points do not split into {n_slices} equal slices")
    per = n // m

    def sq(r: torch.Tensor) -> torch.Tensor:  # (n,) mean square over components
        return r.reshape(r.shape[0], -1).pow(2).mean(1)

    if chunk_size is None or chunk_size >= n:
        return sq(residual_fn(x)).reshape(m, per).mean(1)
    index = (torch.arange(n, device=x.device) // per).to(x.dtype)[:, None]

    def fn(xc: torch.Tensor) -> torch.Tensor:  # this chunk's share of every slice's mean
        s = xc[:, -1].detach().long()
        r2 = sq(residual_fn(xc[:, :-1]))
        return torch.zeros(m, dtype=r2.dtype, device=r2.device).index_add(0, s, r2) / per

    return chunked_sum(fn, torch.cat([x, index], 1), chunk_size, params=params)
