"""deepsolve.fixed_point: solvers, implicit / unrolled / auto / phantom backwards, errors,
batching, and nesting inside a checkpointed deepsolve.unroll."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import deepsolve
from deepsolve.fixed_point import (
    FixedPointError,
    FixedPointStats,
    FixedPointWarning,
    fixed_point,
)

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def contraction(n, norm, seed, dtype=F64, sym=False):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g, dtype=dtype)
    if sym:  # spectral radius = norm: Picard converges like norm**k
        A = A + A.T
    return norm * A / torch.linalg.matrix_norm(A, 2)


def deq(d=8, B=3, seed=0, norm=0.9, xscale=1.0, dtype=F64, sym=False):
    g = torch.Generator().manual_seed(seed + 1)
    W = contraction(d, norm, seed, dtype, sym).requires_grad_()
    x = (xscale * torch.randn(B, d, generator=g, dtype=dtype)).requires_grad_()
    w = torch.randn(B, d, generator=g, dtype=dtype)
    return W, x, w


# ----------------------------------------------------------------------------------------
# implicit gradients


@pytest.mark.parametrize("solver", ["picard", "anderson", "broyden"])
def test_linear_fixed_point_implicit_gradient_is_analytic(solver):
    """z = A z + b: z* = (I - A)^{-1} b; for L = c.z* + |z*|^2 / 2 the adjoint is
    g = (I - A)^{-T} (c + z*), dL/db = g and dL/dA = g z*^T."""
    n = 12
    A = contraction(n, 0.8, 3).requires_grad_()
    gen = torch.Generator().manual_seed(4)
    b = torch.randn(n, generator=gen, dtype=F64, requires_grad=True)
    c = torch.randn(n, generator=gen, dtype=F64)
    st = FixedPointStats()
    z = fixed_point(lambda z: A @ z + b, torch.zeros(n, dtype=F64), solver=solver, tol=1e-14,
                    max_iter=400, stats=st)
    assert st.converged and st.backward == "implicit" and st.solver == solver
    loss = c @ z + 0.5 * z @ z
    gA, gb = torch.autograd.grad(loss, [A, b])
    assert st.backward_converged and st.backward_iterations > 0
    with torch.no_grad():
        eye = torch.eye(n, dtype=F64)
        zs = torch.linalg.solve(eye - A, b)
        g = torch.linalg.solve((eye - A).T, c + zs)
    assert rel_err(z.detach(), zs) < 1e-12
    assert rel_err(gb, g) < 1e-10
    assert rel_err(gA, torch.outer(g, zs)) < 1e-10


def test_nonlinear_implicit_gradient_matches_finite_differences():
    """z = tanh(W z + x), batched: dL/dW and dL/dx against central differences."""
    W, x, w = deq(d=6, B=3, seed=5)

    def loss(W, x):
        z = fixed_point(lambda z: torch.tanh(z @ W.T + x), torch.zeros_like(x), tol=1e-14,
                        max_iter=300)
        return (w * z).sum() + z.pow(2).sum()

    gW, gx = torch.autograd.grad(loss(W, x), [W, x])
    gen = torch.Generator().manual_seed(6)
    h = 1e-6
    with torch.no_grad():
        for _ in range(3):
            dW = torch.randn(W.shape, generator=gen, dtype=F64)
            dx = torch.randn(x.shape, generator=gen, dtype=F64)
            fd_W = (loss(W + h * dW, x) - loss(W - h * dW, x)) / (2 * h)
            fd_x = (loss(W, x + h * dx) - loss(W, x - h * dx)) / (2 * h)
            assert float(fd_W) == pytest.approx(float((gW * dW).sum()), rel=1e-7, abs=1e-9)
            assert float(fd_x) == pytest.approx(float((gx * dx).sum()), rel=1e-7, abs=1e-9)


def test_implicit_reaches_modules_and_tensors_computed_outside_f():
    """No params= needed: a module's parameters and a non-leaf closed-over input (U x) get
    their gradients through the one recorded evaluation of f."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 5, dtype=F64)
    with torch.no_grad():
        lin.weight.mul_(0.5 / torch.linalg.matrix_norm(lin.weight, 2))
    U = torch.randn(5, 4, dtype=F64, requires_grad=True)
    x = torch.randn(7, 4, dtype=F64)
    Ux = x @ U.T  # computed outside f

    def f(z):
        return torch.tanh(lin(z) + Ux)

    z = fixed_point(f, torch.zeros(7, 5, dtype=F64), tol=1e-14, max_iter=200)
    gs = torch.autograd.grad(z.pow(2).sum(), [U, lin.weight, lin.bias], retain_graph=True)
    # reference: plain autograd through 200 Picard iterations (converged to round-off)
    zr = torch.zeros(7, 5, dtype=F64)
    for _ in range(200):
        zr = f(zr)
    refs = torch.autograd.grad(zr.pow(2).sum(), [U, lin.weight, lin.bias])
    for g, r in zip(gs, refs, strict=True):
        assert rel_err(g, r) < 1e-10


