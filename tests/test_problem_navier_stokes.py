"""problems/navier_stokes.py: reference cache, untrained model = coarse solver, loss terms,
gradients, training reduces the misfit, evaluation metrics. Tiny grids (fine 32, coarse 16)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import h5py
import helpers
import pytest
import torch

import deepsolve
from deepsolve.problem import load_problem

PROBLEM = Path(__file__).resolve().parents[1] / "problems" / "navier_stokes.py"

TINY = {
    "fine_n": 32, "coarse_n": 16, "dt": 0.02, "steps": 20, "obs_every": 10, "spinup": 0.2,
    "n_train": 2, "n_test": 2, "batch": 2, "width": 4, "depth": 2, "lr": 3e-2,
    "budget": "", "snapshots": 0, "curriculum": "",
}


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def problem():
    prob, _ = load_problem(PROBLEM)
    return prob


def make_ctx(problem, data_dir, **over):
    """TINY, ``data_dir`` and ``over`` stored as they are (no ``--set`` parsing); seed 0."""
    return helpers.make_ctx(problem, values={**TINY, "data_dir": str(data_dir), **over},
                            dtype=torch.float32, seed=0)


def loss_of(problem, ctx, it=0):
    terms = problem.residuals(ctx, it)
    w = problem.weights(ctx)
    return terms, sum(w.get(k, 1.0) * v for k, v in terms.items())


def test_loads_with_documented_defaults(problem):
    import deepsolve

    assert isinstance(problem, deepsolve.Problem)
    d = problem.config()   # the defaults' values (some are declared as Settings with help)
    for key in ("iterations", "lr", "steps", "eval_every", "dtype", "fine_n", "coarse_n", "nu",
                "alpha", "forcing", "forcing_k", "dt", "n_train", "n_test", "batch", "width",
                "obs_every", "data_dir"):
        assert key in problem.defaults, key
    assert d["dtype"] == "float32"
    assert d["budget"] or d.get("snapshots")
    assert d["steps"] >= 1000 and d["steps"] % d["obs_every"] == 0
    assert d["data_dir"] == "runs/data"


def test_reference_cache_layout_and_reuse(problem, tmp_path):
    ctx = make_ctx(problem, tmp_path)
    d = ctx.data
    assert d["train_generated"] and d["test_generated"]
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and all(f.endswith(".h5") for f in files)  # no temp files left
    per_horizon = TINY["steps"] // TINY["obs_every"]
    for split, n, reps in (("train", TINY["n_train"], 1), ("test", TINY["n_test"], 4)):
        path = d[f"{split}_path"]   # the held-out split runs to eval_multiple (4) horizons
        assert os.path.dirname(path) == str(tmp_path)
        n_times = reps * per_horizon + 1
        with h5py.File(path, "r") as f:
            assert f["vorticity"].shape == (n, n_times, 16, 16)
            t = f["t"][...]
            assert t.shape == (n_times,)
            assert t[0] == 0 and math.isclose(t[-1], reps * TINY["steps"] * TINY["dt"])
            assert list(f.attrs["obs_steps"]) == [10 * k for k in range(1, n_times)]
            a = f.attrs
            assert a["split"] == split and a["n_trajectories"] == n
            for key in ("fine_n", "coarse_n", "nu", "alpha", "forcing", "forcing_k", "dt",
                        "fine_substeps", "steps", "obs_every", "seed", "spinup"):
                assert key in a, key
            assert a["fine_n"] == 32 and a["coarse_n"] == 16
            assert torch.isfinite(torch.from_numpy(f["vorticity"][...])).all()
    with h5py.File(d["train_path"]) as f1, h5py.File(d["test_path"]) as f2:
        assert f1.attrs["seed"] != f2.attrs["seed"]  # held-out ICs differ
        assert not torch.allclose(torch.from_numpy(f1["vorticity"][:, 0]),
                                  torch.from_numpy(f2["vorticity"][:, 0]))
    mtimes = {p: os.stat(d[f"{p}_path"]).st_mtime_ns for p in ("train", "test")}

    ctx2 = make_ctx(problem, tmp_path)  # the same settings: reused, not regenerated
    assert not ctx2.data["train_generated"] and not ctx2.data["test_generated"]
    for p in ("train", "test"):
        assert ctx2.data[f"{p}_path"] == d[f"{p}_path"]
        assert os.stat(d[f"{p}_path"]).st_mtime_ns == mtimes[p]
    assert torch.equal(ctx2.data["train"], d["train"])

    ctx3 = make_ctx(problem, tmp_path, nu=0.02)  # other physics: another file
    assert ctx3.data["train_generated"]
    assert ctx3.data["train_path"] != d["train_path"]

    with open(d["test_path"], "wb") as f:  # a broken cache is regenerated
        f.write(b"not an hdf5 file")
    ctx4 = make_ctx(problem, tmp_path)
    assert ctx4.data["test_generated"] and not ctx4.data["train_generated"]
    assert torch.equal(ctx4.data["test"], d["test"])


def test_untrained_model_is_the_coarse_solver(problem, tmp_path):
    ctx = make_ctx(problem, tmp_path)
    w0 = ctx.data["test"][:, 0]
    assert torch.count_nonzero(ctx.model(w0)) == 0
    a = problem.rollout(ctx, w0, TINY["steps"], "closure")
    b = problem.rollout(ctx, w0, TINY["steps"], "coarse")
    assert torch.equal(a, b)
    m = problem.evaluate(ctx)
    assert m["improvement"] == 1.0 and m["rel_err_closure"] == m["rel_err_coarse"] > 0
    assert m["improvement_4T"] == 1.0 and m["t_half_closure"] == m["t_half_coarse"]
    assert problem.batch_size(ctx) == TINY["batch"]


def test_residuals_and_gradients(problem, tmp_path):
    ctx = make_ctx(problem, tmp_path)
    terms, loss = loss_of(problem, ctx)
    assert set(terms) == {"misfit", "closure"}
    for v in terms.values():
        assert isinstance(v, torch.Tensor) and v.shape == () and torch.isfinite(v)
    assert terms["misfit"] > 0 and terms["closure"] == 0  # closure starts at zero
    stats = ctx.unroll_stats[-1]
    assert stats.n_steps == TINY["steps"]  # went through ctx.unroll
    # the last layer starts at zero, so only it gets a gradient at first; after one step
    # every parameter of the CNN does
    opt = torch.optim.Adam(ctx.model.parameters(), lr=1e-2)
    loss.backward()
    opt.step()
    opt.zero_grad()
    _, loss = loss_of(problem, ctx, 1)
    loss.backward()
    for name, p in ctx.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_checkpointed_gradient_matches_store_all(problem, tmp_path):
    grads = []
    for over in ({}, {"snapshots": 3}):
        ctx = make_ctx(problem, tmp_path, **over)
        with torch.no_grad():
            for p in ctx.model.parameters():
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        _, loss = loss_of(problem, ctx)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in ctx.model.parameters()]))
        assert ("revolve" in ctx.unroll_stats[-1].schedule) == bool(over)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_training_reduces_misfit_and_evaluate(problem, tmp_path):
    ctx = make_ctx(problem, tmp_path)
    opt = problem.optimizer(ctx, list(ctx.model.parameters()))
    misfits = []
    for it in range(8):
        opt.zero_grad(set_to_none=True)
        terms, loss = loss_of(problem, ctx, it)
        loss.backward()
        opt.step()
        misfits.append(float(terms["misfit"].detach()))
    assert misfits[-1] < 0.9 * misfits[0], misfits
    assert all(misfits[k + 1] < misfits[k] for k in range(len(misfits) - 1)), misfits
    with torch.no_grad():
        m = problem.evaluate(ctx)
    numbers = {k: v for k, v in m.items() if not isinstance(v, deepsolve.Curve)}
    assert set(numbers) == {f"{name}{tag}" for name in ("rel_err_closure", "rel_err_coarse",
                                                        "rel_err_padded", "improvement")
                            for tag in ("", "_2T", "_4T")} | {
        "blowups", "t_half_closure", "t_half_coarse", "t_half_padded"}
    assert all(isinstance(v, float) and not math.isnan(v) for v in numbers.values())
    assert m["improvement"] > 1.0  # the closure already beats the coarse solver here
    assert m["blowups"] == 0
    # the curves: the mean error at every held-out observation, 0 at step 0, and equal to
    # the metrics at T, 2T and 4T
    for name in ("closure", "coarse"):
        c = m[f"err_{name}"]
        assert list(c.steps) == [10 * k for k in range(9)] and c.values[0] == 0.0
        for mult, tag in ((1, ""), (2, "_2T"), (4, "_4T")):
            j = list(c.steps).index(mult * TINY["steps"])
            assert math.isclose(c.values[j], m[f"rel_err_{name}{tag}"], rel_tol=1e-12)


def test_observation_steps_adapt_to_any_horizon():
    """Observation step counts: every obs_every steps when it divides the horizon (the
    defaults, unchanged data), otherwise evenly spread, never more than obs_every apart,
    the last one at the horizon."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ns_obs", PROBLEM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    obs = mod.observation_steps
    assert obs(1000, 100) == list(range(100, 1001, 100))
    assert obs(40, 100) == [40]
    assert obs(15, 10) == [8, 15]
    assert obs(250, 100) == [83, 167, 250]
    for steps in range(1, 130):
        for every in range(1, 40):
            c = obs(steps, every)
            gaps = [b - a for a, b in zip([0, *c[:-1]], c, strict=True)]
            assert c[-1] == steps and min(gaps) >= 1 and max(gaps) <= every, (steps, every)
    with pytest.raises(ValueError, match="obs_every must be >= 1"):
        obs(10, 0)


