"""GPU check of the memory planner: does the unroll keep its budget on CUDA?

    python benchmarks/gpu_check.py                       # CUDA, 256x256, T = 10^4
    python benchmarks/gpu_check.py --device cpu --small  # the same sweep, tiny, on the CPU
    python benchmarks/gpu_check.py --compile             # each budget eager and compiled

Self-contained: a 2D Navier–Stokes step (deepsolve.physics, pseudo-spectral RK4) with a small
periodic CNN closure. For budgets from 1% to 100% of the predicted store-all peak it runs
``deepsolve.unroll(..., budget=...)`` forward and backward and prints the plan, the budget,
the predicted peak and the measured real peak: ``torch.cuda.max_memory_allocated`` above
the allocation before the unroll on CUDA, the process's RSS high-water mark above its
resident size on the CPU (beside deepsolve's tracked bytes). A budget below the planner's
minimum is raised to 1.05 x the minimum. A row that measures above its budget (on the CPU:
1.05 x budget + 8 MiB) is marked FAIL and the exit status is 1.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

import deepsolve
from deepsolve.memory import profile_step
from deepsolve.memory.meter import MemoryMeter
from deepsolve.memory.planner import predicted_peak
from deepsolve.physics import Grid, NavierStokes2D, kolmogorov_forcing, random_initial


def make_step(n: int, device, width: int = 16):
    torch.manual_seed(0)
    grid = Grid(n)
    forcing = kolmogorov_forcing(grid, amplitude=1.0, wavenumber=4, device=device)
    dt = 0.5 * (2 * math.pi / n) / 3.0
    ns = NavierStokes2D(grid, nu=1e-3, dt=dt, alpha=0.1, forcing=forcing)
    closure = nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, padding_mode="circular"), nn.GELU(),
        nn.Conv2d(width, 1, 3, padding=1, padding_mode="circular"),
    ).to(device)

    def step(w, i):
        return ns.step(w) + dt * closure(w.unsqueeze(-3)).squeeze(-3)

    w0 = random_initial(grid, torch.Generator().manual_seed(0), batch_shape=(1,)).to(device)
    return step, w0, closure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="32x32, T = 200: a smoke run")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--fractions", type=float, nargs="*",
                    default=[0.01, 0.03, 0.1, 0.3, 0.6, 1.0])
    ap.add_argument("--compile", action="store_true",
                    help="each budget also with compile=True (CUDA graphs on CUDA): its "
                         "segment length, time against the eager row, real peak")
    args = ap.parse_args(argv)
    if args.small:
        args.n = 32
        args.steps = min(args.steps, 200)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here; run with --device cpu --small", file=sys.stderr)
        return 2
    step, w0, closure = make_step(args.n, dev)
    prof = profile_step(step, w0)
    full = predicted_peak(prof, args.steps, "store_all")
    least = predicted_peak(prof, args.steps, "revolve", 1)  # the planner's minimum
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {name}; grid {args.n}x{args.n}, T = {args.steps}; state "
          f"{prof.state_bytes / 2**20:.2f} MiB, recorded step {prof.tape_bytes / 2**20:.2f} MiB"
          f", working set {prof.step_bytes / 2**20:.2f} MiB; store-all predicted "
          f"{full / 2**30:.2f} GiB, minimum {least / 2**20:.2f} MiB\n")
    # warm-up (the planner, the policy profiles and the modules they load, one unroll), so
    # that each row measures what the unroll adds to a warmed process
    w = w0.detach().clone().requires_grad_()
    (deepsolve.unroll(step, w, args.steps, budget=int(math.sqrt(full * least)))**2).mean() \
        .backward()
    closure.zero_grad(set_to_none=True)
    print("| budget | plan | predicted peak | measured peak | measured / budget | tracked | "
          "time [s] | |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for f in args.fractions:
        budget = int(max(f * full, 1.05 * least))  # a fraction of store-all, at least the minimum
        eager_wall = None
        for compiled in ((False, True) if args.compile else (False,)):
            row = _row(step, w0, closure, args.steps, budget, full, dev, compiled, eager_wall)
            if row is None:
                break
            ok, wall = row
            failed += not ok
            eager_wall = wall
    return 1 if failed else 0


def _row(step, w0, closure, steps: int, budget: int, full: int, dev, compiled: bool,
         eager_wall: float | None):
    """One budget row (eager, or compile=True beside the eager row's time): ``(ok, wall)``,
    ``None`` when the budget is below the minimum."""
    st = deepsolve.UnrollStats()
    w = w0.detach().clone().requires_grad_()
    kw = {"compile": True} if compiled else {}
    try:
        if compiled:  # compile outside the measured row (the first call), then measure
            y = deepsolve.unroll(step, w, steps, budget=budget, **kw)
            (y**2).mean().backward()
            closure.zero_grad(set_to_none=True)
            del y
        t0 = time.perf_counter()
        with MemoryMeter(dev, stats=st) as m:
            y = deepsolve.unroll(step, w, steps, budget=budget, stats=st, **kw)
            (y**2).mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
    except deepsolve.BudgetError as e:  # below the minimum, or (compiled, on the CPU) the
        print(f"| {budget / 2**20:.0f} MiB | BudgetError: {e} | | | | | | |")  # compiler's
        return None
    # the real peak: CUDA's allocator peak, or the process's RSS high-water mark above its
    # resident size on entry (allowed 1.05 x budget + 8 MiB for pages and heap slack)
    measured = m.cuda_peak if dev.type == "cuda" else m.host_peak
    ok = measured <= (budget if dev.type == "cuda" else 1.05 * budget + 8 * 2**20)
    p = st.extra["plan"]
    name = p.describe() + (f", compiled k = {st.segment} ({wall / eager_wall:.2f}x eager)"
                           if compiled and eager_wall else "")
    print(f"| {budget / 2**20:.1f} MiB ({budget / full:.0%}) | {name} | "
          f"{p.predicted_peak / 2**20:.1f} MiB | {measured / 2**20:.1f} MiB | "
          f"{measured / budget:.3f} | {m.tracked_peak / 2**20:.1f} MiB | {wall:.1f} | "
          f"{'ok' if ok else 'FAIL'} |")
    del y, w
    closure.zero_grad(set_to_none=True)
    return ok, wall


if __name__ == "__main__":
    sys.exit(main())
