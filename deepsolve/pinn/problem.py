r"""A PINN problem stated by its physics alone: :class:`PINNProblem`.

A problem file's class derives from :class:`PINNProblem` and :class:`deepsolve.Problem`
(``class MyPINN(PINNProblem, deepsolve.Problem)``: a mixin, like
:class:`~deepsolve.pinn.AdamLBFGSTraining`, so ``deepsolve.pinn`` stays below the problem
layer) and supplies four things; the class turns them
into the hooks the trainer calls (``build``, ``residuals``, ``evaluate``, the optimisers of
:class:`~deepsolve.pinn.AdamLBFGSTraining` and, for Gauss–Newton, ``least_squares_terms``):

* ``sample(ctx, n, seed)`` — ``n`` interior (collocation) points ``(n, d)``; the default
  draws from ``domain(cfg)`` (a :class:`~deepsolve.pinn.Box`, :class:`~deepsolve.pinn.Rectangle`
  or any object with ``sample_interior(n, method, seed, dtype, device)``) by ``sampling``;
* ``pde(ctx, x, backend)`` — the residual of the equations at points ``x`` ``(n, d)``: an
  ``(n,)`` tensor (the loss term ``pde``) or a dict of them, one loss term per equation.
  Derivatives come from :func:`~deepsolve.pinn.jet` with the given ``backend`` (the
  ``derivatives`` setting in training; ``"func"`` when Gauss–Newton needs
  ``torch.func``-traceable residuals);
* ``conditions(ctx)`` — the other loss terms: a dict ``name → (fn, points)`` with ``fn``
  mapping fixed points ``(m, d')`` to residuals ``(m,)`` or ``(m, k)`` (boundary, initial or
  data misfits; a target rides along as extra columns of the points). Default: none (hard
  constraints, ``network``);
* ``reference(ctx)`` — held-out points ``(M, d)`` and the reference solution there
  ``(M, C)``, one column per name in ``components``: exact, or computed by a verified solver.

and optionally ``network(ctx)`` (default: a ``tanh`` :class:`~deepsolve.pinn.FNN` of
``depth × width`` from ``inputs`` to ``outputs`` with inputs mapped from the box ``lo, hi``;
override to wrap it in hard constraints or to add unknown coefficients), ``solution(ctx, x)``
(the ``(M, C)`` components the reference gives; default the network's output) and
``extra_metrics(ctx)`` (an inverse problem's recovered coefficients).

Loss. A term ``k`` with residual :math:`r_k` on its :math:`m_k` points is
:math:`L_k = \frac1{m_k}\sum_i \|r_k(x_i)\|^2` (the squares of a point's components summed),
weighted by the setting ``weight_<k>`` if the problem has one, else ``loss_weights[k]``
(default 1): :math:`L = \sum_k w_k L_k`. The same terms, as
:class:`~deepsolve.pinn.LeastSquaresTerm` residual vectors, are what Gauss–Newton minimises,
so both paths see one objective. The ``pde`` points are redrawn by RAD every ``rad_every``
iterations (:meth:`~deepsolve.pinn.Collocation.redistribute`; Wu et al., CMAME 403, 2023) and
chunked under ``residual_budget`` (or else the run's ``budget``).

Metrics. ``<c>_rel_l2`` :math:`= \|\hat f_c - f_c\|_2 / \|f_c\|_2` over the reference
points for each component ``c``, and ``max_rel_l2``, the largest; ``target_metric`` (what
``--set target=LEVEL`` names) is ``<c>_rel_l2`` with one component, else ``max_rel_l2``.

``published`` lists the best published results for the problem (:class:`Published`);
``benchmarks/pinn_table.py`` prints them beside deepsolve's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .chunked import ChunkedResidual
from .gauss_newton import LeastSquaresTerm
from .networks import FNN
from .sampling import Collocation
from .training import ATTENTION_SETTINGS, SECOND_ORDER_SETTINGS, AdamLBFGSTraining
from .weighting import make_weights

__all__ = ["PINNProblem", "Published", "PINN_SETTINGS", "Condition"]

Condition = tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]
"""``(fn, points)``: a loss term's residual function and its fixed points."""


class Published(NamedTuple):
    """One published result: who, how, and what it reached (as published)."""

    source: str       # authors, venue, year (arXiv number)
    method: str       # optimiser, network, tricks
    precision: str    # "float32", "float64"
    error: str        # the relative L2 error as published, e.g. "1.1e-8"
    time: str = "—"   # training time as published
    hardware: str = "—"


