"""Verification tests for :mod:`deepsolve.physics.navier_stokes`.

All tests run in float64 on small grids.  Each one targets one ingredient of
the solver (linear part, advection sign, forcing sign, conservation of the
nonlinear term, temporal order, energy budget, velocity recovery, autograd,
filtering, batching) so that breaking that ingredient makes it fail.
"""

import math

import pytest
import torch
from helpers import rel_strict as _rel

from deepsolve.physics import (
    Grid,
    NavierStokes2D,
    energy,
    enstrophy,
    filter_to,
    kolmogorov_forcing,
    random_initial,
    taylor_green,
    to_spectral,
    velocity,
)
from deepsolve.physics.grids import PeriodicGrid, grid_operators
from deepsolve.physics.initial import filtered_noise

DT64 = torch.float64


# one intra-op thread (conftest.single_thread): tiny-grid FFT loops
pytestmark = pytest.mark.usefixtures("single_thread")


def _field(grid: Grid, seed: int, energy_level: float = 0.5, **kw) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return random_initial(grid, gen, energy_level=energy_level, dtype=DT64, **kw)


# --------------------------------------------------------------------------
# Linear part + RK4: Taylor-Green vortex
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "alpha"),
    [(2 * math.pi, 0.0), (2 * math.pi, 0.1), (1.0, 0.0)],
)
def test_taylor_green_decay(length, alpha):
    """TG vorticity decays as exp(-(2 nu k^2 + alpha) t); advection vanishes identically.

    nu is scaled with k^2 so that the decay over the run is the same (~18 %
    without drag) for both domain lengths; this checks the wavenumber scaling,
    the viscous and drag terms and RK4 (whose per-step error here is
    (lambda dt)^5/120 ~ 1e-17).
    """
    grid = Grid(32, length)
    k = grid.k0
    nu = 0.05 / k**2
    dt, n_steps = 0.02, 100
    ns = NavierStokes2D(grid, nu=nu, dt=dt, alpha=alpha)
    w0 = taylor_green(grid, 1, nu=nu, alpha=alpha, dtype=DT64)
    w = ns.advance(w0, n_steps)
    exact = taylor_green(grid, 1, nu=nu, alpha=alpha, t=dt * n_steps, dtype=DT64)
    assert float(exact.norm() / w0.norm()) < 0.83  # decay is actually tested
    assert _rel(w, exact) < 1e-12


def test_taylor_green_velocity_sign_convention():
    """u = psi_y, v = -psi_x with lap(psi) = -omega gives the TG velocity field."""
    grid = Grid(16)
    x, y = grid.mesh(DT64)
    w = taylor_green(grid, 2, amplitude=0.7, dtype=DT64)
    u, v = velocity(w, grid)
    torch.testing.assert_close(u, 0.7 * torch.sin(2 * x) * torch.cos(2 * y), rtol=0, atol=1e-13)
    torch.testing.assert_close(v, -0.7 * torch.cos(2 * x) * torch.sin(2 * y), rtol=0, atol=1e-13)


# --------------------------------------------------------------------------
# Nonlinear term: sign, conservation, temporal order
# --------------------------------------------------------------------------


def test_advection_sign_analytic():
    """omega = cos x + cos 2y: d omega/dt = -u.grad omega = 1.5 sin x sin 2y (nu = 0)."""
    grid = Grid(16)
    x, y = grid.mesh(DT64)
    w = torch.cos(x) + torch.cos(2 * y)
    rhs = NavierStokes2D(grid, nu=0.0, dt=0.01).rhs(w)
    torch.testing.assert_close(rhs, 1.5 * torch.sin(x) * torch.sin(2 * y), rtol=0, atol=1e-13)


