r"""PhiFlow's incompressible smoke solver as the step of :func:`deepsolve.unroll`: find the
initial velocity that steers a buoyant smoke plume onto a target.

The physics is PhiFlow's standard smoke step (``from phi.torch.flow import *``, torch
backend) on an ``N x N`` box with walls left, right and below and an open top: a density
:math:`\rho` on a ``CenteredGrid`` and a velocity :math:`u` on a ``StaggeredGrid``,

.. math::

    \rho' = \mathcal A(\rho; u, dt), \qquad
    u^* = \mathcal A(u; u, dt) + dt\, b\, \rho' \hat e_y, \qquad
    u' = u^* - \nabla p, \quad \nabla^2 p = \nabla\cdot u^*,

semi-Lagrangian advection :math:`\mathcal A` (``advect.semi_lagrangian``), buoyancy ``b``,
and the pressure projection ``fluid.make_incompressible`` (a conjugate-gradient solve that
PhiFlow differentiates implicitly, by an adjoint CG solve). One unroll step maps torch tensors
to torch tensors: the state is ``(rho (N, N), u_x (N-1, N), u_y (N, N))`` (the staggered
components' non-wall faces, as PhiFlow stores them), wrapped with
``math.tensor(..., convert=False)`` and unwrapped with ``.native(["x", "y"])``.

The control is the initial velocity :math:`u_0` (the initial density, a blob near the
floor, is fixed). The loss is the misfit of the density after ``n`` steps to a target made by
the same solver from a hidden initial velocity (a sideways jet),

.. math::

    L(u_0) = \frac{1}{N^2}\sum_{\text{cells}} \big(\rho_n(u_0) - \rho^\star_n\big)^2,

minimised by Adam through ``--steps`` (default 200) steps under ``snapshots=--snapshots``.

What it measures:

* **gradient**: at a short horizon (``--check-steps``, float64) deepsolve's gradient with
  respect to ``u_0`` and ``rho_0`` against plain autograd through the same PhiFlow step in a
  Python loop (relative error), and a central finite difference along a random direction;
  plus the compiled step against PhiFlow's eager one (``jit_vs_eager``: the compiled
  function skips PhiFlow's checks, CG convergence included, so it is compared once);
* **memory** at the training horizon, one loss + backward each (deepsolve: the first Adam
  iteration): bytes saved for backward plus deepsolve's snapshots
  (``MemoryMeter.tracked_peak``) and the process high-water mark above its resident size on
  entry (``host_peak``), deepsolve against the plain loop;
* **fit**: the loss per Adam iteration, and time.

PhiFlow's Python-level field machinery costs about 0.3 s a step on this grid; the step is
therefore compiled with ``math.jit_compile`` (``--no-jit`` to compare). A jit-compiled
function bakes in any torch tensor it closes over, so everything to be differentiated must
be an argument of the compiled function (here: the state).

Run ``python examples/phiflow_smoke.py`` (about 30 s on one CPU thread) or with ``--help``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from phi.torch.flow import (
    ZERO_GRADIENT,
    Box,
    CenteredGrid,
    Solve,
    StaggeredGrid,
    advect,
    dual,
    extrapolation,
    fluid,
    math,
    resample,
    spatial,
)

import deepsolve
from deepsolve.memory.allocator import return_freed_memory
from deepsolve.memory.meter import MemoryMeter

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Smoke:
    """PhiFlow smoke on an ``n x n`` box: :meth:`step` maps the torch state
    ``(rho, u_x, u_y)`` to the next one, ``dt`` later (``jit``: through ``math.jit_compile``).
    """

    def __init__(self, n: int = 12, dt: float = 0.1, buoyancy: float = 0.5,
                 tol: float = 1e-10, jit: bool = True) -> None:
        self.n, self.dt, self.buoyancy = n, dt, buoyancy
        self.bounds = Box(x=n, y=n)
        # walls left, right and at the floor, open at the top (a closed box makes the pressure
        # system singular; PhiFlow's CG then diverges on some grids, see examples/README.md)
        self.boundary = extrapolation.combine_sides(x=0, y=(0, ZERO_GRADIENT))
        self.template = StaggeredGrid(0, self.boundary, x=n, y=n, bounds=self.bounds)
        self.solve = Solve("CG", tol, tol, x0=None)
        self._physics = math.jit_compile(self._phi_step) if jit else self._phi_step

    def _phi_step(self, rho: math.Tensor, ux: math.Tensor, uy: math.Tensor
                  ) -> tuple[math.Tensor, math.Tensor, math.Tensor]:
        """One smoke step on PhiFlow tensors (the function that ``jit_compile`` traces)."""
        den = CenteredGrid(rho, ZERO_GRADIENT, bounds=self.bounds)
        vel = self.template.with_values(math.stack([ux, uy], dual(vector="x,y")))
        den = advect.semi_lagrangian(den, vel, self.dt)
        force = resample(den * (0, self.buoyancy), to=vel)
        vel = advect.semi_lagrangian(vel, vel, self.dt) + force * self.dt
        vel, _ = fluid.make_incompressible(vel, (), self.solve)
        return (den.values, *math.unstack(vel.values, "~vector"))

    def step(self, state: State, i: int) -> State:
        """torch -> PhiFlow -> one step -> torch."""
        return self._call(self._physics, state)

    def eager_step(self, state: State, i: int) -> State:
        """:meth:`step` without ``jit_compile`` (PhiFlow's checks, e.g. CG convergence, on)."""
        return self._call(self._phi_step, state)

    @staticmethod
    def _call(physics: Callable, state: State) -> State:
        wrapped = [math.tensor(t, spatial("x,y"), convert=False) for t in state]
        return tuple(t.native(["x", "y"]) for t in physics(*wrapped))  # type: ignore

    def initial_density(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A Gaussian blob of smoke near the floor, centred horizontally."""
        c = (torch.arange(self.n, dtype=dtype) + 0.5) / self.n
        x, y = torch.meshgrid(c, c, indexing="ij")
        return torch.exp(-((x - 0.5) ** 2 + (y - 0.2) ** 2) / 0.01)

    def zero_velocity(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
        """Zero ``(u_x, u_y)`` of the staggered shapes PhiFlow stores: ``(n-1, n)`` and, with
        the open top, ``(n, n)``."""
        return tuple(torch.zeros(c.shape.sizes, dtype=dtype)
                     for c in math.unstack(self.template.values, "~vector"))

    def jet(self, strength: float = 1.0, dtype: torch.dtype = torch.float64
            ) -> tuple[torch.Tensor, ...]:
        """The hidden initial velocity of the target: a sideways jet over the blob."""
        ux, uy = self.zero_velocity(dtype)
        yc = (torch.arange(self.n, dtype=dtype) + 0.5) / self.n
        ux = ux + strength * torch.exp(-((yc - 0.3) ** 2) / 0.02)[None, :]
        return ux, uy


def final_density(sim: Smoke, u0: Sequence[torch.Tensor], n: int, snapshots: int | None,
                  rho0: torch.Tensor | None = None,
                  stats: deepsolve.UnrollStats | None = None) -> torch.Tensor:
    """``rho_n`` from ``(rho0, u0)``: by ``deepsolve.unroll`` with revolve (``snapshots``) or,
    with ``snapshots=None``, by a plain loop."""
    rho0 = sim.initial_density(u0[0].dtype) if rho0 is None else rho0
    state: State = (rho0, *u0)  # type: ignore
    if snapshots is None:
        for i in range(n):
            state = sim.step(state, i)
        return state[0]
    return deepsolve.unroll(sim.step, state, n, snapshots=snapshots, stats=stats)[0]


def misfit(rho: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared density misfit."""
    return (rho - target).pow(2).mean()


def target_density(sim: Smoke, n: int) -> torch.Tensor:
    """The density after ``n`` steps from the hidden jet."""
    with torch.no_grad():
        return final_density(sim, sim.jet(), n, None)


def check_gradient(sim: Smoke, n: int = 10, snapshots: int = 3, eps: float = 1e-6,
                   seed: int = 0) -> dict[str, float]:
    """Relative errors of deepsolve's gradients (w.r.t. ``u_0`` and ``rho_0``) against plain
    autograd, float64, ``n`` steps; of the directional derivative against a central finite
    difference of step ``eps``; and of the compiled step's states against the eager ones."""
    target = target_density(sim, n)
    g = torch.Generator().manual_seed(seed)
    base = [0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64)
            for t in sim.zero_velocity()]
    grads = {}
    for name, snaps in (("deepsolve", snapshots), ("plain", None)):
        u0 = [t.clone().requires_grad_(True) for t in base]
        rho0 = sim.initial_density().requires_grad_(True)
        loss = misfit(final_density(sim, u0, n, snaps, rho0), target)
        grads[name] = torch.autograd.grad(loss, [*u0, rho0])
    out = {}
    for key, gd, gp in zip(("u_x", "u_y", "rho0"), grads["deepsolve"], grads["plain"],
                           strict=True):
        out[key] = float((gd - gp).norm() / gp.norm())
    d = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in base]
    with torch.no_grad():
        lp, lm = (misfit(final_density(sim, [b + s * eps * v for b, v in zip(base, d,
                                                                            strict=True)],
                                       n, None), target) for s in (1, -1))
    fd = float((lp - lm) / (2 * eps))
    ad = float(sum((gu * v).sum() for gu, v in zip(grads["deepsolve"][:2], d, strict=True)))
    out["finite_difference"] = abs(ad - fd) / abs(fd)
    with torch.no_grad():
        jit = eager = (sim.initial_density(), *base)
        for i in range(n):
            jit, eager = sim.step(jit, i), sim.eager_step(eager, i)
    out["jit_vs_eager"] = max(float((a - b).norm() / b.norm()) for a, b in zip(jit, eager,
                                                                              strict=True))
    return out


