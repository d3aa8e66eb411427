"""Linear stability of the reversible steppers (deepsolve.stability): the per-mode matrices
against the steppers run on y' = mu y, the Krylov modes against a dense eigensolver, and the
unroll's refusal of a reversible step used outside its region — or, where it is inside, the
gradient of plain autograd through the same forward. Diffusion, a stiff reaction and a
leapfrog step beyond h omega = 2 are refused before the forward sweep; advection, a neural
vector field whose linearisation predicts a growth the trajectory does not keep, and the
couplings the error suggests are run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import deepsolve as ds
from deepsolve import reversible as rv
from deepsolve import stability as st

pytestmark = pytest.mark.usefixtures("single_thread")

D = torch.float64
N = 64
DX = 1.0 / N


def laplacian(u: torch.Tensor) -> torch.Tensor:
    return (u.roll(1) - 2 * u + u.roll(-1)) / DX**2


def sine() -> torch.Tensor:
    return torch.sin(2 * math.pi * torch.arange(N, dtype=D) * DX)


def heat(dt: float, lam: float = 0.999, method: str = "rk4"):
    Dc = torch.nn.Parameter(torch.tensor(1.0, dtype=D))
    return rv.explicit(lambda t, u: Dc * laplacian(u), dt, method=method, lam=lam), Dc


def grad_of(step, x0, n, param, **kw):
    x = ds.unroll(step, x0, n, **kw)
    (g,) = torch.autograd.grad((step.solution(x) ** 2).sum(), param)
    return float(g), float(step.solution(x).detach().abs().max())


# -- the per-mode matrices ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["euler", "heun", "rk4"])
@pytest.mark.parametrize("lam", [0.999, 0.9])
@pytest.mark.parametrize("w", [-0.05, -0.5, 0.3j, -0.2 + 1.0j, 2.5j])
def test_coupled_matrix_predicts_the_stepper_on_a_scalar_mode(method, lam, w):
    """The coupled stepper on y' = mu y (complex scalar) multiplies its state by the matrix
    of coupled_matrix: 40 steps of the real stepper equal M^40 applied to (1, 1)."""
    mu = complex(w) / 0.1
    step = rv.explicit(lambda t, y: mu * y, 0.1, method=method, lam=lam)
    x = step.init(torch.ones(1, dtype=torch.complex128))
    for i in range(40):
        x = step(x, i)
    tab = rv.TABLEAUS[method]
    R = st.rk_stability_function(tab.a, tab.b, np.array([w, -w]))
    M = st.coupled_matrix(R[0] - 1, R[1] - 1, lam)
    want = np.linalg.matrix_power(M, 40) @ np.array([1, 1])
    got = np.array([complex(x[0]), complex(x[1])])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("w", [-0.05, 0.4j, -0.3 + 0.2j])
def test_heun_and_leapfrog_matrices_predict_their_steppers(w):
    mu = complex(w) / 0.1
    heun = rv.reversible_heun(lambda t, y: mu * y, 0.1)
    x = heun.init(torch.ones(1, dtype=torch.complex128))
    for i in range(30):
        x = heun(x, i)
    want = np.linalg.matrix_power(st.heun_matrix(np.array(w)), 30) @ np.array([1, 1])
    np.testing.assert_allclose([complex(x[0]), complex(x[1])], want, rtol=1e-10)
    kappa = -abs(mu) ** 2  # q'' = kappa q
    frog = rv.leapfrog(lambda q, t: kappa * q, 0.1)
    x = (torch.ones(1, dtype=D), torch.zeros(1, dtype=D))
    for i in range(30):
        x = frog(x, i)
    want = np.linalg.matrix_power(st.leapfrog_matrix(np.array(0.01 * kappa)), 30) @ [1, 0]
    np.testing.assert_allclose([float(x[0]), 0.1 * float(x[1])], want.real, rtol=1e-10)


def test_stability_function_is_the_taylor_polynomial_for_rk4():
    w = np.array([-0.3, 0.7j, -1 + 1j])
    tab = rv.TABLEAUS["rk4"]
    want = 1 + w + w**2 / 2 + w**3 / 6 + w**4 / 24
    np.testing.assert_allclose(st.rk_stability_function(tab.a, tab.b, w), want, rtol=1e-14)


def test_ritz_values_find_the_extremes_of_a_symmetric_operator():
    """12 Arnoldi steps on the periodic Laplacian find its most negative eigenvalue
    (-4 / dx^2) within 1 %, and every Ritz value lies inside the spectrum."""
    u = sine()
    flat = st.Flat(u)
    found = st.ritz(st.jvp(laplacian, u, flat), flat)
    lo = -4 / DX**2
    assert min(found.values.real) == pytest.approx(lo, rel=1e-2)
    assert np.all(found.values.real <= 1e-6) and np.all(found.values.real >= lo * (1 + 1e-9))
    assert np.all(abs(found.values.imag) < 1e-6 * abs(lo))


# -- diffusion: refused, and the fix it names works ------------------------------------------


def test_issue_repro_heat_with_default_coupling_is_refused_before_the_forward():
    """The report's repro: RK4 coupled with lam = 0.999 on a 64-point heat equation
    (dt |mu|max = 0.033, where plain RK4 is stable) explodes to 1e10 after 2000 steps; the
    unroll refuses it in one line naming the coupling and the fix, before any step runs."""
    step, _ = heat(2e-6)
    calls = []
    inner = step.increment
    step.increment = lambda y, t, h: calls.append(t) or inner(y, t, h)
    with pytest.raises(ds.StabilityError) as err:
        ds.unroll(step, step.init(sine()), 2000, budget="100KiB")
    msg = str(err.value)
    assert "\n" not in msg and "unstable" in msg and "lam <=" in msg and "dt <=" in msg
    assert "h·μ = -0.03" in msg
    # no forward sweep: the analysis evaluates the field, the steps (2 increments each) at most
    # along the measured trajectory, never through a recorded unroll
    assert len(calls) < 2 * 2000 * 4


def test_the_suggested_coupling_gives_a_stable_forward_and_the_plain_gradient():
    """lam at the bound the error names: the same budgeted unroll runs, its solution stays
    below its initial maximum (heat decays), and its gradient equals plain autograd through
    the same forward within 1e-10."""
    step, _ = heat(2e-6)
    with pytest.raises(ds.StabilityError) as err:
        ds.unroll(step, step.init(sine()), 2000)
    lam = float(str(err.value).split("lam <= ")[1].split(",")[0].split(" ")[0])
    assert 0.9 < lam < 0.99
    step, Dc = heat(2e-6, lam)
    got, top = grad_of(step, step.init(sine()), 2000, Dc, budget="100KiB")
    want, top_plain = grad_of(step, step.init(sine()), 2000, Dc)
    assert top <= 1.0 and top == pytest.approx(top_plain, rel=1e-12)
    assert got == pytest.approx(want, rel=1e-10)
    # and it agrees with plain RK4 (not reversible) to the schemes' accuracy
    Dp = torch.nn.Parameter(torch.tensor(1.0, dtype=D))
    inc = rv.rk_increment(lambda t, u: Dp * laplacian(u))
    x = ds.unroll(lambda u, i: u + inc(u, i * 2e-6, 2e-6), sine(), 2000)
    (g_rk4,) = torch.autograd.grad((x**2).sum(), Dp)
    assert got == pytest.approx(float(g_rk4), rel=1e-3)


@pytest.mark.parametrize("method", ["euler", "heun", "ssprk3"])
def test_other_base_methods_on_diffusion_are_refused(method):
    step, _ = heat(5e-6, method=method)
    with pytest.raises(ds.StabilityError, match="unstable for this step"):
        ds.unroll(step, step.init(sine()), 1000)


def test_a_bare_increment_is_analysed_too():
    """coupled(increment) (no vector field): the modes from the increments' Jacobians."""
    Dc = torch.tensor(1.0, dtype=D)
    step = rv.coupled(rv.rk_increment(lambda t, u: Dc * laplacian(u)), 2e-6)
    rep = step.stability(step.init(sine()))
    assert rep.excess == pytest.approx(0.999 / math.exp(-4 * 2e-6 / DX**2), rel=2e-3)
    with pytest.raises(ds.StabilityError, match="lam <="):
        ds.unroll(step, step.init(sine()), 2000)


