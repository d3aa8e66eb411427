r"""Loss-term weights: fixed, or adapted by learning-rate annealing.

The trainer calls ``Problem.weights(ctx)`` once, keeps the mapping it returns and multiplies
each named loss term by ``weights.get(name, 1.0)`` at every iteration. A problem therefore
creates one weights object (a ``dict`` subclass) in ``build``, returns *that object* from
``weights(ctx)``, and calls ``update_from(terms, params, iteration)`` in ``residuals`` before
returning the terms: an adaptive scheme changes the mapping in place, and the trainer applies
the new weights from then on.

* ``"fixed"`` — :class:`FixedWeights`: the given weights, never changed.
* ``"annealing"`` — :class:`AnnealingWeights`, the learning-rate annealing of Wang, Teng &
  Perdikaris, "Understanding and mitigating gradient flow pathologies in physics-informed
  neural networks", SIAM J. Sci. Comput. 43(5), A3055–A3081 (2021), Algorithm 1: every
  ``every`` iterations

  .. math::

      \hat\lambda_i = \frac{\max_\theta |\nabla_\theta \mathcal{L}_r|}
                           {\overline{|\nabla_\theta \mathcal{L}_i|}},\qquad
      \lambda_i \leftarrow (1-\alpha)\,\lambda_i + \alpha\,\hat\lambda_i,

  where :math:`\mathcal{L}_r` is the (weighted) sum of the *reference* terms (the PDE
  residuals) and :math:`\mathcal{L}_i` each other term (boundary, initial, data),
  unweighted; the mean is over all parameters. The paper uses :math:`\alpha = 0.9`. Terms
  whose gradient vanishes keep their weight.

:func:`make_weights` picks one by name (a problem's ``weighting`` setting).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import torch

__all__ = ["Weights", "FixedWeights", "AnnealingWeights", "make_weights", "WEIGHTINGS"]


class Weights(dict):
    """A ``dict`` of term name → weight (what the trainer reads) with an ``update`` hook."""

    def update_from(self, terms: Mapping[str, torch.Tensor], params: Iterable[torch.Tensor],
                    iteration: int) -> bool:
        """Adapt the weights from the current terms; returns whether they changed."""
        return False

    def total(self, terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weighted sum of ``terms`` (what the trainer minimises)."""
        # sum() types its result `| Literal[0]` (the value for no terms)
        return cast(torch.Tensor,
                    sum(float(self.get(k, 1.0)) * v.reshape(()) for k, v in terms.items()))


class FixedWeights(Weights):
    """Weights that never change (missing names weigh 1)."""


class AnnealingWeights(Weights):
    """Learning-rate annealing (see the module docstring).

    Args:
        initial: starting weights (missing names weigh 1).
        reference: the names of the residual terms :math:`\\mathcal{L}_r` (not adapted).
        alpha: moving-average factor, 0.9 in the paper.
        every: update at iterations divisible by ``every``.
        until: no updates from this iteration on (e.g. where L-BFGS takes over; ``None`` =
            always).
        max_weight: clip the weights to ``[1/max_weight, max_weight]`` (guards against a
            term whose gradient is momentarily almost zero).
    """

    def __init__(self, initial: Mapping[str, float] | None = None,
                 reference: Sequence[str] = ("pde",), alpha: float = 0.9, every: int = 10,
                 until: int | None = None, max_weight: float = 1e6):
        super().__init__(initial or {})
        if not reference:
            raise ValueError("annealing needs at least one reference (residual) term")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.reference = tuple(reference)
        self.alpha = float(alpha)
        self.every = max(int(every), 1)
        self.until = until
        self.max_weight = float(max_weight)
        self.last: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []

    def _due(self, iteration: int) -> bool:
        if self.until is not None and iteration >= self.until:
            return False
        return iteration % self.every == 0 and iteration != self.last

    def update_from(self, terms: Mapping[str, torch.Tensor], params: Iterable[torch.Tensor],
                    iteration: int) -> bool:
        if not self._due(iteration):
            return False
        self.last = iteration
        params = [p for p in params if p.requires_grad]
        missing = [r for r in self.reference if r not in terms]
        if missing:
            raise KeyError(f"annealing reference terms {missing} are not among the loss terms "
                           f"{sorted(terms)}")
        ref = cast(torch.Tensor,
                   sum(float(self.get(r, 1.0)) * terms[r].reshape(()) for r in self.reference))
        g_ref = _grads(ref, params)
        if g_ref is None:
            return False
        top = g_ref.abs().max()
        changed = False
        for name, term in terms.items():
            if name in self.reference:
                continue
            g = _grads(term.reshape(()), params)
            if g is None:
                continue
            mean = g.abs().mean()
            if not (mean > 0 and torch.isfinite(mean)):
                continue
            hat = float(top / mean)
            new = (1 - self.alpha) * float(self.get(name, 1.0)) + self.alpha * hat
            self[name] = min(max(new, 1 / self.max_weight), self.max_weight)
            changed = True
        self.history.append((iteration, dict(self)))
        return changed


def _grads(y: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor | None:
    if not y.requires_grad:
        return None
    gs = torch.autograd.grad(y, params, retain_graph=True, allow_unused=True)
    flat = [g.reshape(-1) for g in gs if g is not None]
    return torch.cat(flat).detach() if flat else None


WEIGHTINGS = {"fixed": FixedWeights, "annealing": AnnealingWeights}


def make_weights(name: str, initial: Mapping[str, float] | None = None, *,
                 reference: Sequence[str] = ("pde",), alpha: float = 0.9, every: int = 10,
                 until: int | None = None) -> Weights:
    """``"fixed"`` or ``"annealing"`` weights (the other arguments only matter for
    annealing)."""
    key = str(name).lower()
    if key == "fixed":
        return FixedWeights(initial or {})
    if key == "annealing":
        return AnnealingWeights(initial, reference, alpha=alpha, every=every, until=until)
    raise ValueError(f"weighting must be one of {sorted(WEIGHTINGS)}, got {name!r}")
