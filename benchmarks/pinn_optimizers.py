"""The PINN problems under each optimiser, for a fixed wall-clock time: the tables of
docs/pinn.md ("Second-order optimisers").

Each case is a ``python -m deepsolve train problems/X.py --set ...`` run, stopped by SIGTERM
when ``--minutes`` of wall time have passed (the trainer finishes its iteration, writes its
restart file and exits); the errors are read from its HDF5 log. One run at a time, in
order, so no two compete for the cores::

    .venv/bin/python benchmarks/pinn_optimizers.py --problem burgers --minutes 15
    .venv/bin/python benchmarks/pinn_optimizers.py --problem kovasznay --minutes 15
    .venv/bin/python benchmarks/pinn_optimizers.py --problem allen_cahn --minutes 60

``--case NAME`` runs one case; ``--report-only`` re-reads the logs of earlier runs in
``--out``. For each run the table gives the training time (the sum of the log's per-iteration
``time`` column, evaluations excluded) at which each error threshold was first met, the best
and the last evaluated errors, and the trainer iterations done.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

# case name -> --set arguments; "defaults" is the problem file as shipped
CASES: dict[str, dict[str, list[str]]] = {
    "burgers": {
        "defaults": [],
        "gauss_newton": ["optimizer=gauss_newton"],
        "gauss_newton, sketched (20% of points)": ["optimizer=gauss_newton", "gn_sketch=0.2"],
        "gauss_newton, doubly sketched (20% of points, 50% of parameters)": [
            "optimizer=gauss_newton", "gn_sketch=0.2", "gn_sketch_params=0.5"],
        "bfgs": ["optimizer=bfgs"],
        "fixed points (no RAD)": ["rad_every=0"],
        "RBA (linear), fixed points": ["rad_every=0", "attention=linear",
                                       "attention_gamma=0.99", "attention_eta=0.01"],
        "vRBA (exponential), fixed points": ["rad_every=0", "attention=exponential",
                                             "attention_gamma=0.99", "attention_eta=0.01",
                                             "attention_temperature=0.25"],
        "old defaults (Adam → L-BFGS)": [
            "optimizer=adam+lbfgs", "dtype=float32", "switch_at=1000", "width=20", "depth=8",
            "n_collocation=10000", "rad_every=0", "iterations=1150"],
    },
    "kovasznay": {
        "defaults": [],
        "gauss_newton": ["optimizer=gauss_newton"],
        "bfgs": ["optimizer=bfgs"],
        "old defaults (Adam → L-BFGS)": [
            "optimizer=adam+lbfgs", "dtype=float32", "switch_at=2100", "width=50", "depth=4",
            "compile=true", "iterations=2300"],
    },
    "allen_cahn": {
        "defaults": [],
        "gauss_newton": ["optimizer=gauss_newton"],
        "old defaults (Adam → L-BFGS)": [
            "optimizer=adam+lbfgs", "dtype=float32", "switch_at=1050", "width=64", "depth=4",
            "harmonics=3", "constraints=hard", "lbfgs_resample_every=50", "iterations=1250"],
    },
}
FILES = {"burgers": "burgers_pinn.py", "kovasznay": "navier_stokes_pinn.py",
         "allen_cahn": "allen_cahn_pinn.py"}
METRICS = {"burgers": ["u_rel_l2"], "kovasznay": ["u_rel_l2", "v_rel_l2", "p_rel_l2"],
           "allen_cahn": ["u_rel_l2"]}
THRESHOLDS = {"burgers": [1e-3, 1e-4, 1e-5, 1e-6], "kovasznay": [1e-4, 1e-5, 1e-6],
              "allen_cahn": [1e-3, 1e-4, 5.37e-5, 2.24e-5]}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")[:40]


def run(problem: str, name: str, sets: list[str], out: pathlib.Path, minutes: float,
        threads: int) -> float:
    """Train one case until it ends or ``minutes`` of wall time pass; the wall seconds."""
    cmd = [sys.executable, "-m", "deepsolve", "train", str(ROOT / "problems" / FILES[problem]),
           "--threads", str(threads), "--out", str(out), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        proc.wait(timeout=minutes * 60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)   # finish the iteration, save, exit
        proc.wait()
    return time.perf_counter() - t0


def summary(problem: str, log_path: pathlib.Path) -> dict:
    from deepsolve.io.h5log import read_log

    c = read_log(log_path).columns
    t = np.cumsum(c["time"]) / 60
    out: dict = {"iterations": len(t), "minutes": float(t[-1]) if len(t) else 0.0}
    names = METRICS[problem]
    worst = np.max(np.stack([c[f"metric/{k}"] for k in names]), axis=0)  # all of them
    ok = np.isfinite(worst)
    for thr in THRESHOLDS[problem]:
        hit = np.flatnonzero(ok & (worst <= thr))
        out[f"<= {thr:g}"] = f"{t[hit[0]]:.1f} min" if hit.size else "—"
    for k in names:
        col = c[f"metric/{k}"]
        fin = np.flatnonzero(np.isfinite(col))
        out[f"last {k}"] = float(col[fin[-1]]) if fin.size else float("nan")
        out[f"best {k}"] = float(np.nanmin(col)) if fin.size else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problem", choices=sorted(CASES), required=True)
    ap.add_argument("--case", action="append", help="run only these cases (names as listed)")
    ap.add_argument("--minutes", type=float, default=15.0, help="wall-clock limit per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "runs" / "pinn_optimizers"))
    ap.add_argument("--report-only", action="store_true", help="read earlier runs' logs")
    args = ap.parse_args()
    cases = CASES[args.problem]
    chosen = args.case or list(cases)
    unknown = [c for c in chosen if c not in cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known for {args.problem}: {list(cases)}")
    rows = []
    for name in chosen:
        out = pathlib.Path(args.out) / args.problem / slug(name)
        wall = None
        if not args.report_only:
            if out.exists():
                import shutil
                shutil.rmtree(out)
            wall = run(args.problem, name, cases[name], out, args.minutes, args.threads)
        log = out / "log.h5"
        if not log.exists():
            print(f"{name}: no log at {log}", file=sys.stderr)
            continue
        s = summary(args.problem, log)
        if wall is not None:
            s["wall"] = f"{wall / 60:.1f} min"
        rows.append((name, s))
    if not rows:
        return
    keys = list(rows[0][1])
    print("\n| case | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, s in rows:
        cells = [f"{v:.2e}" if isinstance(v, float) and k not in ("minutes",) else
                 (f"{v:.1f}" if isinstance(v, float) else str(v)) for k, v in s.items()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.threads} threads per run")


if __name__ == "__main__":
    main()
