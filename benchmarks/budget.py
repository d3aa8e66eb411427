"""Budgets from the minimum to store-all: predicted peak against the real peak, and time.

    .venv/bin/python benchmarks/budget.py                          # both workloads (~15 min)
    .venv/bin/python benchmarks/budget.py --workload ns --steps 500
    .venv/bin/python benchmarks/budget.py --workload conv --budgets 6

Two workloads of different shape:

* ``ns`` — the 64x64 float32 Navier–Stokes step with a CNN closure (``ns_step.py``): a
  16 KiB state whose recorded step keeps ~100 states' worth;
* ``conv`` — Gray–Scott reaction–diffusion on 32 two-field 128x128 float32 grids (a 4 MiB
  state), the Laplacian as a depthwise convolution plus a 2->8->2 convolutional closure: a
  working set dominated by convolution buffers.

For each budget — from 5 % above the planner's minimum to 2 % above its store-all peak,
geometrically spaced — one fresh process runs ``deepsolve.unroll(step, x0, T, budget=...)``
forward and backward after a warm-up (the planner, the profiles, one unroll) and reports the
plan, its predicted peak and time, the **real peak** (the process's RSS high-water mark above
its resident size just before the unroll, reset through /proc/self/clear_refs), the bytes
deepsolve tracks (saved tensors + snapshots, MemoryMeter), and the wall time. On the
``conv`` workload each budget runs twice: with the planner's fixed glibc thresholds (what a
user gets) and with ``DEEPSOLVE_MALLOPT=0`` (glibc's dynamic thresholds), to show what the
fix buys in memory and costs in time. Plain autograd runs once per workload for the time
ratio. ``--png FILE`` draws real peak against time for the ``ns`` workload beside
``torch.utils.checkpoint`` over uniform segments (``--segments``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MiB = 2**20


def make(workload: str):
    """``(step, x0, params)`` of a workload; ``x0`` requires grad."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if workload == "ns":
        import ns_step

        step, w0, closure = ns_step.make()
        return step, w0.detach().clone().requires_grad_(), list(closure.parameters())
    torch.manual_seed(0)
    side, batch = 128, 4 * MiB // (2 * 128 * 128 * 4)
    lap = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]).expand(2, 1, 3, 3)
    lap = lap.clone()
    diff = torch.tensor([0.16, 0.08]).view(1, 2, 1, 1)
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                        nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"))

    def step(x, i):
        u, v = x[:, :1], x[:, 1:]
        uvv = u * v * v
        react = torch.cat([-uvv + 0.035 * (1 - u), uvv - 0.095 * v], dim=1)
        lx = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), lap, groups=2)
        return x + 0.5 * (diff * lx + react) + 0.01 * net(x)

    return step, torch.rand(batch, 2, side, side).requires_grad_(), list(net.parameters())


