"""Budgets with compiled segments: the real peak of the first call and of a warm one, on the CPU.

    .venv/bin/python benchmarks/compiled_budget.py                    # 256 MiB, 512 MiB, 1 GiB
    .venv/bin/python benchmarks/compiled_budget.py --budgets 384 --steps 400

The 2-D Navier–Stokes step of ``benchmarks/ns_step.py`` (64², pseudo-spectral RK4 with a CNN
closure, float64), unrolled ``--steps`` steps under each budget, eager and with
``compile=True``, each in a fresh process: the user warms the step up (one plain step forward
and backward, nothing of deepsolve called), then

* **first call** — ``unroll(..., budget=B, compile=...)`` forward and backward: for the
  compiled run this includes compiling its segment, whose host memory the budget pays for;
* **warm call** — the same again in the same process.

Each call's real peak is the process's RSS high-water mark above its resident size before
the call (``/proc/self/clear_refs`` resets the mark), beside the bytes deepsolve tracks. A
call is within the promise when its real peak is at most ``1.05 B + 8 MiB`` (pages and heap
slack; the CPU check of ``benchmarks/gpu_check.py``); the exit status is 1 otherwise. The
compiled gradients are compared with the eager ones of the same budget (float64, relative).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20


def child(budget: int, steps: int, compiled: bool, out: str) -> dict:
    import torch

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    import ns_step

    step, w0, closure = ns_step.make(dtype=torch.float64)
    params = list(closure.parameters())
    w = w0.detach().clone().requires_grad_()
    torch.autograd.grad((step(w, 0) ** 2).sum(), [w, *params])  # the user's warm-up

    import deepsolve
    from deepsolve.memory.meter import MemoryMeter

    row: dict = {"budget": budget, "compiled": compiled}
    for call in ("first", "warm"):
        st = deepsolve.UnrollStats()
        t0 = time.perf_counter()
        with MemoryMeter("cpu", stats=st) as m:
            y = deepsolve.unroll(step, w, steps, budget=budget, compile=compiled or None,
                                 stats=st)
            g = torch.autograd.grad((y**2).mean(), [w, *params])
        row[call] = {"time": time.perf_counter() - t0, "real": m.host_peak,
                     "tracked": m.tracked_peak}
        del y
    plan = st.extra["plan"]
    row.update(plan=plan.describe(), predicted=plan.predicted_peak, segment=st.segment,
               compiler=st.extra.get("compiler_memory", 0), planned_budget=plan.budget)
    torch.save([x.detach() for x in g], out)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="*", default=[256, 512, 1024],
                    help="budgets in MiB")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        b, n, c, out = args.child
        print(json.dumps(child(int(b), int(n), c == "1", out)))
        return 0
    import torch

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"2-D Navier-Stokes 64^2 float64, {args.steps} steps; each row a fresh process\n")
    print("| budget | mode | plan | predicted peak | first call: real peak (real / budget) "
          "| tracked | time [s] | warm call: real peak (real / budget) | time [s] | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for mib in args.budgets:
            grads = {}
            for compiled in (False, True):
                out = os.path.join(tmp, f"{mib}-{int(compiled)}.pt")
                res = subprocess.run(
                    [sys.executable, __file__, "--child", str(mib * MiB), str(args.steps),
                     str(int(compiled)), out], capture_output=True, text=True, env=env)
                if res.returncode != 0:
                    print(f"| {mib} MiB | {'compiled' if compiled else 'eager'} | "
                          f"{res.stderr.strip().splitlines()[-1]} | | | | | | | |")
                    failed += 1
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                grads[compiled] = torch.load(out)
                budget = r["budget"]
                ok = all(r[c]["real"] <= 1.05 * budget + 8 * MiB for c in ("first", "warm"))
                failed += not ok
                mode = (f"compiled k = {r['segment']} (compiler {r['compiler'] / MiB:.0f} MiB, "
                        f"planned in {r['planned_budget'] / MiB:.0f} MiB)" if compiled
                        else "eager")
                f, w = r["first"], r["warm"]
                print(f"| {mib} MiB | {mode} | {r['plan']} | {r['predicted'] / MiB:.1f} MiB | "
                      f"{f['real'] / MiB:.1f} MiB ({f['real'] / budget:.3f}) | "
                      f"{f['tracked'] / MiB:.1f} MiB | {f['time']:.1f} | "
                      f"{w['real'] / MiB:.1f} MiB ({w['real'] / budget:.3f}) | "
                      f"{w['time']:.1f} | {'ok' if ok else 'FAIL'} |")
            if len(grads) == 2:
                rel = max(float((a - b).norm() / b.norm()) for a, b in
                          zip(grads[True], grads[False], strict=True))
                print(f"| {mib} MiB | gradients | compiled against eager: max relative "
                      f"difference {rel:.1e} | | | | | | | |")
                failed += not rel < 1e-10
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
