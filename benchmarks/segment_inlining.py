"""Compile time and unroll time of compiled segments under Inductor's default inlining and
under deepsolve's setting (``deepsolve.engine.segments.INDUCTOR_OPTIONS``).

Inductor inlines a pointwise value into each of its uses and evaluates the inlined definition
once per use, so a chain whose steps use the state twice (``x - c x``) costs 2^k evaluations
over ``k`` unrolled steps. deepsolve compiles segments with ``realize_reads_threshold=1``,
which stores such a value once. This script measures both settings side by side, each
``(workload, setting)`` in a fresh process with an empty Inductor cache:

* decay — ``x - dt r x`` on 4 values (the trainer tests' tiny problem), 64 steps;
* ode — Lorenz-96, 40 variables, Heun, 4000 steps (benchmarks/peers.py);
* pde4k / pde64k — Fisher–KPP by periodic finite differences, Heun (benchmarks/peers.py).

Columns: the segment length ``k``, the compile time (``stats.compile_time``, the first call),
the median time of 3 further unrolls with their backward, and the gradient's relative
difference from the eager unroll's. A child that runs past ``--timeout`` is reported as such.

    .venv/bin/python benchmarks/segment_inlining.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peers.py beside it
DECAY_STEPS = 64
WORKLOADS = {  # name: segment lengths; every workload but decay is peers.py's of that name
    "decay": (8, 12, 32),
    "ode": (8,),
    "pde4k": (4,),
    "pde64k": (4,),
}
SETTINGS = ("inductor", "deepsolve")


def problem(name: str):
    import torch
    if name == "decay":
        rate = torch.nn.Parameter(torch.tensor(0.1, dtype=torch.float64))
        x0 = torch.linspace(0.5, 1.5, 4, dtype=torch.float64).requires_grad_()

        def step(x, i):
            return x - 0.02 * rate * x
        return step, x0, rate, DECAY_STEPS
    import peers
    w = peers.WORKLOADS[name]
    step, x0, theta, _ = peers.torch_problem(w)
    return step, x0, theta, w["steps"]


def child(name: str, setting: str, k: int) -> dict:
    import torch
    torch.set_num_threads(1)
    import deepsolve
    # the module (deepsolve.engine.segments, the attribute, is the function segments())
    segs = importlib.import_module("deepsolve.engine.segments")
    if setting == "inductor":
        segs.INDUCTOR_OPTIONS = {}
    step, x0, theta, n = problem(name)

    def grad(**kw):
        st = deepsolve.UnrollStats()
        x = deepsolve.unroll(step, x0, n, snapshots=20, stats=st, **kw)
        return torch.autograd.grad((x ** 2).sum(), (theta, x0)), st

    ref, _ = grad()
    g, st = grad(compile=k)
    compile_time = st.compile_time
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        g, st = grad(compile=k)
        times.append(time.perf_counter() - t0)
    import peers
    return dict(k=st.segment, compile=compile_time, time=statistics.median(times),
                grad=peers.rel([t.detach().reshape(-1).numpy() for t in g],
                               [t.detach().reshape(-1).numpy() for t in ref]))


def spawn(name: str, setting: str, k: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--child", json.dumps([name, setting, k])]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"timeout": timeout}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    print("| workload | k | setting | compile [s] | unroll + backward [s] | grad vs eager |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads:
        for k in WORKLOADS[name]:
            for setting in SETTINGS:
                r = spawn(name, setting, k, args.timeout)
                if "timeout" in r:
                    row = f"> {r['timeout']:.0f} (stopped) | | "
                elif "error" in r:
                    row = f"error: {r['error']} | | "
                else:
                    row = f"{r['compile']:.1f} | {r['time']:.4f} | {r['grad']:.1e}"
                print(f"| {name} | {k} | {setting} | {row} |", flush=True)


if __name__ == "__main__":
    main()
