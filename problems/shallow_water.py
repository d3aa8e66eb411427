r"""Bathymetry from sea-surface height: 2-D rotating shallow water, domain-decomposed.

The ocean is the nonlinear rotating shallow-water system on a doubly periodic f-plane box
(:class:`deepsolve.physics.shallow_water.ShallowWater2D`: Arakawa C-grid, Sadourny's
energy-conserving scheme, RK4; mass conserved to round-off, lake at rest exact, verified
against the exact inertia-gravity and geostrophic solutions in tests/test_shallow_water.py).
Its rest depth is unknown: a smooth field

.. math::

    H(x, y) = H_0\Bigl(1 + \sum_{0 < |(m, n)| \le M} a_{mn}\cos(k_m x + l_n y)
                           + b_{mn}\sin(k_m x + l_n y)\Bigr),

with ``2 * modes_count`` coefficients (the wavevectors of a half-plane with
``|m|, |n| <= modes``), the model's parameters, started flat (all zero). The truth draws
them from ``depth_seed`` (relative amplitude ``depth_rms``).

Each member of an ensemble of ``members`` experiments releases a Gaussian sea-surface bump
at rest (at a member-dependent place); gravity waves, bent by rotation (the deformation
radius is a third of the box) and refracted by the depth, run for ``steps`` RK4 steps
(1000 by default, about 8 crossings of the box). We observe the sea-surface height of the
whole field at the end (altimetry); the trainer fits the coefficients **through the whole
unroll**, checkpointed under the run's ``budget``.

Domain decomposition. ``build`` splits the ``ny`` rows over the ``space`` ranks of the run
(``ctx.slab``): under ``torchrun --nproc-per-node K`` each rank holds ``ny / K`` rows of the
state, the depth and the observations, exchanges halos with its two neighbours, and the
trainer sums the loss shares and gradients over the ranks, so the run equals the single-
process one to rounding. Each rank exchanges one 4-row halo per RK4 step
(``exchange="step"``: the stages run on a shrinking halo; the same bits as one row per
stage, a quarter of the messages). ``--set mesh=2x2`` splits 4 processes into 2 data-parallel groups
(members) of 2 space ranks. The truth is computed decomposed too (no rank ever holds the
whole field, except ``evaluate``'s depth, which is a function of the replicated
coefficients).

Loss terms (shares of global means, ``slab.mean``/``slab.share``):

* ``misfit`` :math:`= \langle(\eta_T - \eta_T^{obs})^2\rangle / \langle(\eta_T^{obs})^2\rangle`
  over the field and the members (1 at the flat start when the bump's signal dominates);
* ``prior`` :math:`= \sum a^2 + b^2` (weight ``prior``): a small ridge on the coefficients.

``evaluate``: ``depth_rel_error`` :math:`\|H - H^\star\|/\|H^\star - H_0\|` (1 at the
flat start) and ``coef_rel_error``.

Defaults (32 x 32, 2 members, 1000 steps, float64, L-BFGS with 4 inner iterations, budget
256 MiB: revolve_tail with 807 slots and the last 193 steps kept recorded): 10 iterations
take 7.1 min on one process of this 2-core machine and bring ``depth_rel_error`` from 1 to
6.9e-5 (the misfit from 0.38 to 7e-10); the runs are in docs/hpc.md.
"""

from __future__ import annotations

import math

import torch

import deepsolve
from deepsolve.physics.shallow_water import ShallowWater2D, gaussian_bump


def wavevectors(modes: int) -> list[tuple[int, int]]:
    """Integer wavevectors ``(m, n)`` of one half-plane with ``|m|, |n| <= modes``."""
    return [(m, n) for m in range(0, modes + 1) for n in range(-modes, modes + 1)
            if (m, n) != (0, 0) and (m > 0 or n > 0)]


class Bathymetry(torch.nn.Module):
    """``H = H0 (1 + basis @ coef)``: the rest depth on a block of rows."""

    def __init__(self, n_coef: int):
        super().__init__()
        self.coef = torch.nn.Parameter(torch.zeros(n_coef))

    def forward(self, basis: torch.Tensor, h0: float) -> torch.Tensor:
        return h0 * (1 + torch.einsum("k,kij->ij", self.coef, basis))


def _basis(grid: ShallowWater2D, modes: int, j0: int, rows: int, dtype, device):
    """``(2 * len(wavevectors), rows, nx)``: cos and sin of each wavevector at the cell
    centres of rows ``j0 .. j0 + rows - 1``."""
    X, Y = grid.points("eta", j0, rows, dtype=torch.float64)
    parts = []
    for m, n in wavevectors(modes):
        phase = 2 * math.pi * (m * X / grid.Lx + n * Y / grid.Ly)
        parts += [torch.cos(phase), torch.sin(phase)]
    return torch.stack(parts).to(dtype=dtype, device=device)


