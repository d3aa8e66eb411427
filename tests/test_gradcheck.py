"""``deepsolve.check_gradients`` and ``python -m deepsolve check``: exact steps pass, steps
whose randomness escapes torch's RNG (numpy, Python's random, a torch.Generator object) or
that keep state between calls fail with the reason and what to do, every shipped problem
passes (tiny settings), a PINN file gets the chunked-residual check."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import deepsolve
from deepsolve.cli import main
from deepsolve.gradcheck import GradientCheck, check_gradients
from deepsolve.training.check import check_problem

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOISY = os.path.join(HERE, "data", "noisy_problem.py")
TINY = os.path.join(HERE, "data", "tiny_problem.py")


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4)).double()


def _rng_fingerprint() -> tuple:
    return (torch.get_rng_state().clone(), random.getstate(),
            np.random.get_state(legacy=False)["state"]["pos"])


# ------------------------------------------------------------------ check_gradients


def test_exact_step_passes_quietly_and_leaves_the_rng_alone(capsys):
    """A pytree state, per-step outputs, dropout-like torch noise: every schedule matches
    store_all to 1e-9 (float64), the replays agree, nothing is printed, the global RNG
    states are where they were."""
    net = _net()
    w = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def step(s, i):
        x, v = s["x"], s["v"]
        noise = 0.05 * torch.randn(x.shape, dtype=x.dtype)
        x2 = x + 0.1 * torch.tanh(net(x)) * (1 + noise) + 0.05 * v
        return {"x": x2, "v": w * v - 0.1 * x2}, x2.pow(2).sum(-1)

    x0 = {"x": torch.randn(3, 4, dtype=torch.float64), "v": torch.zeros(3, 4,
                                                                        dtype=torch.float64)}
    before = _rng_fingerprint()
    res = check_gradients(step, x0, 12, snapshots=3, wrt={"w": w})
    after = _rng_fingerprint()
    assert isinstance(res, GradientCheck) and res.ok, res.table()
    assert capsys.readouterr().out == ""
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    names = [r.name for r in res.rows]
    assert names[:2] == ["x0['x']", "x0['v']"] and "w" in names
    assert len(names) == 2 + 1 + 4  # x0 leaves, w, the net's four tensors
    assert set(res.schedules) == {"run", "revolve", "periodic"}
    assert res.schedules["run"].startswith("revolve(n_steps=12, snapshots=3")
    assert res.rtol == 1e-9
    for r in res.rows:
        assert r.ref_norm > 0 and all(e <= 1e-9 for e in r.errors.values()) and r.replay == 0
    assert all(f <= 1e-9 for f in res.forward.values())
    text = res.table()
    assert "|grad| store_all" in text and "ok:" in text
    check_gradients(step, x0, 12, snapshots=3, verbose=True)
    assert "ok: every gradient matches" in capsys.readouterr().out


def test_default_rtol_follows_the_dtype():
    net = _net().float()

    def step(x, i):
        return x + 0.1 * net(x)

    res = check_gradients(step, torch.randn(2, 4), 10, snapshots=2)
    assert res.ok and res.rtol == 1e-4
    assert check_gradients(step, torch.randn(2, 4), 10, snapshots=2, rtol=1e-3).rtol == 1e-3


@pytest.mark.parametrize("source,expect", [
    ("numpy", "numpy's global generator"),
    ("random", "Python's random module"),
])
def test_randomness_that_escapes_torch_is_caught(source, expect):
    """A step drawing from numpy's global generator or Python's random: not ok, the message
    names the generator and says what to do; the gradient columns show the damage."""
    net = _net()

    def step(x, i):
        eps = np.random.standard_normal() if source == "numpy" else random.gauss(0, 1)
        return x + 0.1 * net(x) * (1 + 0.3 * eps * torch.tanh(x))

    res = check_gradients(step, torch.randn(3, 4, dtype=torch.float64), 12, snapshots=3)
    assert not res.ok
    first = res.problems[0]
    assert expect in first and "torch's generator" in first and "seeded" in first
    assert any(e > 1e-6 for r in res.rows for e in r.errors.values())
    assert "MISMATCH" in res.table()


def test_a_torch_generator_object_is_caught_as_nondeterminism():
    """A ``torch.Generator`` object is not among the RNG states unroll replays: the result
    differs from store_all's although every run starts from the same global RNG states."""
    net = _net()
    g = torch.Generator().manual_seed(3)

    def step(x, i):
        return x + 0.1 * net(x) * (1 + 0.3 * torch.randn(x.shape, generator=g,
                                                          dtype=x.dtype))

    res = check_gradients(step, torch.randn(3, 4, dtype=torch.float64), 12, snapshots=3)
    assert not res.ok
    assert any("torch.Generator object" in p and "not a deterministic function" in p
               for p in res.problems), res.problems


