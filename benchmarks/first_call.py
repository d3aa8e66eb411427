"""The first budgeted call of a process: how long its planning takes and what it leaves resident.

    .venv/bin/python benchmarks/first_call.py                # all workloads, 3 processes each
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/first_call.py --repeats 3

For each workload (the steps of ``tests/data/real_peak.py`` and the 64x64 Navier–Stokes step)
a fresh process warms the step up as a user would (one plain step forward and backward,
nothing of deepsolve called), then calls ``deepsolve.plan(step, x0, n, budget=B)`` — the
profile and the planning a batch job's first iteration does — and reports its wall time, the
real peak above the resident size before it (RSS high-water mark, reset through
/proc/self/clear_refs) and what stays resident after it; then a second, warm ``plan`` (the
profile cached). Budgets are fixed byte counts (about a tenth of plain autograd's peak, and
the Navier–Stokes problem's 256 MiB), so that the same command measures another checkout of
the library (``PYTHONPATH``) side by side. Medians over ``--repeats`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20
# workload: (steps, budget [bytes])
WORKLOADS = {"pointwise": (120, 240 * MiB), "conv32": (120, 160 * MiB),
             "spectral": (120, 150 * MiB), "ks": (20_000, 64 * MiB), "ns": (1000, 256 * MiB)}


def child(workload: str) -> dict:
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "data"))
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    if workload == "ns":
        import ns_step

        step, w0, closure = ns_step.make()
        x0, params = w0.detach().clone().requires_grad_(), list(closure.parameters())
    else:
        from real_peak import build

        step, x0, params = build(workload)
    torch.autograd.grad((step(x0, 0) ** 2).sum(), [x0, *params])  # the user's warm-up

    import deepsolve
    from deepsolve.memory.meter import process_status, reset_high_water_mark

    n, budget = WORKLOADS[workload]
    reset_high_water_mark()
    base = process_status("VmRSS:")
    t0 = time.perf_counter()
    p = deepsolve.plan(step, x0, n, budget=budget)
    cold = time.perf_counter() - t0
    real = process_status("VmHWM:") - base
    resident = process_status("VmRSS:") - base
    t0 = time.perf_counter()
    deepsolve.plan(step, x0, n, budget=budget)
    warm = time.perf_counter() - t0
    return {"workload": workload, "plan": p.describe(), "cold": cold, "warm": warm,
            "real": real, "resident": resident, "budget": budget}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    print("| workload | budget [MiB] | plan | first plan [s] | warm plan | real peak of the "
          "first plan [MiB] | resident after it [MiB] |")
    print("|---|---|---|---|---|---|---|")
    for w in (WORKLOADS if args.workload == "all" else [args.workload]):
        rows = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--child", w], capture_output=True,
                                 text=True, env=env)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-2000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("cold", "warm", "real", "resident")}
        plans = sorted({r["plan"] for r in rows})
        print(f"| {w} | {rows[0]['budget'] / MiB:.0f} | {' / '.join(plans)} | "
              f"{med['cold']:.2f} | {med['warm'] * 1e3:.1f} ms | {med['real'] / MiB:.1f} | "
              f"{med['resident'] / MiB:.1f} |")


if __name__ == "__main__":
    main()
