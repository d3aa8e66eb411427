"""Budgets from 1% to 100% of store-all on the Navier–Stokes step: predicted vs measured.

    .venv/bin/python benchmarks/budget.py                 # T = 4000 (about 10 minutes)
    .venv/bin/python benchmarks/budget.py --steps 500     # a quicker sweep

For each budget (a fraction of the planner's predicted store-all peak) one subprocess runs
``deepsolve.unroll(step, w0, T, budget=...)`` forward and backward and reports: the plan,
predicted peak and time, the measured tracked peak (tensors saved for backward + device
snapshots, the CPU measure the budget bounds; MemoryMeter), the process's peak RSS above its
baseline, and the wall time relative to plain autograd (store-all) measured in the same
sweep. torch.utils.checkpoint over uniform segments of several lengths gives the comparison
curve; ``--png FILE`` draws the memory/time trade-off of both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(kind: str, T: int, arg: float) -> dict:
    import ns_step
    import torch
    from torch.utils.checkpoint import checkpoint

    import deepsolve
    from deepsolve.memory import profile_step
    from deepsolve.memory.meter import MemoryMeter
    from deepsolve.memory.planner import predicted_peak

    torch.set_num_threads(1)
    step, w0, closure = ns_step.make()
    prof = profile_step(step, w0)
    full = predicted_peak(prof, T, "store_all")
    w = w0.detach().clone().requires_grad_()
    row: dict = {"kind": kind, "T": T, "store_all_peak": full}
    st = deepsolve.UnrollStats()
    # warm up the step outside the measurement
    with torch.no_grad():
        step(w0, 0)
    with MemoryMeter("cpu", stats=st) as m:
        t0 = time.perf_counter()
        if kind == "budget":
            budget = int(arg * full)
            row["budget"] = budget
            y = deepsolve.unroll(step, w, T, budget=budget, stats=st)
        elif kind == "plain":
            y = w
            for i in range(T):
                y = step(y, i)
        elif kind == "checkpoint":
            k = int(arg)
            row["segment"] = k

            def seg(z, a, b):
                for i in range(a, b):
                    z = step(z, i)
                return z

            y = w
            for a in range(0, T, k):
                y = checkpoint(seg, y, a, min(a + k, T), use_reentrant=False)
        (y**2).mean().backward()
        wall = time.perf_counter() - t0
    row.update(wall=wall, tracked=m.tracked_peak, rss=m.host_peak, saved=m.saved_peak,
               rss_reset=m.host_reset,
               unit=T * (prof.t_record + prof.t_backward))  # the time model's 1.0, seconds
    if kind == "budget":
        p = st.extra["plan"]
        row.update(plan=p.describe(), predicted_peak=p.predicted_peak,
                   predicted_time=p.predicted_time, advances=st.advances)
    return row


def run_child(kind, T, arg):
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(T), str(arg)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--fractions", type=float, nargs="*",
                    default=[0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0])
    ap.add_argument("--segments", type=int, nargs="*", default=None)
    ap.add_argument("--png", help="write the memory/time trade-off plot here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, T, arg = args.child
        print(json.dumps(child(kind, int(T), float(arg))))
        return
    T = args.steps
    segs = args.segments or sorted({10, 30, math.isqrt(T), 4 * math.isqrt(T), T // 4})
    plain = run_child("plain", T, 0)
    rows = []
    for f in args.fractions:
        r = run_child("budget", T, f)
        rows.append(r)
        print(f"  budget {f:.0%}: {r['plan']} {r['wall']:.1f}s", file=sys.stderr)
    ck = []
    for k in segs:
        r = run_child("checkpoint", T, k)
        ck.append(r)
        print(f"  checkpoint k={k}: {r['wall']:.1f}s", file=sys.stderr)
    MiB = 2**20
    print(f"T = {T}, 64x64 float32 Navier-Stokes + CNN closure; store-all predicted peak "
          f"{plain['store_all_peak'] / MiB:.0f} MiB; plain autograd {plain['wall']:.1f} s, "
          f"tracked peak {plain['tracked'] / MiB:.0f} MiB, RSS peak {plain['rss'] / MiB:.0f} MiB"
          "\n")
    print("| budget | plan | predicted peak [MiB] | tracked peak [MiB] | tracked / budget | "
          "predicted / tracked | RSS peak [MiB] | predicted time | measured time | "
          "measured / predicted | predicted [s] | measured [s] | measured / predicted [s] |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        meas = r["wall"] / plain["wall"]
        pred_s = r["predicted_time"] * r["unit"]  # the model in seconds, this run's profile
        print(f"| {r['budget'] / MiB:.1f} MiB ({r['budget'] / r['store_all_peak']:.0%}) | "
              f"{r['plan']} | {r['predicted_peak'] / MiB:.1f} | {r['tracked'] / MiB:.1f} | "
              f"{r['tracked'] / r['budget']:.3f} | {r['predicted_peak'] / r['tracked']:.3f} | "
              f"{r['rss'] / MiB:.0f} | {r['predicted_time']:.3f} | {meas:.3f} | "
              f"{meas / r['predicted_time']:.3f} | {pred_s:.1f} | {r['wall']:.1f} | "
              f"{r['wall'] / pred_s:.3f} |")
    print("\n| torch.utils.checkpoint segment | tracked peak [MiB] | RSS peak [MiB] | "
          "time / plain |")
    print("|---|---|---|---|")
    for r in ck:
        print(f"| {r['segment']} | {r['tracked'] / MiB:.1f} | {r['rss'] / MiB:.0f} | "
              f"{r['wall'] / plain['wall']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": plain, "budget": rows, "checkpoint": ck}, f, indent=1)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        # peak RSS above baseline: the one measure that sees inside torch.utils.checkpoint
        # (its own saved-tensor hooks hide its tensors from ours)
        ax.plot([r["rss"] / MiB for r in rows], [r["wall"] / plain["wall"] for r in rows],
                "o-", label="deepsolve, budget-planned")
        ax.plot([r["rss"] / MiB for r in ck], [r["wall"] / plain["wall"] for r in ck],
                "s--", label="torch.utils.checkpoint, uniform segments")
        ax.plot([plain["rss"] / MiB], [1.0], "k*", ms=12, label="plain autograd")
        ax.set_xscale("log")
        ax.set_xlabel("peak RSS above baseline [MiB]")
        ax.set_ylabel("time / plain autograd")
        ax.set_title(f"Navier–Stokes 64², T = {T}: memory/time trade-off")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
