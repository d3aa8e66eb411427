r"""Physics-informed network for steady 2D Navier--Stokes: Kovasznay flow at Re = 20.

Physics
-------
The steady incompressible Navier--Stokes equations on
:math:`\Omega = [-0.5, 1] \times [-0.5, 1.5]`,

.. math::

    u u_x + v u_y + p_x - \tfrac{1}{Re}(u_{xx} + u_{yy}) = 0,\qquad
    u v_x + v v_y + p_y - \tfrac{1}{Re}(v_{xx} + v_{yy}) = 0,\qquad
    u_x + v_y = 0,

have Kovasznay's (1948) exact solution, with :math:`\lambda = \tfrac{Re}{2} -
\sqrt{\tfrac{Re^2}{4} + 4\pi^2}`:

.. math::

    u = 1 - e^{\lambda x}\cos 2\pi y,\qquad
    v = \tfrac{\lambda}{2\pi} e^{\lambda x}\sin 2\pi y,\qquad
    p = \tfrac12 (1 - e^{2\lambda x}).

The setting follows the DeepXDE example (``examples/pinn_forward/Kovasznay_flow.py``): the
exact :math:`u, v` are imposed on the whole boundary and :math:`p` on the outflow
:math:`x = 1` only (which fixes the pressure constant).

Model and loss
--------------
``ctx.model`` is a fully connected ``tanh`` network :math:`(x, y) \mapsto (u, v, p)` with
``depth`` hidden layers of ``width`` units (default 4×30, 2973 parameters, float64;
DeepXDE's example: 4×50; Glorot-normal weights, zero biases; :class:`deepsolve.pinn.FNN`).
The derivatives come from :func:`deepsolve.pinn.jet`
(``derivatives = "taylor"``: value, gradient and :math:`\partial_{xx}, \partial_{yy}` pushed
through the layers in one pass; ``"func"``: ``torch.func`` forward-over-forward;
``"autograd"``: ``torch.autograd.grad``). ``compile = true`` compiles the residual with
``torch.compile`` (fused kernels, about 2× faster per iteration on a CPU after ~30 s of
compilation). Loss terms (``residuals``), each a mean square:

* ``momentum_x``, ``momentum_y``, ``continuity`` — the three residuals at ``n_interior``
  interior points (1024 scrambled Sobol points by default, ``sampling``; DeepXDE: 2601),
  evaluated in chunks under ``residual_budget`` (or else the run's ``budget``) when one is
  set (:class:`deepsolve.pinn.ChunkedResidual`);
* ``bc_u``, ``bc_v`` — the misfit of :math:`u, v` at ``n_boundary`` boundary points;
* ``bc_p`` — the misfit of :math:`p` at the boundary points on the outflow :math:`x = 1`
  (the three ``bc_`` terms with ``constraints = "soft"`` only).

``constraints = "hard"`` wraps the network in the ansatz of :func:`boundary_lift`
(:class:`deepsolve.pinn.Ansatz`): :math:`u, v` are the transfinite interpolant of their
boundary values plus :math:`16\xi(1-\xi)\eta(1-\eta)` times the network, :math:`p` its outflow
value plus :math:`(1 - \xi)` times the network, so the boundary conditions hold exactly and
the loss holds the three PDE terms only; with ``compile = true`` the lift's derivatives are
computed eagerly (and cached) and enter the compiled residual as an input.

``weighting = "fixed"`` weighs all terms 1 (as DeepXDE does); ``"annealing"`` adapts the
boundary weights by learning-rate annealing during the Adam phase
(:mod:`deepsolve.pinn.weighting`). ``resample_every`` > 0 redraws the interior points during
the Adam phase; ``rar_every`` > 0 adds ``rar_add`` points of largest residual from a pool of
``rar_pool`` every that many Adam iterations.

Optimiser (``optimizer``): ``"ssbroyden"`` (default) — full-memory self-scaled Broyden in
float64 with a strong-Wolfe line search, ``qn_iters`` iterations per trainer iteration
(:class:`deepsolve.pinn.SelfScaledBroyden`; each search starts at ``qn_step_growth`` = 1.25
times the last accepted step, at most 1; a search the loss cannot resolve is followed by
one on the directional derivative, ``qn_approximate_wolfe``); ``"bfgs"`` (SSBFGS; plain
BFGS with ``self_scaled = false``); ``"gauss_newton"`` — Levenberg–Marquardt on the three residual
vectors of :meth:`KovasznayPINN.least_squares_terms` (:class:`deepsolve.pinn.GaussNewton`;
``gn_iters``, ``gn_damping``, ``jacobian_budget``); each after ``warmup`` Adam steps (default
none). ``"adam+lbfgs"`` (the earlier default): ``adam_iterations`` Adam steps (``lr``), then
L-BFGS (strong Wolfe), each trainer iteration one L-BFGS step of up to ``lbfgs_iters`` inner
iterations (:class:`deepsolve.pinn.AdamLBFGS`). ``iterations`` is the total number of
trainer iterations. From iteration ``switch_at`` on (-1: never) the run is in
``switch_dtype``: a run can start in float32 (fast for Adam) and cast model and data then
(:func:`deepsolve.pinn.switch_precision`, called by the optimizer between steps), because in
float32 a line search stalls at a loss of about 1e-5 (round-off in the residual). The
restart file records the switch.

Metrics (``evaluate``)
----------------------
``u_rel_l2``, ``v_rel_l2``, ``p_rel_l2``: relative L2 errors
:math:`\|f_\theta - f\|_2 / \|f\|_2` on a ``test_grid``² tensor grid of the domain (ends
included), and ``max_rel_l2``, the largest of the three. With ``weighting = "annealing"``
also ``weight_bc_u``, ``weight_bc_v``, ``weight_bc_p``.

Reference: DeepXDE's example reaches :math:`u`: 2.3e-4, :math:`v`: 1.1e-3, :math:`p`: 4.9e-4
after 30000 Adam and up to 15000 L-BFGS iterations; docs/pinn.md compares the two on the
same machine (``benchmarks/pinn_deepxde.py``). The defaults (hard boundary conditions,
SSBroyden, 1024 points, the derivative search) run with two threads of the 2-core CPU reach
:math:`u, v \le 10^{-9}` after about 10 minutes and :math:`u, v, p` of 1.8e-10, 9.1e-10,
9.0e-10 at the 15-minute limit; seeds 1 and 2 end at v 2.2e-9 and 1.1e-9 (docs/pinn.md,
"Beside the literature").
"""

