r"""Physics-informed network for viscous Burgers on :math:`[-1, 1]` (Raissi et al. 2019).

Physics
-------
.. math::

    u_t + u u_x = \nu u_{xx},\quad x \in [-1, 1],\ t \in [0, 1],\qquad
    u(x, 0) = -\sin \pi x,\quad u(\pm 1, t) = 0,\qquad \nu = 0.01/\pi .

A steep front forms at :math:`x = 0` (slope about :math:`-150` at :math:`t \approx 0.4`).

Reference solution (Cole--Hopf)
-------------------------------
With :math:`u = -2\nu\,\varphi_x/\varphi` and :math:`\varphi_t = \nu\varphi_{xx}`,
:math:`\varphi(x, 0) = \exp(-\cos(\pi x)/(2\pi\nu))`. The initial condition is odd and
2-periodic, so the solution on the whole line is odd about :math:`x = 0` and :math:`x = \pm 1`
and satisfies the boundary conditions; the heat kernel gives (Basdevant et al., Comput.
Fluids 14, 1986)

.. math::

    u(x, t) = -\frac{\int \sin\pi(x - \eta)\, f(x - \eta)\, e^{-\eta^2/4\nu t}\, d\eta}
                    {\int f(x - \eta)\, e^{-\eta^2/4\nu t}\, d\eta},
    \qquad f(y) = e^{-\cos(\pi y)/(2\pi\nu)},

evaluated by Gauss--Hermite quadrature (:math:`\eta = 2\sqrt{\nu t}\,z`, ``quad_nodes``
nodes from :func:`scipy.special.roots_hermite`; exponents shifted by their maximum so nothing
overflows). :func:`cole_hopf` returns it on any points; with 200 nodes it agrees with 400
nodes to about 1e-12 on the evaluation grid. No file is downloaded.

Model and loss
--------------
``ctx.model``: a ``tanh`` network :math:`N(x, t)` with ``depth`` hidden layers of ``width``
units (default 4 × 20, 1341 parameters; Raissi: 8 × 20), inputs mapped to
:math:`[-1, 1]^2`. With ``constraints = "hard"`` (the default) the solution is the ansatz

.. math::

    u(x, t) = -\sin(\pi x) + t\,(1 - x^2)\,N(x, t)

(:class:`HardConstrained`; Lagaris et al. 1998), which equals the initial condition at
:math:`t = 0` and vanishes at :math:`x = \pm 1` for every network, so the only loss term is
the residual. With ``constraints = "soft"`` (Raissi's setting) :math:`u = N` and the initial
and boundary values are loss terms.

Symmetry (``symmetry``): the initial condition is odd in :math:`x` and Burgers' equation
keeps that parity, so :math:`u(-x, t) = -u(x, t)`. With ``symmetry = "odd"`` the network is
:math:`\tfrac12(N(x, t) - N(-x, t))` (:class:`deepsolve.pinn.Symmetric`): the network's
output is odd for any weights, the front stays at :math:`x = 0`, and the residual, odd too,
needs points on :math:`x \ge 0` only (the collocation domain and the RAD pool are
:math:`[0, 1] \times [0, 1]`). A network pass costs twice the plain one, so
``n_collocation`` points on the half domain cost what ``2 n_collocation`` points on the whole
one do, at the same density. Loss terms:

* ``pde`` — mean square of :math:`u_t + u u_x - \nu u_{xx}` at ``n_collocation`` points
  (Latin hypercube as in Raissi, ``sampling``; every ``rad_every`` iterations redrawn by RAD
  from ``rad_pool`` uniform candidates with probability :math:`\propto |r|^k/\overline{|r|^k}
  + c`, ``rad_k``, ``rad_c``: :meth:`deepsolve.pinn.Collocation.redistribute`), chunked
  under ``residual_budget`` (or else the run's ``budget``) when one is set;
* ``initial``, ``boundary`` (soft constraints only) — mean squared misfit of :math:`u` on the
  initial/boundary points of a random subset of ``n_data`` points (seeded) of Raissi's data
  locations: the 256 grid points at :math:`t = 0` and 100 times at each of :math:`x = \pm 1`.

Optimiser (``optimizer``): ``"ssbroyden"`` (default) — full-memory self-scaled Broyden in
float64 with a strong-Wolfe line search, ``qn_iters`` iterations per trainer iteration
(:class:`deepsolve.pinn.SelfScaledBroyden`; Urbán, Stefanou & Pons 2025, whose Burgers set-up
— a small network, RAD every 500 quasi-Newton iterations — this follows; each search starts
at ``qn_step_growth`` = 1.25 times the last accepted step, at most 1); ``"bfgs"``
(SSBFGS, or plain BFGS with ``self_scaled = false``); ``"gauss_newton"`` —
Levenberg–Marquardt on the residual vector (:class:`deepsolve.pinn.GaussNewton`,
:meth:`BurgersPINN.least_squares_terms`; ``gn_iters``, ``gn_damping``, the Jacobian chunked
under ``jacobian_budget`` or the run's ``budget``); each optionally after ``warmup`` Adam
steps. ``"adam+lbfgs"``: ``adam_iterations`` Adam steps, then L-BFGS (strong Wolfe,
``lbfgs_iters`` inner iterations per trainer iteration; :class:`deepsolve.pinn.AdamLBFGS`),
the run switching to ``switch_dtype`` at ``switch_at``. Raissi et al. used L-BFGS only
(``optimizer=lbfgs``).

Metrics (``evaluate``)
----------------------
``u_rel_l2`` — :math:`\|u_\theta - u\|_2 / \|u\|_2` on Raissi's evaluation grid (256 points
in :math:`x` × 100 times in :math:`[0, 0.99]`); ``u_max_error`` — the largest absolute error
there. Raissi et al. report 6.7e-4 (soft constraints, up to 50000 L-BFGS iterations). The
defaults reach ``u_rel_l2`` 8.8e-9 in 15 minutes on a 2-core CPU with two threads, 1.1e-8
with one beside another run (docs/pinn.md, "Burgers", lists the measured runs); with
``symmetry = "none"`` and 5000 points, 2.6e-7. The earlier defaults (8 × 20, Adam then
L-BFGS) reached 4.6e-4 after 24.7 min.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import roots_hermite

import deepsolve
from deepsolve.pinn import (
    ATTENTION_SETTINGS,
    FNN,
    SECOND_ORDER_SETTINGS,
    AdamLBFGSTraining,
    ChunkedResidual,
    Collocation,
    LeastSquaresTerm,
    Published,
    Rectangle,
    ResidualAttention,
    Symmetric,
    jet,
    make_weights,
)

TERMS = ("pde", "initial", "boundary")
METRICS = ("u_rel_l2", "u_max_error")
NU = 0.01 / math.pi


def cole_hopf(x, t, nu: float = NU, nodes: int = 200) -> np.ndarray:
    """Exact solution at points ``x``, ``t`` (broadcast numpy arrays), float64; see the
    module docstring."""
    x, t = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(t, dtype=np.float64))
    shape = x.shape
    x, t = x.ravel(), t.ravel()
    if (t < 0).any():
        raise ValueError("cole_hopf needs t >= 0")
    z, w = roots_hermite(int(nodes))
    out = -np.sin(np.pi * x)  # t = 0
    pos = t > 0
    for idx in np.array_split(np.flatnonzero(pos), max(1, int(pos.sum()) // 4096)):
        if idx.size == 0:
            continue
        y = x[idx, None] - 2.0 * np.sqrt(nu * t[idx, None]) * z[None, :]
        expo = -np.cos(np.pi * y) / (2 * np.pi * nu)
        weight = w[None, :] * np.exp(expo - expo.max(axis=1, keepdims=True))
        out[idx] = -(np.sin(np.pi * y) * weight).sum(1) / weight.sum(1)
    return out.reshape(shape)


def _switch(cfg, key: str, off: str, on: str) -> bool:
    """``True`` when setting ``key`` is ``on``, ``False`` for ``off``; a one-line error for
    anything else."""
    name = str(getattr(cfg, key))
    if name not in (off, on):
        raise ValueError(f"burgers_pinn: {key} must be {off!r} or {on!r}, got {name!r}")
    return name == on


def _constraints(cfg) -> bool:
    """``True`` for ``constraints = "hard"``."""
    return _switch(cfg, "constraints", "soft", "hard")


def _odd(cfg) -> bool:
    """``True`` for ``symmetry = "odd"``."""
    return _switch(cfg, "symmetry", "none", "odd")


class HardConstrained(torch.nn.Module):
    r""":math:`u(x, t) = -\sin(\pi x) + t\,(1 - x^2)\,N(x, t)`: equals the initial condition at
    :math:`t = 0` and vanishes at :math:`x = \pm 1` for any network :math:`N` (Lagaris et al.,
    IEEE Trans. Neural Netw. 9, 1998). Points ``(n, 2)`` of ``(x, t)`` to ``(n,)``."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        x, t = p[..., 0], p[..., 1]
        return -torch.sin(math.pi * x) + t * (1 - x * x) * self.net(p)