def test_horizon_that_obs_every_does_not_divide(problem, tmp_path):
    """steps=15 with obs_every=10 (refused before: "obs_every=10 must divide steps=15"):
    observations at steps 8 and 15, the reference stored at exactly those times, and the
    misfit is the mean relative error at those two times."""
    ctx = make_ctx(problem, tmp_path, steps=15, starts="initial")
    assert ctx.data["obs_steps"] == [8, 15]
    with h5py.File(ctx.data["train_path"], "r") as f:
        assert f["vorticity"].shape[1] == 3
        assert torch.allclose(torch.from_numpy(f["t"][...]),
                              torch.tensor([0.0, 8 * TINY["dt"], 15 * TINY["dt"]],
                                           dtype=torch.float64))
        assert list(f.attrs["obs_steps"]) == [8, 15]
    terms, loss = loss_of(problem, ctx)
    assert torch.isfinite(loss) and terms["misfit"] > 0
    # the same misfit from a plain rollout compared at steps 8 and 15
    idx = problem.batch_indices(ctx, 0)
    ref = ctx.data["train"][idx]
    w, errs = ref[:, 0], []
    for i in range(15):
        w, _ = problem.advance(ctx, w)
        if i + 1 in (8, 15):
            k = 1 if i + 1 == 8 else 2
            target = ref[:, k]
            errs.append(((w - target).pow(2).sum((-2, -1)) / target.pow(2).sum((-2, -1))).sqrt())
    assert torch.allclose(terms["misfit"], torch.stack(errs).mean(), rtol=1e-5)


