r"""Physics-informed network identifying the coefficients of Burgers' equation from data.

Physics
-------
The data-driven discovery benchmark of Raissi, Perdikaris & Karniadakis (J. Comput. Phys.
378, 2019, Sec. 4.1.1; arXiv:1711.10566): the unknowns :math:`\lambda_1, \lambda_2` of

.. math::

    u_t + \lambda_1 u u_x - \lambda_2 u_{xx} = 0,\quad x \in [-1, 1],\ t \in [0, 1],

are learned together with :math:`u` from :math:`N_u` = ``n_data`` = 2000 observations of the
solution with :math:`\lambda_1 = 1`, :math:`\lambda_2 = 0.01/\pi` (initial condition
:math:`-\sin\pi x`, :math:`u(\pm 1, t) = 0` — neither is given to the network), drawn at random
(seeded by ``seed``, without replacement) from Raissi's 256 × 100 grid
(:math:`x` = 256 points in :math:`[-1, 1]`, ends included; :math:`t` = 100 times in
:math:`[0, 0.99]`). Noise-free data, as in the first row of Raissi's results.

Reference solution (Cole--Hopf)
-------------------------------
:func:`cole_hopf` of ``problems/burgers_pinn.py`` (imported from that file, not copied):
the exact solution by Gauss--Hermite quadrature of the Cole--Hopf integral, 200 nodes
(agrees with 400 to 1e-12 on the grid; the tests of ``burgers_pinn.py`` check it against the
PDE by finite differences and against its initial and boundary values). The observations and
the evaluation grid are its values; nothing is downloaded.

Model and loss
--------------
``ctx.model`` (:class:`BurgersInverseNet`): a ``tanh`` :class:`~deepsolve.pinn.FNN`
(``depth`` × ``width``; Raissi: 8 × 20) for :math:`u(x, t)` and two parameters of the same
module, trained with it: ``lambda1`` (:math:`\lambda_1`, initially 0) and ``log_lambda2``
(:math:`\lambda_2 = e^{\text{log\_lambda2}}`, initially :math:`e^{-6}`; Raissi's
initialisation and parametrisation, which keeps :math:`\lambda_2 > 0`). Loss terms:

* ``data`` — mean squared misfit :math:`u_\theta - u` at the ``n_data`` observations,
  weighted by ``weight_data``;
* ``pde`` — mean square of :math:`u_t + \lambda_1 u u_x - \lambda_2 u_{xx}` at the points
  ``pde_points`` names: ``"collocation"`` (default) — ``n_collocation`` points of
  :math:`[-1, 1] \times [0, 1]` (``sampling``; redrawn by RAD every ``rad_every``
  iterations; :class:`deepsolve.pinn.PINNProblem`); ``"data"`` — the ``n_data`` observation
  points (Raissi's choice; needs ``rad_every = 0``). Measured (3-minute runs, one thread of
  the 2-core CPU, defaults otherwise): at the observations only, the residual leaves
  :math:`u_\theta` free between them and the :math:`\lambda_2` error stalled at 3e-4
  (:math:`\lambda_1`: 2e-6, ``u_rel_l2`` 1.3e-4); with 4000 RAD points it fell to 1e-5
  (1.2e-6 at best; :math:`\lambda_1`: 1.6e-6, ``u_rel_l2`` 1.6e-5).

Derivatives: ``derivatives = "taylor"`` (default; value and derivatives pushed through the
:class:`~deepsolve.pinn.FNN` in one pass), ``"autograd"`` or ``"func"`` (Gauss--Newton uses
``"func"``). Optimiser: ``optimizer`` of :class:`deepsolve.pinn.PINNProblem` (default
SSBroyden, float64).

Metrics
-------
``lambda1_error`` :math:`= |\lambda_1 - 1|` and ``lambda2_error``
:math:`= |\lambda_2 - 0.01/\pi| / (0.01/\pi)` (relative errors; ``lambda1``, ``lambda2``
are logged too), and ``u_rel_l2`` — the relative L2 error of :math:`u_\theta` on the whole
256 × 100 grid. ``target_metric`` (what ``--set target=LEVEL`` names) is ``lambda2_error``:
identifying the coefficients is the task, the published results are coefficient errors, and
:math:`\lambda_2` — multiplying :math:`u_{xx}`, which matters only at the front — is the one
identified least accurately (Raissi: 0.078 % for :math:`\lambda_1`, 0.39 % for
:math:`\lambda_2`, noise-free; ``published``).
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import torch

import deepsolve
from deepsolve.pinn import PINN_SETTINGS, PINNProblem, Published, jet
from deepsolve.problem import load_problem

NU = 0.01 / math.pi        # the true lambda2 (lambda1 = 1)
_burgers, _ = load_problem(pathlib.Path(__file__).resolve().with_name("burgers_pinn.py"))
cole_hopf = sys.modules[type(_burgers).__module__].cole_hopf


def grid() -> tuple[np.ndarray, np.ndarray]:
    """Raissi's grid: 256 points in ``[-1, 1]`` and 100 times in ``[0, 0.99]``."""
    return np.linspace(-1.0, 1.0, 256), np.linspace(0.0, 0.99, 100)


