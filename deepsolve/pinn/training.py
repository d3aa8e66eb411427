r"""The optimiser plumbing that PINN problem files share: Adam → L-BFGS and the
second-order methods.

:class:`AdamLBFGSTraining` is a mixin for a problem class (``class MyPINN(AdamLBFGSTraining,
deepsolve.Problem)``). It supplies, from the problem's settings, the hooks the trainer calls:

* ``optimizer`` — for ``optimizer`` = ``"adam+lbfgs"`` (Adam for ``adam_iterations`` steps
  at ``lr``, then L-BFGS with ``lbfgs_iters`` inner iterations and ``lbfgs_history`` pairs),
  ``"adam"`` or ``"lbfgs"`` an :class:`~deepsolve.pinn.AdamLBFGS`; for ``"ssbroyden"``,
  ``"bfgs"`` (``self_scaled``; ``qn_iters`` iterations a step) and ``"gauss_newton"``
  (``gn_iters``, ``gn_damping``, ``jacobian_budget``, ``gn_sketch``, ``gn_sketch_params``;
  the problem's
  :meth:`~AdamLBFGSTraining.least_squares_terms`) an :class:`~deepsolve.pinn.AdamWarmup`
  of ``warmup`` Adam steps around :class:`~deepsolve.pinn.SelfScaledBroyden` or
  :class:`~deepsolve.pinn.GaussNewton`. The ``on_step`` hook of both is
  :meth:`~AdamLBFGSTraining.on_step`;
* ``on_step`` — from iteration ``switch_at`` (``-1``: never) on, model and data are in
  ``switch_dtype`` (:func:`~deepsolve.pinn.switch_precision`); returns whether the L-BFGS
  memory must be reset. Override it to reset on other changes of the objective;
* ``weights`` — ``ctx.data["weights"]`` (a :class:`~deepsolve.pinn.Weights`);
* ``attend`` — pointwise residual weights (RBA / vRBA, :mod:`.attention`) from the
  ``attention`` settings (:data:`ATTENTION_SETTINGS`, :meth:`make_attention`);
* ``state_dict`` / ``load_state_dict`` — the weights, the attention weights, the collocation set
  (``ctx.data[collocation_key]``, RAR points included) and the run's precision (the dtype of
  ``ctx.data[dtype_key]``), restored before the trainer loads model and optimiser.

and two helpers for ``residuals``: :meth:`~AdamLBFGSTraining.adam_phase` and
:meth:`~AdamLBFGSTraining.collocation_iteration` (L-BFGS keeps the last Adam point set, so it
minimises one fixed objective; the second-order methods may take new sets). It reads only
``ctx.cfg``, ``ctx.data`` and ``ctx.model``.
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import ResidualAttention
from .gauss_newton import GaussNewton, LeastSquaresTerm
from .optim import AdamLBFGS, AdamWarmup, switch_precision
from .quasi_newton import SelfScaledBroyden

__all__ = ["AdamLBFGSTraining", "OPTIMIZERS", "SECOND_ORDER", "SECOND_ORDER_SETTINGS",
           "ATTENTION_SETTINGS"]

OPTIMIZERS = ("adam+lbfgs", "adam", "lbfgs", "ssbroyden", "bfgs", "gauss_newton")
"""The values of the ``optimizer`` setting."""

SECOND_ORDER = ("ssbroyden", "bfgs", "gauss_newton")
"""The optimizers that follow an optional Adam warm-up of ``warmup`` steps."""

SECOND_ORDER_SETTINGS: dict[str, Any] = {
    "warmup": 0,               # Adam steps before a second-order optimizer
    "gn_iters": 1,             # Gauss-Newton iterations per trainer iteration
    "gn_damping": 1e-3,        # initial Levenberg-Marquardt damping (relative)
    "jacobian_budget": "",     # e.g. "64MiB": Jacobian chunk size ("" = the run's budget)
    "gn_sketch": 0.0,          # Gauss-Newton curvature from this many points (a fraction < 1
                               # or a count; 0 = all): GaussNewton(sketch=...)
    "gn_sketch_params": 0.0,   # a step moves this many parameters (fraction or count; 0 = all)
    "qn_iters": 20,            # SSBroyden/BFGS iterations per trainer iteration
    "qn_step_growth": 0.0,     # a search starts at min(1, this x the last step); 0: at 1
                               # (SelfScaledBroyden(step_growth=...))
    "qn_approximate_wolfe": False,  # a failed search is followed by one on the derivative
                               # alone (SelfScaledBroyden(approximate_wolfe=...))
    "self_scaled": True,       # "bfgs": self-scaled (SSBFGS) or plain BFGS
}
"""The settings the second-order optimizers read, with their defaults: a problem class puts
``**SECOND_ORDER_SETTINGS`` in its ``defaults`` (and may override any of them)."""

ATTENTION_SETTINGS: dict[str, Any] = {
    "attention": "",           # pointwise residual weights: "" (off), "linear" (RBA) or
                               # "exponential" (vRBA); deepsolve.pinn.ResidualAttention
    "attention_gamma": 0.999,  # memory of the weights' update
    "attention_eta": 0.01,     # step of the weights' update
    "attention_temperature": 0.1,  # "exponential": softmax temperature (relative residual)
    "attention_every": 1,      # trainer iterations between updates
}
"""The settings of pointwise residual weights (:mod:`.attention`), with their defaults; a
problem puts ``**ATTENTION_SETTINGS`` in its ``defaults`` and calls :meth:`AdamLBFGSTraining
.attend` on its residual's points."""