# ----------------------------------------------------------------------------------------
# unrolled gradients


def picard_reference(f, z0, k, beta):
    z = z0
    for _ in range(k):
        z = f(z) if beta == 1.0 else z + beta * (f(z) - z)
    return z


def anderson_reference(f, z0, k, m, lam, beta):
    """Walker & Ni's Anderson(m) in difference form, written out plainly."""
    zs, fs = [z0], [f(z0)]
    for i in range(k):
        h = min(i, m - 1)
        z, fz = zs[-1], fs[-1]
        r = fz - z
        if h == 0:
            new = z + beta * r
        else:
            Rs = [fs[j] - zs[j] for j in range(len(zs) - h - 1, len(zs))]
            Zs = zs[len(zs) - h - 1:]
            dR = torch.stack([Rs[j + 1] - Rs[j] for j in range(h)], 1)  # (B, h, n)
            dZ = torch.stack([Zs[j + 1] - Zs[j] for j in range(h)], 1)
            A = torch.einsum("bin,bjn->bij", dR, dR)
            reg = lam * torch.einsum("bii->bi", A).mean(-1)
            A = A + reg[:, None, None] * torch.eye(h, dtype=A.dtype)
            gam = torch.linalg.solve(A, torch.einsum("bin,bn->bi", dR, r))
            new = z + beta * r - torch.einsum("bin,bi->bn", dZ + beta * dR, gam)
        zs.append(new)
        fs.append(f(new))
    return zs[-1]


@pytest.mark.parametrize("kw", [{}, {"snapshots": 3}, {"budget": "10KiB"}])
def test_unrolled_picard_equals_plain_autograd(kw):
    W, x, w = deq(d=8, B=3, seed=7, norm=0.95, xscale=0.3)
    z0 = (0.1 * torch.ones(3, 8, dtype=F64)).requires_grad_()

    def f(z):
        return torch.tanh(z @ W.T + x)

    st = FixedPointStats()
    z = fixed_point(f, z0, solver="picard", beta=0.8, tol=1e-8, max_iter=300,
                    backward="unrolled", stats=st, **kw)
    k = st.iterations
    assert st.converged and st.backward == "unrolled" and 10 < k < 300
    assert st.unroll is not None and st.unroll.n_steps == k
    g = torch.autograd.grad((w * z).sum(), [W, x, z0])
    zr = picard_reference(f, z0, k, 0.8)
    assert torch.equal(z.detach(), zr.detach())
    ref = torch.autograd.grad((w * zr).sum(), [W, x, z0])
    for a, b in zip(g, ref, strict=True):
        assert rel_err(a, b) < 1e-10
    if kw:
        assert st.unroll.advances > 0  # checkpointed: steps were recomputed
    # the exact gradient of a converged iteration approaches the implicit gradient
    gi = torch.autograd.grad((w * fixed_point(f, z0, tol=1e-12)).sum(), [W, x])
    assert rel_err(g[0], gi[0]) < 1e-6 and rel_err(g[1], gi[1]) < 1e-6
    assert float(g[2].abs().max()) < 1e-6  # z0's influence has decayed


