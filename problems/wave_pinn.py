r"""Physics-informed network for the 1-D wave equation of Wang, Yu & Perdikaris (NTK paper).

Physics
-------
.. math::

    u_{tt} = c^2 u_{xx},\quad x \in [0, 1],\ t \in [0, 1],\qquad c = 2,

    u(0, t) = u(1, t) = 0,\qquad u(x, 0) = \sin(\pi x) + \tfrac12\sin(4\pi x),
    \qquad u_t(x, 0) = 0,

the benchmark of Wang, Yu & Perdikaris, "When and why PINNs fail to train: a neural tangent
kernel perspective" (J. Comput. Phys. 449, 110768, 2022, arXiv:2007.14527; their notebook
PredictiveIntelligenceLab/PINNsNTK ``PINNsNTK_Wave1D.ipynb``: ``a = 0.5``, ``c = 2`` on the unit
square). The two standing waves have time periods 1 and 1/4: over :math:`[0, 1]` the
solution oscillates four times in :math:`t`.

Reference solution (exact)
--------------------------
:math:`u = \sin(\pi x)\cos(c\pi t) + \tfrac12\sin(4\pi x)\cos(4c\pi t)` (:func:`exact`;
d'Alembert's standing waves). The tests check by autograd that it satisfies the equation
to round-off (1e-12 of :math:`|u_{tt}|`), the boundary values, :math:`u(x, 0)` and
:math:`u_t(x, 0) = 0`, and that a wrong wave speed is caught.

Model and loss
--------------
``ctx.model``: a ``tanh`` :class:`~deepsolve.pinn.FNN` :math:`N(x, t)` (``depth`` × ``width``,
inputs mapped to :math:`[-1, 1]^2`) inside the ansatz chosen by ``constraints``
(:class:`WaveAnsatz`; :math:`u_0(x) = \sin\pi x + \frac12\sin 4\pi x`):

* ``"full"``: :math:`u = u_0(x) + x(1 - x)\,t^2 N(x, t)` — the boundary values,
  :math:`u(x, 0)` and :math:`u_t(x, 0) = 0` hold for every network; the only loss term is
  ``pde``;
* ``"hard"`` (the default): :math:`u = u_0(x) + x(1 - x)\,t\,N(x, t)` — boundary and
  initial values exact, :math:`u_t(x, 0) = 0` the loss term ``velocity``;
* ``"soft"`` (the paper's setting): :math:`u = N`, with the terms ``initial``, ``velocity``
  and ``boundary``.

Loss terms:

* ``pde`` — mean square of :math:`u_{tt} - c^2 u_{xx}` at ``n_collocation`` points
  (``sampling``; redrawn by RAD every ``rad_every`` iterations from ``rad_pool`` candidates,
  ``rad_k``, ``rad_c``);
* ``initial`` (soft) — mean square of :math:`u(x, 0) - u_0(x)` at ``n_initial`` points,
  weight ``weight_initial``;
* ``velocity`` (soft, hard) — mean square of :math:`u_t(x, 0)` at the same :math:`x`,
  weight ``weight_velocity``;
* ``boundary`` (soft) — mean square of :math:`u(0, t)` and :math:`u(1, t)` at ``n_boundary``
  points in all, weight ``weight_boundary``.

Optimiser (``optimizer``): ``"ssbroyden"`` (default; :class:`deepsolve.pinn.SelfScaledBroyden`,
float64, ``qn_iters`` iterations per trainer iteration), ``"bfgs"``, ``"gauss_newton"``,
``"adam+lbfgs"``, ``"adam"`` or ``"lbfgs"`` (:mod:`deepsolve.pinn.problem`).

Defaults and trial runs
-----------------------
Measured on the project's 2-core CPU (shared), one thread, ``time_limit = 3`` minutes,
SSBroyden in float64, 2000 points, RAD every 25 iterations (best ``u_rel_l2`` after 1 / 2 /
3 minutes):

* ``"hard"``, 3 × 30 (the default): 2.7e-1 / 1.2e-2 / 1.2e-3 (100 iterations, still falling);
* ``"hard"``, 4 × 30: 3.4e-1 / 3.1e-2 / 1.6e-3 (71 iterations);
* ``"full"``, 3 × 30: 4.4e-1 / 2.4e-1 / 2.2e-1 — the :math:`t^2` factor makes the network
  carry :math:`(u - u_0)/(x(1-x)t^2)`, of size :math:`\sim 32\pi^2 \approx 316` near
  :math:`t = 0`, which trained far worse;
* ``"soft"``, 3 × 30, weights 10: 3.7e-1 / 3.3e-1 / 2.9e-1.

Metrics (``evaluate``)
----------------------
``u_rel_l2`` — :math:`\|u_\theta - u\|_2 / \|u\|_2` on the ``test_n`` × ``test_n`` grid of the
unit square, ends included (200 × 200 as in the paper's notebook).

Published results
-----------------
``published`` (:class:`~deepsolve.pinn.Published`): Wang, Yu & Perdikaris with NTK-adaptive
and with fixed weights, and the saved output of their notebook (3.86e-3). Entries marked
"unverified" were recalled, not confirmed from the paper's text.
"""

from __future__ import annotations

import math

import torch

import deepsolve
from deepsolve.pinn import PINN_SETTINGS, PINNProblem, Published, jet

CONSTRAINTS = ("full", "hard", "soft")


