"""Reversible steppers and the reversible strategy: gradients against plain autograd through
the same reversible forward, the schedule's counts against their closed form, the drift
measured, bounded and acted on, memory flat in the step count, bad input refused."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

import deepsolve as ds
from deepsolve import reversible as rv
from deepsolve import schedules as S
from deepsolve.engine.reversal import ReconstructionError, relative_error
from deepsolve.memory.live import LiveBytes
from deepsolve.memory.planner import choose
from deepsolve.memory.profiling import StepProfile

pytestmark = pytest.mark.usefixtures("single_thread")

D = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def field(d: int = 6, seed: int = 0):
    """A small neural vector field ``f(t, y)`` and its parameters."""
    g = torch.Generator().manual_seed(seed)
    W = torch.nn.Parameter(0.4 * torch.randn(d, d, generator=g, dtype=D))
    b = torch.nn.Parameter(0.1 * torch.randn(d, generator=g, dtype=D))

    def f(t, y):
        return torch.tanh(y @ W.T + b) * (1 + 0.1 * math.sin(t)) - 0.05 * y

    return f, [W, b]


def grads(step, x0, n, leaves, loss, **kw):
    stats = ds.UnrollStats()
    xn = ds.unroll(step, x0, n, stats=stats, **kw)
    return torch.autograd.grad(loss(xn), leaves), stats


def check_against_plain(step, x0, n, leaves, loss, strategy, tol=1e-10):
    """``x0``: the initial state, or a function making it (a state with a graph of its own
    is made afresh for each backward)."""
    make = x0 if callable(x0) else (lambda: x0)
    want, _ = grads(step, make(), n, leaves, loss)         # plain autograd, every step kept
    got, stats = grads(step, make(), n, leaves, loss, schedule=strategy)
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < tol
    return stats


# -- the schedule -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 50, 101])
@pytest.mark.parametrize("k", [1, 2, 5, 10, 200])
def test_schedule_counts_follow_the_closed_form(n, k):
    st = S.check(S.reversible(n, k))
    assert st.recorded == n                       # every step recorded once
    assert st.advances == n - 1                   # one forward sweep, no recomputation
    assert st.inverses == n - 1                   # every state but x_{n-1} rebuilt
    assert st.peak_slots == max(1, math.ceil((n - 1) / k)) == S.reversible(n, k).slots[0]


def test_schedule_checker_refuses_an_invert_without_the_next_state():
    bad = [S.Store(0, 0), S.Advance(0, 2), S.Reverse(2), S.Invert(0)]
    with pytest.raises(S.ScheduleError, match="next reverse step is 1"):
        S.check(bad, n_steps=3)
    bad = [S.Store(0, 0), S.Advance(0, 2), S.Reverse(2), S.Restore(0, 0), S.Invert(1)]
    with pytest.raises(S.ScheduleError, match="needs x_2"):
        S.check(bad, n_steps=3)


def test_shifted_moves_inverts_and_slots():
    acts = list(S.shifted(S.reversible(5, 2), 10, 3))
    assert S.Invert(13) in acts and S.Store(4, 12) in acts
    assert S.shifted(S.reversible(5, 2), 10, 3).slots == {0: 5}


# -- gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["euler", "heun", "rk4", "ssprk3"])
def test_coupled_runge_kutta_gradients_equal_plain_autograd(method):
    f, params = field()
    y0 = torch.randn(3, 6, dtype=D, generator=torch.Generator().manual_seed(1),
                     requires_grad=True)
    step = rv.explicit(f, 0.01, method=method)
    stats = check_against_plain(step, step.init(y0), 1000, [y0, *params],
                                lambda x: (step.solution(x) ** 2).sum(),
                                ds.Reversible(every=100))
    assert stats.inverses == 999 and stats.advances == 999 and stats.recorded == 1000
    assert stats.snapshots_peak == 10
    assert stats.reconstruction_error is not None
    assert 0 <= stats.reconstruction_error < 1e-10


def test_coupled_method_keeps_the_base_order():
    """Reversible Heun-coupled and RK4-coupled solutions of y' = -y converge at order 2 and 4
    (the coupling keeps the base method's order)."""
    for method, order in (("heun", 2), ("rk4", 4)):
        errs = []
        for n in (20, 40):
            step = rv.explicit(lambda t, y: -y, 1.0 / n, method=method, lam=0.999)
            x = step.init(torch.ones(1, dtype=D))
            for i in range(n):
                x = step(x, i)
            errs.append(abs(float(step.solution(x)) - math.exp(-1)))
        assert math.log2(errs[0] / errs[1]) == pytest.approx(order, abs=0.3)


def test_leapfrog_gradients_and_energy():
    k = torch.nn.Parameter(torch.tensor(2.0, dtype=D))
    step = rv.leapfrog(lambda q, t: -k * torch.sin(q), 0.01)
    q0 = torch.linspace(-1, 1, 5, dtype=D).requires_grad_()
    v0 = torch.zeros(5, dtype=D)
    check_against_plain(step, (q0, v0), 1000, [q0, k],
                        lambda x: (x[0] ** 2).sum() + x[1].sum(), ds.Reversible(every=250))
    with torch.no_grad():  # the pendulum's energy is conserved to O(h^2), no drift
        q, v = ds.unroll(step, (q0.detach(), v0), 1000)
        e0 = 0.5 * v0**2 - float(k) * torch.cos(q0.detach())
        e1 = 0.5 * v**2 - float(k) * torch.cos(q)
    assert float((e1 - e0).abs().max()) < 1e-3


def test_reversible_heun_gradients_equal_plain_autograd():
    f, params = field(seed=3)
    y0 = torch.randn(2, 6, dtype=D, generator=torch.Generator().manual_seed(2),
                     requires_grad=True)
    step = rv.reversible_heun(f, 0.02)
    stats = check_against_plain(step, lambda: step.init(y0), 1000, [y0, *params],
                                lambda x: (x[0] ** 3).sum(), ds.Reversible(snapshots=3))
    assert stats.snapshots_peak == 3


def test_pytree_state_outputs_hooks_and_norms():
    """A dict solution, per-step outputs, an adjoint hook and the adjoint norms: the same
    as plain autograd (the hook as x_i.register_hook on every state of a plain loop)."""
    f, params = field(d=4, seed=5)
    inner = rv.explicit(lambda t, y: {"a": f(t, y["a"]), "b": -0.3 * y["b"] * y["a"][..., :1]},
                        0.05, method="heun")
    y0 = {"a": torch.randn(2, 4, dtype=D, requires_grad=True), "b": torch.ones(2, 3, dtype=D)}

    def fwd(x, i):
        nxt = inner(x, i)
        return nxt, (nxt[0]["a"] ** 2).sum(-1)

    step = rv.invertible(fwd, inner.inverse)
    hook = lambda i, g: {k: (v * 0.9 if i % 7 == 0 else v) for k, v in g.items()}  # noqa: E731
    hook_pair = lambda i, g: (hook(i, g[0]), hook(i, g[1]))  # noqa: E731

    def run(**kw):
        st = ds.UnrollStats(adjoint_norms=True)
        x, outs = ds.unroll(step, inner.init(y0), 200, stats=st, adjoint_hook=hook_pair, **kw)
        loss = outs.sum() + (x[0]["b"] ** 2).sum()
        return torch.autograd.grad(loss, [y0["a"], *params]), st

    want, sw = run(schedule=ds.Revolve(20))
    got, sg = run(schedule=ds.Reversible(every=30))
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < 1e-10
    assert torch.allclose(sg.adjoint_norms, sw.adjoint_norms, rtol=1e-10)
    assert sg.inverses == 199


def test_truncated_reversible_unroll():
    f, params = field(seed=7)
    step = rv.explicit(f, 0.01, method="rk4")
    y0 = torch.randn(6, dtype=D, requires_grad=True)
    x0 = step.init(y0)

    def loss(x):
        return (x[0] ** 2).sum()

    want, _ = grads(step, x0, 300, params, loss, truncate=70)
    got, st = grads(step, x0, 300, params, loss, truncate=70,
                    schedule=ds.Reversible(every=20))
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < 1e-10
    assert st.inverses > 0


# -- drift ----------------------------------------------------------------------------------


def unstable_inverse():
    """A coupling of 0.3: stable forward, its inverse amplifies rounding ~3.3x per step."""
    f, params = field(seed=11)
    step = rv.explicit(f, 0.05, method="euler", lam=0.3)
    y0 = torch.randn(4, 6, dtype=D, requires_grad=True)
    return step, step.init(y0), [y0, *params]


def test_drift_beyond_the_tolerance_raises_naming_the_window():
    step, x0, leaves = unstable_inverse()
    xn = ds.unroll(step, x0, 400, schedule=ds.Reversible(every=100))
    with pytest.raises(ReconstructionError) as e:
        torch.autograd.grad((xn[0] ** 2).sum(), leaves)
    msg = str(e.value)
    assert "\n" not in msg and "steps 300..398" in msg and "tolerance" in msg


def test_drift_recompute_gives_exact_gradients():
    step, x0, leaves = unstable_inverse()

    def loss(x):
        return (x[0] ** 2).sum()

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        stats = check_against_plain(step, x0, 400, leaves, loss,
                                    ds.Reversible(every=100, on_drift="recompute"))
    assert stats.extra["recomputed_windows"] >= 1
    assert stats.reconstruction_error > 1e-6
    assert any("recomputed that window" in str(x.message) for x in w)


def test_short_windows_keep_the_unstable_inverse_within_tolerance():
    """The same unstable inverse, snapshots every 5 steps: the drift stays bounded."""
    step, x0, leaves = unstable_inverse()
    stats = check_against_plain(step, x0, 400, leaves, lambda x: (x[0] ** 2).sum(),
                                ds.Reversible(every=5), tol=1e-8)
    assert stats.reconstruction_error < 1e-8


def test_relative_error_measure():
    a = [torch.tensor([1.0, 2.0], dtype=D), torch.zeros(2, dtype=D)]
    b = [torch.tensor([1.0, 2.5], dtype=D), torch.tensor([0.0, 1e-3], dtype=D)]
    assert relative_error(a, b) == pytest.approx(1.0)  # second leaf: 1e-3 / 1e-3
    assert relative_error(a[:1], b[:1]) == pytest.approx(0.2)
    assert relative_error([torch.tensor([float("nan")])], [torch.tensor([1.0])]) == math.inf


# -- memory ---------------------------------------------------------------------------------


def test_memory_flat_in_the_number_of_steps():
    """Tracked memory of a reversible unroll with a fixed number of snapshots: the same at
    n = 60 and n = 600 (a 128 KiB state), within 5 % (n = 10^3 .. 10^5 of a 1 MiB state:
    benchmarks/reversible.py)."""
    f = lambda t, y: torch.sin(y) * 0.5  # noqa: E731
    w = torch.nn.Parameter(torch.tensor(0.7, dtype=D))
    step = rv.explicit(lambda t, y: w * f(t, y), 0.01, method="heun")
    peaks = []
    for n in (60, 600):
        y0 = torch.randn(8192, dtype=D, requires_grad=True)  # 64 KiB; the pair 128 KiB
        with LiveBytes("cpu") as lb:
            xn = ds.unroll(step, step.init(y0), n, schedule=ds.Reversible(snapshots=4))
            torch.autograd.grad(xn[0].sum(), [y0, w])
            del xn
        peaks.append(lb.peak)
    assert peaks[1] <= 1.05 * peaks[0]
    assert peaks[0] < 16 * 2 * 8192 * 8  # a few snapshots and states, not n of them


# -- the planner ------------------------------------------------------------------------------


def profile(**kw) -> StepProfile:
    base = dict(state_bytes=2**20, tape_bytes=2**20, output_bytes=0, grad_bytes=1024,
                scratch_bytes=0, t_advance=1e-3, t_record=1.2e-3, t_backward=2e-3,
                device="cpu", kept_bytes=2**21, reverse_bytes=3 * 2**20,
                advance_bytes=2**21, chain_bytes=2**21)
    base.update(kw)
    return StepProfile(**base)


@pytest.mark.parametrize("budget_mib", [12, 20])
def test_planner_takes_reversible_when_revolve_recomputes_a_lot(budget_mib):
    p = profile(t_inverse=1e-3)
    n, budget = 3000, budget_mib * 2**20
    plain = choose(p, n, budget)
    both = choose(p, n, budget, reversible=True)
    rows = {a.name.split("(")[0]: a for a in both.alternatives}
    assert "reversible" in rows and "revolve" in rows       # explain() shows both
    assert both.predicted_peak <= budget
    assert both.kind == "reversible"                         # 2 evaluations per step vs >= 3
    assert both.predicted_time < plain.predicted_time
    assert S.check(both.schedule).inverses == n - 1
    assert "reversible" in both.explain() and "revolve" in both.explain()


def test_planner_keeps_revolve_when_it_recomputes_little():
    p = profile(t_inverse=5e-3)  # an inverse five times the step
    plan = choose(p, 100, 60 * 2**20, reversible=True)
    assert plan.kind != "reversible"
    assert any(a.name.startswith("reversible") for a in plan.alternatives)


def test_budgeted_unroll_of_a_reversible_step_fits_and_is_exact():
    f, params = field(d=64, seed=13)
    step = rv.explicit(f, 0.01, method="rk4")
    y0 = torch.randn(32, 64, dtype=D, requires_grad=True)  # 16 KiB, the pair 32 KiB
    x0 = step.init(y0)
    n = 600
    p = ds.plan(step, x0, n, budget="3MiB")
    assert p.predicted_peak <= 3 * 2**20
    assert any(a.name.startswith("reversible") for a in p.alternatives)
    check_against_plain(step, x0, n, [y0, *params], lambda x: (x[0] ** 2).sum(),
                        ds.Budget("3MiB"))


# -- bad input ------------------------------------------------------------------------------


def test_a_wrong_inverse_is_refused_on_the_first_pair():
    f, params = field()
    good = rv.explicit(f, 0.01)
    step = rv.invertible(good, lambda x, i: (x[0] * 1.001, x[1]))
    y0 = torch.randn(6, dtype=D, requires_grad=True)
    with pytest.raises(ValueError, match="does not invert it") as e:
        ds.unroll(step, good.init(y0), 50, schedule=ds.Reversible())
    assert "\n" not in str(e.value)


def test_inverse_of_another_structure_is_refused():
    f, _ = field()
    good = rv.explicit(f, 0.01)
    step = rv.invertible(good, lambda x, i: x[0])
    with pytest.raises(TypeError, match="inverse returned a state of structure"):
        ds.unroll(step, good.init(torch.randn(6, dtype=D, requires_grad=True)), 10,
                  schedule=ds.Reversible())


def test_step_without_inverse_and_random_steps_are_refused():
    x0 = torch.randn(4, dtype=D, requires_grad=True)
    with pytest.raises(TypeError, match="needs a step with an inverse"):
        ds.unroll(lambda x, i: x * 0.9, x0, 10, schedule=ds.Reversible())
    noisy = rv.invertible(lambda x, i: x + 0.01 * torch.randn_like(x), lambda x, i: x)
    with pytest.raises(ValueError, match="draws no random numbers"):
        ds.unroll(noisy, x0, 10, schedule=ds.Reversible())
    lf = rv.leapfrog(lambda q, t: -q, 0.1)
    with pytest.raises(ValueError, match="snapshot_dtype= with a reversible schedule"):
        ds.unroll(lf, (x0, x0.detach()), 10, schedule=ds.Reversible(),
                  snapshot_dtype=torch.float32)
    with pytest.raises(ValueError, match="online"):
        ds.unroll(rv.leapfrog(lambda q, t: -q, 0.1), (x0, x0.detach()),
                  until=lambda x, i: i >= 5, schedule=ds.Reversible())


def test_steps_drawing_from_numpy_or_a_private_generator_are_named_as_random():
    """The report's item 9: a step drawing from numpy's global generator was told to
    "check step.inverse"; it is named a random draw, and one drawing from a generator no
    capture sees (a numpy Generator it closes over) is named a nondeterministic step."""
    import numpy as np

    x0 = torch.randn(4, dtype=D, requires_grad=True)
    glob = rv.invertible(lambda x, i: x + 0.01 * float(np.random.randn()), lambda x, i: x)
    with pytest.raises(ValueError, match=r"draws no random numbers.*numpy's global"):
        ds.unroll(glob, x0, 10, schedule=ds.Reversible())
    rng = np.random.default_rng(0)
    own = rv.invertible(lambda x, i: x + 0.01 * float(rng.standard_normal()), lambda x, i: x)
    with pytest.raises(ValueError, match="needs a deterministic step.*numpy Generator"):
        ds.unroll(own, x0, 10, schedule=ds.Reversible())


def test_recompute_never_returns_a_non_finite_gradient_silently():
    """on_drift="recompute" recomputes drifting windows exactly; a gradient that is still
    not finite (here: the loss itself is NaN at one element) raises instead of returning."""
    step, x0, leaves = unstable_inverse()
    xn = ds.unroll(step, x0, 400, schedule=ds.Reversible(every=100, on_drift="recompute"))
    loss = (xn[0] ** 2).sum() + 0 * torch.sqrt(-xn[0][0, 0].abs() - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ReconstructionError, match="non-finite gradient") as e:
            torch.autograd.grad(loss, leaves)
    assert "\n" not in str(e.value)


def test_drift_error_names_the_window_the_inverse_allows_and_the_coupling():
    """The report's item 8: the drift error names the inverse's growth, the window it
    allows, and the coupling lam (it advised shorter windows only)."""
    step, x0, leaves = unstable_inverse()
    xn = ds.unroll(step, x0, 400, schedule=ds.Reversible(every=100))
    with pytest.raises(ReconstructionError) as e:
        torch.autograd.grad((xn[0] ** 2).sum(), leaves)
    msg = str(e.value)
    assert "Reversible(every=" in msg and "lam closer to 1 (now 0.3)" in msg
    k = int(msg.split("Reversible(every=")[1].split(")")[0])
    assert 5 <= k < 100
    check_against_plain(step, x0, 400, leaves, lambda x: (x[0] ** 2).sum(),
                        ds.Reversible(every=k), tol=1e-8)


@pytest.mark.parametrize("kw, match", [
    (dict(every=0), "every must be an integer >= 1"),
    (dict(every=3, snapshots=2), "not both"),
    (dict(tolerance=-1.0), "tolerance must be a number > 0"),
    (dict(on_drift="ignore"), "on_drift must be"),
])
def test_bad_strategy_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        ds.Reversible(**kw)


@pytest.mark.parametrize("make, match", [
    (lambda: rv.explicit(lambda t, y: y, 0.0), "dt must be a finite nonzero"),
    (lambda: rv.explicit(lambda t, y: y, 0.1, method="rk7"), "unknown method"),
    (lambda: rv.explicit(lambda t, y: y, 0.1, lam=1.5), r"lam must be a number in \(0, 1\]"),
    (lambda: rv.Tableau([[0, 1], [0, 0]], [0.5, 0.5], [0, 1]), "on or above the diagonal"),
    (lambda: rv.Tableau([[0, 0], [1, 0]], [0.5, 0.6], [0, 1]), "sum to"),
])
def test_bad_stepper_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_a_problem_asks_for_a_reversible_unroll():
    """The shallow-water problem with its reversible integrator: ``--set reversible=4``
    rebuilds states by the inverse (the step is the problem's ``step``, its inverse
    ``step_inverse``), and the loss gradient equals plain autograd's."""
    from helpers import make_ctx

    from deepsolve.problem import load_problem

    problem, _ = load_problem("problems/shallow_water.py")
    small = ["steps=40", "obs_every=20", "nx=16", "ny=16", "members=1",
             "integrator=reversible", "budget="]
    found = []
    for extra in ("snapshots=0", "reversible=4"):
        ctx = make_ctx(problem, [*small, extra], seed=0)
        loss = sum(problem.residuals(ctx, 0).values())
        found.append((torch.autograd.grad(loss, list(ctx.model.parameters())),
                      ctx.unroll_stats[-1]))
    (want, plain), (got, stats) = found
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < 1e-9
    assert plain.inverses == 0 and stats.inverses == 39
    assert stats.reconstruction_error is not None and stats.reconstruction_error < 1e-10


def test_the_reversible_setting_on_a_step_without_inverse_is_one_line(tmp_path, capsys):
    """``--set reversible=4`` on a problem without ``step_inverse``: unroll's TypeError
    reached the command line as a 47-line traceback (exit 1). The trainer's context refuses
    it where it turns the setting into a Reversible schedule: one ValueError line naming the
    setting, the problem and the method to define; exit 2 and no run directory made."""
    from helpers import make_ctx

    from deepsolve.cli import main
    from deepsolve.problem import load_problem

    tiny = str(Path(__file__).resolve().parent / "data" / "tiny_problem.py")
    out = tmp_path / "run"
    assert main(["train", tiny, "--out", str(out), "--quiet", "--set", "reversible=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deepsolve train: error: "), err
    for needle in ("--set reversible=4 needs a step with an inverse", "the problem Decay",
                   "tiny_problem.py", "step_inverse(ctx, x, i) beside it"):
        assert needle in err[0], err
    assert not out.exists()
    problem, _ = load_problem(tiny)
    ctx = make_ctx(problem, ["reversible=2"])
    with pytest.raises(ValueError, match=r"--set reversible=2 needs a step with an inverse"):
        ctx.unroll(problem.step, ctx.data["x0"])
    with pytest.raises(ValueError, match="the step <lambda> has none"):
        ctx.unroll(lambda x, i: 0.9 * x, ctx.data["x0"])
    # a schedule the call names itself is unroll's to check, as before
    with pytest.raises(TypeError, match="needs a step with an inverse"):
        ctx.unroll(problem.step, ctx.data["x0"], schedule=ds.Reversible())
