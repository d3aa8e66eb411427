"""problems/schrodinger_pinn.py: the split-step reference, the periodic model, short runs.

The 4th-order split-step solver is checked against the Satsuma--Yajima solution on a wide
domain, for conservation of mass and Hamiltonian and under refinement on the benchmark domain;
the residuals against that exact solution (zero by autograd and torch.func). The model is
periodic in ``x`` for any network and, with the hard constraint, exact at ``t = 0``. The
problem runs a few iterations at tiny sizes through the real trainer (SSBroyden with RAD;
Gauss--Newton) with finite, falling loss terms and finite metrics.
"""

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

pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated"),
              pytest.mark.usefixtures("single_thread")]  # conftest: one intra-op thread

PATH = pathlib.Path(__file__).resolve().parents[1] / "problems" / "schrodinger_pinn.py"
TINY = ["n_collocation=64", "n_initial=32", "width=8", "depth=2", "ref_modes=256",
        "ref_dt=1e-3", "rad_every=2", "rad_pool=256", "qn_iters=6", "eval_every=1",
        "checkpoint_every=100"]
make_ctx = functools.partial(helpers.make_ctx, base=TINY)


@pytest.fixture(scope="module")
def nls():
    prob, _ = load_problem(PATH)
    return prob, sys.modules[type(prob).__module__]


# ----------------------------------------------------------------------------- reference


def test_solver_matches_the_satsuma_yajima_solution(nls):
    """On [-15, 15] the periodic problem is the whole-line one (tails ~1e-6): the split-step
    solution equals the exact two-soliton breather, |h| = 4 at t = pi/4."""
    _, mod = nls
    t = np.linspace(0, np.pi / 2, 9)
    x, h = mod.nls_reference(t, n_modes=512, dt=2.5e-4, half_width=15.0)
    exact = mod.satsuma_yajima(x[:, None], t[None, :])
    assert np.abs(exact[:, 0] - 2 / np.cosh(x)).max() < 1e-14   # the formula at t = 0
    assert np.abs(h - exact).max() < 5e-6
    assert abs(np.abs(h[:, 4]).max() - 4.0) < 1e-5               # the peak at t = pi/4


def test_reference_conserves_and_converges_on_the_benchmark(nls):
    _, mod = nls
    t = np.linspace(0, np.pi / 2, 21)
    x, h = mod.nls_reference(t, n_modes=256, dt=4.6e-4)
    assert np.array_equal(h[:, 0], 2 / np.cosh(x))
    mass, ham = mod.invariants(h)
    assert mass[0] == pytest.approx(7.99927, abs=1e-5)
    assert np.abs(mass - mass[0]).max() < 1e-10
    assert np.abs(ham - ham[0]).max() < 1e-7 * abs(ham[0])
    # half the step: time converged; twice the modes: the kink at x = +-5 limits it to ~1e-5
    _, half = mod.nls_reference(t, n_modes=256, dt=2.3e-4)
    assert np.abs(half - h).max() < 2e-6
    _, fine = mod.nls_reference(t, n_modes=512, dt=2.3e-4)
    diff = np.abs(fine[::2]) - np.abs(h)
    assert np.abs(fine[::2] - h).max() < 1e-4
    assert np.linalg.norm(diff) / np.linalg.norm(np.abs(h)) < 2e-5
    # the periodic solution is not the whole-line one (tails at x = +-5: 2 sech 5 = 0.027)
    assert np.abs(np.abs(h) - np.abs(mod.satsuma_yajima(x[:, None], t))).max() > 1e-2
    with pytest.raises(ValueError, match="increasing times"):
        mod.nls_reference([0.5, 0.1], n_modes=16)


class _Exact(torch.nn.Module):
    """The Satsuma--Yajima solution as a network ``(x, t) -> (u, v)``."""

    def forward(self, p):
        x, t = p[..., 0], p[..., 1]
        den = torch.cosh(4 * x) + 4 * torch.cosh(2 * x) + 3 * torch.cos(4 * t)
        re = torch.cos(0.5 * t) * torch.cosh(3 * x) + 3 * torch.cos(4.5 * t) * torch.cosh(x)
        im = torch.sin(0.5 * t) * torch.cosh(3 * x) + 3 * torch.sin(4.5 * t) * torch.cosh(x)
        return torch.stack((4 * re / den, 4 * im / den), -1)


@pytest.mark.parametrize("backend", ["autograd", "func"])
def test_residuals_vanish_for_an_exact_solution(nls, backend):
    prob, mod = nls
    ctx = make_ctx(prob)
    x = torch.rand(200, 2, dtype=torch.float64) * torch.tensor([6.0, 1.5]) - torch.tensor(
        [3.0, 0.0])
    ctx.model = _Exact()
    with torch.no_grad():
        exact = mod.satsuma_yajima(x[:, 0].numpy(), x[:, 1].numpy())
        uv = ctx.model(x)
    assert np.abs(uv[:, 0].numpy() + 1j * uv[:, 1].numpy() - exact).max() < 1e-13
    r = prob.pde(ctx, x, backend)
    assert set(r) == {"pde_u", "pde_v"}
    assert max(float(v.detach().abs().max()) for v in r.values()) < 1e-11
    ctx.model = lambda p: _Exact()(p) * 1.01   # not a solution: the residual sees it
    assert max(float(v.detach().abs().max()) for v in prob.pde(ctx, x, backend).values()) > 1e-2


