"""problems/burgers_pinn.py and problems/navier_stokes_pinn.py: references and short runs.

The Cole--Hopf reference is checked against the PDE by finite differences and against its
initial and boundary conditions; the Kovasznay solution by autograd. Both problems are
loaded and trained for a few iterations at tiny sizes through the real trainer (Adam, then
L-BFGS) with finite named loss terms and the documented metric keys.
"""

from __future__ import annotations

import math
import pathlib
import shutil
import sys

import helpers
import numpy as np
import pytest
import torch

from deepsolve.io.h5log import read_log
from deepsolve.pinn import OPTIMIZERS
from deepsolve.problem import Context, apply_overrides, load_problem
from deepsolve.train import train

pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated"),
              pytest.mark.usefixtures("single_thread")]  # conftest: one intra-op thread

ROOT = pathlib.Path(__file__).resolve().parents[1] / "problems"
BURGERS = ROOT / "burgers_pinn.py"
KOVASZNAY = ROOT / "navier_stokes_pinn.py"


def module_of(path):
    prob, _ = load_problem(path)
    return prob, sys.modules[type(prob).__module__]


# ----------------------------------------------------------------------------- Cole-Hopf


@pytest.fixture(scope="module")
def burgers():
    return module_of(BURGERS)


def fd_residual(ch, x, t, nu, hx, ht):
    u = ch(x, t)
    u_t = (ch(x, t + ht) - ch(x, t - ht)) / (2 * ht)
    up, um = ch(x + hx, t), ch(x - hx, t)
    u_x = (up - um) / (2 * hx)
    u_xx = (up - 2 * u + um) / hx**2
    return u_t + u * u_x - nu * u_xx, np.abs(u_t) + np.abs(u * u_x) + np.abs(nu * u_xx)


def test_cole_hopf_satisfies_burgers(burgers):
    _, mod = burgers
    nu = mod.NU
    # smooth part of the domain: central differences with h = 1e-3 (error ~ h^2 u''')
    x, t = np.meshgrid(np.linspace(-0.95, 0.95, 39), np.linspace(0.05, 0.95, 19))
    keep = np.abs(x) > 0.15
    res, scale = fd_residual(mod.cole_hopf, x[keep], t[keep], nu, 1e-3, 1e-3)
    assert np.abs(res).max() < 2e-4 * scale.max()
    # the steep front at x = 0 (slope ~ -150): smaller steps, residual relative to the terms
    x, t = np.meshgrid(np.linspace(-0.02, 0.02, 21), np.linspace(0.4, 0.95, 12))
    res, scale = fd_residual(mod.cole_hopf, x, t, nu, 2e-5, 1e-5)
    assert np.abs(res).max() < 1e-4 * scale.max()
    assert scale.max() > 50          # the front really is steep there


def test_cole_hopf_initial_and_boundary_conditions(burgers):
    _, mod = burgers
    x = np.linspace(-1, 1, 101)
    assert np.array_equal(mod.cole_hopf(x, 0.0), -np.sin(np.pi * x))
    np.testing.assert_allclose(mod.cole_hopf(x, 1e-7), -np.sin(np.pi * x), atol=1e-5)
    t = np.linspace(0.01, 1.0, 50)
    assert np.abs(mod.cole_hopf(-1.0, t)).max() < 1e-12
    assert np.abs(mod.cole_hopf(1.0, t)).max() < 1e-12
    # odd in x, converged in the number of quadrature nodes
    u = mod.cole_hopf(x[:, None], t[None, :])
    np.testing.assert_allclose(u, -mod.cole_hopf(-x[:, None], t[None, :]), atol=1e-12)
    np.testing.assert_allclose(u, mod.cole_hopf(x[:, None], t[None, :], nodes=400), atol=1e-12)
    with pytest.raises(ValueError, match="t >= 0"):
        mod.cole_hopf(0.0, -1.0)


