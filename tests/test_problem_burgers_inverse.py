"""problems/burgers_inverse_pinn.py: the data, the unknown coefficients, short runs.

The observations are Cole--Hopf values (``problems/burgers_pinn.py``) at a seeded random
subset of Raissi's grid that satisfy Burgers' equation with the true coefficients (finite
differences) and not with others; the residual is checked against a manufactured solution by
every derivative backend; ``lambda1`` and ``log_lambda2`` are parameters of the model and the
metrics are their relative errors. The problem runs a few iterations at tiny sizes through
the real trainer (SSBroyden, both choices of residual points; Gauss--Newton) with finite,
falling loss terms, finite metrics and moving coefficients.
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

ROOT = pathlib.Path(__file__).resolve().parents[1] / "problems"
PATH = ROOT / "burgers_inverse_pinn.py"
TINY = ["n_data=200", "n_collocation=64", "rad_pool=256", "width=8", "depth=2", "qn_iters=3",
        "eval_every=1", "checkpoint_every=100", "quad_nodes=60"]
make_ctx = functools.partial(helpers.make_ctx, base=TINY)


@pytest.fixture(scope="module")
def inv():
    prob, _ = load_problem(PATH)
    return prob, sys.modules[type(prob).__module__]


def test_reference_is_the_forward_problems_cole_hopf(inv):
    _, mod = inv
    fwd = sys.modules[type(load_problem(ROOT / "burgers_pinn.py")[0]).__module__]
    assert mod.cole_hopf.__code__.co_code == fwd.cole_hopf.__code__.co_code
    assert mod.NU == fwd.NU == 0.01 / math.pi
    x, t = np.linspace(-1, 1, 7), np.linspace(0.1, 0.9, 5)
    assert np.array_equal(mod.cole_hopf(x[:, None], t), fwd.cole_hopf(x[:, None], t))


def test_observations_are_a_seeded_subset_that_satisfies_burgers(inv):
    _, mod = inv
    obs = mod.observations(2000, seed=0)
    xg, tg = mod.grid()
    assert obs.shape == (2000, 3) and (xg.size, tg.size) == (256, 100)
    assert np.isin(obs[:, 0], xg).all() and np.isin(obs[:, 1], tg).all()
    assert len({(a, b) for a, b, _ in obs}) == 2000                     # no repeats
    assert np.array_equal(obs, mod.observations(2000, seed=0))
    assert not np.array_equal(obs, mod.observations(2000, seed=1))
    assert np.array_equal(obs[:, 2], mod.cole_hopf(obs[:, 0], obs[:, 1], mod.NU))
    # Burgers with lambda = (1, nu) by central differences (smooth part, t > 0.05)
    keep = (np.abs(obs[:, 0]) > 0.2) & (obs[:, 1] > 0.05) & (np.abs(obs[:, 0]) < 0.95)
    x, t = obs[keep, 0], obs[keep, 1]
    h = 1e-3

    def ch(a, b):
        return mod.cole_hopf(a, b, mod.NU)

    u = ch(x, t)
    u_t = (ch(x, t + h) - ch(x, t - h)) / (2 * h)
    u_x = (ch(x + h, t) - ch(x - h, t)) / (2 * h)
    u_xx = (ch(x + h, t) - 2 * u + ch(x - h, t)) / h**2

    def res(l1, l2):
        return np.abs(u_t + l1 * u * u_x - l2 * u_xx).max()

    assert res(1.0, mod.NU) < 1e-4 * np.abs(u_t).max()
    assert res(1.0, 2 * mod.NU) > 100 * res(1.0, mod.NU)
    assert res(0.9, mod.NU) > 100 * res(1.0, mod.NU)
    with pytest.raises(ValueError, match="n_data must be in"):
        mod.observations(25601, seed=0)


class _Manufactured(torch.nn.Module):
    """``u = sin(pi x) exp(-t) + x t``: ``u_t``, ``u_x``, ``u_xx`` known in closed form."""

    def forward(self, p):
        x, t = p[..., 0], p[..., 1]
        return torch.sin(math.pi * x) * torch.exp(-t) + x * t


@pytest.mark.parametrize("backend", ["autograd", "func"])
def test_residual_formula(inv, backend):
    prob, _ = inv
    ctx = make_ctx(prob)
    with torch.no_grad():
        ctx.model.lambda1.fill_(0.7)
        ctx.model.log_lambda2.fill_(math.log(0.05))
    ctx.model.net = _Manufactured()
    x = torch.rand(50, 2, dtype=torch.float64) * torch.tensor([2.0, 1.0]) - torch.tensor(
        [1.0, 0.0])
    X, T = x[:, 0], x[:, 1]
    u = torch.sin(math.pi * X) * torch.exp(-T) + X * T
    u_t = -torch.sin(math.pi * X) * torch.exp(-T) + X
    u_x = math.pi * torch.cos(math.pi * X) * torch.exp(-T) + T
    u_xx = -math.pi**2 * torch.sin(math.pi * X) * torch.exp(-T)
    expected = u_t + 0.7 * u * u_x - 0.05 * u_xx
    assert torch.allclose(prob.pde(ctx, x, backend), expected, rtol=1e-12, atol=1e-12)


def test_taylor_residual_equals_autograd(inv):
    prob, _ = inv
    ctx = make_ctx(prob, seed=0)
    with torch.no_grad():
        ctx.model.lambda1.fill_(0.4)
    x = ctx.data["collocation"].points(0)
    assert torch.allclose(prob.pde(ctx, x, "taylor"), prob.pde(ctx, x, "autograd"),
                          rtol=1e-10, atol=1e-13)


def test_unknowns_are_model_parameters_and_metrics_are_their_errors(inv):
    prob, mod = inv
    ctx = make_ctx(prob)
    m = ctx.model
    names = dict(m.named_parameters())
    assert names["lambda1"] is m.lambda1 and names["log_lambda2"] is m.log_lambda2
    assert float(m.lambda1.detach()) == 0.0
    assert float(m.lambda2.detach()) == pytest.approx(math.exp(-6))
    out = prob.evaluate(ctx)
    assert out["lambda1_error"] == 1.0
    assert out["lambda2_error"] == pytest.approx(abs(math.exp(-6) - mod.NU) / mod.NU)
    with torch.no_grad():
        m.lambda1.fill_(1.002)
        m.log_lambda2.fill_(math.log(mod.NU * 0.99))
    out = prob.evaluate(ctx)
    assert out["lambda1_error"] == pytest.approx(0.002)
    assert out["lambda2_error"] == pytest.approx(0.01)
    assert out["lambda2"] == pytest.approx(mod.NU * 0.99)
    assert set(out) == {"u_rel_l2", "lambda1", "lambda2", "lambda1_error", "lambda2_error"}
    assert prob.target_metric == "lambda2_error"
    assert prob.config()["n_data"] == 2000


def test_residual_points_and_data_term(inv):
    prob, _ = inv
    ctx = make_ctx(prob, ["weight_data=3.0", "pde_points=data", "rad_every=0"])
    obs = torch.as_tensor(ctx.observations)
    assert torch.equal(ctx.data["collocation"].points(0), obs[:, :2])   # Raissi: the data
    assert torch.equal(ctx.data["points_data"], obs)
    assert ctx.data["weights"] == {"pde": 1.0, "data": 3.0}
    with torch.no_grad():
        r = ctx.data["conditions"]["data"](obs)
        assert torch.allclose(r, ctx.model(obs[:, :2]) - obs[:, 2])
    ctx = make_ctx(prob, ["pde_points=collocation", "n_collocation=50", "rad_every=5"])
    pts = ctx.data["collocation"].points(0)
    assert pts.shape == (50, 2) and not np.isin(pts[:, 1].numpy(), obs[:, 1].numpy()).all()
    for bad, msg in ((["pde_points=grid"], "pde_points must be 'data' or 'collocation'"),
                     (["pde_points=data"], "set rad_every=0")):
        with pytest.raises(ValueError, match=msg) as info:
            make_ctx(prob, bad)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("sets", [
    ["pde_points=data", "rad_every=0"],
    ["rad_every=2"],
    ["optimizer=gauss_newton", "gn_iters=2"],
], ids=["ssbroyden-data", "ssbroyden-rad", "gauss_newton"])
def test_a_few_iterations_through_the_trainer(tmp_path, sets):
    res = train(str(PATH), sets=TINY + sets, overrides={"iterations": 4},
                out=str(tmp_path / "run"), quiet=True)
    assert res.iterations == 4 and math.isfinite(res.final_loss)
    c = read_log(res.log_path).columns
    for k in ("pde", "data"):
        assert np.isfinite(c[f"loss/{k}"]).all()
    assert c["loss"][-1] < 0.5 * c["loss"][0]
    for k in ("u_rel_l2", "lambda1_error", "lambda2_error"):
        assert np.isfinite(c[f"metric/{k}"]).all()
    assert c["metric/lambda1"][-1] != 0.0                               # trained
    assert c["metric/lambda2"][-1] != pytest.approx(math.exp(-6), rel=1e-9)
    assert c["metric/u_rel_l2"][-1] < c["metric/u_rel_l2"][0]
