r"""Recover the diffusivity and the reaction rate of a stiff reaction–diffusion equation whose
every time step is an implicit (backward-Euler) solve, trained through the unrolled solver.

The model is Fisher–KPP on the periodic interval :math:`[0, 1)`,

.. math::

    u_t = D\,u_{xx} + r\,u\,(1 - u),

discretised on ``n`` points with spectral second derivatives and backward Euler in time,

.. math::

    u^{k+1} = u^k + \Delta t\,\bigl(D\,\partial_{xx} u^{k+1} + r\,u^{k+1}(1 - u^{k+1})\bigr).

Each step solves this nonlinear system by :func:`deepsolve.fixed_point` (Anderson by default)
on the map

.. math::

    v \mapsto (I - \Delta t D \partial_{xx})^{-1}\bigl(u^k + \Delta t\,r\,v(1 - v)\bigr)

(the diffusion inverted exactly by FFT: a contraction with factor about
:math:`\Delta t\,r\,\max|1 - 2v|`, whatever :math:`\Delta t D k_{\max}^2`; with the defaults
:math:`\Delta t D k_{\max}^2 \approx 4`, where explicit Euler would blow up), started from
:math:`u^k`, with ``backward="implicit"``: the gradient of each step comes from one adjoint
solve instead of from its iterations. The time loop is ``ctx.unroll(self.step, u0)``,
checkpointed with ``snapshots`` revolve slots (the inner solves are redone in the reverse
sweep), so memory is a few states whatever ``steps`` and the inner iteration counts.

Truth and data: :math:`D^\star` = ``D_true``, :math:`r^\star` = ``r_true``, a fixed initial
condition (two bumps on a background), the same discretisation (solved to ``tol=1e-13``);
``sensors`` fixed grid points observed every ``obs_every`` steps, with Gaussian noise of
``noise`` times the rms of the clean observations.

The model (:class:`Coefficients`) holds :math:`\log D` and :math:`\log r`, started at
``D_init`` and ``r_init``. Loss term ``misfit``: the mean squared observation misfit
relative to the mean square of the data. ``evaluate`` returns ``D_rel_error``,
``r_rel_error`` (:math:`|p - p^\star| / p^\star`) and ``param_error`` (the larger).

The optimiser is L-BFGS with a strong-Wolfe line search (two parameters, smooth loss). With the
defaults (4 trainer iterations, about 14 loss evaluations, 7–13 s for the whole ``deepsolve
train`` run on a busy 2-core CPU in float64, one torch thread: ``threads``), from a start 2x
off in each parameter (``D_init = 2 D*``, ``r_init = r*/2``), the misfit reaches the noise
level (``noise**2``) and ``D_rel_error`` is about 0.013, ``r_rel_error`` about 0.003: the
noise, not the optimiser, sets these (the diffusivity is the less observable of the two).
"""

from __future__ import annotations

import math

import torch

import deepsolve
from deepsolve.fixed_point import fixed_point


class Coefficients(torch.nn.Module):
    """``(D, r) = (exp(log_D), exp(log_r))``: positive by construction, O(1) parameters."""

    def __init__(self, D: float, r: float):
        super().__init__()
        self.log_D = torch.nn.Parameter(torch.tensor(math.log(D)))
        self.log_r = torch.nn.Parameter(torch.tensor(math.log(r)))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.log_D.exp(), self.log_r.exp()