from __future__ import annotations

import math

import torch

import deepsolve
from deepsolve.pinn import (
    FNN,
    SECOND_ORDER_SETTINGS,
    AdamLBFGSTraining,
    Ansatz,
    ChunkedResidual,
    Collocation,
    Jet,
    LeastSquaresTerm,
    Published,
    Rectangle,
    jet,
    make_weights,
    transfinite,
)

TERMS = ("momentum_x", "momentum_y", "continuity", "bc_u", "bc_v", "bc_p")
PDE_TERMS = ("momentum_x", "momentum_y", "continuity")
PAIRS = ((0, 0), (1, 1))  # the second derivatives the residuals use
METRICS = ("u_rel_l2", "v_rel_l2", "p_rel_l2", "max_rel_l2")


def kovasznay(xy: torch.Tensor, re: float) -> torch.Tensor:
    """Exact ``(u, v, p)`` at points ``(..., 2)``, shape ``(..., 3)``."""
    lam = re / 2 - math.sqrt(re**2 / 4 + 4 * math.pi**2)
    x, y = xy[..., 0], xy[..., 1]
    ex = torch.exp(lam * x)
    u = 1 - ex * torch.cos(2 * math.pi * y)
    v = lam / (2 * math.pi) * ex * torch.sin(2 * math.pi * y)
    p = 0.5 * (1 - torch.exp(2 * lam * x))
    return torch.stack((u, v, p), -1)


