r"""Data assimilation for 1D viscous Burgers: recover the initial condition from sparse data.

The truth is :math:`u_t + u u_x = \nu u_{xx}` on the periodic interval
:math:`[0, 2\pi)`, started from a smooth random :math:`u_0^\star`
(:func:`deepsolve.physics.burgers.random_initial`, seeded by ``u0_seed``) and
solved with the same pseudo-spectral ETDRK4 solver on the same grid but with a
``fine``-times smaller step.  We observe it only at ``sensors`` fixed grid
points (drawn from ``seed``) at ``obs_times`` equally spaced times in the
*second half* of the horizon :math:`T = \text{steps}\cdot dt` (the last one at
:math:`T`), with Gaussian noise of standard deviation ``noise`` times the rms of
the clean observations.

The unknown :math:`u_0` is a truncated Fourier series (the model,
:class:`FourierInitialCondition`),

.. math::

    u_0(x) = a_0 + \sum_{m=1}^{M} a_m \cos(m x) + b_m \sin(m x),\qquad M = \text{modes},

started at :math:`u_0 = 0`, and is trained **through the unrolled solver**:
``ctx.unroll(self.step, u0)`` runs ``steps`` ETDRK4 steps of size ``dt``; the
step returns ``(next_state, next_state[sensors])``, so the observations along
the trajectory are per-step outputs (row ``i`` is the state after ``i + 1``
steps) and the misfit picks the observed rows.  Gradients flow back to the
Fourier coefficients through all ``steps`` steps, checkpointed according to the
run's ``snapshots``/``budget``.

Loss terms (``residuals``), both scalar tensors:

* ``misfit`` :math:`= \langle (H u - y)^2\rangle / \langle y^2\rangle`: the mean
  squared observation misfit over all observed times and sensors, relative to
  the mean square of the data (1 at :math:`u_0 = 0`; about ``noise**2`` at the truth);
* ``smoothness`` :math:`= \langle u_{0,x}^2\rangle / \langle y^2\rangle`, the
  (domain-mean) H1 seminorm of :math:`u_0` in the same units, weighted by the
  setting ``smoothness`` (small: it only damps the modes the late, sparse data
  cannot see).

``evaluate`` returns

* ``u0_rel_error``: :math:`\|u_0 - u_0^\star\|_2 / \|u_0^\star\|_2` on the grid;
* ``final_rel_error``: the same for the state at :math:`T` predicted from the
  current :math:`u_0` vs the noise-free true state at :math:`T`;
* ``obs_rel_error``: the rms of the predictions at the observed times and
  sensors minus the *clean* observations, relative to their rms.

The default optimiser is L-BFGS with a strong-Wolfe line search (the trainer calls it with
a closure; one trainer iteration = up to ``lbfgs_iters`` L-BFGS iterations): the control
has only ``2 * modes + 1`` parameters and the loss is smooth, so it converges in a few dozen
loss evaluations.  ``optimizer=adam`` (set ``lr`` to about 0.03) also works but is slower:
about 0.5 ``u0_rel_error`` after 60 iterations.

With the defaults (about 37 loss evaluations, ~15 s on a 2-core CPU in float64) the
recovered :math:`u_0` has ``u0_rel_error`` about 0.27 (from 1 at :math:`u_0 = 0`) and the
predicted final state ``final_rel_error`` about 0.007; the misfit reaches the noise level.

Late, sparse data make the problem ill-posed: viscosity damps mode :math:`m` by
:math:`e^{-\nu m^2 t}` and shocks merge characteristics, so only the large
scales of :math:`u_0` are recoverable; the final state is recovered much better
than :math:`u_0`.
"""

from __future__ import annotations

import math

import torch

import deepsolve
from deepsolve.physics.burgers import Burgers1D, Grid1D, random_initial


