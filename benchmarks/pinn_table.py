"""deepsolve's PINN problems beside the best published results: the table of docs/pinn.md
("Beside the literature").

Each shipped PINN problem runs once with its defaults through the command line, as a user
would run it (``python -m deepsolve train problems/X.py --threads T``): the defaults stop at
their ``time_limit`` (15 minutes) or their iterations, whichever comes first. The errors are
read from the run's HDF5 log: the best evaluated error, the training time at which it was
reached (the log's ``elapsed``, evaluations included) and the last one. Beside them, the
published numbers with their source, time and hardware as published, and the target this
project set itself (docs/pinn.md). By default one run at a time with two threads;
``--parallel 2 --threads 1`` runs two at once, one core each::

    .venv/bin/python benchmarks/pinn_table.py                 # every problems/*_pinn.py
    .venv/bin/python benchmarks/pinn_table.py --threads 1 --parallel 2 --minutes 5
    .venv/bin/python benchmarks/pinn_table.py --problem burgers --set attention=exponential
    .venv/bin/python benchmarks/pinn_table.py --report-only   # re-read the runs in --out

The problems are the files ``problems/<name>_pinn.py``; the published numbers are each
problem's ``published`` (:class:`deepsolve.pinn.Published`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the three targets this project set itself (docs/pinn.md): problem -> (metrics, level)
TARGETS = {"burgers": (["u_rel_l2"], 1e-8), "allen_cahn": (["u_rel_l2"], 2e-6),
           "navier_stokes": (["u_rel_l2", "v_rel_l2"], 1e-9)}


def problem_files() -> dict[str, pathlib.Path]:
    """Every PINN problem file ``problems/<name>_pinn.py`` by ``<name>``."""
    return {f.stem.removesuffix("_pinn"): f for f in sorted((ROOT / "problems").glob("*_pinn.py"))}


def describe(path: pathlib.Path) -> tuple[list[str], tuple]:
    """The metrics the table reports for a problem file, and its ``published`` results."""
    from deepsolve.problem import load_problem

    prob, _ = load_problem(path)
    name = path.stem.removesuffix("_pinn")
    metrics = TARGETS[name][0] if name in TARGETS else [prob.target_metric]
    return metrics, tuple(getattr(prob, "published", ()))


def command(path: pathlib.Path, out: pathlib.Path, threads: int, sets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "deepsolve", "train", str(path), "--threads", str(threads),
           "--out", str(out), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def run_all(jobs: list[tuple[str, list[str]]], parallel: int, threads: int) -> None:
    """Run the commands, ``parallel`` at a time; raise if one fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    waiting, running = list(jobs), []
    while waiting or running:
        while waiting and len(running) < parallel:
            name, cmd = waiting.pop(0)
            print("$", " ".join(cmd[1:]), flush=True)
            running.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env)))
        time.sleep(1.0)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                if proc.returncode != 0:
                    raise SystemExit(f"pinn_table: {name} failed with exit code "
                                     f"{proc.returncode}")


def summary(names: list[str], log_path: pathlib.Path) -> dict:
    """Best (the worst of the problem's metrics at each evaluation) and last errors, with
    the training minutes of the best, the run's minutes and why it stopped."""
    from deepsolve.io import read_log

    c = read_log(log_path).columns
    worst = np.max(np.stack([c[f"metric/{k}"] for k in names]), axis=0)
    rows = np.flatnonzero(np.isfinite(worst))
    if "elapsed" in c:
        minutes = c["elapsed"] / 60
    else:   # a log from before the elapsed column: the iterations' own times
        minutes = np.cumsum(c["time"]) / 60
    best = rows[np.argmin(worst[rows])]
    stopped = [s for s in c.get("stopped", []) if s]
    return {"best": float(worst[best]), "at": float(minutes[best]),
            "last": float(worst[rows[-1]]), "minutes": float(minutes[-1]),
            "iterations": len(minutes),
            "stopped": stopped[-1] if stopped else "iterations"}


def main() -> None:
    files = problem_files()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problem", action="append", choices=sorted(files),
                    help="run only these problems (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="threads per run")
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at the same time (each with --threads)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="time_limit of every run (default: each problem's, 15 minutes)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="a setting for every run, as --set of deepsolve train")
    ap.add_argument("--out", default=str(ROOT / "runs" / "pinn_table"))
    ap.add_argument("--report-only", action="store_true", help="read earlier runs' logs")
    args = ap.parse_args()
    problems = args.problem or list(files)
    sets = args.sets + ([f"time_limit={args.minutes:g}"] if args.minutes else [])
    if not args.report_only:
        jobs = []
        for problem in problems:
            out = pathlib.Path(args.out) / problem
            if out.exists():
                shutil.rmtree(out)
            jobs.append((problem, command(files[problem], out, args.threads, sets)))
        run_all(jobs, max(args.parallel, 1), args.threads)
    print("\n| problem | error | source | method | precision | relative L2 | time | "
          "hardware |")
    print("|---|---|---|---|---|---:|---:|---|")
    for problem in problems:
        log = pathlib.Path(args.out) / problem / "log.h5"
        if not log.exists():
            print(f"{problem}: no log at {log}", file=sys.stderr)
            continue
        metrics, published = describe(files[problem])
        s = summary(metrics, log)
        what = " and ".join(metrics)
        for pub in published:
            print(f"| {problem} | {what} | {pub.source} | {pub.method} | {pub.precision} | "
                  f"{pub.error} | {pub.time} | {pub.hardware} |")
        extra = (" (" + ", ".join(sets) + ")") if sets else ""
        print(f"| {problem} | {what} | **deepsolve**, defaults{extra} | best of "
              f"{s['iterations']} iterations (last {s['last']:.2e}; stopped by "
              f"{s['stopped']}) | float64 | **{s['best']:.2e}** | {s['at']:.1f} min | "
              f"2-core CPU, {args.threads} thread(s), {args.parallel} run(s) at a time |")
        if problem in TARGETS:
            level = TARGETS[problem][1]
            met = "met" if s["best"] <= level else "not met"
            print(f"| {problem} | {what} | target (docs/pinn.md) | | | {level:.0e} | 15 min | "
                  f"this CPU: {met} |")
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.threads} thread(s) per run, "
          f"{args.parallel} at a time")


if __name__ == "__main__":
    main()
