"""Budgets from the minimum to store-all: predicted peak against the real peak of the first
(cold) call and of a later (warm) one, time, and what holding host memory costs in CPU time.

    .venv/bin/python benchmarks/budget.py                          # ns and conv (~25 min)
    .venv/bin/python benchmarks/budget.py --workload ns --steps 500
    .venv/bin/python benchmarks/budget.py --workload conv --budgets 6
    .venv/bin/python benchmarks/budget.py --workload pointwise --allocators
    .venv/bin/python benchmarks/budget.py --workload ks --steps 100000   # a 1 KiB state

Workloads:

* ``ns`` — the 64x64 float32 Navier–Stokes step with a CNN closure (``ns_step.py``): a
  16 KiB state whose recorded step keeps ~100 states' worth;
* ``conv`` — Gray–Scott reaction–diffusion on 32 two-field 128x128 float32 grids (a 4 MiB
  state), the Laplacian as a depthwise convolution plus a 2->8->2 convolutional closure: a
  working set dominated by convolution buffers;
* ``pointwise``, ``spectral``, ``ks``, ``ks64`` — the steps of ``tests/data/real_peak.py``:
  4 MiB pointwise and pseudo-spectral steps, and an explicit Kuramoto–Sivashinsky step on a
  1 KiB (``ks``) or 64 KiB (``ks64``) state, where the objects around the tensors are most
  of the memory.

For each budget — from 5 % above the planner's minimum (with room for ``n^(1/3)``
snapshots) to 2 % above its store-all peak, geometrically spaced — one fresh process, after
the user's own warm-up (one plain step forward and backward; nothing of deepsolve called),
runs ``deepsolve.unroll(step, x0, T, budget=...)`` forward and backward twice: the **cold**
call (profile, plan, unroll, backward: a batch job's first iteration) and, after emptying the
host allocator's cache, the **warm** one. Each reports the real peak (the RSS high-water mark
above the resident size just before the call, reset through /proc/self/clear_refs), the
wall and CPU time; the cold call's time beyond its two sweeps is its planning time. Plain
autograd runs once per workload, in a process of its own. ``--allocators`` runs each budget
three times: with deepsolve's host allocator (what a user gets), with glibc's defaults
(``DEEPSOLVE_HOST_ALLOCATOR=0 DEEPSOLVE_MALLOPT=0``) and with glibc's thresholds fixed (the
previous way to hold the bound: ``DEEPSOLVE_HOST_ALLOCATOR=0``), and prints the CPU time of
the warm call of each. ``--png FILE`` draws real peak against time for the ``ns`` workload
beside ``torch.utils.checkpoint`` over uniform segments (``--segments``).
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
    if workload != "conv":
        sys.path.insert(0, os.path.join(HERE, "..", "tests", "data"))
        from real_peak import build

        return build(workload)
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
    from deepsolve.memory import hostalloc
    from deepsolve.memory.meter import process_status, reset_high_water_mark
    from deepsolve.memory.planner import minimum_budget, predicted_peak

    torch.set_num_threads(1)
    step, x0, params = make(workload)
    if kind == "sizes":
        prof = deepsolve.plan(step, x0, T, budget=2**50).profile
        return {"kind": kind, "T": T, "store_all_peak": predicted_peak(prof, T, "store_all"),
                "minimum": minimum_budget(prof, T), "slot": prof.slot_bytes}
    (step(x0, 0) ** 2).mean().backward()  # the user's own warm-up: one plain step
    x0.grad = None
    for p in params:
        p.grad = None

    def measured(fn) -> dict:
        reset_high_water_mark()
        base = process_status("VmRSS:")
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = fn()
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        return {"wall": wall, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                "sys": r1.ru_stime - r0.ru_stime, "real": process_status("VmHWM:") - base,
                "out": out}

    row: dict = {"kind": kind, "T": T}
    if kind == "budget":
        budget = int(arg)

        def call():
            st = deepsolve.UnrollStats()
            y = deepsolve.unroll(step, x0, T, budget=budget, stats=st)
            (y**2).mean().backward()
            return st

        cold = measured(call)
        hostalloc.set_limit(None)  # the first call's cache, reserved for its budget: emptied
        warm = measured(call)
        st = cold.pop("out")
        p = st.extra["plan"]
        cold["planning"] = cold["wall"] - st.forward_time - st.backward_time
        warm.pop("out")
        row.update(budget=budget, plan=p.describe(), predicted_peak=p.predicted_peak,
                   predicted_time=p.predicted_time, cold=cold, warm=warm,
                   unit=T * (p.profile.t_record + p.profile.t_backward),
                   host=hostalloc.active(), wall=warm["wall"], real=warm["real"])
        return row

    def run():
        if kind == "plain":
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

    m = measured(run)
    m.pop("out")
    row.update(m)
    return row


ALLOCATORS = {"host": {}, "glibc": {"DEEPSOLVE_HOST_ALLOCATOR": "0", "DEEPSOLVE_MALLOPT": "0"},
              "fixed": {"DEEPSOLVE_HOST_ALLOCATOR": "0"}}


def run_child(workload, T, kind, arg, allocator: str = "host") -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and not k.startswith("DEEPSOLVE_")}
    env.update(ALLOCATORS[allocator])
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run([sys.executable, __file__, "--child", workload, str(T), kind,
                          str(arg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(workload: str, T: int, count: int, allocators: bool) -> tuple[dict, list]:
    sizes = run_child(workload, T, "sizes", 0)
    lo = max(1.05 * sizes["minimum"], sizes["minimum"] + math.ceil(T ** (1 / 3)) * sizes["slot"])
    hi = 1.02 * sizes["store_all_peak"]
    budgets = [int(lo * (hi / lo) ** (k / (count - 1))) for k in range(count)]
    plain = run_child(workload, T, "plain", 0)
    rows = []
    for b in budgets:
        r = run_child(workload, T, "budget", b)
        if allocators:
            r["glibc"] = run_child(workload, T, "budget", b, "glibc")
            r["fixed"] = run_child(workload, T, "budget", b, "fixed")
        rows.append(r)
        print(f"  {workload} budget {b / MiB:.2f} MiB: {r['plan']} real cold "
              f"{r['cold']['real'] / MiB:.2f} warm {r['warm']['real'] / MiB:.2f} MiB, "
              f"{r['wall']:.1f} s", file=sys.stderr)
    return plain, rows


def table(workload: str, plain: dict, rows: list, allocators: bool) -> None:
    print(f"\n{workload}, T = {rows[0]['T']}: plain autograd {plain['wall']:.2f} s, real peak "
          f"{plain['real'] / MiB:.2f} MiB\n")
    head = ("| budget [MiB] | plan | predicted peak | real peak, cold | cold / budget | "
            "real peak, warm | warm / budget | predicted / warm | planning, cold [s] | "
            "time / plain | measured / predicted time |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|"
    if allocators:
        head += (" CPU host / glibc | CPU fixed / glibc | system time host / glibc / fixed "
                 "[s] | warm real, glibc / fixed [MiB] |")
        sep += "---|---|---|---|"
    print(head)
    print(sep)
    for r in rows:
        c, w, b = r["cold"], r["warm"], r["budget"]
        line = (f"| {b / MiB:.2f} | {r['plan']} | {r['predicted_peak'] / MiB:.2f} | "
                f"{c['real'] / MiB:.2f} | {c['real'] / b:.3f} | {w['real'] / MiB:.2f} | "
                f"{w['real'] / b:.3f} | {r['predicted_peak'] / max(w['real'], 1):.3f} | "
                f"{c['planning']:.2f} | {w['wall'] / plain['wall']:.2f} | "
                f"{w['wall'] / (r['predicted_time'] * r['unit']):.2f} |")
        if allocators:
            g, f = r["glibc"]["warm"], r["fixed"]["warm"]
            line += (f" {w['cpu'] / g['cpu']:.2f} | {f['cpu'] / g['cpu']:.2f} | "
                     f"{w['sys']:.1f} / {g['sys']:.1f} / {f['sys']:.1f} | "
                     f"{g['real'] / MiB:.1f} / {f['real'] / MiB:.1f} |")
        print(line)


STEPS = {"ns": 1000, "conv": 24, "pointwise": 12, "spectral": 10, "ks": 10_000, "ks64": 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=[*STEPS, "both"], default="both")
    ap.add_argument("--steps", type=int, default=None,
                    help="unroll length (default: " + ", ".join(f"{k} {v}" for k, v in
                                                            STEPS.items()) + ")")
    ap.add_argument("--budgets", type=int, default=7, help="budgets per sweep (default 7)")
    ap.add_argument("--allocators", action="store_true",
                    help="also run each budget with glibc's defaults and fixed thresholds "
                         "(default for conv)")
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
        T = args.steps or STEPS[workload]
        allocators = args.allocators or workload == "conv"
        plain, rows = sweep(workload, T, args.budgets, allocators)
        table(workload, plain, rows, allocators)
        out[workload] = {"plain": plain, "budget": rows}
        if workload == "ns" and (args.png or args.segments):
            segs = args.segments or sorted({10, math.isqrt(T), 4 * math.isqrt(T), T // 4})
            ck = [run_child(workload, T, "checkpoint", k) for k in segs]
            out[workload]["checkpoint"] = ck
            print("\n| torch.utils.checkpoint segment | real peak [MiB] | time / plain |")
            print("|---|---|---|")
            for r in ck:
                print(f"| {r['segment']} | {r['real'] / MiB:.1f} | "
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
    # the first (cold) call's real peak: a warm call's rise above a baseline that already
    # holds the cold call's freed memory understates a store-all unroll's use
    ax.plot([r["cold"]["real"] / MiB for r in rows], [r["wall"] / plain["wall"] for r in rows],
            "o-", label="deepsolve, budget-planned (first call's real peak)")
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
