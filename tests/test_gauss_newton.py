"""deepsolve.pinn.gauss_newton: the residual Jacobian against torch.func.jacrev (with and
without chunks), Levenberg–Marquardt on problems with known minima (a linear and a nonlinear
least-squares fit, a 1-D Poisson PINN), the dense and matrix-free paths agreeing, budget
chunking, and the refusal of terms that are not the closure's loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, jacrev

from deepsolve.pinn import (
    FNN,
    GaussNewton,
    LeastSquaresTerm,
    jet,
    least_squares_loss,
    residual_jacobian,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

F64 = torch.float64


def closure_for(opt, terms):
    def closure():
        opt.zero_grad()
        loss = least_squares_loss(terms())
        loss.backward()
        return loss
    return closure


class Affine(torch.nn.Module):
    """``x @ w + b`` for points ``(n, d)``: residuals of a linear least-squares fit."""

    def __init__(self, d: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(d, dtype=F64))
        self.b = torch.nn.Parameter(torch.zeros((), dtype=F64))

    def forward(self, x):
        return x @ self.w + self.b


def burgers_like_terms(model, x, data):
    """A PINN residual with second derivatives (torch.func backend), plus a two-component
    data term with per-component weights and the targets riding along as columns."""
    def pde(p):
        j = jet(model, p, 2, backend="func", hessian_pairs=((0, 0),))
        return j.jacobian[:, 1, 0] + j.value[:, 0] * j.jacobian[:, 0, 0] - 0.01 * j.d(0, 0, 0)

    def fit(p):
        return model(p[:, :2]) - p[:, 2:]

    return [LeastSquaresTerm(pde, x, 0.7), LeastSquaresTerm(fit, data, (2.0, 0.5))]


@pytest.mark.parametrize("chunk", [None, 7, 1])
def test_jacobian_equals_jacrev_of_the_residual_vector(chunk):
    torch.manual_seed(0)
    model = FNN(2, 2, 6, 2).to(F64)
    x = torch.rand(23, 2, dtype=F64)
    data = torch.cat([torch.rand(11, 2, dtype=F64), torch.randn(11, 2, dtype=F64)], 1)
    terms = burgers_like_terms(model, x, data)
    r, J = residual_jacobian(model, terms, chunk_rows=chunk)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def vector(th):
        """The scaled residuals as a function of the flat parameters, by hand."""
        parts = [t.view(sh) for t, sh in
                 zip(torch.split(th, [math.prod(sh) for sh in shapes]), shapes, strict=True)]
        params = {"m." + n: v for n, v in zip(names, parts, strict=True)}
        pde = functional_call(_Wrap(model, terms[0].fn), params, (x,))
        fit = functional_call(_Wrap(model, terms[1].fn), params, (data,))
        scale = torch.tensor([2.0, 0.5], dtype=F64).div(11).sqrt()
        return torch.cat([pde * math.sqrt(0.7 / 23), (fit * scale).reshape(-1)])

    want_r = vector(theta)
    want_J = jacrev(vector)(theta)
    assert J.shape == (23 + 22, theta.numel())
    torch.testing.assert_close(r, want_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(J, want_J, rtol=0, atol=1e-12)
    # |r|^2 is the loss the terms define
    assert float(r @ r) == pytest.approx(float(least_squares_loss(terms).detach()), rel=1e-12)


class _Wrap(torch.nn.Module):
    def __init__(self, m, fn):
        super().__init__()
        self.m = m
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_linear_least_squares_reaches_the_normal_equations_solution():
    torch.manual_seed(1)
    A = torch.randn(60, 5, dtype=F64)
    y = torch.randn(60, dtype=F64)
    model = Affine(5)
    pts = torch.cat([A, y[:, None]], 1)
    def terms():
        return [LeastSquaresTerm(lambda p: model(p[:, :5]) - p[:, 5], pts)]
    opt = GaussNewton(model.parameters(), model, terms, max_iter=8)
    opt.step(closure_for(opt, terms))
    X = torch.cat([A, torch.ones(60, 1, dtype=F64)], 1)
    want = torch.linalg.lstsq(X, y).solution
    got = torch.cat([model.w.detach(), model.b.detach().reshape(1)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def exp_fit(dense_max: int, chunk_rows: int | None = None, budget=None):
    """y = a exp(b t) sampled exactly: zero residual at (a, b) = (2, -1.5)."""
    class Exp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor(1.0, dtype=F64))
            self.b = torch.nn.Parameter(torch.tensor(0.0, dtype=F64))

        def forward(self, t):
            return self.a * torch.exp(self.b * t)

    model = Exp()
    t = torch.linspace(0, 2, 40, dtype=F64)
    pts = torch.stack([t, 2.0 * torch.exp(-1.5 * t)], 1)
    def terms():
        return [LeastSquaresTerm(lambda p: model(p[:, 0]) - p[:, 1], pts)]
    opt = GaussNewton(model.parameters(), model, terms, max_iter=30, dense_max=dense_max,
                      chunk_rows=chunk_rows, budget=budget)
    loss = opt.step(closure_for(opt, terms))
    return model, float(loss), opt


@pytest.mark.parametrize("dense_max,chunk,budget", [(10, None, None), (0, None, None),
                                                    (10, 3, None), (10, None, 200)],
                         ids=["dense", "cg", "chunked", "budget"])
def test_nonlinear_fit_reaches_its_zero_residual_minimum(dense_max, chunk, budget):
    model, loss, opt = exp_fit(dense_max, chunk, budget)
    assert abs(float(model.a) - 2.0) < 1e-10 and abs(float(model.b) + 1.5) < 1e-10
    assert loss < 1e-20
    if budget is not None:   # 200 bytes at 3 * 2 values of 8 bytes per point: 4 points a chunk
        from deepsolve.pinn.gauss_newton import _Residuals
        assert opt.rows(_Residuals(model, list(model.parameters()), opt.terms())) == 4


def poisson_pinn(width=10, n=64, seed=0):
    """-u'' = pi^2 sin(pi x) on [0, 1], u = x (1 - x) N(x): exact u = sin(pi x)."""
    torch.manual_seed(seed)
    net = FNN(1, 1, width, 2, scalar=True).to(F64)

    class Hard(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return x[..., 0] * (1 - x[..., 0]) * self.net(x)

    model = Hard()
    x = ((torch.arange(n, dtype=F64) + 0.5) / n)[:, None]

    def pde(p):
        j = jet(model, p, 2, backend="func")
        return -j.hessian[:, 0, 0] - math.pi**2 * torch.sin(math.pi * p[:, 0])

    def terms():
        return [LeastSquaresTerm(pde, x)]

    test = torch.linspace(0, 1, 201, dtype=F64)[:, None]

    def error():
        with torch.no_grad():
            exact = torch.sin(math.pi * test[:, 0])
            return float((model(test) - exact).norm() / exact.norm())

    return model, terms, error


def test_poisson_pinn_reaches_high_accuracy():
    model, terms, error = poisson_pinn()
    opt = GaussNewton(model.parameters(), model, terms, max_iter=1)
    closure = closure_for(opt, terms)
    start = error()
    for _ in range(60):
        loss = opt.step(closure)
    assert start > 0.5
    assert float(loss) < 1e-7      # from about 50 (measured: 1e-8 after 60 iterations)
    assert error() < 5e-6          # measured: 2.2e-6 (Adam: ~1e-3 in thousands of steps)


def test_terms_that_are_not_the_loss_are_refused():
    model, terms, _ = poisson_pinn()
    opt = GaussNewton(model.parameters(), model, terms)

    def closure():   # the problem's loss has a weight the terms lack
        opt.zero_grad()
        loss = 2.0 * least_squares_loss(terms())
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="terms must be the problem's loss terms"):
        opt.step(closure)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_bad_input_errors():
    model, terms, _ = poisson_pinn()
    with pytest.raises(ValueError, match="max_iter must be >= 1"):
        GaussNewton(model.parameters(), model, terms, max_iter=0)
    other = torch.nn.Parameter(torch.zeros(3, dtype=F64))
    opt = GaussNewton([other], model, terms)
    with pytest.raises(ValueError, match="parameters of the model"):
        opt.step(closure_for(opt, terms))
    x = torch.rand(5, 1, dtype=F64)
    bad = [LeastSquaresTerm(lambda p: model(p).unsqueeze(1).repeat(1, 2), x, (1.0, 2.0, 3.0))]
    with pytest.raises(ValueError, match="3 weights for residuals of shape"):
        least_squares_loss(bad)


def test_runs_under_saved_tensor_hooks_and_restores_them():
    """A memory meter's saved-tensor hooks are active (a run with --budget): the Jacobian
    (torch.func.jacrev) runs with them suspended, and they are back afterwards."""
    from deepsolve.pinn.chunked import SavedBytes

    model, terms, error = poisson_pinn()
    opt = GaussNewton(model.parameters(), model, terms)
    closure = closure_for(opt, terms)
    with SavedBytes() as meter:
        for _ in range(5):
            opt.step(closure)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert hooks is not None                       # the meter's hooks are still there
    assert meter.peak > 0                              # and saw the closure's backward
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert error() < 0.1


def test_jacobian_columns_follow_the_order_of_the_parameters_given():
    """The flat parameter vector is laid out in the order the parameters are passed; the
    Jacobian's columns follow it, whatever the model's own order."""
    torch.manual_seed(0)
    model = FNN(2, 2, 5, 2).to(F64)
    x = torch.rand(9, 2, dtype=F64)
    data = torch.cat([torch.rand(4, 2, dtype=F64), torch.randn(4, 2, dtype=F64)], 1)
    terms = burgers_like_terms(model, x, data)
    params = list(model.parameters())
    _, J = residual_jacobian(model, terms, params)
    _, Jr = residual_jacobian(model, terms, params[::-1])
    cols = torch.split(torch.arange(J.shape[1]), [p.numel() for p in params])
    torch.testing.assert_close(Jr, J[:, torch.cat(cols[::-1])], rtol=0, atol=0)


# ----------------------------------------------------------------------------- sketched


def linear_problem(n=60, d=5, seed=1):
    torch.manual_seed(seed)
    A = torch.randn(n, d, dtype=F64)
    y = torch.randn(n, dtype=F64)
    model = Affine(d)
    pts = torch.cat([A, y[:, None]], 1)

    def terms():
        return [LeastSquaresTerm(lambda p: model(p[:, :d]) - p[:, d], pts)]

    X = torch.cat([A, torch.ones(n, 1, dtype=F64)], 1)
    return model, terms, torch.linalg.lstsq(X, y).solution


@pytest.mark.parametrize("sketch,sketch_params", [(0.25, None), (12, None), (None, 3),
                                                  (0.5, 0.5)],
                         ids=["rows-fraction", "rows-count", "params", "doubly"])
def test_sketched_steps_reach_the_least_squares_solution(sketch, sketch_params):
    """The curvature from a quarter of the rows (or a step in 3 of 6 parameters) is not the
    Hessian, but the gradient and the gain ratio are exact: the iterates reach the
    least-squares solution, not a sketch's (whose own solutions lie 1e-1 away). Near the
    minimum the loss changes fall below float64's resolution of the loss (~60), which
    bounds the distance reached at ~1e-8 (measured 4e-9 to 7e-9)."""
    model, terms, want = linear_problem()
    opt = GaussNewton(model.parameters(), model, terms, max_iter=200, sketch=sketch,
                      sketch_params=sketch_params, seed=3)
    opt.step(closure_for(opt, terms))
    got = torch.cat([model.w.detach(), model.b.detach().reshape(1)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_sketched_curvature_is_the_scaled_jacobian_of_the_drawn_rows():
    """J_S^T J_S from the drawn points, rows of term k scaled by sqrt(M_k/m_k), equals the
    product of torch.func.jacrev's rows at those points; g and L are the full ones."""
    from deepsolve.pinn.gauss_newton import _Residuals

    torch.manual_seed(0)
    model = FNN(2, 2, 6, 2).to(F64)
    x = torch.rand(23, 2, dtype=F64)
    data = torch.cat([torch.rand(11, 2, dtype=F64), torch.randn(11, 2, dtype=F64)], 1)
    terms = burgers_like_terms(model, x, data)
    opt = GaussNewton(model.parameters(), model, lambda: terms, sketch=0.4, seed=5)
    st = opt.state[next(model.parameters())]
    res = _Residuals(model, list(model.parameters()), terms)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    A, g, L = opt._sketched_normal(res, theta, 4, st, opt._generator(st), None)
    r, J = residual_jacobian(model, terms)
    gen = opt._generator(st)   # the same draws again
    rows, want = [], torch.zeros_like(A)
    start = 0
    for t, comps in ((terms[0], 1), (terms[1], 2)):
        n = t.points.shape[0]
        m = math.ceil(0.4 * n)
        pick = torch.randperm(n, generator=gen)[:m]
        idx = (start + pick[:, None] * comps + torch.arange(comps)[None, :]).reshape(-1)
        want += J[idx].T @ J[idx] * (n / m)
        rows.append(m)
        start += n * comps
    assert rows == [10, 5]
    torch.testing.assert_close(A, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, J.T @ r, rtol=1e-12, atol=1e-12)
    assert L == pytest.approx(float(r @ r), rel=1e-12)


def test_sketched_pinn_reaches_high_accuracy_and_is_reproducible():
    errors, thetas = [], []
    for _ in range(2):
        model, terms, error = poisson_pinn()
        opt = GaussNewton(model.parameters(), model, terms, max_iter=1, sketch=0.5, seed=7)
        closure = closure_for(opt, terms)
        for _ in range(80):
            opt.step(closure)
        errors.append(error())
        thetas.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert errors[0] < 5e-5            # measured 1e-6 .. 1e-5; from > 0.5
    assert torch.equal(thetas[0], thetas[1])   # the sketches are seeded by the iteration


def test_sketch_bad_input():
    model, terms, _ = poisson_pinn()
    for bad in (1.5, -0.2, float("nan")):
        with pytest.raises(ValueError, match="sketch must be a fraction in"):
            GaussNewton(model.parameters(), model, terms, sketch=bad)
    with pytest.raises(ValueError, match="sketch_params must be a fraction in"):
        GaussNewton(model.parameters(), model, terms, sketch_params=2.5)
    opt = GaussNewton(model.parameters(), model, terms, sketch=0.5, dense_max=10)
    with pytest.raises(ValueError, match="need the dense normal equations"):
        opt.step(closure_for(opt, terms))
