"""deepsolve.pinn.quasi_newton: the Broyden-family update (secant condition, BFGS as the
textbook formula, positive definiteness), and SSBroyden / SSBFGS / BFGS minimising problems
with known minima: a least-squares fit, the Rosenbrock function and a 1-D Poisson PINN."""

from __future__ import annotations

import math

import pytest
import torch
from test_gauss_newton import poisson_pinn

from deepsolve.pinn import QUASI_NEWTON, SelfScaledBroyden, least_squares_loss
from deepsolve.pinn.quasi_newton import (
    APPROX_WOLFE,
    SYMMETRIZE_EVERY,
    _LazyInverse,
    approximate_wolfe,
    broyden_terms,
    broyden_update,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

F64 = torch.float64


def pair(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(n, n, dtype=F64, generator=g)
    B = M @ M.T + n * torch.eye(n, dtype=F64)   # a positive definite Hessian
    grad = torch.randn(n, dtype=F64, generator=g)
    H = torch.linalg.inv(B + 0.3 * torch.eye(n, dtype=F64))  # an earlier approximation
    alpha = 0.7
    s = -alpha * (H @ grad)
    y = B @ s
    return H, s, y, grad, alpha


@pytest.mark.parametrize("method", QUASI_NEWTON)
@pytest.mark.parametrize("first", [True, False])
def test_update_satisfies_the_secant_condition_and_stays_positive_definite(method, first):
    H, s, y, g, alpha = pair()
    assert broyden_update(H, s, y, g, alpha, method, first)
    torch.testing.assert_close(H @ y, s, rtol=1e-10, atol=1e-12)   # H_{k+1} y_k = s_k
    torch.testing.assert_close(H, H.T, rtol=0, atol=1e-14)
    assert float(torch.linalg.eigvalsh(H).min()) > 0


def test_bfgs_update_is_the_textbook_formula():
    H, s, y, g, alpha = pair(seed=3)
    rho = 1 / float(y @ s)
    eye = torch.eye(len(s), dtype=F64)
    want = (eye - rho * torch.outer(s, y)) @ H @ (eye - rho * torch.outer(y, s)) \
        + rho * torch.outer(s, s)
    broyden_update(H, s, y, g, alpha, "bfgs", first=False)
    torch.testing.assert_close(H, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", QUASI_NEWTON)
def test_update_without_the_averaging_is_symmetric_to_round_off(method):
    """The rank-3 product alone (what most iterations do) equals the averaged update to
    round-off; SelfScaledBroyden's H stays symmetric over hundreds of iterations."""
    H, s, y, g, alpha = pair(n=40, seed=5)
    H2 = H.clone()
    broyden_update(H, s, y, g, alpha, method, False)
    broyden_update(H2, s, y, g, alpha, method, False, symmetrize=False)
    torch.testing.assert_close(H2, H, rtol=1e-13, atol=1e-15)
    assert float((H2 - H2.T).abs().max()) <= 1e-15 * float(H2.abs().max())
    x = torch.tensor([-1.2, 1.0] * 15, dtype=F64, requires_grad=True)
    opt = SelfScaledBroyden([x], method=method, max_iter=300)

    def closure():  # the chained Rosenbrock function in 30 dimensions: 180-260 iterations
        opt.zero_grad()
        loss = (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()
        loss.backward()
        return loss

    loss = float(opt.step(closure).detach())
    H = opt.state[x]["H"]
    assert opt.state[x]["n_iter"] > 2 * SYMMETRIZE_EVERY  # several averagings
    # a search can fail only at the round-off of the zero minimum (a loss of ~1e-30)
    assert opt.state[x]["failed_ls"] == 0 or loss < 1e-25
    assert loss < 1e-20
    assert float((H - H.T).abs().max()) <= 1e-12 * float(H.abs().max())


@pytest.mark.parametrize("method", QUASI_NEWTON)
def test_pending_rank3_terms_equal_the_dense_updates(method):
    """``H = c H0 + W diag(w) Wᵀ`` with the updates pending: its products and, once folded,
    its matrix equal the dense update's, pair after pair (the BFGS scaling of H0 at the
    first pair included)."""
    n, k = 12, 7
    gen = torch.Generator().manual_seed(1)
    M = torch.randn(n, n, dtype=F64, generator=gen)
    B = M @ M.T + torch.eye(n, dtype=F64)          # the curvature the pairs come from
    dense = torch.eye(n, dtype=F64)
    lazy = _LazyInverse(torch.eye(n, dtype=F64), fold_every=k)
    probe = torch.randn(n, dtype=F64, generator=gen)
    for i in range(k):
        g = torch.randn(n, dtype=F64, generator=gen)
        s = -0.6 * (dense @ g)
        y = B @ s + 1e-3 * torch.randn(n, dtype=F64, generator=gen)
        assert broyden_update(dense, s, y, g, 0.6, method, i == 0, symmetrize=False)
        terms = broyden_terms(lazy @ y, s, y, g, 0.6, method, i == 0)
        assert terms is not None
        lazy.add(*terms)
        torch.testing.assert_close(lazy @ probe, dense @ probe, rtol=1e-12, atol=0)
    assert lazy.full and lazy.m == 3 * k
    lazy.fold(symmetrize=False)
    assert (lazy.c, lazy.m) == (1.0, 0)
    torch.testing.assert_close(lazy.H0, dense, rtol=1e-12, atol=1e-14)


def test_folding_cadence_leaves_the_iterates():
    """Folding after every update or after 16 changes the iterates by round-off only: 40
    SSBroyden iterations on the Poisson PINN agree to 1e-8 in every parameter."""
    def fit(fold_every):
        torch.manual_seed(0)
        model, terms, _ = poisson_pinn()
        opt = SelfScaledBroyden(list(model.parameters()), max_iter=40, fold_every=fold_every)

        def closure():
            opt.zero_grad()
            loss = least_squares_loss(terms())
            loss.backward()
            return loss

        opt.step(closure)
        assert opt.state[opt._params[0]]["n_iter"] == 40
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    a, b = fit(1), fit(16)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-8)
    assert float((a - b).abs().max()) > 0   # not the same arithmetic (the test can tell)


@pytest.mark.parametrize("first", [True, False])
def test_a_pair_whose_bound_rounds_to_zero_is_skipped(first):
    """A gradient 1e17 times the step makes ``a = bh - 1`` about 1/eps, SSBroyden's lower
    bound rho_m about 0 and sigma about 0 (exactly 0 raised ZeroDivisionError; slightly above,
    ``phi ~ 1/sigma`` broke the secant condition by 1e13): the pair is skipped, and the next
    sound pair updates as usual."""
    H, s, y, g, alpha = pair(seed=2)
    before = H.clone()
    assert not broyden_update(H, s, y, -1e17 * s, alpha, "ssbroyden", first)
    assert torch.equal(H, before)
    assert broyden_update(H, s, y, g, alpha, "ssbroyden", first)
    torch.testing.assert_close(H @ y, s, rtol=1e-10, atol=1e-12)


def _chained_rosenbrock(opt, x):
    def closure():
        opt.zero_grad()
        loss = (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()
        loss.backward()
        return loss
    return closure


def test_step_growth_starts_each_search_near_the_last_step():
    """``step_growth=1.5``: each search after the first starts at ``min(1, 1.5 t_last)``,
    the step the previous search accepted, and the run still reaches the minimum."""
    x = torch.tensor([-1.2, 1.0] * 5, dtype=F64, requires_grad=True)
    opt = SelfScaledBroyden([x], max_iter=300, step_growth=1.5)
    starts, accepted, progress = [], [], []
    search = opt._search

    def spy(obj, theta, t0, *args):
        out = search(obj, theta, t0, *args)
        starts.append(t0)
        accepted.append(out[2])
        progress.append(out[3])
        return out

    opt._search = spy  # type: ignore[method-assign]
    loss = float(opt.step(_chained_rosenbrock(opt, x)).detach())
    assert loss < 1e-20
    assert opt.state[x]["failed_ls"] == 0 or loss < 1e-25
    # after a search without progress: the unit step (the retry), else near the last step
    want = [min(1.0, 1.5 * t) if ok else 1.0
            for t, ok in zip(accepted[:-1], progress[:-1], strict=True)]
    assert starts[1:] == pytest.approx(want, rel=1e-15)
    assert min(starts[1:]) < 1.0   # the rule acted: some searches started below 1


def test_a_low_start_without_progress_retries_the_unit_step():
    """A search that started below the unit step and made no progress is repeated from
    the unit step before the curvature is given up (H reset): no failure is counted."""
    x = torch.tensor([-1.2, 1.0] * 5, dtype=F64, requires_grad=True)
    opt = SelfScaledBroyden([x], max_iter=300, step_growth=1.0)
    starts = []
    search = opt._search

    def low_starts_fail(obj, theta, t0, *args):  # after the first search, whose start
        starts.append(t0)                           # comes from the gradient's size
        out = search(obj, theta, t0, *args)
        return (*out[:3], False) if t0 < 1.0 and len(starts) > 1 else out

    opt._search = low_starts_fail  # type: ignore[method-assign]
    loss = float(opt.step(_chained_rosenbrock(opt, x)).detach())
    low = [i for i, t in enumerate(starts) if t < 1.0 and i > 0]
    assert low and all(starts[i + 1] == 1.0 for i in low if i + 1 < len(starts))
    assert opt.state[x]["failed_ls"] == 0 or loss < 1e-25
    assert loss < 1e-20


def _noisy(value: torch.Tensor, x: torch.Tensor, level: float = 1e-7) -> torch.Tensor:
    """``value`` with a round-off-like error of ``level`` times itself that jumps with the
    last bits of ``x``: the gradient is exact, the value resolves no smaller change."""
    noise = torch.sin(1e15 * (x.detach() * torch.arange(1, x.numel() + 1, dtype=F64)).sum())
    return value + (level * noise * value).detach()


@pytest.mark.parametrize("t0", [1e-6, 1.0, 1e4])
def test_approximate_wolfe_finds_the_band_on_the_derivative(t0):
    """On phi(t) = 1 + g t + a t^2 / 2 with a noisy value the search returns a step with
    sigma phi'(0) <= phi'(t) <= (2 delta - 1) phi'(0), i.e. t in
    [(1 - sigma) |g| / a, 2 (1 - delta) |g| / a], from short and long starts alike."""
    delta, sigma, eps = APPROX_WOLFE
    gtd, a = -1e-9, 1e3         # the decrease to the minimum, 5e-22, is far below the noise
    d = torch.ones(1, dtype=F64)
    calls = []

    def obj(theta, t, d):
        calls.append(t)
        x = theta + t * d
        f = _noisy(1 + gtd * x + 0.5 * a * x * x, x).sum()
        return float(f), (gtd + a * x).detach()

    theta = torch.zeros(1, dtype=F64)
    f_t, g_t, t, found = approximate_wolfe(obj, theta, t0, d, 1.0, gtd)
    assert found
    assert (1 - sigma) * -gtd / a <= t <= 2 * (1 - delta) * -gtd / a
    assert sigma * gtd <= float(g_t @ d) <= (2 * delta - 1) * gtd
    assert f_t <= 1.0 + eps
    assert len(calls) <= 20


def test_approximate_wolfe_gives_up_on_an_ascent():
    """A direction along which phi' never enters the band (a constant slope of the wrong
    sign): not found, within its evaluations."""
    d = torch.ones(2, dtype=F64)
    out = approximate_wolfe(lambda th, t, d: (1.0 + t, torch.ones(2, dtype=F64)),
                            torch.zeros(2, dtype=F64), 1.0, d, 1.0, -2.0, max_evals=12)
    assert out[3] is False


@pytest.mark.parametrize("approximate", [False, True])
def test_approximate_wolfe_goes_on_where_the_loss_no_longer_resolves_steps(approximate):
    """An ill-conditioned quadratic whose minimum value is 1 and whose value carries a
    round-off-like error of 1e-7 (the gradient exact): the strong-Wolfe search fails once
    the decrease is below 1e-7, and the reset to steepest descent cannot resolve one either,
    so the plain optimizer stalls with a gradient of ~1e-3; with ``approximate_wolfe`` the
    steps found on the derivative go on to the minimiser."""
    n = 12
    g = torch.Generator().manual_seed(3)
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=F64, generator=g))
    A = Q @ torch.diag(torch.logspace(0, 4, n, dtype=F64)) @ Q.T
    x_star = torch.randn(n, dtype=F64, generator=g)
    x = torch.nn.Parameter(x_star + torch.randn(n, dtype=F64, generator=g))
    opt = SelfScaledBroyden([x], max_iter=200, approximate_wolfe=approximate)

    def closure():
        opt.zero_grad()
        e = x - x_star
        loss = _noisy(1 + 0.5 * e @ (A @ e), x)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    grad = float((A @ (x.detach() - x_star)).norm())
    st = opt.state[x]
    if approximate:
        assert st["approximate"] > 0
        assert grad < 1e-9
    else:
        assert st["failed_ls"] > 0
        assert grad > 1e-6


def test_pairs_without_curvature_are_skipped():
    H, s, y, g, alpha = pair()
    before = H.clone()
    assert not broyden_update(H, s, -y, g, alpha, "ssbroyden", False)
    assert torch.equal(H, before)


def run(params, loss_fn, method, steps=1, max_iter=100):
    opt = SelfScaledBroyden(params, method=method, max_iter=max_iter)

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    for _ in range(steps):
        loss = opt.step(closure)
    return float(loss.detach()), opt


@pytest.mark.parametrize("method", QUASI_NEWTON)
def test_least_squares_fit_reaches_the_lstsq_solution(method):
    torch.manual_seed(0)
    A = torch.randn(50, 8, dtype=F64)
    y = torch.randn(50, dtype=F64)
    w = torch.nn.Parameter(torch.zeros(8, dtype=F64))
    loss, opt = run([w], lambda: (A @ w - y).pow(2).mean(), method, max_iter=60)
    want = torch.linalg.lstsq(A, y).solution
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-9)
    assert loss == pytest.approx(float((A @ want - y).pow(2).mean()), rel=1e-12)


@pytest.mark.parametrize("method", QUASI_NEWTON)
def test_rosenbrock_reaches_its_minimum(method):
    x = torch.nn.Parameter(torch.tensor([-1.2, 1.0], dtype=F64))
    loss, _ = run([x], lambda: 100 * (x[1] - x[0] ** 2) ** 2 + (1 - x[0]) ** 2, method,
                  max_iter=200)
    torch.testing.assert_close(x.detach(), torch.ones(2, dtype=F64), rtol=0, atol=1e-7)
    assert loss < 1e-14


# measured after 200 iterations (loss, relative L2 error): ssbroyden 2.5e-11, 1.9e-8;
# ssbfgs 2.6e-11, 1.1e-8; bfgs 1.9e-8, 3.5e-7 (Adam needs thousands of steps for 1e-3)
POISSON = {"ssbroyden": (1e-9, 1e-6), "ssbfgs": (1e-9, 1e-6), "bfgs": (1e-6, 1e-5)}


@pytest.mark.parametrize("method", QUASI_NEWTON)
def test_poisson_pinn_reaches_high_accuracy(method):
    model, terms, error = poisson_pinn()
    start = error()
    loss, opt = run(list(model.parameters()), lambda: least_squares_loss(terms()), method,
                    steps=4, max_iter=50)
    assert start > 0.5
    assert opt.state[opt._params[0]]["n_iter"] == 200
    max_loss, max_error = POISSON[method]
    assert loss < max_loss
    assert error() < max_error


def test_state_round_trips_and_continues_identically():
    def fresh():
        torch.manual_seed(0)
        return poisson_pinn()

    model, terms, _ = fresh()
    whole, _ = run(list(model.parameters()), lambda: least_squares_loss(terms()),
                   "ssbroyden", steps=4, max_iter=10)

    model, terms, _ = fresh()
    _, opt = run(list(model.parameters()), lambda: least_squares_loss(terms()), "ssbroyden",
                 steps=2, max_iter=10)
    state = opt.state_dict()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model2, terms2, _ = fresh()
    model2.load_state_dict(params)
    opt2 = SelfScaledBroyden(list(model2.parameters()), method="ssbroyden", max_iter=10)
    opt2.load_state_dict(state)
    assert torch.equal(opt2.state[opt2._params[0]]["H"], opt.state[opt._params[0]]["H"])

    def closure():
        opt2.zero_grad()
        loss = least_squares_loss(terms2())
        loss.backward()
        return loss

    for _ in range(2):
        loss = opt2.step(closure)
    assert float(loss) == whole


class _FlatValue(torch.autograd.Function):
    """A loss whose value never changes but whose reported gradient is 1: every line
    search along -H g ends at a step of about zero with f_new == f."""

    @staticmethod
    def forward(ctx, x):
        return x.new_ones(())

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.ones(3, dtype=F64)


def test_a_search_without_decrease_fails_the_step_at_once():
    x = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=F64))
    start = x.detach().clone()
    calls = []

    def loss_fn():
        calls.append(1)
        return _FlatValue.apply(x)

    loss, opt = run([x], loss_fn, "ssbroyden", max_iter=20)
    st = opt.state[x]
    # one search (at most max_ls calls) plus the closures at the start and the end;
    # accepting f_new == f would run all 20 iterations of 50-call searches
    assert len(calls) <= opt.max_ls + 2
    assert (st["n_iter"], st["failed_ls"], st["first"]) == (1, 1, True)
    assert torch.equal(x.detach(), start)
    assert loss == 1.0


def test_bad_input_errors():
    p = torch.nn.Parameter(torch.zeros(5, dtype=F64))
    with pytest.raises(ValueError, match="method must be one of"):
        SelfScaledBroyden([p], method="dfp")
    with pytest.raises(ValueError, match="more than max_params=4"):
        SelfScaledBroyden([p], max_params=4)
    with pytest.raises(ValueError, match="step_growth must be >= 1"):
        SelfScaledBroyden([p], step_growth=0.5)
    with pytest.raises(ValueError, match="fold_every must be >= 1"):
        SelfScaledBroyden([p], fold_every=0)
    with pytest.raises(ValueError, match="needs a closure"):
        SelfScaledBroyden([p]).step(None)  # type: ignore[arg-type]
    assert math.isfinite(run([p], lambda: (p - 1).pow(2).sum(), "bfgs")[0])