def test_reversible_heun_on_diffusion_is_refused_and_a_coupling_is_suggested():
    Dc = torch.tensor(1.0, dtype=D)
    step = rv.reversible_heun(lambda t, u: Dc * laplacian(u), 2e-6)
    with pytest.raises(ds.StabilityError, match="method='heun', lam=0.9"):
        ds.unroll(step, step.init(sine()), 2000, schedule=ds.Reversible())


def test_stiff_reaction_diffusion_is_refused_before_its_forward_goes_to_nan():
    """A bistable reaction k u (1 - u)(u - 0.3) with k = 2000 beside diffusion: plain RK4
    is stable at dt = 1e-3 (its Jacobian's |h mu| is below 2.8), the coupled one goes to NaN
    within ten steps; the unroll says so (the step where the forward stops being finite)
    instead of returning NaN or reporting a drift."""
    k = torch.tensor(2000.0, dtype=D)
    x = torch.arange(N, dtype=D) * DX
    u0 = 0.5 + 0.4 * torch.sin(2 * math.pi * x)

    def f(t, u):
        return 1e-3 * laplacian(u) + k * u * (1 - u) * (u - 0.3)

    step = rv.explicit(f, 1e-3)
    with pytest.raises(ds.StabilityError, match="stops being finite"):
        ds.unroll(step, step.init(u0), 2000, budget="100KiB")
    inc = rv.rk_increment(f)
    with torch.no_grad():
        out = ds.unroll(lambda u, i: u + inc(u, i * 1e-3, 1e-3), u0, 2000)
    assert bool(torch.isfinite(out).all()) and float(out.max()) <= 1.0 + 1e-6


