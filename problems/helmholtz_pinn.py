r"""Physics-informed network for the 2-D Helmholtz benchmark of Wang, Teng & Perdikaris.

Physics
-------
.. math::

    \Delta u + k^2 u = q \quad\text{on } [-1, 1]^2,\qquad u = 0 \text{ on the boundary},

    q(x, y) = \bigl(k^2 - (a_1\pi)^2 - (a_2\pi)^2\bigr)\sin(a_1\pi x)\sin(a_2\pi y),

with :math:`k = 1`, :math:`a_1 = 1`, :math:`a_2 = 4` (settings ``k``, ``a1``, ``a2``): the
benchmark of Wang, Teng & Perdikaris, "Understanding and mitigating gradient flow pathologies
in physics-informed neural networks" (SIAM J. Sci. Comput. 43(5), 2021, arXiv:2001.04536;
their code, PredictiveIntelligenceLab/GradientPathologiesPINNs, ``Helmholtz/Helmholtz2D.py``:
the same equation, coefficients and domain), later used by McClenny & Braga-Neto
(self-adaptive PINNs) and Anagnostopoulos et al. (residual-based attention).

Reference solution (exact)
--------------------------
:math:`u = \sin(a_1\pi x)\sin(a_2\pi y)` (:func:`exact`), which vanishes on the boundary for
integer :math:`a_1, a_2`; :math:`q` is its image under :math:`\Delta + k^2` (:func:`source`).
The tests check by autograd that the exact solution's residual is at round-off (below
1e-12 of :math:`\max|q| \approx 166`) and that it vanishes on the four sides, and by
central differences that :func:`source` is :math:`\Delta u + k^2 u`.

Model and loss
--------------
``ctx.model``: a ``tanh`` :class:`~deepsolve.pinn.FNN` :math:`N(x, y)` of ``depth`` hidden
layers × ``width`` units. With ``constraints = "hard"`` (the default) the solution is the
ansatz

.. math::

    u(x, y) = (1 - x^2)(1 - y^2)\,N(x, y)

(:class:`HardDirichlet`), zero on the boundary for every network, so the only loss term is
``pde``. With ``constraints = "soft"`` (the papers' setting) :math:`u = N` and the term
``boundary`` is added. Loss terms:

* ``pde`` — mean square of :math:`\Delta u + k^2 u - q` at ``n_collocation`` points
  (``sampling``; every ``rad_every`` iterations redrawn by RAD from ``rad_pool`` candidates,
  :meth:`deepsolve.pinn.Collocation.redistribute`, ``rad_k``, ``rad_c``);
* ``boundary`` (``constraints = "soft"`` only) — mean square of :math:`u` at ``n_boundary``
  points on the four sides (``sampling``, allotted by side length), weighted by
  ``weight_boundary``.

Optimiser (``optimizer``): ``"ssbroyden"`` (default; :class:`deepsolve.pinn.SelfScaledBroyden`,
full-memory self-scaled Broyden in float64, ``qn_iters`` iterations per trainer iteration),
``"bfgs"``, ``"gauss_newton"``, ``"adam+lbfgs"``, ``"adam"`` or ``"lbfgs"``
(:mod:`deepsolve.pinn.problem`).

Defaults and trial runs
-----------------------
Measured on the project's 2-core CPU (shared), one thread, ``time_limit = 3`` minutes,
SSBroyden in float64, 3 × 30 network, 2000 points, RAD every 25 iterations (best
``u_rel_l2`` after 1 / 2 / 3 minutes):

* ``constraints = "hard"`` (the default): 8.1e-3 / 8.0e-5 / 4.1e-5 (131 iterations);
* ``constraints = "soft"``, ``weight_boundary = 10``: 2.05 / 9.1e-2 / 9.1e-2 (56 iterations; the
  run stalled).

The hard ansatz removes the boundary term, whose balance against the residual (about 166
times larger in scale) is the failure Wang et al. analyse.

Metrics (``evaluate``)
----------------------
``u_rel_l2`` — :math:`\|u_\theta - u\|_2 / \|u\|_2` on the ``test_n`` × ``test_n`` grid of
:math:`[-1, 1]^2`, ends included (100 × 100 as in Wang et al.'s code).

Published results
-----------------
``published`` (:class:`~deepsolve.pinn.Published`): Wang et al. (plain PINN and learning-rate
annealing with their improved architecture), McClenny & Braga-Neto (self-adaptive weights)
and Anagnostopoulos et al. (residual-based attention, "of the order of 1e-5" in their
abstract). Entries marked "unverified" were recalled, not confirmed from the papers' text.
"""

from __future__ import annotations

import math

import torch

import deepsolve
from deepsolve.pinn import PINN_SETTINGS, PINNProblem, Published, jet


