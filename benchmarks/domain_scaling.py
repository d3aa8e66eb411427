"""Weak and strong scaling of a domain-decomposed, checkpointed shallow-water unroll.

    .venv/bin/python benchmarks/domain_scaling.py                  # CPU, gloo, 1/2/4 processes
    .venv/bin/python benchmarks/domain_scaling.py --device cuda    # one process per GPU, NCCL

Each configuration runs under ``torchrun --nproc-per-node K``: the ranks split the ``ny`` rows
of a 2-D rotating shallow-water field (problems/shallow_water.py's solver, float64; halos of
4 rows once per RK4 step, ``--exchange stage`` for 1 row per stage) and run forward +
backward of ``--steps`` steps under the *same* schedule (revolve with ``--snapshots``
slots) ``--repeats`` times after a warm-up. Per rank: the median time of forward +
backward, the tracked peak (snapshots + saved tensors, ``MemoryMeter``) and the real peak
(RSS high-water mark above the rank's warmed baseline on CPU, after ``malloc_trim`` hands
the freed pages of the warm-up back; ``max_memory_allocated`` above the baseline on CUDA).
The table gives the largest over the ranks.

* strong scaling: the same ``--ny`` rows on 1, 2, 4 ranks (ideal: time and memory / K);
* weak scaling: ``--rows`` rows per rank (ideal: constant time and memory).

On a CPU with fewer cores than ranks the processes share cores (``OMP_NUM_THREADS=1``
each), so the times measure oversubscription, not the method; memory per rank is what the
decomposition is for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(args) -> None:
    import ctypes
    import ctypes.util
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    import deepsolve
    from deepsolve.distributed import Slab
    from deepsolve.memory.meter import MemoryMeter
    from deepsolve.physics.shallow_water import ShallowWater2D, gaussian_bump

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    ny = args.ny if args.mode == "strong" else args.rows * world
    nx, L = args.nx, 1.0e6
    dt = 0.5 * (L / max(nx, ny)) / (9.81 * 140.0) ** 0.5
    grid = ShallowWater2D(nx=nx, ny=ny, Lx=L, Ly=L, f=1e-4, drag=1e-6, dt=dt,
                          exchange=args.exchange)
    slab = Slab(ny, dim=-2, halo=grid.halo())
    X, Y = grid.points("eta", slab.start, slab.rows, dtype=torch.float64, device=device)
    coef = torch.tensor([0.1, -0.05], dtype=torch.float64, device=device, requires_grad=True)

    def step(x, i):
        depth = 100.0 * (1 + coef[0] * torch.cos(2e-6 * torch.pi * X)
                         + coef[1] * torch.sin(2e-6 * torch.pi * Y))
        return grid.step(x, depth, slab.halo)

    eta = gaussian_bump(grid, 1.0, 0.08 * L, j0=slab.start, rows=slab.rows,
                        dtype=torch.float64, device=device)
    x0 = torch.stack([eta, torch.zeros_like(eta), torch.zeros_like(eta)])[None].expand(
        args.members, 3, slab.rows, nx).contiguous()

    libc = None if cuda else ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")

    def run():
        coef.grad = None
        if libc is not None:   # the baseline is the live set, not pages the last run freed
            gc.collect()
            libc.malloc_trim(0)
        stats = deepsolve.UnrollStats()
        dist.barrier()
        t0 = time.perf_counter()
        with MemoryMeter(device, stats=stats) as m:
            xT = deepsolve.unroll(step, x0, args.steps, snapshots=args.snapshots, stats=stats)
            slab.mean(xT[:, 0] ** 2).backward()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, m

    run()   # warm-up: the allocator's pools, the process's baseline
    times, tracked, real = [], [], []
    for _ in range(args.repeats):
        t, m = run()
        times.append(t)
        tracked.append(m.tracked_peak)
        real.append(m.cuda_peak if cuda else m.host_peak)
    res = {"rank": rank, "rows": slab.rows, "time": statistics.median(times),
           "tracked": max(tracked), "real": statistics.median(real)}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(args, mode: str, k: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(k), __file__, "--child", "--mode", mode,
               "--out", out, "--device", args.device, "--nx", str(args.nx), "--ny",
               str(args.ny), "--rows", str(args.rows), "--steps", str(args.steps),
               "--snapshots", str(args.snapshots), "--repeats", str(args.repeats),
               "--members", str(args.members), "--exchange", args.exchange]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{mode} K={k} failed:\n{r.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f"rank{i}.json"))) for i in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="strong", choices=["strong", "weak"])
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--nx", type=int, default=128)
    ap.add_argument("--ny", type=int, default=128, help="rows (strong scaling)")
    ap.add_argument("--rows", type=int, default=32, help="rows per rank (weak scaling)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--snapshots", type=int, default=20)
    ap.add_argument("--members", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exchange", default="step", choices=["step", "stage"],
                    help="halos: 4 rows once per RK4 step, or 1 row per stage")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    procs = [int(p) for p in args.procs.split(",")]
    print(f"shallow water {args.nx} columns, float64, {args.steps} steps, revolve "
          f"s={args.snapshots}, {args.members} member(s), halo exchange per {args.exchange}, "
          f"device {args.device}; per rank: "
          "median of forward+backward, tracked and real peak (largest over the ranks)\n")
    print("ideal: strong scaling divides time and memory per rank by K, weak scaling keeps "
          "them; the `/ ideal` columns are 1.00 when it does\n")
    print("| scaling | K | rows/rank | time [s] | t(K=1) / t | tracked peak [MiB] | "
          "tracked / ideal | real peak [MiB] | real / ideal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("strong", "weak"):
        base = None
        for k in procs:
            res = launch(args, mode, k)
            t = max(r["time"] for r in res)
            tr = max(r["tracked"] for r in res) / 2**20
            re = max(r["real"] for r in res) / 2**20
            if base is None:
                base = (t, tr, re)
            per = k if mode == "strong" else 1   # the ideal per-rank share is 1 / per
            print(f"| {mode} | {k} | {max(r['rows'] for r in res)} | {t:.2f} | "
                  f"{base[0] / t:.2f} | {tr:.1f} | {tr * per / base[1]:.2f} | {re:.1f} | "
                  f"{re * per / base[2]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