# -- stable steps run, with the plain gradient ----------------------------------------------


def test_advection_is_stable_and_its_gradient_is_plain_autograds():
    """Central-difference advection: imaginary modes, inside the coupled RK4 region."""
    c = torch.nn.Parameter(torch.tensor(1.0, dtype=D))
    step = rv.explicit(lambda t, u: -c * (u.roll(-1) - u.roll(1)) / (2 * DX), 1e-2)
    rep = step.stability(step.init(sine()))
    assert rep.excess <= 1.0 and rep.stable(10_000)
    got, top = grad_of(step, step.init(sine()), 3000, c, schedule=ds.Reversible(every=300))
    want, _ = grad_of(step, step.init(sine()), 3000, c)
    assert top < 1.01 and got == pytest.approx(want, rel=1e-9)


def test_a_growth_the_trajectory_does_not_keep_is_measured_not_assumed():
    """A saturating neural field whose linearisation at x_0 has a decaying mode (reversible
    Heun grows it by 1.019 per step there): along the trajectory the field saturates, and
    the growth measured over the unroll keeps the error far below the tolerance, so the
    unroll runs; without the measurement it would be refused."""
    g = torch.Generator().manual_seed(3)
    W = 0.4 * torch.randn(6, 6, generator=g, dtype=D)
    b = 0.1 * torch.randn(6, generator=g, dtype=D)

    def f(t, y):
        return torch.tanh(y @ W.T + b) * (1 + 0.1 * math.sin(t)) - 0.05 * y

    y0 = torch.randn(2, 6, dtype=D, generator=torch.Generator().manual_seed(2))
    step = rv.reversible_heun(f, 0.02)
    at_start = step.stability(step.init(y0))
    assert at_start.excess > 1.01 and not at_start.stable(1000)
    measured = step.stability(step.init(y0), 0, 1000)
    assert measured.trajectory and len(measured.trajectory) == 1000
    assert measured.stable(1000)
    x = ds.unroll(step, step.init(y0), 1000)
    assert bool(torch.isfinite(x[0]).all())


# -- leapfrog -------------------------------------------------------------------------------


