"""Reversible steppers against revolve at the same memory and plain autograd; memory flat in n.

    .venv/bin/python benchmarks/reversible.py                       # both tables (~15 min)
    .venv/bin/python benchmarks/reversible.py --table speed --repeats 3
    .venv/bin/python benchmarks/reversible.py --table flat --sizes 1000 10000 100000

Two workloads, both with learnable coefficients and float64 states:

* ``sine_gordon`` — the 1-D sine-Gordon equation ``q_tt = c^2 q_xx - theta sin(q)`` on a
  periodic grid, leapfrog (kick-drift-kick, :func:`deepsolve.reversible.leapfrog`), state
  ``(q, v)``; learnable ``c^2`` and ``theta``.
* ``neural_ode`` — ``y' = tanh(y W^T + b) - 0.05 y`` (a 64-wide layer on a batch of
  vectors), RK4 made reversible by the McCallum–Foster coupling
  (:func:`deepsolve.reversible.explicit`), state ``(y, z)``.

Table ``speed`` (n = 10^4, small states so that plain autograd fits): plain autograd
(every step kept), revolve with the same memory as the reversible unroll (``s =
snapshots + 1`` slots: the reversible unroll holds one more state while it inverts) and the
reversible unroll (``Reversible(snapshots=4)``); forward + backward wall time, medians over
``--repeats`` fresh processes run in turn, the gradients checked against plain autograd.
Table ``flat``: the reversible leapfrog unroll of a 1 MiB state (``(q, v)``, 2 x 65536
float64) for each n, each in a fresh process: the tracked peak (deepsolve's host allocator's
live bytes) and the real peak (RSS high-water mark above the resident size before the call),
and the largest drift measured at a snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 2**20


def build(workload: str, size: int):
    """``(step, x0, leaves)`` of a workload with ``size`` points (sine-Gordon) or batch rows
    (neural ODE)."""
    import torch

    from deepsolve import reversible as rv

    D = torch.float64
    g = torch.Generator().manual_seed(0)
    if workload == "sine_gordon":
        L = 40.0
        dx = L / size
        c2 = torch.tensor(1.0, dtype=D, requires_grad=True)
        theta = torch.tensor(1.0, dtype=D, requires_grad=True)

        def accel(q, t):
            lap = (torch.roll(q, 1) - 2 * q + torch.roll(q, -1)) / (dx * dx)
            return c2 * lap - theta * torch.sin(q)

        x = torch.linspace(-L / 2, L / 2, size + 1, dtype=D)[:-1]
        q0 = (2 * torch.exp(-x * x)).requires_grad_()  # a pulse that splits into waves
        v0 = torch.zeros_like(x)
        step = rv.leapfrog(accel, min(0.5 * dx, 0.05))
        return step, (q0, v0), [q0, c2, theta]
    W = (0.3 * torch.randn(64, 64, generator=g, dtype=D)).requires_grad_()
    b = (0.1 * torch.randn(64, generator=g, dtype=D)).requires_grad_()
    y0 = torch.randn(size, 64, generator=g, dtype=D).requires_grad_()
    step = rv.explicit(lambda t, y: torch.tanh(y @ W.T + b) - 0.05 * y, 1e-3, method="rk4")
    return step, step.init(y0), [y0, W, b]


def child(workload: str, kind: str, n: int, size: int, snapshots: int) -> dict:
    import torch

    import deepsolve as ds
    from deepsolve.memory import hostalloc
    from deepsolve.memory.meter import process_status, reset_high_water_mark

    torch.set_num_threads(1)
    hostalloc.install()
    step, x0, leaves = build(workload, size)

    def loss(x):
        return (x[0] ** 2).sum() + x[1].sum()

    with torch.no_grad():  # the user's warm-up: a few plain steps
        x = x0
        for i in range(3):
            x = step(x, i)
    strategy = {"plain": None, "revolve": ds.Revolve(snapshots + 1),
                "reversible": ds.Reversible(snapshots=snapshots)}[kind]
    stats = ds.UnrollStats()
    reset_high_water_mark()
    base = process_status("VmRSS:")
    hostalloc.reset_peak()
    live0 = hostalloc.live()
    t0 = time.perf_counter()
    xn = ds.unroll(step, x0, n, stats=stats,
                   **({} if strategy is None else {"schedule": strategy}))
    g = torch.autograd.grad(loss(xn), leaves)
    wall = time.perf_counter() - t0
    del xn
    return {"workload": workload, "kind": kind, "n": n, "size": size, "wall": wall,
            "tracked": hostalloc.peak() - live0, "real": process_status("VmHWM:") - base,
            "state": sum(t.numel() * t.element_size() for t in x0),
            "drift": stats.reconstruction_error, "grads": [float(t.double().sum()) for t in g],
            "gnorm": [float(t.norm()) for t in g]}


def run(*args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--child", *map(str, args)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def speed(repeats: int, n: int, snapshots: int) -> None:
    sizes = {"sine_gordon": 2048, "neural_ode": 16}
    print(f"n = {n} steps, Reversible(snapshots={snapshots}) vs Revolve({snapshots + 1}) vs "
          f"plain autograd; medians of {repeats} fresh processes each\n")
    print("| workload | state | schedule | time [s] | time / plain | time / reversible | "
          "tracked peak [MiB] | real peak [MiB] | max grad rel. diff vs plain | drift |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w, size in sizes.items():
        rows: dict[str, list[dict]] = {"plain": [], "revolve": [], "reversible": []}
        for _ in range(repeats):  # side by side: one of each in turn
            for kind in rows:
                rows[kind].append(run(w, kind, n, size, snapshots))
        med = {k: statistics.median(r["wall"] for r in v) for k, v in rows.items()}
        ref = rows["plain"][0]["gnorm"]
        for kind, rs in rows.items():
            r = rs[0]
            diff = max(abs(a - b) / max(abs(b), 1e-300)
                       for a, b in zip(r["gnorm"], ref, strict=True))
            drift = "-" if r["drift"] is None else f"{r['drift']:.1e}"
            print(f"| {w} | {r['state'] / 1024:.0f} KiB | {kind} | {med[kind]:.2f} | "
                  f"{med[kind] / med['plain']:.2f} | {med[kind] / med['reversible']:.2f} | "
                  f"{statistics.median(x['tracked'] for x in rs) / MiB:.1f} | "
                  f"{statistics.median(x['real'] for x in rs) / MiB:.1f} | {diff:.1e} | "
                  f"{drift} |", flush=True)


def flat(sizes: list[int], snapshots: int) -> None:
    print(f"sine_gordon, leapfrog, state (q, v) = 1 MiB, Reversible(snapshots={snapshots}); "
          "one fresh process per n\n")
    print("| n | time [s] | time per step [ms] | tracked peak [MiB] | real peak [MiB] | "
          "tracked / first | real / first | drift at a snapshot |")
    print("|---|---|---|---|---|---|---|---|")
    first = None
    for n in sizes:
        r = run("sine_gordon", "reversible", n, 65536, snapshots)
        first = first or r
        print(f"| {n} | {r['wall']:.1f} | {r['wall'] / n * 1e3:.3f} | {r['tracked'] / MiB:.2f} | "
              f"{r['real'] / MiB:.2f} | {r['tracked'] / first['tracked']:.3f} | "
              f"{r['real'] / first['real']:.3f} | {r['drift']:.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", choices=["speed", "flat", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10_000, help="n of the speed table")
    ap.add_argument("--snapshots", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 10_000, 100_000],
                    help="the n of the flat table")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        w, kind, n, size, s = args.child
        print(json.dumps(child(w, kind, int(n), int(size), int(s))))
        return
    if args.table in ("speed", "both"):
        speed(args.repeats, args.steps, args.snapshots)
    if args.table in ("flat", "both"):
        print()
        flat(args.sizes, args.snapshots)


if __name__ == "__main__":
    main()
