"""The horizon study: how long must the Navier–Stokes closure be unrolled in training, and
what does a longer horizon buy?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/horizons.py --png docs/img/horizons.png

trains the closure of problems/navier_stokes.py (its defaults otherwise: the 32² coarse
solver with the advection-error input, 8 training trajectories of 1000 steps, the 256 MiB
budget) with training horizons of 1 step (one-step, "a-priori" training), 10, 100 and 1000
steps and with the problem's default run (its horizon curriculum 100 → 300 → 1000), each
for the same compute, and evaluates each on the 8 held-out initial conditions by rollouts
to 4x the longest horizon (4000 steps, 8 time units).

* **Windows.** Every run uses ``starts=any``: a window of ``h`` steps starts at a random
  observation time of a training trajectory and ends within its 1000 steps, so a short
  horizon sees the whole trajectory, not only its first ``h`` steps; the reference is
  observed every ``min(h, 100)`` steps (every step for the one-step run).
* **Compute** is counted in trajectory-step evaluations: the unroll's step evaluations,
  recomputation included (the log's ``advances + recorded``), times the windows in the
  batch. A probe iteration of each horizon (its plan under the budget, in this process)
  gives its evaluations per iteration; every run gets the evaluations of the problem's
  default run (or ``--evals``). The batch is ``clamp(2000 / h, 2, 256)`` windows, so a
  short horizon takes more windows per optimiser step and more steps; the learning rate
  follows the problem's cosine schedule over each run's iterations. The measured total
  and the wall time are in the table.
* **Evaluation** (the problem's ``evaluate`` at the last iteration, read from each run's
  log): the mean relative L2 error against the filtered reference at ``T`` (1000 steps),
  ``2T`` and ``4T``; the time at which the mean error reaches 0.5; blow-ups (a state that is
  not finite or whose norm exceeds 3x the reference's, counted and then charged an error of
  2); the real and the tracked peak memory of the run's iterations.

Each run is the CLI in a fresh process (``python -m deepsolve train``), one at a time, its
log kept under ``--out``. Prints a markdown table; ``--png`` draws the mean error against
rollout time, one curve per training horizon, the uncorrected coarse solver dashed and its
3/2-padded variant dotted (the references without learning).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PROBLEM = os.path.join(ROOT, "problems", "navier_stokes.py")
MiB = 2.0**20


def windows_batch(h: int) -> int:
    """Windows per iteration for a horizon of ``h`` steps: ``clamp(2000 / h, 2, 256)``."""
    return int(min(256, max(2, 2000 // h)))


def obs_every(h: int) -> int:
    return min(h, 100)


def base_sets(h_min: int, data_dir: str) -> list[str]:
    return ["starts=any", f"obs_every={obs_every(h_min)}", f"data_dir={data_dir}"]


def probe(h: int, batch: int, data_dir: str, threads: int) -> int:
    """Step evaluations (advances + recorded, recomputation included) of one training
    iteration with horizon ``h``, measured on the problem as the trainer builds it."""
    import torch

    from deepsolve.training.prepare import build, prepare

    cfg = prepare(PROBLEM, {"threads": threads},
                  [*base_sets(h, data_dir), f"curriculum=0:{h}", f"batch={batch}"])
    torch.set_num_threads(threads)
    problem, ctx, _ = build(PROBLEM, cfg)
    ctx.horizon = h
    terms = problem.residuals(ctx, 0)
    w = problem.weights(ctx)
    sum(w.get(k, 1.0) * v for k, v in terms.items()).backward()
    n = sum(s.advances + s.recorded for s in ctx.unroll_stats)
    ctx.release()
    return int(n)


def plan_runs(horizons: list[int], curriculum: bool, evals: float | None, data_dir: str,
              threads: int) -> list[dict]:
    """One entry per run: label, horizon(s), batch, iterations, ``--set`` options. The
    curriculum run is the problem's default run (its curriculum, batch and iterations); its
    step evaluations are the budget of every other run unless ``evals`` is given."""
    per_iter: dict[tuple[int, int], int] = {}

    def cost(h: int, batch: int) -> int:
        if (h, batch) not in per_iter:
            per_iter[h, batch] = probe(h, batch, data_dir, threads)
        return per_iter[h, batch] * batch

    from deepsolve.problem import load_problem
    from deepsolve.settings import parse_curriculum

    d = load_problem(PROBLEM)[0].config()
    its, b = int(d["iterations"]), int(d["batch"])
    stages = [(int(a), int(n)) for a, n in parse_curriculum(d["curriculum"], its, d["steps"])]
    bounds = [a for a, _ in stages] + [its]
    default_cost = sum((bounds[j + 1] - bounds[j]) * cost(n, b)
                       for j, (_, n) in enumerate(stages))
    budget = float(evals) if evals else float(default_cost)
    runs = []
    for h in horizons:
        bh = windows_batch(h)
        n_its = max(1, round(budget / cost(h, bh)))
        runs.append({"label": f"{h} step" + ("s" if h > 1 else ""), "horizon": str(h),
                     "batch": bh, "iterations": n_its,
                     "sets": [*base_sets(h, data_dir), f"curriculum=0:{h}", f"batch={bh}",
                              f"memory_every={max(1, n_its // 10)}"]})
    if curriculum:
        n_its = max(1, round(its * budget / default_cost))
        runs.append({"label": "curriculum",
                     "horizon": "→".join(str(n) for _, n in stages),
                     "batch": b, "iterations": n_its,
                     "sets": [*base_sets(min(n for _, n in stages), data_dir),
                              f"curriculum={d['curriculum']}", f"batch={b}",
                              f"memory_every={max(1, n_its // 10)}"]})
    return runs


def train(run: dict, out: str, threads: int) -> float:
    """Run the CLI for ``run``; returns its wall time."""
    args = [sys.executable, "-m", "deepsolve", "train", PROBLEM, "--out", out, "--quiet",
            "--iterations", str(run["iterations"]), "--threads", str(threads)]
    for s in [*run["sets"], "eval_every=0"]:
        args += ["--set", s]
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"horizons: {run['label']} failed:\n{r.stderr[-3000:]}")
    return wall


def results(out: str, batch: int) -> dict:
    from deepsolve.io import read_curves, read_log

    log = read_log(out)
    c = log.columns
    last = {k[len("metric/"):]: float(c[k][-1]) for k in c if k.startswith("metric/")}
    curves = {name: read_curves(out, f"eval_err_{name}")
              for name in ("closure", "coarse", "padded")}

    def curve(name: str) -> tuple[np.ndarray, np.ndarray]:
        cc = curves[name]
        s, v = cc["step"][-1], cc["value"][-1]
        ok = s >= 0
        return s[ok], v[ok]

    return {"metrics": last, **{name: curve(name) for name in curves},
            "evals": float(np.sum(c["advances"] + c["recorded"])) * batch,
            "train_time": float(np.sum(c["time"])),
            "real": float(np.nanmax(c["peak_real_memory"])),
            "tracked": float(np.nanmax(c["peak_tracked_memory"])),
            "schedule": str(c["schedule"][-1]), "dt": float(log.attrs["config"]["dt"])}


def _t(v: float, end: float) -> str:
    return f"> {end:g}" if not math.isfinite(v) else f"{v:.2f}"


def _name(run: dict) -> str:
    unit = "step" if run["horizon"] == "1" else "steps"
    tail = " (the default curriculum)" if run["label"] == "curriculum" else ""
    return f"{run['horizon']} {unit}{tail}"


def table(rows: list[tuple[dict, dict, float]]) -> str:
    first = rows[0][1]
    end = first["closure"][0][-1] * first["dt"]
    lines = [
        "| training horizon | batch | iterations | step evaluations | wall [s] | schedule | "
        "real peak [MiB] | tracked peak [MiB] | error at T | at 2T | at 4T | t(error = 0.5) | "
        "blow-ups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r, wall in rows:
        m = r["metrics"]
        lines.append(
            f"| {_name(run)} | {run['batch']} | {run['iterations']} | "
            f"{r['evals'] / 1e3:.0f}k | {wall:.0f} | {r['schedule']} | {r['real'] / MiB:.0f} | "
            f"{r['tracked'] / MiB:.0f} | {m['rel_err_closure']:.3f} | "
            f"{m['rel_err_closure_2T']:.3f} | {m['rel_err_closure_4T']:.3f} | "
            f"{_t(m['t_half_closure'], end)} | {int(m['blowups'])} |")
    m = first["metrics"]
    for name, label in (("coarse", "uncorrected coarse (no learning)"),
                        ("padded", "coarse, 3/2-padded advection (no learning)")):
        lines.append(f"| {label} | | | | | | | | {m[f'rel_err_{name}']:.3f} | "
                     f"{m[f'rel_err_{name}_2T']:.3f} | {m[f'rel_err_{name}_4T']:.3f} | "
                     f"{_t(m[f't_half_{name}'], end)} | 0 |")
    return "\n".join(lines)


def figure(rows: list[tuple[dict, dict, float]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run, r, _ in rows:
        s, v = r["closure"]
        ax.plot(s * r["dt"], v, label=f"trained on {_name(run)}")
    s, v = rows[0][1]["coarse"]
    ax.plot(s * rows[0][1]["dt"], v, "k--", label="uncorrected coarse solver")
    s, v = rows[0][1]["padded"]
    ax.plot(s * rows[0][1]["dt"], v, "k:", label="coarse, 3/2-padded advection")
    t_train = 1000 * rows[0][1]["dt"]
    ax.axvline(t_train, color="0.6", lw=0.8)
    ax.axhline(0.5, color="0.8", lw=0.8)
    ax.set_xlabel(f"rollout time (the longest training horizon is T = {t_train:g})")
    ax.set_ylabel("mean relative L2 error, 8 held-out ICs")
    ax.set_ylim(0, 1.6)
    ax.set_title("Navier–Stokes closure: error against rollout time by training horizon")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--horizons", default="1,10,100,1000")
    ap.add_argument("--no-curriculum", action="store_true",
                    help="leave out the run with the problem's default curriculum")
    ap.add_argument("--evals", type=float, default=None,
                    help="trajectory-step evaluations per run, recomputation included "
                         "(default: those of the problem's default run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/horizons", help="where the runs' logs go")
    ap.add_argument("--data-dir", default="runs/data")
    ap.add_argument("--png", help="write the error-against-time figure here")
    args = ap.parse_args()
    horizons = [int(h) for h in args.horizons.split(",") if h.strip()]
    runs = plan_runs(horizons, not args.no_curriculum, args.evals, args.data_dir, args.threads)
    rows = []
    for run in runs:
        out = os.path.join(args.out, run["label"].replace(" ", "_"))
        print(f"# {run['label']}: batch {run['batch']}, {run['iterations']} iterations, "
              f"{' '.join(run['sets'])}", flush=True)
        wall = train(run, out, args.threads)
        rows.append((run, results(out, run["batch"]), wall))
    print(table(rows))
    if args.png:
        figure(rows, args.png)
        print(f"figure: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