def test_train_steps_40_with_the_default_obs_every(tmp_path):
    """`train problems/navier_stokes.py --steps 40` (obs_every=100 by default) trains: one
    observation, at the horizon (tiny grids otherwise)."""
    from deepsolve.cli import main
    from deepsolve.io import read_log

    sets = ["fine_n=32", "coarse_n=16", "spinup=0.2", "n_train=2", "n_test=2", "batch=2",
            "width=4", "depth=2", "budget=", "snapshots=4", f"data_dir={tmp_path / 'data'}"]
    out = tmp_path / "run"
    rc = main(["train", str(PROBLEM), "--steps", "40", "--iterations", "2", "--quiet",
               "--out", str(out), *[a for kv in sets for a in ("--set", kv)]])
    assert rc == 0
    log = read_log(out / "log.h5")
    assert log.n_rows == 2 and all(math.isfinite(v) for v in log.columns["loss"])


def test_windows_start_anywhere_one_step_training(problem, tmp_path):
    """starts=any: a window of h steps starts at a random observation time of a training
    trajectory and ends within the reference; with obs_every=1 and h=1 each window is a pair
    (reference at t, at t + dt), and the misfit is the mean one-step relative error of those
    pairs, computed here directly."""
    ctx = make_ctx(problem, tmp_path, starts="any", obs_every=1, batch=4)
    traj, index, counts = problem.windows(ctx, 0, 1)
    assert counts == [1] and index.shape == (4, 2)
    assert len(set(zip(traj.tolist(), index[:, 0].tolist(), strict=True))) == 4   # distinct
    ctx.horizon = 1
    terms = problem.residuals(ctx, 0)
    ref, errs = ctx.data["train"], []
    for b in range(4):
        w1, _ = problem.advance(ctx, ref[traj[b], index[b, 0]][None])
        target = ref[traj[b], index[b, 0] + 1]
        errs.append(((w1[0] - target).pow(2).sum() / target.pow(2).sum()).sqrt())
    assert torch.allclose(terms["misfit"], torch.stack(errs).mean(), rtol=1e-5)
    assert ctx.unroll_stats[-1].n_steps == 1
    # a 10-step horizon in a 20-step reference: 11 starts, observed every step, ending
    # within the reference; over the iterations every start is drawn
    seen = set()
    for it in range(40):
        traj, index, counts = problem.windows(ctx, it, 10)
        assert counts == list(range(1, 11)) and index.shape == (4, 11)
        assert (index[:, -1] <= TINY["steps"]).all() and (index[:, 1:] - index[:, :-1] == 1).all()
        seen |= set(index[:, 0].tolist())
    assert seen == set(range(11))
    assert torch.equal(problem.windows(ctx, 3, 10)[1], problem.windows(ctx, 3, 10)[1])
    with pytest.raises(ValueError, match="exceeds the 40 training windows"):
        problem.windows(make_ctx(problem, tmp_path, starts="any", obs_every=1, batch=41), 0, 1)
    # obs_every=3 does not divide 20: observed every 2 steps, the largest divisor up to 3
    ctx2 = make_ctx(problem, tmp_path, starts="any", obs_every=3)
    assert ctx2.data["obs_every"] == 2 and ctx2.data["obs_steps"] == list(range(2, 21, 2))


