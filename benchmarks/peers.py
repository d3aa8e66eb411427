"""deepsolve beside its peers on unrolled solvers: diffrax (JAX), plain autograd and
torch.utils.checkpoint, eager and with compiled segments.

    .venv/bin/pip install -e '.[bench]' && .venv/bin/python benchmarks/peers.py
    .venv/bin/python benchmarks/peers.py --jax-python /path/to/python-with-jax-and-diffrax
    .venv/bin/python benchmarks/peers.py --workloads ode pde4k --repeats 3
    .venv/bin/python benchmarks/peers.py --quick            # tiny sizes: does it all run?

JAX and diffrax are benchmark-only (``pip install -e '.[bench]'``, or a separate environment
given by ``--jax-python``); deepsolve never imports them.

Workloads (float64, one thread, the same explicit method and the same loss ``sum(x_n^2)`` on
both sides, gradients with respect to a coefficient and the initial state):

* ``ode`` — Lorenz-96, 40 variables, Heun, ``dt = 1e-3``, 4000 steps; learnable forcing F.
* ``pde4k`` — Fisher–KPP ``u_t = D u_xx + r u (1 - u)`` by periodic finite differences on
  4096 points, Heun, 2000 steps (``D dt / dx^2 = 0.2``); learnable rate r.
* ``pde64k`` — the same on 65,536 points, 1000 steps.
* ``ns`` — the 2-D Navier–Stokes step of benchmarks/ns_step.py (64^2 pseudo-spectral RK4,
  the CNN closure), 200 steps; the JAX side is a port of it (checked against it to 1e-12
  at one step before timing), with the closure's weights copied; learnable: the closure's
  last bias.

Methods, each in its own process: ``eager`` (``unroll(..., snapshots=20)``), ``compile``
(the same with ``compile=True``), ``auto20`` (``compile="auto", compile_runs=20``: the
trainer's default for a 20-iteration run), ``plain`` (a Python loop, autograd keeps every
step), ``checkpoint`` (``torch.utils.checkpoint`` over 20 segments) and ``diffrax``
(``diffeqsolve(..., adjoint=RecursiveCheckpointAdjoint(checkpoints=20))`` under ``jax.jit``).

Reported per cell: the first call in a fresh process (compilation included: inductor's with
an empty cache directory, and again with the cache the first process filled; XLA's), the
median of ``--repeats`` calls after it, the run of 20 iterations (first + 19 medians; for
``auto20`` its 20 unrolls timed, since it runs the first eagerly and decides at the second),
the process's peak RSS above its size before the first call, and the gradient's relative
difference from diffrax's (from plain autograd's where diffrax did not run).
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

import numpy as np

SNAPSHOTS = 20
WORKLOADS = {
    "ode": dict(kind="l96", size=40, steps=4000, dt=1e-3),
    "pde4k": dict(kind="kpp", size=4096, steps=2000, dt=1e-3),
    "pde64k": dict(kind="kpp", size=65536, steps=1000, dt=1e-3),
    "ns": dict(kind="ns", size=64, steps=200, dt=None),
}
QUICK = {"ode": dict(size=40, steps=200), "pde4k": dict(size=512, steps=100),
         "pde64k": dict(size=2048, steps=60), "ns": dict(size=32, steps=20)}
METHODS = ("plain", "checkpoint", "eager", "compile", "auto20", "diffrax")


def inputs(w: dict) -> dict[str, np.ndarray]:
    """The same initial state and coefficient for both sides (float64 numpy)."""
    rng = np.random.default_rng(0)
    n = w["size"]
    if w["kind"] == "l96":
        return {"x0": 8.0 + 0.5 * rng.standard_normal(n), "theta": np.array(8.0)}
    if w["kind"] == "kpp":
        x = np.linspace(0, 1, n, endpoint=False)
        u0 = 0.5 + 0.3 * np.sin(2 * np.pi * x) + 0.05 * rng.standard_normal(n)
        return {"x0": u0, "theta": np.array(1.0)}
    return {}


def rss() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB


# -- torch side -------------------------------------------------------------------------------

def torch_problem(w: dict):
    """``(step, x0, theta, params)``: the torch step, the initial state and the coefficient
    (leaves requiring grad)."""
    import torch
    if w["kind"] == "ns":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ns_step

        step, x0, closure = ns_step.make(n=w["size"], dtype=torch.float64)
        theta = closure.net[-1].bias
        return step, x0.requires_grad_(), theta, ns_step
    arr = inputs(w)
    x0 = torch.tensor(arr["x0"]).requires_grad_()
    theta = torch.tensor(arr["theta"]).requires_grad_()
    dt = w["dt"]
    if w["kind"] == "l96":
        def f(y):
            return (torch.roll(y, -1) - torch.roll(y, 2)) * torch.roll(y, 1) - y + theta
    else:
        n = w["size"]
        coef = 0.2 / dt  # D / dx^2 with D dt / dx^2 = 0.2

        def f(y):
            return coef * (torch.roll(y, 1) - 2 * y + torch.roll(y, -1)) + theta * y * (1 - y)
        assert n > 2

    def step(y, i):
        k1 = f(y)
        return y + (0.5 * dt) * (k1 + f(y + dt * k1))

    return step, x0, theta, None


def torch_child(w: dict, method: str, repeats: int) -> dict:
    import torch
    torch.set_num_threads(1)
    from torch.utils.checkpoint import checkpoint

    import deepsolve

    step, x0, theta, _ = torch_problem(w)
    n = w["steps"]
    wrt = (theta, x0)
    stats = deepsolve.UnrollStats()

    def run():
        if method == "plain":
            x = x0
            for i in range(n):
                x = step(x, i)
        elif method == "checkpoint":
            seg = -(-n // SNAPSHOTS)

            def piece(x, a, b):
                for i in range(a, b):
                    x = step(x, i)
                return x
            x = x0
            for a in range(0, n, seg):
                x = checkpoint(piece, x, a, min(a + seg, n), use_reentrant=False)
        else:
            kw = {"eager": {}, "compile": {"compile": True},
                  "auto20": {"compile": "auto", "compile_runs": 20}}[method]
            x = deepsolve.unroll(step, x0, n, snapshots=SNAPSHOTS, stats=stats, **kw)
        g = torch.autograd.grad((x ** 2).sum(), wrt)
        return g

    base = rss()
    times = []
    # auto20 is a training run: 20 unrolls (the first eager and timed, the decision at the
    # second), all timed; the others: the first call and `repeats` more
    for _ in range(20 if method == "auto20" else 1 + repeats):
        t0 = time.perf_counter()
        g = run()
        times.append(time.perf_counter() - t0)
    warm = statistics.median(times[-repeats:])
    run20 = sum(times) if method == "auto20" else times[0] + 19 * warm
    return dict(first=times[0], warm=warm, run20=run20, rss=rss() - base,
                grad=[t.detach().reshape(-1).numpy().tolist() for t in g],
                segment=stats.segment, compile_time=stats.compile_time)


# -- JAX side ---------------------------------------------------------------------------------

def jax_child(w: dict, repeats: int) -> dict:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                          "intra_op_parallelism_threads=1")
    import diffrax
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    n, dt = w["steps"], w["dt"]
    if w["kind"] == "ns":
        x0, theta, f, dt = jax_ns(w)
    else:
        arr = inputs(w)
        x0, theta = jnp.asarray(arr["x0"]), jnp.asarray(arr["theta"])
        if w["kind"] == "l96":
            def f(t, y, th):
                return (jnp.roll(y, -1) - jnp.roll(y, 2)) * jnp.roll(y, 1) - y + th
        else:
            coef = 0.2 / dt

            def f(t, y, th):
                return coef * (jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1)) + th * y * (1 - y)

    def loss(th, y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(f), diffrax.Heun() if w["kind"] != "ns" else diffrax.Euler(),
            0.0, n * dt, dt, y0, args=th, saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.ConstantStepSize(),
            adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=SNAPSHOTS), max_steps=n)
        return jnp.sum(sol.ys[-1] ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    base = rss()
    t0 = time.perf_counter()
    g = jax.block_until_ready(grad(theta, x0))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(grad(theta, x0))
        times.append(time.perf_counter() - t0)
    warm = statistics.median(times)
    return dict(first=first, warm=warm, run20=first + 19 * warm, rss=rss() - base,
                grad=[np.asarray(t).reshape(-1).tolist() for t in g])


def jax_ns(w: dict):
    """The NS step of benchmarks/ns_step.py in JAX: one RK4 step of the pseudo-spectral
    solver plus ``dt`` times the CNN closure, as ``diffrax.Euler`` on ``f = (step(x) - x) /
    dt`` (Euler of that vector field is the step itself, up to rounding). Constants and
    weights come from the torch side (written by the parent to ``w["ns_file"]``)."""
    import jax
    import jax.numpy as jnp
    z = np.load(w["ns_file"])
    n = w["size"]
    dt = float(z["dt"])
    k2, inv_k2, mask = (jnp.asarray(z[k]) for k in ("k2", "inv_k2", "mask"))
    igrad = jnp.asarray(z["igrad"])
    lin = jnp.asarray(z["linear"])
    f_hat = jnp.asarray(z["forcing_hat"])
    ws = [(jnp.asarray(z[f"w{i}"]), jnp.asarray(z[f"b{i}"])) for i in range(3)]

    def spec(u):
        return jnp.fft.rfft2(u, norm="forward")

    def phys(u):
        return jnp.fft.irfft2(u, s=(n, n), norm="forward")

    def rhs(wh):
        psi = wh * inv_k2
        pair = jnp.stack((psi, wh), axis=-3)[..., :, None, :, :]
        g = phys(igrad * pair)
        jac = g[..., 0, 0, :, :] * g[..., 1, 1, :, :] - g[..., 0, 1, :, :] * g[..., 1, 0, :, :]
        return lin * wh + mask * spec(jac) + f_hat

    def conv(x, wgt, b):
        xp = jnp.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="wrap")
        y = jax.lax.conv_general_dilated(xp, wgt, (1, 1), "VALID",
                                         precision=jax.lax.Precision.HIGHEST)
        return y + b[None, :, None, None]

    def closure(x, last_bias):
        h = x[:, None]
        h = jax.nn.gelu(conv(h, *ws[0]), approximate=False)
        h = jax.nn.gelu(conv(h, *ws[1]), approximate=False)
        return conv(h, ws[2][0], last_bias)[:, 0]

    def step(x, th):
        wh = spec(x)
        k1 = rhs(wh)
        k2_ = rhs(wh + 0.5 * dt * k1)
        k3 = rhs(wh + 0.5 * dt * k2_)
        k4 = rhs(wh + dt * k3)
        return phys(wh + dt / 6.0 * (k1 + 2.0 * (k2_ + k3) + k4)) + dt * closure(x, th)

    def field(t, x, th):
        return (step(x, th) - x) / dt

    x0 = jnp.asarray(z["x0"])
    got = np.asarray(step(x0, jnp.asarray(z["b2"])))
    err = np.abs(got - z["x1"]).max() / np.abs(z["x1"]).max()
    if not err < 1e-10:
        raise SystemExit(f"the JAX port of the NS step differs from torch's by {err:.2e}")
    return x0, jnp.asarray(z["b2"]), field, dt


def export_ns(w: dict, path: str) -> None:
    """Write the torch NS step's constants, weights, x0 and one step of it for the port."""
    import torch
    step, x0, theta, ns_step = torch_problem(w)
    cl = step.__closure__
    ns = next(c.cell_contents for c in cl if type(c.cell_contents).__name__ == "NavierStokes2D")
    closure = next(c.cell_contents for c in cl if isinstance(c.cell_contents, torch.nn.Module))
    ops, f_hat = ns._constants(torch.float64, torch.device("cpu"))
    convs = [m for m in closure.net if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        x1 = step(x0, 0)
    arrays = dict(
        dt=np.array(float(ns.dt)), k2=ops.k2.numpy(), inv_k2=ops.inv_k2.numpy(),
        mask=ops.mask.numpy(), igrad=ops.igrad.numpy(),
        linear=(-(ns.nu * ops.k2 + ns.alpha)).numpy(), forcing_hat=f_hat.numpy(),
        x0=x0.detach().numpy(), x1=x1.numpy())
    for i, c in enumerate(convs):
        arrays[f"w{i}"] = c.weight.detach().numpy()
        arrays[f"b{i}"] = c.bias.detach().numpy()
    np.savez(path, **arrays)


# -- the parent -------------------------------------------------------------------------------

def child(args) -> None:
    w = json.loads(args.child_workload)
    res = jax_child(w, args.repeats) if args.child == "diffrax" else \
        torch_child(w, args.child, args.repeats)
    print("RESULT " + json.dumps(res))


def spawn(python: str, w: dict, method: str, repeats: int, env: dict) -> dict | None:
    cmd = [python, os.path.abspath(__file__), "--child", method, "--child-workload",
           json.dumps(w), "--repeats", str(repeats)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    print(f"  {method}: failed: {' | '.join(tail)}", file=sys.stderr)
    return None


def rel(a: list, b: list) -> float:
    x = np.concatenate([np.asarray(v) for v in a])
    y = np.concatenate([np.asarray(v) for v in b])
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    ap.add_argument("--jax-python", default=sys.executable,
                    help="a Python with jax and diffrax (default: this one)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-workload", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    base_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    base_env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         base_env.get("PYTHONPATH", "")])
    tmp = tempfile.mkdtemp(prefix="peers-")
    rows = []
    for name in args.workloads:
        w = dict(WORKLOADS[name], **(QUICK[name] if args.quick else {}))
        if w["kind"] == "ns":
            w["ns_file"] = os.path.join(tmp, f"ns{w['size']}.npz")
            export_ns(w, w["ns_file"])
        res: dict[str, dict | None] = {}
        for m in args.methods:
            env = dict(base_env)
            if m in ("compile", "auto20"):  # a cold compile cache, then the one it filled
                env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, f"inductor-{name}-{m}")
            python = args.jax_python if m == "diffrax" else sys.executable
            res[m] = spawn(python, w, m, args.repeats, env)
            if res[m] is not None and m in ("compile", "auto20"):
                again = spawn(python, w, m, args.repeats, env)
                res[m]["first_warm_cache"] = again["first"] if again else float("nan")
                res[m]["run20_warm_cache"] = again["run20"] if again else float("nan")
            print(f"  {name} {m}: {res[m] and {k: v for k, v in res[m].items() if k != 'grad'}}",
                  file=sys.stderr, flush=True)
        ref_name = "diffrax" if res.get("diffrax") else "plain"
        ref = res.get(ref_name)
        dfx = res.get("diffrax")
        for m in args.methods:
            r = res.get(m)
            if r is None:
                rows.append((name, m) + ("failed",) * 8)
                continue
            run20 = r["run20"]
            vs = (f"{r['warm'] / dfx['warm']:.2f}" if dfx else "-")
            vs_first = (f"{r['first'] / dfx['first']:.2f}" if dfx else "-")
            vs20 = (f"{run20 / dfx['run20']:.2f}" if dfx else "-")
            r20 = f"{run20:.1f}"
            if "run20_warm_cache" in r:
                r20 += f" / {r['run20_warm_cache']:.1f}"
                if dfx:
                    vs20 += f" / {r['run20_warm_cache'] / dfx['run20']:.2f}"
            err = rel(r["grad"], ref["grad"]) if ref is not None and m != ref_name else 0.0
            seg = r.get("segment", "")
            cold = r["first"]
            warmc = r.get("first_warm_cache")
            first = f"{cold:.2f}" + (f" / {warmc:.2f}" if warmc is not None else "")
            label = f" (k={seg})" if m == "compile" or (m == "auto20" and r["compile_time"]
                                                         or seg != 1) else ""
            rows.append((name, m + (label or (" (eager)" if m == "auto20" else "")),
                         f"{r['warm']:.3f}", vs, first, vs_first, r20, vs20,
                         f"{r['rss']:.0f}", f"{err:.1e}"))
    head = ("workload", "method", "time [s]", "/ diffrax", "first call [s]", "/ diffrax",
            "20 its [s]", "/ diffrax", "RSS [MiB]", "grad vs ref")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print(f"\nreference gradient: diffrax where it ran, else plain autograd; time: median of "
          f"{args.repeats} after the first call (auto20: of the last {args.repeats} of its 20); "
          "first call: a fresh process (compiled methods: an empty inductor cache / the cache "
          "the first process filled); 20 its: the first call and 19 more (auto20: the 20 "
          "unrolls of its run, measured)")


if __name__ == "__main__":
    main()