def test_kovasznay_solution_solves_navier_stokes():
    prob, mod = module_of(KOVASZNAY)
    re = 20.0
    xy = torch.rand(50, 2, dtype=torch.float64, requires_grad=True)
    uvp = mod.kovasznay(xy, re)
    grads = [torch.autograd.grad(uvp[:, c].sum(), xy, create_graph=True)[0] for c in range(3)]

    def lap(c):
        return sum(torch.autograd.grad(grads[c][:, i].sum(), xy, retain_graph=True)[0][:, i]
                   for i in range(2))

    u, v = uvp[:, 0], uvp[:, 1]
    mx = u * grads[0][:, 0] + v * grads[0][:, 1] + grads[2][:, 0] - lap(0) / re
    my = u * grads[1][:, 0] + v * grads[1][:, 1] + grads[2][:, 1] - lap(1) / re
    div = grads[0][:, 0] + grads[1][:, 1]
    for r in (mx, my, div):
        assert r.abs().max() < 1e-12


# ----------------------------------------------------------------------------- problems

TINY_NS = ["n_interior=64", "n_boundary=40", "width=8", "depth=2", "test_grid=11",
           "compile=false", "adam_iterations=3", "lbfgs_iters=3", "eval_every=2",
           "optimizer=adam+lbfgs", "dtype=float32", "switch_at=1000", "constraints=soft"]
TINY_BURGERS = ["n_collocation=64", "n_data=30", "width=8", "depth=2", "adam_iterations=3",
                "lbfgs_iters=3", "eval_every=2", "quad_nodes=60", "compile=false",
                "constraints=soft", "optimizer=adam+lbfgs", "dtype=float32",
                "switch_at=1000", "rad_every=0"]
CASES = [
    (KOVASZNAY, TINY_NS, {"momentum_x", "momentum_y", "continuity", "bc_u", "bc_v", "bc_p"},
     {"u_rel_l2", "v_rel_l2", "p_rel_l2", "max_rel_l2"}),
    (BURGERS, TINY_BURGERS, {"pde", "initial", "boundary"}, {"u_rel_l2", "u_max_error"}),
]


@pytest.mark.parametrize("path,tiny,terms,metrics", CASES, ids=["kovasznay", "burgers"])
def test_defaults_and_documented_keys(path, tiny, terms, metrics):
    prob, mod = module_of(path)
    cfg = prob.config()
    for key in ("iterations", "adam_iterations", "lbfgs_iters", "derivatives", "weighting",
                "sampling", "residual_budget", "resample_every", "rar_every"):
        assert key in cfg
    assert cfg["optimizer"] in OPTIMIZERS and cfg["iterations"] > cfg["warmup"]
    assert set(mod.TERMS) == terms and set(mod.METRICS) == metrics
    doc = mod.__doc__
    for name in terms | metrics:
        assert f"``{name}``" in doc


def test_hard_constraints_hold_exactly_for_any_network(burgers):
    """u = -sin(pi x) + t (1 - x^2) N(x, t): the initial and boundary values are exact."""
    _, mod = burgers
    torch.manual_seed(1)
    net = mod.FNN(2, 1, 8, 2, lo=(-1.0, 0.0), hi=(1.0, 1.0), scalar=True).double()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()  # far from zero output
        model = mod.HardConstrained(net)
        x = torch.linspace(-1, 1, 101, dtype=torch.float64)
        t = torch.rand(101, dtype=torch.float64)
        at0 = model(torch.stack([x, torch.zeros_like(x)], 1))
        assert (at0 + torch.sin(math.pi * x)).abs().max() < 1e-15
        for side in (-1.0, 1.0):
            edge = model(torch.stack([torch.full_like(t, side), t], 1))
            assert edge.abs().max() < 1e-15
        inner = model(torch.stack([0.3 * x, 0.5 + 0.4 * t], 1))
        assert (inner + torch.sin(math.pi * 0.3 * x)).abs().max() > 1e-2  # N matters inside


def test_hard_constraints_through_the_trainer(tmp_path):
    tiny = [s for s in TINY_BURGERS if not s.startswith("constraints=")]
    res = train(str(BURGERS), sets=tiny + ["constraints=hard"], overrides={"iterations": 5},
                out=str(tmp_path / "run"), quiet=True)
    log = read_log(res.log_path)
    assert log.n_rows == 5 and np.isfinite(log.columns["loss/pde"]).all()
    assert "loss/initial" not in log.columns and "loss/boundary" not in log.columns
    assert np.isfinite(log.columns["metric/u_rel_l2"][-1])
    prob, _ = load_problem(BURGERS)
    for bad, msg in ((["constraints=hard", "derivatives=taylor"], "needs derivatives"),
                     (["constraints=exact"], "constraints must be 'soft' or 'hard'")):
        cfg = apply_overrides(prob.config(), tiny + bad)
        with pytest.raises(ValueError, match=msg):
            prob.build(Context(cfg, torch.device("cpu"), torch.float32))


