"""A heterogeneous chain: ``deepsolve.sequential`` against ``checkpoint_sequential``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chain.py             # about 3 minutes
    .venv/bin/python benchmarks/chain.py --layers 60 --reps 1          # a quick check
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chain.py --planning  # planner times only

The chain: ``--layers`` blocks ``Linear(w_i, w_{i+1}) + ReLU`` with widths cycling through
``--widths`` (default 256/1024/512), batch ``--batch``, float32, CPU. For each segment count of
``torch.utils.checkpoint.checkpoint_sequential`` (``--segments``; ``use_reentrant=False``) one
subprocess measures its memory and time; then ``deepsolve.sequential`` runs, in its own
subprocess, with the budget set to checkpoint_sequential's measured RSS peak (equal memory: both
RSS peaks are reported), and once more below checkpoint_sequential's smallest memory
(``--below`` times it, at least the least-memory schedule's need). Plain autograd gives the
reference.

Measured per run (median over ``--reps`` forward + backward passes after one warm-up pass,
which also profiles and plans for ``sequential``):

* time: wall time of forward + backward [s];
* saved peak: most bytes of tensors saved for backward alive at once (unique storages,
  parameters and the input excluded; ``torch.autograd.graph.saved_tensors_hooks``);
* RSS peak: the process high-water mark (``VmHWM``, reset through /proc/self/clear_refs as in
  ``deepsolve.memory.meter``) above the resident size before the pass, with glibc's mmap
  threshold fixed (``MALLOC_MMAP_THRESHOLD_=131072``) so freed tensors leave the resident set.
  Parameter gradients are allocated by the warm-up pass and zeroed in place, so they are in the
  baseline, not in the peak (``sequential`` adds each layer's gradients to ``.grad`` as it
  goes under ``loss.backward()``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 2 ** 20


def build(n_layers: int, widths: list[int], batch: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    w = [widths[i % len(widths)] for i in range(n_layers + 1)]
    layers = [torch.nn.Sequential(torch.nn.Linear(w[i], w[i + 1]), torch.nn.ReLU())
              for i in range(n_layers)]
    net = torch.nn.Sequential(*layers)
    x = torch.randn(batch, w[0], requires_grad=True)
    return net, x


class _Saved:
    """Peak bytes of tensors saved for backward (unique storages alive)."""

    def __init__(self, exclude):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict = {}
        self.now = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [0, t.untyped_storage().nbytes()]
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        box = _Box(t)
        weakref.finalize(box, self.release, ptr)
        return box

    def release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[ptr]
            self.now -= entry[1]

    @staticmethod
    def unpack(b):
        return b if not isinstance(b, _Box) else b.t


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def child(kind: str, arg: float, opts: dict) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint_sequential

    from deepsolve.memory.meter import process_status, reset_high_water_mark
    from deepsolve.sequential import SequentialStats, sequential

    torch.set_num_threads(opts["threads"])
    net, x = build(opts["layers"], opts["widths"], opts["batch"])
    params = list(net.parameters())
    st = SequentialStats()
    budget = int(arg)
    if kind == "seqlow":  # at least the least-memory schedule's need (plus rounding slack)
        from deepsolve.schedules.hetero import least_memory
        from deepsolve.sequential import profile_chain

        need = least_memory(profile_chain(list(net), x).costs, charge_input=False)
        budget = max(budget, int(1.15 * (need + profile_chain(list(net), x).costs.states[-1])))

    def step():
        if kind == "plain":
            y = net(x)
        elif kind == "ckpt":
            y = checkpoint_sequential(net, int(arg), x, use_reentrant=False)
        else:
            y = sequential(list(net), x, budget=budget, stats=st)
        y.square().mean().backward()

    step()  # warm-up: allocates the parameter gradients; profiles and plans for sequential
    plan_time, profile_time = st.plan_time, st.profile_time
    times, rss, saved, reset = [], [], [], True
    for _ in range(opts["reps"]):
        for p in params:
            p.grad.zero_()
        x.grad = None
        meter = _Saved([x, *params])
        reset = reset_high_water_mark() and reset
        base = process_status("VmRSS:")
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        rss.append(process_status("VmHWM:") - base)
        saved.append(meter.peak)
    row = {"kind": kind, "arg": arg, "time": statistics.median(times), "times": times,
           "rss": max(rss), "saved": max(saved), "rss_reset": reset}
    if kind in ("seq", "seqlow"):
        row.update(budget=budget, schedule=st.schedule, mode=st.mode, block=st.block,
                   advances=st.advances, recorded=st.recorded, predicted_peak=st.predicted_peak,
                   plan_time=plan_time, profile_time=profile_time)
    return row


def planning(sizes: list[int], fractions: list[float], slots: int, exact_max: int) -> None:
    """Planning time of ``hetero`` (``mode="auto"``) on the benchmark's chain shape at several
    lengths and budgets: CPU and wall seconds, the mode it picked, and the gap to
    ``mode="exact"`` where that runs (``n <= exact_max``)."""
    from deepsolve.schedules.hetero import ChainCosts, hetero, least_memory

    def chain(n: int) -> ChainCosts:
        w = [(256, 1024, 512)[i % 3] for i in range(n + 1)]
        batch, f32 = 256, 4
        states = [batch * v * f32 for v in w]
        params = [(w[i] + 1) * w[i + 1] * f32 for i in range(n)]
        # Linear+ReLU as profiled: no tape of its own; scratch = output; backward adds the
        # parameter gradients and the output the record keeps
        fwd = [2e-11 * batch * w[i] * w[i + 1] for i in range(n)]
        return ChainCosts(fwd, states, [0] * n, [2 * f for f in fwd], states[1:],
                          [2 * states[i + 1] + params[i] for i in range(n)])

    print(f"hetero planning time, {slots} slots, chain Linear+ReLU widths 256/1024/512, batch "
          "256 (budget: a fraction of the way from the least-memory need to store-all)\n")
    print("| n | budget | mode | block | CPU [s] | wall [s] | exact CPU [s] | gap to exact |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for n in sizes:
        c = chain(n)
        lo = least_memory(c)
        hi = sum(c.states) + sum(c.backward_overhead)
        for frac in fractions:
            memory = int(lo + frac * (hi - lo))
            t0, w0 = time.process_time(), time.perf_counter()
            h = hetero(c, memory, slots=slots)
            cpu, wall = time.process_time() - t0, time.perf_counter() - w0
            ex = gap = ""
            if n <= exact_max and h.mode != "exact":
                t0 = time.process_time()
                e = hetero(c, memory, slots=slots, mode="exact")
                ex = f"{time.process_time() - t0:.2f}"
                gap = f"{h.advance_cost / e.advance_cost - 1:+.1%}" if e.advance_cost else "0"
            elif h.mode == "exact":
                ex, gap = f"{cpu:.2f}", "0 (exact)"
            print(f"| {n} | {frac:.0%} | {h.mode} | {h.block or '-'} | {cpu:.2f} | {wall:.2f} | "
                  f"{ex} | {gap} |", flush=True)


def run_child(kind: str, arg: float, opts: dict) -> dict:
    # a fixed mmap threshold: glibc then returns every large tensor to the OS when it is freed
    # (no dynamic threshold, no cached heap), so the resident size follows the live tensors
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, repr(arg),
                          json.dumps(opts)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{kind}({arg}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--widths", default="256,1024,512")
    ap.add_argument("--segments", default="2,4,14",
                    help="checkpoint_sequential segment counts (memory levels)")
    ap.add_argument("--below", type=float, default=0.5,
                    help="one more sequential run at this fraction of the smallest "
                         "checkpoint_sequential memory (0: skip)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--planning", action="store_true",
                    help="only time the planner (n = 100, 200, 500, 1000) and exit")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, arg, opts = args.child
        print(json.dumps(child(kind, float(arg), json.loads(opts))))
        return []
    if args.planning:
        planning([100, 200, 500, 1000], [0.02, 0.1, 0.3], 256, exact_max=200)
        return []
    opts = {"layers": args.layers, "batch": args.batch, "reps": args.reps,
            "widths": [int(w) for w in args.widths.split(",")], "threads": args.threads}
    t_start = time.perf_counter()
    plain = run_child("plain", 0, opts)
    print(f"  plain: {plain['time']:.2f} s", file=sys.stderr)
    pairs = []
    for k in [int(s) for s in args.segments.split(",")]:
        ck = run_child("ckpt", k, opts)
        sq = run_child("seq", ck["rss"], opts)
        pairs.append((ck, sq))
        print(f"  segments {k}: checkpoint {ck['time']:.2f} s, sequential {sq['time']:.2f} s",
              file=sys.stderr)
    extra = None
    if args.below > 0 and pairs:
        low = min(ck["rss"] for ck, _ in pairs)
        extra = run_child("seqlow", int(low * args.below), opts)
        print(f"  below: sequential {extra['time']:.2f} s", file=sys.stderr)
    total = time.perf_counter() - t_start

    w = opts["widths"]
    print(f"{args.layers} layers Linear+ReLU, widths cycling {'/'.join(map(str, w))}, batch "
          f"{args.batch}, float32, CPU, {args.threads} thread(s); median of {args.reps} "
          f"forward+backward passes; plain autograd {plain['time']:.2f} s, saved peak "
          f"{plain['saved'] / MiB:.1f} MiB, RSS peak {plain['rss'] / MiB:.1f} MiB "
          f"(benchmark wall time {total:.0f} s)\n")
    print("| memory level | method | time [s] | time / plain | saved peak [MiB] | "
          "RSS peak [MiB] | seq. / ckpt. time | seq. / ckpt. RSS | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ck, sq in pairs:
        level = f"{int(ck['arg'])} segments"
        print(f"| {level} | checkpoint_sequential | {ck['time']:.2f} | "
              f"{ck['time'] / plain['time']:.2f} | {ck['saved'] / MiB:.1f} | "
              f"{ck['rss'] / MiB:.1f} | | | {int(ck['arg'])} equal segments |")
        print(f"| {level} | sequential (budget {ck['rss'] / MiB:.1f} MiB) | {sq['time']:.2f} | "
              f"{sq['time'] / plain['time']:.2f} | {sq['saved'] / MiB:.1f} | "
              f"{sq['rss'] / MiB:.1f} | {sq['time'] / ck['time']:.2f} | "
              f"{sq['rss'] / max(ck['rss'], 1):.2f} | {_plan(sq)} |")
    if extra is not None:
        print(f"| below checkpoint_sequential | sequential (budget {extra['budget'] / MiB:.1f} MiB)"
              f" | {extra['time']:.2f} | {extra['time'] / plain['time']:.2f} | "
              f"{extra['saved'] / MiB:.1f} | {extra['rss'] / MiB:.1f} | | | {_plan(extra)} |")
    print(f"| - | plain autograd | {plain['time']:.2f} | 1.00 | {plain['saved'] / MiB:.1f} | "
          f"{plain['rss'] / MiB:.1f} | | | store all |")
    rows = [plain] + [r for pair in pairs for r in pair] + ([extra] if extra else [])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _plan(r: dict) -> str:
    if r.get("schedule") == "plain":
        return "everything recorded"
    return (f"{r['mode']}, {r['advances']} recomputed layers, planned in "
            f"{r['plan_time']:.2f} s (profile {r['profile_time']:.1f} s)")


if __name__ == "__main__":
    main()
