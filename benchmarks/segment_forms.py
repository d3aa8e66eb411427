"""Compiled segment forms side by side: the step unrolled ``k`` times into one graph, or
compiled once as the body of a loop (``torch._higher_order_ops.scan``), or called ``k`` times
as a nested compile region (``torch.compiler.nested_compile_region``).

    .venv/bin/python benchmarks/segment_forms.py                      # all workloads
    .venv/bin/python benchmarks/segment_forms.py --workloads ode pde4k --repeats 5

For each workload of benchmarks/peers.py (Lorenz-96 of 40 variables, Fisher–KPP on 4096 and
65,536 points, the 64² Navier–Stokes step; float64, one thread) and each form and length
``k``, in a fresh process with an empty inductor cache: the first call of a recorded segment
and its backward (compile and deepsolve's check against the eager steps included), then per
step the median time of an unrecorded segment (``advance``) and of a recorded one with its
backward (``record``), and the bytes a recorded segment keeps for its backward (``tape``,
saved tensors counted once per storage) in units of the state. Eager steps (``k = 1``,
not compiled) are the baseline. Prints one table (docs/compile.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from peers import WORKLOADS, torch_problem  # noqa: E402

RUNS = {
    "eager": [1],
    "unrolled": [1, 2, 4, 8, 16],
    "loop": [8, 32, 128, 512],
    "nested": [8, 32, 128, 512],
}


def child(work: str, form: str, k: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from deepsolve.engine.segments import INDUCTOR_OPTIONS, Segments

    w = WORKLOADS[work]
    step, x0, theta, _ = torch_problem(w)
    x0 = x0.detach()
    state_bytes = x0.numel() * x0.element_size()
    if form == "nested":
        region = torch.compiler.nested_compile_region(step)

        def body(y, s):
            for j in range(k):
                y = region(y, torch.as_tensor(s + j))
            return y
        seg = torch.compile(body, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
    else:
        seg = Segments(step, k, 10**9, compiled=form != "eager",
                       form="loop" if form == "loop" else "unrolled")

    def record():
        x = x0.clone().requires_grad_()
        y = seg(x, 0)
        return torch.autograd.grad((y ** 2).sum(), (x, theta))

    t0 = time.perf_counter()
    record()
    with torch.no_grad():
        seg(x0, 0)
    first = time.perf_counter() - t0
    real_form = getattr(seg, "form", form)
    eager = getattr(seg, "eager_reason", None)
    reps = max(2, min(200, int(4000 / (k * max(1, x0.numel() // 4096)))))
    adv, rec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(reps):
                seg(x0, 0)
        adv.append((time.perf_counter() - t0) / (reps * k))
        t0 = time.perf_counter()
        for _ in range(max(1, reps // 4)):
            record()
        rec.append((time.perf_counter() - t0) / (max(1, reps // 4) * k))
    seen: dict[int, int] = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except Exception:
            pass
        return t

    x = x0.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = seg(x, 0)
    del y
    return dict(first=first, advance=statistics.median(adv), record=statistics.median(rec),
                tape=sum(seen.values()) / state_bytes, form=real_form, eager=eager)


def spawn(work: str, form: str, k: int, repeats: int) -> dict | None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, __file__, "--child", work, form, str(k),
                              str(repeats)], capture_output=True, text=True, env=env,
                             timeout=1800)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last[:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=["ode", "pde4k", "pde64k", "ns"])
    ap.add_argument("--forms", nargs="*", default=list(RUNS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work, form, k, repeats = args.child
        print(json.dumps(child(work, form, int(k), int(repeats))))
        return
    print("| workload | form | k | first call [s] | advance [µs/step] | record + backward "
          "[µs/step] | tape [states] |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for work in args.workloads:
        for form in args.forms:
            for k in RUNS[form]:
                r = spawn(work, form, k, args.repeats)
                if r is None or "error" in r:
                    print(f"| {work} | {form} | {k} | failed: {r and r['error']} | | | |",
                          flush=True)
                    continue
                note = "" if r["form"] == form or form in ("eager", "nested") else \
                    f" (ran {r['form']})"
                if r["eager"]:
                    note += " (eager)"
                print(f"| {work} | {form}{note} | {k} | {r['first']:.1f} | "
                      f"{r['advance'] * 1e6:.1f} | {r['record'] * 1e6:.1f} | "
                      f"{r['tape']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