def test_inviscid_conservation_and_order():
    """Inviscid, unforced flow conserves E and Z; the drift comes from RK4 only.

    The 2/3-dealiased Galerkin system conserves E and Z exactly in continuous
    time, so the drift measured here is pure time-discretisation error.  The
    initial field is band-limited (|k| <= 6, peak 3, E = 1/4) on N = 32, a
    strongly nonlinear run (many eddy turnovers by T = 5, enstrophy cascades
    to the truncation scale).  dt = 0.01 and 0.005 keep the drift well above
    round-off (~1e-13) so the ratio is meaningful.

    Observed: the drift of these *quadratic invariants* falls by ~2^5 (ratio
    ~29-34) per halving of dt, one order better than RK4's 4th-order
    trajectory error (see ``test_rk4_fourth_order_convergence``, ratio ~16):
    for a skew linear system RK4 gives |R(iz)|^2 = 1 - z^6/72 + O(z^8).  We
    therefore require the ratio to be at least 16 (4th order or better), and
    at most 45 for enstrophy (whose drift is monotone in this run).
    """
    grid = Grid(32)
    w0 = _field(grid, 0, energy_level=0.25, peak_wavenumber=3.0, max_wavenumber=6)
    e0, z0 = energy(w0, grid), enstrophy(w0)
    t_end = 5.0
    errs = []
    for dt in (0.01, 0.005):
        w = NavierStokes2D(grid, nu=0.0, dt=dt).advance(w0, round(t_end / dt))
        errs.append((abs(float((energy(w, grid) - e0) / e0)), abs(float((enstrophy(w) - z0) / z0))))
    (de1, dz1), (de2, dz2) = errs
    assert de2 < 1e-9 and dz2 < 1e-9
    assert de1 > 1e-10 and dz1 > 1e-9  # dominated by time-stepping error, not round-off
    assert de1 / de2 > 16
    assert 16 < dz1 / dz2 < 45


def test_rk4_fourth_order_convergence():
    """Trajectory error of the full nonlinear problem falls by 2^4 per halving of dt."""
    grid = Grid(32)
    w0 = _field(grid, 0, energy_level=0.25, peak_wavenumber=3.0, max_wavenumber=6)
    sols = [
        NavierStokes2D(grid, nu=0.0, dt=dt).advance(w0, round(2.0 / dt))
        for dt in (0.02, 0.01, 0.005)
    ]
    e1 = float((sols[0] - sols[1]).norm())
    e2 = float((sols[1] - sols[2]).norm())
    assert e1 > 1e-8 * float(sols[2].norm())
    assert 14 < e1 / e2 < 18


# --------------------------------------------------------------------------
# Forcing, drag, viscosity: Kolmogorov flow and the energy budget
# --------------------------------------------------------------------------


def test_kolmogorov_forcing_sign_and_laminar_spinup():
    """F = F0 sin(kf y) x-hat has curl f = -F0 kf cos(kf y); from rest the flow
    spins up to u = U sin(kf y) (1 - e^{-lambda t}), U = F0/lambda, lambda = nu kf^2 + alpha."""
    grid = Grid(32)
    f0, m, nu, alpha = 0.8, 4, 0.02, 0.1
    force = kolmogorov_forcing(grid, f0, m, dtype=DT64)
    ns = NavierStokes2D(grid, nu=nu, dt=0.01, alpha=alpha, forcing=force)
    _, y = grid.mesh(DT64)
    kf = m * grid.k0
    torch.testing.assert_close(
        ns.vorticity_forcing(), -f0 * kf * torch.cos(kf * y), rtol=0, atol=1e-12
    )

    lam = nu * kf**2 + alpha
    steps = 100
    w = ns.advance(torch.zeros(32, 32, dtype=DT64), steps)
    big_u = f0 / lam
    exact = -big_u * kf * -math.expm1(-lam * 0.01 * steps) * torch.cos(kf * y)
    assert _rel(w, exact) < 1e-10
    # the laminar state is a fixed point
    w_lam = -big_u * kf * torch.cos(kf * y)
    assert _rel(ns.advance(w_lam, 10), w_lam) < 1e-13


