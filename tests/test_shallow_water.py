"""Verification tests for :mod:`deepsolve.physics.shallow_water` (C-grid rotating shallow water).

float64, small grids, one intra-op thread.  Each test targets one property of the scheme
so that breaking it makes the test fail: flux-form mass conservation, the lake at rest,
the linear inertia-gravity dispersion (exact discrete solution and second-order
convergence of the frequency), discrete geostrophic balance, energy conservation of the
Sadourny vorticity averaging (semi-discrete and under RK4) and drag dissipation, slab /
halo locality, and autograd.
"""

import math
import threading
from dataclasses import replace

import pytest
import torch

from deepsolve.physics.shallow_water import (
    ShallowWater2D,
    circular_pad,
    energy,
    gaussian_bump,
    geostrophic_state,
    inertia_gravity_exact,
    inertia_gravity_frequency,
    mass,
)

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


def smooth_field(grid, gen, kind="eta", kmax=2, j0=0, rows=None):
    """Random smooth periodic field (Fourier modes |m|, |n| <= kmax) at ``kind`` points."""
    X, Y = grid.points(kind, j0, rows, dtype=F64)
    out = torch.zeros_like(X)
    for m in range(-kmax, kmax + 1):
        for n in range(-kmax, kmax + 1):
            a, b = torch.randn(2, generator=gen, dtype=F64) / (1 + m * m + n * n)
            ph = 2 * math.pi * (m * X / grid.Lx + n * Y / grid.Ly)
            out = out + a * torch.cos(ph) + b * torch.sin(ph)
    return out / out.abs().max()


def random_problem(grid, seed=0, amp=0.05, vel=0.05, bump=0.2):
    """Smooth random state (eta, u, v) and a non-flat depth around 1 (nondimensional)."""
    gen = torch.Generator().manual_seed(seed)
    eta = amp * smooth_field(grid, gen, "eta")
    u = vel * smooth_field(grid, gen, "u")
    v = vel * smooth_field(grid, gen, "v")
    depth = 1.0 + bump * smooth_field(grid, gen, "eta")
    return torch.stack([eta, u, v]), depth


def nondim_grid(nx=16, ny=16, **kw):
    kw = {"g": 1.0, "f": 2.0, "dt": 0.01, **kw}
    return ShallowWater2D(nx=nx, ny=ny, Lx=1.0, Ly=ny / nx, **kw)


# --------------------------------------------------------------------------------------
# 1. mass conservation
# --------------------------------------------------------------------------------------


def test_mass_conserved_over_200_steps():
    grid = nondim_grid(nx=16, ny=12, dt=0.01, drag=0.1, viscosity=1e-3)
    state, depth = random_problem(grid, seed=1, amp=0.1, vel=0.1)
    assert grid.cfl(float(depth.max())) < 0.5
    m0 = mass(state, depth, grid)
    s = grid.advance(state, depth, 200)
    assert (s - state).abs().max() > 1e-2  # it did move
    rel = float(((mass(s, depth, grid) - m0) / m0).abs())
    assert rel < 1e-12, rel


# --------------------------------------------------------------------------------------
# 2. lake at rest
# --------------------------------------------------------------------------------------


def test_lake_at_rest_stays_at_rest():
    grid = ShallowWater2D(nx=16, ny=16, Lx=1e6, Ly=1e6, dt=200.0, viscosity=100.0, drag=1e-5)
    gen = torch.Generator().manual_seed(2)
    depth = 1000.0 + 400.0 * smooth_field(grid, gen, kmax=3) + gaussian_bump(grid, -300.0)
    assert grid.cfl(float(depth.max())) < 0.5
    s = grid.advance(torch.zeros(3, 16, 16, dtype=F64), depth, 100)
    err = float(s.abs().max())
    assert err < 1e-13, err


# --------------------------------------------------------------------------------------
# 3. linear inertia-gravity wave
# --------------------------------------------------------------------------------------

H_IG = 100.0


def ig_grid(nx, dt=600.0):
    # deformation radius sqrt(gH)/f ~ 310 km vs wavelength 2000 km: f and g both matter
    return ShallowWater2D(nx=nx, ny=4, Lx=2e6, Ly=4 * 2e6 / nx, g=9.81, f=1e-4, dt=dt)


