"""Inside the step: what one recorded Navier–Stokes step keeps for backward under each
recomputation policy, what that costs in time, and the end-to-end effect at T = 4000.

    .venv/bin/python benchmarks/inside_step.py            # about 5 minutes on a quiet core
    .venv/bin/python benchmarks/inside_step.py --bf16     # + bf16-snapshot rows (+3 minutes)
    .venv/bin/python benchmarks/inside_step.py --quick    # T = 400, fewer repeats (~1 minute)

Sections:

1. *Where today's tape comes from*: the tensors one recorded step saves (unique storages,
   input and parameters excluded), attributed to the autograd nodes that save them.
2. *The recorded step under each policy* (64x64 float32 Navier–Stokes RK4 + CNN closure,
   ``benchmarks/ns_step.py``; and a wider closure), eager and in a ``CompiledPolicy``: the
   kept tape as the profiler measures it (``profile_step(..., policy=...)``: the
   selective-checkpoint cache, or the compiled backward node's saved tensors), and the time of
   recording + backward, median of interleaved repeats so that load on the machine hits
   every policy alike; the gradient of one step against plain autograd.
3. *End to end at T = 4000 under a fixed budget*, one subprocess per row (peak RSS is its
   own): the planner's choice; each policy forced on the recorded tail with the fewest
   recomputations its smaller tapes fit in the same budget (``CompiledPolicy("save_fft")``
   too, compiled before the clock starts); the planner's row
   again from an initial state perturbed by 1e-7 (relative), to show how much any rounding
   difference changes this chaotic flow's gradient at T; and with ``--bf16``,
   at a small budget, bf16 snapshots against exact ones (more slots, the gradient error they cost).
4. If ``benchmarks/chain.py`` exists, its quick run (see HOOK(chain) below).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 2**20
COMPILED = ("save_expensive", "save_fft", "recompute_all")  # policies also run compiled


def policies(compiled: bool = True) -> dict:
    """Row name -> policy: the eager names, and each of ``COMPILED`` in a CompiledPolicy."""
    from deepsolve import CompiledPolicy

    out = {name: name for name in ("none", "save_expensive", "save_fft", "recompute_all")}
    if compiled:
        out.update({f"compiled:{name}": CompiledPolicy(name) for name in COMPILED})
    return out


# ----------------------------------------------------------------------------------------
# 1. where the tape comes from


def tape_sources(step, w0) -> list[str]:
    """Unique saved storages of one recorded step, by the set of node types saving them."""
    x = w0.detach().requires_grad_()
    y = step(x, 0)
    skip = {x.untyped_storage().data_ptr()}
    owners: dict[int, set] = {}
    size: dict[int, int] = {}
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                val = getattr(node, attr)
            except RuntimeError:
                continue
            for t in val if isinstance(val, (tuple, list)) else (val,):
                if not isinstance(t, torch.Tensor) or (t.is_leaf and t.requires_grad):
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in skip:
                    continue
                owners.setdefault(ptr, set()).add(node.name())
                size[ptr] = t.untyped_storage().nbytes()
        todo.extend(f for f, _ in node.next_functions)
    total = sum(size.values())
    groups: dict[str, int] = {}
    for ptr, names in owners.items():
        if "ConvolutionBackward0" in names:
            key = "closure: convolution inputs (padded GELU outputs), ConvolutionBackward0"
        elif "GeluBackward0" in names:
            key = "closure: GELU inputs (convolution outputs), GeluBackward0"
        elif names == {"FftR2CBackward0"}:
            key = "rfft2's real input, kept by FftR2CBackward0 only (it needs only the shape)"
        else:
            key = "spectral RK4: " + " + ".join(sorted(names))
        groups[key] = groups.get(key, 0) + size[ptr]
    lines = ["| saved by | KiB | share |", "|---|---:|---:|"]
    for key, b in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {key} | {b / 1024:.1f} | {b / total:.0%} |")
    lines.append(f"| **total** | **{total / 1024:.1f}** | 100% |")
    return lines


# ----------------------------------------------------------------------------------------
# 2. the recorded step under each policy


def step_table(configs, rounds: int, compiled: bool = True) -> tuple[list[str], list[dict]]:
    import ns_step
    from torch.utils.checkpoint import checkpoint

    from deepsolve.engine import CompiledPolicy, Step, policy_context, saved_bytes
    from deepsolve.memory import profile_step

    lines = ["| closure | policy | kept tape [KiB] | tape / none | record [ms] | backward [ms] "
             "| record + backward [ms] | time / none | one-step grad rel. err |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for label, kw in configs:
        step, w0, closure = ns_step.make(**kw)
        params = list(closure.parameters())
        pols = policies(compiled)
        tapes = {name: profile_step(step, w0, policy=p, cache=False, repeats=1).tape_bytes
                 for name, p in pols.items()}
        ctx = {name: policy_context(p) for name, p in pols.items() if p is not None}
        # a compiled policy records as the executor does: the compiled (i, *leaves) function
        run = {name: p.compiled_step(Step(step, None, [w0], False), True)
               for name, p in pols.items() if isinstance(p, CompiledPolicy)}
        if compiled:  # for reference: the step compiled without any policy
            name = "torch.compile(step), no policy"
            plain_c = torch.compile(step)
            xi = w0.detach().requires_grad_()
            for _ in range(3):  # compile, then the recompilation with a dynamic i
                plain_c(xi, _).sum().backward()
            y = plain_c(xi, 0)
            found = [t for t in params if t.requires_grad]
            tapes[name] = saved_bytes([y], [xi, *found])
            pols[name] = None
            run[name] = lambda i, x, f=plain_c: ([f(x, i)], [])
        times: dict[str, list] = {name: [] for name in pols}
        grads = {}
        x = w0.detach()
        with torch.no_grad():
            adv = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                step(x, 0)
                adv.append(time.perf_counter() - t0)
        for r in range(rounds + 1):  # round 0 warms up
            for name in pols:
                xi = x.detach().requires_grad_()
                t0 = time.perf_counter()
                if name in run:
                    y = run[name](0, xi)[0][0]
                elif ctx[name] is None:
                    y = step(xi, 0)
                else:
                    y = checkpoint(step, xi, 0, use_reentrant=False, context_fn=ctx[name])
                t1 = time.perf_counter()
                g = torch.autograd.grad(y, [xi, *params], torch.ones_like(y))
                t2 = time.perf_counter()
                if r:
                    times[name].append((t1 - t0, t2 - t1))
                else:
                    grads[name] = g
        base_tape = tapes["none"]
        t_none = statistics.median(a + b for a, b in times["none"])
        for name in pols:
            rec = statistics.median(a for a, _ in times[name])
            bwd = statistics.median(b for _, b in times[name])
            tot = statistics.median(a + b for a, b in times[name])
            num = sum(((a - b).double() ** 2).sum() for a, b in zip(grads[name], grads["none"],
                                                                   strict=True))
            den = sum((b.double() ** 2).sum() for b in grads["none"])
            err = math.sqrt(num / den)
            rows.append(dict(closure=label, policy=name, tape=tapes[name], rec=rec, bwd=bwd,
                             total=tot, ratio=tot / t_none, tape_ratio=tapes[name] / base_tape,
                             advance=statistics.median(adv)))
            lines.append(f"| {label} | {name} | {tapes[name] / 1024:.1f} | "
                         f"{tapes[name] / base_tape:.2f} | {rec * 1e3:.2f} | {bwd * 1e3:.2f} | "
                         f"{tot * 1e3:.2f} | {tot / t_none:.2f} | {err:.1e} |")
        lines.append(f"| {label} | (unrecorded step) | | | {statistics.median(adv) * 1e3:.2f} "
                     "| | | | |")
    return lines, rows


# ----------------------------------------------------------------------------------------
# 3. end to end


def fewest_recomputations(p, q, n: int, budget: int) -> tuple[int, int]:
    """``(snapshots, tail)`` of the revolve-with-recorded-tail with the fewest recomputed
    steps whose tail, kept under ``q``'s policy, fits ``budget`` (time not considered: this
    is the schedule a policy's smaller tapes buy, whether or not it pays)."""
    import dataclasses

    from deepsolve.memory.planner import _best_tail, predicted_peak

    if predicted_peak(q, n, "store_all") <= budget:
        return 1, n
    # the same step times as plain (a policy name without a time floor): fewest advances
    same_time = dataclasses.replace(q, policy="none" if q.policy == "none" else "x",
                                    t_record=p.t_record, t_backward=p.t_backward)
    best = _best_tail(p, n, budget, same_time)
    if best is None:
        raise SystemExit(f"no recorded tail fits {budget} bytes")
    return best[0], best[1]