def boundary_lift(re: float, lo: tuple[float, float], hi: tuple[float, float]):
    r"""The lift and factor of the hard-constraint ansatz (:class:`deepsolve.pinn.Ansatz`):
    :math:`u, v` = their transfinite interpolant from the four edges
    (:func:`deepsolve.pinn.transfinite`, which reads the exact solution on the boundary only)
    plus :math:`16\,\xi(1 - \xi)\,\eta(1 - \eta)` times the network, :math:`p` = its
    outflow value :math:`p(x_1, y)` plus :math:`(1 - \xi)` times the network, with
    :math:`\xi, \eta \in [0, 1]` the scaled coordinates."""
    x0, y0 = lo
    x1, y1 = hi

    def exact(xy):
        return kovasznay(xy, re)

    coons = transfinite(exact, lo, hi)

    def lift(xy):
        x, y = xy[..., 0], xy[..., 1]
        xi, eta = (x - x0) / (x1 - x0), (y - y0) / (y1 - y0)
        bubble = 16 * xi * (1 - xi) * eta * (1 - eta)
        p_out = exact(torch.stack([torch.full_like(x, x1), y], -1))[..., 2]
        g = torch.cat([coons(xy)[..., :2], p_out.unsqueeze(-1)], -1)
        return g, torch.stack([bubble, bubble, 1 - xi], -1)

    return lift


def _hard(cfg) -> bool:
    """``True`` for ``constraints = "hard"``; a one-line error for anything but hard/soft."""
    name = str(cfg.constraints)
    if name not in ("soft", "hard"):
        raise ValueError(f"navier_stokes_pinn: constraints must be 'soft' or 'hard', got "
                         f"{name!r}")
    return name == "hard"


