"""problems/allen_cahn_pinn.py: the spectral reference, the periodic model, short runs.

The ETDRK4 reference is checked against the PDE (time derivative by central differences,
``u_xx`` spectrally, residual relative to the size of the terms), against its initial
condition and under refinement in space and time. The model is periodic in ``x`` and, with
the hard constraint, exact at ``t = 0`` for any network. The problem runs a few iterations at
tiny sizes through the real trainer (Adam; Adam then L-BFGS with the soft initial condition)
and writes finite loss terms and metrics.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pathlib
import sys

import helpers
import numpy as np
import pytest
import torch

from deepsolve.io.h5log import read_log
from deepsolve.problem import load_problem
from deepsolve.train import train

PATH = pathlib.Path(__file__).resolve().parents[1] / "problems" / "allen_cahn_pinn.py"
TINY = ["n_slices=4", "n_per_slice=16", "width=8", "depth=2", "ref_modes=128", "ref_dt=5e-3",
        "test_nx=32", "test_nt=11", "eval_every=2", "n_initial=16",
        # the Adam -> L-BFGS configuration (the defaults before SSBroyden)
        "optimizer=adam+lbfgs", "dtype=float32", "switch_at=1050", "constraints=hard",
        "lbfgs_resample_every=50", "harmonics=3"]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def ac():
    prob, _ = load_problem(PATH)
    return prob, sys.modules[type(prob).__module__]


make_ctx = functools.partial(helpers.make_ctx, base=TINY, dtype=torch.float64)


# ----------------------------------------------------------------------------- reference


def spectral_uxx(u):
    """Second x-derivative of periodic grid values ``u (n, ...)`` on [-1, 1)."""
    n = u.shape[0]
    k = np.pi * np.arange(n // 2 + 1)
    return np.fft.irfft(-(k**2)[:, None] * np.fft.rfft(u, axis=0), n, axis=0)


def test_reference_satisfies_allen_cahn(ac):
    _, mod = ac
    centres = np.array([0.02, 0.25, 0.5, 0.75, 0.99])
    h = 1e-3
    times = np.stack([centres - h, centres, centres + h], 1).ravel()
    x, u = mod.allen_cahn_reference(times, n_modes=1024, dt=h)
    u = u.reshape(x.size, centres.size, 3)
    um, uc, up = u[..., 0], u[..., 1], u[..., 2]
    u_t = (up - um) / (2 * h)
    u_xx = spectral_uxx(uc)
    res = u_t - mod.D * u_xx + 5 * uc**3 - 5 * uc
    scale = np.abs(u_t) + np.abs(mod.D * u_xx) + np.abs(5 * uc**3) + np.abs(5 * uc)
    assert np.abs(res).max() < 2e-5 * scale.max()
    assert np.abs(mod.D * u_xx).max() > 0.3     # steep fronts: diffusion matters
    # a wrong coefficient is caught: the residual with 2d instead of d is far larger
    bad = u_t - 2 * mod.D * u_xx + 5 * uc**3 - 5 * uc
    assert np.abs(bad).max() > 100 * np.abs(res).max()


@pytest.fixture(scope="module")
def default_reference(ac):
    _, mod = ac
    t = np.linspace(0, 1, 201)
    return t, mod.allen_cahn_reference(t)   # 2048 modes, dt = 1e-3 (the defaults)


def test_reference_initial_condition_and_convergence(ac, default_reference):
    _, mod = ac
    t, (x, u) = default_reference
    assert x.shape == (2048,) and u.shape == (2048, 201)
    np.testing.assert_allclose(u[:, 0], x**2 * np.cos(np.pi * x), rtol=0, atol=1e-14)
    assert np.abs(u).max() < 1 + 1e-6 and (np.abs(u[:, -1]) > 0.99).mean() > 0.5  # ±1
    # half the modes: differences only at the kink x = ±1 (u0' jumps), early on
    xc, uc = mod.allen_cahn_reference(t, n_modes=1024)
    diff = uc - u[::2]
    assert np.abs(diff).max() < 1e-3
    assert np.abs(diff[:, 20:]).max() < 2e-4                       # t >= 0.1
    assert np.linalg.norm(diff) / np.linalg.norm(u[::2]) < 1e-5
    # twice the time step: ETDRK4 is far below that already
    _, ut = mod.allen_cahn_reference(t[:41], dt=2e-3)
    assert np.abs(ut - u[:, :41]).max() < 1e-8
    with pytest.raises(ValueError, match="increasing times"):
        mod.allen_cahn_reference([0.5, 0.1], n_modes=16)


# ----------------------------------------------------------------------------- kink ansatz


def test_smoothed_kink_is_the_heat_flow_of_abs(ac):
    """G(s, t) equals |.| convolved with the heat kernel of variance 2dt (quadrature), solves
    G_t = d G_ss (autograd), and is |s| at t = 0."""
    _, mod = ac
    d = mod.D
    for t in (1e-3, 0.05, 0.8):
        w = math.sqrt(4 * d * t)
        y = np.linspace(-12 * w, 12 * w, 20001)
        kernel = np.exp(-(y / w) ** 2) / (math.sqrt(math.pi) * w)
        s = np.array([-0.3, -2 * w, -w / 3, 0.0, w / 5, w, 3 * w, 0.7])
        quad = np.array([np.trapezoid(np.abs(si - y) * kernel, y) for si in s])
        got = mod.smoothed_kink(torch.tensor(s), torch.full((s.size,), t, dtype=torch.float64),
                                d).numpy()
        np.testing.assert_allclose(got, quad, rtol=0, atol=1e-6 * w)  # the kink in |s - y|
        assert abs(got[3] - np.abs(s[3])) > 0.5 * w                   # rounded at s = 0
    s = torch.linspace(-0.05, 0.05, 201, dtype=torch.float64, requires_grad=True)
    t = torch.linspace(1e-3, 0.5, 201, dtype=torch.float64).requires_grad_()
    g = mod.smoothed_kink(s, t, d)
    g_s, g_t = torch.autograd.grad(g.sum(), (s, t), create_graph=True)
    (g_ss,) = torch.autograd.grad(g_s.sum(), s)
    assert (g_t - d * g_ss).abs().max() < 1e-12 * g_t.abs().max()
    assert g_t.abs().max() > 1e-2
    with torch.no_grad():
        zero = mod.smoothed_kink(s, torch.zeros_like(s), d)
    torch.testing.assert_close(zero, s.detach().abs(), rtol=0, atol=1e-16)
    # at t = 0 (collocation and initial points) the derivatives stay finite, in both precisions
    for dtype in (torch.float64, torch.float32):
        s0 = torch.linspace(-0.01, 0.01, 21, dtype=dtype, requires_grad=True)
        t0 = torch.zeros_like(s0, requires_grad=True)
        g = mod.smoothed_kink(s0, t0, d)
        g_s, g_t = torch.autograd.grad(g.sum(), (s0, t0), create_graph=True)
        (g_ss,) = torch.autograd.grad(g_s.sum(), s0)
        assert all(torch.isfinite(v).all() for v in (g, g_s, g_t, g_ss)), dtype


def test_kink_layer_carries_the_layer_of_the_reference(ac):
    """The reference minus K(x, t) has no kink at t = 0 and no boundary layer at x = ±1
    later: its second differences there are those of the smooth rest of the solution."""
    _, mod = ac
    t = np.array([0.0, 0.005, 0.02, 0.1])
    x, u = mod.allen_cahn_reference(t, n_modes=8192)   # the defaults' resolution
    h = x[1] - x[0]

    def second_difference(v):                          # periodic
        return (np.roll(v, -1) - 2 * v + np.roll(v, 1)) / h**2

    near = np.abs(x) > 0.95
    for j in range(t.size):
        kink = mod.kink_layer(torch.tensor(x), torch.full((x.size,), t[j],
                                                           dtype=torch.float64)).numpy()
        raw = np.abs(second_difference(u[:, j]))[near].max()
        smooth = np.abs(second_difference(u[:, j] - kink))[near].max()
        assert raw > 100 and smooth < 30 and smooth < raw / 8, (t[j], raw, smooth)
    # the kink of u0 (slope -2 to +2 across x = ±1) is K's at t = 0
    kink0 = mod.kink_layer(torch.tensor(x), torch.zeros(x.size, dtype=torch.float64)).numpy()
    exact0 = mod.kink_layer(torch.tensor(x), None).numpy()            # 2 chi (1 - |x|)
    np.testing.assert_allclose(kink0, exact0, rtol=0, atol=1e-16)
    for v, jump in ((u[:, 0], 4.0), (u[:, 0] - kink0, 0.0)):
        slope_in, slope_out = (v[0] - v[-1]) / h, (v[1] - v[0]) / h
        assert abs(slope_out - slope_in - jump) < 0.05


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("kink", [True, False])
@pytest.mark.parametrize("constraints", ["hard", "soft"])
def test_model_is_periodic_and_exact_at_t0(ac, constraints, kink):
    prob, mod = ac
    torch.manual_seed(3)
    ctx = make_ctx(prob, [f"constraints={constraints}", "harmonics=3", f"kink={kink}"])
    assert ctx.model.kink == kink
    model = ctx.model
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()                          # far from zero output
        t = torch.rand(50, dtype=torch.float64)
        left = model(torch.stack([-torch.ones_like(t), t], 1))
        right = model(torch.stack([torch.ones_like(t), t], 1))
        assert (left - right).abs().max() < 1e-12
        assert left.abs().max() > 1e-2
        x = torch.linspace(-1, 1, 101, dtype=torch.float64)
        at0 = model(torch.stack([x, torch.zeros_like(x)], 1))
        u0 = x * x * torch.cos(math.pi * x)
        if constraints == "hard":
            assert (at0 - u0).abs().max() < 1e-15
        else:
            assert (at0 - u0).abs().max() > 1e-2
    # the network part is periodic with its derivatives too
    pts = torch.stack([torch.tensor([-1.0, 1.0], dtype=torch.float64),
                       torch.full((2,), 0.4, dtype=torch.float64)], 1).requires_grad_()
    n = model.net(torch.cat([torch.cos(model.freq * pts[:, :1]),
                             torch.sin(model.freq * pts[:, :1]), pts[:, 1:]], 1))
    (g,) = torch.autograd.grad(n.sum(), pts)
    assert (g[0] - g[1]).abs().max() < 1e-12


def test_bad_settings_give_one_line_errors(ac):
    prob, _ = ac
    for bad, msg in ((["constraints=exact"], "constraints must be 'soft' or 'hard'"),
                     (["derivatives=taylor"], "derivatives must be 'autograd' or 'func'"),
                     (["ref_modes=100"], "must be a multiple of test_nx"),
                     (["causal_eps=a,b"], "causal_eps must be numbers"),
                     (["causal_eps=1,0.1"], "non-decreasing"),
                     (["causal_threshold=0"], "threshold must be in")):
        with pytest.raises(ValueError, match=msg) as info:
            make_ctx(prob, bad)
        assert "\n" not in str(info.value)


def test_collocation_is_laid_out_by_time_slice(ac):
    prob, _ = ac
    ctx = make_ctx(prob, ["n_slices=8", "n_per_slice=5"])
    t = ctx.data["collocation"].points(0)[:, 1].reshape(8, 5)
    lo = torch.arange(8, dtype=torch.float64)[:, None] / 8
    assert ((t >= lo) & (t < lo + 1 / 8)).all()
    assert not torch.equal(ctx.data["collocation"].points(1), ctx.data["collocation"].points(0))


def test_lbfgs_blocks_draw_new_points_and_reset_the_memory(ac):
    prob, _ = ac
    ctx = make_ctx(prob, ["optimizer=adam+lbfgs", "adam_iterations=3", "lbfgs_resample_every=2",
                          "switch_at=-1", "causal_eps=[1.0]"])
    used = [prob.collocation_iteration(ctx, k) for k in range(9)]
    assert used == [0, 1, 2, 2, 2, 3, 3, 4, 4]        # Adam: every step; L-BFGS: per block
    coll = ctx.data["collocation"]
    assert not torch.equal(coll.points(used[5]), coll.points(used[4]))
    resets = [prob.on_step(ctx, k) for k in range(9)]
    assert resets == [False] * 5 + [True, False, True, False]
    # an eps advance in the L-BFGS phase resets the memory too
    ctx = make_ctx(prob, ["optimizer=adam+lbfgs", "adam_iterations=1", "lbfgs_resample_every=0",
                          "switch_at=-1", "causal_eps=1e-6,1e-5"])
    prob.residuals(ctx, 1)                            # tiny eps: min weight ~ 1
    assert prob.on_step(ctx, 2) and ctx.data["causal"].eps == 1e-5
    assert not prob.on_step(ctx, 3)


def test_state_round_trips(ac):
    prob, _ = ac
    ctx = make_ctx(prob, ["causal_eps=0.001,0.01", "causal_threshold=0.5"])
    for it in range(3):
        prob.residuals(ctx, it)
    causal = ctx.data["causal"]
    assert causal.eps == 0.01 and causal.history     # tiny losses: advanced
    buf = io.BytesIO()
    torch.save(prob.state_dict(ctx), buf)
    fresh = make_ctx(prob, ["causal_eps=0.001,0.01", "causal_threshold=0.5"])
    buf.seek(0)
    prob.load_state_dict(fresh, torch.load(buf, weights_only=True))
    assert fresh.data["causal"].eps == 0.01
    assert fresh.data["causal"].min_weight == causal.min_weight
    assert torch.equal(fresh.data["collocation"].points(2), ctx.data["collocation"].points(2))


# ----------------------------------------------------------------------------- trainer


def test_defaults_and_documented_keys(ac):
    prob, mod = ac
    cfg = prob.config()
    assert cfg["ref_modes"] % cfg["test_nx"] == 0 and (cfg["test_nx"], cfg["test_nt"]) == (512, 201)
    assert cfg["causal_threshold"] == 0.99 and cfg["constraints"] == "hard" and cfg["kink"]
    assert cfg["optimizer"] == "ssbroyden" and cfg["dtype"] == "float64"
    assert set(mod.TERMS) == {"pde", "initial"} and set(mod.METRICS) == {"u_rel_l2",
                                                                          "u_max_error"}
    for name in (*mod.TERMS, *mod.METRICS, "causal_eps", "causal_min_weight", "pde_mse"):
        assert f"``{name}``" in mod.__doc__


@pytest.mark.parametrize("sets,terms,lbfgs", [
    ([], {"pde"}, False),
    (["constraints=soft", "optimizer=adam+lbfgs", "adam_iterations=3", "lbfgs_iters=3",
      "switch_at=3"], {"pde", "initial"}, True),
], ids=["hard-adam", "soft-adam-lbfgs"])
def test_a_few_iterations_through_the_trainer(tmp_path, sets, terms, lbfgs):
    res = train(str(PATH), sets=TINY + sets, overrides={"iterations": 5},
                out=str(tmp_path / "run"), quiet=True)
    assert res.iterations == 5 and math.isfinite(res.final_loss)
    log = read_log(res.log_path)
    assert log.n_rows == 5
    for k in terms:
        assert np.isfinite(log.columns[f"loss/{k}"]).all()
    assert ("loss/initial" in log.columns) == ("initial" in terms)
    for k in ("u_rel_l2", "u_max_error", "causal_eps", "causal_min_weight", "pde_mse"):
        col = log.columns[f"metric/{k}"]
        assert np.isfinite(col[-1]) and 0 <= col[-1] < 1e3
    assert 0 < log.columns["metric/causal_min_weight"][-1] <= 1
    lr = log.columns["lr"]
    assert lr[0] == pytest.approx(1e-3)
    if lbfgs:
        assert lr[-1] == pytest.approx(1.0)                       # Adam, then L-BFGS
        state = torch.load(res.restart_path, weights_only=True)
        assert state["problem"]["dtype"] == "float64"
    else:
        assert 0 < lr[-1] < lr[0]                                 # the decay schedule


def test_residual_budget_chunks_the_causal_loss(ac):
    """Under a residual budget the causal loss is evaluated in chunks; the terms and their
    gradients equal the unchunked ones."""
    prob, _ = ac
    out = {}
    for name, sets in {"whole": [], "chunked": ["residual_budget=3kB"]}.items():
        torch.manual_seed(0)
        ctx = make_ctx(prob, sets)
        loss = prob.residuals(ctx, 0)["pde"]
        out[name] = (loss, torch.autograd.grad(loss, list(ctx.model.parameters())))
        if name == "chunked":
            assert ctx.data["chunk"] < int(ctx.cfg.n_slices) * int(ctx.cfg.n_per_slice)
    assert torch.allclose(out["chunked"][0], out["whole"][0], rtol=1e-12, atol=0)
    for a, b in zip(out["chunked"][1], out["whole"][1], strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_reference_is_computed_once_and_read_back(ac, tmp_path):
    prob, _ = ac
    sets = [f"cache_dir={tmp_path}"]
    first, second = make_ctx(prob, sets), make_ctx(prob, sets)
    path, computed = first.cached["allen_cahn_reference"]
    assert computed and os.path.dirname(path) == str(tmp_path)
    assert second.cached["allen_cahn_reference"] == (path, False)
    for k in first.data:  # the same data from the file as from the computation
        a, b = first.data[k], second.data[k]
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sets", [
    ["optimizer=gauss_newton"],
    ["optimizer=ssbroyden", "qn_iters=4"],
    ["optimizer=gauss_newton", "constraints=soft"],
], ids=["gauss_newton", "ssbroyden", "gauss_newton-soft"])
def test_second_order_with_causal_weights_resumes_exactly(tmp_path, sets):
    """Gauss–Newton (the causal weights riding along with the points) and SSBroyden after
    an Adam warm-up, float64, new point blocks every 2 steps: the loss falls, and a run
    stopped after iteration 4 and resumed equals one that ran through."""
    sets = TINY + sets + ["dtype=float64", "switch_at=-1", "warmup=2", "lbfgs_resample_every=2",
                          "checkpoint_every=100"]
    res, _ = helpers.stop_resume_and_compare(PATH, sets, tmp_path, stop=4, total=8)
    a = read_log(res.log_path).columns
    assert a["loss"][-1] < 0.5 * a["loss"][1]
    assert a["lr"][-1] == pytest.approx(1.0)


def test_the_default_optimizer_runs_without_a_scheduler_warning(tmp_path):
    """The default run (SSBroyden from the first iteration, no Adam step) stepped an Adam
    learning-rate schedule that Adam never used, and torch warned that lr_scheduler.step()
    came before optimizer.step(). With an Adam warm-up the schedule is kept, and silent."""
    import warnings

    for sets, scheduled in ((["optimizer=ssbroyden", "qn_iters=2"], False),
                            (["optimizer=ssbroyden", "qn_iters=2", "warmup=2"], True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = train(str(PATH), sets=TINY + sets, overrides={"iterations": 3},
                        out=str(tmp_path / f"run{int(scheduled)}"), quiet=True)
        assert res.iterations == 3
        said = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        assert not said, said
        state = torch.load(res.restart_path, weights_only=True)
        assert bool(state["scheduler"]) == scheduled