@pytest.mark.parametrize("snapshots", [None, 4])
def test_unrolled_anderson_equals_plain_autograd(snapshots):
    W, x, w = deq(d=8, B=3, seed=8, norm=0.95, xscale=0.3)
    z0 = torch.zeros(3, 8, dtype=F64, requires_grad=True)

    def f(z):
        return torch.tanh(z @ W.T + x)

    st = FixedPointStats()
    z = fixed_point(f, z0, solver="anderson", m=4, lam=1e-6, beta=0.9, tol=1e-9,
                    backward="unrolled", snapshots=snapshots, stats=st)
    k = st.iterations
    assert st.converged and k > 4
    g = torch.autograd.grad((w * z).sum(), [W, x, z0])
    zr = anderson_reference(f, z0, k, 4, 1e-6, 0.9)
    assert rel_err(z.detach(), zr.detach()) < 1e-12
    ref = torch.autograd.grad((w * zr).sum(), [W, x, z0])
    for a, b in zip(g, ref, strict=True):
        assert rel_err(a, b) < 1e-10


def test_unrolled_broyden_checkpointed_equals_recorded_and_approaches_implicit():
    W, x, w = deq(d=8, B=3, seed=9, norm=0.9)

    def f(z):
        return torch.tanh(z @ W.T + x)

    grads = []
    for snapshots in (None, 3):
        st = FixedPointStats()
        z = fixed_point(f, torch.zeros(3, 8, dtype=F64), solver="broyden", tol=1e-12,
                        backward="unrolled", snapshots=snapshots, stats=st)
        assert st.converged
        grads.append(torch.autograd.grad((w * z).sum(), [W, x]))
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10
    gi = torch.autograd.grad((w * fixed_point(f, torch.zeros(3, 8, dtype=F64), tol=1e-13))
                             .sum(), [W, x])
    for a, b in zip(grads[0], gi, strict=True):
        assert rel_err(a, b) < 1e-6


def test_unrolled_runs_the_solver_once_inside_an_unknown_length_unroll():
    """backward="unrolled" is one unroll(until=...) pass: f runs k + 1 times forward (the
    online schedule's stop test needs f(z_k)), and the gradients equal the two-pass path
    (a no-grad solve, then an unroll of the k iterations) used by backward="auto"."""
    W, x, w = deq(d=6, B=2, seed=10)
    calls = {"n": 0}

    def f(z):
        calls["n"] += 1
        return torch.tanh(z @ W.T + x)

    st = FixedPointStats()
    with torch.no_grad():
        fixed_point(f, torch.zeros(2, 6, dtype=F64), solver="picard", stats=st)
    k = st.iterations
    z = fixed_point(f, torch.zeros(2, 6, dtype=F64), solver="picard", backward="unrolled",
                    stats=st, max_iter=k)
    g = torch.autograd.grad((w * z).sum(), [W, x])
    with pytest.warns(FixedPointWarning):
        z2 = fixed_point(f, torch.zeros(2, 6, dtype=F64), solver="picard", backward="auto",
                         max_iter=k - 1, tol=1e-30)
    assert z2.shape == z.shape
    zr = torch.zeros(2, 6, dtype=F64)
    for _ in range(st.iterations):
        zr = f(zr)
    g_ref = torch.autograd.grad((w * zr).sum(), [W, x])
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) < 1e-10
    with pytest.warns(FixedPointWarning, match="did not converge in 3 iterations"):
        fixed_point(f, torch.zeros(2, 6, dtype=F64), backward="unrolled", max_iter=3,
                    solver="picard", stats=st)
    assert st.iterations == 3 and not st.converged


# ----------------------------------------------------------------------------------------
# auto and phantom