def test_window_spacing_fits_every_stage(problem, tmp_path):
    ns = sys.modules[type(problem).__module__]
    assert ns.window_spacing(1000, 100, (100, 300)) == 100
    assert ns.window_spacing(1000, 100, (100, 250)) == 50
    assert ns.window_spacing(40, 100, (4, 12)) == 4
    assert ns.window_spacing(15, 10) == 5 and ns.window_spacing(7, 3) == 1
    for steps, every, lengths in ((1000, 100, (100, 300)), (24, 5, (6, 9)), (17, 4, ())):
        s = ns.window_spacing(steps, every, lengths)
        assert s <= every and all(n % s == 0 for n in (steps, *lengths))
    # the default percent curriculum with --steps 40: stages 4, 12 and 40 steps, so the
    # reference is observed every 4 steps and every stage trains
    ctx = make_ctx(problem, tmp_path, steps=40, obs_every=100, starts="any",
                   curriculum="0:10%,30%:30%,60%:100%", iterations=10)
    assert ctx.data["obs_every"] == 4
    for it, h in ((0, 4), (3, 12), (6, 40)):
        ctx.horizon = h
        terms = problem.residuals(ctx, it)
        assert torch.isfinite(terms["misfit"]) and terms["misfit"] > 0
        assert ctx.unroll_stats[-1].n_steps == h
    with pytest.raises(ValueError, match=r"a stage of 4 steps ends before the first "
                                         r"observation \(step 40\)"):
        make_ctx(problem, tmp_path, steps=40, obs_every=100, starts="initial",
                 curriculum="0:10%,60%:100%", iterations=10)


