"""Pointwise residual weights (deepsolve/pinn/attention.py): the update against its closed
form, the tilts of both potentials, weighted residuals whose gradients and Gauss–Newton
Jacobians are those of lambda_i * r_i (torch.func.jacrev), chunking, restart state, and a
Burgers PINN trained with them through the trainer."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from deepsolve.pinn import (
    ChunkedResidual,
    LeastSquaresTerm,
    ResidualAttention,
    least_squares_loss,
    residual_jacobian,
)
from deepsolve.pinn.gauss_newton import GaussNewton

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")]

BURGERS = pathlib.Path(__file__).resolve().parents[1] / "problems" / "burgers_pinn.py"


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 1)).double()


def _laplace_residual(net):
    """r = u_xx + u_yy + u - 1 (derivatives in the points: autograd)."""
    def fn(x):
        x = x.detach().requires_grad_(True) if not x.requires_grad else x
        u = net(x).squeeze(-1)
        g = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        lap = sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i]
                  for i in range(2))
        return lap + u - 1.0
    return fn


def test_update_follows_its_closed_form():
    x = torch.rand(7, 2, dtype=torch.float64)
    r = torch.tensor([0.1, -2.0, 0.5, 0.0, 1.0, -0.25, 2.0], dtype=torch.float64)
    att = ResidualAttention("linear", gamma=0.9, eta=0.05)
    for _ in range(12):
        w = att.update(x, r)
    q = r.abs() / 2.0
    want = 0.9**12 + 0.05 * q * (1 - 0.9**12) / (1 - 0.9)
    torch.testing.assert_close(w, want)
    assert att.updates == 12


def test_tilts_of_both_potentials():
    r = torch.tensor([1.0, -4.0, 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(ResidualAttention("linear").tilt(r), r.abs() / 4)
    q = ResidualAttention("exponential", temperature=0.25).tilt(r)
    want = torch.softmax(r.abs() / 4 / 0.25, 0)
    torch.testing.assert_close(q, want / want.max())     # a softmax scaled to max 1
    assert q.max() == 1.0 and q[1] == 1.0
    # a lower temperature concentrates the weight on the largest residual
    cold = ResidualAttention("exponential", temperature=0.05).tilt(r)
    assert cold[2] < q[2] and cold[0] < q[0]
    # vector residuals: by the norm of each point's components
    rv = torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(ResidualAttention("linear").tilt(rv),
                               torch.tensor([1.0, 0.2], dtype=torch.float64))
    # all-zero residuals: no tilt
    assert torch.equal(ResidualAttention("linear").tilt(torch.zeros(3)), torch.ones(3))


def test_a_new_point_set_starts_at_one_and_step_updates_once_per_iteration():
    net = _net()
    fn = _laplace_residual(net)
    x = torch.rand(16, 2, dtype=torch.float64)
    att = ResidualAttention("linear", gamma=0.5, eta=1.0)
    p1 = att.step(fn, x, iteration=0)
    p2 = att.step(fn, x, iteration=0)     # the line search's second evaluation
    assert att.updates == 1 and torch.equal(p1, p2)
    assert p1.shape == (16, 3) and torch.equal(p1[:, :2], x)
    att.step(fn, x, iteration=1)
    assert att.updates == 2
    y = torch.rand(16, 2, dtype=torch.float64)     # RAD / resampling: a new set
    assert torch.equal(att.attach(y)[:, 2], torch.ones(16, dtype=torch.float64))
    assert att.updates == 0
    att.step(fn, y, iteration=4, every=3)          # not due: 4 % 3 != 0
    assert att.updates == 0


def test_weighted_loss_gradient_is_that_of_lambda_times_r():
    net = _net(1)
    fn = _laplace_residual(net)
    x = torch.rand(40, 2, dtype=torch.float64)
    att = ResidualAttention("exponential", gamma=0.9, eta=0.3, temperature=0.3)
    for it in range(3):
        att.step(fn, x, it)
    lam = att.weights.clone()
    pts = att.attach(x)
    params = list(net.parameters())
    # chunked (two chunks, recomputed in the backward) against the plain weighted loss
    chunked = ChunkedResidual(ResidualAttention.weighted(fn), params=params, chunk_size=15)
    g1 = torch.autograd.grad(chunked(pts), params)
    g2 = torch.autograd.grad((lam * fn(x)).pow(2).mean(), params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_gauss_newton_jacobian_of_weighted_residuals_is_exact():
    """The Jacobian the Gauss–Newton path builds for lambda_i r_i (torch.func, one chunk of
    rows at a time) against torch.func.jacrev of the weighted residual vector."""
    net = _net(2)

    def u_fn(x):   # a residual in the values (no input derivatives): u(x) - sin(x0) x1
        return net(x).squeeze(-1) - torch.sin(x[:, 0]) * x[:, 1]

    x = torch.rand(25, 2, dtype=torch.float64)
    att = ResidualAttention("linear", gamma=0.0, eta=1.0)
    att.update(x, u_fn(x).detach())
    pts = att.attach(x)
    term = LeastSquaresTerm(ResidualAttention.weighted(u_fn), pts, 0.5)
    r, J = residual_jacobian(net, [term], chunk_rows=7)
    names = [n for n, _ in net.named_parameters()]
    theta = {n: p.detach() for n, p in net.named_parameters()}

    def scaled(params):
        out = torch.func.functional_call(net, params, (x,)).squeeze(-1)
        return math.sqrt(0.5 / 25) * att.weights * (out - torch.sin(x[:, 0]) * x[:, 1])

    jac = torch.func.jacrev(scaled)(theta)
    want = torch.cat([jac[n].reshape(25, -1) for n in names], 1)
    torch.testing.assert_close(r, scaled(theta))
    torch.testing.assert_close(J, want)
    torch.testing.assert_close(r.pow(2).sum(), least_squares_loss([term]))


def test_gauss_newton_with_attention_reaches_a_known_minimum():
    """A linear model fitted to exactly representable data: weighted least squares has the
    same minimiser whatever the (positive) weights, so Levenberg–Marquardt on lambda_i r_i
    reaches it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    a_true, b_true = torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64), 0.75
    x = torch.rand(60, 3, dtype=torch.float64)
    y = x @ a_true + b_true
    att = ResidualAttention("exponential", gamma=0.5, eta=1.0, temperature=0.2)

    def res(p):
        return model(p).squeeze(-1) - (p @ a_true + b_true)

    att.update(x, res(x).detach())
    opt = GaussNewton(model.parameters(), model,
                      lambda: [LeastSquaresTerm(ResidualAttention.weighted(res), att.attach(x))],
                      max_iter=5)

    def closure():
        opt.zero_grad()
        loss = least_squares_loss([LeastSquaresTerm(ResidualAttention.weighted(res),
                                                    att.attach(x))])
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    torch.testing.assert_close(model.weight.detach().squeeze(0), a_true, atol=1e-8, rtol=0)
    assert abs(float(model.bias.detach()) - b_true) < 1e-8
    assert float((model(x).squeeze(-1) - y).abs().max().detach()) < 1e-8