def test_auto_picks_implicit_when_converged_and_unrolled_otherwise():
    W, x, w = deq(d=8, B=3, seed=11, norm=0.95, xscale=0.3)

    def f(z):
        return torch.tanh(z @ W.T + x)

    z0 = torch.zeros(3, 8, dtype=F64)
    st = FixedPointStats()
    z = fixed_point(f, z0, backward="auto", tol=1e-10, stats=st)
    assert st.converged and st.backward == "implicit"
    g_auto = torch.autograd.grad((w * z).sum(), [W, x])
    g_impl = torch.autograd.grad((w * fixed_point(f, z0, tol=1e-10)).sum(), [W, x])
    for a, b in zip(g_auto, g_impl, strict=True):
        assert torch.equal(a, b)
    with pytest.warns(FixedPointWarning, match=r"backward='unrolled'"):
        z = fixed_point(f, z0, solver="picard", backward="auto", max_iter=5, stats=st,
                        snapshots=2)
    assert not st.converged and st.backward == "unrolled" and st.iterations == 5
    g = torch.autograd.grad((w * z).sum(), [W, x])
    zr = picard_reference(f, z0, 5, 1.0)
    for a, b in zip(g, torch.autograd.grad((w * zr).sum(), [W, x]), strict=True):
        assert rel_err(a, b) < 1e-10


def test_phantom_gradients():
    W, x, w = deq(d=8, B=3, seed=12, norm=0.8)

    def f(z):
        return torch.tanh(z @ W.T + x)

    z0 = torch.zeros(3, 8, dtype=F64)
    zi = fixed_point(f, z0, tol=1e-13)
    st = FixedPointStats()
    zj = fixed_point(f, z0, tol=1e-13, backward="phantom", phantom_steps=1,
                     phantom_damping=1.0, stats=st)
    assert st.backward == "phantom" and torch.equal(zj.detach(), zi.detach())
    # Jacobian-free backward: g = dL/dz*, pulled through f once at z*
    gj = torch.autograd.grad((w * zj).sum(), [W, x])
    zs = zi.detach()
    ref = torch.autograd.grad((w * f(zs)).sum(), [W, x])
    for a, b in zip(gj, ref, strict=True):
        assert rel_err(a, b) < 1e-12
    # many damped phantom steps approach the implicit gradient; few are an approximation
    g_impl = torch.autograd.grad((w * zi).sum(), [W, x])
    errs = []
    for k in (5, 150):
        zp = fixed_point(f, z0, tol=1e-13, backward="phantom", phantom_steps=k,
                         phantom_damping=0.5)
        gp = torch.autograd.grad((w * zp).sum(), [W, x])
        errs.append(rel_err(gp[0], g_impl[0]))
    assert errs[1] < 1e-10 < errs[0] < 0.5


# ----------------------------------------------------------------------------------------
# solvers


def test_anderson_and_broyden_converge_in_fewer_iterations_than_picard():
    W, x, _ = deq(d=32, B=4, seed=13, norm=0.99, xscale=0.1, sym=True)  # rho ~ 0.99

    def f(z):
        return torch.tanh(z @ W.T + x)

    its = {}
    for solver in ("picard", "anderson", "broyden"):
        st = FixedPointStats()
        with torch.no_grad():
            z = fixed_point(f, torch.zeros(4, 32, dtype=F64), solver=solver, tol=1e-8,
                            max_iter=2000, stats=st)
            assert float((f(z) - z).norm() / f(z).norm()) < 1e-7
        assert st.converged, solver
        assert len(st.residuals) == st.iterations + 1 and st.residual <= 1e-8
        its[solver] = st.iterations
    assert its["anderson"] < its["picard"] / 3, its
    assert its["broyden"] < its["picard"] / 3, its


@pytest.mark.parametrize("solver", ["picard", "anderson", "broyden"])
def test_float32(solver):
    W, x, w = deq(d=16, B=5, seed=14, dtype=torch.float32)
    st = FixedPointStats()
    z = fixed_point(lambda z: torch.tanh(z @ W.T + x), torch.zeros(5, 16), solver=solver,
                    tol=1e-5, stats=st)
    assert z.dtype == torch.float32 and st.converged
    gW, gx = torch.autograd.grad((w * z).sum(), [W, x])
    W64, x64 = W.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    z64 = fixed_point(lambda z: torch.tanh(z @ W64.T + x64), torch.zeros(5, 16, dtype=F64),
                      tol=1e-12)
    rW, rx = torch.autograd.grad((w.double() * z64).sum(), [W64, x64])
    assert rel_err(gW.double(), rW) < 1e-3 and rel_err(gx.double(), rx) < 1e-3


