r"""Learned closure for coarse 2D Navier--Stokes, trained through the unrolled solver.

"Solver in the loop" (Um et al., NeurIPS 2020; Kochkov et al., PNAS 2021): a coarse
pseudo-spectral solver plus a small periodic CNN is trained so that *its own long rollouts*
follow a filtered fine-grid reference, with gradients taken through every coarse step.

Physics
-------
Forced 2D Navier--Stokes in vorticity form on the periodic square :math:`[0, 2\pi)^2`
(:mod:`deepsolve.physics.navier_stokes`),

.. math::

    \partial_t\omega + \mathbf u\cdot\nabla\omega = \nu\nabla^2\omega - \alpha\omega + f,
    \qquad f = -F_0 k_f\cos(k_f y)\quad\text{(Kolmogorov forcing)},

with viscosity ``nu``, linear drag ``alpha``, forcing amplitude ``forcing`` and integer
forcing wavenumber ``forcing_k``. Initial conditions are random smooth vorticity fields
(spectral peak ``ic_peak``, kinetic energy ``ic_energy``) run for ``spinup`` time units with
the fine solver, so that they carry the flow's own small scales rather than the random
field's. The defaults (``nu=0.005, alpha=0.1, forcing=1, forcing_k=4``) are a moderate
Reynolds number: the 64² reference agrees with a 128² run to 3-4 % over the horizon
:math:`T = 2`, whereas the 32² coarse solver, whose 2/3-dealiased dynamics keep only integer
wavenumbers :math:`|m| \le 10`, lacks the transfer to and from the unresolved scales. Its
error grows steadily and alike for every initial condition (relative L2 error about 0.13
after 0.2 time units, about 0.4 at :math:`T`): a systematic error, which a closure can
learn. Most of it is the advection term: the 2/3 rule keeps only the product's modes below
:math:`N/3`, while the filtered reference carries :math:`|m| \le 15` and the coarse dynamics
never feed the band :math:`11 \le |m| \le 15` (12-17 % of its norm). The same 32² solver
with its advection product formed on a 3/2-padded 48² grid (:func:`advection_error` added,
no learning) has error 0.169 at :math:`T` instead of 0.394; ``evaluate`` reports it
(``rel_err_padded``) beside the coarse solver, so the learned part of a closure's gain is
visible.

Reference data
--------------
A fine solver (``fine_n`` points per side, step ``dt / fine_substeps``) integrates
``n_train`` (seed ``data_seed``) and ``n_test`` (seed ``data_seed + 1``, so the held-out
initial conditions are disjoint from the training ones) initial conditions for the horizon
:math:`T` = ``steps * dt``. At ``n_obs = ceil(steps / obs_every)`` observation times the fine
vorticity is spectrally truncated to the coarse grid
(:func:`~deepsolve.physics.navier_stokes.filter_to`) and stored. The observation times are
spread evenly over the horizon, at coarse step counts ``round(k * steps / n_obs)``,
``k = 1..n_obs`` (:func:`observation_steps`): every ``obs_every`` steps when ``obs_every``
divides ``steps`` (the defaults: 100, 200, ..., 1000), otherwise as evenly as whole steps
allow, never more than ``obs_every`` apart, the last one at the horizon -- so any horizon
works: ``--steps 40`` observes once, at step 40; ``--steps 250`` at steps 83, 167 and 250. The
fine solver runs exactly to those step counts (``(count - previous) * fine_substeps`` fine
steps each), so the reference is the filtered fine solution at the very times the coarse
model is compared with it. The files are HDF5 under ``data_dir`` (default ``runs/data``) in
a PDEBench-like layout::

    ns_{split}_{hash}.h5              split = "train" or "test"
      vorticity   float32/64 (n_trajectories, n_times, coarse_n, coarse_n)  filtered fine
      t           float64 (n_times,)   times: 0 and observation_steps(steps, obs_every) * dt
      attrs       every parameter the data depend on (fine_n, coarse_n, nu, alpha, forcing,
                  forcing_k, dt, fine_substeps, steps, obs_every, ic_peak, ic_energy,
                  spinup, n_trajectories, seed, split, dtype, version), and obs_steps
                  (the observation step counts; a function of steps and obs_every)

``{hash}`` is a hash of those attributes, so any change of the settings that define the data
regenerates it and an unchanged configuration reuses the cache. Files are written to a
temporary name and moved into place with ``os.replace``, so a killed run never leaves a
broken cache (a cache that cannot be read is regenerated). The initial conditions are drawn
with a CPU generator, so the data do not depend on the device (up to rounding).

Model
-----
The model (:class:`Closure`, ``ctx.model``) is a periodic CNN (``depth`` circular 3x3
convolutions, ``width`` channels, GELU) plus a linear 1x1 skip, whose inputs are the
vorticity, the velocity it induces and, with ``features="advection"`` (the default), the
coarse advection's error :func:`advection_error` -- each computable from the coarse state
alone, each normalised by its rms over the training data; the learned coarse step is

.. math::

    \omega_{i+1} = \mathrm{NS}^{\text{coarse}}_{dt}(\omega_i) + dt\;\mathrm{CNN}_\theta(\omega_i).

The last convolution and the skip are initialised to zero, so the untrained model *is* the
uncorrected coarse solver. The state is a batch ``(B, N, N)`` of ``batch`` training windows
(:meth:`NavierStokesClosure.batch_size`; a distributed rank takes every ``world_size``-th
window of the iteration's batch).

Loss (``residuals``)
--------------------
Each iteration takes ``batch`` training windows (:meth:`windows`): with ``starts="any"``
(the default) a window of the iteration's horizon :math:`h` (``ctx.horizon``: ``steps``, or
the curriculum's stage) starts at a random observation time of a training trajectory and
ends within it, so short horizons see the whole trajectory; with ``starts="initial"`` every
window starts at :math:`t = 0`. From the window's filtered state it unrolls :math:`h`
learned coarse steps with ``ctx.unroll(self.step, x0, h)`` (checkpointed under the run's
``budget``/``snapshots``). The step returns per-step outputs, so the state is compared with
the reference at every observation time (every ``obs_every`` steps or as near as the
horizon allows) without storing the trajectory:

* ``misfit`` -- mean over observation times and windows of the relative L2 error
  :math:`\|\omega_i - \bar\omega_i\| / \|\bar\omega_i\|` (:math:`\bar\omega` the filtered
  reference); the gradient flows back through all :math:`h` steps;
* ``closure`` -- mean over steps of :math:`(T\,\|\mathrm{CNN}(\omega_i)\| / \|\omega_i\|)^2`,
  the size of the closure tendency relative to the state over the horizon, weighted by
  ``reg`` (a small penalty that keeps the correction no larger than the data ask for).

The learning rate decays from ``lr`` to ``lr * lr_final`` on a cosine (:meth:`scheduler`).
The default ``curriculum`` ``0:10%,30%:30%,60%:100%`` unrolls 100 steps for the first 30
iterations, 300 to the 60th, then 1000 (percentages of ``--iterations`` and ``--steps``);
benchmarks/horizons.py compares it with fixed horizons of 1 to 1000 steps at equal compute
(docs/unroll.md).

``evaluate`` rolls the ``n_test`` held-out initial conditions out to ``eval_multiple``
(4) times the horizon without gradients, with the learned, the uncorrected coarse and the
3/2-padded solver, and returns the mean relative L2 error
:math:`\|\omega_t - \bar\omega_t\| / \|\bar\omega_t\|` of each at :math:`T`, :math:`2T`
and :math:`4T` (``rel_err_closure``, ``rel_err_coarse``, ``rel_err_padded``, ``..._2T``,
``..._4T``), ``improvement`` = ``rel_err_coarse / rel_err_closure`` (> 1: the closure helps)
at each, the rollouts that blow up (``blowups``: a state that is not finite or 3 times the
reference's norm, charged an error of 2 from then on), the time at which each error reaches
0.5 (``t_half_*``) and the error curves against rollout time (``err_*``, logged as the curve
groups ``eval_err_*`` and drawn by ``deepsolve report`` in ``evaluation.png``).

Defaults and scaling up
-----------------------
The defaults (64² reference, 32² model, 8 + 8 trajectories, ``dt=0.002``, 100 iterations of
``batch=2`` windows on the curriculum 100 -> 300 -> 1000 steps, a 256 MiB budget for the
unroll's checkpoints) take about six minutes on a 2-core VM with one thread, reference
generation included (``make demo``, or ``python -m deepsolve train
problems/navier_stokes.py``; about 0.7, 1.5 and 5 s per iteration in the three stages). They
bring the mean held-out error at :math:`T` from 0.394 (coarse) to about 0.12
(``improvement`` about 3.4; the 3/2-padded solver without learning: 0.172), about 2.4x at
:math:`2T` and 1.2x at :math:`4T`, with no blow-ups (the README's table, generated from the
kept demo log by ``benchmarks/demo_table.py``). ``dt`` is far below the coarse CFL limit
here only because 1000 steps must fit in a horizon over which the flow stays predictable;
by :math:`4T` every model's error is near that of an uncorrelated field (1.41).

On a GPU the same file scales to large grids and 10^4-step unrolls, the budget bounding the
unroll's memory (revolve checkpointing keeps a few hundred states instead of 10^4 recorded
steps). Keep the ratio of the dissipation scale to the grids by scaling ``nu`` with
``(64 / fine_n)**2``, and the horizon ``steps * dt`` within the flow's predictability (about
2 time units here; lower ``nu``, weaker ``alpha`` or stronger ``forcing`` shorten it). For
example (not yet run on a GPU; check the reference first, e.g. ``fine_n=512`` against
``fine_n=1024`` on a few trajectories)::

    deepsolve train problems/navier_stokes.py --device cuda --budget 80% --iterations 500 \
        --steps 10000 --lr 3e-3 --set fine_n=512 --set coarse_n=256 --set nu=1e-4 \
        --set dt=0.0002 --set fine_substeps=2 --set obs_every=1000 --set n_train=64 \
        --set n_test=16 --set batch=8 --set width=32 --set depth=4 --set eval_every=50

``obs_every`` is the longest interval between observations (any ``steps`` works; see
"Reference data"); ``fine_n`` should be at least twice
``coarse_n``; ``dt / fine_substeps`` must satisfy the fine grid's CFL limit (roughly
``dt * max|u| * fine_n / 2 < 2``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import deepsolve
from deepsolve import Setting
from deepsolve.config import parse_curriculum
from deepsolve.physics import (
    Grid,
    NavierStokes2D,
    advection_hat,
    energy,
    filter_to,
    kolmogorov_forcing,
    random_initial,
    spectral_operators,
    to_physical,
    to_spectral,
    velocity,
)

#: Bump when the way the reference data is generated changes (invalidates caches).
DATA_VERSION = 1


def advection_error(omega: torch.Tensor, grid: Grid) -> torch.Tensor:
    r"""What the coarse solver's advection term gets wrong, computable from the coarse
    field alone: :math:`P_{N}\,J(\psi,\omega)` with the product formed on a grid of
    :math:`3N/2` points (Orszag's 3/2 rule: exact for every mode the :math:`N`-point field
    carries, :math:`|m| < N/2`) minus the coarse solver's :math:`P_{2/3}J(\psi,\omega)`
    (the product formed on the :math:`N`-point grid, modes above :math:`N/3` dropped and the
    kept ones aliased). ``(..., N, N) -> (..., N, N)``, physical space, units of vorticity
    per time.

    The 2/3-rule term is alias-free but keeps only the product's modes below :math:`N/3`;
    the filtered reference keeps modes up to :math:`N/2 - 1`, and the coarse dynamics never
    feed the band between (its transfer is exactly this term's high part). A closure given
    this input can restore that transfer; it learns how much of it to use.
    """
    n = grid.n
    big = Grid(3 * n // 2)
    ops_n = spectral_operators(grid, omega.dtype, omega.device)
    ops_b = spectral_operators(big, omega.dtype, omega.device)
    padded = to_spectral(filter_to(omega, big.n))
    exact = filter_to(to_physical(advection_hat(padded, ops_b, big.n), big.n), n)
    return exact - to_physical(advection_hat(to_spectral(omega), ops_n, n), n)


class Closure(nn.Module):
    """Periodic CNN closure: a vorticity tendency ``(..., N, N) -> (..., N, N)``.

    The input channels are the vorticity and the velocity ``(u, v)`` it induces (computed
    spectrally on the ``n``-point grid), divided by ``scale`` (vorticity rms) and
    ``velocity_scale``, and with ``features="advection"`` the coarse solver's advection error
    (:func:`advection_error`) divided by ``advection_scale``; then ``depth`` circular 3x3
    convolutions with ``width`` channels and GELU, plus a linear 1x1 skip from the inputs;
    the output is multiplied by ``scale``. The last convolution and the skip start at zero,
    so the closure is exactly zero before training.
    """

    def __init__(self, n: int, width: int = 16, depth: int = 3, scale: float = 1.0,
                 velocity_scale: float = 1.0, features: str = "advection",
                 advection_scale: float = 1.0):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if features not in ("state", "advection"):
            raise ValueError(f"features must be 'state' or 'advection', got {features!r}")
        self.grid = Grid(n)
        self.features = features
        layers: list[nn.Module] = []
        c_in = n_in = 3 + (features == "advection")
        for _ in range(depth - 1):
            layers += [nn.Conv2d(c_in, width, 3, padding=1, padding_mode="circular"), nn.GELU()]
            c_in = width
        last = nn.Conv2d(c_in, 1, 3, padding=1, padding_mode="circular")
        self.skip = nn.Conv2d(n_in, 1, 1, bias=False)
        for m in (last, self.skip):
            nn.init.zeros_(m.weight)
        nn.init.zeros_(last.bias)
        layers.append(last)
        self.net = nn.Sequential(*layers)
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.register_buffer("velocity_scale", torch.tensor(float(velocity_scale)))
        self.register_buffer("advection_scale", torch.tensor(float(advection_scale)))

    def forward(self, omega: torch.Tensor) -> torch.Tensor:
        shape = omega.shape
        u, v = velocity(omega, self.grid)
        channels = [omega / self.scale, u / self.velocity_scale, v / self.velocity_scale]
        if self.features == "advection":
            channels.append(advection_error(omega, self.grid) / self.advection_scale)
        x = torch.stack(channels, dim=-3).reshape(-1, len(channels), *shape[-2:])
        return ((self.net(x) + self.skip(x)) * self.scale).reshape(shape)


# ----------------------------------------------------------------------------------------
# reference data


def _data_attrs(cfg, split: str, n_traj: int, seed: int, dtype: torch.dtype,
                repeats: int = 1, obs_every: int | None = None) -> dict:
    steps = int(cfg.steps)
    obs_every = int(cfg.obs_every if obs_every is None else obs_every)
    attrs = {
        "version": DATA_VERSION,
        "split": split,
        "n_trajectories": int(n_traj),
        "seed": int(seed),
        "fine_n": int(cfg.fine_n),
        "coarse_n": int(cfg.coarse_n),
        "nu": float(cfg.nu),
        "alpha": float(cfg.alpha),
        "forcing": float(cfg.forcing),
        "forcing_k": int(cfg.forcing_k),
        "dt": float(cfg.dt),
        "fine_substeps": int(cfg.fine_substeps),
        "steps": steps,
        "obs_every": obs_every,
        "ic_peak": float(cfg.ic_peak),
        "ic_energy": float(cfg.ic_energy),
        "spinup": float(cfg.spinup),
        "domain_length": 2 * math.pi,
        "dtype": str(dtype).replace("torch.", ""),
    }
    if repeats > 1:  # (absent for one horizon, so those files keep their names)
        attrs["repeats"] = int(repeats)
    return attrs


def _check_features(value) -> None:
    if value not in ("state", "advection"):
        raise ValueError(f"--set features={value}: use features=state (vorticity and "
                         "velocity) or features=advection (and the coarse advection's error)")


def _check_starts(value) -> None:
    if value not in ("initial", "any"):
        raise ValueError(f"--set starts={value}: use starts=initial (every window starts at "
                         "t = 0) or starts=any (a random observation time)")


#: A held-out trajectory *blows up* when its state is not finite or its norm exceeds this
#: many times the reference's; its error then counts as :data:`ERROR_CAP`.
BLOWUP_NORM = 3.0
#: The relative error a blown-up trajectory counts as (a field of the reference's energy but
#: uncorrelated with it has relative error sqrt(2) = 1.41).
ERROR_CAP = 2.0


def observation_steps(steps: int, obs_every: int) -> list[int]:
    """Coarse step counts of the observation times: ``n_obs = ceil(steps / obs_every)``
    counts ``round(k * steps / n_obs)`` (halves up), ``k = 1..n_obs``. Strictly increasing,
    at most ``obs_every`` apart, the last equal to ``steps``; ``k * obs_every`` exactly when
    ``obs_every`` divides ``steps``. One-line ``ValueError`` unless both are >= 1."""
    steps, obs_every = int(steps), int(obs_every)
    if steps < 1 or obs_every < 1:
        raise ValueError(f"navier_stokes: steps and obs_every must be >= 1, got steps={steps}, "
                         f"obs_every={obs_every}")
    n_obs = -(-steps // obs_every)
    return [(2 * k * steps + n_obs) // (2 * n_obs) for k in range(1, n_obs + 1)]


def window_spacing(steps: int, obs_every: int, lengths=()) -> int:
    """The observation spacing of ``starts=any``: the largest divisor of
    ``gcd(steps, *lengths)`` that is at most ``obs_every``, so that windows of every length
    (the curriculum's stages) start and end on observation times and none is observed
    less often than every ``obs_every`` steps. ``window_spacing(1000, 100, (100, 300))``
    is 100; ``window_spacing(40, 100, (4, 12))`` is 4; ``window_spacing(15, 10)`` is 5."""
    g = math.gcd(int(steps), *[int(n) for n in lengths])
    return max(d for d in range(1, min(g, int(obs_every)) + 1) if g % d == 0)


def reference_steps(steps: int, obs_every: int, repeats: int = 1) -> list[int]:
    """Observation step counts of ``repeats`` consecutive horizons of ``steps``: those of
    :func:`observation_steps` for the first, shifted by ``steps`` for each next one, so every
    multiple ``m * steps`` (``m <= repeats``) is observed."""
    counts = observation_steps(steps, obs_every)
    return [m * int(steps) + c for m in range(int(repeats)) for c in counts]


def generate_reference(attrs: dict, device: torch.device, dtype: torch.dtype,
                       chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Fine-grid trajectories filtered to the coarse grid.

    Returns ``(vorticity (n_traj, n_times, coarse_n, coarse_n), t (n_times,))`` on the CPU.
    Initial conditions are drawn on the fine grid from ``attrs["seed"]`` (CPU generator, so
    the data do not depend on the device up to rounding); trajectories are integrated in
    chunks of ``chunk`` on ``device``.
    """
    fine = Grid(attrs["fine_n"])
    nc = attrs["coarse_n"]
    sub = attrs["fine_substeps"]
    counts = reference_steps(attrs["steps"], attrs["obs_every"], attrs.get("repeats", 1))
    n_obs = len(counts)
    force = kolmogorov_forcing(fine, attrs["forcing"], attrs["forcing_k"], dtype=dtype,
                               device=device)
    solver = NavierStokes2D(fine, nu=attrs["nu"], dt=attrs["dt"] / sub, alpha=attrs["alpha"],
                            forcing=force)
    gen = torch.Generator().manual_seed(attrs["seed"])
    w0 = random_initial(fine, gen, (attrs["n_trajectories"],), peak_wavenumber=attrs["ic_peak"],
                        energy_level=attrs["ic_energy"], dtype=dtype)
    out = torch.empty(attrs["n_trajectories"], n_obs + 1, nc, nc, dtype=dtype)
    with torch.no_grad():
        for a in range(0, attrs["n_trajectories"], chunk):
            w = w0[a:a + chunk].to(device)
            w = solver.advance(w, round(attrs["spinup"] / attrs["dt"]) * sub)
            out[a:a + chunk, 0] = filter_to(w, nc).cpu()
            done = 0
            for k, count in enumerate(counts, start=1):
                w = solver.advance(w, (count - done) * sub)
                done = count
                out[a:a + chunk, k] = filter_to(w, nc).cpu()
    if not torch.isfinite(out).all():
        raise FloatingPointError("the fine reference solution blew up; lower dt (CFL) or "
                                 "raise fine_substeps")
    t = torch.tensor([0, *counts], dtype=torch.float64) * attrs["dt"]
    return out, t


def _reference(attrs: dict, device: torch.device, dtype: torch.dtype):
    """What :meth:`deepsolve.Context.cache` stores for ``attrs``: ``(compute, extra
    attributes)``."""

    def compute():
        vort, t = generate_reference(attrs, device, dtype)
        return {"vorticity": vort, "t": t}

    info = {"obs_steps": reference_steps(attrs["steps"], attrs["obs_every"],
                                         attrs.get("repeats", 1)),
            "description": "2D Kolmogorov flow with drag, fine-grid vorticity spectrally "
                           "filtered to the coarse grid; vorticity[trajectory, time, x, y]"}
    return compute, info


# ----------------------------------------------------------------------------------------
# the problem


class NavierStokesClosure(deepsolve.Problem):
    """Train a CNN closure through ``steps`` unrolled coarse Navier--Stokes steps."""

    defaults = {
        # trainer
        "iterations": 100,
        "lr": 1e-2,
        "lr_final": Setting(0.1, "cosine decay to lr * lr_final at the last iteration",
                            low=0.0, allowed=">= 0"),
        "steps": 1000,          # coarse steps per unroll (horizon T = steps * dt)
        # the horizon grows: 100 steps for the first 30 iterations, 300 to the 60th, then
        # 1000 (percentages of --steps and --iterations; benchmarks/horizons.py)
        "curriculum": "0:10%,30%:30%,60%:100%",
        "eval_every": 25,
        "memory_every": 10,     # tracked-memory meter every 10 iterations (it costs ~1 s)
        "budget": "256MiB",     # memory for the unroll's checkpoints (store_all: ~1.3 GB)
        "dtype": "float32",
        # physics
        "nu": Setting(0.005, "viscosity", low=0.0, allowed=">= 0"),
        "alpha": Setting(0.1, "linear drag", low=0.0, allowed=">= 0"),
        "forcing": Setting(1.0, "Kolmogorov forcing amplitude F0"),
        "forcing_k": Setting(4, "forcing wavenumber", low=1, allowed=">= 1"),
        "ic_peak": Setting(4.0, "spectral peak of the random initial vorticity", low=0.0,
                           allowed=">= 0"),
        "ic_energy": Setting(0.5, "kinetic energy of the random initial vorticity", low=0.0,
                             allowed=">= 0"),
        "spinup": Setting(0.5, "fine-solver time before t = 0 (removes the IC transient)",
                          low=0.0, allowed=">= 0"),
        # discretisation and data
        "fine_n": Setting(64, "reference grid (>= coarse_n)", low=4, allowed=">= 4"),
        "coarse_n": Setting(32, "model grid", low=4, allowed=">= 4"),
        "dt": Setting(0.002, "coarse step"),
        "fine_substeps": Setting(1, "the reference steps with dt / fine_substeps", low=1,
                                 allowed=">= 1"),
        "obs_every": Setting(100, "longest interval between observation times, in coarse "
                             "steps", low=1, allowed=">= 1"),
        "n_train": Setting(8, "training trajectories", low=1, allowed=">= 1"),
        "n_test": Setting(8, "held-out trajectories (ICs from data_seed + 1)", low=1,
                          allowed=">= 1"),
        "batch": Setting(2, "training windows per iteration (each a trajectory and a start)",
                         low=1, allowed=">= 1"),
        "starts": Setting("any", "where training windows start: 'initial' (t = 0) or "
                          "'any' (a random observation time; observed every "
                          "window_spacing() steps)",
                          check=_check_starts),
        "eval_multiple": Setting(4, "held-out rollouts run to eval_multiple * steps (errors at "
                                 "1, 2, 4, ... times the horizon)", low=1, allowed=">= 1"),
        "data_seed": Setting(1234, "seed of the training ICs (held-out: data_seed + 1)"),
        "data_dir": Setting("runs/data", "where the reference trajectories are cached"),
        # model and regularisation
        "width": Setting(8, "CNN channels", low=1, allowed=">= 1"),
        "depth": Setting(3, "CNN convolutions", low=1, allowed=">= 1"),
        "reg": Setting(1e-4, "weight of the closure-size term", low=0.0, allowed=">= 0"),
        "features": Setting("advection", "closure inputs: 'state' (vorticity, velocity) or "
                            "'advection' (and the coarse advection's error)",
                            check=_check_features),
    }

    # -- setup ---------------------------------------------------------------------------

    def build(self, ctx):
        cfg = ctx.cfg
        if int(cfg.fine_n) < int(cfg.coarse_n):
            raise ValueError(f"fine_n={cfg.fine_n} must be >= coarse_n={cfg.coarse_n}")
        if cfg.starts == "initial" and not 1 <= int(cfg.batch) <= int(cfg.n_train):
            raise ValueError(f"batch must be in 1..n_train={cfg.n_train} with starts=initial, "
                             f"got {cfg.batch}; or --set starts=any")
        stages = parse_curriculum(getattr(cfg, "curriculum", ""),
                                  getattr(cfg, "iterations", None), int(cfg.steps))
        lengths = [n for _, n in stages]
        every = int(cfg.obs_every)
        if cfg.starts == "any":  # windows start and end on observation times
            every = window_spacing(int(cfg.steps), every, lengths)
        counts = observation_steps(cfg.steps, every)
        if lengths and min(lengths) < counts[0]:
            raise ValueError(f"curriculum={cfg.curriculum}: a stage of {min(lengths)} steps "
                             f"ends before the first observation (step {counts[0]}); lower "
                             "obs_every, lengthen the stages (--set curriculum= for none) or "
                             "--set starts=any")
        dtype, device = ctx.dtype, ctx.device
        data_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        data = {}
        repeats = int(cfg.eval_multiple)
        for split, n, seed, rep in (("train", int(cfg.n_train), int(cfg.data_seed), 1),
                                    ("test", int(cfg.n_test), int(cfg.data_seed) + 1, repeats)):
            attrs = _data_attrs(cfg, split, n, seed, data_dtype, rep, every)
            compute, info = _reference(attrs, device, data_dtype)
            name = f"ns_{split}"
            vort = ctx.cache(name, attrs, compute, directory=cfg.data_dir, attrs=info)["vorticity"]
            path, generated = ctx.cached[name]
            data[split] = vort.to(device=device, dtype=dtype)
            data[f"{split}_path"] = path
            data[f"{split}_generated"] = generated
        grid = Grid(int(cfg.coarse_n))
        force = kolmogorov_forcing(grid, float(cfg.forcing), int(cfg.forcing_k), dtype=dtype,
                                   device=device)
        data["coarse"] = NavierStokes2D(grid, nu=float(cfg.nu), dt=float(cfg.dt),
                                        alpha=float(cfg.alpha), forcing=force)
        scale = float(data["train"].pow(2).mean().sqrt())
        vscale = float((2 * energy(data["train"], grid).mean()).sqrt())
        features = str(cfg.features)
        ascale = 1.0
        if features == "advection":
            sample = data["train"][:, :: max(1, data["train"].shape[1] // 8)]
            ascale = float(advection_error(sample, grid).pow(2).mean().sqrt())
        ctx.model = Closure(grid.n, int(cfg.width), int(cfg.depth), scale, vscale, features,
                            ascale).to(device=device, dtype=dtype)
        data["batch_ref"] = None
        data["window_index"] = {}
        data["obs_steps"] = counts
        data["obs_every"] = every
        data["test_steps"] = reference_steps(cfg.steps, every, repeats)
        ctx.data = data

    def batch_size(self, ctx) -> int:
        return int(ctx.cfg.batch)

    def scheduler(self, ctx, optimizer):
        """Cosine decay of the learning rate from ``lr`` to ``lr * lr_final`` over the run
        (the trainer steps it once per iteration); ``lr_final=1`` keeps it constant."""
        total = max(int(ctx.cfg.iterations), 1)
        final = float(ctx.cfg.lr_final)

        def factor(it):
            return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(it, total) / total))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def weights(self, ctx):
        return {"misfit": 1.0, "closure": float(ctx.cfg.reg)}

    # -- the learned coarse step ---------------------------------------------------------

    def advance(self, ctx, omega: torch.Tensor, solver: str = "closure"):
        """One coarse step of ``solver``; returns ``(next, tendency added or None)``.

        ``"closure"``: the coarse step plus ``dt`` times the learned closure;
        ``"coarse"``: the uncorrected coarse step; ``"padded"``: the coarse step plus ``dt``
        times :func:`advection_error`, i.e. the coarse solver with its advection product
        formed on a 3/2-padded grid (no learning: the reference that shows how much of a
        closure's gain is the resolved advection alone).
        """
        nxt = ctx.data["coarse"].step(omega)
        if solver == "coarse":
            return nxt, None
        if solver == "closure":
            c = ctx.model(omega)
        else:
            c = advection_error(omega, ctx.data["coarse"].grid)
        return nxt + float(ctx.cfg.dt) * c, c

    def step(self, ctx, omega, i):
        """Learned step ``i``; outputs ``(misfit_i, closure_i)``, each of shape ``(B,)``.

        ``misfit_i`` is the relative squared error against the reference at observation
        steps (``i + 1`` in :func:`observation_steps`) and zero otherwise; ``closure_i`` is
        ``(T * |CNN(omega_i)| / |omega_i|)**2``. The reference of the current batch is
        ``ctx.data["batch_ref"]`` (set by :meth:`residuals`).
        """
        cfg = ctx.cfg
        nxt, c = self.advance(ctx, omega)
        dims = (-2, -1)
        horizon = float(cfg.steps) * float(cfg.dt)
        closure = (c * horizon).pow(2).sum(dims) / omega.pow(2).sum(dims)
        k = ctx.data["window_index"].get(i + 1)
        ref = ctx.data["batch_ref"]
        if k is not None and ref is not None:
            target = ref[k]
            misfit = (nxt - target).pow(2).sum(dims) / target.pow(2).sum(dims)
        else:
            misfit = nxt.new_zeros(nxt.shape[:-2])
        return nxt, (misfit, closure)

    # -- loss and metrics ----------------------------------------------------------------

    def batch_indices(self, ctx, iteration: int) -> torch.Tensor:
        """Training trajectories of ``iteration`` with ``starts=initial`` (the same on every
        rank, reproducible on resume); a distributed rank takes every ``world_size``-th."""
        cfg = ctx.cfg
        g = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + int(iteration))
        idx = torch.randperm(int(cfg.n_train), generator=g)[: int(cfg.batch)]
        if ctx.world_size > 1:
            idx = idx[ctx.rank::ctx.world_size]
        return idx

    def windows(self, ctx, iteration: int, steps: int):
        """The training windows of ``iteration`` for a horizon of ``steps``:
        ``(trajectories (B,), reference indices (B, K + 1), observation counts (K,))``.

        ``starts=initial``: the trajectories of :meth:`batch_indices`, each from ``t = 0``,
        observed at the :func:`observation_steps` counts within ``steps``.
        ``starts=any``: ``batch`` distinct (trajectory, start) pairs drawn from the
        ``n_train * ((cfg.steps - steps) // s + 1)`` windows that end within the reference,
        each starting at an observation time and observed every ``s`` steps
        (``steps // s`` observations), ``s`` = :func:`window_spacing` of ``steps``,
        ``obs_every`` and the curriculum's stages; so a one-step horizon with ``obs_every=1``
        is one-step, "a-priori", training on every pair of the reference.
        """
        cfg = ctx.cfg
        every = int(ctx.data["obs_every"])
        if cfg.starts == "initial":
            counts = [c for c in ctx.data["obs_steps"] if c <= steps]
            traj = self.batch_indices(ctx, iteration)
            index = torch.arange(len(counts) + 1).expand(len(traj), -1)
            return traj, index, counts
        n_obs = steps // every
        counts = [m * every for m in range(1, n_obs + 1)]
        n_starts = (int(cfg.steps) - steps) // every + 1
        total = int(cfg.n_train) * n_starts
        if int(cfg.batch) > total:
            raise ValueError(f"batch={cfg.batch} exceeds the {total} training windows of "
                             f"{steps} steps (n_train={cfg.n_train} x {n_starts} starts); "
                             "lower batch")
        g = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + int(iteration))
        pick = torch.randperm(total, generator=g)[: int(cfg.batch)]
        if ctx.world_size > 1:
            pick = pick[ctx.rank::ctx.world_size]
        traj, start = pick // n_starts, pick % n_starts
        index = start[:, None] + torch.arange(n_obs + 1)
        return traj, index, counts

    def residuals(self, ctx, iteration):
        steps = int(ctx.horizon)  # cfg.steps, or the stage of --set curriculum=...
        traj, index, counts = self.windows(ctx, iteration, steps)
        if traj.numel() == 0:
            raise ValueError(f"batch={ctx.cfg.batch} is smaller than the number of processes "
                             f"({ctx.world_size}); every rank needs a trajectory")
        if not counts:
            first = ctx.data["obs_steps"][0] if ctx.cfg.starts == "initial" else \
                int(ctx.data["obs_every"])
            raise ValueError(f"a horizon of {steps} steps ends before the first observation "
                             f"(step {first}); start the curriculum at that many steps or more")
        train = ctx.data["train"]
        ref = train[traj.to(train.device)[:, None], index.to(train.device)]  # (B, K+1, N, N)
        ref = ref.transpose(0, 1)                                            # (K+1, B, N, N)
        ctx.data["batch_ref"] = ref
        ctx.data["window_index"] = {c: k for k, c in enumerate(counts, start=1)}
        _, (sq, closure) = ctx.unroll(self.step, ref[0], steps)
        rows = torch.tensor([c - 1 for c in counts], device=sq.device)
        rel = sq.index_select(0, rows).sqrt()  # (K, B) at the observation times
        return {"misfit": rel.mean(), "closure": closure.mean()}

    def rollout(self, ctx, omega: torch.Tensor, n_steps: int, solver: str = "closure"):
        """Plain (no-grad) rollout of ``solver`` (:meth:`advance`)."""
        with torch.no_grad():
            for _ in range(n_steps):
                omega, _ = self.advance(ctx, omega, solver)
        return omega

    def rollout_errors(self, ctx, solver: str = "closure") -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out rollouts of ``solver`` to ``eval_multiple * steps``: ``(errors (n_obs, n_test),
        blown up (n_test,) bool)``, the relative L2 error against the filtered reference at
        every reference observation (``ctx.data["test_steps"]``). A trajectory *blows up*
        when its state stops being finite or its norm exceeds :data:`BLOWUP_NORM` times the
        reference's; from then on its error counts as :data:`ERROR_CAP`."""
        test = ctx.data["test"]
        dims = (-2, -1)
        w = test[:, 0]
        blown = torch.zeros(test.shape[0], dtype=torch.bool, device=test.device)
        errors, done = [], 0
        with torch.no_grad():
            for k, count in enumerate(ctx.data["test_steps"], start=1):
                w = self.rollout(ctx, w, count - done, solver)
                done = count
                ref = test[:, k]
                ref_norm = ref.pow(2).sum(dims).sqrt()
                err = (w - ref).pow(2).sum(dims).sqrt() / ref_norm
                blown |= ~torch.isfinite(err) | (w.pow(2).sum(dims).sqrt() > BLOWUP_NORM * ref_norm)
                errors.append(torch.where(blown, torch.full_like(err, ERROR_CAP), err))
        return torch.stack(errors), blown

    def evaluate(self, ctx):
        """Held-out metrics: the mean relative L2 error of the closure and of the coarse
        solver at the horizon ``T`` (``rel_err_closure``, ``rel_err_coarse``,
        ``improvement``) and of the unlearned 3/2-padded solver (``rel_err_padded``,
        :meth:`advance`), at the horizon ``T`` and at each multiple ``m T`` in 2, 4, 8, ... up
        to ``eval_multiple`` (``..._{m}T``); ``blowups``, the held-out trajectories that blew
        up (:meth:`rollout_errors`); ``t_half_closure`` / ``_coarse`` / ``_padded``, the time
        at which the mean error first reaches 0.5 (linear between observations; ``inf`` if
        never); and the curves ``err_closure`` / ``err_coarse`` / ``err_padded`` of the mean
        error against the rollout step (:class:`deepsolve.Curve`)."""
        cfg = ctx.cfg
        steps, dt = int(cfg.steps), float(cfg.dt)
        counts = ctx.data["test_steps"]
        if "coarse_errors" not in ctx.data:  # the references do not change
            ctx.data["coarse_errors"] = self.rollout_errors(ctx, "coarse")[0].mean(1)
            ctx.data["padded_errors"] = self.rollout_errors(ctx, "padded")[0].mean(1)
        base, padded = ctx.data["coarse_errors"], ctx.data["padded_errors"]
        errors, blown = self.rollout_errors(ctx, "closure")
        err = errors.mean(1)
        out: dict = {}
        multiples = [1] + [m for m in (2, 4, 8, 16, 32) if m <= int(cfg.eval_multiple)]
        for m in multiples:
            j = counts.index(m * steps)
            tag = "" if m == 1 else f"_{m}T"
            out[f"rel_err_closure{tag}"] = float(err[j])
            out[f"rel_err_coarse{tag}"] = float(base[j])
            out[f"rel_err_padded{tag}"] = float(padded[j])
            out[f"improvement{tag}"] = float(base[j]) / max(float(err[j]), 1e-30)
        out["blowups"] = float(blown.sum())
        for name, e in (("closure", err), ("coarse", base), ("padded", padded)):
            out[f"t_half_{name}"] = _first_crossing(counts, e.tolist(), 0.5) * dt
            out[f"err_{name}"] = deepsolve.Curve([0, *counts], [0.0, *e.tolist()])
        return out


def _first_crossing(counts: list[int], values: list[float], level: float) -> float:
    """The first step count at which ``values`` (observed at ``counts``, 0 at step 0) reaches
    ``level``, linear between observations; ``inf`` if it never does."""
    prev_c, prev_v = 0, 0.0
    for c, v in zip(counts, values, strict=True):
        if v >= level:
            return prev_c + (c - prev_c) * (level - prev_v) / (v - prev_v)
        prev_c, prev_v = c, v
    return math.inf


problem = NavierStokesClosure()