def test_state_dict_round_trip():
    x = torch.rand(5, 2)
    att = ResidualAttention("linear")
    att.update(x, torch.arange(5.0))
    att.iteration = 3
    other = ResidualAttention("linear")
    other.load_state_dict(att.state_dict())
    assert torch.equal(other.weights, att.weights) and other.iteration == 3
    assert torch.equal(other.attach(x), att.attach(x))   # the same set keeps its weights


@pytest.mark.parametrize("kwargs,match", [
    ({"potential": "cubic"}, "potential='cubic' is not one of linear, exponential"),
    ({"gamma": 1.0}, r"gamma=1.0 must be in \[0, 1\)"),
    ({"eta": 0.0}, "eta=0.0 must be a finite number > 0"),
    ({"potential": "exponential", "temperature": -1}, "temperature=-1"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResidualAttention(**kwargs)


def test_update_refuses_mismatched_residuals():
    att = ResidualAttention()
    with pytest.raises(ValueError, match="3 residuals for 4 points"):
        att.update(torch.rand(4, 2), torch.rand(3))


@pytest.mark.parametrize("potential,optimizer", [("linear", "ssbroyden"),
                                                 ("exponential", "gauss_newton")])
def test_burgers_with_attention_through_the_trainer(tmp_path, potential, optimizer):
    """A few iterations of the Burgers PINN with attention: the loss falls, the weights are
    in the restart file, and a resumed run continues from them."""
    from deepsolve.io import read_log
    from deepsolve.train import train

    sets = {"n_collocation": 128, "width": 8, "depth": 2, "quad_nodes": 60, "compile": False,
            "optimizer": optimizer, "qn_iters": 5, "gn_iters": 2, "rad_every": 0,
            "attention": potential, "attention_gamma": 0.9, "attention_eta": 0.5,
            "eval_every": 2, "time_limit": 0}
    out = str(tmp_path / "run")
    train(str(BURGERS), overrides={**sets, "iterations": 6, "checkpoint_every": 3}, out=out,
          quiet=True)
    log = read_log(f"{out}/log.h5")
    # the weighted loss moves with its weights: the error against Cole-Hopf must fall
    before = float(log.attrs["initial_metrics"]["u_rel_l2"])
    assert log.columns["metric/u_rel_l2"][-1] < 0.8 * before
    state = torch.load(f"{out}/restart.pt", weights_only=True)["problem"]["attention"]
    w = state["weights"]
    assert state["updates"] == 6 and w.shape == (128,) and float(w.min()) >= 0
    assert float(w.max() - w.min()) > 0     # the weights moved apart
    res = train(str(BURGERS), overrides={**sets, "iterations": 8}, out=out, resume=True,
                quiet=True)
    assert res.iterations == 8
    state2 = torch.load(f"{out}/restart.pt", weights_only=True)["problem"]["attention"]
    assert state2["updates"] == 8   # resumed from the 6 updates, not started over
