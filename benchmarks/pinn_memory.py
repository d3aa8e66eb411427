"""Peak memory and time of the Kovasznay PINN residual over 10^5 points: unchunked vs chunked.

    .venv/bin/python benchmarks/pinn_memory.py                     # 10^5 points, ~2 minutes
    .venv/bin/python benchmarks/pinn_memory.py --points 20000      # quicker
    .venv/bin/python benchmarks/pinn_memory.py --derivatives func  # torch.func derivatives

Each configuration runs in its own subprocess (one thread): the loss is the sum of the three
mean squared residuals of problems/navier_stokes_pinn.py (4x50 tanh network, float32,
second derivatives) over ``--points`` scrambled Sobol points, then its gradient. Reported:
the chunk size the budget gives (:class:`deepsolve.pinn.ChunkedResidual`, bytes per point
measured on a probe), the peak of tensors saved for backward
(:class:`deepsolve.pinn.SavedBytes`, which also sees the chunks recomputed in the backward
pass), the process's peak RSS above its baseline before the loss (VmHWM after resetting it
through /proc/self/clear_refs, on the first evaluation, after ``malloc_trim``: a warmed-up
process keeps freed heap memory and would hide the peak), the time of forward + backward
(median of ``--repeat`` further evaluations), and
the largest relative difference of the parameter gradient from the unchunked one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _trim() -> None:
    """Return freed heap memory to the system (glibc), so the RSS baseline is tight."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def child(budget: str, points: int, derivatives: str, repeat: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from deepsolve.pinn import ChunkedResidual, Rectangle, SavedBytes
    from deepsolve.problem import Context, apply_overrides, load_problem

    prob, _ = load_problem(os.path.join(ROOT, "problems", "navier_stokes_pinn.py"))
    cfg = apply_overrides(prob.config(), [f"derivatives={derivatives}", "n_interior=16",
                                          "n_boundary=8", "test_grid=2", "constraints=soft"])
    ctx = Context(cfg, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    prob.build(ctx)
    params = list(ctx.model.parameters())
    x = Rectangle(prob.lo, prob.hi).sample_interior(points, "sobol", 0, torch.float32)
    res = ChunkedResidual(lambda xc: prob.pde(ctx, xc), params=params, budget=budget or None)
    chunk = res.chunk_size(x)  # the probe runs here, outside the measurements

    def loss_and_grad():
        loss = sum(res(x).values())
        return torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)

    # memory first, in a process that has not run the full loss yet: glibc keeps freed heap
    # memory, so a warmed-up process would hide most of the peak from the RSS
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    base = _status("VmRSS:")
    with SavedBytes() as meter:
        grads = loss_and_grad()
    rss = _status("VmHWM:") - base
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        loss_and_grad()
        times.append(time.perf_counter() - t0)
    flat = torch.cat([g.reshape(-1) for g in grads]).double()
    return {"budget": budget or "none", "chunk": chunk or points, "points": points,
            "chunks": -(-points // (chunk or points)), "per_point": res.per_point,
            "saved_peak": meter.peak, "rss_peak": rss if reset else None,
            "time": sorted(times)[len(times) // 2], "grad": flat.tolist()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--budgets", default="64MiB,16MiB", help="comma-separated budgets")
    ap.add_argument("--derivatives", default="autograd", choices=["autograd", "func"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        row = child(args.child, args.points, args.derivatives, args.repeat)
        print("ROW " + json.dumps(row))
        return
    rows = []
    for budget in [""] + [b.strip() for b in args.budgets.split(",") if b.strip()]:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", budget,
                              "--points", str(args.points), "--derivatives", args.derivatives,
                              "--repeat", str(args.repeat)],
                             capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
        if out.returncode != 0 or not line:
            sys.exit(f"child for budget {budget!r} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(line[-1][4:]))
    ref = rows[0]["grad"]
    scale = max(abs(g) for g in ref)
    mib = 2.0**20
    print(f"Kovasznay residual (4x50 tanh, float32, derivatives={args.derivatives}), "
          f"{args.points:,} collocation points, forward + backward\n")
    print("| budget | chunk | chunks | saved-tensor peak [MiB] | peak RSS increase [MiB] "
          "| time [s] | time / unchunked | max grad diff / max grad |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        diff = max(abs(a - b) for a, b in zip(r["grad"], ref, strict=True)) / scale
        rss = "n/a" if r["rss_peak"] is None else f"{r['rss_peak'] / mib:.0f}"
        print(f"| {r['budget']} | {r['chunk']:,} | {r['chunks']} | {r['saved_peak'] / mib:.1f} "
              f"| {rss} | {r['time']:.2f} | {r['time'] / rows[0]['time']:.2f} | {diff:.1e} |")
    per_point = next((r["per_point"] for r in rows if r["per_point"]), None)
    if per_point:
        print(f"\nsaved bytes per collocation point (probe): {per_point:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "grad"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