def test_batched_elements_are_independent_problems():
    W, x, w = deq(d=6, B=4, seed=15, norm=0.9)

    def solve(xb, wb, **kw):
        st = FixedPointStats()
        z = fixed_point(lambda z: torch.tanh(z @ W.T + xb), torch.zeros_like(xb), tol=1e-13,
                        stats=st, **kw)
        return z, st, torch.autograd.grad((wb * z).sum(), [W, xb])

    z, st, (gW, gx) = solve(x, w)
    assert st.sample_residuals.shape == (4,) and bool((st.sample_residuals <= 1e-13).all())
    gW_sum = torch.zeros_like(gW)
    its = []
    for b in range(4):
        xb = x[b:b + 1].detach().requires_grad_()
        zb, stb, (gWb, gxb) = solve(xb, w[b:b + 1])
        its.append(stb.iterations)
        assert rel_err(zb.detach(), z[b:b + 1].detach()) < 1e-12
        assert rel_err(gxb, gx[b:b + 1]) < 1e-9
        gW_sum += gWb
    assert rel_err(gW_sum, gW) < 1e-9
    assert st.iterations >= max(its)
    # two batch dimensions give the same as one flattened batch dimension
    x2 = x.detach().reshape(2, 2, 6).requires_grad_()
    z2 = fixed_point(lambda z: torch.tanh(z @ W.T + x2), torch.zeros_like(x2), tol=1e-13,
                     batch_dims=2)
    assert rel_err(z2.detach().reshape(4, 6), z.detach()) < 1e-12
    # batch_dims=0: one problem with a (4, 6) state, a single residual
    st0 = FixedPointStats()
    z0 = fixed_point(lambda z: torch.tanh(z @ W.T + x), torch.zeros(4, 6, dtype=F64),
                     tol=1e-13, batch_dims=0, stats=st0)
    assert st0.sample_residuals.shape == (1,) and rel_err(z0.detach(), z.detach()) < 1e-11


# ----------------------------------------------------------------------------------------
# nesting inside a checkpointed unroll


def heat_like_step(W, a, dt, backward, solver="anderson"):
    """Backward Euler for u' = a * tanh(W u) - u: every step solves
    u_next = u + dt * (a * tanh(W u_next) - u_next)."""

    def step(u, i):
        def f(v):
            return (u + dt * a * torch.tanh(v @ W.T)) / (1 + dt)

        return fixed_point(f, u, solver=solver, tol=1e-13, backward=backward)

    return step


def test_implicit_inside_revolve_equals_inside_store_all():
    W = contraction(6, 1.5, 16).requires_grad_()
    a = torch.tensor(0.8, dtype=F64, requires_grad=True)
    u0 = torch.randn(2, 6, generator=torch.Generator().manual_seed(17), dtype=F64,
                     requires_grad=True)
    calls = {"n": 0}
    step = heat_like_step(W, a, 0.5, "implicit")

    def counted(u, i):
        calls["n"] += 1
        return step(u, i)

    grads = []
    for kw in ({"schedule": "store_all"}, {"snapshots": 3}):
        calls["n"] = 0
        uT = deepsolve.unroll(counted, u0, 12, **kw)
        grads.append(torch.autograd.grad(uT.pow(2).sum(), [W, a, u0]))
        if "snapshots" in kw:
            assert calls["n"] > 24  # the inner solves are recomputed in the reverse sweep
    for g, r in zip(*grads, strict=True):
        assert rel_err(g, r) < 1e-10