def child(mode: str, T: int, budget: int, out: str) -> dict:
    import ns_step

    import deepsolve
    from deepsolve import schedules as S
    from deepsolve.engine import execute
    from deepsolve.memory import profile_step
    from deepsolve.memory.meter import process_status, reset_high_water_mark
    from deepsolve.memory.planner import predicted_peak

    torch.set_num_threads(1)
    step, w0, closure = ns_step.make()
    params = list(closure.parameters())
    p = profile_step(step, w0)
    w = w0.detach().clone().requires_grad_()
    st = deepsolve.UnrollStats()
    row: dict = {"mode": mode, "T": T, "budget": budget}
    with torch.no_grad():
        step(w0, 0)
    forced = mode in ("save_expensive", "recompute_all") or mode.startswith("compiled:")
    if forced:
        policy = (deepsolve.CompiledPolicy(mode.partition(":")[2])
                  if mode.startswith("compiled:") else mode)
        q = profile_step(step, w0, policy=policy)  # (compiles a CompiledPolicy)
        s, m = fewest_recomputations(p, q, T, budget)
        sched = S.store_all(T) if m == T else S.revolve_tail(T, s, m)
        row["plan"] = (f"store_all [{mode}]" if m == T
                       else f"revolve(s={s}) + {m} recorded steps [{mode}]")
        row["predicted_peak"] = predicted_peak(q, T, "store_all" if m == T else "revolve_tail",
                                               (s, m))
        row["kept"] = m
    else:
        if mode == "perturbed":  # the flow's sensitivity: x_0 changed by 1e-7 (relative)
            g = torch.Generator().manual_seed(1)
            w = (w0 * (1 + 1e-7 * torch.randn(w0.shape, generator=g, dtype=w0.dtype)))
            w = w.detach().requires_grad_()
        dtype = torch.bfloat16 if mode == "bf16" else None
        plan = deepsolve.plan(step, w0, T, budget=budget, snapshot_dtype=dtype)
        row["plan"] = plan.describe() + (" + bf16 snapshots" if dtype is not None else "")
        row["predicted_peak"] = plan.predicted_peak
        row["kept"] = 0 if plan.policy == "none" else (T if plan.kind == "store_all"
                                                       else plan.schedule.tail)
    can_reset = reset_high_water_mark()
    base = process_status("VmRSS:")
    t0 = time.perf_counter()
    if forced:
        y = execute(step, w, sched, policy=policy, stats=st)
    else:
        y = deepsolve.unroll(step, w, T, budget=budget, stats=st,
                             snapshot_dtype=torch.bfloat16 if mode == "bf16" else None)
    loss = (y**2).mean()
    loss.backward()
    row["wall"] = time.perf_counter() - t0
    row["peak_rss"] = process_status("VmHWM:") - base if can_reset else -1
    row["advances"], row["recorded"] = st.advances, st.recorded
    row["policy"] = st.extra.get("policy", "none")
    torch.save([w.grad, *[q.grad for q in params]], out)
    return row


