"""Verification tests for :mod:`deepsolve.physics.burgers`.

All accuracy tests run in float64.  Each targets one ingredient: the exact
Cole--Hopf reference itself, the full solver against it (sign and size of the
nonlinear and viscous terms, both time steppers, a Galilean-boosted case with
non-zero mean), 4th-order temporal convergence, inviscid energy conservation of
the dealiased Galerkin system (fails without the 2/3 rule), mean conservation,
autograd (gradcheck), batching, float32 and the input checks.
"""

import math

import pytest
import torch
from helpers import rel_strict as _rel

from deepsolve.physics.burgers import (
    Burgers1D,
    Grid1D,
    cfl_numbers,
    cole_hopf,
    derivative,
    energy,
    etdrk4_coefficients,
    momentum,
    nonlinear_hat,
    random_initial,
    spectral_operators,
    to_physical,
    to_spectral,
)
from deepsolve.physics.grids import PeriodicGrid, grid_operators
from deepsolve.physics.time_stepping import etdrk4, etdrk4_phi, rk4

DT64 = torch.float64
METHODS = ["etdrk4", "rk4"]

# A Cole-Hopf case with two modes, phases and a drift (mean velocity 0.7): max|u| ~ 1.1.
MULTI = dict(a=1.0, amplitudes=(0.4, 0.3), wavenumbers=(1, 3), phases=(0.3, 1.0), drift=0.7)


# one intra-op thread: these grids are tiny and the test machines have 2 shared cores
pytestmark = pytest.mark.usefixtures("single_thread")


def _solve_cole_hopf(n: int, nu: float, dt: float, t_end: float, method: str, **case) -> float:
    grid = Grid1D(n)
    u0 = cole_hopf(grid, 0.0, nu, dtype=DT64, **case)
    n_steps = round(t_end / dt)
    u = Burgers1D(grid, nu, dt, method).advance(u0, n_steps)
    return _rel(u, cole_hopf(grid, n_steps * dt, nu, dtype=DT64, **case))


# --------------------------------------------------------------------------
# The exact reference
# --------------------------------------------------------------------------


def test_cole_hopf_solves_burgers():
    """The closed form satisfies u_t + u u_x = nu u_xx (spectral x, centred t differences)."""
    grid, nu, t, h = Grid1D(128), 0.1, 0.4, 1e-4
    u = cole_hopf(grid, t, nu, dtype=DT64, **MULTI)
    u_t = (cole_hopf(grid, t + h, nu, dtype=DT64, **MULTI)
           - cole_hopf(grid, t - h, nu, dtype=DT64, **MULTI)) / (2 * h)
    res = u_t + u * derivative(u, grid) - nu * derivative(u, grid, 2)
    assert float(res.abs().max()) < 1e-7 * float(u_t.abs().max())
    # t = 0 is -2 nu phi_x / phi + drift with phi = a + sum b cos(m x + theta)
    x = grid.coords(DT64)
    phi = 1.0 + 0.4 * torch.cos(x + 0.3) + 0.3 * torch.cos(3 * x + 1.0)
    dphi = -0.4 * torch.sin(x + 0.3) - 0.9 * torch.sin(3 * x + 1.0)
    u0 = cole_hopf(grid, 0.0, nu, dtype=DT64, **MULTI)
    assert torch.allclose(u0, 0.7 - 2 * nu * dphi / phi, rtol=0, atol=1e-15)
    assert float(momentum(u0, grid)) == pytest.approx(0.7 * grid.length, rel=1e-13)


def test_cole_hopf_checks_positivity():
    with pytest.raises(ValueError, match="positive"):
        cole_hopf(Grid1D(16), 0.0, 0.1, a=0.5, amplitudes=(0.6,))
    with pytest.raises(ValueError, match="nu > 0"):
        cole_hopf(Grid1D(16), 0.0, 0.0)


# --------------------------------------------------------------------------
# Solver vs exact solution; temporal order
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_matches_cole_hopf(method):
    # single mode, a/b = 1/0.6: coefficients ~ exp(-1.1 m), resolved to round-off at n = 128
    err = _solve_cole_hopf(128, 0.1, 0.01, 1.0, method, a=1.0, amplitudes=(0.6,))
    assert err < 1e-11
    # two modes, phases and non-zero mean (Galilean boost), max|u| ~ 1.1, t = 1
    err = _solve_cole_hopf(128, 0.1, 0.005, 1.0, method, **MULTI)
    assert err < 1e-9