def initial_condition(x: torch.Tensor) -> torch.Tensor:
    r""":math:`u_0(x) = \sin\pi x + \frac12\sin 4\pi x`."""
    return torch.sin(math.pi * x) + 0.5 * torch.sin(4 * math.pi * x)


def exact(p: torch.Tensor, c: float = 2.0) -> torch.Tensor:
    r""":math:`\sin(\pi x)\cos(c\pi t) + \frac12\sin(4\pi x)\cos(4c\pi t)` at points
    ``(n, 2)`` of ``(x, t)``, ``(n,)``."""
    x, t = p[:, 0], p[:, 1]
    return (torch.sin(math.pi * x) * torch.cos(c * math.pi * t)
            + 0.5 * torch.sin(4 * math.pi * x) * torch.cos(4 * c * math.pi * t))


def _constraints(cfg) -> str:
    name = str(cfg.constraints)
    if name not in CONSTRAINTS:
        raise ValueError(f"wave_pinn: constraints must be one of {', '.join(CONSTRAINTS)}, "
                         f"got {name!r}")
    return name


class WaveAnsatz(torch.nn.Module):
    r""":math:`u = u_0(x) + x(1 - x)\,t^m N(x, t)` (``power`` :math:`m` = 2: ``"full"``, 1:
    ``"hard"``). Points ``(..., 2)`` of ``(x, t)`` to ``(...)``."""

    def __init__(self, net: torch.nn.Module, power: int):
        super().__init__()
        self.net, self.power = net, int(power)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        x, t = p[..., 0], p[..., 1]
        return initial_condition(x) + x * (1 - x) * t ** self.power * self.net(p)


class WavePINN(PINNProblem, deepsolve.Problem):
    inputs, outputs = 2, 1
    lo, hi = (0.0, 0.0), (1.0, 1.0)   # (x, t)
    components = ("u",)
    published = (
        # the numbers marked "unverified" were not confirmed from the paper's text
        Published("Wang, Yu & Perdikaris, J. Comput. Phys. 449, 110768 (2022), "
                  "arXiv:2007.14527", "NTK-adaptive loss weights, 3 x 500 tanh, 80001 "
                  "gradient steps, batch 300", "float32", "1.728e-3 (unverified)"),
        Published("PredictiveIntelligenceLab/PINNsNTK, PINNsNTK_Wave1D.ipynb (the paper's "
                  "notebook, its saved output)", "NTK-adaptive loss weights, 3 x 500 tanh, "
                  "80001 steps, batch 300", "float32", "3.86e-3", "—", "Tesla P100"),
        Published("Wang, Yu & Perdikaris, J. Comput. Phys. 449, 110768 (2022), "
                  "arXiv:2007.14527", "fixed weights (plain PINN), 3 x 500 tanh", "float32",
                  "4.518e-1 (unverified)"),
    )
    defaults = {
        **PINN_SETTINGS,
        # physics
        "c": 2.0,                  # wave speed
        # network
        "width": 30,
        "depth": 3,
        "constraints": "hard",     # "hard", "full" or "soft" (module docstring)
        # points
        "n_collocation": 2000,     # interior points of the pde term
        "rad_pool": 20000,         # RAD candidates
        "n_initial": 200,          # soft/hard: points on t = 0
        "n_boundary": 200,         # soft: points on x = 0 and x = 1
        "weight_initial": 10.0,    # weight of the initial term
        "weight_velocity": 10.0,   # weight of the velocity term
        "weight_boundary": 10.0,   # weight of the boundary term
        # reference
        "test_n": 200,             # test grid test_n x test_n (Wang et al.: 200 x 200)
    }

    def network(self, ctx):
        cfg = ctx.cfg
        net = super().network(ctx)   # the tanh FNN of width x depth on the box lo, hi
        kind = _constraints(cfg)
        return net if kind == "soft" else WaveAnsatz(net, 2 if kind == "full" else 1)

    def pde(self, ctx, x, backend):
        c = float(ctx.cfg.c)
        j = jet(ctx.model, x, 2, backend=backend, hessian_pairs=((0, 0), (1, 1)))
        return j.d(None, 1, 1) - c * c * j.d(None, 0, 0)

    def conditions(self, ctx):
        cfg = ctx.cfg
        kind = _constraints(cfg)
        if kind == "full":
            return {}
        geom, method, seed = self.domain(cfg), str(cfg.sampling), int(cfg.seed)
        initial = geom.sample_face(int(cfg.n_initial), 1, 0, method, seed + 1, torch.float64)

        def velocity(p):
            return jet(ctx.model, p, 1, backend="func").jacobian[:, 1]

        out = {"velocity": (velocity, initial)}
        if kind == "soft":
            sides = geom.sample_boundary(int(cfg.n_boundary), method, seed + 2, torch.float64,
                                         axes=(0,))
            out["initial"] = (lambda p: ctx.model(p) - initial_condition(p[:, 0]), initial)
            out["boundary"] = (lambda p: ctx.model(p), sides)
        return out

    def reference(self, ctx):
        n = int(ctx.cfg.test_n)
        if n < 2:
            raise ValueError(f"wave_pinn: test_n must be >= 2, got {n}")
        pts = self.domain(ctx.cfg).grid(n, dtype=torch.float64)
        return pts, exact(pts, float(ctx.cfg.c))[:, None]


problem = WavePINN()