@pytest.mark.parametrize("solver", ["picard", "anderson"])
def test_unrolled_inside_revolve_equals_plain_autograd(solver):
    W = contraction(6, 1.5, 18).requires_grad_()
    a = torch.tensor(0.8, dtype=F64, requires_grad=True)
    u0 = torch.randn(2, 6, generator=torch.Generator().manual_seed(19), dtype=F64,
                     requires_grad=True)
    step = heat_like_step(W, a, 0.5, "unrolled", solver)
    uT = deepsolve.unroll(step, u0, 10, snapshots=3)
    g = torch.autograd.grad(uT.pow(2).sum(), [W, a, u0])
    u = u0  # plain autograd through every inner and outer iteration
    for i in range(10):
        u = step(u, i)
    ref = torch.autograd.grad(u.pow(2).sum(), [W, a, u0])
    for x, r in zip(g, ref, strict=True):
        assert rel_err(x, r) < 1e-10
    # and the unrolled gradient of converged solves is the implicit one
    gi = torch.autograd.grad(deepsolve.unroll(heat_like_step(W, a, 0.5, "implicit"), u0, 10,
                                              snapshots=3).pow(2).sum(), [W, a, u0])
    for x, r in zip(g, gi, strict=True):
        assert rel_err(x, r) < 1e-8


# ----------------------------------------------------------------------------------------
# errors, warnings, modes


def test_nan_error_names_the_iteration():
    calls = {"n": 0}

    def f(z):
        calls["n"] += 1  # call 1 is f(z_0); call j + 1 is f(z_j)
        return 0.5 * z + 1 if calls["n"] < 5 else z * float("nan")

    with pytest.raises(FixedPointError, match=r"not finite \(NaN/Inf\) at iteration 4"):
        fixed_point(f, torch.zeros(3, dtype=F64), solver="picard")
    with pytest.raises(FixedPointError, match="at iteration 0"):
        fixed_point(lambda z: z + float("inf"), torch.zeros(2, 3), solver="broyden")
    calls["n"] = 0
    with pytest.raises(FixedPointError, match=r"batch elements \[1\]"):
        fixed_point(lambda z: z / torch.tensor([[1.0], [0.0]]), torch.ones(2, 3))
    assert issubclass(FixedPointError, ValueError)


def test_nonconvergence_warns_or_raises_when_strict():
    W, x, w = deq(d=6, B=2, seed=20, norm=0.95)

    def f(z):
        return torch.tanh(z @ W.T + x)

    z0 = torch.zeros(2, 6, dtype=F64)
    with pytest.warns(FixedPointWarning, match=r"did not converge in 3 iterations: relative "
                                               r"residual \d\.\d+e[-+]\d+ > tol=1\.0e-06"):
        fixed_point(f, z0, solver="picard", max_iter=3)
    with pytest.raises(FixedPointError, match="did not converge in 3 iterations"):
        fixed_point(f, z0, solver="picard", max_iter=3, strict=True)
    with pytest.raises(ValueError):
        fixed_point(f, z0, solver="picard", max_iter=3, strict=True, backward="auto")
    # the adjoint solve, too
    z = fixed_point(f, z0, tol=1e-12, backward_max_iter=2, backward_solver="picard")
    with pytest.warns(FixedPointWarning, match="adjoint solve did not converge in 2"):
        torch.autograd.grad((w * z).sum(), [W])
    z = fixed_point(f, z0, tol=1e-12, backward_max_iter=2, backward_solver="picard",
                    strict=True)
    with pytest.raises(FixedPointError, match="adjoint"):
        torch.autograd.grad((w * z).sum(), [W])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = fixed_point(f, z0, tol=1e-12)
        torch.autograd.grad((w * z).sum(), [W])
    # no fixed point: Anderson's least squares degenerate (float32), still a clean warning
    with pytest.warns(FixedPointWarning, match="did not converge in 100"):
        fixed_point(lambda z: torch.exp(2 * z), torch.zeros(2, 3))


def test_atol_for_a_fixed_point_at_zero():
    st = FixedPointStats()
    with pytest.warns(FixedPointWarning):  # the relative residual of z -> z / 2 stays ~1
        fixed_point(lambda z: 0.5 * z, torch.ones(4, dtype=F64), solver="picard", stats=st,
                    max_iter=40)
    assert st.residual > 0.4
    z = fixed_point(lambda z: 0.5 * z, torch.ones(4, dtype=F64), solver="picard", atol=1e-9,
                    stats=st, max_iter=40)
    assert st.converged and st.iterations == 30 and float(z.abs().max()) <= 1e-9