@pytest.mark.parametrize("method", METHODS)
def test_fourth_order_in_time(method):
    # n = 192 puts the spatial error (~1e-14) well below the smallest temporal one (~1e-12);
    # the largest dt is inside RK4's diffusive limit (dt nu k_max^2 = 2.4).
    dts = [0.006, 0.003, 0.0015]
    errs = [_solve_cole_hopf(192, 0.1, dt, 0.6, method, **MULTI) for dt in dts]
    orders = [math.log2(e0 / e1) for e0, e1 in zip(errs, errs[1:], strict=False)]
    assert errs[-1] < 1e-11
    for p in orders:
        assert 3.9 < p < 4.1, (errs, orders)


def test_etdrk4_takes_stiff_steps():
    """ETDRK4 integrates the diffusion exactly: stable and accurate far past RK4's limit."""
    grid, nu, dt = Grid1D(128), 0.1, 0.04
    u0 = cole_hopf(grid, 0.0, nu, dtype=DT64, a=1.0, amplitudes=(0.6,))
    adv, diff = cfl_numbers(u0, grid, dt, nu)
    assert diff > 2.78 and adv < 1  # beyond RK4's diffusive limit
    assert _solve_cole_hopf(128, nu, dt, 1.0, "etdrk4", a=1.0, amplitudes=(0.6,)) < 1e-9


def test_etdrk4_coefficients_limits():
    """z -> 0 limits (nu = 0): q = dt/2, f1 = f2 = f3 = dt/6, e = e2 = 1 (classical RK4)."""
    c = etdrk4_coefficients(Grid1D(16), 0.1, 0.0, DT64)
    assert torch.allclose(c.q, torch.full_like(c.q, 0.05), rtol=1e-14, atol=0)
    for f in (c.f1, c.f2, c.f3):
        assert torch.allclose(f, torch.full_like(f, 0.1 / 6), rtol=1e-14, atol=0)
    assert torch.equal(c.e, torch.ones_like(c.e))
    # a large |z|: the closed forms without cancellation
    c = etdrk4_coefficients(Grid1D(16), 1.0, 10.0, DT64)
    z = -10.0 * 7.0**2
    assert float(c.f1[7]) == pytest.approx((-4 - z + math.exp(z) * (4 - 3 * z + z * z)) / z**3,
                                           rel=1e-12)
    assert float(c.q[7]) == pytest.approx((math.exp(z / 2) - 1) / z, rel=1e-12)


# --------------------------------------------------------------------------
# Conservation
# --------------------------------------------------------------------------


def test_galerkin_nonlinear_term_conserves_energy():
    """<u, N(u)> = 0 exactly, even for a field with every mode up to Nyquist."""
    grid = Grid1D(64)
    u = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), dtype=DT64)
    ops = spectral_operators(grid, DT64)
    nl = to_physical(nonlinear_hat(to_spectral(u), ops, grid.n), grid.n)
    scale = (u * u).sum(-1) * nl.abs().amax(-1)
    assert float(((u * nl).sum(-1) / scale).abs().max()) < 1e-15


@pytest.mark.parametrize("method", METHODS)
def test_inviscid_energy_conservation(method):
    """nu = 0 before the shock (t* ~ 0.75): only the O(dt^4) time error changes E."""
    grid = Grid1D(64)
    u0 = random_initial(grid, torch.Generator().manual_seed(1), peak_wavenumber=6.0, rms=0.5,
                        dtype=DT64)
    assert float(-derivative(u0, grid).min()) < 1.4  # shock time > 0.7
    errs = []
    for dt in (2e-3, 1e-3):
        u = Burgers1D(grid, 0.0, dt, method).advance(u0, round(0.25 / dt))
        errs.append(abs(float(energy(u, grid) / energy(u0, grid) - 1)))
        assert _rel(u, u0) > 0.05  # it did evolve
    assert errs[0] < 1e-11  # without the 2/3 rule this is ~1e-7
    assert errs[1] < errs[0] / 8 or errs[1] < 1e-14


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nu", [0.0, 0.05])
def test_mean_conservation(method, nu):
    grid = Grid1D(64)
    u0 = random_initial(grid, torch.Generator().manual_seed(2), rms=0.5, mean=0.8, dtype=DT64)
    u = Burgers1D(grid, nu, 2e-3, method).advance(u0, 200)
    assert _rel(u, u0) > 0.05
    assert float(momentum(u, grid)) == pytest.approx(0.8 * grid.length, rel=1e-13)


def test_energy_decays_with_viscosity():
    grid, nu = Grid1D(64), 0.05
    u0 = random_initial(grid, torch.Generator().manual_seed(3), rms=0.5, dtype=DT64)
    s = Burgers1D(grid, nu, 1e-3)
    u1 = s.advance(u0, 1)
    de_dt = float(energy(u1, grid) - energy(u0, grid)) / 1e-3
    dissipation = -nu * float((derivative(u0, grid) ** 2).sum() * grid.dx)
    assert de_dt == pytest.approx(dissipation, rel=2e-3)