def test_state_kept_between_calls_is_caught():
    """A step whose result depends on how often it was called (a counter): recomputation
    gives other values, the check fails."""
    net = _net()
    calls = [0]

    def step(x, i):
        calls[0] += 1
        return x + 0.1 * net(x) * (1 + 1e-3 * calls[0])

    res = check_gradients(step, torch.randn(3, 4, dtype=torch.float64), 10, snapshots=2)
    assert not res.ok and res.problems


def test_a_parameter_used_only_at_early_steps():
    """The check's verdict on a tensor used only at steps 0-2 agrees with an independent
    comparison of the checkpointed and the plain gradient: where the unroll does not find
    it the check says 'missing' (and not ok), where it does, the check passes."""
    net = _net()
    w = torch.nn.Parameter(torch.full((4,), 1.1, dtype=torch.float64))

    def step(x, i):
        y = x + 0.1 * net(x)
        return y * w if i < 3 else y

    x0 = torch.randn(3, 4, dtype=torch.float64)
    res = check_gradients(step, x0, 12, snapshots=3, also=(), wrt={"w": w})
    plain = torch.autograd.grad(deepsolve.unroll(step, x0, 12).sum(), w)[0]
    (ckpt,) = torch.autograd.grad(deepsolve.unroll(step, x0, 12, snapshots=3).sum(), w,
                                  allow_unused=True)
    found = ckpt is not None and torch.allclose(ckpt, plain, rtol=1e-9, atol=0)
    row = next(r for r in res.rows if r.name == "w")
    assert res.ok == found
    assert (row.missing == ["run"]) == (ckpt is None)
    if ckpt is None:
        assert any("w gets no gradient" in p and "params=[...]" in p for p in res.problems)


def test_bad_arguments_are_one_line_errors():
    def step(x, i):
        return x * 0.5

    x0 = torch.ones(3)
    for n in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n_steps must be an integer >= 1"):
            check_gradients(step, x0, n)
    with pytest.raises(ValueError, match="until= is not supported"):
        check_gradients(step, x0, 4, until=lambda x, i: i > 2)
    with pytest.raises(ValueError, match="also= takes"):
        check_gradients(step, x0, 4, also=("bogus",))
    with pytest.raises(ValueError, match="nothing in the unroll's result requires grad"):
        check_gradients(lambda x, i: x + 1, torch.ones(3, dtype=torch.long), 4)


# ------------------------------------------------------------------ problem files