def test_no_grad_and_nothing_to_differentiate():
    W, x, _ = deq(d=4, B=2, seed=21)
    st = FixedPointStats()
    for backward in ("implicit", "unrolled", "phantom", "auto"):
        with torch.no_grad():
            z = fixed_point(lambda z: torch.tanh(z @ W.T + x), torch.zeros(2, 4, dtype=F64),
                            backward=backward, stats=st)
        assert not z.requires_grad and st.backward == "none" and st.converged
    Wc, xc = W.detach(), x.detach()
    z, st = fixed_point(lambda z: torch.tanh(z @ Wc.T + xc), torch.zeros(2, 4, dtype=F64),
                        return_stats=True)
    assert not z.requires_grad and st.backward == "none"


def test_bad_arguments():
    z0 = torch.zeros(3)

    def f(z):
        return 0.5 * z

    with pytest.raises(ValueError, match="unknown solver"):
        fixed_point(f, z0, solver="newton")
    with pytest.raises(ValueError, match="unknown backward"):
        fixed_point(f, z0, backward="adjoint")
    with pytest.raises(TypeError, match=r"unknown option\(s\) m for solver 'picard'"):
        fixed_point(f, z0, solver="picard", m=3)
    fixed_point(f, z0, solver="picard", backward_solver="anderson", m=3)  # m: the adjoint's
    with pytest.raises(ValueError, match="shape"):
        fixed_point(lambda z: z[:2], z0)
    with pytest.raises(TypeError, match="floating-point"):
        fixed_point(f, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_dims"):
        fixed_point(f, z0, batch_dims=2)
    with pytest.raises(ValueError, match="beta"):
        fixed_point(f, z0, solver="picard", beta=1.5)
    with pytest.raises(ValueError, match="budget= or snapshots="):
        fixed_point(f, z0, budget="1MiB", snapshots=3)


def test_stats_fields_and_return_stats():
    W, x, w = deq(d=6, B=2, seed=22)
    z, st = fixed_point(lambda z: torch.tanh(z @ W.T + x), torch.zeros(2, 6, dtype=F64),
                        return_stats=True, tol=1e-10)
    assert isinstance(st, FixedPointStats)
    assert st.iterations + 1 == len(st.residuals) and st.residuals[-1] == st.residual <= 1e-10
    assert st.residuals[0] > st.residual and st.forward_time > 0
    assert st.backward_time == 0 and st.backward_converged is None
    torch.autograd.grad((w * z).sum(), [W])
    assert st.backward_converged and st.backward_time > 0 and st.backward_solver == "anderson"
    assert st.backward_residuals[-1] <= 1e-10
    assert math.isfinite(st.residual)


def _deq(seed: int = 0):
    torch.manual_seed(seed)
    W = (0.3 * torch.randn(6, 6, dtype=torch.float64)).requires_grad_()
    x = torch.randn(4, 6, dtype=torch.float64)
    return (lambda z: torch.tanh(z @ W.T + x)), W, torch.zeros(4, 6, dtype=torch.float64)


@pytest.mark.parametrize("obj, short", [
    (deepsolve.Implicit(solver="picard", tol=1e-12, max_iter=300),
     dict(backward="implicit", backward_solver="picard", backward_tol=1e-12,
          backward_max_iter=300)),
    (deepsolve.Unrolled(snapshots=3), dict(backward="unrolled", snapshots=3)),
    (deepsolve.Phantom(3, 0.7), dict(backward="phantom", phantom_steps=3, phantom_damping=0.7)),
    (deepsolve.Auto(), dict(backward="auto")),
], ids=lambda v: type(v).__name__ if not isinstance(v, dict) else v["backward"])
def test_backward_mode_objects_are_their_short_forms(obj, short):
    """A backward-mode object gives the gradient of its keyword short form, bit for bit."""
    f, W, z0 = _deq()
    z = deepsolve.fixed_point(f, z0, tol=1e-10, max_iter=200, backward=obj)
    (g,) = torch.autograd.grad(z.square().sum(), W)
    z2 = deepsolve.fixed_point(f, z0, tol=1e-10, max_iter=200, **short)
    (g2,) = torch.autograd.grad(z2.square().sum(), W)
    assert torch.equal(g, g2)


def test_unrolled_object_equals_plain_autograd_through_the_iterations():
    f, W, z0 = _deq(1)
    st = deepsolve.FixedPointStats()
    z = deepsolve.fixed_point(f, z0, solver="picard", tol=1e-8, max_iter=100, stats=st,
                              backward=deepsolve.Unrolled(snapshots=4))
    (g,) = torch.autograd.grad(z.sum(), W)
    zz = z0
    for _ in range(st.iterations):
        zz = f(zz)
    (ref,) = torch.autograd.grad(zz.sum(), W)
    assert torch.allclose(g, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("make, message", [
    (lambda: deepsolve.Phantom(0), "phantom_steps must be"),
    (lambda: deepsolve.Phantom(2, 1.5), "phantom_damping must be"),
    (lambda: deepsolve.Unrolled(snapshots=3, budget="1MiB"), "not both"),
    (lambda: deepsolve.fixed_point(lambda z: z * 0.5, torch.ones(3), backward=3),
     "backward must be one of"),
    (lambda: deepsolve.fixed_point(lambda z: z * 0.5, torch.ones(3), phantom_damping=2.0),
     "phantom_damping must be"),
])
def test_bad_backward_modes_are_one_line_errors(make, message):
    with pytest.raises(ValueError, match=message) as err:
        make()
    assert "\n" not in str(err.value)


# --- a divergence is never called convergence ----------------------------------------------

def test_picard_divergence_is_not_convergence_even_where_norms_overflow():
    """1.6 z + 1 in float32 reached z ~ 6e18, where ||f(z)||^2 overflows: the relative
    residual divided by inf was 0 and the solve reported converged=True, even with
    strict=True; in float64 1.5 z + 1 "converged" at iteration 870 with z ~ 3e153."""
    with pytest.warns(FixedPointWarning, match="did not converge in 100 iterations"):
        z, st = fixed_point(lambda z: 1.6 * z + 1, torch.zeros(8), solver="picard",
                            return_stats=True)
    assert not st.converged and st.residual == pytest.approx(0.375, rel=1e-3)
    assert float(z.abs().max()) > 1e19         # past the float32 overflow of ||z||^2
    with pytest.raises(FixedPointError, match="did not converge"):
        fixed_point(lambda z: 1.6 * z + 1, torch.zeros(8), solver="picard", strict=True)
    with pytest.raises(FixedPointError, match="not finite"):  # runs into inf in float64
        fixed_point(lambda z: 1.5 * z + 1, torch.zeros(8, dtype=F64), solver="picard",
                    max_iter=2000, return_stats=True)


@pytest.mark.parametrize("backward", ["implicit", "unrolled"])
@pytest.mark.parametrize("solver", ["picard", "anderson", "broyden"])
def test_a_growing_iterate_is_not_converged_in_any_solver(solver, backward):
    """f(z) = z + c has no fixed point; its relative residual ~ 1/k falls below tol=1e-2
    after ~100 steps (every solver falls back to Picard here), and that was "converged"."""
    c = torch.tensor(1.0, dtype=F64, requires_grad=True)
    f = lambda z: z + c  # noqa: E731
    with pytest.warns(FixedPointWarning, match="only because the iterate grew"):
        z, st = fixed_point(f, torch.zeros(4, dtype=F64), solver=solver, tol=1e-2,
                            max_iter=300, backward=backward, return_stats=True)
    assert not st.converged and st.iterations == 300 and st.residual < 1e-2
    with pytest.raises(FixedPointError, match="only because the iterate grew"):
        fixed_point(f, torch.zeros(4, dtype=F64), solver=solver, tol=1e-2, max_iter=300,
                    backward=backward, strict=True)
    # a genuine fixed point far from the start still converges: z* = 1e6, ||z*|| >> r_0
    z, st = fixed_point(lambda z: 0.5 * z + 5e5 * c, torch.zeros(4, dtype=F64),
                        solver=solver, backward=backward, return_stats=True)
    assert st.converged and torch.allclose(z, torch.full((4,), 1e6, dtype=F64))