class AdamLBFGSTraining:
    """Mixin: Adam then L-BFGS, a precision switch and restart state for a PINN problem (see
    the module docstring for the settings it reads).

    Attributes:
        collocation_key: the ``ctx.data`` key of the :class:`~deepsolve.pinn.Collocation` set
            whose state goes into restart files (``None``: none).
        dtype_key: the ``ctx.data`` key of a tensor in the run's current precision.
    """

    collocation_key: str | None = "collocation"
    dtype_key: str = "test"

    def _optimizer_name(self, ctx) -> str:
        name = str(ctx.cfg.optimizer).lower()
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZERS))}, "
                             f"got {ctx.cfg.optimizer!r}")
        return name

    @staticmethod
    def _setting(ctx, key: str) -> Any:
        """``ctx.cfg``'s value of a second-order setting, or its default."""
        return getattr(ctx.cfg, key, SECOND_ORDER_SETTINGS[key])

    def lbfgs_start(self, ctx) -> int:
        """The first iteration after Adam: ``adam_iterations`` for ``"adam+lbfgs"``, 0 for
        ``"lbfgs"``, ``warmup`` (default 0) for the second-order optimizers, never for
        ``"adam"`` (reported as a huge number)."""
        name = self._optimizer_name(ctx)
        if name in SECOND_ORDER:
            return int(self._setting(ctx, "warmup"))
        return {"adam+lbfgs": int(ctx.cfg.adam_iterations), "lbfgs": 0}.get(name, 2**62)

    def _adapt_until(self, ctx) -> int | None:
        """Until which iteration annealed weights may adapt: the end of the Adam phase (the
        second-order methods need one fixed objective); ``None`` (always) for ``"adam"``."""
        return None if self._optimizer_name(ctx) == "adam" else self.lbfgs_start(ctx)

    def adam_phase(self, ctx, iteration: int) -> bool:
        """Whether ``iteration`` is an Adam step."""
        return iteration < self.lbfgs_start(ctx)

    def collocation_iteration(self, ctx, iteration: int) -> int:
        """The iteration whose collocation set ``iteration`` uses: its own during Adam and
        the second-order methods (Gauss–Newton builds its curvature at every step; the
        quasi-Newton matrix is carried across a redrawn set, as Urbán et al. 2025 do with
        RAD), the last Adam set during L-BFGS (one fixed objective)."""
        if self.adam_phase(ctx, iteration) or self._optimizer_name(ctx) in SECOND_ORDER:
            return iteration
        return max(self.lbfgs_start(ctx) - 1, 0)

    def switch_precision_at(self, ctx, iteration: int) -> bool:
        """From ``switch_at`` on, model and data in ``switch_dtype``; whether it switched now."""
        at = int(ctx.cfg.switch_at)
        if at < 0 or iteration < at:
            return False
        return switch_precision(ctx.model, ctx.data, getattr(torch, str(ctx.cfg.switch_dtype)))

    def on_step(self, ctx, iteration: int) -> bool:
        """Called by the optimiser before every step; ``True`` resets the L-BFGS memory."""
        return self.switch_precision_at(ctx, iteration)

    def least_squares_terms(self, ctx, iteration: int) -> list[LeastSquaresTerm]:
        """The loss as :class:`~deepsolve.pinn.LeastSquaresTerm` residuals for
        ``optimizer = "gauss_newton"``: one per term of ``residuals`` with the same weight
        (``weight * mean(fn(points)**2)`` must equal the term's value). Problems that offer
        Gauss–Newton override this."""
        raise ValueError(f"{type(self).__name__}: optimizer='gauss_newton' needs the problem "
                         "to define least_squares_terms(ctx, iteration); use 'ssbroyden', "
                         "'bfgs' or 'adam+lbfgs'")

    def optimizer(self, ctx, params):
        cfg = ctx.cfg
        name = self._optimizer_name(ctx)
        if name not in SECOND_ORDER:
            return AdamLBFGS(params, switch_at=self.lbfgs_start(ctx), adam_lr=float(cfg.lr),
                             max_iter=int(cfg.lbfgs_iters),
                             history_size=int(cfg.lbfgs_history),
                             on_step=lambda k: self.on_step(ctx, k))
        params = list(params)
        second: torch.optim.Optimizer
        outer: list[AdamWarmup] = []   # the iteration is the outer optimizer's step count
        if name == "gauss_newton":
            budget = str(self._setting(ctx, "jacobian_budget") or getattr(cfg, "budget", "")
                         or "")
            second = GaussNewton(
                params, ctx.model,
                lambda: self.least_squares_terms(ctx, outer[0].steps_taken),
                max_iter=int(self._setting(ctx, "gn_iters")),
                damping=float(self._setting(ctx, "gn_damping")),
                budget=budget or None,
                sketch=float(self._setting(ctx, "gn_sketch")) or None,
                sketch_params=float(self._setting(ctx, "gn_sketch_params")) or None,
                seed=int(getattr(cfg, "seed", 0)))
        else:
            second = SelfScaledBroyden(params, method="ssbroyden" if name == "ssbroyden"
                                       else "ssbfgs" if self._setting(ctx, "self_scaled")
                                       else "bfgs",
                                       max_iter=int(self._setting(ctx, "qn_iters")),
                                       step_growth=float(self._setting(ctx, "qn_step_growth"))
                                       or None,
                                       approximate_wolfe=bool(
                                           self._setting(ctx, "qn_approximate_wolfe")))
        outer.append(AdamWarmup(params, second, warmup=self.lbfgs_start(ctx),
                                adam_lr=float(cfg.lr), on_step=lambda k: self.on_step(ctx, k)))
        return outer[0]

    @staticmethod
    def make_attention(cfg) -> ResidualAttention | None:
        """The :class:`~deepsolve.pinn.ResidualAttention` the ``attention`` settings ask for
        (``None`` when off); a problem keeps it as ``ctx.data["attention"]``."""
        kind = str(getattr(cfg, "attention", "") or "")
        if not kind:
            return None
        return ResidualAttention(kind, float(cfg.attention_gamma), float(cfg.attention_eta),
                                 float(cfg.attention_temperature))

    def attend(self, ctx, iteration: int, x: torch.Tensor, fn,
               chunk_size: int | None = None) -> torch.Tensor:
        """The points ``x`` of the residual ``fn`` with their attention weights as a last
        column, updated once in ``iteration`` (every ``attention_every``); the residual
        then is ``ResidualAttention.weighted(fn)``. ``x`` itself when attention is off."""
        att = ctx.data.get("attention")
        if att is None:
            return x
        return att.step(fn, x, iteration, int(getattr(ctx.cfg, "attention_every", 1)),
                        chunk_size)

    def weights(self, ctx):
        return ctx.data["weights"]

    def state_dict(self, ctx) -> dict[str, Any]:
        """What a restart needs beyond the model and optimiser: the (annealed) weights, the
        collocation set (RAR points) and the precision the run is in."""
        d = ctx.data
        state = {"weights": dict(d["weights"]),
                 "dtype": str(d[self.dtype_key].dtype).removeprefix("torch.")}
        if self.collocation_key is not None:
            state["collocation"] = d[self.collocation_key].state_dict()
        if d.get("attention") is not None:
            state["attention"] = d["attention"].state_dict()
        return state

    def load_state_dict(self, ctx, state: dict[str, Any]) -> None:
        if "dtype" in state:  # before the trainer loads the model and the optimiser
            switch_precision(ctx.model, ctx.data, getattr(torch, state["dtype"]))
        ctx.data["weights"].update(state["weights"])
        if self.collocation_key is not None and "collocation" in state:
            ctx.data[self.collocation_key].load_state_dict(state["collocation"])
        if ctx.data.get("attention") is not None and "attention" in state:
            ctx.data["attention"].load_state_dict(state["attention"])