def test_a_closure_that_blows_up_is_counted(problem, tmp_path):
    """A closure that drives the state to infinity: every held-out trajectory counts as a
    blow-up, its error is charged ERROR_CAP from then on (never NaN), and the error reaches
    0.5 before the coarse solver's does."""
    ctx = make_ctx(problem, tmp_path)
    last = ctx.model.net[-1]
    with torch.no_grad():
        last.bias.fill_(1e4)   # a tendency of 1e4 * scale everywhere: far past 3x the norm
    m = problem.evaluate(ctx)
    assert m["blowups"] == TINY["n_test"]
    assert m["rel_err_closure_4T"] == 2.0 and m["rel_err_closure"] == 2.0
    assert all(math.isfinite(v) for v in m["err_closure"].values)
    assert m["t_half_closure"] < m["t_half_coarse"]


def _random_field(n: int, kmax: int, seed: int = 0) -> torch.Tensor:
    """A real periodic field on ``n x n`` points with modes ``|k_x|, |k_y| <= kmax``."""
    from deepsolve.physics import to_physical
    g = torch.Generator().manual_seed(seed)
    hat = torch.complex(torch.randn(n, n // 2 + 1, generator=g, dtype=torch.float64),
                        torch.randn(n, n // 2 + 1, generator=g, dtype=torch.float64))
    k = torch.fft.fftfreq(n, 1.0 / n).abs()
    keep = (k[:, None] <= kmax) & (torch.arange(n // 2 + 1)[None, :] <= kmax)
    hat = hat * keep
    hat[0, 0] = 0
    return to_physical(hat, n)


def test_advection_error_is_the_exact_product_minus_the_coarse_one():
    """advection_error against an independent exact product: formed on a 2N grid (exact
    for modes below N/2), filtered to N, minus the coarse solver's 2/3-rule term; and zero
    for a field whose modes stay below N/6 (its product stays below N/3, where the 2/3 rule
    keeps everything and aliases nothing)."""
    from deepsolve.physics import Grid, filter_to, spectral_operators, to_physical, to_spectral
    from deepsolve.physics.navier_stokes import advection_hat

    ns = sys.modules[type(load_problem(PROBLEM)[0]).__module__]
    n = 24
    grid, fine = Grid(n), Grid(2 * n)
    omega = _random_field(n, n // 2 - 1)

    def jac(w, g):  # J(psi, w) with no dealiasing: the plain product on g's points
        ops = spectral_operators(g, w.dtype, w.device)
        hat = to_spectral(w)
        psi = hat * ops.inv_k2
        d = [to_physical(1j * k * f, g.n) for f in (psi, hat) for k in (ops.kx, ops.ky)]
        return d[0] * d[3] - d[1] * d[2]

    exact = filter_to(jac(filter_to(omega, fine.n), fine), n)
    coarse = to_physical(advection_hat(to_spectral(omega), spectral_operators(grid, omega.dtype,
                                                                              omega.device), n), n)
    err = ns.advection_error(omega, grid)
    torch.testing.assert_close(err, exact - coarse, rtol=0, atol=1e-10 * exact.abs().max())
    assert err.abs().max() > 1e-2 * exact.abs().max()  # not trivially zero here
    low = _random_field(n, n // 6 - 1, seed=1)
    assert ns.advection_error(low, grid).abs().max() < 1e-11 * low.abs().max()


def test_the_padded_reference_is_the_closure_that_adds_the_advection_error(problem, tmp_path):
    """The unlearned 3/2-padded solver of evaluate() is exactly a closure whose linear skip
    passes the advection-error input through (weight advection_scale / scale): equal
    errors and curves; and it differs from the coarse solver."""
    ctx = make_ctx(problem, tmp_path, features="advection")
    m = ctx.model
    with torch.no_grad():
        m.skip.weight[0, 3] = m.advection_scale / m.scale
    r = problem.evaluate(ctx)
    for tag in ("", "_2T", "_4T"):
        assert r[f"rel_err_closure{tag}"] == pytest.approx(r[f"rel_err_padded{tag}"], rel=1e-4)
        assert r[f"rel_err_padded{tag}"] != r[f"rel_err_coarse{tag}"]
    assert r["err_padded"].steps == r["err_closure"].steps