def test_reference_on_raissis_grid(nls):
    prob, mod = nls
    ctx = make_ctx(prob)
    test, exact = ctx.data["test"], ctx.data["test_exact"]
    assert test.shape == (256 * 201, 2) and exact.shape == (256 * 201, 3)
    x, t = test[:, 0].reshape(256, 201), test[:, 1].reshape(256, 201)
    assert torch.allclose(x[:, 0], -5 + 10 * torch.arange(256, dtype=torch.float64) / 256)
    assert torch.allclose(t[0], torch.linspace(0, math.pi / 2, 201, dtype=torch.float64))
    assert torch.allclose(exact[:, 0], exact[:, 1:].norm(dim=1), rtol=0, atol=1e-15)
    h = exact[:, 0].reshape(256, 201)
    assert torch.allclose(h[:, 0], 2 / torch.cosh(x[:, 0]), rtol=0, atol=1e-15)
    assert abs(float(h[:, 100].max()) - 4.0) < 1e-2                 # t = pi/4
    assert prob.target_metric == "h_rel_l2"


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("constraints", ["soft", "hard"])
def test_model_is_periodic_and_exact_at_t0_when_hard(nls, constraints):
    prob, _ = nls
    ctx = make_ctx(prob, [f"constraints={constraints}", "harmonics=2"])
    model = ctx.model
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        t = torch.rand(50, dtype=torch.float64)
        left = model(torch.stack([-5 * torch.ones_like(t), t], 1))
        right = model(torch.stack([5 * torch.ones_like(t), t], 1))
        assert (left - right).abs().max() < 1e-12 and left.abs().max() > 1e-2
        x = torch.linspace(-5, 5, 101, dtype=torch.float64)
        at0 = model(torch.stack([x, torch.zeros_like(x)], 1))
        u0 = torch.stack([2 / torch.cosh(x), torch.zeros_like(x)], 1)
        assert ((at0 - u0).abs().max() < 1e-15) == (constraints == "hard")
    terms = prob.residuals(ctx, 0)
    assert set(terms) == ({"pde_u", "pde_v"} if constraints == "hard"
                          else {"pde_u", "pde_v", "initial"})


def test_initial_term_and_its_weight(nls):
    prob, _ = nls
    ctx = make_ctx(prob, ["weight_initial=7.5", "n_initial=40"])
    pts = ctx.data["points_initial"]
    assert pts.shape == (40, 4) and (pts[:, 1] == 0).all() and (pts[:, 3] == 0).all()
    assert torch.allclose(pts[:, 0], torch.linspace(-5, 5, 41, dtype=torch.float64)[:-1])
    assert torch.allclose(pts[:, 2], 2 / torch.cosh(pts[:, 0]))
    assert ctx.data["weights"] == {"pde_u": 1.0, "pde_v": 1.0, "initial": 7.5}
    with torch.no_grad():
        r = ctx.data["conditions"]["initial"](pts)
        assert torch.allclose(r, ctx.model(pts[:, :2]) - pts[:, 2:])


def test_bad_settings_give_one_line_errors(nls):
    prob, _ = nls
    for bad, msg in ((["constraints=exact"], "constraints must be 'soft' or 'hard'"),
                     (["harmonics=0"], "harmonics must be >= 1"),
                     (["ref_modes=300"], "must be a multiple of test_nx"),
                     (["derivatives=taylor"], "derivatives must be 'autograd' or 'func'"),
                     (["n_initial=0"], "n_initial must be >= 1")):
        with pytest.raises(ValueError, match=msg) as info:
            make_ctx(prob, bad)
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- trainer


@pytest.mark.parametrize("sets", [[], ["optimizer=gauss_newton", "gn_iters=2"]],
                         ids=["ssbroyden", "gauss_newton"])
def test_a_few_iterations_through_the_trainer(tmp_path, sets):
    res = train(str(PATH), sets=TINY + sets, overrides={"iterations": 4},
                out=str(tmp_path / "run"), quiet=True)
    assert res.iterations == 4 and math.isfinite(res.final_loss)
    c = read_log(res.log_path).columns
    for k in ("pde_u", "pde_v", "initial"):
        assert np.isfinite(c[f"loss/{k}"]).all()
    assert c["loss"][-1] < 0.7 * c["loss"][0]   # (RAD redraws the points every 2)
    for k in ("h_rel_l2", "u_rel_l2", "v_rel_l2", "max_rel_l2"):
        col = c[f"metric/{k}"]
        assert np.isfinite(col[-1]) and 0 < col[-1] < 10
    assert c["metric/h_rel_l2"][-1] < c["metric/h_rel_l2"][0]