def test_inertia_gravity_exact_matches_closed_form():
    """The matrix-exponential solution is the 3x3 system's: eta(t) in closed form."""
    grid = ig_grid(32)
    k = 2 * math.pi / grid.Lx
    c, s = math.cos(k * grid.dx / 2), 2 * math.sin(k * grid.dx / 2) / grid.dx
    w = math.sqrt(grid.f**2 * c**2 + grid.g * H_IG * s**2)
    assert w == pytest.approx(inertia_gravity_frequency(grid, H_IG), rel=1e-14)
    t = 12345.0
    ex = inertia_gravity_exact(grid, H_IG, t)
    x = grid.x_centres()
    eta = (grid.f**2 * c**2 + grid.g * H_IG * s**2 * math.cos(w * t)) / w**2 * torch.cos(k * x)
    assert float((ex[0] - eta).abs().max()) < 1e-13


def _ig_error(solver, exact_grid, A, steps=150, every=25):
    """Max over samples and fields of the solver's error vs the exact discrete-linear
    solution of ``exact_grid``, each field relative to its largest norm over the samples."""
    depth = torch.full((solver.ny, solver.nx), H_IG, dtype=F64)
    s = inertia_gravity_exact(exact_grid, H_IG, 0.0, amplitudes=(A, 0.0, 0.0))
    num, ex = [], []
    for n in range(1, steps + 1):
        s = solver.step(s, depth)
        if n % every == 0:
            num.append(s)
            ex.append(inertia_gravity_exact(exact_grid, H_IG, n * solver.dt,
                                            amplitudes=(A, 0.0, 0.0)))
    num, ex = torch.stack(num), torch.stack(ex)
    scale = ex.pow(2).sum(dim=(-2, -1)).sqrt().amax(dim=0)  # per field, over time
    return float(((num - ex).pow(2).sum(dim=(-2, -1)).sqrt().amax(dim=0) / scale).max())


def test_inertia_gravity_wave_matches_exact_discrete_solution():
    grid = ig_grid(32, dt=600.0)
    A = 1e-6 * H_IG
    s0 = inertia_gravity_exact(grid, H_IG, 0.0, amplitudes=(A, 0.0, 0.0))
    assert float((s0[0] - A * torch.cos(2 * math.pi * grid.x_centres() / grid.Lx)).abs().max()
                 ) < 1e-18
    assert torch.equal(s0[1:], torch.zeros_like(s0[1:]))
    err = _ig_error(grid, grid, A)  # two periods of the mode (omega dt = 0.084)
    assert err < 1e-4, err
    # the comparison is sensitive: a solver with the wrong sign of f or g off by 1% fails
    for bad in (replace(grid, f=-grid.f), replace(grid, g=grid.g * 1.01)):
        assert _ig_error(bad, grid, A) > 1e-2


def _measured_frequency(nx):
    """Largest |Im eig| of the solver's linearisation (jvp of rhs at rest) on one x-mode."""
    grid = ig_grid(nx, dt=1.0)
    depth = torch.full((grid.ny, nx), H_IG, dtype=F64)
    k = 2 * math.pi / grid.Lx
    basis = []
    for ch, kind in enumerate(("eta", "u", "eta")):  # v shares x with the centres
        x = grid.points(kind, dtype=F64)[0]
        for fn in (torch.cos, torch.sin):
            b = torch.zeros(3, grid.ny, nx, dtype=F64)
            b[ch] = fn(k * x)
            basis.append(b)
    B = torch.stack(basis)
    zero = torch.zeros(3, grid.ny, nx, dtype=F64)
    cols = []
    for b in basis:
        _, out = torch.autograd.functional.jvp(lambda st: grid.rhs(st, depth), zero, b)
        coef = (B * out).sum(dim=(1, 2, 3)) / (B * B).sum(dim=(1, 2, 3))
        leak = out - (coef[:, None, None, None] * B).sum(0)
        assert float(leak.norm()) <= 1e-12 * float(out.norm())  # the mode is invariant
        cols.append(coef)
    w = float(torch.linalg.eigvals(torch.stack(cols, 1)).imag.abs().max())
    return grid, w