def _turbulent_kolmogorov(nu=0.01, alpha=0.1, dt=0.01, cross_force=0.0):
    grid = Grid(32)
    force = kolmogorov_forcing(grid, 1.0, 4, dtype=DT64)
    if cross_force:  # add F_y = c sin(3x) so that both force components are exercised
        x, _ = grid.mesh(DT64)
        force = force + torch.stack((torch.zeros_like(x), cross_force * torch.sin(3 * x)))
    w = _field(grid, 1, energy_level=0.5, peak_wavenumber=3.0)
    w = NavierStokes2D(grid, nu=nu, dt=dt, alpha=alpha, forcing=force).advance(w, 50)
    return grid, force, w


def test_energy_budget_centred_difference():
    """dE/dt = -2 nu Z - 2 alpha E + <u.F>, with dE/dt from a centred difference (h = 1e-3)."""
    nu, alpha, h = 0.01, 0.1, 1e-3
    grid, force, w_prev = _turbulent_kolmogorov(nu, alpha)
    ns = NavierStokes2D(grid, nu=nu, dt=h, alpha=alpha, forcing=force)
    w_mid = ns.step(w_prev)
    w_next = ns.step(w_mid)
    dedt = (ns.energy(w_next) - ns.energy(w_prev)) / (2 * h)
    terms = (
        -2 * nu * ns.enstrophy(w_mid),
        -2 * alpha * ns.energy(w_mid),
        ns.energy_injection(w_mid),
    )
    rate = sum(terms)
    assert all(abs(float(t)) > 0.05 for t in terms)  # every term matters
    torch.testing.assert_close(ns.energy_rate(w_mid), rate)
    assert abs(float((dedt - rate) / rate)) < 1e-4


def test_energy_budget_simpson():
    """Delta E over 10 steps equals the Simpson integral of the budget RHS.

    Kolmogorov forcing plus a y-directed body force 0.7 sin(3x) y-hat.
    """
    nu, alpha, dt, m = 0.05, 0.1, 0.01, 10
    grid, force, w = _turbulent_kolmogorov(nu, alpha, cross_force=0.7)
    ns = NavierStokes2D(grid, nu=nu, dt=dt, alpha=alpha, forcing=force)
    traj = [w]
    for _ in range(m):
        traj.append(ns.step(traj[-1]))
    rates = torch.stack([ns.energy_rate(x) for x in traj])
    simpson = dt / 3 * (rates[0] + rates[-1] + 4 * rates[1:-1:2].sum() + 2 * rates[2:-1:2].sum())
    delta_e = ns.energy(traj[-1]) - ns.energy(traj[0])
    assert abs(float(delta_e)) > 1e-3
    assert abs(float((delta_e - simpson) / simpson)) < 1e-4


# --------------------------------------------------------------------------
# Velocity recovery
# --------------------------------------------------------------------------