def child(workload: str, T: int, kind: str, arg: float) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint

    import deepsolve
    from deepsolve.memory.meter import MemoryMeter, process_status, reset_high_water_mark
    from deepsolve.memory.planner import predicted_peak

    torch.set_num_threads(1)
    step, x0, params = make(workload)
    prof = deepsolve.plan(step, x0, T, budget=2**50).profile  # fixes glibc's thresholds
    row: dict = {"kind": kind, "T": T, "store_all_peak": predicted_peak(prof, T, "store_all"),
                 "minimum": predicted_peak(prof, T, "revolve", 1),
                 "unit": T * (prof.t_record + prof.t_backward)}  # the time model's 1.0 [s]
    if kind == "sizes":
        return row
    budget = int(arg) if kind == "budget" else None
    if budget is not None:  # warm-up as a training loop's first iteration
        deepsolve.unroll(step, x0, T, budget=budget).pow(2).sum().backward()
    else:
        y = x0
        for i in range(min(T, 20)):
            y = step(y, i)
        y.pow(2).sum().backward()
        del y
    x0.grad = None
    for p in params:
        p.grad = None
    st = deepsolve.UnrollStats()
    reset_high_water_mark()
    base = process_status("VmRSS:")
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with MemoryMeter("cpu", stats=st) as m:
        if budget is not None:
            y = deepsolve.unroll(step, x0, T, budget=budget, stats=st)
        elif kind == "plain":
            y = x0
            for i in range(T):
                y = step(y, i)
        else:  # torch.utils.checkpoint over uniform segments of arg steps
            k = int(arg)
            row["segment"] = k

            def seg(z, a, b):
                for i in range(a, b):
                    z = step(z, i)
                return z

            y = x0
            for a in range(0, T, k):
                y = checkpoint(seg, y, a, min(a + k, T), use_reentrant=False)
        (y**2).mean().backward()
        del y
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    row.update(wall=wall, cpu=(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
               sys=r1.ru_stime - r0.ru_stime, real=process_status("VmHWM:") - base,
               tracked=m.tracked_peak)
    if budget is not None:
        p = st.extra["plan"]
        row.update(budget=budget, plan=p.describe(), predicted_peak=p.predicted_peak,
                   predicted_time=p.predicted_time, advances=st.advances)
    return row


def run_child(workload, T, kind, arg, glibc: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["DEEPSOLVE_MALLOPT"] = "0" if glibc else "1"
    out = subprocess.run([sys.executable, __file__, "--child", workload, str(T), kind,
                          str(arg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(workload: str, T: int, count: int, both: bool) -> tuple[dict, list]:
    sizes = run_child(workload, T, "sizes", 0)
    lo, hi = 1.05 * sizes["minimum"], 1.02 * sizes["store_all_peak"]
    budgets = [int(lo * (hi / lo) ** (k / (count - 1))) for k in range(count)]
    plain = run_child(workload, T, "plain", 0)
    rows = []
    for b in budgets:
        r = run_child(workload, T, "budget", b)
        if both:
            r["glibc"] = run_child(workload, T, "budget", b, glibc=True)
        rows.append(r)
        print(f"  {workload} budget {b / MiB:.1f} MiB: {r['plan']} real "
              f"{r['real'] / MiB:.1f} MiB, {r['wall']:.1f} s", file=sys.stderr)
    return plain, rows


def table(workload: str, plain: dict, rows: list, both: bool) -> None:
    print(f"\n{workload}, T = {rows[0]['T']}: minimum {rows[0]['minimum'] / MiB:.1f} MiB, "
          f"store-all {rows[0]['store_all_peak'] / MiB:.1f} MiB predicted; plain autograd "
          f"{plain['wall']:.1f} s, real peak {plain['real'] / MiB:.1f} MiB\n")
    head = ("| budget [MiB] | plan | predicted peak | real peak | real / budget | "
            "predicted / real | tracked | time / plain | measured / predicted time |")
    sep = "|---|---|---|---|---|---|---|---|---|"
    if both:
        head += (" real peak, glibc defaults | real / budget, glibc | CPU time fixed / "
                 "glibc | system time fixed / glibc [s] |")
        sep += "---|---|---|---|"
    print(head)
    print(sep)
    for r in rows:
        meas = r["wall"] / plain["wall"]
        line = (f"| {r['budget'] / MiB:.1f} | {r['plan']} | {r['predicted_peak'] / MiB:.1f} | "
                f"{r['real'] / MiB:.1f} | {r['real'] / r['budget']:.3f} | "
                f"{r['predicted_peak'] / max(r['real'], 1):.3f} | {r['tracked'] / MiB:.1f} | "
                f"{meas:.2f} | {r['wall'] / (r['predicted_time'] * r['unit']):.2f} |")
        if both:
            g = r["glibc"]
            line += (f" {g['real'] / MiB:.1f} | {g['real'] / r['budget']:.2f} | "
                     f"{r['cpu'] / g['cpu']:.2f} | {r['sys']:.1f} / {g['sys']:.1f} |")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["ns", "conv", "both"], default="both")
    ap.add_argument("--steps", type=int, default=None,
                    help="unroll length (default: 1000 for ns, 24 for conv)")
    ap.add_argument("--budgets", type=int, default=7, help="budgets per sweep (default 7)")
    ap.add_argument("--segments", type=int, nargs="*", default=None)
    ap.add_argument("--png", help="write the ns memory/time trade-off plot here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        workload, T, kind, arg = args.child
        print(json.dumps(child(workload, int(T), kind, float(arg))))
        return
    out = {}
    for workload in (["ns", "conv"] if args.workload == "both" else [args.workload]):
        T = args.steps or (1000 if workload == "ns" else 24)
        both = workload == "conv"
        plain, rows = sweep(workload, T, args.budgets, both)
        table(workload, plain, rows, both)
        out[workload] = {"plain": plain, "budget": rows}
        if workload == "ns" and (args.png or args.segments):
            segs = args.segments or sorted({10, math.isqrt(T), 4 * math.isqrt(T), T // 4})
            ck = [run_child(workload, T, "checkpoint", k) for k in segs]
            out[workload]["checkpoint"] = ck
            print("\n| torch.utils.checkpoint segment | real peak [MiB] | tracked [MiB] | "
                  "time / plain |")
            print("|---|---|---|---|")
            for r in ck:
                print(f"| {r['segment']} | {r['real'] / MiB:.1f} | {r['tracked'] / MiB:.1f} | "
                      f"{r['wall'] / plain['wall']:.2f} |")
            if args.png:
                plot(args.png, T, plain, rows, ck)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def plot(path: str, T: int, plain: dict, rows: list, ck: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot([r["real"] / MiB for r in rows], [r["wall"] / plain["wall"] for r in rows],
            "o-", label="deepsolve, budget-planned")
    ax.plot([r["real"] / MiB for r in ck], [r["wall"] / plain["wall"] for r in ck],
            "s--", label="torch.utils.checkpoint, uniform segments")
    ax.plot([plain["real"] / MiB], [1.0], "k*", ms=12, label="plain autograd")
    ax.set_xscale("log")
    ax.set_xlabel("real peak (RSS above baseline) [MiB]")
    ax.set_ylabel("time / plain autograd")
    ax.set_title(f"Navier–Stokes 64², T = {T}: memory/time trade-off")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