def test_inertia_gravity_frequency_second_order():
    errs = []
    for nx in (16, 32, 64):
        grid, w = _measured_frequency(nx)
        assert w == pytest.approx(inertia_gravity_frequency(grid, H_IG), rel=1e-12)
        k = 2 * math.pi / grid.Lx
        w2 = grid.f**2 + grid.g * H_IG * k**2
        errs.append(abs(w * w - w2) / w2)
    ratios = [errs[0] / errs[1], errs[1] / errs[2]]
    assert errs[0] < 0.05
    assert all(3.7 < r < 4.3 for r in ratios), (errs, ratios)


# --------------------------------------------------------------------------------------
# 4. geostrophic balance
# --------------------------------------------------------------------------------------


def test_geostrophic_state_is_steady():
    grid = ig_grid(32, dt=600.0)
    A = 1e-6 * H_IG
    k = 2 * math.pi * 2 / grid.Lx
    c, s = math.cos(k * grid.dx / 2), 2 * math.sin(k * grid.dx / 2) / grid.dx
    x = grid.x_centres()[0]
    state = geostrophic_state(grid, A * torch.cos(k * x))
    v_exp = -(grid.g * s * A / (grid.f * c)) * torch.sin(k * x)
    assert float((state[2] - v_exp).abs().max()) < 1e-12 * float(v_exp.abs().max())
    assert torch.equal(state[1], torch.zeros_like(state[1]))
    depth = torch.full((grid.ny, grid.nx), H_IG, dtype=F64)
    end = grid.advance(state, depth, 200)  # 1.2e5 s: ~2.7 inertia-gravity periods
    change = (end - state).abs().amax(dim=(-2, -1)) / state.abs().amax(dim=(-2, -1)).clamp_min(
        1e-300)
    change_u = float(end[1].abs().max() / state[2].abs().max())  # u starts at 0
    # O(A/H) = 1e-6 nonlinear drift at most (measured ~2e-8)
    assert float(change[0]) < 1e-6 and float(change[2]) < 1e-6 and change_u < 1e-6, (
        change, change_u)
    # a slightly unbalanced v (1%) is not steady: the bound is tight
    off = torch.stack([state[0], state[1], 1.01 * state[2]])
    end_off = grid.advance(off, depth, 200)
    assert float(end_off[1].abs().max() / state[2].abs().max()) > 1e-3


# --------------------------------------------------------------------------------------
# 5. energy
# --------------------------------------------------------------------------------------


def _dE_dt(grid, state, depth):
    st = state.clone().requires_grad_(True)
    (gE,) = torch.autograd.grad(energy(st, depth, grid), st)
    tend = grid.rhs(state, depth)
    return float((gE * tend).sum()), float(gE.norm() * tend.norm())


def test_energy_semi_discrete_budget():
    """dE/dt = grad E . rhs is 0 without drag (Sadourny averaging) and -r sum(h u^2)."""
    grid = nondim_grid(nx=16, ny=12)
    state, depth = random_problem(grid, seed=3, amp=0.2, vel=0.3, bump=0.3)
    rate, scale = _dE_dt(grid, state, depth)
    assert abs(rate) < 1e-13 * scale, (rate, scale)
    r = 0.3
    drag = replace(grid, drag=r)
    rate_d, _ = _dE_dt(drag, state, depth)
    h = depth + state[0]
    hu = 0.5 * (h + torch.roll(h, -1, -1))
    hv = 0.5 * (h + torch.roll(h, -1, -2))
    expect = -r * float((hu * state[1] ** 2 + hv * state[2] ** 2).sum()) * grid.cell_area
    assert rate_d == pytest.approx(expect, rel=1e-12)


