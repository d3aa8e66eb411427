"""problems/burgers_assimilation.py: loading, loss terms, gradients, data, a short training run.

Most tests use a shortened configuration (n = 64, 120 solver steps) to stay fast; the
defaults (500 steps) are checked for their keys and values only.
"""

from __future__ import annotations

import functools
import math
import pathlib

import helpers
import pytest
import torch

import deepsolve
from deepsolve.physics.burgers import derivative
from deepsolve.problem import load_problem

PATH = pathlib.Path(__file__).resolve().parents[1] / "problems" / "burgers_assimilation.py"
SMALL = ["n=64", "steps=120", "obs_times=4", "lbfgs_iters=4"]
TERMS = {"misfit", "smoothness"}
METRICS = {"u0_rel_error", "final_rel_error", "obs_rel_error"}


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def problem():
    prob, sha = load_problem(PATH)
    assert len(sha) == 64
    return prob


make_ctx = functools.partial(helpers.make_ctx, base=SMALL)  # the configuration's dtype


def loss_of(problem, ctx, it=0):
    terms = problem.residuals(ctx, it)
    w = problem.weights(ctx)
    return terms, sum(float(w.get(k, 1.0)) * v for k, v in terms.items())


def test_loads_with_trainer_defaults(problem):
    assert isinstance(problem, deepsolve.Problem)
    cfg = problem.config()
    for key in ("iterations", "lr", "steps", "eval_every", "snapshots", "dtype"):
        assert key in problem.defaults
    assert cfg["steps"] >= 500 and cfg["dtype"] == "float64"
    assert 8 <= cfg["sensors"] <= 16
    assert set(problem.weights(make_ctx(problem))) == TERMS


def test_residuals_and_gradients(problem):
    ctx = make_ctx(problem)
    assert isinstance(ctx.model, torch.nn.Module)
    terms, loss = loss_of(problem, ctx)
    assert set(terms) == TERMS
    for v in terms.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and torch.isfinite(v)
        assert v.requires_grad
    # u0 = 0 predicts zeros: the relative misfit is exactly 1 and the H1 term 0
    assert float(terms["misfit"].detach()) == pytest.approx(1.0, rel=1e-12)
    assert float(terms["smoothness"].detach()) == 0.0
    loss.backward()
    for name, p in ctx.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert float(p.grad[1:].abs().max() if name == "alpha" else p.grad.abs().max()) > 0


def test_gradient_matches_finite_differences_and_checkpointing(problem):
    """The misfit gradient through the unrolled solver (store_all and revolve) vs FD."""
    ctx = make_ctx(problem, ["steps=60", "obs_times=3"])
    with torch.no_grad():
        ctx.model.alpha.copy_(torch.linspace(0.3, -0.2, ctx.model.modes + 1))
        ctx.model.beta.copy_(torch.linspace(-0.1, 0.4, ctx.model.modes))

    def misfit():
        return problem.residuals(ctx, 0)["misfit"]

    ctx.model.zero_grad()
    misfit().backward()
    g = ctx.model.beta.grad.clone()
    ctx.cfg.snapshots = 5  # revolve through the same unroll: the same gradient
    ctx.model.zero_grad()
    misfit().backward()
    assert torch.allclose(ctx.model.beta.grad, g, rtol=1e-10, atol=1e-14)
    ctx.cfg.snapshots = 0
    h = 1e-6
    with torch.no_grad():
        for j in (0, 2):
            ctx.model.beta[j] += h
            up = float(misfit())
            ctx.model.beta[j] -= 2 * h
            down = float(misfit())
            ctx.model.beta[j] += h
            assert (up - down) / (2 * h) == pytest.approx(float(g[j]), rel=1e-6)


