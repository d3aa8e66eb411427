"""problems/helmholtz_pinn.py: the exact solution, the set-up, the ansatz and short runs."""

from __future__ import annotations

import functools
import math
import pathlib
import sys

import helpers
import numpy as np
import pytest
import torch

from deepsolve.io.h5log import read_log
from deepsolve.problem import load_problem
from deepsolve.train import train

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

PATH = pathlib.Path(__file__).resolve().parents[1] / "problems" / "helmholtz_pinn.py"
TINY = ["n_collocation=64", "rad_pool=256", "width=16", "depth=2", "test_n=20",
        "n_boundary=40", "qn_iters=5"]


@pytest.fixture(scope="module")
def helm():
    prob, _ = load_problem(PATH)
    return prob, sys.modules[type(prob).__module__]


make_ctx = functools.partial(helpers.make_ctx, base=TINY)


def test_exact_solution_satisfies_the_equation_and_the_boundary(helm):
    _, mod = helm
    g = torch.Generator().manual_seed(0)
    p = (2 * torch.rand(500, 2, generator=g, dtype=torch.float64) - 1).requires_grad_()
    u = mod.exact(p)
    (du,) = torch.autograd.grad(u.sum(), p, create_graph=True)
    uxx = torch.autograd.grad(du[:, 0].sum(), p, retain_graph=True)[0][:, 0]
    uyy = torch.autograd.grad(du[:, 1].sum(), p)[0][:, 1]
    q = mod.source(p).detach()
    res = (uxx + uyy + u - q).detach()
    assert float(q.abs().max()) > 100                      # (17 pi^2 - 1) sin sin
    assert float(res.abs().max()) < 1e-12 * float(q.abs().max())
    # k^2 counts: with k = 2 the residual of the k = 1 source is 3u, not zero
    assert float((uxx + uyy + 4 * u - q).detach().abs().max()) > 1.0
    # u = 0 on the four sides
    s = torch.linspace(-1, 1, 101, dtype=torch.float64)
    one = torch.ones_like(s)
    for side in (torch.stack([s, one], 1), torch.stack([s, -one], 1),
                 torch.stack([one, s], 1), torch.stack([-one, s], 1)):
        assert float(mod.exact(side).abs().max()) < 1e-14


def test_source_matches_finite_differences(helm):
    _, mod = helm
    p = torch.tensor([[0.3, -0.2], [-0.7, 0.45], [0.1, 0.9]], dtype=torch.float64)
    h = 1e-4
    ex, ey = torch.tensor([h, 0.0], dtype=torch.float64), torch.tensor([0.0, h],
                                                                        dtype=torch.float64)
    u = mod.exact(p)
    lap = sum((mod.exact(p + e) - 2 * u + mod.exact(p - e)) / h**2 for e in (ex, ey))
    torch.testing.assert_close(lap + u, mod.source(p), rtol=1e-5, atol=1e-5)
    assert mod.exact(torch.tensor([[0.5, 0.125]], dtype=torch.float64)).item() == \
        pytest.approx(math.sin(math.pi / 2) * math.sin(math.pi / 2))


def test_defaults_and_reference_grid(helm):
    prob, mod = helm
    cfg = prob.config()
    assert (cfg["k"], cfg["a1"], cfg["a2"]) == (1.0, 1.0, 4.0)
    assert cfg["constraints"] == "hard" and cfg["test_n"] == 100
    assert cfg["optimizer"] == "ssbroyden" and cfg["dtype"] == "float64"
    ctx = make_ctx(prob, ["test_n=100"])
    x, u = ctx.data["test"], ctx.data["test_exact"]
    assert x.shape == (10000, 2) and u.shape == (10000, 1)
    assert float(x.min()) == -1.0 and float(x.max()) == 1.0
    torch.testing.assert_close(u[:, 0], mod.exact(x), rtol=0, atol=0)
    for name in ("u_rel_l2", "pde", "boundary", "constraints", "weight_boundary"):
        assert f"``{name}" in mod.__doc__, name
    assert prob.published and all(p.error for p in prob.published)


@pytest.mark.parametrize("constraints", ["hard", "soft"])
def test_ansatz_and_terms(helm, constraints):
    prob, _ = helm
    torch.manual_seed(1)
    ctx = make_ctx(prob, [f"constraints={constraints}", "weight_boundary=7"])
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.normal_()
        s = torch.linspace(-1, 1, 41, dtype=torch.float64)
        sides = torch.cat([torch.stack([s, torch.ones_like(s)], 1),
                           torch.stack([-torch.ones_like(s), s], 1)])
        on_side = ctx.model(sides).abs().max()
        inside = ctx.model(torch.tensor([[0.1, 0.2], [0.5, -0.3]],
                                        dtype=torch.float64)).abs().max()
    assert float(inside) > 1e-3
    terms = prob.residuals(ctx, 0)
    w = prob.weights(ctx)
    if constraints == "hard":
        assert float(on_side) == 0.0
        assert set(terms) == {"pde"}
    else:
        assert float(on_side) > 1e-3
        assert set(terms) == {"pde", "boundary"} and w["boundary"] == 7.0
        pts = ctx.data["points_boundary"]
        assert ((pts.abs() - 1).abs().min(1).values < 1e-15).all()   # on a side
        assert float(terms["boundary"]) == pytest.approx(
            float(ctx.model(pts).pow(2).mean()), rel=1e-12)
    # the pde term is the mean square of Laplacian + k^2 u - q at the collocation points
    x = ctx.data["collocation"].points(0).clone().requires_grad_()
    u = ctx.model(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    lap = (torch.autograd.grad(du[:, 0].sum(), x, retain_graph=True)[0][:, 0]
           + torch.autograd.grad(du[:, 1].sum(), x)[0][:, 1])
    _, mod = helm
    want = (lap + u - mod.source(x)).pow(2).mean()
    assert float(terms["pde"]) == pytest.approx(float(want), rel=1e-10)


def test_bad_constraints_give_a_one_line_error(helm):
    prob, _ = helm
    for bad, msg in ((["constraints=exact"], "constraints must be 'soft' or 'hard'"),
                     (["test_n=1"], "test_n must be >= 2")):
        with pytest.raises(ValueError, match=msg) as info:
            make_ctx(prob, bad)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("sets,terms", [
    ([], {"pde"}),
    (["constraints=soft"], {"pde", "boundary"}),
    (["optimizer=gauss_newton"], {"pde"}),
    (["optimizer=gauss_newton", "constraints=soft"], {"pde", "boundary"}),
], ids=["ssbroyden-hard", "ssbroyden-soft", "gauss_newton-hard", "gauss_newton-soft"])
def test_a_few_iterations_through_the_trainer(tmp_path, sets, terms):
    res = train(str(PATH), sets=TINY + sets + ["eval_every=1"], overrides={"iterations": 6},
                out=str(tmp_path / "run"), quiet=True)
    assert res.iterations == 6 and math.isfinite(res.final_loss)
    c = read_log(res.log_path).columns
    for k in terms:
        assert np.isfinite(c[f"loss/{k}"]).all()
    assert ("loss/boundary" in c) == ("boundary" in terms)
    assert c["loss"][-1] < 0.98 * c["loss"][0]            # the loss falls
    err = c["metric/u_rel_l2"]
    assert np.isfinite(err).all() and err[-1] < 50