class KovasznayPINN(AdamLBFGSTraining, deepsolve.Problem):
    target_metric = "max_rel_l2"  # what --set target=LEVEL names
    published = (   # the best published results (benchmarks/pinn_table.py)
        Published("DeepXDE 1.15's Kovasznay example (Lu et al., SIAM Rev. 63, 2021), run "
                  "here by benchmarks/pinn_deepxde.py: no published error", "Adam 30000 + "
                  "L-BFGS, 4×50 MLP", "float32", "u 1.4e-4, v 6.9e-4", "99.9 min",
                  "this 2-core CPU, loaded"),
    )
    collocation_key = "interior"  # restart state: the interior set and the dtype of xb
    dtype_key = "xb"

    defaults = {
        # trainer
        "iterations": 5000,        # total trainer iterations (warm-up + second-order steps);
                                   # time_limit ends the run first on a 2-core CPU
        "time_limit": 15.0,        # minutes: whichever of the two comes first ends the run
        "lr": 1e-3,                # Adam learning rate
        "eval_every": 10,
        "checkpoint_every": 100,
        "dtype": "float64",        # precision of the run (of its first phase with switch_at)
        # optimiser
        "optimizer": "ssbroyden",  # "ssbroyden", "bfgs", "gauss_newton", "adam+lbfgs",
                                   # "adam" or "lbfgs"
        **SECOND_ORDER_SETTINGS,   # warmup, qn_iters, self_scaled, gn_iters, gn_damping,
                                   # jacobian_budget (deepsolve.pinn.SECOND_ORDER_SETTINGS)
        "qn_step_growth": 1.25,    # SSBroyden's searches start near the last step: 1.6x the
                                   # iterations late in the run (docs/pinn.md)
        "qn_approximate_wolfe": True,  # past the loss's round-off (about 1e-16), steps found
                                   # on the derivative (docs/pinn.md)
        "adam_iterations": 2000,   # "adam+lbfgs": Adam steps before L-BFGS takes over
        "lbfgs_iters": 50,         # L-BFGS inner iterations per trainer iteration
        "lbfgs_history": 50,
        "switch_at": -1,           # iteration from which the run is in switch_dtype (-1 never)
        "switch_dtype": "float64",
        # physics
        "re": 20.0,
        # network
        "width": 30,
        "depth": 4,
        "derivatives": "taylor",   # "taylor" (one pass), "func" (torch.func) or "autograd"
        "compile": True,           # torch.compile the residual
        # collocation
        "n_interior": 1024,        # 2^10 Sobol points, 3072 residuals for 2973 parameters:
                                   # twice the iterations of DeepXDE's 2601 (docs/pinn.md)
        "n_boundary": 400,
        "sampling": "sobol",       # "uniform", "sobol", "halton" or "lhs"
        "resample_every": 0,       # redraw the interior points (Adam phase only; 0 = never)
        "rar_every": 0,            # RAR every this many Adam iterations (0 = off)
        "rar_pool": 20000,
        "rar_add": 100,
        "residual_budget": "",     # e.g. "64MiB": chunk the residual ("" = the run's budget)
        # weighting
        "weighting": "fixed",      # "fixed" or "annealing"
        "anneal_alpha": 0.9,
        "anneal_every": 100,
        # evaluation
        "test_grid": 201,
        # boundary conditions
        "constraints": "hard",     # "hard": the ansatz of boundary_lift satisfies the
                                   # boundary conditions exactly; "soft": bc_u, bc_v, bc_p
                                   # loss terms (DeepXDE's setting)
    }

    lo, hi = (-0.5, -0.5), (1.0, 1.5)

    def build(self, ctx):
        cfg = ctx.cfg
        dtype, device = ctx.dtype, ctx.device
        geom = Rectangle(self.lo, self.hi)
        seed = int(cfg.seed)
        method = str(cfg.sampling)
        interior = Collocation(
            lambda n, s: geom.sample_interior(n, method, s, dtype, device),
            int(cfg.n_interior), resample_every=int(cfg.resample_every), seed=seed)
        xb = geom.sample_boundary(int(cfg.n_boundary), method, seed + 1, dtype, device)
        outflow = (xb[:, 0] - self.hi[0]).abs() < 1e-9
        net = FNN(2, 3, int(cfg.width), int(cfg.depth))
        hard = _hard(cfg)
        if hard:
            net = Ansatz(net, boundary_lift(float(cfg.re), self.lo, self.hi))
        ctx.model = net.to(device=device, dtype=dtype)
        test = geom.grid(int(cfg.test_grid), dtype=dtype, device=device)
        # weights adapt during Adam only: L-BFGS needs one fixed objective
        weights = make_weights(str(cfg.weighting),
                               {k: 1.0 for k in (PDE_TERMS if hard else TERMS)},
                               reference=PDE_TERMS, alpha=float(cfg.anneal_alpha),
                               every=int(cfg.anneal_every), until=self._adapt_until(ctx))
        ctx.data = {
            "geometry": geom,
            "interior": interior,
            "xb": xb,
            "ub": kovasznay(xb, float(cfg.re)),
            "outflow": outflow,
            "test": test,
            "test_exact": kovasznay(test, float(cfg.re)),
            "weights": weights,
            "residual": ChunkedResidual(self._pde_fn(ctx),
                                        params=list(ctx.model.parameters()),
                                        budget=str(cfg.residual_budget or cfg.budget)
                                        or None),
        }

    # physics ----------------------------------------------------------------------------
    def _pde_fn(self, ctx):
        def fn(x):
            return self.pde(ctx, x)

        if not bool(ctx.cfg.compile):
            return fn
        if not (_hard(ctx.cfg) and str(ctx.cfg.derivatives) == "taylor"):
            return torch.compile(fn)
        model = ctx.model

        def ansatz_fn(x, lift):
            value, jac, hess = model.taylor(x, 2, PAIRS, lift=lift)
            return self.equations(ctx, Jet(value, jac, hess[:, :2], (0, 1), None, PAIRS))

        compiled = torch.compile(ansatz_fn)

        def hard_fn(x):  # the lift's derivatives (eager, cached) go in as an input
            return compiled(x, model.lift_jet(x, 2, PAIRS))

        return hard_fn

    def pde(self, ctx, x, backend: str | None = None):
        """The three residuals at points ``x (N, 2)``: a dict of ``(N,)`` tensors."""
        return self.equations(ctx, jet(ctx.model, x, 2,
                                       backend=backend or str(ctx.cfg.derivatives),
                                       hessian_components=(0, 1), hessian_pairs=PAIRS))

    def equations(self, ctx, j):
        """The three residuals from the jet of ``(u, v, p)`` (second derivatives of ``u, v``
        along ``PAIRS``)."""
        u, v = j.value[:, 0], j.value[:, 1]
        u_x, u_y = j.jacobian[:, 0, 0], j.jacobian[:, 0, 1]
        v_x, v_y = j.jacobian[:, 1, 0], j.jacobian[:, 1, 1]
        p_x, p_y = j.jacobian[:, 2, 0], j.jacobian[:, 2, 1]
        nu = 1.0 / float(ctx.cfg.re)
        return {
            "momentum_x": u * u_x + v * u_y + p_x - nu * j.laplacian(0),
            "momentum_y": u * v_x + v * v_y + p_y - nu * j.laplacian(1),
            "continuity": u_x + v_y,
        }

    def _points(self, ctx, iteration):
        d, cfg = ctx.data, ctx.cfg
        coll = d["interior"]
        if (int(cfg.rar_every) > 0 and iteration > 0 and iteration % int(cfg.rar_every) == 0
                and self.adam_phase(ctx, iteration)):
            coll.refine(lambda x: self.pde(ctx, x), int(cfg.rar_pool), int(cfg.rar_add),
                        iteration=iteration)
        return coll.points(self.collocation_iteration(ctx, iteration)).to(d["xb"].dtype)

    def least_squares_terms(self, ctx, iteration):
        """The six loss terms as three residual vectors (for ``optimizer =
        "gauss_newton"``): the momentum and continuity residuals at the interior points,
        the ``u, v`` misfit on the boundary, the ``p`` misfit on the outflow; targets ride
        along as extra columns of the points."""
        d, w = ctx.data, ctx.data["weights"]

        def pde(x):
            r = self.pde(ctx, x, "func")
            return torch.stack([r[k] for k in PDE_TERMS], 1)

        def bc(p):
            return ctx.model(p[:, :2])[:, :2] - p[:, 2:]

        def bc_p(p):
            return ctx.model(p[:, :2])[:, 2] - p[:, 2]

        xb, ub, out = d["xb"], d["ub"], d["outflow"]
        interior = LeastSquaresTerm(pde, self._points(ctx, iteration),
                                    [float(w.get(k, 1.0)) for k in PDE_TERMS])
        if _hard(ctx.cfg):  # the boundary values hold exactly
            return [interior]
        return [
            interior,
            LeastSquaresTerm(bc, torch.cat([xb, ub[:, :2]], 1),
                             [float(w.get(k, 1.0)) for k in ("bc_u", "bc_v")]),
            LeastSquaresTerm(bc_p, torch.cat([xb[out], ub[out, 2:]], 1),
                             float(w.get("bc_p", 1.0))),
        ]

    def residuals(self, ctx, iteration):
        d = ctx.data
        x = self._points(ctx, iteration)
        terms = dict(d["residual"](x))
        if _hard(ctx.cfg):  # the boundary values hold exactly
            d["weights"].update_from(terms, ctx.model.parameters(), iteration)
            return terms
        pred = ctx.model(d["xb"])
        err = pred - d["ub"]
        terms["bc_u"] = err[:, 0].pow(2).mean()
        terms["bc_v"] = err[:, 1].pow(2).mean()
        terms["bc_p"] = err[d["outflow"], 2].pow(2).mean()
        d["weights"].update_from(terms, ctx.model.parameters(), iteration)
        return terms

    def evaluate(self, ctx):
        d = ctx.data
        pred = ctx.model(d["test"])
        exact = d["test_exact"]
        errs = ((pred - exact).norm(dim=0) / exact.norm(dim=0)).tolist()
        out = {"u_rel_l2": errs[0], "v_rel_l2": errs[1], "p_rel_l2": errs[2],
               "max_rel_l2": max(errs)}
        if str(ctx.cfg.weighting) == "annealing":
            for k in ("bc_u", "bc_v", "bc_p"):
                out[f"weight_{k}"] = float(d["weights"].get(k, 1.0))
        return out


problem = KovasznayPINN()
