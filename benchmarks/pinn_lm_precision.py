"""Does the precision of the Levenberg–Marquardt solve limit a PINN run near its best error?

From a trained state (a run's ``restart.pt``), on the problem's own fixed least-squares terms
(``least_squares_terms(ctx, 0)``), takes the same Levenberg–Marquardt iterations with two
solves of the damped system :math:`(J^\\top J + \\mu I)\\delta = -J^\\top r`:

* ``cholesky``: the normal equations, factorised (what :class:`deepsolve.pinn.GaussNewton`
  does); it resolves singular values of :math:`J` down to about
  :math:`\\sqrt{\\epsilon}\\,s_{max}` only;
* ``svd``: :math:`J = U S V^\\top`, :math:`\\delta = -V\\,\\mathrm{diag}(s/(s^2+\\mu))\\,U^\\top r`,
  accurate to :math:`\\epsilon\\,s_{max}`.

Both use the gain-ratio damping of ``GaussNewton`` (Nielsen 1999). If the two trajectories
agree, the damping :math:`\\mu` stays far above :math:`\\epsilon\\|J^\\top J\\|` and the solve's
precision is not what stops the run; the table also shows whether the problem's error
follows the loss on a fixed point set. Prints the singular values of :math:`J` and, every
``--every`` iterations, the loss, the problem's metrics and :math:`\\mu` for both solves.

    .venv/bin/python benchmarks/pinn_lm_precision.py problems/burgers_pinn.py \\
        runs/burgers/restart.pt --iterations 40 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from deepsolve.pinn import least_squares_loss, residual_jacobian
from deepsolve.pinn.optim import flat_parameters, load_flat_parameters
from deepsolve.problem import Context, apply_overrides, load_problem


def lm(prob, ctx, terms, theta0: torch.Tensor, solver: str, iterations: int, every: int,
       tau: float = 1e-3) -> list[tuple]:
    """``iterations`` Levenberg–Marquardt steps from ``theta0``; rows ``(iteration, loss,
    metrics, mu, seconds)`` every ``every`` iterations."""
    params = list(ctx.model.parameters())
    theta, mu, nu, rows = theta0.clone(), 0.0, 2.0, []
    start = time.perf_counter()

    def loss_at(th):
        load_flat_parameters(params, th)
        with torch.no_grad():
            return float(least_squares_loss(terms))

    for k in range(1, iterations + 1):
        load_flat_parameters(params, theta)
        r, J = residual_jacobian(ctx.model, terms, params)
        r, J = r.detach(), J.detach()
        f = float(r @ r)
        if solver == "svd":
            U, S, Vh = torch.linalg.svd(J, full_matrices=False)
            c = U.T @ r
        else:
            A, g = J.T @ J, J.T @ r
        if mu <= 0:
            mu = tau * float((J * J).sum(0).max())
        for _ in range(40):
            if solver == "svd":
                d = -(Vh.T @ (S / (S * S + mu) * c))
            else:
                L, info = torch.linalg.cholesky_ex(A + mu * torch.eye(A.shape[0], dtype=A.dtype))
                if int(info):
                    mu, nu = mu * nu, nu * 2
                    continue
                d = torch.cholesky_solve(-g.unsqueeze(1), L).squeeze(1)
            f_new = loss_at(theta + d)
            predicted = f - float((r + J @ d).pow(2).sum())
            rho = (f - f_new) / predicted if predicted > 0 else -1.0
            if rho > 0:
                theta, f = theta + d, f_new
                mu, nu = max(mu * max(1 / 3, 1 - (2 * rho - 1) ** 3), 1e-300), 2.0
                break
            mu, nu = mu * nu, nu * 2
        if k % every == 0 or k == iterations:
            load_flat_parameters(params, theta)
            with torch.no_grad():
                metrics = prob.evaluate(ctx)
            rows.append((k, f, metrics, mu, time.perf_counter() - start))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("problem", help="a PINN problem file with least_squares_terms")
    ap.add_argument("restart", help="a run's restart.pt (its model is the starting point)")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tau", type=float, default=1e-3,
                    help="initial damping relative to max diag(JᵀJ) (GaussNewton's damping)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prob, _ = load_problem(args.problem)
    state = torch.load(args.restart, map_location="cpu", weights_only=False)
    cfg = apply_overrides(prob.config(), args.set)
    ctx = Context(cfg, torch.device("cpu"), torch.float64)
    torch.manual_seed(int(cfg.get("seed", 0)))
    prob.build(ctx)
    ctx.model.load_state_dict(state["model"])
    ctx.model.to(torch.float64)
    terms = prob.least_squares_terms(ctx, 0)
    params = list(ctx.model.parameters())
    theta0 = flat_parameters(params).detach().clone()
    _, J = residual_jacobian(ctx.model, terms, params)
    s = torch.linalg.svdvals(J.detach())
    print(f"J: {tuple(J.shape)}; singular values {float(s[0]):.2e} … {float(s[-1]):.2e}; "
          f"eps·s_max² = {torch.finfo(J.dtype).eps * float(s[0]) ** 2:.1e}")
    with torch.no_grad():
        load_flat_parameters(params, theta0)
        m0 = prob.evaluate(ctx)
        loss0 = float(least_squares_loss(terms))
    keys = [k for k in m0 if k.endswith("rel_l2")]
    print(f"start: loss {loss0:.3e}  " + "  ".join(f"{k} {m0[k]:.3e}" for k in keys))
    print("| solve | iteration | loss | " + " | ".join(keys) + " | μ | seconds |")
    print("|---|---:|---:|" + "---:|" * len(keys) + "---:|---:|")
    for solver in ("cholesky", "svd"):
        for k, f, m, mu, sec in lm(prob, ctx, terms, theta0, solver, args.iterations,
                                   args.every, args.tau):
            print(f"| {solver} | {k} | {f:.3e} | " + " | ".join(f"{m[q]:.3e}" for q in keys)
                  + f" | {mu:.1e} | {sec:.1f} |", flush=True)


if __name__ == "__main__":
    main()
