"""DeepXDE's own Kovasznay example, timed on this machine: the anchor of docs/pinn.md.

The set-up is DeepXDE's ``examples/pinn_forward/Kovasznay_flow.py`` (DeepXDE 1.15, PyTorch
backend): a 4×50 tanh network (Glorot normal), 2601 interior + 400 boundary Hammersley
points, ``u, v`` Dirichlet on the whole boundary and ``p`` on the outflow ``x = 1``,
Adam (lr 1e-3) for 30000 iterations, then L-BFGS with DeepXDE's defaults (at most 15000
iterations). Errors are relative L2 on the same 201×201 grid ``problems/navier_stokes_pinn.py``
uses (DeepXDE's example uses 10⁵ random points; the numbers agree to two digits).

DeepXDE is a benchmark-only dependency (``pip install -e .[bench]``), never imported by
deepsolve. Run on one thread, side by side with deepsolve on the other core::

    OMP_NUM_THREADS=1 DDE_BACKEND=pytorch .venv/bin/python benchmarks/pinn_deepxde.py

``--adam`` / ``--lbfgs`` shorten the run (for a smoke test); progress and the time at which
each of deepsolve's targets was first passed go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DDE_BACKEND", "pytorch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

RE = 20.0
NU = 1.0 / RE
LAM = 1.0 / (2 * NU) - np.sqrt(1.0 / (4 * NU**2) + 4 * np.pi**2)


def exact(x: np.ndarray) -> np.ndarray:
    ex = np.exp(LAM * x[:, 0:1])
    u = 1 - ex * np.cos(2 * np.pi * x[:, 1:2])
    v = LAM / (2 * np.pi) * ex * np.sin(2 * np.pi * x[:, 1:2])
    p = 0.5 * (1 - np.exp(2 * LAM * x[:, 0:1]))
    return np.hstack((u, v, p))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adam", type=int, default=30000)
    ap.add_argument("--lbfgs", type=int, default=15000, help="L-BFGS max iterations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import deepxde as dde

    def pde(x, u):
        uu, vv = u[:, 0:1], u[:, 1:2]
        u_x = dde.grad.jacobian(u, x, i=0, j=0)
        u_y = dde.grad.jacobian(u, x, i=0, j=1)
        v_x = dde.grad.jacobian(u, x, i=1, j=0)
        v_y = dde.grad.jacobian(u, x, i=1, j=1)
        p_x = dde.grad.jacobian(u, x, i=2, j=0)
        p_y = dde.grad.jacobian(u, x, i=2, j=1)
        u_xx = dde.grad.hessian(u, x, component=0, i=0, j=0)
        u_yy = dde.grad.hessian(u, x, component=0, i=1, j=1)
        v_xx = dde.grad.hessian(u, x, component=1, i=0, j=0)
        v_yy = dde.grad.hessian(u, x, component=1, i=1, j=1)
        return [uu * u_x + vv * u_y + p_x - NU * (u_xx + u_yy),
                uu * v_x + vv * v_y + p_y - NU * (v_xx + v_yy),
                u_x + v_y]

    geom = dde.geometry.Rectangle(xmin=[-0.5, -0.5], xmax=[1, 1.5])
    bcs = [
        dde.icbc.DirichletBC(geom, lambda x: exact(x)[:, 0:1], lambda _, on: on, component=0),
        dde.icbc.DirichletBC(geom, lambda x: exact(x)[:, 1:2], lambda _, on: on, component=1),
        dde.icbc.DirichletBC(geom, lambda x: exact(x)[:, 2:3],
                             lambda x, on: on and np.isclose(x[0], 1), component=2),
    ]
    data = dde.data.PDE(geom, pde, bcs, num_domain=2601, num_boundary=400, num_test=100000)
    net = dde.nn.FNN([2] + 4 * [50] + [3], "tanh", "Glorot normal")
    model = dde.Model(data, net)

    g = np.linspace(0, 1, 201)
    xs, ys = np.meshgrid(-0.5 + 1.5 * g, -0.5 + 2.0 * g, indexing="ij")
    grid = np.stack((xs.ravel(), ys.ravel()), 1)
    ref = exact(grid)

    def errors() -> list[float]:
        pred = model.predict(grid)
        return [float(np.linalg.norm(pred[:, i] - ref[:, i]) / np.linalg.norm(ref[:, i]))
                for i in range(3)]

    t0 = time.perf_counter()
    model.compile("adam", lr=1e-3)
    model.train(iterations=args.adam, display_every=1000)
    t_adam = time.perf_counter() - t0
    e_adam = errors()
    print(f"after Adam: {t_adam:.0f} s, errors u v p = {e_adam}", flush=True)
    dde.optimizers.config.set_LBFGS_options(maxiter=args.lbfgs)
    model.compile("L-BFGS")
    model.train(display_every=1000)
    total = time.perf_counter() - t0
    e = errors()
    out = {"adam_iterations": args.adam, "lbfgs_maxiter": args.lbfgs, "adam_s": t_adam,
           "total_s": total, "u_rel_l2": e[0], "v_rel_l2": e[1], "p_rel_l2": e[2],
           "after_adam": e_adam}
    print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh)
    return out


if __name__ == "__main__":
    main()
