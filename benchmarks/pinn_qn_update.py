"""The inverse-Hessian work of one SSBroyden iteration: dense updates against pending ones.

:class:`deepsolve.pinn.SelfScaledBroyden` needs, per iteration, the next direction
:math:`H_{k+1} g_{k+1}` and the update :math:`H_{k+1} = \\beta H_k + U C U^\\top`. The dense
path (:func:`deepsolve.pinn.quasi_newton.broyden_update`, the optimizer before the pending
terms) reads the :math:`P^2` values of :math:`H` three times and writes them once per
iteration (:math:`H g`, :math:`H y`, the rank-3 product) and averages :math:`H` with its
transpose every 64 iterations. The pending path (``_LazyInverse``, what the optimizer does
now) reads them once (:math:`H_0 g_{k+1}`) and folds ``fold_every`` updates at a time.

Both take ``--iterations`` steps of half the quasi-Newton step on a quadratic with a diagonal
Hessian (eigenvalues 1e-3 to 1e3; the line search and the loss are left out: they cost the
same on both paths) at each ``P`` and thread count and
print the median milliseconds per iteration over ``--repeats`` runs. ``P`` = 1341 and 2973
are the Burgers and Kovasznay networks of the shipped problems.

    .venv/bin/python benchmarks/pinn_qn_update.py --sizes 1341 2973 --threads 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepsolve.pinn.quasi_newton import SYMMETRIZE_EVERY, _LazyInverse, broyden_update


def curvature(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A quadratic model: the diagonal of its Hessian (``n`` values from 1e-3 to 1e3) and the
    gradient at a random start, :math:`g_0 = B x_0`."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.logspace(-3, 3, n, dtype=torch.float64)
    return b, b * torch.randn(n, dtype=torch.float64, generator=gen)


def dense(H: torch.Tensor, b: torch.Tensor, g: torch.Tensor, iterations: int) -> None:
    """The iterations of the dense path: ``d = -H g``, a step of 0.5 d, the update."""
    for k in range(1, iterations + 1):
        s = -0.5 * (H @ g)
        y = b * s
        broyden_update(H, s, y, g, 0.5, "ssbroyden", k == 1,
                       symmetrize=k % SYMMETRIZE_EVERY == 0)
        g = g + y


def pending(H: torch.Tensor, b: torch.Tensor, g: torch.Tensor, iterations: int,
            fold_every: int) -> None:
    """The same iterations as :class:`deepsolve.pinn.SelfScaledBroyden` takes them."""
    lazy = _LazyInverse(H, fold_every)
    Hg = lazy @ g
    for k in range(1, iterations + 1):
        s = -0.5 * Hg
        y = b * s
        g_new = g + y
        Hg_new = lazy @ g_new
        if lazy.update(Hg, Hg_new, g, g_new, s, 0.5, "ssbroyden", k == 1) and lazy.full:
            lazy.fold(symmetrize=k % SYMMETRIZE_EVERY == 0)
        g, Hg = g_new, Hg_new
    lazy.fold(symmetrize=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1341, 2973])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iterations", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fold-every", type=int, default=16)
    a = ap.parse_args(argv)
    print(f"SSBroyden inverse-Hessian work per iteration, median of {a.repeats} runs of "
          f"{a.iterations} iterations (ms); fold_every={a.fold_every}")
    print(f"{'P':>6} {'threads':>7} {'dense':>8} {'pending':>8} {'ratio':>6}")
    for n in a.sizes:
        b, g0 = curvature(n)
        for threads in a.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {"dense": [], "pending": []}
            for _ in range(a.repeats):     # interleaved: load drifts hit both alike
                for name in times:
                    H = torch.eye(n, dtype=torch.float64)
                    t0 = time.perf_counter()
                    if name == "dense":
                        dense(H, b, g0, a.iterations)
                    else:
                        pending(H, b, g0, a.iterations, a.fold_every)
                    times[name].append((time.perf_counter() - t0) / a.iterations * 1e3)
            d, p = (statistics.median(times[k]) for k in ("dense", "pending"))
            print(f"{n:>6} {threads:>7} {d:>8.2f} {p:>8.2f} {d / p:>6.2f}")


if __name__ == "__main__":
    main()