def test_leapfrog_beyond_h_omega_two_is_refused_and_the_named_dt_runs():
    k = torch.tensor(1.0, dtype=D)
    step = rv.leapfrog(lambda q, t: k * laplacian(q), 0.02)  # h omega = 0.02 * 128 = 2.56
    q0 = (sine(), torch.zeros(N, dtype=D))
    with pytest.raises(ds.StabilityError, match=r"h·ω = 2\.5.*dt <= ") as err:
        ds.unroll(step, q0, 500)
    dt = float(str(err.value).split("dt <= ")[1].split(" ")[0])
    assert dt < 2 / (2 / DX)
    ok = rv.leapfrog(lambda q, t: k * laplacian(q), dt)
    assert ok.stability(q0).stable(500)
    with torch.no_grad():
        q, _ = ds.unroll(ok, q0, 500)
    assert float(q.abs().max()) < 1.5


# -- the planner ----------------------------------------------------------------------------


def test_planner_bounds_reversible_windows_by_the_inverse_growth():
    """The report's item 8: lam = 0.5 on the heat step (forward stable, the inverse
    amplifying rounding by about 2 per step). Whatever the planner picks under a budget,
    its windows stay within what the inverse can rebuild and the gradient is plain
    autograd's; a window of 200 steps (what it picked before) drifts by 1e40."""
    step, Dc = heat(2e-5, 0.5)
    x0 = step.init(sine())
    want, _ = grad_of(step, x0, 2000, Dc)
    for budget in ("100KiB", "400KiB", "4MiB"):
        p = ds.plan(step, x0, 2000, budget=budget)
        if p.kind == "reversible":
            assert p.strategy.every <= 22
        got, _ = grad_of(step, x0, 2000, Dc, budget=budget)
        assert got == pytest.approx(want, rel=1e-8)
    with pytest.raises(ds.ReconstructionError, match=r"lam closer to 1 \(now 0.5\)"):
        grad_of(step, x0, 2000, Dc, schedule=ds.Reversible(every=200))


def test_planner_never_picks_reversible_for_a_step_that_draws_random_numbers():
    """The report's item 7: a step with an inverse that draws random numbers is not weighed
    as reversible (the plan says why), so budget= runs it, with the plain gradient."""
    a = torch.nn.Parameter(torch.tensor(0.3, dtype=D))

    def noisy(x, i):
        return x + 1e-3 * (a * x + 1e-2 * torch.randn_like(x))

    noisy.inverse = lambda x, i: x  # claims an inverse it cannot have
    x0 = torch.randn(4096, dtype=D, generator=torch.Generator().manual_seed(0))
    p = ds.plan(noisy, x0, 400, budget="1MiB")
    assert p.kind != "reversible"
    assert any("draws random numbers" in alt.note for alt in p.alternatives)
    torch.manual_seed(5)
    xa = ds.unroll(noisy, x0, 400, budget="1MiB")
    (got,) = torch.autograd.grad(xa.sum(), a)
    torch.manual_seed(5)
    xb = ds.unroll(noisy, x0, 400)
    (want,) = torch.autograd.grad(xb.sum(), a)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_planner_does_not_pick_reversible_for_an_unstable_step():
    step, _ = heat(2e-6)
    p = ds.plan(step, step.init(sine()), 2000, budget="100KiB")
    assert p.kind != "reversible"
    assert any("unstable" in alt.note for alt in p.alternatives)


def test_an_invertible_step_is_weighed_from_its_round_trip():
    """Your own invertible step has no analysis: the planner runs it forward and back and
    weighs the reversible schedule only when the round trip comes back within the
    tolerance."""
    good = rv.invertible(lambda x, i: x * 1.001 + 0.01, lambda x, i: (x - 0.01) / 1.001)
    bad = rv.invertible(lambda x, i: x * 1.001 + 0.01, lambda x, i: (x - 0.01) / 1.002)
    x0 = torch.ones(4096, dtype=D)
    p = ds.plan(good, x0, 2000, budget="200KiB")  # weighed (chosen or not: timings decide)
    assert any(alt.name.startswith("reversible(") for alt in p.alternatives)
    p = ds.plan(bad, x0, 2000, budget="200KiB")
    assert p.kind != "reversible"
    assert not any(alt.name.startswith("reversible(") for alt in p.alternatives)
    assert any("inverses back drift" in alt.note for alt in p.alternatives)