def exact(p: torch.Tensor, a1: float = 1.0, a2: float = 4.0) -> torch.Tensor:
    r""":math:`\sin(a_1\pi x)\sin(a_2\pi y)` at points ``(n, 2)``, ``(n,)``."""
    return torch.sin(a1 * math.pi * p[:, 0]) * torch.sin(a2 * math.pi * p[:, 1])


def source(p: torch.Tensor, k: float = 1.0, a1: float = 1.0, a2: float = 4.0) -> torch.Tensor:
    r""":math:`q = \Delta u + k^2 u` of the exact solution at points ``(n, 2)``, ``(n,)``."""
    return (k * k - (a1 * math.pi) ** 2 - (a2 * math.pi) ** 2) * exact(p, a1, a2)


def _hard(cfg) -> bool:
    """``True`` for ``constraints = "hard"``; a one-line error for anything but hard/soft."""
    name = str(cfg.constraints)
    if name not in ("soft", "hard"):
        raise ValueError(f"helmholtz_pinn: constraints must be 'soft' or 'hard', got {name!r}")
    return name == "hard"


class HardDirichlet(torch.nn.Module):
    r""":math:`u = (1 - x^2)(1 - y^2)\,N(x, y)`: zero on the boundary of :math:`[-1, 1]^2`
    for any network :math:`N`. Points ``(..., 2)`` to ``(...)``."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        x, y = p[..., 0], p[..., 1]
        return (1 - x * x) * (1 - y * y) * self.net(p)


class HelmholtzPINN(PINNProblem, deepsolve.Problem):
    inputs, outputs = 2, 1
    lo, hi = (-1.0, -1.0), (1.0, 1.0)
    components = ("u",)
    published = (
        # the numbers marked "unverified" were not confirmed from the papers' text
        Published("Anagnostopoulos, Toscano, Stergiopulos & Karniadakis, CMAME 421, 116805 "
                  "(2024), arXiv:2307.00379", "residual-based attention (RBA), modified MLP, "
                  "exact boundary conditions, Adam then L-BFGS", "float32",
                  "O(1e-5) (abstract; the table value unverified)"),
        Published("McClenny & Braga-Neto, J. Comput. Phys. 474, 111722 (2023), "
                  "arXiv:2009.04544", "self-adaptive PINN (per-point trainable weights), "
                  "Adam then L-BFGS", "float32", "3.2e-3 (unverified)"),
        Published("Wang, Teng & Perdikaris, SIAM J. Sci. Comput. 43(5) (2021), "
                  "arXiv:2001.04536", "learning-rate annealing + improved architecture "
                  "(M4), 3 x 50 tanh, 40001 Adam steps, batch 128", "float32",
                  "3.69e-3 (unverified)"),
        Published("Wang, Teng & Perdikaris, SIAM J. Sci. Comput. 43(5) (2021), "
                  "arXiv:2001.04536", "plain PINN (M1), 3 x 50 tanh, 40001 Adam steps, "
                  "batch 128", "float32", "1.81e-1 (unverified)"),
    )
    defaults = {
        **PINN_SETTINGS,
        # physics
        "k": 1.0,                  # wave number
        "a1": 1.0,                 # u = sin(a1 pi x) sin(a2 pi y) (integers: u = 0 on the sides)
        "a2": 4.0,
        # network
        "width": 30,
        "depth": 3,
        "constraints": "hard",     # "hard": (1-x^2)(1-y^2) N; "soft": boundary loss term
        # points
        "n_collocation": 2000,     # interior points of the pde term
        "rad_pool": 20000,         # RAD candidates
        "n_boundary": 400,         # "soft": points on the four sides
        "weight_boundary": 10.0,   # "soft": weight of the boundary term
        # reference
        "test_n": 100,             # test grid test_n x test_n (Wang et al.: 100 x 100)
    }

    def network(self, ctx):
        cfg = ctx.cfg
        net = super().network(ctx)   # the tanh FNN of width x depth on the box lo, hi
        return HardDirichlet(net) if _hard(cfg) else net

    def pde(self, ctx, x, backend):
        cfg = ctx.cfg
        j = jet(ctx.model, x, 2, backend=backend, hessian_pairs=((0, 0), (1, 1)))
        k = float(cfg.k)
        return j.laplacian() + k * k * j.value - source(x, k, float(cfg.a1), float(cfg.a2))

    def conditions(self, ctx):
        cfg = ctx.cfg
        if _hard(cfg):
            return {}
        pts = self.domain(cfg).sample_boundary(int(cfg.n_boundary), str(cfg.sampling),
                                               int(cfg.seed) + 1, torch.float64)
        return {"boundary": (lambda p: ctx.model(p), pts)}

    def reference(self, ctx):
        n = int(ctx.cfg.test_n)
        if n < 2:
            raise ValueError(f"helmholtz_pinn: test_n must be >= 2, got {n}")
        pts = self.domain(ctx.cfg).grid(n, dtype=torch.float64)
        return pts, exact(pts, float(ctx.cfg.a1), float(ctx.cfg.a2))[:, None]


problem = HelmholtzPINN()