def test_energy_rk4_error_shrinks_with_dt_and_drag_dissipates():
    grid = nondim_grid(nx=16, ny=16, dt=0.02)
    gen = torch.Generator().manual_seed(4)
    depth = 1.0 + 0.2 * smooth_field(grid, gen)
    eta = gaussian_bump(grid, 0.2, width=0.15)
    state = torch.stack([eta, torch.zeros_like(eta), torch.zeros_like(eta)])
    assert grid.cfl(float(depth.max())) < 0.5
    e0 = float(energy(state, depth, grid))
    changes = []
    for halvings in (0, 1):
        g = replace(grid, dt=grid.dt / 2**halvings)
        s = g.advance(state, depth, 40 * 2**halvings)  # T = 0.8
        changes.append(abs(float(energy(s, depth, g)) - e0) / e0)
    ratio = changes[0] / changes[1]
    assert changes[0] <= 1e-8 or ratio >= 8, (changes, ratio)
    # with drag the energy decays every step, by far more than the RK4 error
    dr = replace(grid, drag=0.05)
    es, s = [e0], state
    for _ in range(40):
        s = dr.step(s, depth)
        es.append(float(energy(s, depth, dr)))
    diffs = torch.tensor(es).diff()
    assert bool((diffs[1:] < 0).all()) and diffs[0] <= 0  # u = v = 0 at t = 0
    assert (e0 - es[-1]) / e0 > 100 * changes[0]


# --------------------------------------------------------------------------------------
# 6. slabs of rows with halos from the neighbours
# --------------------------------------------------------------------------------------


def _halo_pad(a, b, source, calls):
    """pad for the slab of global rows a..b-1: halo rows from ``source(call_index)``."""

    def pad(x, width):
        assert width in (1, 4)   # one row per stage, or four once per step
        X = source(len(calls))
        ny = X.shape[-2]
        calls.append(width)
        assert float((x - X[..., a:b, :]).abs().max()) <= 1e-14  # its own rows agree
        below = X[..., [(a - w) % ny for w in range(width, 0, -1)], :]
        above = X[..., [(b + w) % ny for w in range(width)], :]
        return torch.cat([below, x, above], dim=-2)

    return pad


@pytest.mark.parametrize("n_slabs", [2, 4])
def test_slab_rhs_and_step_match_global_rows(n_slabs):
    grid = nondim_grid(nx=8, ny=16, dt=0.01, drag=0.1, viscosity=1e-3)
    state, depth = random_problem(grid, seed=5, amp=0.2, vel=0.3)
    assert grid.halo() == 1

    recorded = []

    def recording_pad(x, width):
        recorded.append(x)
        return circular_pad(x, width)

    R = grid.rhs(state, depth, recording_pad)
    assert len(recorded) == 1
    S = grid.step(state, depth, recording_pad)
    assert len(recorded) == 5  # one pad call per RK4 stage
    stages = recorded[1:]
    rows = grid.ny // n_slabs
    for p in range(n_slabs):
        a, b = p * rows, (p + 1) * rows
        # each slab builds its own depth and initial rows
        st, dp = state[..., a:b, :], depth[..., a:b, :]
        calls = []
        r = grid.rhs(st, dp, _halo_pad(a, b, lambda i: recorded[0], calls))
        assert len(calls) == 1
        assert float((r - R[..., a:b, :]).abs().max()) <= 1e-14
        calls = []
        s = grid.step(st, dp, _halo_pad(a, b, lambda i: stages[i], calls))
        assert len(calls) == 4
        assert float((s - S[..., a:b, :]).abs().max()) <= 1e-14
        # diagnostics: slab sums add up (checked below)
    m = sum(mass(state[..., p * rows:(p + 1) * rows, :], depth[p * rows:(p + 1) * rows], grid)
            for p in range(n_slabs))
    assert float(m) == pytest.approx(float(mass(state, depth, grid)), rel=1e-14)