def initial_condition(n: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Two smooth bumps on a background of 0.05, periodic on [0, 1)."""
    x = torch.arange(n, dtype=dtype, device=device) / n

    def bump(c, w):
        d = torch.remainder(x - c + 0.5, 1.0) - 0.5
        return torch.exp(-(d / w) ** 2)

    return 0.05 + 0.5 * bump(0.3, 0.05) + 0.8 * bump(0.7, 0.08)


class ImplicitHeat(deepsolve.Problem):
    defaults = {
        # trainer
        "iterations": 4,      # trainer iterations (each up to lbfgs_iters L-BFGS iterations)
        "lr": 1.0,            # L-BFGS step scale (with optimizer=adam use ~0.05)
        "steps": 40,          # backward-Euler steps (horizon T = steps * dt)
        "snapshots": 8,       # revolve slots of the time loop (0 = store every step)
        "eval_every": 1,
        "dtype": "float64",
        "optimizer": "lbfgs",  # "lbfgs" or "adam"
        "lbfgs_iters": 5,
        "threads": 1,         # torch threads (0 = leave as is): the ops are tiny, and extra
                              # threads only add synchronisation (~8x slower on a busy CPU)
        # physics and discretisation
        "n": 64,              # grid points on [0, 1)
        "dt": 0.025,
        "D_true": 4e-3,       # dt * D * k_max^2 ~ 4: stiff
        "r_true": 3.0,        # dt * r = 0.075: the fixed-point map contracts by ~0.08
        # the implicit solves
        "solver": "anderson",  # fixed_point solver: anderson, picard or broyden
        "tol": 1e-10,          # relative residual of each step's solve (and adjoint)
        "max_iter": 50,
        # data
        "sensors": 16,        # observed grid points (drawn from `seed`)
        "obs_every": 8,       # observation interval in steps (the last step is observed)
        "noise": 0.01,        # noise std relative to the rms of the clean observations
        # model
        "D_init": 8e-3,
        "r_init": 1.5,
    }

    def build(self, ctx):
        cfg = ctx.cfg
        n, steps, every = int(cfg.n), int(cfg.steps), int(cfg.obs_every)
        if not 1 <= every <= steps:
            raise ValueError(f"need 1 <= obs_every <= steps, got obs_every={every}, "
                             f"steps={steps}")
        if not 1 <= int(cfg.sensors) <= n:
            raise ValueError(f"sensors must be in 1..n={n}, got {cfg.sensors}")
        for key in ("D_true", "r_true", "D_init", "r_init", "dt"):
            if not float(getattr(cfg, key)) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(cfg, key)}")
        if int(cfg.threads) > 0:
            torch.set_num_threads(int(cfg.threads))
        dtype, device = ctx.dtype, ctx.device
        k = 2 * math.pi * torch.fft.rfftfreq(n, d=1.0 / n, dtype=dtype).to(device)
        sensors = torch.randperm(n, generator=ctx.generator)[: int(cfg.sensors)].sort()[0]
        sensors = sensors.to(device)
        rows = torch.arange(steps - 1, -1, -every, device=device).flip(0)  # ends at steps-1
        ctx.data = {"k2": k * k, "sensors": sensors, "rows": rows,
                    "u0": initial_condition(n, dtype, device)}
        truth = torch.tensor([float(cfg.D_true), float(cfg.r_true)], dtype=dtype,
                             device=device)
        with torch.no_grad():
            u, outs = ctx.data["u0"], []
            for i in range(steps):
                u, o = self._step(ctx, u, i, truth[0], truth[1], tol=1e-13)
                outs.append(o)
            clean = torch.stack(outs).index_select(0, rows)
        scale = clean.pow(2).mean().sqrt()
        noise = torch.randn(clean.shape, generator=ctx.generator, dtype=torch.float64)
        obs = clean + float(cfg.noise) * scale * noise.to(dtype=dtype, device=device)
        ctx.data.update(obs=obs, clean_obs=clean, obs_power=obs.pow(2).mean(), uT_true=u)
        ctx.model = Coefficients(float(cfg.D_init), float(cfg.r_init)).to(device=device,
                                                                           dtype=dtype)

    def _step(self, ctx, u, i, D, r, tol=None):
        """One backward-Euler step: ``(u_next, u_next at the sensors)``."""
        cfg, d = ctx.cfg, ctx.data
        dt = float(cfg.dt)
        n = u.shape[-1]
        inv = 1.0 / (1.0 + dt * D * d["k2"])  # (I - dt D d_xx)^{-1} in Fourier space

        def f(v):
            rhs = u + dt * r * v * (1.0 - v)
            return torch.fft.irfft(torch.fft.rfft(rhs) * inv, n=n)

        u_next = fixed_point(f, u, solver=str(cfg.solver),
                             tol=float(cfg.tol) if tol is None else tol,
                             max_iter=int(cfg.max_iter), backward="implicit")
        return u_next, u_next.index_select(-1, d["sensors"])

    def step(self, ctx, u, i):
        D, r = ctx.model()  # inside the step, so the unroll finds log_D and log_r
        return self._step(ctx, u, i, D, r)

    def _predict(self, ctx):
        uT, outs = ctx.unroll(self.step, ctx.data["u0"])
        return uT, outs.index_select(0, ctx.data["rows"])

    def residuals(self, ctx, iteration):
        d = ctx.data
        _, pred = self._predict(ctx)
        return {"misfit": (pred - d["obs"]).pow(2).mean() / d["obs_power"]}

    def optimizer(self, ctx, params):
        name = str(ctx.cfg.optimizer).lower()
        if name == "lbfgs":
            return torch.optim.LBFGS(params, lr=float(ctx.cfg.lr),
                                     max_iter=int(ctx.cfg.lbfgs_iters), history_size=10,
                                     line_search_fn="strong_wolfe")
        if name == "adam":
            return torch.optim.Adam(params, lr=float(ctx.cfg.lr))
        raise ValueError(f"optimizer must be 'lbfgs' or 'adam', got {ctx.cfg.optimizer!r}")

    def evaluate(self, ctx):
        cfg = ctx.cfg
        with torch.no_grad():
            D, r = ctx.model()
        d_err = abs(float(D) - float(cfg.D_true)) / float(cfg.D_true)
        r_err = abs(float(r) - float(cfg.r_true)) / float(cfg.r_true)
        return {"D_rel_error": d_err, "r_rel_error": r_err, "param_error": max(d_err, r_err)}


problem = ImplicitHeat()