PINN_SETTINGS: dict[str, Any] = {
    # trainer
    "iterations": 1000,        # total trainer iterations (warm-up + second-order steps)
    "time_limit": 15.0,        # minutes: whichever of the two comes first ends the run
    "lr": 1e-3,                # Adam learning rate (warm-up, "adam+lbfgs", "adam")
    "eval_every": 10,
    "checkpoint_every": 100,
    "dtype": "float64",        # precision of the run (of its first phase with switch_at)
    # optimiser
    "optimizer": "ssbroyden",  # "ssbroyden", "bfgs", "gauss_newton", "adam+lbfgs", "adam",
                               # "lbfgs"
    **SECOND_ORDER_SETTINGS,   # warmup, qn_iters, self_scaled, gn_iters, gn_damping, ...
    "adam_iterations": 1000,   # "adam+lbfgs": Adam steps before L-BFGS
    "lbfgs_iters": 50,         # L-BFGS inner iterations per trainer iteration
    "lbfgs_history": 50,
    "switch_at": -1,           # iteration from which the run is in switch_dtype (-1 never)
    "switch_dtype": "float64",
    # network
    "width": 30,
    "depth": 3,
    "activation": "tanh",
    "derivatives": "autograd",  # "autograd", "func" (torch.func) or "taylor" (bare FNN only)
    # points
    "n_collocation": 4000,     # interior points of the pde terms
    "sampling": "sobol",       # "uniform", "sobol", "halton" or "lhs"
    "rad_every": 25,           # RAD: redraw the set from the residual every this many (0 off)
    "rad_pool": 40000,
    "rad_k": 1.0,
    "rad_c": 1.0,
    "residual_budget": "",     # e.g. "64MiB": chunk the residual ("" = the run's budget)
    **ATTENTION_SETTINGS,      # pointwise weights on the pde term: "", "linear", "exponential"
}
"""The settings every :class:`PINNProblem` has, with their defaults; a problem's
``defaults`` is ``{**PINN_SETTINGS, ...its own...}``."""