def observations(n: int, seed: int, nodes: int = 200) -> np.ndarray:
    """``n`` grid points drawn without replacement (seeded) with the exact solution there:
    ``(n, 3)`` rows ``(x, t, u)``."""
    xg, tg = grid()
    if not 1 <= int(n) <= xg.size * tg.size:
        raise ValueError(f"burgers_inverse_pinn: n_data must be in [1, {xg.size * tg.size}], "
                         f"got {n}")
    pick = np.sort(np.random.default_rng(int(seed)).choice(xg.size * tg.size, int(n),
                                                           replace=False))
    x, t = xg[pick // tg.size], tg[pick % tg.size]
    return np.stack([x, t, cole_hopf(x, t, NU, nodes)], 1)


class BurgersInverseNet(torch.nn.Module):
    r""":math:`u(x, t)` = ``net`` (a scalar :class:`~deepsolve.pinn.FNN`) with the unknown
    coefficients as parameters of the same module: ``lambda1`` and ``log_lambda2``
    (:math:`\lambda_2 = e^{\text{log\_lambda2}}`)."""

    def __init__(self, net: torch.nn.Module, lambda1: float = 0.0, log_lambda2: float = -6.0):
        super().__init__()
        self.net = net
        self.lambda1 = torch.nn.Parameter(torch.tensor(float(lambda1)))
        self.log_lambda2 = torch.nn.Parameter(torch.tensor(float(log_lambda2)))

    @property
    def lambda2(self) -> torch.Tensor:
        return self.log_lambda2.exp()

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return self.net(p)


class BurgersInversePINN(PINNProblem, deepsolve.Problem):
    inputs, outputs = 2, 1
    lo, hi = (-1.0, 0.0), (1.0, 1.0)
    components = ("u",)
    published = (
        Published("Raissi, Perdikaris & Karniadakis, J. Comput. Phys. 378 (2019) "
                  "(arXiv:1711.10566)",
                  "PINN 8 hidden layers x 20 tanh, N_u = 2000 noise-free points, residual at the "
                  "data points, L-BFGS", "float32",
                  "lambda1 0.078 %, lambda2 0.39 % (relative errors; as commonly quoted, "
                  "not re-read from the paper here)"),
    )
    defaults = {
        **PINN_SETTINGS,
        # network
        "width": 20,
        "depth": 4,
        "derivatives": "taylor",   # "taylor" (one pass), "autograd" or "func" (torch.func)
        # unknowns (Raissi's initial values)
        "lambda1_init": 0.0,
        "log_lambda2_init": -6.0,
        # data and points
        "n_data": 2000,            # N_u observations (random grid points, seeded by seed)
        "weight_data": 1.0,        # weight of the data term
        "pde_points": "collocation",  # "collocation": at n_collocation points (RAD);
                                      # "data": at the observations (Raissi; rad_every=0)
        "n_collocation": 4000,     # residual points (pde_points = "collocation")
        "rad_every": 25,           # RAD every this many iterations (0 off; "data" needs 0)
        "quad_nodes": 200,         # Cole-Hopf quadrature nodes
    }

    @property
    def target_metric(self) -> str:  # what --set target=LEVEL names (module docstring)
        return "lambda2_error"

    def _pde_at_data(self, cfg) -> bool:
        name = str(cfg.pde_points)
        if name not in ("data", "collocation"):
            raise ValueError(f"burgers_inverse_pinn: pde_points must be 'data' or "
                             f"'collocation', got {name!r}")
        if name == "data" and int(cfg.rad_every) > 0:
            raise ValueError("burgers_inverse_pinn: pde_points='data' keeps the observation "
                             "points; set rad_every=0 (or pde_points=collocation)")
        return name == "data"

    def build(self, ctx):
        cfg = ctx.cfg
        self._pde_at_data(cfg)
        ctx.observations = observations(int(cfg.n_data), int(cfg.seed), int(cfg.quad_nodes))
        super().build(ctx)

    def sample(self, ctx, n, seed):
        if self._pde_at_data(ctx.cfg):   # Raissi: the residual at the observation points
            return torch.as_tensor(ctx.observations[:, :2]).to(ctx.dtype)
        return super().sample(ctx, n, seed)

    def network(self, ctx):
        cfg = ctx.cfg
        net = super().network(ctx)   # the tanh FNN of width x depth on the box lo, hi
        return BurgersInverseNet(net, float(cfg.lambda1_init), float(cfg.log_lambda2_init))

    def pde(self, ctx, x, backend):
        """``u_t + lambda1 u u_x - lambda2 u_xx`` at points ``(N, 2)`` of ``(x, t)``."""
        m = ctx.model
        j = jet(m.net, x, 2, backend=backend, hessian_pairs=((0, 0),))
        u = j.value
        return j.jacobian[:, 1] + m.lambda1 * u * j.jacobian[:, 0] - m.lambda2 * j.d(None, 0, 0)

    def conditions(self, ctx):
        pts = torch.as_tensor(ctx.observations)  # (x, t, u): the target rides along

        def data(p):
            return ctx.model(p[:, :2]) - p[:, 2]

        return {"data": (data, pts)}

    def reference(self, ctx):
        xg, tg = grid()
        X, T = np.meshgrid(xg, tg, indexing="ij")
        exact = cole_hopf(X, T, NU, int(ctx.cfg.quad_nodes))
        return (torch.from_numpy(np.stack([X.ravel(), T.ravel()], 1)),
                torch.from_numpy(exact.reshape(-1, 1)))

    def extra_metrics(self, ctx):
        m = ctx.model
        l1, l2 = float(m.lambda1.detach()), float(m.lambda2.detach())
        return {"lambda1": l1, "lambda2": l2, "lambda1_error": abs(l1 - 1.0),
                "lambda2_error": abs(l2 - NU) / NU}


problem = BurgersInversePINN()