def _spectral_derivative(f: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
    ops = grid.operators(f.dtype, f.device)
    k = ops.kx if axis == "x" else ops.ky
    return torch.fft.irfft2(1j * k * to_spectral(f), s=(grid.n, grid.n), norm="forward")


@pytest.mark.parametrize("length", [2 * math.pi, 3.0])
def test_velocity_divergence_free_and_curl(length):
    grid = Grid(24, length)
    w = _field(grid, 3, peak_wavenumber=4.0 * grid.k0)
    u, v = velocity(w, grid)
    div = _spectral_derivative(u, grid, "x") + _spectral_derivative(v, grid, "y")
    curl = _spectral_derivative(v, grid, "x") - _spectral_derivative(u, grid, "y")
    scale = float(w.abs().max())
    assert float(div.abs().max()) < 1e-12 * scale
    assert float((curl - w).abs().max()) < 1e-12 * scale
    assert abs(float(w.mean())) < 1e-14 * scale


# --------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------


def test_gradcheck_initial_vorticity():
    grid = Grid(8)
    force = kolmogorov_forcing(grid, 0.5, 1, dtype=DT64)
    ns = NavierStokes2D(grid, nu=0.05, dt=0.05, alpha=0.1, forcing=force)
    w0 = _field(grid, 4, energy_level=1.0, peak_wavenumber=2.0).requires_grad_(True)

    def f(w):
        return ns.advance(w, 3)

    assert torch.autograd.gradcheck(f, (w0,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_parameters():
    """Gradients w.r.t. nu and a learnable body force (not cached across calls)."""
    grid = Grid(8)
    w0 = _field(grid, 5, energy_level=1.0, peak_wavenumber=2.0)
    nu = torch.tensor(0.05, dtype=DT64, requires_grad=True)
    force = (0.3 * kolmogorov_forcing(grid, 1.0, 1, dtype=DT64)).requires_grad_(True)

    def f(nu_, force_):
        return NavierStokes2D(grid, nu=nu_, dt=0.05, forcing=force_).advance(w0, 2)

    assert torch.autograd.gradcheck(f, (nu, force), eps=1e-6, atol=1e-8, rtol=1e-6)
    ns = NavierStokes2D(grid, nu=nu, dt=0.05, forcing=force)
    for _ in range(2):  # repeated forward/backward must not reuse a freed graph
        ns.energy(ns.advance(w0, 2)).backward()
    assert nu.grad is not None and force.grad is not None


def test_float32_matches_float64_and_backprops():
    grid = Grid(32)
    force = kolmogorov_forcing(grid, 1.0, 4, dtype=DT64)
    w64 = _field(grid, 6, peak_wavenumber=3.0)
    ns = NavierStokes2D(grid, nu=0.01, dt=0.01, alpha=0.1, forcing=force)
    out64 = ns.advance(w64, 20)
    w32 = w64.float().requires_grad_(True)
    out32 = ns.advance(w32, 20)
    assert out32.dtype == torch.float32
    assert _rel(out32.double(), out64) < 1e-5
    ns.energy(out32).backward()
    assert (
        w32.grad is not None and torch.isfinite(w32.grad).all() and float(w32.grad.abs().max()) > 0
    )


# --------------------------------------------------------------------------
# Filtering, batching, initial conditions
# --------------------------------------------------------------------------


def test_filter_to_preserves_low_modes():
    fine, coarse = Grid(64), Grid(16)
    w = _field(fine, 7, peak_wavenumber=8.0)  # energetic well beyond the coarse grid's band
    wc = filter_to(w, coarse.n)
    assert wc.shape == (16, 16)
    hf, hc = to_spectral(w), to_spectral(wc)
    kmax = (coarse.n - 1) // 2  # |m| <= 7 retained, coarse Nyquist dropped
    rows = torch.cat((torch.arange(kmax + 1), torch.arange(-kmax, 0)))
    torch.testing.assert_close(
        hc[rows % coarse.n, : kmax + 1], hf[rows % fine.n, : kmax + 1], rtol=0, atol=1e-15
    )
    assert float(hc[coarse.n // 2].abs().max()) < 1e-15 and float(hc[:, -1].abs().max()) < 1e-15
    assert float(hf[kmax + 1 : fine.n - kmax].abs().max()) > 1e-3  # something was removed
    # a field band-limited to the coarse grid is just resampled
    x, y = fine.mesh(DT64)
    xc, yc = coarse.mesh(DT64)
    g = torch.sin(3 * x - 2 * y) + 0.5 * torch.cos(7 * y)
    torch.testing.assert_close(
        filter_to(g, coarse.n),
        torch.sin(3 * xc - 2 * yc) + 0.5 * torch.cos(7 * yc),
        rtol=0,
        atol=1e-13,
    )
    # zero-padding back up is exact interpolation of the filtered field
    torch.testing.assert_close(filter_to(filter_to(wc, 64), 16), wc, rtol=0, atol=1e-13)


def test_batch_equals_members():
    grid = Grid(16)
    force = kolmogorov_forcing(grid, 1.0, 2, dtype=DT64)
    ns = NavierStokes2D(grid, nu=0.02, dt=0.02, alpha=0.05, forcing=force)
    gen = torch.Generator().manual_seed(8)
    batch = random_initial(grid, gen, batch_shape=(2, 3), peak_wavenumber=3.0, dtype=DT64)
    out = ns.advance(ns.step(batch), 4)
    assert out.shape == (2, 3, 16, 16)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(
                out[i, j], ns.advance(ns.step(batch[i, j]), 4), rtol=0, atol=1e-13
            )
    e = ns.energy(out)
    assert e.shape == (2, 3)
    assert float((e[0, 0] - ns.energy(out[0, 0])).abs()) < 1e-15


def test_random_initial_properties():
    grid = Grid(32)
    a = _field(grid, 9, energy_level=0.3, peak_wavenumber=3.0, max_wavenumber=6)
    b = _field(grid, 9, energy_level=0.3, peak_wavenumber=3.0, max_wavenumber=6)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert abs(float(energy(a, grid)) - 0.3) < 1e-14
    h = to_spectral(a)
    ops = grid.operators(DT64)
    assert abs(float(h[0, 0])) < 1e-16
    assert float(h.abs()[ops.k2 > 36.0 + 1e-9].max()) < 1e-15
    assert float(h.abs().max()) > 0.05


# --------------------------------------------------------------------------
# The shared n-d periodic grid
# --------------------------------------------------------------------------


def test_periodic_grid_3d_derivatives_and_laplacian():
    """On a 12 x 10 x 8 box with three lengths, the spectral derivative of
    sin(2 k1 x + 0.3) cos(3 k2 y) sin(3 k3 z) is the analytic one along each axis, batched."""
    grid = PeriodicGrid((12, 10, 8), (2 * math.pi, 3.0, 5.0))
    assert grid.rfft_shape == (12, 10, 5) and grid.ndim == 3
    x, y, z = grid.mesh(DT64)
    k1, k2, k3 = (m * k0 for m, k0 in zip((2, 3, 3), grid.fundamental, strict=True))
    sx, cx = torch.sin(k1 * x + 0.3), torch.cos(k1 * x + 0.3)
    sy, cy = torch.sin(k2 * y), torch.cos(k2 * y)
    sz, cz = torch.sin(k3 * z), torch.cos(k3 * z)
    u = sx * cy * sz
    batch = torch.stack((u, -2 * u))  # (2, 12, 10, 8)
    exact = (k1 * cx * cy * sz, -k2 * sx * sy * sz, k3 * sx * cy * cz)
    for axis, d_exact in enumerate(exact):
        d = grid.derivative(batch, axis)
        assert d.shape == batch.shape
        torch.testing.assert_close(d, torch.stack((d_exact, -2 * d_exact)), rtol=0, atol=1e-12)
    torch.testing.assert_close(grid.derivative(u, 0, order=3), -(k1**3) * cx * cy * sz,
                               rtol=0, atol=1e-11)
    torch.testing.assert_close(grid.laplacian(u), -(k1**2 + k2**2 + k3**2) * u, rtol=0,
                               atol=1e-11)
    # the Nyquist mode cos(pi z / dz): odd derivatives vanish, even ones keep -k_N^2
    nyq = torch.cos(math.pi * z / grid.spacing[2])
    k_n = 4 * grid.fundamental[2]
    assert float(grid.derivative(nyq, -1).abs().max()) < 1e-13
    torch.testing.assert_close(grid.derivative(nyq, -1, 2), -(k_n**2) * nyq, rtol=0, atol=1e-12)
    torch.testing.assert_close(grid.to_physical(grid.to_spectral(batch)), batch, rtol=0,
                               atol=1e-15)


def test_periodic_grid_dealiasing_is_exact_galerkin():
    """P rfft(u v) on the n grid equals the exact product (on a 2n grid) truncated to the band.

    Keeping one more mode (3|m| <= n) lets aliases of the product land on kept modes.
    """
    coarse, fine = Grid(12), Grid(24)
    mask = coarse.operators(DT64).mask
    m = torch.fft.fftfreq(12, d=1 / 12, dtype=DT64)
    keep = (3 * m.abs() < 12).to(DT64)
    assert torch.equal(mask, keep[:, None] * keep[None, : 7])  # |m_x|, |m_y| <= 3
    assert torch.equal(grid_operators(PeriodicGrid((12, 12)), DT64).mask, mask)
    gen = torch.Generator().manual_seed(10)
    r1, r2 = (coarse.to_spectral(torch.randn(2, 12, 12, dtype=DT64, generator=gen))
              for _ in range(2))

    def product_error(band: torch.Tensor) -> float:
        u, v = coarse.to_physical(band * r1), coarse.to_physical(band * r2)
        pseudo = band * coarse.to_spectral(u * v)
        exact = band * coarse.to_spectral(filter_to(filter_to(u, 24) * filter_to(v, 24), 12))
        return float((pseudo - exact).abs().max())

    assert fine.rfft_shape == (24, 13)
    assert product_error(mask) < 1e-15
    wide = (3 * m.abs() <= 12).to(DT64)  # |m| <= 4
    assert product_error(wide[:, None] * wide[None, :7]) > 1e-3
    torch.testing.assert_close(coarse.dealias(r1), mask * r1, rtol=0, atol=0)


def test_grid_is_the_2d_periodic_grid_and_checks_shapes():
    grid = Grid(16, 3.0)
    assert isinstance(grid, PeriodicGrid)
    assert (grid.shape, grid.lengths, grid.dims) == ((16, 16), (3.0, 3.0), (-2, -1))
    ops, generic = grid.operators(DT64), grid_operators(PeriodicGrid((16, 16), 3.0), DT64)
    assert torch.equal(ops.kx, generic.k_odd[0]) and torch.equal(ops.ky, generic.k_odd[1])
    assert torch.equal(ops.k2, generic.k2) and torch.equal(ops.inv_k2, generic.inv_k2)
    assert float(ops.kx[8, 0]) == 0.0 and float(generic.k[0][8, 0]) == pytest.approx(
        -8 * 2 * math.pi / 3)
    assert grid_operators(grid, torch.complex64).k2.dtype == torch.float32
    with pytest.raises(ValueError, match=r"field of shape \(\.\.\., 4, 6\), got \(3, 4, 5\)"):
        PeriodicGrid((4, 6)).check_field(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match=r"rfftn coefficients of shape \(\.\.\., 4, 6, 3\)"):
        PeriodicGrid((4, 6, 4)).check_spectral(torch.zeros(4, 6, 4))
    with pytest.raises(ValueError, match=r"rfft2 coefficients of shape \(\.\.\., 16, 9\)"):
        NavierStokes2D(grid, 0.1, 0.01).step_hat(torch.zeros(16, 16, dtype=torch.complex128))
    for shape, lengths in (((), None), ((8, 1), None), ((8, 8), (1.0,)), ((8,), -1.0)):
        with pytest.raises(ValueError):
            PeriodicGrid(shape, lengths)


def test_filtered_noise_is_band_limited_and_reproducible():
    grid = PeriodicGrid((8, 10, 12), (2 * math.pi, 2 * math.pi, 4.0))

    def draw(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return filtered_noise(grid, lambda k: torch.exp(-k), gen, (2,), max_wavenumber=2.5,
                              dtype=DT64)

    a = draw(0)
    assert a.shape == (2, 8, 10, 12) and a.dtype == DT64
    torch.testing.assert_close(a, draw(0), rtol=0, atol=0)
    assert float((a - draw(1)).abs().max()) > 1e-2
    h = grid.to_spectral(a).abs()
    ops = grid_operators(grid, DT64)
    outside = (ops.mask == 0) | (ops.k2 > 2.5**2 + 1e-9)
    assert float(h[:, outside].max()) < 1e-15
    assert float(h[:, ~outside].max()) > 1e-2
