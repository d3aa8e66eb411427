"""problems/implicit_heat.py: a time loop of implicit (fixed-point) steps, trained through
ctx.unroll with implicit gradients of every step."""

from __future__ import annotations

import functools
import math
import pathlib

import helpers
import pytest
import torch

import deepsolve
from deepsolve.problem import load_problem

PATH = pathlib.Path(__file__).resolve().parents[1] / "problems" / "implicit_heat.py"
SMALL = ["steps=24", "obs_every=6"]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def problem():
    prob, sha = load_problem(PATH)
    assert len(sha) == 64
    return prob


make_ctx = functools.partial(helpers.make_ctx, base=SMALL, dtype=torch.float64)


def test_loads_with_defaults(problem):
    assert isinstance(problem, deepsolve.Problem)
    cfg = problem.config()
    for key in ("iterations", "steps", "snapshots", "dtype", "D_true", "r_true", "solver"):
        assert key in problem.defaults
    assert cfg["dtype"] == "float64" and cfg["snapshots"] > 0
    # the step is stiff: explicit Euler would be unstable (dt D k_max^2 > 2)
    assert cfg["dt"] * cfg["D_true"] * (math.pi * cfg["n"]) ** 2 > 2


def test_residuals_finite_with_gradients_through_the_implicit_steps(problem):
    ctx = make_ctx(problem)
    terms = problem.residuals(ctx, 0)
    assert set(terms) == {"misfit"}
    misfit = terms["misfit"]
    assert misfit.dim() == 0 and torch.isfinite(misfit) and misfit.requires_grad
    misfit.backward()
    g = torch.stack([ctx.model.log_D.grad, ctx.model.log_r.grad])
    assert torch.isfinite(g).all() and bool((g.abs() > 0).all())
    # the same gradient with every step stored (no revolve) and against finite differences
    ctx.cfg.snapshots = 0
    ctx.model.zero_grad()
    problem.residuals(ctx, 0)["misfit"].backward()
    g2 = torch.stack([ctx.model.log_D.grad, ctx.model.log_r.grad])
    assert torch.allclose(g, g2, rtol=1e-10, atol=0)
    h = 1e-5
    with torch.no_grad():
        for p, gp in ((ctx.model.log_D, g[0]), (ctx.model.log_r, g[1])):
            p += h
            up = float(problem.residuals(ctx, 0)["misfit"])
            p -= 2 * h
            down = float(problem.residuals(ctx, 0)["misfit"])
            p += h
            assert (up - down) / (2 * h) == pytest.approx(float(gp), rel=1e-5)


def test_data_are_the_truth(problem):
    ctx = make_ctx(problem)
    d = ctx.data
    assert d["rows"].tolist() == [5, 11, 17, 23]
    assert d["obs"].shape == (4, ctx.cfg.sensors)
    with torch.no_grad():
        ctx.model.log_D.fill_(math.log(ctx.cfg.D_true))
        ctx.model.log_r.fill_(math.log(ctx.cfg.r_true))
        uT, pred = problem._predict(ctx)
        ev = problem.evaluate(ctx)
    assert float((pred - d["clean_obs"]).norm() / d["clean_obs"].norm()) < 1e-8
    assert float((uT - d["uT_true"]).norm()) < 1e-8
    assert ev["param_error"] < 1e-12
    assert 0 < float(uT.min()) and float(uT.max()) < 1  # Fisher-KPP stays in (0, 1)


def test_a_few_iterations_reduce_the_parameter_error(problem):
    ctx = make_ctx(problem, ["lbfgs_iters=4"])
    e0 = problem.evaluate(ctx)
    assert e0["D_rel_error"] == pytest.approx(1.0) and e0["r_rel_error"] == pytest.approx(0.5)
    opt = problem.optimizer(ctx, list(ctx.model.parameters()))

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = problem.residuals(ctx, 0)["misfit"]
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    e1 = problem.evaluate(ctx)
    assert e1["param_error"] < 0.1 * e0["param_error"]
    assert e1["r_rel_error"] < 0.05


def test_bad_settings(problem):
    with pytest.raises(ValueError, match="obs_every"):
        make_ctx(problem, ["obs_every=100"])
    with pytest.raises(ValueError, match="D_true"):
        make_ctx(problem, ["D_true=-1"])
    with pytest.raises(ValueError, match="optimizer"):
        ctx = make_ctx(problem, ["optimizer=sgd"])
        problem.optimizer(ctx, list(ctx.model.parameters()))