def end_to_end(T: int, budget: int, small: int, bf16: bool) -> list[str]:
    runs = [("planner", budget), ("save_expensive", budget), ("recompute_all", budget),
            ("compiled:save_fft", budget), ("perturbed", budget)]
    if bf16:
        runs += [("exact", small), ("bf16", small)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        refs: dict[int, list] = {}
        for mode, b in runs:
            out = os.path.join(tmp, f"{mode}.pt")
            res = subprocess.run([sys.executable, __file__, "--child", mode, str(T), str(b),
                                  out], capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"child {mode} failed:\n{res.stderr[-3000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            grads = torch.load(out)
            if b not in refs:  # the first (exact) run at each budget is the reference
                refs[b] = grads
            ref = refs[b]
            num = sum(((a - r).double() ** 2).sum() for a, r in zip(grads, ref, strict=True))
            row["grad_err"] = math.sqrt(num / sum((r.double() ** 2).sum() for r in ref))
            rows.append(row)
            print(f"  done {mode} at {b / MiB:.0f} MiB: {row['wall']:.1f} s", file=sys.stderr)
    lines = [f"T = {T}; one subprocess per row, one thread; gradient error against the exact "
             "run at the same budget (the first row of each budget)", "",
             "| budget | run | plan | predicted peak [MiB] | peak RSS [MiB] | recomputed "
             "(unrecorded) steps | steps kept under the policy | wall [s] | grad rel. err |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rss = f"{r['peak_rss'] / MiB:.0f}" if r["peak_rss"] >= 0 else "—"
        lines.append(f"| {r['budget'] / MiB:.0f} MiB | {r['mode']} | {r['plan']} | "
                     f"{r['predicted_peak'] / MiB:.1f} | {rss} | {r['advances']} | {r['kept']} "
                     f"| {r['wall']:.1f} | {r['grad_err']:.1e} |")
    return lines


# ----------------------------------------------------------------------------------------


# HOOK(chain): the quick arguments for benchmarks/chain.py (written separately). Its own
# docstring gives "--layers 60 --reps 1" as the quick check; "--quick" is used instead if the
# script ever accepts it. Override with --chain-args.
CHAIN_QUICK_ARGS = ["--layers", "60", "--reps", "1"]


def chain_section(extra: list[str] | None = None) -> list[str]:
    """HOOK(chain): when ``benchmarks/chain.py`` exists, run it with quick arguments in a
    subprocess of its own (its own peaks) and return its output as a section of this report;
    nothing to change here once the file lands."""
    path = os.path.join(HERE, "chain.py")
    if not os.path.exists(path):
        return ["(benchmarks/chain.py not present yet: section skipped)"]
    if extra is None:
        usage = subprocess.run([sys.executable, path, "--help"], capture_output=True,
                               text=True).stdout
        extra = ["--quick"] if "--quick" in usage else CHAIN_QUICK_ARGS
    res = subprocess.run([sys.executable, path, *extra], capture_output=True, text=True)
    if res.returncode:
        return [f"benchmarks/chain.py {' '.join(extra)} failed (exit {res.returncode}):",
                res.stderr[-2000:]]
    return [f"`benchmarks/chain.py {' '.join(extra)}`:", "", res.stdout.rstrip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 400, fewer repeats")
    ap.add_argument("--steps", type=int, help="T for the end-to-end runs (default 4000)")
    ap.add_argument("--budget", default="1GiB", help="the fixed budget (default 1GiB)")
    ap.add_argument("--small-budget", default="2MiB",
                    help="the budget of the bf16-snapshot rows (default 2MiB)")
    ap.add_argument("--rounds", type=int, help="interleaved timing repeats (default 30)")
    ap.add_argument("--bf16", action="store_true",
                    help="add bf16 vs exact snapshots at --small-budget (two more T-step runs)")
    ap.add_argument("--no-end-to-end", action="store_true", help="sections 1-2 only")
    ap.add_argument("--end-to-end-only", action="store_true", help="section 3 only")
    ap.add_argument("--no-chain", action="store_true", help="skip benchmarks/chain.py")
    ap.add_argument("--chain-args", help="arguments for benchmarks/chain.py (default: quick)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, T, b, out = args.child
        print(json.dumps(child(mode, int(T), int(b), out)))
        return
    import ns_step

    from deepsolve.memory.budget import parse_budget

    torch.set_num_threads(1)
    T = args.steps or (400 if args.quick else 4000)
    rounds = args.rounds or (8 if args.quick else 30)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread\n")
    if not args.end_to_end_only:
        print("## 1. Where one recorded step's tape comes from (64x64, width 16)\n")
        step, w0, _ = ns_step.make()
        print("\n".join(tape_sources(step, w0)))
        print("\n## 2. The recorded step under each policy\n")
        configs = [("width 16, batch 1", dict()),
                   ("width 32, batch 4", dict(width=32, batch=4))]
        lines, _ = step_table(configs, rounds)
        print("\n".join(lines))
    if not args.no_end_to_end:
        budget = parse_budget(args.budget)
        small = parse_budget(args.small_budget)
        print(f"\n## 3. End to end, T = {T}\n")
        print("\n".join(end_to_end(T, budget, small, args.bf16)))
    if not args.no_chain:
        print("\n## 4. Chain benchmark (benchmarks/chain.py, quick)\n")
        print("\n".join(chain_section(args.chain_args.split() if args.chain_args else None)))


if __name__ == "__main__":
    main()
