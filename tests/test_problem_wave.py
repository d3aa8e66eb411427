"""problems/wave_pinn.py: the exact solution, the set-up, the three ansätze and short runs."""

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

PATH = pathlib.Path(__file__).resolve().parents[1] / "problems" / "wave_pinn.py"
TINY = ["n_collocation=64", "rad_pool=256", "width=16", "depth=2", "test_n=20",
        "n_initial=30", "n_boundary=30", "qn_iters=5"]


@pytest.fixture(scope="module")
def wave():
    prob, _ = load_problem(PATH)
    return prob, sys.modules[type(prob).__module__]


make_ctx = functools.partial(helpers.make_ctx, base=TINY)


def derivatives(f, p):
    """u, u_t, u_tt, u_xx of f at points p (x, t) by autograd."""
    p = p.clone().requires_grad_()
    u = f(p)
    (du,) = torch.autograd.grad(u.sum(), p, create_graph=True)
    uxx = torch.autograd.grad(du[:, 0].sum(), p, retain_graph=True)[0][:, 0]
    utt = torch.autograd.grad(du[:, 1].sum(), p)[0][:, 1]
    return u.detach(), du[:, 1].detach(), utt.detach(), uxx.detach()


def test_exact_solution_satisfies_the_wave_equation_and_conditions(wave):
    _, mod = wave
    g = torch.Generator().manual_seed(0)
    p = torch.rand(500, 2, generator=g, dtype=torch.float64)
    _, _, utt, uxx = derivatives(mod.exact, p)
    assert float(utt.abs().max()) > 100                    # the 8 pi t mode
    assert float((utt - 4 * uxx).abs().max()) < 1e-12 * float(utt.abs().max())
    assert float((utt - 1 * uxx).abs().max()) > 10         # a wrong speed is caught
    s = torch.linspace(0, 1, 101, dtype=torch.float64)
    zero, one = torch.zeros_like(s), torch.ones_like(s)
    assert float(mod.exact(torch.stack([zero, s], 1)).abs().max()) < 1e-15
    assert float(mod.exact(torch.stack([one, s], 1)).abs().max()) < 1e-14
    at0 = torch.stack([s, zero], 1)
    u0 = torch.sin(math.pi * s) + 0.5 * torch.sin(4 * math.pi * s)
    torch.testing.assert_close(mod.exact(at0), u0, rtol=0, atol=1e-15)
    torch.testing.assert_close(mod.initial_condition(s), u0, rtol=0, atol=0)
    _, ut, _, _ = derivatives(mod.exact, at0)
    assert float(ut.abs().max()) < 1e-13
    # the published form: sin(pi x) cos(2 pi t) + 0.5 sin(4 pi x) cos(8 pi t)
    q = torch.tensor([[0.3, 0.1]], dtype=torch.float64)
    want = (math.sin(0.3 * math.pi) * math.cos(0.2 * math.pi)
            + 0.5 * math.sin(1.2 * math.pi) * math.cos(0.8 * math.pi))
    assert mod.exact(q).item() == pytest.approx(want, rel=1e-14)


def test_defaults_and_reference_grid(wave):
    prob, mod = wave
    cfg = prob.config()
    assert cfg["c"] == 2.0 and cfg["test_n"] == 200
    assert cfg["optimizer"] == "ssbroyden" and cfg["dtype"] == "float64"
    assert cfg["constraints"] in mod.CONSTRAINTS
    ctx = make_ctx(prob, ["test_n=200"])
    x, u = ctx.data["test"], ctx.data["test_exact"]
    assert x.shape == (40000, 2) and u.shape == (40000, 1)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    torch.testing.assert_close(u[:, 0], mod.exact(x), rtol=0, atol=0)
    for name in ("u_rel_l2", "pde", "initial", "velocity", "boundary", "constraints",
                 "weight_initial", "weight_velocity", "weight_boundary", *mod.CONSTRAINTS):
        assert f"``{name}" in mod.__doc__ or f'``"{name}"' in mod.__doc__, name
    assert prob.published and all(p.error for p in prob.published)


