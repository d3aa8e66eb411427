r"""Autoregressive training of a neuraloperator FNO through long rollouts with
``deepsolve.unroll(..., budget=...)``, against plain rollout training.

Data: ``B`` trajectories of the periodic 1-D viscous Burgers equation
:math:`u_t + u u_x = \nu u_{xx}` on :math:`[0, 2\pi)` (``N`` points, :math:`\nu = 0.05`),
from smooth random initial fields, computed by deepsolve's pseudo-spectral ETDRK4 solver
(:class:`deepsolve.physics.burgers.Burgers1D`) and sampled every :math:`\Delta t = 0.05`:
frames :math:`u^\star_0, \dots, u^\star_n`.

Model: a 1-D FNO (``neuralop.models.FNO``, 4 Fourier layers, 16 modes, 32 channels) as the
residual update of an emulator,

.. math::

    u_{i+1} = u_i + \Delta t\,\mathrm{FNO}_\theta(u_i), \qquad
    L(\theta) = \frac{1}{n}\sum_{i=1}^{n} \operatorname{mean}\big(u_i - u^\star_i\big)^2,

rolled out from :math:`u_0 = u^\star_0` for ``n = --steps`` (default 200) steps; each term is
a per-step output of the unroll, and Adam trains :math:`\theta` through the whole rollout.
With ``budget=--budget`` (default ``"24MiB"``) deepsolve profiles the step once and picks the
fastest checkpoint schedule whose predicted peak fits; the plain rollout keeps every step's
activations (about 1.9 MiB a step here: batch 8, float32).

What it measures:

* **gradient**: at a short horizon (``--check-steps``, float64 FNO) the gradient of every FNO
  parameter by deepsolve, under a budget small enough to force checkpointing and under
  ``snapshots=3``, against plain rollout autograd (largest relative error over the parameter
  tensors);
* **memory**, one loss + backward at the training horizon each: the tracked peak (bytes
  autograd saves for backward plus deepsolve's snapshots, :class:`~deepsolve.UnrollStats`
  with :class:`deepsolve.memory.meter.MemoryMeter`) and the process RSS high-water mark above
  a warmed baseline (``VmHWM`` after resetting it to the current RSS), for deepsolve and for
  plain rollout training;
* **training**: the loss per iteration and the time per iteration, both ways.

Run ``python examples/neuraloperator_rollout.py`` (about 30 s on one CPU thread) or with
``--help``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from neuralop.models import FNO

import deepsolve
from deepsolve.memory.allocator import return_freed_memory
from deepsolve.memory.meter import MemoryMeter
from deepsolve.physics.burgers import Burgers1D, Grid1D, random_initial

NU, DT_SOLVER, SUBSTEPS = 0.05, 0.01, 5  # frames every DT = SUBSTEPS * DT_SOLVER
DT = DT_SOLVER * SUBSTEPS


def trajectories(batch: int, n_frames: int, grid_n: int = 64, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Burgers frames ``(n_frames + 1, batch, 1, grid_n)`` every ``DT``, float64 solve."""
    grid = Grid1D(grid_n)
    solver = Burgers1D(grid, nu=NU, dt=DT_SOLVER)
    u = random_initial(grid, torch.Generator().manual_seed(seed), (batch,), dtype=torch.float64)
    frames = [u]
    with torch.no_grad():
        for _ in range(n_frames):
            u = solver.advance(u, SUBSTEPS)
            frames.append(u)
    return torch.stack(frames)[:, :, None, :].to(dtype)


def make_fno(dtype: torch.dtype = torch.float32, seed: int = 0) -> FNO:
    """The emulator's FNO in ``dtype``, its spectral weights in the matching complex dtype.

    Cast parameter by parameter: ``model.double()`` leaves neuralop's ``complex64`` spectral
    weights as they are, and ``model.to(torch.float64)`` drops their imaginary parts.
    """
    torch.manual_seed(seed)
    model = FNO(n_modes=(16,), in_channels=1, out_channels=1, hidden_channels=32, n_layers=4)
    cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    for p in model.parameters():
        p.data = p.data.to(cdtype if p.is_complex() else dtype)
    return model


