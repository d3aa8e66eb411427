"""problems/poisson_lshape_pinn.py: the finite-difference reference (its equation and its
h^(4/3) convergence), the exact singular solution, points in the L-shape and on its six
edges, the hard ansatz, and short runs through the trainer (SSBroyden and Gauss-Newton)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch

from deepsolve.io.h5log import read_log
from deepsolve.pinn import FNN
from deepsolve.problem import Context, apply_overrides, load_problem
from deepsolve.train import train

pytestmark = pytest.mark.usefixtures("single_thread")

PATH = Path(__file__).resolve().parents[1] / "problems" / "poisson_lshape_pinn.py"
TINY = ["n_collocation=64", "n_boundary=48", "width=6", "depth=2", "ref_n=8", "eval_every=1",
        "rad_every=0", "qn_iters=3"]


@pytest.fixture(scope="module")
def mod():
    prob, _ = load_problem(PATH)
    return prob, sys.modules[type(prob).__module__]


def test_fd_reference_solves_the_discrete_problem(mod):
    x, u = mod[1].lshape_fd(16)
    h = x[1] - x[0]
    X, Y = np.meshgrid(x, x, indexing="ij")
    outside = (X > 0) & (Y > 0)
    assert np.abs(u[outside]).max() == 0 and np.abs(u[[0, -1], :]).max() == 0
    assert np.abs(u[:, [0, -1]]).max() == 0
    assert np.abs(u[16, 16:]).max() == 0 and np.abs(u[16:, 16]).max() == 0  # re-entrant edges
    lap = (u[2:, 1:-1] + u[:-2, 1:-1] + u[1:-1, 2:] + u[1:-1, :-2] - 4 * u[1:-1, 1:-1]) / h**2
    interior = ~((X[1:-1, 1:-1] >= 0) & (Y[1:-1, 1:-1] >= 0))
    np.testing.assert_allclose(-lap[interior], 1.0, atol=1e-9)
    assert (u[1:-1, 1:-1][interior] > 0).all()


def test_fd_reference_converges_at_rate_four_thirds(mod):
    fd = mod[1].lshape_fd
    u = {n: fd(n)[1] for n in (8, 16, 32, 64)}
    d = [np.abs(u[2 * n][:: 2 * n // 8, :: 2 * n // 8] - u[n][:: n // 8, :: n // 8]).max()
         for n in (8, 16, 32)]
    for a, b in zip(d[:-1], d[1:], strict=True):
        assert 2.2 < a / b < 2.9, d  # 2^(4/3) = 2.52
    # extrapolation with that rate: 16/32 and 32/64 agree far better than the grids do
    p = mod[1].P43
    r1 = (p * u[32][::2, ::2] - u[16])[::2, ::2] / (p - 1)
    r2 = (p * u[64][::2, ::2] - u[32])[::4, ::4] / (p - 1)
    assert np.abs(r1 - r2).max() < 0.2 * d[2]


def test_singular_solution_is_harmonic_and_vanishes_on_the_corner_edges(mod):
    m = mod[1]
    torch.manual_seed(0)
    pts = torch.rand(400, 2, dtype=torch.float64) * 2 - 1
    pts = pts[m.inside(pts) & (pts.norm(dim=1) > 0.1)].requires_grad_(True)
    u = m.singular_solution(pts)
    (g,) = torch.autograd.grad(u.sum(), pts, create_graph=True)
    lap = sum(torch.autograd.grad(g[:, i].sum(), pts, retain_graph=True)[0][:, i]
              for i in range(2))
    assert lap.abs().max() < 1e-10 and u.detach().abs().max() > 0.5
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    z = torch.zeros_like(t)
    assert m.singular_solution(torch.stack([t, z], 1)).abs().max() < 1e-12
    assert m.singular_solution(torch.stack([z, t], 1)).abs().max() < 1e-12
    # on the negative x axis (phi = pi/2): r^(2/3) sin(pi/3)
    v = m.singular_solution(torch.tensor([[-0.5, 0.0]], dtype=torch.float64))
    assert float(v) == pytest.approx(0.5 ** (2 / 3) * math.sin(math.pi / 3), rel=1e-14)


def test_interior_and_boundary_points(mod):
    prob, m = mod
    ctx = helpers.make_ctx(prob, ["constraints=soft"], base=TINY)
    x = prob.sample(ctx, 500, 3)
    assert x.shape == (500, 2) and bool(m.inside(x).all())
    assert (x.abs() <= 1).all() and ((x[:, 0] < 0) & (x[:, 1] < 0)).any()
    np.testing.assert_array_equal(x, prob.sample(ctx, 500, 3))  # deterministic
    assert not torch.equal(x, prob.sample(ctx, 500, 4))
    pts = ctx.data["points_bc"]
    assert pts.shape == (48, 3) and (pts[:, 2] == 0).all()
    xb = pts[:, :2]
    edges = [(xb[:, 1] == 0) & (xb[:, 0] >= 0), xb[:, 0] == 1, xb[:, 1] == -1, xb[:, 0] == -1,
             xb[:, 1] == 1, (xb[:, 0] == 0) & (xb[:, 1] >= 0)]
    counts = [int(e.sum()) for e in edges]
    assert all(c >= 5 for c in counts) and counts[2] > counts[1]  # length 2 against 1
    on_some = torch.stack(edges).any(0)
    assert bool(on_some.all())
    ctx = helpers.make_ctx(prob, ["constraints=soft", "variant=singular"], base=TINY)
    pts = ctx.data["points_bc"]
    np.testing.assert_allclose(pts[:, 2], m.singular_solution(pts[:, :2]), atol=1e-15)
    assert pts[:, 2].abs().max() > 0.5


def test_hard_ansatz_vanishes_on_all_six_edges(mod):
    m = mod[1]
    torch.manual_seed(1)
    net = FNN(2, 1, 8, 2, lo=(-1.0, -1.0), hi=(1.0, 1.0), scalar=True).double()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
        model = m.HardLShape(net)
        t = torch.rand(30, 1, dtype=torch.float64)
        for a, b in m.EDGES:
            a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
            assert model(a + t * (b - a)).abs().max() < 1e-15
        inner = torch.tensor([[-0.5, -0.5], [-0.5, 0.5], [0.5, -0.5]], dtype=torch.float64)
        assert model(inner).abs().min() > 1e-4


def test_reference_points_and_terms(mod):
    prob, m = mod
    ctx = helpers.make_ctx(prob, base=TINY)
    test, exact = ctx.data["test"], ctx.data["test_exact"]
    assert bool(m.inside(test).all()) and exact.shape == (test.shape[0], 1)
    assert test.shape[0] == 9 * 9 - 4 * 4 + 0 and exact.max() > 0.1
    assert set(prob.residuals(ctx, 0)) == {"pde", "bc"}
    ctx = helpers.make_ctx(prob, ["constraints=hard"], base=TINY)
    assert set(prob.residuals(ctx, 0)) == {"pde"}


def test_bad_settings_fail_with_one_line(mod):
    prob, _ = mod
    for bad, msg in ((["variant=circle"], "variant must be one of"),
                     (["constraints=exact"], "constraints must be one of"),
                     (["variant=singular", "constraints=hard"], "needs variant = 'deepxde'"),
                     (["ref_n=7"], "ref_n must be an even")):
        cfg = apply_overrides(prob.config(), TINY + bad)
        with pytest.raises(ValueError, match=msg):
            prob.build(Context(cfg, torch.device("cpu"), torch.float64))


@pytest.mark.parametrize("sets", [[], ["constraints=hard"], ["variant=singular"]],
                         ids=["soft", "hard", "singular"])
def test_a_few_iterations_through_the_trainer(tmp_path, sets):
    res = train(str(PATH), sets=TINY + sets, overrides={"iterations": 6},
                out=str(tmp_path / "run"), quiet=True)
    log = read_log(res.log_path)
    loss = log.columns["loss"]
    assert np.isfinite(loss).all() and loss[-1] < loss[0]
    assert math.isfinite(log.columns["metric/u_rel_l2"][-1])


def test_gauss_newton_run(tmp_path):
    res = train(str(PATH), sets=TINY + ["optimizer=gauss_newton"],
                overrides={"iterations": 3}, out=str(tmp_path / "run"), quiet=True)
    loss = read_log(res.log_path).columns["loss"]
    assert np.isfinite(loss).all() and loss[-1] < loss[0]