class BurgersPINN(AdamLBFGSTraining, deepsolve.Problem):
    target_metric = "u_rel_l2"  # what --set target=LEVEL names
    published = (   # the best published results (benchmarks/pinn_table.py)
        Published("Raissi, Perdikaris & Karniadakis, JCP 378 (2019)", "L-BFGS, 9×20 MLP",
                  "float32", "6.7e-4"),
        Published("Toscano et al., arXiv:2509.14198 (2025)", "vRBA + SSBroyden, 3×30 MLP",
                  "float64", "1.1e-8", "—", "GPU"),
        Published("DSGNAR (2026)", "doubly-sketched Gauss–Newton", "float64", "8e-14",
                  "346 s", "1× H100"),
        Published("DSGNAR (2026)", "doubly-sketched Gauss–Newton", "float32", "4.75e-7",
                  "< 10 s", "1× H100"),
    )
    defaults = {
        # trainer
        "iterations": 1200,        # total trainer iterations (warm-up + second-order steps)
        "time_limit": 15.0,        # minutes: whichever of the two comes first ends the run
        "lr": 1e-3,                # Adam learning rate (warm-up, "adam+lbfgs", "adam")
        "eval_every": 10,
        "checkpoint_every": 100,
        "dtype": "float64",        # precision of the run (of its first phase with switch_at)
        # optimiser
        "optimizer": "ssbroyden",  # "ssbroyden", "bfgs", "gauss_newton", "adam+lbfgs",
                                   # "adam" or "lbfgs"
        **SECOND_ORDER_SETTINGS,   # warmup, qn_iters, self_scaled, gn_iters, gn_damping,
                                   # jacobian_budget (deepsolve.pinn.SECOND_ORDER_SETTINGS)
        "qn_step_growth": 1.25,    # SSBroyden's searches start near the last step: 1.28x
                                   # the iterations in 15 min (docs/pinn.md)
        "adam_iterations": 1000,   # "adam+lbfgs": Adam steps before L-BFGS
        "lbfgs_iters": 50,         # L-BFGS inner iterations per trainer iteration
        "lbfgs_history": 50,
        "switch_at": -1,           # iteration from which the run is in switch_dtype (-1 never)
        "switch_dtype": "float64",
        # physics
        "nu": NU,
        # network
        "width": 20,
        "depth": 4,
        "constraints": "hard",     # "hard": exact ansatz; "soft": initial/boundary loss terms
        "symmetry": "odd",         # "odd": u odd in x by construction, points on x >= 0;
                                   # "none": the plain network on the whole domain
        "derivatives": "autograd",  # "autograd", "taylor" (one pass) or "func" (torch.func)
        "compile": False,          # torch.compile the residual (pays off with "taylor")
        # points
        "n_collocation": 3500,     # on x >= 0 with symmetry = "odd" (the whole domain else)
        "n_data": 100,             # initial + boundary points (Raissi's N_u)
        "sampling": "lhs",         # "uniform", "sobol", "halton" or "lhs"
        "resample_every": 0,       # Adam phase only
        "rar_every": 0,
        "rar_pool": 50000,
        "rar_add": 200,
        "rad_every": 25,           # RAD: redraw the set from the residual every this many (0 off)
        "rad_pool": 50000,
        "rad_k": 1.0,
        "rad_c": 1.0,
        "residual_budget": "",     # e.g. "64MiB": chunk the residual ("" = the run's budget)
        # weighting
        **ATTENTION_SETTINGS,      # attention ("", "linear" RBA, "exponential" vRBA),
                                   # attention_gamma, _eta, _temperature, _every
        "weighting": "fixed",
        "anneal_alpha": 0.9,
        "anneal_every": 100,
        # reference
        "quad_nodes": 200,
    }

    def build(self, ctx):
        cfg = ctx.cfg
        dtype, device = ctx.dtype, ctx.device
        seed = int(cfg.seed)
        odd = _odd(cfg)
        geom = Rectangle((0.0 if odd else -1.0, 0.0), (1.0, 1.0))  # (x, t)
        method = str(cfg.sampling)
        coll = Collocation(lambda n, s: geom.sample_interior(n, method, s, dtype, device),
                           int(cfg.n_collocation), resample_every=int(cfg.resample_every),
                           seed=seed)
        # Raissi's data locations: x grid at t = 0 and t grid at x = -1, 1
        xg = np.linspace(-1.0, 1.0, 256)
        tg = np.linspace(0.0, 0.99, 100)
        locs = np.concatenate([np.stack([xg, np.zeros_like(xg)], 1),
                               np.stack([-np.ones_like(tg), tg], 1),
                               np.stack([np.ones_like(tg), tg], 1)])
        rng = np.random.default_rng(seed)
        pick = np.sort(rng.choice(len(locs), size=min(int(cfg.n_data), len(locs)),
                                  replace=False))
        data = locs[pick]
        is_initial = pick < 256
        ud = cole_hopf(data[:, 0], data[:, 1], float(cfg.nu), int(cfg.quad_nodes))
        X, T = np.meshgrid(xg, tg, indexing="ij")
        exact = cole_hopf(X, T, float(cfg.nu), int(cfg.quad_nodes))

        def t_(a):
            return torch.as_tensor(a, dtype=torch.float64).to(dtype=dtype, device=device)

        net = FNN(2, 1, int(cfg.width), int(cfg.depth), lo=(-1.0, 0.0), hi=(1.0, 1.0),
                  scalar=True)
        hard = _constraints(cfg)
        if hard and str(cfg.derivatives) == "taylor":
            raise ValueError("burgers_pinn: constraints='hard' needs derivatives='autograd' or "
                             "'func' (Taylor mode runs on a bare FNN)")
        if odd:  # the solution is odd in x: so is the network, the points on x >= 0
            net = Symmetric(net, axis=0, parity=-1)
        ctx.model = (HardConstrained(net) if hard else net).to(device=device, dtype=dtype)
        # weights adapt during Adam only: L-BFGS needs one fixed objective
        terms = ("pde",) if hard else TERMS
        weights = make_weights(str(cfg.weighting), {k: 1.0 for k in terms}, reference=("pde",),
                               alpha=float(cfg.anneal_alpha), every=int(cfg.anneal_every),
                               until=self._adapt_until(ctx))
        ctx.data = {
            "geometry": geom,
            "collocation": coll,
            "x_initial": t_(data[is_initial]),
            "u_initial": t_(ud[is_initial]),
            "x_boundary": t_(data[~is_initial]),
            "u_boundary": t_(ud[~is_initial]),
            "test": t_(np.stack([X.ravel(), T.ravel()], 1)),
            "test_exact": t_(exact.ravel()),
            "weights": weights,
            "attention": self.make_attention(cfg),
            "residual": ChunkedResidual(self._weighted(self._pde_fn(ctx), cfg),
                                        params=list(ctx.model.parameters()),
                                        budget=str(cfg.residual_budget or cfg.budget)
                                        or None),
        }

    def _weighted(self, fn, cfg):
        """``fn`` of points with their attention weights (:meth:`attend`), when on."""
        return ResidualAttention.weighted(fn) if str(cfg.attention) else fn

    def _pde_fn(self, ctx):
        def fn(x):
            return self.pde(ctx, x)

        return torch.compile(fn) if bool(ctx.cfg.compile) else fn

    def pde(self, ctx, x, backend: str | None = None):
        """Residual ``u_t + u u_x - nu u_xx`` at points ``(N, 2)`` of ``(x, t)``, ``(N,)``."""
        j = jet(ctx.model, x, 2, backend=backend or str(ctx.cfg.derivatives),
                hessian_pairs=((0, 0),))
        u = j.value
        u_x, u_t = j.jacobian[:, 0], j.jacobian[:, 1]
        u_xx = j.d(None, 0, 0)
        return u_t + u * u_x - float(ctx.cfg.nu) * u_xx

    def _points(self, ctx, iteration):
        d, cfg = ctx.data, ctx.cfg
        coll = d["collocation"]
        if (int(cfg.rar_every) > 0 and iteration > 0 and iteration % int(cfg.rar_every) == 0
                and self.adam_phase(ctx, iteration)):
            coll.refine(lambda x: self.pde(ctx, x), int(cfg.rar_pool), int(cfg.rar_add),
                        iteration=iteration)
        every = int(cfg.rad_every)
        if (every > 0 and iteration > 0 and iteration % every == 0
                and self.collocation_iteration(ctx, iteration) == iteration):
            coll.redistribute(lambda x: self.pde(ctx, x), int(cfg.rad_pool), iteration,
                              k=float(cfg.rad_k), c=float(cfg.rad_c))
        return coll.points(self.collocation_iteration(ctx, iteration)).to(d["test"].dtype)

    def least_squares_terms(self, ctx, iteration):
        """The loss terms as residual vectors, for ``optimizer = "gauss_newton"``."""
        d, w = ctx.data, ctx.data["weights"]
        x = self._points(ctx, iteration)
        pts = self.attend(ctx, iteration, x, lambda p: self.pde(ctx, p))
        terms = [LeastSquaresTerm(self._weighted(lambda p: self.pde(ctx, p, "func"), ctx.cfg),
                                  pts, float(w.get("pde", 1.0)))]
        if not _constraints(ctx.cfg):
            for k in ("initial", "boundary"):  # points (x, t, u): the target rides along
                pts = torch.cat([d[f"x_{k}"], d[f"u_{k}"].unsqueeze(1)], 1)
                terms.append(LeastSquaresTerm(lambda p: ctx.model(p[:, :2]) - p[:, 2], pts,
                                              float(w.get(k, 1.0))))
        return terms

    def residuals(self, ctx, iteration):
        d, cfg = ctx.data, ctx.cfg
        x = self._points(ctx, iteration)
        x = self.attend(ctx, iteration, x, lambda p: self.pde(ctx, p))
        terms = {"pde": d["residual"](x)}
        if _constraints(cfg):  # initial and boundary values hold exactly
            d["weights"].update_from(terms, ctx.model.parameters(), iteration)
            return terms
        terms["initial"] = (ctx.model(d["x_initial"]) - d["u_initial"]).pow(2).mean()
        terms["boundary"] = (ctx.model(d["x_boundary"]) - d["u_boundary"]).pow(2).mean()
        d["weights"].update_from(terms, ctx.model.parameters(), iteration)
        return terms

    def evaluate(self, ctx):
        d = ctx.data
        pred = ctx.model(d["test"])
        err = pred - d["test_exact"]
        out = {"u_rel_l2": float(err.norm() / d["test_exact"].norm()),
               "u_max_error": float(err.abs().max())}
        if str(ctx.cfg.weighting) == "annealing":
            for k in ("initial", "boundary"):
                out[f"weight_{k}"] = float(d["weights"].get(k, 1.0))
        return out


problem = BurgersPINN()