class ShallowWaterBathymetry(deepsolve.Problem):
    defaults = {
        # trainer
        "iterations": 10,       # L-BFGS steps (each evaluates the loss <= lbfgs_iters + ~2 times)
        "lr": 1.0,
        "steps": 1000,          # RK4 steps through which we train
        "budget": "256MiB",     # per device: the planner picks the schedule
        "dtype": "float64",
        "eval_every": 1,
        "optimizer": "lbfgs",   # "lbfgs" (strong Wolfe) or "adam" (lr ~ 0.02)
        "lbfgs_iters": 4,
        # grid and physics (SI units)
        "nx": 32,
        "ny": 32,
        "length": 1.0e6,        # box side [m]
        "h0": 100.0,            # mean depth [m]; wave speed sqrt(g h0) ~ 31 m/s
        "f": 1.0e-4,            # Coriolis parameter [1/s]; deformation radius ~ 310 km
        "cfl": 0.5,             # gravity-wave CFL number that sets dt
        "drag": 1.0e-6,         # linear bottom drag [1/s]
        "viscosity": 0.0,       # [m^2/s]
        "exchange": "step",     # halos: 4 rows once per RK4 step ("step") or 1 per stage
        "integrator": "rk4",    # "rk4", or "reversible": RK4 made reversible by the
                                # McCallum-Foster coupling (state (x, z), lam below), whose
                                # inverse lets the unroll rebuild states (--set reversible=8)
        "lam": 0.999,           # coupling parameter of the reversible integrator
        # truth and data
        "modes": 2,             # |m|, |n| <= modes: 12 wavevectors, 24 coefficients
        "depth_seed": 7,
        "depth_rms": 0.1,       # relative rms of the true depth anomaly
        "members": 2,           # ensemble of released bumps (the data-parallel batch)
        "bump": 1.0,            # bump height [m]
        "bump_width": 0.08,     # bump width, fraction of the box
        "obs_every": 50,        # steps between observations (the last one at the end)
        "obs_stride": 4,        # altimetry tracks: every obs_stride-th column of the grid
        # regularisation
        "prior": 1e-4,
    }

    def batch_size(self, ctx):
        return int(ctx.cfg.members)

    def build(self, ctx):
        cfg = ctx.cfg
        nx, ny, L = int(cfg.nx), int(cfg.ny), float(cfg.length)
        h0 = float(cfg.h0)
        dx = L / max(nx, ny)
        dt = float(cfg.cfl) * dx / math.sqrt(9.81 * h0 * (1 + 4 * float(cfg.depth_rms)))
        grid = ShallowWater2D(nx=nx, ny=ny, Lx=L, Ly=L, g=9.81, f=float(cfg.f),
                              drag=float(cfg.drag), viscosity=float(cfg.viscosity), dt=dt,
                              exchange=str(cfg.exchange))
        slab = ctx.slab(ny, dim=-2, halo=grid.halo())   # first: the ranks that share a field
        dtype, device = ctx.dtype, ctx.device
        basis = _basis(grid, int(cfg.modes), slab.start, slab.rows, dtype, device)
        n_coef = basis.shape[0]
        g = torch.Generator().manual_seed(int(cfg.depth_seed))
        true = torch.randn(n_coef, generator=g, dtype=torch.float64)
        true = (true * float(cfg.depth_rms) * math.sqrt(2.0 / n_coef)).to(dtype)
        model = Bathymetry(n_coef).to(device=device, dtype=dtype)
        with torch.no_grad():
            depth_true = h0 * (1 + torch.einsum("k,kij->ij", true.to(device), basis))
        if float(depth_true.min()) <= 0.2 * h0:
            raise ValueError(f"depth_rms={cfg.depth_rms} makes the true depth nearly vanish; "
                             "lower it")
        members = int(cfg.members)
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        # every member's bump on this rank's rows, at a member-dependent place
        bumps = []
        for k in range(members):
            x0 = L * ((0.3 + 0.37 * k) % 1.0)
            y0 = L * ((0.4 + 0.23 * k) % 1.0)
            eta = gaussian_bump(grid, float(cfg.bump), float(cfg.bump_width) * L, x0, y0,
                                j0=slab.start, rows=slab.rows, dtype=dtype, device=device)
            z = torch.zeros_like(eta)
            bumps.append(torch.stack([eta, z, z]))
        x0 = ctx.shard(torch.stack(bumps))          # (members on this rank, 3, rows, nx)
        integrator = str(cfg.integrator)
        if integrator not in ("rk4", "reversible"):
            raise ValueError(f"integrator must be 'rk4' or 'reversible', got {integrator!r}")
        ctx.model = model
        ctx.data = {"grid": grid, "slab": slab, "basis": basis, "x0": x0, "h0": h0,
                    "true_coef": true.to(device), "steps": int(cfg.steps),
                    "reversible": integrator == "reversible"}
        if integrator == "reversible":  # the carried state is the coupled pair (x, z)
            ctx.data["x0"] = x0 = (x0, x0.clone())
        steps, every = int(cfg.steps), int(cfg.obs_every)
        if not 1 <= every <= steps:
            raise ValueError(f"obs_every must be in 1..steps={steps}, got {every}")
        if int(cfg.obs_stride) < 1:
            raise ValueError(f"obs_stride must be >= 1, got {cfg.obs_stride}")
        # observed steps: every obs_every-th, the last one at the end (row i: after i+1 steps)
        ctx.data["obs_rows"] = torch.arange(steps - 1, -1, -every, device=device).flip(0)
        with torch.no_grad():   # the truth, decomposed like the model
            _, outs = deepsolve.unroll(lambda s, i: self._advance(ctx, s, depth_true), x0,
                                       steps)
        obs = outs.index_select(0, ctx.data["obs_rows"])
        # the global mean square of the observations (every rank's share, summed)
        power = slab.mean(obs.pow(2))
        ctx.data["obs"] = obs
        ctx.data["obs_power"] = _global_sum(power, ctx)

    def depth(self, ctx) -> torch.Tensor:
        return ctx.model(ctx.data["basis"], ctx.data["h0"])

    def _advance(self, ctx, x, depth):
        """One RK4 step and what the altimeter sees of it: ``(x_next, eta_next[..., ::s])``;
        with the reversible integrator ``x`` is the coupled pair and the altimeter sees its
        solution half."""
        d = ctx.data
        if d["reversible"]:
            x = self._coupled(ctx, depth).forward(x, 0)
            return x, x[0][:, 0, :, ::int(ctx.cfg.obs_stride)]
        y = d["grid"].step(x, depth, d["slab"].halo)
        return y, y[:, 0, :, ::int(ctx.cfg.obs_stride)]

    def _coupled(self, ctx, depth):
        """RK4 of the grid's tendency at this depth, made reversible (the grid's time does
        not enter, so every step is step 0 of its own stepper)."""
        d = ctx.data
        grid, pad = d["grid"], d["slab"].halo
        return deepsolve.reversible.explicit(lambda t, s: grid.rhs(s, depth, pad), grid.dt,
                                             method="rk4", lam=float(ctx.cfg.lam))

    def step(self, ctx, x, i):
        return self._advance(ctx, x, self.depth(ctx))

    def step_stability(self, ctx, x, i=0, n=None):
        """The reversible integrator's linear stability at ``x`` (``None`` for RK4, and on
        a decomposed domain: each rank would analyse its own block, and ranks that disagree
        must not leave the others waiting in a halo exchange)."""
        if not ctx.data["reversible"] or (torch.distributed.is_available() and
                                          torch.distributed.is_initialized() and
                                          torch.distributed.get_world_size() > 1):
            return None
        return self._coupled(ctx, self.depth(ctx)).stability(x, i, n)

    def step_inverse(self, ctx, x, i):
        """``x_i`` from ``x_{i+1}`` (the reversible integrator only)."""
        if not ctx.data["reversible"]:
            raise ValueError("shallow_water: the RK4 integrator has no inverse; give --set "
                             "integrator=reversible for a reversible unroll")
        return self._coupled(ctx, self.depth(ctx)).inverse(x, 0)

    def residuals(self, ctx, iteration):
        d = ctx.data
        slab = d["slab"]
        _, outs = ctx.unroll(self.step, d["x0"])
        pred = outs.index_select(0, d["obs_rows"])        # (times, members, rows, tracks)
        misfit = slab.mean((pred - d["obs"]).pow(2)) / d["obs_power"]
        return {"misfit": misfit, "prior": slab.share(ctx.model.coef.pow(2).sum())}

    def optimizer(self, ctx, params):
        name = str(ctx.cfg.optimizer).lower()
        if name == "lbfgs":
            return torch.optim.LBFGS(params, lr=float(ctx.cfg.lr),
                                     max_iter=int(ctx.cfg.lbfgs_iters), history_size=20,
                                     line_search_fn="strong_wolfe")
        if name == "adam":
            return torch.optim.Adam(params, lr=float(ctx.cfg.lr))
        raise ValueError(f"optimizer must be 'lbfgs' or 'adam', got {ctx.cfg.optimizer!r}")

    def weights(self, ctx):
        return {"misfit": 1.0, "prior": float(ctx.cfg.prior)}

    def evaluate(self, ctx):
        d = ctx.data
        coef, true = ctx.model.coef.detach(), d["true_coef"]
        # the depth over the whole grid: a function of the (replicated) coefficients
        grid = d["grid"]
        full = _basis(grid, int(ctx.cfg.modes), 0, grid.ny, coef.dtype, coef.device)
        anomaly = torch.einsum("k,kij->ij", coef - true, full)
        scale = torch.einsum("k,kij->ij", true, full)
        return {"depth_rel_error": float(anomaly.norm() / scale.norm()),
                "coef_rel_error": float((coef - true).norm() / true.norm())}


def _global_sum(t: torch.Tensor, ctx) -> torch.Tensor:
    """The sum of ``t`` over every rank (a constant of the data: no gradient)."""
    t = t.detach().clone()
    if ctx.world_size > 1:
        torch.distributed.all_reduce(t)
        t = t / ctx.data_size   # each data rank holds its members' share: the mean of them
    return t


problem = ShallowWaterBathymetry()
