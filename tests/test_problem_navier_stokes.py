"""problems/navier_stokes.py: reference cache, untrained model = coarse solver, loss terms,
gradients, training reduces the misfit, evaluation metrics. Tiny grids (fine 32, coarse 16)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import h5py
import helpers
import pytest
import torch

from deepsolve.problem import load_problem

PROBLEM = Path(__file__).resolve().parents[1] / "problems" / "navier_stokes.py"

TINY = {
    "fine_n": 32, "coarse_n": 16, "dt": 0.02, "steps": 20, "obs_every": 10, "spinup": 0.2,
    "n_train": 2, "n_test": 2, "batch": 2, "width": 4, "depth": 2, "lr": 3e-2,
    "budget": "", "snapshots": 0,
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
    n_times = TINY["steps"] // TINY["obs_every"] + 1
    for split, n in (("train", TINY["n_train"]), ("test", TINY["n_test"])):
        path = d[f"{split}_path"]
        assert os.path.dirname(path) == str(tmp_path)
        with h5py.File(path, "r") as f:
            assert f["vorticity"].shape == (n, n_times, 16, 16)
            t = f["t"][...]
            assert t.shape == (n_times,)
            assert t[0] == 0 and math.isclose(t[-1], TINY["steps"] * TINY["dt"])
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
    a = problem.rollout(ctx, w0, TINY["steps"], closure=True)
    b = problem.rollout(ctx, w0, TINY["steps"], closure=False)
    assert torch.equal(a, b)
    m = problem.evaluate(ctx)
    assert m["improvement"] == 1.0 and m["rel_err_closure"] == m["rel_err_coarse"] > 0
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
    assert set(m) == {"rel_err_closure", "rel_err_coarse", "improvement"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    assert m["improvement"] > 1.0  # the closure already beats the coarse solver here


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
    ctx = make_ctx(problem, tmp_path, steps=15)
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