# --------------------------------------------------------------------------
# Autograd, batching, dtypes, devices
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_gradcheck_through_steps(method):
    grid = Grid1D(12)
    u0 = random_initial(grid, torch.Generator().manual_seed(4), batch_shape=(2,), rms=0.7,
                        dtype=DT64).requires_grad_(True)
    s = Burgers1D(grid, 0.1, 0.05, method)

    def f(u):
        for _ in range(3):
            u = s.step(u)
        return u

    assert torch.autograd.gradcheck(f, (u0,))


def test_gradcheck_viscosity_rk4():
    grid = Grid1D(12)
    u0 = random_initial(grid, torch.Generator().manual_seed(5), rms=0.7, dtype=DT64)
    nu = torch.tensor([[0.1], [0.2]], dtype=DT64, requires_grad=True)

    def f(nu):
        s = Burgers1D(grid, nu, 0.05, "rk4")
        return s.advance(u0.expand(2, -1), 3)

    assert torch.autograd.gradcheck(f, (nu,))


def test_step_does_not_modify_input():
    grid = Grid1D(16)
    u0 = random_initial(grid, torch.Generator().manual_seed(6), dtype=DT64)
    copy = u0.clone()
    for method in METHODS:
        Burgers1D(grid, 0.1, 0.01, method).step(u0)
    assert torch.equal(u0, copy)


@pytest.mark.parametrize("method", METHODS)
def test_batch_equals_per_member(method):
    grid = Grid1D(32)
    u0 = random_initial(grid, torch.Generator().manual_seed(7), batch_shape=(2, 3), rms=0.5,
                        dtype=DT64)
    s = Burgers1D(grid, 0.05, 0.01, method)
    batched = s.advance(u0, 20)
    assert batched.shape == (2, 3, 32)
    for i in range(2):
        for j in range(3):
            assert torch.allclose(batched[i, j], s.advance(u0[i, j], 20), rtol=0, atol=1e-14)