def measure_plain(sim: Smoke, n: int) -> dict[str, Any]:
    """One loss + backward at horizon ``n`` by the plain loop from rest: tracked peak (bytes
    saved for backward), host peak and time."""
    return_freed_memory()  # RSS follows the live bytes (deepsolve.memory.allocator)
    target = target_density(sim, n)
    u0 = [t.requires_grad_(True) for t in sim.zero_velocity()]
    t0 = time.perf_counter()
    with MemoryMeter() as m:
        misfit(final_density(sim, u0, n, None), target).backward()
    return {"tracked_peak": m.tracked_peak, "host_peak": m.host_peak,
            "time": time.perf_counter() - t0}


def train(sim: Smoke, n: int, iters: int, snapshots: int, lr: float = 0.1) -> dict[str, Any]:
    """Adam on the initial velocity from rest: the loss before each iteration and after the
    last, the time, and the memory of the first iteration's loss + backward (tracked peak:
    bytes saved for backward plus snapshots; host peak; :class:`~deepsolve.UnrollStats`)."""
    return_freed_memory()
    target = target_density(sim, n)
    u0 = [t.requires_grad_(True) for t in sim.zero_velocity()]
    opt = torch.optim.Adam(u0, lr=lr)
    losses = []
    memory: dict[str, Any] = {}
    t0 = time.perf_counter()
    for it in range(iters):
        opt.zero_grad()
        stats = deepsolve.UnrollStats()
        t1 = time.perf_counter()
        with MemoryMeter(stats=stats) as m:
            loss = misfit(final_density(sim, u0, n, snapshots, stats=stats), target)
            loss.backward()
        if it == 0:
            memory = {"tracked_peak": m.tracked_peak, "host_peak": m.host_peak,
                      "time": time.perf_counter() - t1, "stats": stats}
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(misfit(final_density(sim, u0, n, None), target)))
    return {"losses": losses, "time_per_iter": (time.perf_counter() - t0) / max(iters, 1),
            "memory": memory}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the gradient check, the memory comparison and the fit; print and return results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="unroll length (default 200)")
    ap.add_argument("--iters", type=int, default=3, help="Adam iterations (default 3)")
    ap.add_argument("--grid", type=int, default=12, help="cells per side (default 12)")
    ap.add_argument("--snapshots", type=int, default=20, help="revolve snapshot slots")
    ap.add_argument("--lr", type=float, default=0.1, help="Adam learning rate")
    ap.add_argument("--check-steps", type=int, default=10,
                    help="horizon of the gradient check against plain autograd")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory comparison")
    ap.add_argument("--no-jit", action="store_true", help="do not math.jit_compile the step")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    math.set_global_precision(64)
    warnings.filterwarnings("ignore", message="Sparse", category=UserWarning)
    sim = Smoke(args.grid, jit=not args.no_jit)

    res: dict[str, Any] = {"grad_rel_err": check_gradient(sim, args.check_steps)}
    print(f"gradient vs plain autograd ({args.check_steps} steps, float64): "
          + ", ".join(f"{k} {v:.1e}" for k, v in res["grad_rel_err"].items()))
    fit = train(sim, args.steps, args.iters, args.snapshots, args.lr)
    res["fit"] = fit
    print(f"fit: loss {fit['losses'][0]:.3e} -> {fit['losses'][-1]:.3e} after {args.iters} "
          f"Adam iterations ({fit['time_per_iter']:.2f} s each)")
    if not args.no_memory and fit["memory"]:
        ds, plain = fit["memory"], measure_plain(sim, args.steps)
        res["memory"] = {"deepsolve": ds, "plain": plain}
        st = ds["stats"]
        print(f"memory, one loss+backward at {args.steps} steps, {args.grid}^2 grid: tracked "
              f"peak {_mib(ds['tracked_peak'])} (deepsolve, snapshots={args.snapshots}) vs "
              f"{_mib(plain['tracked_peak'])} (plain); host peak {_mib(ds['host_peak'])} vs "
              f"{_mib(plain['host_peak'])}; time {ds['time']:.2f} s vs {plain['time']:.2f} s; "
              f"{st.advances} unrecorded + {st.recorded} recorded steps")
    return res


if __name__ == "__main__":
    main()
