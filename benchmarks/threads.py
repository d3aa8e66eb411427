"""Seconds per training iteration of the shipped problems with 1 and 2 torch threads, on a
quiet machine and on a loaded one — what the trainer's default thread count rests on.

    .venv/bin/python benchmarks/threads.py                       # all unrolled problems (~15 min)
    .venv/bin/python benchmarks/threads.py --problems navier_stokes --iterations 3
    .venv/bin/python benchmarks/threads.py --demo quiet:1 quiet:2 loaded:1 --keep runs/demo

``--demo MACHINE:THREADS ...`` times the whole main job instead (what ``make demo`` runs:
``train problems/navier_stokes.py`` with its defaults, reference generation included, each
in a fresh data directory as on a fresh clone) and prints its wall time per cell; ``--keep
DIR`` keeps the first cell's run directory there.

Each cell is one ``python -m deepsolve train PROBLEM --threads T`` subprocess with the
problem's default settings (its default horizon, budget and model) and ``--iterations K``;
the figure is the median of the log's per-iteration ``time`` column without iteration 0
(which also profiles the step for the planner). "Loaded" runs the same with ``--load``
busy processes beside it (default: twice the CPUs this process may use), the situation of a
shared login node or workstation. Reference data are generated (and cached) before the
timings. The rows of one problem are taken side by side in the same run, so the ratios
compare like with like on a noisy machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNROLLED = ["navier_stokes", "burgers_assimilation", "implicit_heat"]


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def _run(problem: str, threads: int, iterations: int, workdir: str) -> tuple[float, float]:
    """(median seconds per iteration after the first, wall seconds of the process)."""
    from deepsolve.io import read_log

    out = tempfile.mkdtemp(prefix=f"{problem}-t{threads}-", dir=workdir)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "deepsolve", "train", os.path.join(ROOT, "problems",
                                                                   f"{problem}.py"),
           "--out", os.path.join(out, "run"), "--iterations", str(iterations), "--quiet",
           "--threads", str(threads), "--set", f"data_dir={os.path.join(workdir, 'data')}"]
    if problem != "navier_stokes":
        cmd = cmd[:-2]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    t = read_log(os.path.join(out, "run", "log.h5")).columns["time"]
    return statistics.median(t[1:] if len(t) > 1 else t), wall


class _Load:
    """``n`` busy processes while the block runs."""

    def __init__(self, n: int):
        self.stop = mp.Event()
        self.procs = [mp.Process(target=_spin, args=(self.stop,), daemon=True)
                      for _ in range(n)]

    def __enter__(self):
        for p in self.procs:
            p.start()

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join()


def demo(cells: list[str], load: int, keep: str | None) -> None:
    """Wall time of the main job per ``machine:threads`` cell."""
    import shutil

    print("| machine | threads | `make demo` wall [s] | of which training [s] | s/it |")
    print("|---|---|---|---|---|")
    for k, cell in enumerate(cells):
        machine, threads = cell.split(":")
        work = tempfile.mkdtemp(prefix="deepsolve-demo-")
        out = os.path.join(work, "run")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        cmd = [sys.executable, "-m", "deepsolve", "train",
               os.path.join(ROOT, "problems", "navier_stokes.py"), "--out", out, "--quiet",
               "--threads", threads, "--set", f"data_dir={os.path.join(work, 'data')}"]
        with _Load(load if machine == "loaded" else 0):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
        from deepsolve.io import read_log

        t = read_log(os.path.join(out, "log.h5")).columns["time"]
        print(f"| {machine} | {threads} | {wall:.0f} | {sum(t):.0f} | "
              f"{statistics.median(t):.2f} |", flush=True)
        if keep and k == 0:
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(out, keep)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", nargs="*", default=UNROLLED)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--load", type=int, default=None,
                    help="busy processes for the loaded rows (default 2 x usable CPUs)")
    ap.add_argument("--demo", nargs="*", metavar="MACHINE:THREADS",
                    help="time the whole main job in these cells (quiet:1 loaded:1 ...)")
    ap.add_argument("--keep", help="--demo: keep the first cell's run directory here")
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    load = args.load if args.load is not None else 2 * cpus
    if args.demo:
        print(f"{cpus} usable CPUs; loaded cells run beside {load} busy processes\n")
        demo(args.demo, load, args.keep)
        return
    work = tempfile.mkdtemp(prefix="deepsolve-threads-")
    print(f"{cpus} usable CPUs; loaded rows run beside {load} busy processes; "
          f"{args.iterations} iterations per cell, median of iterations 1..\n")
    if "navier_stokes" in args.problems:   # the reference data, generated once, outside
        _run("navier_stokes", 1, 1, work)  # the timings
    rows = []
    for problem in args.problems:
        for loaded in (False, True):
            with _Load(load if loaded else 0):
                cells = {t: _run(problem, t, args.iterations, work) for t in args.threads}
            rows.append((problem, "loaded" if loaded else "quiet", cells))
            base = cells[args.threads[0]][0]
            print(f"  {problem} {'loaded' if loaded else 'quiet'}: " + ", ".join(
                f"{t} thread(s) {c[0]:.2f} s/it ({c[0] / base:.2f}x)" for t, c in
                cells.items()), flush=True)
    print()
    head = " | ".join(f"{t} thread(s) [s/it]" for t in args.threads)
    ratio = " | ".join(f"{t}/{args.threads[0]}" for t in args.threads[1:])
    print(f"| problem | machine | {head} | {ratio} |")
    print("|---|---|" + "---|" * (2 * len(args.threads) - 1))
    for problem, machine, cells in rows:
        base = cells[args.threads[0]][0]
        vals = " | ".join(f"{cells[t][0]:.3f}" for t in args.threads)
        rs = " | ".join(f"{cells[t][0] / base:.2f}" for t in args.threads[1:])
        print(f"| {problem} | {machine} | {vals} | {rs} |")


if __name__ == "__main__":
    main()