@pytest.mark.parametrize("method", METHODS)
def test_float32(method):
    grid, nu = Grid1D(64), 0.1
    u0 = cole_hopf(grid, 0.0, nu, dtype=torch.float32, **MULTI)
    assert u0.dtype == torch.float32
    u = Burgers1D(grid, nu, 0.01, method).advance(u0, 50)
    assert u.dtype == torch.float32
    assert _rel(u.double(), cole_hopf(grid, 0.5, nu, dtype=DT64, **MULTI)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_matches_cpu(method):
    grid, nu = Grid1D(64), 0.1
    u0 = cole_hopf(grid, 0.0, nu, dtype=DT64, **MULTI)
    s = Burgers1D(grid, nu, 0.01, method)
    u_gpu = s.advance(u0.cuda(), 50)
    assert u_gpu.device.type == "cuda"
    assert torch.allclose(u_gpu.cpu(), s.advance(u0, 50), rtol=0, atol=1e-12)


def test_random_initial_properties():
    grid = Grid1D(48)
    u = random_initial(grid, torch.Generator().manual_seed(8), batch_shape=(4,), rms=0.3,
                       mean=0.2, max_wavenumber=5, dtype=DT64)
    assert u.shape == (4, 48)
    assert torch.allclose(u.mean(-1), torch.full((4,), 0.2, dtype=DT64), atol=1e-14)
    assert torch.allclose((u - 0.2).pow(2).mean(-1).sqrt(), torch.full((4,), 0.3, dtype=DT64))
    spec = to_spectral(u).abs()
    assert float(spec[..., 6:].max()) < 1e-15


def test_input_checks():
    with pytest.raises(ValueError):
        Grid1D(1)
    with pytest.raises(ValueError, match="method"):
        Burgers1D(Grid1D(8), 0.1, 0.01, "euler")
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        Burgers1D(Grid1D(8), 0.1, 0.01).step(torch.zeros(7, dtype=DT64))
    with pytest.raises(TypeError, match="rk4"):
        Burgers1D(Grid1D(8), torch.tensor(0.1, requires_grad=True), 0.01, "etdrk4")
    with pytest.raises(ValueError, match=">= 0"):
        Burgers1D(Grid1D(8), -0.1, 0.01)


# --------------------------------------------------------------------------
# The shared kit: time steppers and the 1D grid
# --------------------------------------------------------------------------


def test_rk4_linear_fourth_order():
    """du/dt = lambda u: one step is R(z) = 1 + z + z^2/2 + z^3/6 + z^4/24; error ~ dt^4."""
    lam = torch.tensor([-1 + 3j, -0.2 - 1j], dtype=torch.complex128)  # per-member rates
    u0 = torch.tensor([1 + 0j, 0.5 - 0.2j], dtype=torch.complex128)
    z = 0.1 * lam
    r = 1 + z + z**2 / 2 + z**3 / 6 + z**4 / 24
    assert float((rk4(lambda v: lam * v, u0, 0.1) - r * u0).abs().max()) < 1e-15
    errs = []
    for dt in (0.1, 0.05, 0.025):
        u = u0
        for _ in range(round(1.0 / dt)):
            u = rk4(lambda v: lam * v, u, dt)
        errs.append(float((u - u0 * torch.exp(lam)).abs().max()))
    orders = [math.log2(e0 / e1) for e0, e1 in zip(errs, errs[1:], strict=False)]
    assert errs[-1] < 1e-6
    for p in orders:
        assert 3.9 < p < 4.1, (errs, orders)


def test_etdrk4_logistic_fourth_order_and_exact_linear_part():
    """u' = a u - u^2 (a < 0), exact u = a u0 e^{at} / (a + u0 (e^{at} - 1)); ETDRK4 is 4th order,
    and with N = 0 it is the exact exponential even for a stiff a dt."""
    a = torch.tensor([-3.0], dtype=DT64)
    u0 = torch.tensor([0.5], dtype=DT64)
    t_end = 2.0
    exact = a * u0 * torch.exp(a * t_end) / (a + u0 * torch.expm1(a * t_end))
    errs = []
    for dt in (0.1, 0.05, 0.025):
        coeffs = etdrk4_phi(dt * a, dt)
        u = u0
        for _ in range(round(t_end / dt)):
            u = etdrk4(lambda v: -v * v, u, coeffs)
        errs.append(float((u - exact).abs().max()))
    orders = [math.log2(e0 / e1) for e0, e1 in zip(errs, errs[1:], strict=False)]
    assert errs[-1] < 1e-9
    for p in orders:
        assert 3.9 < p < 4.1, (errs, orders)
    stiff = torch.tensor([[-500.0, -2.0], [0.0, -1e-8]], dtype=DT64)  # any shape of L
    c = etdrk4_phi(0.1 * stiff, 0.1)
    v = torch.ones_like(stiff)
    torch.testing.assert_close(etdrk4(torch.zeros_like, v, c), torch.exp(0.1 * stiff),
                               rtol=1e-15, atol=0)
    # z = 0 and z -> 0: e = 1, q = dt/2, f1 = f2 = f3 = dt/6 (no cancellation near 0)
    assert float(c.e[1, 0]) == 1.0 and float(c.q[1, 0]) == pytest.approx(0.05, rel=1e-14)
    for f in (c.q, c.f1, c.f2, c.f3):
        assert float(f[1, 1]) == pytest.approx(float(f[1, 0]), rel=1e-8)
    for f in (c.f1, c.f2, c.f3):
        assert float(f[1, 0]) == pytest.approx(0.1 / 6, rel=1e-14)


def test_grid1d_is_the_1d_periodic_grid():
    """Grid1D's operators, derivative and checks are those of PeriodicGrid((n,), (L,))."""
    grid = Grid1D(16, 3.0)
    assert isinstance(grid, PeriodicGrid)
    assert (grid.shape, grid.lengths, grid.rfft_shape) == ((16,), (3.0,), (9,))
    assert (grid.n, grid.length, grid.rfft_size, grid.m_max) == (16, 3.0, 9, 5)
    generic = grid_operators(PeriodicGrid((16,), 3.0), DT64)
    ops = grid.operators(DT64)
    assert torch.equal(ops.k, generic.k_odd[0]) and torch.equal(ops.k2, generic.k2)
    assert torch.equal(ops.mask, generic.mask)
    assert float(ops.k[8]) == 0.0 and float(generic.k[0][8]) == pytest.approx(8 * 2 * math.pi / 3)
    assert ops.mask.tolist() == [1.0] * 6 + [0.0] * 3  # 3|m| < 16: m <= 5
    x = grid.coords(DT64)
    k = 3 * grid.k0
    u = torch.sin(k * x + 0.4)
    torch.testing.assert_close(derivative(u, grid), k * torch.cos(k * x + 0.4), rtol=0,
                               atol=1e-13)
    torch.testing.assert_close(derivative(u, grid, 2), grid.laplacian(u), rtol=0, atol=1e-12)
    torch.testing.assert_close(derivative(u, grid, 2), -(k**2) * u, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"rfft coefficients of shape \(\.\.\., 9\)"):
        grid.check_spectral(torch.zeros(8, dtype=torch.complex128))
