"""deepsolve's PINN problems beside the best published results: the table of docs/pinn.md
("Beside the literature").

Each shipped PINN problem runs once with its defaults through the command line, as a user
would run it (``python -m deepsolve train problems/X.py --threads T``): the defaults stop at
their ``time_limit`` (15 minutes) or their iterations, whichever comes first. The errors are
read from the run's HDF5 log: the best evaluated error, the training time at which it was
reached (the log's ``elapsed``, evaluations included) and the last one. Beside them, the
published numbers with their source, time and hardware as published, and the target this
project set itself (docs/pinn.md). One run at a time, so none competes for the cores::

    .venv/bin/python benchmarks/pinn_table.py                 # about 45 minutes
    .venv/bin/python benchmarks/pinn_table.py --problem burgers --set attention=exponential
    .venv/bin/python benchmarks/pinn_table.py --report-only   # re-read the runs in --out
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

FILES = {"burgers": "burgers_pinn.py", "allen_cahn": "allen_cahn_pinn.py",
         "kovasznay": "navier_stokes_pinn.py"}
METRICS = {"burgers": ["u_rel_l2"], "allen_cahn": ["u_rel_l2"],
           "kovasznay": ["u_rel_l2", "v_rel_l2"]}
TARGETS = {"burgers": 1e-8, "allen_cahn": 2e-6, "kovasznay": 1e-9}

# (source, method, precision, relative L2 error, time, hardware), as published
PUBLISHED: dict[str, list[tuple[str, str, str, str, str, str]]] = {
    "burgers": [
        ("Raissi, Perdikaris & Karniadakis, JCP 378 (2019)", "L-BFGS, 9×20 MLP", "float32",
         "6.7e-4", "—", "—"),
        ("Toscano et al., arXiv:2509.14198 (2025)", "vRBA + SSBroyden, 3×30 MLP", "float64",
         "1.1e-8", "—", "GPU"),
        ("DSGNAR (2026)", "doubly-sketched Gauss–Newton", "float64", "8e-14", "346 s",
         "1× H100"),
        ("DSGNAR (2026)", "doubly-sketched Gauss–Newton", "float32", "4.75e-7", "< 10 s",
         "1× H100"),
    ],
    "allen_cahn": [
        ("Wang et al., JAX-PI, arXiv:2308.08468 (2023)",
         "expert's guide: causal, Fourier features, Adam", "float32", "5.37e-5", "—", "GPU"),
        ("Toscano et al., arXiv:2509.14198 (2025)", "vRBA + SSBroyden, 3×30 MLP", "float64",
         "2.1e-6", "—", "GPU"),
    ],
    "kovasznay": [],
}


def run(problem: str, out: pathlib.Path, threads: int, sets: list[str]) -> None:
    cmd = [sys.executable, "-m", "deepsolve", "train", str(ROOT / "problems" / FILES[problem]),
           "--threads", str(threads), "--out", str(out), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True,
                   env=dict(os.environ, OMP_NUM_THREADS=str(threads)))


def summary(problem: str, log_path: pathlib.Path) -> dict:
    """Best (the worst of the problem's metrics at each evaluation) and last errors, with
    the training minutes of the best, the run's minutes and why it stopped."""
    from deepsolve.io import read_log

    c = read_log(log_path).columns
    names = METRICS[problem]
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problem", action="append", choices=sorted(FILES),
                    help="run only these problems (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="a setting for every run, as --set of deepsolve train")
    ap.add_argument("--out", default=str(ROOT / "runs" / "pinn_table"))
    ap.add_argument("--report-only", action="store_true", help="read earlier runs' logs")
    args = ap.parse_args()
    problems = args.problem or list(FILES)
    results = {}
    for problem in problems:
        out = pathlib.Path(args.out) / problem
        if not args.report_only:
            if out.exists():
                shutil.rmtree(out)
            run(problem, out, args.threads, args.sets)
        log = out / "log.h5"
        if not log.exists():
            print(f"{problem}: no log at {log}", file=sys.stderr)
            continue
        results[problem] = summary(problem, log)
    print("\n| problem | error | source | method | precision | relative L2 | time | "
          "hardware |")
    print("|---|---|---|---|---|---:|---:|---|")
    for problem, s in results.items():
        what = " and ".join(METRICS[problem])
        for src, method, prec, err, took, hw in PUBLISHED[problem]:
            print(f"| {problem} | {what} | {src} | {method} | {prec} | {err} | {took} | "
                  f"{hw} |")
        sets = (" (" + ", ".join(args.sets) + ")") if args.sets else ""
        print(f"| {problem} | {what} | **deepsolve**, defaults{sets} | best of "
              f"{s['iterations']} iterations (last {s['last']:.2e}; stopped by "
              f"{s['stopped']}) | float64 | **{s['best']:.2e}** | {s['at']:.1f} min | "
              f"2-core CPU, {args.threads} threads |")
        met = "met" if s["best"] <= TARGETS[problem] else "not met"
        print(f"| {problem} | {what} | target (docs/pinn.md) | | | "
              f"{TARGETS[problem]:.0e} | 15 min | this CPU: {met} |")
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.threads} threads per run")


if __name__ == "__main__":
    main()
