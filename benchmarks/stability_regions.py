"""Stability regions of the reversible steppers (docs/reversible.md, "Stability").

    .venv/bin/python benchmarks/stability_regions.py                  # the table
    .venv/bin/python benchmarks/stability_regions.py --png docs/img/reversible_stability.png

For the McCallum–Foster coupling of Euler, Heun and RK4 at two couplings, and for reversible
Heun, prints how far the region reaches along the negative real axis (diffusion, decay,
stiff reactions) and along the imaginary axis (advection, waves, oscillation), beside the base
method's own reach; ``--png`` draws the regions in the ``w = h mu`` plane. A point belongs to
a region when no mode grows faster than the exact solution by more than a factor 10 over
10^4 steps, ``rho(M(w)) <= 10^(1e-4) max(1, |e^w|)`` (:mod:`deepsolve.stability`; for the base
method ``|R(w)|`` in place of ``rho(M)``): a growth of ``1 + 1e-8`` per step, which the strict
region excludes, does nothing in any run.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepsolve import stability as st  # noqa: E402
from deepsolve.reversible import TABLEAUS  # noqa: E402

METHODS = ("euler", "heun", "rk4")
COUPLINGS = (0.999, 0.9)
SLACK = 10 ** (1 / 10_000)  # a factor 10 over 10^4 steps


def growth(method: str, lam: float | None, w: np.ndarray) -> np.ndarray:
    """Per point: the growth beyond the solution (<= 1 inside the region). ``lam=None``: the
    base method itself; ``method="reversible_heun"``: Kidger et al.'s scheme."""
    with np.errstate(over="ignore", invalid="ignore"):
        allowed = np.maximum(np.abs(np.exp(w)), 1.0)
        if method == "reversible_heun":
            rho, _ = st.amplification(st.heun_matrix(w))
            return rho / allowed
        tab = TABLEAUS[method]
        r = st.rk_stability_function(tab.a, tab.b, w)
        if lam is None:
            return np.abs(r) / allowed
        r_back = st.rk_stability_function(tab.a, tab.b, -w)
        rho, _ = st.amplification(st.coupled_matrix(r - 1, r_back - 1, lam))
        return rho / allowed


def reach(method: str, lam: float | None, direction: complex, top: float = 6.0) -> float:
    """How far the region reaches from 0 along ``direction`` (the first point outside)."""
    t = np.linspace(0, top, 600_001)[1:]
    g = growth(method, lam, t * direction)
    out = np.nonzero(g > SLACK)[0]
    return float(t[out[0]]) if out.size else float("inf")


def table() -> str:
    rows = ["| scheme | coupling | negative real axis: stable for |h·μ| < | "
            "imaginary axis: stable for |h·μ| < |",
            "|---|---:|---:|---:|"]
    for m in METHODS:
        rows.append(f"| {m} (base method) | — | {reach(m, None, -1):.3g} | "
                    f"{reach(m, None, 1j):.3g} |")
        for lam in COUPLINGS:
            rows.append(f"| {m}, coupled | {lam} | {reach(m, lam, -1):.3g} | "
                        f"{reach(m, lam, 1j):.3g} |")
    rows.append(f"| reversible Heun | — | {reach('reversible_heun', None, -1):.3g} | "
                f"{reach('reversible_heun', None, 1j):.3g} |")
    return "\n".join(rows)


def figure(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.linspace(-3.2, 0.6, 700)
    y = np.linspace(-3.2, 3.2, 700)
    X, Y = np.meshgrid(x, y)
    W = X + 1j * Y
    fig, axes = plt.subplots(len(COUPLINGS), len(METHODS), figsize=(11, 7), sharex=True,
                             sharey=True)
    for i, lam in enumerate(COUPLINGS):
        for j, m in enumerate(METHODS):
            ax = axes[i, j]
            base = growth(m, None, W) <= SLACK
            coupled = growth(m, lam, W) <= SLACK
            ax.contourf(X, Y, coupled, levels=[0.5, 1.5], colors=["#4c72b0"], alpha=0.55)
            ax.contour(X, Y, base, levels=[0.5], colors="k", linewidths=1.0)
            ax.axhline(0, color="0.6", lw=0.5)
            ax.axvline(0, color="0.6", lw=0.5)
            ax.set_title(f"{m}, lam = {lam}", fontsize=10)
            if i == len(COUPLINGS) - 1:
                ax.set_xlabel("Re(h·μ)")
            if j == 0:
                ax.set_ylabel("Im(h·μ)")
            ax.set_aspect("equal")
    fig.suptitle("Coupled (shaded) against the base method (outline): no mode grows 10x "
                 "beyond the solution over 10^4 steps", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", help="also draw the regions into this file")
    args = ap.parse_args()
    print(table())
    if args.png:
        figure(args.png)


if __name__ == "__main__":
    main()
