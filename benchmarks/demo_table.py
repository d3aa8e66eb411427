"""The README's numbers for the main job, generated from a run's log (so they can be
regenerated after any change instead of typed).

    .venv/bin/python benchmarks/demo_table.py runs/navier_stokes-latest           # print
    .venv/bin/python benchmarks/demo_table.py runs/navier_stokes-latest --readme README.md

prints (or writes between the ``<!-- demo-table -->`` markers of README.md) the plan the
budget gave, the closure's relative L2 error on the held-out trajectories before training
and at every evaluated iteration beside the uncorrected coarse solver's, and the training
time (the sum of the log's per-iteration ``time``). tests/test_readme.py checks that
README.md holds this script's output for the log kept in docs/data/navier_stokes_demo.h5
(the demo run whose numbers the README quotes).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BEGIN, END = "<!-- demo-table:begin -->", "<!-- demo-table:end -->"


def table(log_path: str) -> str:
    """The markdown block for the demo run whose log is ``log_path``."""
    from deepsolve.io import read_log
    from deepsolve.memory.budget import format_bytes

    log = read_log(log_path)
    c, cfg = log.columns, log.attrs["config"]
    rows = [k for k in range(log.n_rows) if math.isfinite(c["metric/rel_err_closure"][k])]
    budget = log.attrs.get("budget_bytes")
    budget_text = format_bytes(budget) if budget else str(cfg["budget"])
    lines = [
        f"With the defaults ({log.n_rows} iterations of {cfg['steps']}-step unrolls through a "
        f"{cfg['coarse_n']}² coarse solver, a {budget_text} budget → "
        f"`{c['schedule'][-1]}`), the trained closure against the uncorrected coarse solver "
        f"on the {cfg['n_test']} held-out initial conditions — relative L2 error of the "
        "vorticity at the horizon (`metric/rel_err_*` in the log):",
        "",
        "| after iteration | closure | uncorrected coarse | improvement |",
        "|---|---|---|---|",
    ]
    init = log.attrs.get("initial_metrics") or {}
    if init:
        lines.append(f"| (before training) | {init['rel_err_closure']:.3f} | "
                     f"{init['rel_err_coarse']:.3f} | {init['improvement']:.2f}× |")
    for k in rows:
        lines.append(f"| {int(c['iteration'][k]) + 1} | {c['metric/rel_err_closure'][k]:.3f} | "
                     f"{c['metric/rel_err_coarse'][k]:.3f} | {c['metric/improvement'][k]:.2f}× |")
    lines += ["", f"Training took {sum(c['time']):.0f} s ({log.attrs.get('threads', '?')} "
              f"thread(s), {sum(c['time']) / log.n_rows:.1f} s per iteration, "
              f"{log.attrs.get('device_name', '')})."]
    real = c.get("peak_real_memory")
    if real is not None and np.isfinite(real).any():
        lines[-1] += (f" The largest real peak of an iteration, everything it adds above the "
                      f"run's start (the unroll under its budget, the optimiser, what the first "
                      f"step profile leaves resident), was {format_bytes(np.nanmax(real))}.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run directory (or its log.h5)")
    ap.add_argument("--readme", help="replace the block between the markers of this file")
    args = ap.parse_args()
    log = args.run if args.run.endswith(".h5") else os.path.join(args.run, "log.h5")
    block = table(log)
    if not args.readme:
        print(block)
        return 0
    text = open(args.readme).read()
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pat.search(text):
        print(f"{args.readme}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    with open(args.readme, "w") as f:
        f.write(pat.sub(lambda m: f"{BEGIN}\n{block}\n{END}", text))
    print(f"{args.readme}: demo table updated from {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
