"""deepsolve.pinn.problem: a PINNProblem's loss, Gauss–Newton terms, metrics and errors.

A first-order system for -u'' = pi^2 sin(pi x) on [0, 1] (u' = v, v' = -pi^2 sin(pi x);
exact u = sin(pi x), v = pi cos(pi x)), two equations and a boundary condition, exercises
the dict-of-equations path; the loss the trainer sees must equal the least-squares terms'
(the objective Gauss–Newton minimises), with and without attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepsolve.io import read_log
from deepsolve.pinn import least_squares_loss
from deepsolve.problem import Context, apply_overrides, load_problem
from deepsolve.train import train

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

F64 = torch.float64


SOURCE = '''
import math

import torch

import deepsolve
from deepsolve.pinn import PINN_SETTINGS, PINNProblem, jet

F64 = torch.float64


class System(PINNProblem, deepsolve.Problem):
    inputs, outputs, lo, hi = 1, 2, (0.0,), (1.0,)
    components = ("u", "v")
    loss_weights = {"bc": 10.0, "flux": 2.0}
    defaults = {**PINN_SETTINGS, "n_collocation": 40, "width": 8, "depth": 2,
                "rad_every": 3, "rad_pool": 400, "eval_every": 2}

    def pde(self, ctx, x, backend):
        j = jet(ctx.model, x, 1, backend=backend)
        u, v = j.value[:, 0], j.value[:, 1]
        return {"flux": j.jacobian[:, 0, 0] - v,
                "balance": j.jacobian[:, 1, 0] + math.pi**2 * torch.sin(math.pi * x[:, 0])}

    def conditions(self, ctx):
        pts = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64)   # (x, u target)
        return {"bc": (lambda p: ctx.model(p[:, :1])[:, 0] - p[:, 1], pts)}

    def reference(self, ctx):
        x = torch.linspace(0, 1, 51, dtype=F64)[:, None]
        return x, torch.cat([torch.sin(math.pi * x), math.pi * torch.cos(math.pi * x)], 1)


problem = System()
'''


def load(tmp_path):
    """The system problem as a problem file, and its module's ``System``."""
    path = tmp_path / "system.py"
    path.write_text(SOURCE)
    prob, _ = load_problem(path)
    return path, type(prob)


def context(problem, sets=()):
    cfg = apply_overrides(problem.config(), list(sets))
    ctx = Context(cfg, torch.device("cpu"), F64)
    torch.manual_seed(0)
    problem.build(ctx)
    return ctx


@pytest.mark.parametrize("sets", [[], ["attention=exponential"], ["attention=linear"]],
                         ids=["plain", "vrba", "rba"])
def test_the_loss_equals_the_least_squares_terms(tmp_path, sets):
    prob = load(tmp_path)[1]()
    ctx = context(prob, sets)
    for it in (0, 1, 3):   # 3: after a RAD redraw
        terms = prob.residuals(ctx, it)
        assert set(terms) == {"flux", "balance", "bc"}
        w = dict(ctx.data["weights"])
        loss = sum(w.get(k, 1.0) * v for k, v in terms.items())
        lsq = least_squares_loss(prob.least_squares_terms(ctx, it))
        assert float(lsq) == pytest.approx(float(loss), rel=1e-12)
    # by hand: the conditions' mean square, weighted
    with torch.no_grad():
        at = ctx.model(torch.tensor([[0.0], [1.0]], dtype=F64))[:, 0]
    assert float(terms["bc"]) == pytest.approx(float(at.pow(2).mean()), rel=1e-12)
    assert w == {"flux": 2.0, "balance": 1.0, "bc": 10.0}


def test_rad_redraws_the_points_every_rad_every(tmp_path):
    prob = load(tmp_path)[1]()
    ctx = context(prob)
    a, b = prob._points(ctx, 1), prob._points(ctx, 2)
    c = prob._points(ctx, 3)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert c.shape == (40, 1) and bool(((c >= 0) & (c <= 1)).all())


def test_metrics_are_the_relative_l2_errors_of_each_component(tmp_path):
    prob = load(tmp_path)[1]()
    ctx = context(prob)
    m = prob.evaluate(ctx)
    x = ctx.data["test"]
    with torch.no_grad():
        pred = ctx.model(x)
    exact = ctx.data["test_exact"]
    for i, c in enumerate("uv"):
        want = float((pred[:, i] - exact[:, i]).norm() / exact[:, i].norm())
        assert m[f"{c}_rel_l2"] == pytest.approx(want, rel=1e-12)
    assert m["max_rel_l2"] == max(m["u_rel_l2"], m["v_rel_l2"])
    assert prob.target_metric == "max_rel_l2"


@pytest.mark.parametrize("optimizer", ["ssbroyden", "gauss_newton"])
def test_training_through_the_trainer_reaches_the_exact_solution(tmp_path, optimizer):
    """Gauss–Newton checks at its first step that its terms equal the trainer's loss."""
    path, _ = load(tmp_path)
    res = train(str(path), sets=[f"optimizer={optimizer}", "qn_iters=10"],
                overrides={"iterations": 30}, out=str(tmp_path / "run"), quiet=True)
    c = read_log(res.log_path).columns
    assert np.isfinite(c["loss"]).all() and c["loss"][-1] < 1e-3 * c["loss"][0]
    assert c["metric/max_rel_l2"][-1] < 1e-3


def test_a_reference_of_the_wrong_shape_is_refused(tmp_path):
    System = load(tmp_path)[1]

    class Bad(System):
        def reference(self, ctx):
            x = torch.linspace(0, 1, 5, dtype=F64)[:, None]
            return x, torch.sin(x)   # one column for two components

    with pytest.raises(ValueError, match=r"must be \(M, 2\) for 5 points"):
        context(Bad())


def test_a_weight_setting_overrides_the_class_weights(tmp_path):
    System = load(tmp_path)[1]

    class Weighted(System):
        defaults = {**System.defaults, "weight_bc": 3.5}

    prob = Weighted()
    assert dict(context(prob).data["weights"])["bc"] == 3.5
    assert dict(context(prob, ["weight_bc=0"]).data["weights"])["bc"] == 0.0
    with pytest.raises(ValueError, match="weight of loss term 'bc' must be finite and >= 0"):
        context(prob, ["weight_bc=-1"])
