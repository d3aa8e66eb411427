"""The README's numbers for the main job, generated from a run's log (so they can be
regenerated after any change instead of typed).

    .venv/bin/python benchmarks/demo_table.py runs/navier_stokes-latest           # print
    .venv/bin/python benchmarks/demo_table.py runs/navier_stokes-latest --readme README.md \
        --png docs/img/demo_rollout.png

prints (or writes between the ``<!-- demo-table -->`` markers of README.md) the horizons and
the plan the budget gave, the closure's relative L2 error on the held-out trajectories at the
horizon T and at 4T before training and at every evaluated iteration, with its improvement
over the uncorrected coarse solver, the references without learning (the coarse solver and
its 3/2-padded variant), and the training time (the sum of the log's per-iteration
``time``); ``--png`` draws the last evaluation's error against rollout time.
tests/test_readme.py checks that README.md holds this script's output for the log kept in
docs/data/navier_stokes_demo.h5 (the demo run whose numbers the README quotes).
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


def _rows(log) -> list[int]:
    return [k for k in range(log.n_rows)
            if math.isfinite(log.columns["metric/rel_err_closure"][k])]


def table(log_path: str) -> str:
    """The markdown block for the demo run whose log is ``log_path``."""
    from deepsolve.io import read_log
    from deepsolve.memory.budget import format_bytes

    log = read_log(log_path)
    c, cfg = log.columns, log.attrs["config"]
    rows = _rows(log)
    budget = log.attrs.get("budget_bytes")
    budget_text = format_bytes(budget) if budget else str(cfg["budget"])
    steps = np.asarray(c["n_steps"]) if "n_steps" in c else np.full(log.n_rows, cfg["steps"])
    stages = []
    for k in range(log.n_rows):
        if k == 0 or steps[k] != steps[k - 1]:
            stages.append(f"{int(steps[k])} from iteration {k + 1}")
    horizon = ("horizon curriculum: " + ", ".join(stages)) if len(stages) > 1 else \
        f"{int(steps[0])}-step unrolls"
    has_padded = "metric/rel_err_padded" in c
    lines = [
        f"With the defaults ({log.n_rows} iterations; {horizon}; {cfg.get('batch')} windows "
        f"per iteration through a {cfg['coarse_n']}² coarse solver, a {budget_text} budget → "
        f"`{c['schedule'][-1]}` for the longest), the trained closure on the "
        f"{cfg['n_test']} held-out initial conditions — mean relative L2 error of the "
        f"vorticity at the horizon T = {cfg['steps']} steps and at 4T "
        "(`metric/rel_err_*` in the log):",
        "",
        "| after iteration | closure at T | improvement at T | closure at 4T | "
        "improvement at 4T | blow-ups |",
        "|---|---|---|---|---|---|",
    ]

    def row(label: str, m: dict) -> str:
        return (f"| {label} | {m['rel_err_closure']:.3f} | {m['improvement']:.2f}× | "
                f"{m['rel_err_closure_4T']:.3f} | {m['improvement_4T']:.2f}× | "
                f"{int(m['blowups'])} |")

    init = log.attrs.get("initial_metrics") or {}
    if init and "rel_err_closure_4T" in init:
        lines.append(row("(before training)", init))
    for k in rows:
        lines.append(row(str(int(c["iteration"][k]) + 1),
                         {name[len("metric/"):]: c[name][k] for name in c
                          if name.startswith("metric/")}))
    last = rows[-1]
    lines += ["", f"References (no learning): the uncorrected coarse solver "
              f"{c['metric/rel_err_coarse'][last]:.3f} at T and "
              f"{c['metric/rel_err_coarse_4T'][last]:.3f} at 4T"]
    if has_padded:
        learned = c["metric/rel_err_padded"][last] / c["metric/rel_err_closure"][last]
        lines[-1] += (f"; the same solver with its advection product formed on a 3/2-padded "
                      f"grid (the closure's `advection` input added as it is) "
                      f"{c['metric/rel_err_padded'][last]:.3f} and "
                      f"{c['metric/rel_err_padded_4T'][last]:.3f}, so the learned part of the "
                      f"gain is {learned:.2f}× at T")
    lines[-1] += "."
    lines += ["", f"Training took {sum(c['time']):.0f} s ({log.attrs.get('threads', '?')} "
              f"thread(s), {sum(c['time']) / log.n_rows:.1f} s per iteration, "
              f"{log.attrs.get('device_name', '')})."]
    real = c.get("peak_real_memory")
    if real is not None and np.isfinite(real).any():
        lines[-1] += (f" The largest real peak of an iteration, everything it adds above the "
                      f"run's start (the unroll under its budget, the optimiser, what the first "
                      f"step profile leaves resident), was {format_bytes(np.nanmax(real))}.")
    return "\n".join(lines)


def figure(log_path: str, png: str) -> None:
    """Mean held-out error against rollout time: the trained closure (the log's last
    evaluation), the uncorrected coarse solver and the 3/2-padded one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deepsolve.io import curve_names, read_curves, read_log

    log = read_log(log_path)
    cfg = log.attrs["config"]
    dt, horizon = float(cfg["dt"]), int(cfg["steps"]) * float(cfg["dt"])
    fig, ax = plt.subplots(figsize=(6, 3.4))
    style = {"closure": ("C0", "-", "trained closure"),
             "coarse": ("k", "--", "uncorrected coarse solver"),
             "padded": ("C1", ":", "coarse, 3/2-padded advection")}
    names = curve_names(log_path)
    for key, (color, ls, label) in style.items():
        if f"eval_err_{key}" not in names:
            continue
        cc = read_curves(log_path, f"eval_err_{key}")
        s, v = np.asarray(cc["step"][-1]), np.asarray(cc["value"][-1])
        ok = s >= 0
        ax.plot(s[ok] * dt, v[ok], color=color, ls=ls, label=label)
    ax.axvline(horizon, color="0.6", lw=0.8)
    ax.set_xlabel(f"rollout time (training horizon T = {horizon:g})")
    ax.set_ylabel("mean relative L2 error")
    ax.set_title(f"{cfg['n_test']} held-out initial conditions", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run directory (or its log.h5)")
    ap.add_argument("--readme", help="replace the block between the markers of this file")
    ap.add_argument("--png", help="also draw the error against rollout time here")
    args = ap.parse_args()
    log = args.run if args.run.endswith(".h5") else os.path.join(args.run, "log.h5")
    block = table(log)
    if args.png:
        figure(log, args.png)
        print(f"figure: {args.png}")
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