def test_observations_are_the_truth_at_the_right_times(problem):
    ctx = make_ctx(problem)
    d, cfg = ctx.data, ctx.cfg
    assert d["sensors"].numel() == cfg.sensors and d["rows"].numel() == cfg.obs_times
    assert int(d["rows"][-1]) == cfg.steps - 1  # the last observation is at T
    assert int(d["rows"][0]) >= cfg.steps // 2  # all in the second half
    # the coarse solver from the true u0 reproduces the clean data up to its dt^4 error:
    # an off-by-one in the observation rows would give ~1e-2
    with torch.no_grad():
        uT, outs = ctx.unroll(problem.step, d["u0_true"])
    pred = outs.index_select(0, d["rows"])
    assert float((pred - d["clean_obs"]).norm() / d["clean_obs"].norm()) < 1e-6
    assert float((uT - d["uT_true"]).norm() / d["uT_true"].norm()) < 1e-6
    # noise of the requested relative size
    scale = d["clean_obs"].pow(2).mean().sqrt()
    rel_noise = float((d["obs"] - d["clean_obs"]).pow(2).mean().sqrt() / scale)
    assert 0.5 * cfg.noise < rel_noise < 1.5 * cfg.noise
    # the same settings give the same truth and data
    ctx2 = make_ctx(problem)
    assert torch.equal(ctx2.data["obs"], d["obs"])
    assert torch.equal(ctx2.data["u0_true"], d["u0_true"])


def test_model_parametrisation(problem):
    ctx = make_ctx(problem)
    model = ctx.model
    with torch.no_grad():
        model.alpha.copy_(torch.randn(model.modes + 1, generator=torch.Generator().manual_seed(0)))
        model.beta.copy_(torch.randn(model.modes, generator=torch.Generator().manual_seed(1)))
        u0 = model()
        a, b = model.coefficients()
        x = ctx.data["grid"].coords(torch.float64)
        ref = a[0] + sum(a[m] * torch.cos(m * x) + b[m - 1] * torch.sin(m * x)
                         for m in range(1, model.modes + 1))
        assert torch.allclose(u0, ref, atol=1e-13)
        h1 = derivative(u0, ctx.data["grid"]).pow(2).mean()
        assert float(model.h1_seminorm()) == pytest.approx(float(h1), rel=1e-12)


def test_evaluate_keys(problem):
    ctx = make_ctx(problem)
    with torch.no_grad():
        ev = problem.evaluate(ctx)
    assert set(ev) == METRICS
    assert all(isinstance(v, float) and math.isfinite(v) for v in ev.values())
    assert ev["u0_rel_error"] == pytest.approx(1.0)  # the model starts at u0 = 0


def _train(problem, ctx, iterations):
    """The trainer's loop (closure for L-BFGS)."""
    params = [p for p in ctx.model.parameters() if p.requires_grad]
    opt = problem.optimizer(ctx, params)

    def closure():
        opt.zero_grad(set_to_none=True)
        _, loss = loss_of(problem, ctx)
        loss.backward()
        return loss

    for _ in range(iterations):
        if isinstance(opt, torch.optim.LBFGS):
            opt.step(closure)
        else:
            closure()
            opt.step()


@pytest.mark.parametrize(("optimizer", "sets", "iterations"), [
    ("lbfgs", [], 3),
    ("adam", ["lr=0.05"], 8),
])
def test_training_reduces_misfit_and_error(problem, optimizer, sets, iterations):
    ctx = make_ctx(problem, [f"optimizer={optimizer}"] + sets)
    with torch.no_grad():
        m0 = float(problem.residuals(ctx, 0)["misfit"])
        e0 = problem.evaluate(ctx)
    _train(problem, ctx, iterations)
    with torch.no_grad():
        m1 = float(problem.residuals(ctx, 0)["misfit"])
        e1 = problem.evaluate(ctx)
    assert m1 < 0.5 * m0
    assert e1["u0_rel_error"] < 0.9 * e0["u0_rel_error"]
    assert e1["final_rel_error"] < 0.7 * e0["final_rel_error"]
    if optimizer == "lbfgs":
        assert m1 < 0.05 and e1["u0_rel_error"] < 0.6


def test_bad_settings(problem):
    with pytest.raises(ValueError, match="optimizer"):
        ctx = make_ctx(problem, ["optimizer=sgd"])
        problem.optimizer(ctx, list(ctx.model.parameters()))
    with pytest.raises(ValueError, match="obs_times"):
        make_ctx(problem, ["obs_times=100"])
    with pytest.raises(ValueError, match="modes"):
        make_ctx(problem, ["modes=30"])