def test_burgers_odd_symmetry(tmp_path):
    """symmetry=odd: u(-x, t) = -u(x, t) for any weights, the points on x >= 0, the residual
    odd too, the model the ansatz around (N(x, t) - N(-x, t))/2; through the trainer the loss
    falls; a bad value is refused."""
    prob, _ = module_of(BURGERS)
    tiny = [s for s in TINY_BURGERS if not s.startswith("constraints=")]
    cfg = apply_overrides(prob.config(), tiny + ["constraints=hard", "symmetry=odd",
                                                 "dtype=float64"])
    ctx = Context(cfg, torch.device("cpu"), torch.float64)
    torch.manual_seed(0)
    prob.build(ctx)
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.normal_()
    x = ctx.data["collocation"].points(0)
    assert x[:, 0].min() >= 0 and x[:, 0].max() > 0.5
    mirror = x * torch.tensor([-1.0, 1.0], dtype=x.dtype)
    with torch.no_grad():
        assert (ctx.model(mirror) + ctx.model(x)).abs().max() < 1e-14
        assert (ctx.model(x) + torch.sin(math.pi * x[:, 0])).abs().max() > 1e-2
    torch.testing.assert_close(prob.pde(ctx, mirror), -prob.pde(ctx, x), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(prob.pde(ctx, x, "func"), prob.pde(ctx, x), rtol=1e-12,
                               atol=1e-12)   # Gauss-Newton's path
    fnn = ctx.model.net.net
    with torch.no_grad():
        n_odd = 0.5 * (fnn(x) - fnn(mirror))
        want = -torch.sin(math.pi * x[:, 0]) + x[:, 1] * (1 - x[:, 0] ** 2) * n_odd
        torch.testing.assert_close(ctx.model(x), want, rtol=1e-13, atol=1e-13)
    res = train(str(BURGERS), sets=tiny + ["constraints=hard", "symmetry=odd",
                                           "optimizer=ssbroyden", "qn_iters=20", "warmup=0",
                                           "dtype=float64", "switch_at=-1"],
                overrides={"iterations": 6}, out=str(tmp_path / "odd"), quiet=True)
    c = read_log(res.log_path).columns
    assert c["loss"][-1] < 0.05 * c["loss"][0] and np.isfinite(c["metric/u_rel_l2"][-1])
    # the output bias cancels in N(x) - N(-x): its gradient is zero (to round-off)
    loss = prob.pde(ctx, x).pow(2).mean()
    bias_grad, weight_grad = torch.autograd.grad(loss, [fnn.layers[-1].bias,
                                                        fnn.layers[-1].weight])
    scale = float(weight_grad.abs().max())
    assert scale > 1e-3 and float(bias_grad.abs().max()) < 1e-12 * scale
    cfg = apply_overrides(prob.config(), tiny + ["constraints=hard", "symmetry=even"])
    with pytest.raises(ValueError, match="symmetry must be 'none' or 'odd'"):
        prob.build(Context(cfg, torch.device("cpu"), torch.float64))


def kovasznay_context(extra, dtype=torch.float64):
    prob, mod = module_of(KOVASZNAY)
    cfg = apply_overrides(prob.config(), TINY_NS + ["dtype=float64"] + extra)
    ctx = Context(cfg, torch.device("cpu"), dtype)
    torch.manual_seed(0)
    prob.build(ctx)
    return prob, mod, ctx


def test_kovasznay_hard_constraints_hold_exactly_for_any_network():
    """The ansatz (transfinite lift, bubble factor; p from the outflow): u, v equal the exact
    solution on the whole boundary and p on the outflow, whatever the network's weights, and
    the Taylor-mode residuals equal torch.func's."""
    prob, mod, ctx = kovasznay_context(["constraints=hard"])
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.normal_()  # far from zero output
    xb = ctx.data["xb"]
    exact = mod.kovasznay(xb, 20.0)
    with torch.no_grad():
        pred = ctx.model(xb)
        inside = ctx.model(ctx.data["test"])
    assert (pred[:, :2] - exact[:, :2]).abs().max() < 1e-13
    out = ctx.data["outflow"]
    assert out.sum() > 10 and (pred[out, 2] - exact[out, 2]).abs().max() < 1e-13
    assert (inside - ctx.data["test_exact"]).abs().max() > 1e-2  # the network matters inside
    x = ctx.data["interior"].points(0)
    taylor, func = prob.pde(ctx, x, "taylor"), prob.pde(ctx, x, "func")
    for k in mod.PDE_TERMS:
        torch.testing.assert_close(taylor[k], func[k], rtol=1e-10, atol=1e-12)


def test_kovasznay_hard_constraints_through_the_trainer(tmp_path):
    """Only the three PDE terms are logged and weighted; Gauss–Newton's residual vector is
    the trainer's loss (it checks that at its first step) and the loss falls."""
    for opt in (["optimizer=ssbroyden", "qn_iters=4"], ["optimizer=gauss_newton"]):
        res = train(str(KOVASZNAY), sets=TINY_NS + opt + ["constraints=hard", "dtype=float64",
                                                          "switch_at=-1", "warmup=2"],
                    overrides={"iterations": 6}, out=str(tmp_path / opt[0]), quiet=True)
        c = read_log(res.log_path).columns
        assert not any(k.startswith("loss/bc_") for k in c)
        total = sum(c[f"loss/{k}"] for k in ("momentum_x", "momentum_y", "continuity"))
        np.testing.assert_allclose(c["loss"], total, rtol=1e-10)
        assert c["loss"][-1] < 0.5 * c["loss"][1]
        assert np.isfinite(c["metric/max_rel_l2"][-1])
    prob, _ = load_problem(KOVASZNAY)
    cfg = apply_overrides(prob.config(), TINY_NS + ["constraints=exact"])
    with pytest.raises(ValueError, match="constraints must be 'soft' or 'hard'"):
        prob.build(Context(cfg, torch.device("cpu"), torch.float32))


@pytest.mark.parametrize("path,tiny,terms,metrics", CASES, ids=["kovasznay", "burgers"])
def test_a_few_iterations_through_the_trainer(tmp_path, path, tiny, terms, metrics):
    res = train(str(path), sets=tiny, overrides={"iterations": 5}, out=str(tmp_path / "run"),
                quiet=True)
    assert res.iterations == 5 and math.isfinite(res.final_loss)
    log = read_log(res.log_path)
    assert log.n_rows == 5
    for k in terms:
        col = log.columns[f"loss/{k}"]
        assert np.isfinite(col).all()
    for k in metrics:
        col = log.columns[f"metric/{k}"]
        assert np.isfinite(col[-1]) and 0 <= col[-1] < 1e3
    lr = log.columns["lr"]
    assert lr[0] == pytest.approx(1e-3) and lr[-1] == pytest.approx(1.0)  # Adam, then L-BFGS


@pytest.mark.parametrize("path,tiny", [(KOVASZNAY, TINY_NS), (BURGERS, TINY_BURGERS)],
                         ids=["kovasznay", "burgers"])
def test_options_func_annealing_chunks_rar(path, tiny):
    """torch.func derivatives, annealed weights, a chunked residual and RAR give the same
    kind of loss terms; the chunked loss equals the unchunked one."""
    prob, _ = load_problem(path)
    base = apply_overrides(prob.config(), tiny + ["dtype=float64"])
    losses = {}
    for name, extra in {
        "plain": [],
        "func": ["derivatives=func"],
        "chunked": ["residual_budget=20kB"],
    }.items():
        cfg = apply_overrides(base, extra)
        ctx = Context(cfg, torch.device("cpu"), torch.float64)
        torch.manual_seed(0)
        prob.build(ctx)
        terms = prob.residuals(ctx, 0)
        losses[name] = {k: float(v.detach()) for k, v in terms.items()}
        if name == "chunked":
            assert ctx.data["residual"].chunk_size(torch.zeros(64, 2, dtype=torch.float64)) < 64
    for k, v in losses["plain"].items():
        assert losses["func"][k] == pytest.approx(v, rel=1e-10)
        assert losses["chunked"][k] == pytest.approx(v, rel=1e-10)

    cfg = apply_overrides(base, ["weighting=annealing", "anneal_every=1", "rar_every=1",
                                 "rar_pool=200", "rar_add=5"])
    ctx = Context(cfg, torch.device("cpu"), torch.float64)
    torch.manual_seed(0)
    prob.build(ctx)
    w = prob.weights(ctx)
    before = dict(w)
    prob.residuals(ctx, 0)
    assert dict(w) != before                                   # the weights adapted in place
    n0 = len(next(v for v in ctx.data.values() if hasattr(v, "refine")))
    prob.residuals(ctx, 1)
    n1 = len(next(v for v in ctx.data.values() if hasattr(v, "refine")))
    assert n1 == n0 + 5                                        # RAR added its points
    with torch.no_grad():
        m = prob.evaluate(ctx)
    assert any(k.startswith("weight_") for k in m)


@pytest.mark.parametrize("path,tiny,at", [(KOVASZNAY, TINY_NS, 3), (BURGERS, TINY_BURGERS, 3),
                                          (KOVASZNAY, TINY_NS, 1), (KOVASZNAY, TINY_NS, 4)],
                         ids=["kovasznay-at-lbfgs", "burgers-at-lbfgs", "in-adam", "in-lbfgs"])
def test_switch_to_float64_and_resume_in_it(tmp_path, path, tiny, at):
    """float32, then float64 from iteration ``switch_at`` (at the Adam → L-BFGS switch,
    during Adam, during L-BFGS): the restart file records it, a resumed run loads the float64
    weights without rounding them and continues; the log is complete and the resumed run
    equals an uninterrupted one."""
    tiny = tiny + [f"switch_at={at}"]
    out = str(tmp_path / "run")
    res = train(str(path), sets=tiny, overrides={"iterations": 4}, out=out, quiet=True)
    state = torch.load(res.restart_path, weights_only=True)
    want = torch.float64 if at < 4 else torch.float32
    assert state["problem"]["dtype"] == str(want).removeprefix("torch.")
    assert all(v.dtype == want for v in state["model"].values())
    res = train(str(path), sets=tiny, overrides={"iterations": 6}, out=out,
                resume=True, quiet=True)
    state = torch.load(res.restart_path, weights_only=True)
    assert all(v.dtype == torch.float64 for v in state["model"].values())
    log = read_log(res.log_path)
    assert list(log.columns["iteration"]) == list(range(6))
    assert log.columns["lr"][-1] == pytest.approx(1.0)
    assert np.isfinite(log.columns["loss"]).all()
    whole = train(str(path), sets=tiny, overrides={"iterations": 6},
                  out=str(tmp_path / "whole"), quiet=True)
    ref = read_log(whole.log_path).columns["loss"]
    np.testing.assert_allclose(log.columns["loss"], ref, rtol=1e-9)
    a = torch.load(res.restart_path, weights_only=True)["model"]
    b = torch.load(whole.restart_path, weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12)


def test_float32_run_without_switch_stays_float32(tmp_path):
    res = train(str(KOVASZNAY), sets=TINY_NS + ["switch_at=-1"], overrides={"iterations": 4},
                out=str(tmp_path / "run"), quiet=True)
    state = torch.load(res.restart_path, weights_only=True)
    assert state["problem"]["dtype"] == "float32"
    assert all(v.dtype == torch.float32 for v in state["model"].values())


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile needs a C++ compiler on CPU")
@pytest.mark.parametrize("constraints", ["soft", "hard"])
def test_compiled_residual_equals_eager(constraints):
    """Loss and parameter gradients of the compiled residual equal the eager ones; with the
    hard ansatz the lift's derivatives enter the compiled function as an input."""
    prob, _ = load_problem(KOVASZNAY)
    losses = []
    for flag in ("false", "true"):
        cfg = apply_overrides(prob.config(), TINY_NS + [f"compile={flag}", "dtype=float64",
                                                        f"constraints={constraints}"])
        ctx = Context(cfg, torch.device("cpu"), torch.float64)
        torch.manual_seed(0)
        prob.build(ctx)
        terms = prob.residuals(ctx, 0)
        loss = sum(terms.values())
        grads = torch.autograd.grad(loss, list(ctx.model.parameters()))
        losses.append((float(loss.detach()), grads))
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-12)
    for a, b in zip(losses[0][1], losses[1][1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path,tiny", [(KOVASZNAY, TINY_NS), (BURGERS, TINY_BURGERS)],
                         ids=["kovasznay", "burgers"])
def test_problem_state_round_trips(path, tiny):
    """Annealed weights and RAR points survive state_dict/load_state_dict (and torch.save)."""
    import io

    prob, _ = load_problem(path)
    cfg = apply_overrides(prob.config(), tiny + ["weighting=annealing", "anneal_every=1",
                                                 "rar_every=1", "rar_pool=100", "rar_add=3"])
    ctx = Context(cfg, torch.device("cpu"), torch.float32)
    prob.build(ctx)
    prob.residuals(ctx, 0)
    prob.residuals(ctx, 1)
    buf = io.BytesIO()
    torch.save(prob.state_dict(ctx), buf)
    fresh = Context(cfg, torch.device("cpu"), torch.float32)
    prob.build(fresh)
    buf.seek(0)
    prob.load_state_dict(fresh, torch.load(buf, weights_only=True))
    assert dict(prob.weights(fresh)) == dict(prob.weights(ctx))
    key = "interior" if "interior" in ctx.data else "collocation"
    assert torch.equal(fresh.data[key].points(1), ctx.data[key].points(1))


def test_the_trainer_applies_annealed_weights(tmp_path):
    """The trainer keeps the dict weights(ctx) returned: in-place updates reach the loss."""
    res = train(str(KOVASZNAY), sets=TINY_NS + ["weighting=annealing", "anneal_every=1",
                                                "eval_every=1", "dtype=float64"],
                overrides={"iterations": 3}, out=str(tmp_path / "run"), quiet=True)
    c = read_log(res.log_path).columns
    w = {k: c[f"metric/weight_{k}"] for k in ("bc_u", "bc_v", "bc_p")}
    assert all(abs(v[0] - 1.0) > 1e-6 for v in w.values())
    total = sum(c[f"loss/{k}"] for k in ("momentum_x", "momentum_y", "continuity"))
    total = total + sum(w[k] * c[f"loss/{k}"] for k in w)
    np.testing.assert_allclose(c["loss"], total, rtol=1e-10)


# ----------------------------------------------------------------------------- second order

SECOND = {
    "gauss_newton": ["optimizer=gauss_newton"],
    "ssbroyden": ["optimizer=ssbroyden", "qn_iters=4"],
    "bfgs": ["optimizer=bfgs", "qn_iters=4", "self_scaled=false"],
}


@pytest.mark.parametrize("path,tiny", [(BURGERS, TINY_BURGERS), (KOVASZNAY, TINY_NS),
                                       (KOVASZNAY, TINY_NS + ["constraints=hard"])],
                         ids=["burgers", "kovasznay", "kovasznay-hard"])
@pytest.mark.parametrize("name", list(SECOND))
def test_second_order_resumed_run_equals_uninterrupted(tmp_path, path, tiny, name):
    """An Adam warm-up, then the second-order optimizer, in float64, with the collocation
    set redrawn by RAD (Burgers): a run stopped after iteration 4 and resumed equals one
    that ran through — the optimizer's state (Gauss–Newton damping, the SSBroyden inverse
    Hessian, the phase) and the RAD points are in the restart file. The loss falls."""
    sets = tiny + SECOND[name] + ["dtype=float64", "switch_at=-1", "warmup=2",
                                  "checkpoint_every=100"]
    if path == BURGERS:
        sets += ["rad_every=3", "rad_pool=300"]
    res, whole = helpers.stop_resume_and_compare(path, sets, tmp_path, stop=4, total=8)
    a = read_log(res.log_path).columns
    assert a["loss"][-1] < 0.5 * a["loss"][1]
    assert a["lr"][0] == pytest.approx(1e-3) and a["lr"][-1] == pytest.approx(1.0)
    sa = torch.load(res.restart_path, weights_only=True)
    sb = torch.load(whole.restart_path, weights_only=True)
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=1e-10, atol=1e-13)
    assert sa["model"][k].dtype == torch.float64


def test_gauss_newton_needs_least_squares_terms_and_known_names(tmp_path):
    prob, _ = load_problem(BURGERS)
    cfg = apply_overrides(prob.config(), TINY_BURGERS + ["optimizer=newton"])
    ctx = Context(cfg, torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        prob.build(ctx)
        prob.optimizer(ctx, list(ctx.model.parameters()))
    from deepsolve.pinn import AdamLBFGSTraining

    class NoTerms(AdamLBFGSTraining):
        pass

    with pytest.raises(ValueError, match="needs the problem to define least_squares_terms"):
        NoTerms().least_squares_terms(ctx, 0)