def make_step(model: torch.nn.Module, ref: torch.Tensor) -> Callable[[torch.Tensor, int], Any]:
    """The rollout step ``u_i -> (u_{i+1}, mean((u_{i+1} - ref_{i+1})^2))``."""

    def step(u: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = u + DT * model(u)
        return v, (v - ref[i + 1]).pow(2).mean()

    return step


def rollout_loss(step: Callable, u0: torch.Tensor, n: int, budget: str | None,
                 stats: deepsolve.UnrollStats | None = None) -> torch.Tensor:
    """The mean per-step misfit of an ``n``-step rollout: by ``deepsolve.unroll`` under
    ``budget``, or with ``budget=None`` by a plain Python loop."""
    if budget is None:
        u, total = u0, u0.new_zeros(())
        for i in range(n):
            u, m = step(u, i)
            total = total + m
        return total / n
    _, misfits = deepsolve.unroll(step, u0, n, budget=budget, stats=stats)
    return misfits.mean()


def check_gradient(n: int = 12, batch: int = 4, budget: str = "4MiB", snapshots: int = 3,
                   seed: int = 0) -> dict[str, Any]:
    """Largest relative error over the FNO's parameter tensors of deepsolve's gradient
    against the plain rollout's, float64, ``n`` steps: under ``budget`` (the planner's
    schedule, reported) and under revolve with ``snapshots`` slots."""
    ref = trajectories(batch, n, seed=seed, dtype=torch.float64)
    model = make_fno(torch.float64, seed)
    params = list(model.parameters())
    step = make_step(model, ref)
    g_plain = torch.autograd.grad(rollout_loss(step, ref[0], n, None), params)
    stats = deepsolve.UnrollStats()
    g_budget = torch.autograd.grad(rollout_loss(step, ref[0], n, budget, stats), params)
    _, misfits = deepsolve.unroll(step, ref[0], n, snapshots=snapshots)
    g_revolve = torch.autograd.grad(misfits.mean(), params)
    errs = [max(float((a - b).norm() / b.norm()) for a, b in zip(g, g_plain, strict=True))
            for g in (g_budget, g_revolve)]
    return {"max_rel_err": max(errs), "budget_rel_err": errs[0], "revolve_rel_err": errs[1],
            "schedule": stats.schedule}


def train(n: int, iters: int, batch: int, budget: str | None, lr: float = 1e-3,
          seed: int = 0) -> dict[str, Any]:
    """Adam on the FNO through ``n``-step rollouts (deepsolve under ``budget``, or plain with
    ``None``): the losses, the time per iteration, and the memory of the first iteration
    (tracked peak, host peak above a warmed baseline, the unroll's stats)."""
    return_freed_memory()  # RSS follows the live bytes (deepsolve.memory.allocator)
    ref = trajectories(batch, n, seed=seed)
    model = make_fno(torch.float32, seed)
    step = make_step(model, ref)
    with torch.no_grad():  # warm-up: first-call allocations and caches out of the baseline
        step(ref[0], 0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, memory = [], {}
    t0 = time.perf_counter()
    for it in range(iters):
        opt.zero_grad()
        stats = deepsolve.UnrollStats() if budget is not None else None
        with MemoryMeter(stats=stats) as m:
            loss = rollout_loss(step, ref[0], n, budget, stats)
            loss.backward()
        if it == 0:
            memory = {"tracked_peak": m.tracked_peak, "host_peak": m.host_peak,
                      "host_reset": m.host_reset, "stats": stats}
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "time_per_iter": (time.perf_counter() - t0) / max(iters, 1),
            "memory": memory}


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Gradient check, then deepsolve and plain rollout training; print and return results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="rollout length (default 200)")
    ap.add_argument("--iters", type=int, default=4, help="Adam iterations per run (default 4)")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per batch")
    ap.add_argument("--budget", default="24MiB", help="deepsolve memory budget")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    ap.add_argument("--check-steps", type=int, default=12,
                    help="horizon of the gradient check against the plain rollout")
    ap.add_argument("--no-plain", action="store_true", help="skip plain rollout training")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    chk = check_gradient(args.check_steps, seed=args.seed)
    res: dict[str, Any] = {"grad": chk}
    print(f"gradient vs plain rollout ({args.check_steps} steps, float64), max relative error "
          f"over the parameters: {chk['budget_rel_err']:.1e} ({chk['schedule']}), "
          f"{chk['revolve_rel_err']:.1e} (snapshots=3)")
    runs = {"deepsolve": args.budget} if args.no_plain else {"deepsolve": args.budget,
                                                             "plain": None}
    for name, budget in runs.items():
        r = train(args.steps, args.iters, args.batch, budget, args.lr, args.seed)
        res[name] = r
        mem = r["memory"]
        plan = mem["stats"].schedule if mem.get("stats") else "store every step"
        print(f"{name:9s} ({plan}): loss {r['losses'][0]:.4e} -> {r['losses'][-1]:.4e} in "
              f"{args.iters} iterations, {r['time_per_iter']:.2f} s each; tracked peak "
              f"{_mib(mem['tracked_peak'])}, host peak {_mib(mem['host_peak'])}")
    return res


if __name__ == "__main__":
    main()
