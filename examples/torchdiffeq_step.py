r"""torchdiffeq's fixed-grid RK4 as the step of :func:`deepsolve.unroll`: system identification
of a damped pendulum through a long trajectory.

The model is a batch of ``B`` damped pendulums :math:`x = (\theta, \dot\theta)`,

.. math::

    \dot\theta = \omega, \qquad \dot\omega = -\Omega^2 \sin\theta - \gamma\,\omega,

with unknown frequency :math:`\Omega = e^{a}` and damping :math:`\gamma = e^{b}`. One step of
the unroll is one call of ``torchdiffeq.odeint(f, x_i, [t_i, t_i + dt], method="rk4")`` (the
fixed-grid 3/8-rule RK4 of torchdiffeq, one stage set per step). The loss is the mean squared
misfit to a reference trajectory :math:`x^\star` computed with the true parameters,

.. math::

    L(a, b) = \frac{1}{n}\sum_{i=1}^{n} \frac{1}{B}\lVert x_i - x^\star_i \rVert^2,

each term returned by the step as a per-step output, so the gradient flows through all ``n``
steps (``--steps``, default 300, i.e. 6 time units with ``dt = 0.02``). L-BFGS fits
``(a, b)`` in at most ``--iters`` iterations, each loss and gradient one unroll under
``snapshots=--snapshots`` (revolve).

What it measures:

* **gradient**: at a short horizon (``--check-steps``, float64) the deepsolve gradient of
  ``L`` with respect to ``(a, b)`` and to ``x_0`` against plain autograd through the same
  torchdiffeq step in a Python loop (relative error; deepsolve's contract is <= 1e-10);
* **memory** at the training horizon, one loss + backward each: the bytes autograd saves
  for backward plus deepsolve's snapshots (:class:`deepsolve.memory.meter.MemoryMeter`'s
  ``tracked_peak``, with :class:`deepsolve.UnrollStats`) and the process high-water mark above
  the resident size on entry (``host_peak``), deepsolve against the plain loop;
* **fit**: the loss and the recovered :math:`\Omega, \gamma` (true 1.0 and 0.1), and time.

Run ``python examples/torchdiffeq_step.py`` (about 15 s on one CPU thread) or with
``--help``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torchdiffeq

import deepsolve
from deepsolve.memory.allocator import return_freed_memory
from deepsolve.memory.meter import MemoryMeter

TRUE_OMEGA, TRUE_GAMMA = 1.0, 0.1
DT = 0.02


class Pendulum(torch.nn.Module):
    """Damped pendulum vector field ``f(t, x)`` with log-parameters ``a = log Omega`` and
    ``b = log gamma`` (torchdiffeq's ``func(t, y)`` convention; ``x`` has shape ``(B, 2)``)."""

    def __init__(self, omega: float, gamma: float) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(math.log(omega)))
        self.b = torch.nn.Parameter(torch.tensor(math.log(gamma)))

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The time derivative of ``x = (theta, theta')``."""
        theta, w = x[..., 0], x[..., 1]
        return torch.stack((w, -self.a.exp() ** 2 * torch.sin(theta) - self.b.exp() * w), -1)

    def values(self) -> tuple[float, float]:
        """``(Omega, gamma)`` as numbers."""
        return float(self.a.detach().exp()), float(self.b.detach().exp())


def rk4_step(f: Callable, x: torch.Tensor, i: int, dt: float = DT) -> torch.Tensor:
    """``x(t_i + dt)`` from ``x(t_i)`` by one torchdiffeq fixed-grid RK4 step."""
    t = torch.tensor([i * dt, (i + 1) * dt], dtype=x.dtype)
    return torchdiffeq.odeint(f, x, t, method="rk4")[1]


def make_step(f: Callable, ref: torch.Tensor) -> Callable[[torch.Tensor, int], Any]:
    """The unroll step: ``x_i -> (x_{i+1}, ||x_{i+1} - ref_{i+1}||^2 / B)``."""

    def step(x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rk4_step(f, x, i)
        return y, (y - ref[i + 1]).pow(2).sum() / y.shape[0]

    return step


def reference(x0: torch.Tensor, n: int) -> torch.Tensor:
    """The trajectory ``(n + 1, B, 2)`` of the true pendulum from ``x0``."""
    f = Pendulum(TRUE_OMEGA, TRUE_GAMMA).to(x0.dtype)
    xs = [x0]
    with torch.no_grad():
        for i in range(n):
            xs.append(rk4_step(f, xs[-1], i))
    return torch.stack(xs)


def initial(batch: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    """``batch`` initial states: angles in (-2, 2), angular velocities in (-1, 1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 2, generator=g, dtype=torch.float64) * 2 - 1).mul(
        torch.tensor([2.0, 1.0], dtype=torch.float64)).to(dtype)


def loss_deepsolve(step: Callable, x0: torch.Tensor, n: int, snapshots: int,
                   stats: deepsolve.UnrollStats | None = None) -> torch.Tensor:
    """Mean per-step misfit through ``deepsolve.unroll`` (revolve with ``snapshots`` slots)."""
    _, misfits = deepsolve.unroll(step, x0, n, snapshots=snapshots, stats=stats)
    return misfits.mean()


def loss_plain(step: Callable, x0: torch.Tensor, n: int) -> torch.Tensor:
    """The same loss by a plain Python loop (autograd records every step)."""
    x, total = x0, x0.new_zeros(())
    for i in range(n):
        x, m = step(x, i)
        total = total + m
    return total / n


def check_gradient(n: int = 40, batch: int = 16, snapshots: int = 4, seed: int = 0
                   ) -> dict[str, float]:
    """Relative errors of deepsolve's gradients (w.r.t. ``a``, ``b`` and ``x0``) against plain
    autograd through the same torchdiffeq step, float64, ``n`` steps."""
    x0 = initial(batch, seed=seed)
    ref = reference(x0, n)
    f = Pendulum(0.8, 0.3).double()
    inputs = [f.a, f.b]
    grads = {}
    for name in ("deepsolve", "plain"):
        x = x0.clone().requires_grad_(True)
        step = make_step(f, ref)
        loss = loss_deepsolve(step, x, n, snapshots) if name == "deepsolve" else \
            loss_plain(step, x, n)
        grads[name] = torch.autograd.grad(loss, [*inputs, x])
    out = {}
    for key, gd, gp in zip(("a", "b", "x0"), grads["deepsolve"], grads["plain"], strict=True):
        out[key] = float((gd - gp).norm() / gp.norm())
    return out


def measure_memory(n: int, batch: int, snapshots: int, seed: int = 0) -> dict[str, Any]:
    """One loss + backward at horizon ``n`` by deepsolve (revolve, ``snapshots``) and by the
    plain loop: tracked peak (saved tensors + snapshots), host peak, time, and the stats."""
    return_freed_memory()  # RSS follows the live bytes (deepsolve.memory.allocator)
    x0 = initial(batch, seed=seed)
    ref = reference(x0, n)
    f = Pendulum(0.8, 0.3).double()
    out: dict[str, Any] = {}
    for name in ("deepsolve", "plain"):
        step = make_step(f, ref)
        stats = deepsolve.UnrollStats() if name == "deepsolve" else None
        t0 = time.perf_counter()
        with MemoryMeter(stats=stats) as m:
            loss = loss_deepsolve(step, x0, n, snapshots, stats) if name == "deepsolve" \
                else loss_plain(step, x0, n)
            loss.backward()
        out[name] = {"tracked_peak": m.tracked_peak, "host_peak": m.host_peak,
                     "host_reset": m.host_reset, "time": time.perf_counter() - t0}
        if stats is not None:
            out[name]["stats"] = stats
        f.zero_grad()
    return out


def train(n: int, iters: int, batch: int, snapshots: int, seed: int = 0) -> dict[str, Any]:
    """Fit ``(Omega, gamma)`` by L-BFGS (strong Wolfe line search, at most ``iters``
    iterations) through ``n``-step unrolls; every loss evaluated, the fit and the time."""
    x0 = initial(batch, seed=seed)
    ref = reference(x0, n)
    f = Pendulum(0.8, 0.3).double()
    step = make_step(f, ref)
    opt = torch.optim.LBFGS(f.parameters(), lr=1.0, max_iter=iters,
                            line_search_fn="strong_wolfe")
    losses: list[float] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_deepsolve(step, x0, n, snapshots)
        loss.backward()
        losses.append(float(loss.detach()))
        return loss

    t0 = time.perf_counter()
    if iters > 0:
        opt.step(closure)
    omega, gamma = f.values()
    return {"losses": losses, "omega": omega, "gamma": gamma,
            "time": time.perf_counter() - t0}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the gradient check, the memory comparison and the fit; print and return results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="unroll length (default 300)")
    ap.add_argument("--iters", type=int, default=15, help="L-BFGS iterations (default 15)")
    ap.add_argument("--batch", type=int, default=256, help="pendulums in the batch")
    ap.add_argument("--snapshots", type=int, default=16, help="revolve snapshot slots")
    ap.add_argument("--check-steps", type=int, default=40,
                    help="horizon of the gradient check against plain autograd")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory comparison")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    res: dict[str, Any] = {"grad_rel_err": check_gradient(args.check_steps, seed=args.seed)}
    print(f"gradient vs plain autograd ({args.check_steps} steps, float64): "
          + ", ".join(f"{k} {v:.1e}" for k, v in res["grad_rel_err"].items()))
    if not args.no_memory:
        mem = measure_memory(args.steps, args.batch, args.snapshots, args.seed)
        res["memory"] = mem
        st = mem["deepsolve"]["stats"]
        print(f"memory, one loss+backward at {args.steps} steps, batch {args.batch}: "
              f"tracked peak {_mib(mem['deepsolve']['tracked_peak'])} (deepsolve, "
              f"snapshots={args.snapshots}) vs {_mib(mem['plain']['tracked_peak'])} (plain); "
              f"host peak {_mib(mem['deepsolve']['host_peak'])} vs "
              f"{_mib(mem['plain']['host_peak'])}; time {mem['deepsolve']['time']:.2f} s vs "
              f"{mem['plain']['time']:.2f} s; {st.advances} unrecorded + {st.recorded} "
              f"recorded steps")
    fit = train(args.steps, args.iters, args.batch, args.snapshots, args.seed)
    res["fit"] = fit
    if fit["losses"]:
        print(f"fit: loss {fit['losses'][0]:.3e} -> {fit['losses'][-1]:.3e} in "
              f"{len(fit['losses'])} unrolls ({fit['time']:.1f} s); Omega {fit['omega']:.6f} "
              f"(true {TRUE_OMEGA}), gamma {fit['gamma']:.6f} (true {TRUE_GAMMA})")
    return res


if __name__ == "__main__":
    main()