class FourierInitialCondition(torch.nn.Module):
    r"""``u0(x) = a_0 + sum_{m=1}^{M} a_m cos(m k0 x) + b_m sin(m k0 x)`` on an ``n``-point grid.

    The trained parameters ``alpha`` (``M+1``) and ``beta`` (``M``), initialised to zero,
    are H1-whitened: :math:`a_m = \alpha_m / m`, :math:`b_m = \beta_m / m` for
    :math:`m \ge 1` and :math:`a_0 = \alpha_0`.  The H1 seminorm is then a plain sum of
    squares, and a per-parameter optimiser (Adam) moves mode :math:`m` of :math:`u_0` by
    about ``lr / m`` per step, so the poorly observed small scales do not jump about.
    """

    def __init__(self, n: int, modes: int, length: float = 2 * math.pi):
        super().__init__()
        if not 1 <= modes <= (n - 1) // 3:
            raise ValueError(f"modes must be in 1..{(n - 1) // 3} (the 2/3 rule on n={n}), "
                             f"got {modes}")
        self.n = n
        self.modes = modes
        self.k0 = 2 * math.pi / length
        self.alpha = torch.nn.Parameter(torch.zeros(modes + 1))
        self.beta = torch.nn.Parameter(torch.zeros(modes))

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)``: the cosine (``M+1``, with the mean) and sine (``M``) coefficients."""
        inv_m = 1.0 / torch.arange(1, self.modes + 1, dtype=self.beta.dtype,
                                   device=self.beta.device)
        return torch.cat((self.alpha[:1], self.alpha[1:] * inv_m)), self.beta * inv_m

    def spectrum(self) -> torch.Tensor:
        """rfft (``norm="forward"``) coefficients ``(n//2+1,)``: ``a_0``, ``(a_m - i b_m)/2``."""
        a, b = self.coefficients()
        re = torch.cat((a[:1], 0.5 * a[1:]))
        im = torch.cat((b.new_zeros(1), -0.5 * b))
        c = torch.complex(re, im)
        pad = c.new_zeros(self.n // 2 + 1 - (self.modes + 1))
        return torch.cat((c, pad))

    def forward(self) -> torch.Tensor:
        """``u0`` on the grid, shape ``(n,)``."""
        return torch.fft.irfft(self.spectrum(), n=self.n, norm="forward")

    def h1_seminorm(self) -> torch.Tensor:
        r"""Domain mean :math:`\langle u_x^2\rangle = \tfrac12\sum_m (m k_0)^2 (a_m^2 + b_m^2)
        = \tfrac12 k_0^2 \sum_{m\ge1} (\alpha_m^2 + \beta_m^2)`."""
        return 0.5 * self.k0**2 * (self.alpha[1:].pow(2).sum() + self.beta.pow(2).sum())


class BurgersAssimilation(deepsolve.Problem):
    defaults = {
        # trainer
        "iterations": 6,      # optimiser steps (each L-BFGS step evaluates the loss <= ~7 times)
        "lr": 1.0,            # L-BFGS step scale (with optimizer=adam use ~0.03)
        "steps": 500,         # solver steps through which we train (horizon T = steps * dt)
        "eval_every": 1,
        "snapshots": 0,       # 0 = store every step (tiny states); e.g. 20 for revolve
        "dtype": "float64",
        # optimiser
        "optimizer": "lbfgs",  # "lbfgs" (strong Wolfe line search) or "adam"
        "lbfgs_iters": 5,      # L-BFGS inner iterations per trainer iteration
        # physics and discretisation
        "n": 128,             # grid points on [0, 2 pi)
        "nu": 0.05,           # viscosity
        "dt": 0.01,           # solver step (advective CFL dt*max|u|*k_max ~ 0.5)
        "fine": 4,            # the truth uses dt / fine
        # truth and data
        "u0_seed": 1,         # seeds the true initial condition
        "u0_rms": 0.5,
        "u0_peak": 3.0,       # spectral peak (integer wavenumber) of the true u0
        "sensors": 12,        # observation points (grid points drawn from `seed`)
        "obs_times": 10,      # observation times, equally spaced in (T/2, T]
        "noise": 0.02,        # noise std, relative to the rms of the clean observations
        # model and regularisation
        "modes": 8,           # Fourier modes of the recovered u0
        "smoothness": 1e-4,   # weight of the H1 term
    }

    def build(self, ctx):
        cfg = ctx.cfg
        steps = int(cfg.steps)
        if steps < 2 * int(cfg.obs_times) or int(cfg.obs_times) < 1:
            raise ValueError(f"need 1 <= obs_times <= steps/2, got obs_times={cfg.obs_times}, "
                             f"steps={steps}")
        if not 1 <= int(cfg.sensors) <= int(cfg.n):
            raise ValueError(f"sensors must be in 1..n={cfg.n}, got {cfg.sensors}")
        grid = Grid1D(int(cfg.n))
        dtype, device = ctx.dtype, ctx.device
        solver = Burgers1D(grid, float(cfg.nu), float(cfg.dt))
        fine = Burgers1D(grid, float(cfg.nu), float(cfg.dt) / int(cfg.fine))

        u0_true = random_initial(grid, torch.Generator().manual_seed(int(cfg.u0_seed)),
                                 peak_wavenumber=float(cfg.u0_peak), rms=float(cfg.u0_rms),
                                 dtype=dtype, device=device)
        # observed step counts: steps/2 + j * (steps/2) / obs_times, j = 1..obs_times
        half = steps / 2
        counts = sorted({round(half + j * half / int(cfg.obs_times))
                         for j in range(1, int(cfg.obs_times) + 1)})
        sensors = torch.randperm(grid.n, generator=ctx.generator)[: int(cfg.sensors)].sort()[0]
        with torch.no_grad():  # the truth, with dt / fine
            u, states, done = u0_true, [], 0
            for c in counts:
                u = fine.advance(u, (c - done) * int(cfg.fine))
                done = c
                states.append(u)
            true_obs_states = torch.stack(states)  # (n_obs, n)
        sensors = sensors.to(device)
        clean = true_obs_states.index_select(-1, sensors)  # (n_obs, sensors)
        scale = clean.pow(2).mean().sqrt()
        noise = torch.randn(clean.shape, generator=ctx.generator, dtype=torch.float64)
        obs = clean + float(cfg.noise) * scale * noise.to(dtype=dtype, device=device)

        ctx.model = FourierInitialCondition(grid.n, int(cfg.modes), grid.length).to(
            device=device, dtype=dtype)
        ctx.data = {
            "grid": grid,
            "solver": solver,
            "sensors": sensors,
            "rows": torch.tensor([c - 1 for c in counts], device=device),
            "obs": obs,
            "clean_obs": clean,
            "obs_power": obs.pow(2).mean(),
            "u0_true": u0_true,
            "uT_true": true_obs_states[-1],
        }

    def step(self, ctx, u, i):
        u_next = ctx.data["solver"].step(u)
        return u_next, u_next.index_select(-1, ctx.data["sensors"])

    def _predict(self, ctx):
        u0 = ctx.model()
        uT, outs = ctx.unroll(self.step, u0)
        return u0, uT, outs.index_select(0, ctx.data["rows"])

    def residuals(self, ctx, iteration):
        _, _, pred = self._predict(ctx)
        d = ctx.data
        return {
            "misfit": (pred - d["obs"]).pow(2).mean() / d["obs_power"],
            "smoothness": ctx.model.h1_seminorm() / d["obs_power"],
        }

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
        return {"misfit": 1.0, "smoothness": float(ctx.cfg.smoothness)}

    def evaluate(self, ctx):
        d = ctx.data
        with torch.no_grad():
            u0, uT, pred = self._predict(ctx)

        def rel(a, b):
            return float((a - b).norm() / b.norm())

        return {
            "u0_rel_error": rel(u0, d["u0_true"]),
            "final_rel_error": rel(uT, d["uT_true"]),
            "obs_rel_error": rel(pred, d["clean_obs"]),
        }


problem = BurgersAssimilation()