class PINNProblem(AdamLBFGSTraining):
    """Mixin of a PINN problem file's class, before :class:`deepsolve.Problem` (module
    docstring).

    Class attributes:
        inputs, outputs: the network's input and output sizes.
        lo, hi: the input box (the network maps it onto ``[-1, 1]^inputs``).
        components: names of the columns of ``reference``/``solution`` (metrics
            ``<name>_rel_l2``).
        loss_weights: weight per loss term (default 1).
        published: the best published results (:class:`Published`).
    """

    inputs: int = 2
    outputs: int = 1
    lo: tuple[float, ...] = (-1.0, -1.0)
    hi: tuple[float, ...] = (1.0, 1.0)
    components: tuple[str, ...] = ("u",)
    loss_weights: Mapping[str, float] = {}
    published: tuple[Published, ...] = ()
    defaults = PINN_SETTINGS
    dtype_key = "test"

    # ---- what a problem supplies ---------------------------------------------------------

    def domain(self, cfg) -> Any:
        """The interior's geometry (default: the box ``lo, hi``)."""
        from .geometry import Box

        return Box(self.lo, self.hi)

    def sample(self, ctx: Any, n: int, seed: int) -> torch.Tensor:
        """``n`` interior points ``(n, inputs)`` (default: ``domain`` by ``sampling``)."""
        return self.domain(ctx.cfg).sample_interior(n, str(ctx.cfg.sampling), seed,
                                                    ctx.dtype, ctx.device)

    def pde(self, ctx: Any, x: torch.Tensor, backend: str
            ) -> torch.Tensor | dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__}.pde(ctx, x, backend) must return "
                                  "the equations' residuals at x")

    def conditions(self, ctx: Any) -> dict[str, Condition]:
        return {}

    def reference(self, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__}.reference(ctx) must return the "
                                  "test points and the reference solution there")

    def network(self, ctx: Any) -> torch.nn.Module:
        cfg = ctx.cfg
        return FNN(self.inputs, self.outputs, int(cfg.width), int(cfg.depth),
                   str(cfg.activation), lo=self.lo, hi=self.hi, scalar=self.outputs == 1)

    def solution(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """The components the reference gives, ``(M, C)``, at points ``x``."""
        assert ctx.model is not None, "build() creates the model"
        return ctx.model(x).reshape(x.shape[0], -1)

    def extra_metrics(self, ctx: Any) -> dict[str, float]:
        return {}

    def choice(self, cfg, key: str, allowed: tuple[str, ...]) -> str:
        """The setting ``key``, refused in one line unless it is one of ``allowed``."""
        value = str(getattr(cfg, key))
        if value not in allowed:
            raise ValueError(f"{type(self).__name__}: {key} must be one of {allowed}, got "
                             f"{value!r}")
        return value

    # ---- the trainer's hooks -------------------------------------------------------------

    @property
    def target_metric(self) -> str:  # what --set target=LEVEL names
        return f"{self.components[0]}_rel_l2" if len(self.components) == 1 else "max_rel_l2"

    def build(self, ctx: Any) -> None:
        cfg = ctx.cfg
        ctx.model = self.network(ctx).to(device=ctx.device, dtype=ctx.dtype)
        coll = Collocation(lambda n, s: self.sample(ctx, n, s), int(cfg.n_collocation),
                           seed=int(cfg.seed))
        test, exact = self.reference(ctx)
        if exact.dim() != 2 or exact.shape != (test.shape[0], len(self.components)):
            raise ValueError(f"{type(self).__name__}.reference: the solution must be (M, "
                             f"{len(self.components)}) for {test.shape[0]} points and the "
                             f"components {self.components}, got {tuple(exact.shape)}")
        ctx.data = {"collocation": coll,
                    "test": test.to(device=ctx.device, dtype=ctx.dtype),
                    "test_exact": exact.to(device=ctx.device, dtype=ctx.dtype),
                    "attention": self.make_attention(cfg)}
        conds = self.conditions(ctx)
        for name, (_, pts) in conds.items():
            ctx.data[f"points_{name}"] = pts.to(device=ctx.device, dtype=ctx.dtype)
        ctx.data["conditions"] = {name: fn for name, (fn, _) in conds.items()}
        budget = str(cfg.residual_budget or cfg.budget) or None
        ctx.data["residual"] = ChunkedResidual(self._pde_fn(ctx, str(cfg.derivatives)),
                                               params=list(ctx.model.parameters()),
                                               budget=budget)
        names = list(self.equations(ctx)) + list(conds)
        ctx.data["weights"] = make_weights("fixed", {k: self.loss_weight(cfg, k)
                                                     for k in names})

    def loss_weight(self, cfg, name: str) -> float:
        """The weight of loss term ``name``: the setting ``weight_<name>`` when the problem
        has one, else ``loss_weights[name]``, else 1."""
        value = getattr(cfg, f"weight_{name}", None)
        w = float(self.loss_weights.get(name, 1.0) if value is None else value)
        if not (w >= 0 and w < float("inf")):
            raise ValueError(f"{type(self).__name__}: the weight of loss term {name!r} must "
                             f"be finite and >= 0, got {w}")
        return w

    def equations(self, ctx: Any) -> tuple[str, ...]:
        """The names of the pde terms (one for a tensor residual: ``pde``)."""
        with torch.enable_grad():
            r = self.pde(ctx, ctx.data["test"][:2], str(ctx.cfg.derivatives))
        return tuple(r) if isinstance(r, Mapping) else ("pde",)

    def _pde_fn(self, ctx: Any, backend: str):
        def fn(x):
            return self.pde(ctx, x, backend)

        return _weighted(fn) if str(ctx.cfg.attention) else fn

    def _points(self, ctx: Any, iteration: int) -> torch.Tensor:
        cfg, coll = ctx.cfg, ctx.data["collocation"]
        every = int(cfg.rad_every)
        if every > 0 and iteration > 0 and iteration % every == 0:
            coll.redistribute(lambda x: self.pde(ctx, x, str(cfg.derivatives)),
                              int(cfg.rad_pool), iteration, k=float(cfg.rad_k),
                              c=float(cfg.rad_c))
        x = coll.points(iteration).to(ctx.data["test"].dtype)
        return self.attend(ctx, iteration, x,
                           lambda p: _stacked(self.pde(ctx, p, str(cfg.derivatives))))

    def residuals(self, ctx: Any, iteration: int) -> dict[str, torch.Tensor]:
        d = ctx.data
        out = d["residual"](self._points(ctx, iteration))
        terms = dict(out) if isinstance(out, Mapping) else {"pde": out}
        for name, fn in d["conditions"].items():
            r = fn(d[f"points_{name}"])
            terms[name] = r.pow(2).reshape(r.shape[0], -1).sum(1).mean()
        return terms

    def least_squares_terms(self, ctx: Any, iteration: int) -> list[LeastSquaresTerm]:
        """The loss as residual vectors (Gauss–Newton): the equations stacked as the
        components of one term at the collocation points, one term per condition."""
        d, w = ctx.data, ctx.data["weights"]
        eqs = self.equations(ctx)
        pde = self._pde_fn(ctx, "func")
        weights = [float(w.get(k, 1.0)) for k in eqs]
        terms = [LeastSquaresTerm(lambda x: _stacked(pde(x)), self._points(ctx, iteration),
                                  weights if len(eqs) > 1 else weights[0])]
        for name, fn in d["conditions"].items():
            terms.append(LeastSquaresTerm(fn, d[f"points_{name}"], float(w.get(name, 1.0))))
        return terms

    def evaluate(self, ctx: Any) -> dict[str, float]:
        d = ctx.data
        exact = d["test_exact"]
        pred = self.solution(ctx, d["test"]).reshape(exact.shape)
        errs = ((pred - exact).norm(dim=0) / exact.norm(dim=0)).tolist()
        out = {f"{c}_rel_l2": e for c, e in zip(self.components, errs, strict=True)}
        if len(errs) > 1:
            out["max_rel_l2"] = max(errs)
        out.update(self.extra_metrics(ctx))
        return out


def _stacked(r: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A dict of ``(n,)`` residuals as ``(n, k)``; a tensor as it is."""
    return torch.stack(list(r.values()), 1) if isinstance(r, Mapping) else r


def _weighted(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``fn`` of points ``(n, d)`` as a function of points with their attention weights
    ``(n, d + 1)``: each equation's residual times the point's weight
    (:meth:`~deepsolve.pinn.ResidualAttention.weighted`, per equation of a dict)."""

    def weighted_fn(p: torch.Tensor):
        r, w = fn(p[:, :-1]), p[:, -1]
        return {k: v * w for k, v in r.items()} if isinstance(r, Mapping) else r * w

    return weighted_fn
