"""Memory and time of the fixed-point backwards on a batched DEQ layer, and solver iterations.

    .venv/bin/python benchmarks/fixed_point.py            # about 1 minute on 2 CPU cores
    .venv/bin/python benchmarks/fixed_point.py --quick    # fewer repeats, a smoke run

The layer is ``z = tanh(W z + U x)`` with width 256, batch 64, float32, ``W`` symmetric with
spectral norm ``rho`` (0.95: Picard needs about 110 iterations to the relative residual
``tol = 1e-5``) and ``U x`` small, so that ``tanh`` is nearly linear and the contraction is
close to ``rho``. The loss is ``sum(w * z)``; gradients are taken with respect to ``W``, ``U``
and ``x``.

Table 1, subprocesses per method (so that its peak RSS is its own): wall time of forward +
backward (median of 3), forward and backward iterations, peak live saved-for-backward bytes
(``saved_tensors_hooks``, distinct storages, over forward and backward, the implicit backward's
recomputation included; W, U and x themselves count 0.3 MiB) plus the checkpoint snapshots the
unroll holds, peak RSS above the process's baseline after a warm-up run (VmHWM reset through
/proc/self/clear_refs; measured in a separate run with ``MALLOC_MMAP_THRESHOLD_=32768`` so that
freed tensors leave the RSS; it also counts the solvers' work buffers — Anderson and Broyden
histories — and temporaries), and the gradient's largest relative error (over W, U, x) against
a float64 implicit solve to ``tol = 1e-12``. Methods: plain autograd through the Picard iterations,
``fixed_point(backward="unrolled")`` recorded and checkpointed (revolve, 8 snapshots),
``"implicit"`` with each solver (the adjoint solved by the same solver), ``"phantom"``
(5 steps, λ = 0.5) and the Jacobian-free backward (1 step, λ = 1).

Table 2: forward iterations of Picard, Anderson (m = 5) and Broyden (m = 30) for several
``rho`` (same layer, no grad).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref

import torch

from deepsolve.memory.meter import process_status, reset_high_water_mark

WIDTH, BATCH, TOL = 256, 64, 1e-5






class SavedBytes:
    """Live bytes of the distinct storages saved for backward, and their peak (a tensor
    saved by many nodes, such as a weight used at every iteration, counts once)."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.refs: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        n = self.refs.get(key, 0)
        if n == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = n + 1
        box = _Box(t)
        weakref.finalize(box, self._release, key, storage.nbytes())
        return box

    def _release(self, key, nbytes):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    @staticmethod
    def unpack(box):
        return box.t


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def layer(rho: float, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(WIDTH, WIDTH, generator=g, dtype=torch.float64)
    A = A + A.T
    W = (rho * A / torch.linalg.matrix_norm(A, 2)).to(dtype).requires_grad_()
    U = (0.1 * torch.randn(WIDTH, 32, generator=g, dtype=torch.float64) / 32 ** 0.5).to(
        dtype).requires_grad_()
    x = torch.randn(BATCH, 32, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64).to(dtype)
    return W, U, x, w


METHODS = {
    # name: (label, fixed_point kwargs or None for plain autograd)
    "plain": ("plain autograd through the Picard iterations", None),
    "unrolled": ("unrolled Picard, recorded (store_all)",
                 {"solver": "picard", "backward": "unrolled"}),
    "unrolled_revolve": ("unrolled Picard, revolve, 8 snapshots",
                         {"solver": "picard", "backward": "unrolled", "snapshots": 8}),
    "unrolled_anderson": ("unrolled Anderson, recorded (store_all)",
                          {"solver": "anderson", "backward": "unrolled"}),
    "implicit_picard": ("implicit, Picard", {"solver": "picard", "backward": "implicit"}),
    "implicit_anderson": ("implicit, Anderson", {"solver": "anderson", "backward": "implicit"}),
    "implicit_broyden": ("implicit, Broyden", {"solver": "broyden", "backward": "implicit"}),
    "phantom": ("phantom (Anderson forward, 5 steps, λ=0.5)",
                {"solver": "anderson", "backward": "phantom"}),
    "jfb": ("Jacobian-free (Anderson forward, 1 step)",
            {"solver": "anderson", "backward": "phantom", "phantom_steps": 1,
             "phantom_damping": 1.0}),
}


def reference(rho: float) -> list[torch.Tensor]:
    from deepsolve.fixed_point import fixed_point

    W, U, x, w = layer(rho, torch.float64)
    z = fixed_point(lambda z: torch.tanh(z @ W.T + x @ U.T), torch.zeros(BATCH, WIDTH,
                    dtype=torch.float64), tol=1e-12, max_iter=500)
    return list(torch.autograd.grad((w * z).sum(), [W, U, x]))


def run_once(method: str, rho: float, picard_iters: int):
    from deepsolve.fixed_point import FixedPointStats, fixed_point

    W, U, x, w = layer(rho)
    params = [W, U, x]

    def f(z):
        return torch.tanh(z @ W.T + x @ U.T)

    z0 = torch.zeros(BATCH, WIDTH)
    st = FixedPointStats()
    hooks = SavedBytes()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        kw = METHODS[method][1]
        if kw is None:
            z = z0
            for _ in range(picard_iters):
                z = f(z)
        else:
            z = fixed_point(f, z0, tol=TOL, max_iter=1000, stats=st, **kw)
        t1 = time.perf_counter()
        grads = torch.autograd.grad((w * z).sum(), params)
    t2 = time.perf_counter()
    snap = st.unroll.snapshot_bytes_peak if st.unroll is not None else 0
    return {
        "fwd_iters": picard_iters if kw is None else st.iterations,
        "bwd_iters": (picard_iters if kw is None else st.backward_iterations),
        "forward_s": t1 - t0, "total_s": t2 - t0, "saved_bytes": hooks.peak + snap,
        "grads": grads,
    }


def child(mode: str, method: str, rho: float, picard_iters: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    if mode == "rss":  # run with MALLOC_MMAP_THRESHOLD_ low: freed tensors leave the RSS
        run_once(method, rho, picard_iters)  # warm-up (lazy initialisation)
        if not reset_high_water_mark():
            return {"rss_bytes": float("nan")}
        base = process_status("VmRSS")
        run_once(method, rho, picard_iters)
        return {"rss_bytes": process_status("VmHWM") - base}
    ref = reference(rho)
    run_once(method, rho, picard_iters)  # warm-up
    runs = [run_once(method, rho, picard_iters) for _ in range(repeats)]
    res = runs[0]
    err = max(float((g.double() - r).norm() / r.norm()) for g, r in zip(res["grads"], ref,
                                                                       strict=True))
    out = {k: v for k, v in res.items() if k != "grads"}
    out.update(total_s=statistics.median(r["total_s"] for r in runs), grad_err=err)
    return out


def picard_iterations(rho: float) -> int:
    from deepsolve.fixed_point import FixedPointStats, fixed_point

    W, U, x, _ = layer(rho)
    st = FixedPointStats()
    with torch.no_grad():
        fixed_point(lambda z: torch.tanh(z @ W.T + x @ U.T), torch.zeros(BATCH, WIDTH),
                    solver="picard", tol=TOL, max_iter=5000, stats=st)
    return st.iterations


def iteration_table(rhos) -> list[str]:
    from deepsolve.fixed_point import FixedPointStats, fixed_point

    rows = ["| rho | Picard | Anderson (m=5) | Broyden (m=30) |", "|---:|---:|---:|---:|"]
    for rho in rhos:
        W, U, x, _ = layer(rho)
        its = []
        for solver in ("picard", "anderson", "broyden"):
            st = FixedPointStats()
            with torch.no_grad():
                fixed_point(lambda z, W=W, U=U, x=x: torch.tanh(z @ W.T + x @ U.T),
                            torch.zeros(BATCH, WIDTH), solver=solver, tol=TOL,
                            max_iter=5000, stats=st)
            its.append(f"{st.iterations}" + ("" if st.converged else " (not converged)"))
        rows.append(f"| {rho} | " + " | ".join(its) + " |")
    return rows


def _mib(b: float) -> str:
    return "n/a" if b != b else f"{b / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 timing repeat, fewer rhos")
    ap.add_argument("--rho", type=float, default=0.95)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, method, rho, iters, repeats = args.child
        print(json.dumps(child(mode, method, float(rho), int(iters), int(repeats))))
        return
    torch.set_num_threads(1)
    repeats = 1 if args.quick else 3
    k = picard_iterations(args.rho)
    print(f"DEQ layer z = tanh(W z + U x): width {WIDTH}, batch {BATCH}, float32, rho = "
          f"{args.rho}, tol = {TOL:g}; Picard needs {k} iterations\n")
    print("| method | fwd iters | bwd iters | time fwd+bwd [ms] | saved + snapshots [MiB] | "
          "peak RSS [MiB] | grad rel. error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env_rss = dict(env, MALLOC_MMAP_THRESHOLD_="32768", MALLOC_TRIM_THRESHOLD_="0")
    for method, (label, _) in METHODS.items():
        r = {}
        for mode, e in (("time", env), ("rss", env_rss)):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                                  method, str(args.rho), str(k), str(repeats)],
                                 capture_output=True, text=True, env=e, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{method} ({mode}) failed:\n{out.stderr}")
            r.update(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"| {label} | {r['fwd_iters']} | {r['bwd_iters']} | {1e3 * r['total_s']:.1f} | "
              f"{_mib(r['saved_bytes'])} | {_mib(r['rss_bytes'])} | {r['grad_err']:.1e} |",
              flush=True)
    print()
    rhos = (0.9, 0.95) if args.quick else (0.5, 0.8, 0.9, 0.95, 0.99)
    print(f"Forward iterations to tol = {TOL:g} (same layer, no grad):\n")
    print("\n".join(iteration_table(rhos)))


if __name__ == "__main__":
    main()