@pytest.mark.parametrize("constraints,terms", [
    ("full", {"pde"}), ("hard", {"pde", "velocity"}),
    ("soft", {"pde", "initial", "velocity", "boundary"})])
def test_ansatz_and_terms(wave, constraints, terms):
    prob, mod = wave
    torch.manual_seed(2)
    ctx = make_ctx(prob, [f"constraints={constraints}", "weight_initial=3",
                               "weight_velocity=3", "weight_boundary=5"])
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.normal_()
    s = torch.linspace(0, 1, 41, dtype=torch.float64)
    zero, one = torch.zeros_like(s), torch.ones_like(s)
    u, ut, _, _ = derivatives(ctx.model, torch.stack([s, zero], 1))
    with torch.no_grad():
        sides = ctx.model(torch.cat([torch.stack([zero, s], 1), torch.stack([one, s], 1)]))
    ic_err = float((u - mod.initial_condition(s)).abs().max())
    exact_ic, exact_bc = constraints != "soft", constraints != "soft"
    assert (ic_err < 1e-15) == exact_ic
    assert (float(sides.abs().max()) < 1e-15) == exact_bc
    assert (float(ut.abs().max()) < 1e-15) == (constraints == "full")
    out = prob.residuals(ctx, 0)
    w = prob.weights(ctx)
    assert set(out) == terms
    for k in terms - {"pde"}:
        assert w[k] == (5.0 if k == "boundary" else 3.0)
    if "velocity" in terms:
        x0 = ctx.data["points_velocity"]
        assert (x0[:, 1] == 0).all()
        _, ut0, _, _ = derivatives(ctx.model, x0)
        assert float(out["velocity"]) == pytest.approx(float(ut0.pow(2).mean()), rel=1e-10)
    if "boundary" in terms:
        xb = ctx.data["points_boundary"]
        assert ((xb[:, 0] == 0) | (xb[:, 0] == 1)).all()
    # the pde term is the mean square of u_tt - c^2 u_xx at the collocation points
    x = ctx.data["collocation"].points(0)
    _, _, utt, uxx = derivatives(ctx.model, x)
    assert float(out["pde"]) == pytest.approx(float((utt - 4 * uxx).pow(2).mean()), rel=1e-10)


def test_bad_settings_give_one_line_errors(wave):
    prob, _ = wave
    for bad, msg in ((["constraints=exact"], "constraints must be one of full, hard, soft"),
                     (["test_n=1"], "test_n must be >= 2")):
        with pytest.raises(ValueError, match=msg) as info:
            make_ctx(prob, bad)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("sets,terms", [
    ([], None),
    (["constraints=soft"], {"pde", "initial", "velocity", "boundary"}),
    (["optimizer=gauss_newton", "constraints=hard"], {"pde", "velocity"}),
    (["optimizer=gauss_newton", "constraints=soft"], {"pde", "initial", "velocity",
                                                      "boundary"}),
], ids=["ssbroyden-default", "ssbroyden-soft", "gauss_newton-hard", "gauss_newton-soft"])
def test_a_few_iterations_through_the_trainer(tmp_path, sets, terms):
    res = train(str(PATH), sets=TINY + sets + ["eval_every=1"], overrides={"iterations": 6},
                out=str(tmp_path / "run"), quiet=True)
    assert res.iterations == 6 and math.isfinite(res.final_loss)
    c = read_log(res.log_path).columns
    got = {k.removeprefix("loss/") for k in c if k.startswith("loss/")}
    if terms is not None:
        assert got == terms
    for k in got:
        assert np.isfinite(c[f"loss/{k}"]).all()
    assert c["loss"][-1] < 0.98 * c["loss"][0]            # the loss falls
    err = c["metric/u_rel_l2"]
    assert np.isfinite(err).all() and err[-1] < 50
