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
learn. Part of it cannot be learned quickly: the filtered reference keeps
:math:`|m| \le 15`, and the band :math:`11 \le |m| \le 15` (12-17 % of its norm), which the
coarse dynamics never feed, is lost by both models within the first 0.2 time units.

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
convolutions, ``width`` channels, GELU) whose inputs are the vorticity and the velocity it
induces, normalised by the reference rms; the learned coarse step is

.. math::

    \omega_{i+1} = \mathrm{NS}^{\text{coarse}}_{dt}(\omega_i) + dt\;\mathrm{CNN}_\theta(\omega_i).

The last convolution is initialised to zero, so the untrained model *is* the uncorrected
coarse solver. The state is a batch ``(B, N, N)`` of ``batch`` trajectories
(:meth:`NavierStokesClosure.batch_size`; a distributed rank takes every
``world_size``-th trajectory of the iteration's batch).

Loss (``residuals``)
--------------------
Each iteration takes ``batch`` training trajectories, starts from their filtered initial
vorticity and unrolls ``steps`` learned coarse steps with ``ctx.unroll(self.step, x0, steps)``
(checkpointed under the run's ``budget``/``snapshots``). The step returns per-step outputs,
so the state is compared with the reference at every observation time (every ``obs_every``
steps or as near as the horizon allows, the last one at :math:`T`) without storing the trajectory:

* ``misfit`` -- mean over observation times and trajectories of the relative L2 error
  :math:`\|\omega_i - \bar\omega_i\| / \|\bar\omega_i\|` (:math:`\bar\omega` the filtered
  reference); the gradient flows back through all ``steps`` steps;
* ``closure`` -- mean over steps of :math:`(T\,\|\mathrm{CNN}(\omega_i)\| / \|\omega_i\|)^2`,
  the size of the closure tendency relative to the state over the horizon, weighted by
  ``reg`` (a small penalty that keeps the correction no larger than the data ask for).

The learning rate decays from ``lr`` to ``lr * lr_final`` on a cosine (:meth:`scheduler`).

``evaluate`` rolls out the ``n_test`` held-out initial conditions for the same horizon without
gradients and returns ``rel_err_closure`` and ``rel_err_coarse``, the mean relative L2 error
:math:`\|\omega_T - \bar\omega_T\| / \|\bar\omega_T\|` of the learned and of the uncorrected
coarse solver, and ``improvement`` = ``rel_err_coarse / rel_err_closure`` (> 1: the closure
helps).

Defaults and scaling up
-----------------------
The defaults (64² reference, 32² model, 8 + 8 trajectories, unrolls of ``steps=1000`` coarse
steps of ``dt=0.002`` with ``batch=2`` trajectories, 30 iterations, a 256 MiB budget for the
unroll's checkpoints) take about three minutes on a 2-core VM, reference generation included:
5.0-5.7 s per iteration measured in quiet runs with one and two threads (``make demo``, or
``python -m deepsolve train problems/navier_stokes.py``, then ``python -m deepsolve report
RUN_DIR`` for the median iteration time; ``benchmarks/threads.py --demo`` in
docs/problems.md#threads; several times longer beside other jobs). They bring the mean
held-out error at :math:`T` from 0.39 (coarse) to about 0.32 (``improvement`` about 1.25:
the README's table, generated from the kept demo log by ``benchmarks/demo_table.py``). More
iterations keep improving it. ``dt``
is far below the coarse CFL limit here only because 1000 steps must fit in a horizon over
which the flow stays predictable.

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
from deepsolve.physics import (
    Grid,
    NavierStokes2D,
    energy,
    filter_to,
    kolmogorov_forcing,
    random_initial,
    velocity,
)

#: Bump when the way the reference data is generated changes (invalidates caches).
DATA_VERSION = 1


class Closure(nn.Module):
    """Periodic CNN closure: a vorticity tendency ``(..., N, N) -> (..., N, N)``.

    The input channels are the vorticity and the velocity ``(u, v)`` it induces (computed
    spectrally on the ``n``-point grid), divided by ``scale`` (vorticity rms) and
    ``velocity_scale``; then ``depth`` circular 3x3 convolutions with ``width`` channels and
    GELU; the output is multiplied by ``scale``. The last convolution starts at zero, so the
    closure is exactly zero before training.
    """

    def __init__(self, n: int, width: int = 16, depth: int = 3, scale: float = 1.0,
                 velocity_scale: float = 1.0):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.grid = Grid(n)
        layers: list[nn.Module] = []
        c_in = 3
        for _ in range(depth - 1):
            layers += [nn.Conv2d(c_in, width, 3, padding=1, padding_mode="circular"), nn.GELU()]
            c_in = width
        last = nn.Conv2d(c_in, 1, 3, padding=1, padding_mode="circular")
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        layers.append(last)
        self.net = nn.Sequential(*layers)
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.register_buffer("velocity_scale", torch.tensor(float(velocity_scale)))

    def forward(self, omega: torch.Tensor) -> torch.Tensor:
        shape = omega.shape
        u, v = velocity(omega, self.grid)
        x = torch.stack((omega / self.scale, u / self.velocity_scale, v / self.velocity_scale),
                        dim=-3)
        x = x.reshape(-1, 3, *shape[-2:])
        return (self.net(x) * self.scale).reshape(shape)


# ----------------------------------------------------------------------------------------
# reference data


def _data_attrs(cfg, split: str, n_traj: int, seed: int, dtype: torch.dtype) -> dict:
    steps, obs_every = int(cfg.steps), int(cfg.obs_every)
    return {
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
    counts = observation_steps(attrs["steps"], attrs["obs_every"])
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

    info = {"obs_steps": observation_steps(attrs["steps"], attrs["obs_every"]),
            "description": "2D Kolmogorov flow with drag, fine-grid vorticity spectrally "
                           "filtered to the coarse grid; vorticity[trajectory, time, x, y]"}
    return compute, info


# ----------------------------------------------------------------------------------------
# the problem


class NavierStokesClosure(deepsolve.Problem):
    """Train a CNN closure through ``steps`` unrolled coarse Navier--Stokes steps."""

    defaults = {
        # trainer
        "iterations": 30,
        "lr": 1e-2,
        "lr_final": Setting(0.1, "cosine decay to lr * lr_final at the last iteration",
                            low=0.0, allowed=">= 0"),
        "steps": 1000,          # coarse steps per unroll (horizon T = steps * dt)
        "eval_every": 10,
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
        "batch": Setting(2, "training trajectories per iteration (1..n_train)", low=1,
                         allowed=">= 1"),
        "data_seed": Setting(1234, "seed of the training ICs (held-out: data_seed + 1)"),
        "data_dir": Setting("runs/data", "where the reference trajectories are cached"),
        # model and regularisation
        "width": Setting(8, "CNN channels", low=1, allowed=">= 1"),
        "depth": Setting(3, "CNN convolutions", low=1, allowed=">= 1"),
        "reg": Setting(1e-4, "weight of the closure-size term", low=0.0, allowed=">= 0"),
    }

    # -- setup ---------------------------------------------------------------------------

    def build(self, ctx):
        cfg = ctx.cfg
        counts = observation_steps(cfg.steps, cfg.obs_every)
        if int(cfg.fine_n) < int(cfg.coarse_n):
            raise ValueError(f"fine_n={cfg.fine_n} must be >= coarse_n={cfg.coarse_n}")
        if not 1 <= int(cfg.batch) <= int(cfg.n_train):
            raise ValueError(f"batch must be in 1..n_train={cfg.n_train}, got {cfg.batch}")
        dtype, device = ctx.dtype, ctx.device
        data_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        data = {}
        for split, n, seed in (("train", int(cfg.n_train), int(cfg.data_seed)),
                               ("test", int(cfg.n_test), int(cfg.data_seed) + 1)):
            attrs = _data_attrs(cfg, split, n, seed, data_dtype)
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
        ctx.model = Closure(grid.n, int(cfg.width), int(cfg.depth), scale, vscale).to(
            device=device, dtype=dtype)
        data["batch_ref"] = None
        data["obs_steps"] = counts
        data["obs_index"] = {c: k for k, c in enumerate(counts, start=1)}  # count -> time
        data["obs_rows"] = torch.tensor([c - 1 for c in counts], device=device)
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

    def advance(self, ctx, omega: torch.Tensor, closure: bool = True):
        """One learned coarse step; returns ``(next, closure tendency or None)``."""
        nxt = ctx.data["coarse"].step(omega)
        if not closure:
            return nxt, None
        c = ctx.model(omega)
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
        k = ctx.data["obs_index"].get(i + 1)
        ref = ctx.data["batch_ref"]
        if k is not None and ref is not None:
            target = ref[k]
            misfit = (nxt - target).pow(2).sum(dims) / target.pow(2).sum(dims)
        else:
            misfit = nxt.new_zeros(nxt.shape[:-2])
        return nxt, (misfit, closure)

    # -- loss and metrics ----------------------------------------------------------------

    def batch_indices(self, ctx, iteration: int) -> torch.Tensor:
        """Training trajectories of ``iteration`` (the same on every rank, reproducible on
        resume); a distributed rank takes every ``world_size``-th of them."""
        cfg = ctx.cfg
        g = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + int(iteration))
        idx = torch.randperm(int(cfg.n_train), generator=g)[: int(cfg.batch)]
        if ctx.world_size > 1:
            idx = idx[ctx.rank::ctx.world_size]
        return idx

    def residuals(self, ctx, iteration):
        steps = int(ctx.horizon)  # cfg.steps, or the stage of --set curriculum=...
        idx = self.batch_indices(ctx, iteration)
        if idx.numel() == 0:
            raise ValueError(f"batch={ctx.cfg.batch} is smaller than the number of processes "
                             f"({ctx.world_size}); every rank needs a trajectory")
        idx = idx.to(ctx.data["train"].device)
        ref = ctx.data["train"][idx].transpose(0, 1)  # (n_times, B, N, N)
        ctx.data["batch_ref"] = ref
        _, (sq, closure) = ctx.unroll(self.step, ref[0], steps)
        rows = ctx.data["obs_rows"]
        rows = rows[rows < steps]  # the observations within this horizon
        if rows.numel() == 0:
            raise ValueError(f"a horizon of {steps} steps ends before the first observation "
                             f"(step {int(ctx.data['obs_rows'][0]) + 1}); start the curriculum "
                             "at that many steps or more")
        rel = sq.index_select(0, rows).sqrt()  # (n_obs, B) at the obs times
        return {"misfit": rel.mean(), "closure": closure.mean()}

    def rollout(self, ctx, omega: torch.Tensor, n_steps: int, closure: bool = True):
        """Plain (no-grad) rollout of the learned or, with ``closure=False``, the
        uncorrected coarse solver."""
        with torch.no_grad():
            for _ in range(n_steps):
                omega, _ = self.advance(ctx, omega, closure)
        return omega

    def evaluate(self, ctx):
        steps = int(ctx.cfg.steps)
        test = ctx.data["test"]
        ref_t = test[:, -1]

        def rel(w):
            dims = (-2, -1)
            return float(((w - ref_t).pow(2).sum(dims) / ref_t.pow(2).sum(dims)).sqrt().mean())

        if "rel_err_coarse" not in ctx.data:  # the baseline does not change
            ctx.data["rel_err_coarse"] = rel(self.rollout(ctx, test[:, 0], steps, False))
        err = rel(self.rollout(ctx, test[:, 0], steps, True))
        base = ctx.data["rel_err_coarse"]
        return {"rel_err_closure": err, "rel_err_coarse": base,
                "improvement": base / max(err, 1e-30)}


problem = NavierStokesClosure()
