"""Repeat a two-process torchrun training (gloo, CPU) and count how its processes end.

A two-rank run of tests/data/batch_problem.py once ended with a worker killed by SIGABRT
("terminate called without an active exception": a C++ thread object destroyed while its
thread still ran) on a loaded 2-core machine. This script runs the same job ``--runs``
times, optionally beside ``--burn`` processes that keep the CPUs busy (the load under which
it was seen), and prints how each run ended: its exit code, whether a worker aborted, and
the stderr line that says so.

    python benchmarks/dist_teardown.py --runs 20 --burn 2
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = os.path.join(ROOT, "tests", "data", "batch_problem.py")


def _burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def _run(out: str, iterations: int, resume: bool) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "deepsolve", "train", BATCH, "--out", out, "--quiet", "--iterations",
           str(iterations), *(["--resume"] if resume else [])]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--burn", type=int, default=2, help="busy processes beside the runs")
    ap.add_argument("--iterations", type=int, default=4)
    args = ap.parse_args()
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.burn)]
    for b in burners:
        b.start()
    ends: collections.Counter = collections.Counter()
    t0 = time.time()
    try:
        for k in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "run")
                rc1, err1 = _run(out, args.iterations, False)
                rc2, err2 = _run(out, 2 * args.iterations, True)   # the resumed run
            for label, rc, err in (("fresh", rc1, err1), ("resume", rc2, err2)):
                aborted = "exitcode:-6" in err.replace(" ", "") or "terminate called" in err
                end = "abort" if aborted else ("ok" if rc == 0 else f"rc {rc}")
                ends[end] += 1
                if end != "ok":
                    line = next((x for x in err.splitlines() if "terminate" in x
                                 or "Error" in x), err.strip().splitlines()[-1:])
                    print(f"run {k} ({label}): {end}: {line}", flush=True)
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=5)
    print("| runs | busy processes | ok | aborted (SIGABRT) | other | time |")
    print("|---|---|---|---|---|---|")
    other = sum(v for e, v in ends.items() if e not in ("ok", "abort"))
    print(f"| {2 * args.runs} | {args.burn} | {ends['ok']} | {ends['abort']} | {other} | "
          f"{time.time() - t0:.0f} s |")


if __name__ == "__main__":
    main()