def test_slabs_in_lockstep_exchanging_halos_among_themselves():
    """Four slabs run concurrently; each pad is a halo exchange with the neighbour slabs'
    current stage (no global data after the start), as a distributed caller would do."""
    grid = nondim_grid(nx=8, ny=16, dt=0.01, drag=0.1, viscosity=1e-3)
    state, depth = random_problem(grid, seed=10, amp=0.2, vel=0.3)
    S = grid.step(grid.step(state, depth), depth)
    n_slabs, rows = 4, 4
    barrier = threading.Barrier(n_slabs, timeout=30)
    posted, out = {}, [None] * n_slabs

    def worker(p):
        def exchange(x, width):
            posted[p] = x
            barrier.wait()
            below = posted[(p - 1) % n_slabs][..., -width:, :]
            above = posted[(p + 1) % n_slabs][..., :width, :]
            barrier.wait()  # everyone has read before the next stage is posted
            return torch.cat([below, x, above], dim=-2)

        sl = slice(p * rows, (p + 1) * rows)
        s = state[..., sl, :]
        out[p] = grid.step(grid.step(s, depth[sl], exchange), depth[sl], exchange)

    threads = [threading.Thread(target=worker, args=(p,)) for p in range(n_slabs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out)
    assert float((torch.cat(out, dim=-2) - S).abs().max()) <= 1e-14


@pytest.mark.parametrize("n_slabs", [1, 2, 4])
def test_one_wide_halo_per_step_gives_the_same_bits_as_one_halo_per_stage(n_slabs):
    """exchange="step": one pad of 4 rows per step, stages on shrinking halos; equal to the
    per-stage exchange to the last bit, on the whole grid and on slabs."""
    base = dict(nx=8, ny=16, dt=0.01, drag=0.1, viscosity=1e-3)
    grid, wide = nondim_grid(**base), nondim_grid(**base, exchange="step")
    assert (grid.halo(), wide.halo()) == (1, 4)
    state, depth = random_problem(grid, seed=6, amp=0.2, vel=0.3)
    S = grid.step(grid.step(state, depth), depth)
    rows = grid.ny // n_slabs

    def stacked(st):   # what step pads: (eta, u, v, depth) of the whole grid
        return torch.cat([st, depth.expand_as(st[..., :1, :, :])], dim=-3)

    X0, X1 = stacked(state), stacked(grid.step(state, depth))
    for p in range(n_slabs):
        a, b = p * rows, (p + 1) * rows
        calls = []
        S1 = wide.step(state[..., a:b, :], depth[a:b], _halo_pad(a, b, lambda i: X0, calls))
        assert calls == [4]
        S2 = wide.step(S1, depth[a:b], _halo_pad(a, b, lambda i: X1, calls))
        assert calls == [4, 4]
        assert torch.equal(S2, S[..., a:b, :])
    with pytest.raises(ValueError, match="exchange must be"):
        nondim_grid(**base, exchange="never")


def test_slab_coordinates_and_energy_add_up():
    grid = nondim_grid(nx=8, ny=16)
    state, depth = random_problem(grid, seed=6, amp=0.2, vel=0.3)
    bump = gaussian_bump(grid, 1.0, width=0.1)
    X, Y = grid.points("eta")
    total = 0.0
    for a in (0, 4, 8, 12):
        assert torch.equal(grid.x_centres(a, 4), X[a:a + 4])
        assert torch.equal(grid.y_centres(a, 4), Y[a:a + 4])
        assert float((gaussian_bump(grid, 1.0, width=0.1, j0=a, rows=4)
                      - bump[a:a + 4]).abs().max()) < 1e-15
        full = state

        def pad(x, width, a=a, full=full):
            v = full[..., 2, :, :]
            return torch.cat([v[..., [(a - 1) % 16], :], x, v[..., [(a + 4) % 16], :]], -2)

        total += float(energy(state[..., a:a + 4, :], depth[a:a + 4], grid, pad))
    assert total == pytest.approx(float(energy(state, depth, grid)), rel=1e-14)


def test_batch_and_float32():
    grid = nondim_grid(nx=8, ny=8, dt=0.01)
    s0, depth = random_problem(grid, seed=7, amp=0.2, vel=0.2)
    s1, _ = random_problem(grid, seed=8, amp=0.2, vel=0.2)
    batch = grid.step(torch.stack([s0, s1]), depth)
    assert batch.shape == (2, 3, 8, 8)
    assert torch.equal(batch[1], grid.step(s1, depth))
    s32 = grid.step(s0.float(), depth.float())
    assert s32.dtype == torch.float32
    assert float((s32.double() - batch[0]).abs().max()) < 1e-5


# --------------------------------------------------------------------------------------
# 7. gradients
# --------------------------------------------------------------------------------------


def test_gradcheck_two_steps_wrt_depth_and_state():
    grid = nondim_grid(nx=8, ny=6, dt=0.02, drag=0.1, viscosity=1e-3)
    state, depth = random_problem(grid, seed=9, amp=0.2, vel=0.3)
    state.requires_grad_(True)
    depth.requires_grad_(True)

    def run(s, d):
        return grid.step(grid.step(s, d), d)

    assert torch.autograd.gradcheck(run, (state, depth), eps=1e-6, atol=1e-7, rtol=1e-5)