@pytest.mark.parametrize("noise", ["numpy", "random", "generator"])
def test_check_fails_on_a_planted_step_with_escaped_randomness(noise, capsys):
    rc = main(["check", NOISY, "--set", f"noise={noise}"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "MISMATCH" in out and "ok: every gradient" not in out
    reason = {"numpy": "numpy's global generator", "random": "Python's random module",
              "generator": "torch.Generator object"}[noise]
    assert reason in out and "torch's generator instead" in out


def test_check_passes_when_the_noise_comes_from_torch(capsys):
    rc = main(["check", NOISY, "--set", "noise=torch"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ok: every gradient matches" in out
    assert "run settings: snapshots=3" in out and "revolve(n_steps=20, snapshots=3)" in out
    for name in ("x0", "rate", "gain"):
        assert any(line.startswith(name) for line in out.splitlines()), name


def test_check_with_a_budget_and_a_horizon(capsys):
    res = check_problem(TINY, steps=7, overrides={"budget": "256KiB"})
    assert res.ok, res.table()
    assert res.n_steps == 7 and "budget='256KiB'" in res.title
    assert main(["check", TINY, "--steps", "51"]) == 2
    err = capsys.readouterr().err
    assert "--steps 51" in err and "unrolls 50 steps" in err and err.count("\n") == 1
    assert main(["check", TINY, "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
    assert main(["check", os.path.join(HERE, "data", "no_such_problem.py")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["check", TINY, "--budget", "1B"]) == 2  # a budget nothing fits: bad input
    err = capsys.readouterr().err
    assert err.startswith("deepsolve check: error: the budget") and err.count("\n") == 1


SHIPPED = {
    "navier_stokes.py": ["fine_n=32", "coarse_n=16", "curriculum=", "dt=0.02", "steps=20",
                         "obs_every=10",
                         "spinup=0.2", "n_train=2", "n_test=2", "batch=2", "width=4",
                         "depth=2", "budget=", "snapshots=4"],
    "burgers_assimilation.py": ["steps=60", "n=32"],
    "implicit_heat.py": ["steps=16", "n=32"],
    "burgers_pinn.py": ["n_collocation=256", "width=8", "depth=3", "quad_nodes=40"],
    "navier_stokes_pinn.py": ["n_interior=256", "n_boundary=64", "width=8", "depth=2",
                              "compile=False", "test_grid=11"],
    "shallow_water.py": ["nx=8", "ny=8", "steps=12", "obs_every=4", "members=2", "budget=",
                         "snapshots=3"],
    "allen_cahn_pinn.py": ["n_slices=4", "n_per_slice=32", "width=8", "depth=2",
                           "ref_modes=64", "test_nx=16", "test_nt=11", "ref_dt=0.01"],
    "helmholtz_pinn.py": ["n_collocation=64", "width=8", "depth=2", "test_n=11"],
    "wave_pinn.py": ["n_collocation=64", "n_initial=30", "width=8", "depth=2", "test_n=11"],
    "schrodinger_pinn.py": ["n_collocation=64", "n_initial=32", "width=8", "depth=2",
                            "ref_modes=256", "ref_dt=1e-3"],
    "burgers_inverse_pinn.py": ["n_data=200", "n_collocation=64", "width=8", "depth=2",
                                "quad_nodes=60"],
    "cavity_pinn.py": ["n_collocation=64", "width=6", "depth=2", "ref_n=16"],
    "poisson_lshape_pinn.py": ["n_collocation=64", "n_boundary=48", "width=6", "depth=2",
                               "ref_n=8"],
}


def test_every_shipped_problem_is_listed():
    shipped = sorted(f for f in os.listdir(os.path.join(ROOT, "problems")) if f.endswith(".py")
                     and not f.startswith("_"))
    assert shipped == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_check_passes_on_every_shipped_problem(name, tmp_path, capsys):
    sets = [*SHIPPED[name]]
    if name == "navier_stokes.py":
        sets.append(f"data_dir={tmp_path / 'data'}")
    rc = main(["check", os.path.join(ROOT, "problems", name),
               *[a for kv in sets for a in ("--set", kv)]])
    out = capsys.readouterr().out
    assert rc == 0, out
    if name == "navier_stokes.py":   # the closure's last layer starts at zero: named, unchecked
        assert "ok: every non-zero gradient matches" in out
        assert "the store_all gradient is identically zero, so these are not checked" in out
    elif name == "burgers_pinn.py":  # odd network: the output bias cancels in N(x) - N(-x)
        assert "ok: every non-zero gradient matches (1 of" in out
        assert "net.net.layers.3.bias: the" in out and "identically zero" in out
    else:
        assert "ok: every gradient matches" in out
    if name.endswith("_pinn.py"):
        assert "does not unroll" in out and "chunked" in out
        # the forced chunking really chunked: the note about an unchunked loss is absent
        assert "did not chunk" not in out
    else:
        assert "against store_all" in out and "revolve" in out


def test_a_schedule_whose_unroll_fails_is_a_finding_not_a_crash():
    """A step that changes its state's dtype from its 8th call on: store_all (6 calls) runs,
    the checkpointed schedules (which call it more often) fail; the check reports each
    failure with the unroll's own one-line error instead of raising."""
    calls = [0]

    def step(x, i):
        calls[0] += 1
        return x.float() if calls[0] >= 8 else 0.9 * x

    res = check_gradients(step, torch.randn(3, 4, dtype=torch.float64), 6, snapshots=2)
    assert not res.ok
    assert set(res.failed) == {"run", "periodic"}  # revolve(6, 2) is the run's own schedule
    assert all("the unroll failed where store_all ran" in p for p in res.problems)
    assert "error" in res.table()


def test_parameters_with_an_identically_zero_gradient_are_named_not_passed():
    """`deepsolve check problems/navier_stokes.py` printed 0.000e+00 for every first-layer
    gradient (the last layer starts at zero) and "ok" without a word: half the model was
    not checked."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                              torch.nn.Linear(4, 3)).double()
    torch.nn.init.zeros_(net[2].weight)
    torch.nn.init.zeros_(net[2].bias)

    def step(x, i):
        return x + 0.1 * net(x)

    res = check_gradients(step, torch.randn(2, 3, dtype=torch.float64), 10,
                          wrt=dict(net.named_parameters()), snapshots=3)
    assert res.ok and res.zero_gradient == ["0.weight", "0.bias"]
    table = res.table()
    assert table.count("0 (not checked)") == 2
    (note,) = [ln for ln in table.splitlines() if ln.startswith("note: 0.weight, 0.bias")]
    assert "identically zero, so these are not checked" in note and "starts at zero" in note
    assert table.splitlines()[-1].startswith("ok: every non-zero gradient matches (2 of 5 "
                                             "tensors have a zero reference gradient")
    torch.nn.init.normal_(net[2].weight)              # the gradient flows: all checked
    res = check_gradients(step, torch.randn(2, 3, dtype=torch.float64), 10,
                          wrt=dict(net.named_parameters()), snapshots=3)
    assert res.ok and res.zero_gradient == [] and "not checked" not in res.table()
