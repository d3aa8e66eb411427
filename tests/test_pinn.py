"""deepsolve.pinn: derivatives, geometry, collocation/RAR, weighting, chunking, Adam→L-BFGS."""

from __future__ import annotations

import io
import math

import pytest
import torch

import deepsolve.pinn as P
from deepsolve.pinn.chunked import _mse_contribution

F64 = torch.float64
# torch's forward-mode decompositions script a few functions on first use (a torch warning)
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated"),
              pytest.mark.usefixtures("single_thread")]  # conftest: one intra-op thread
BACKENDS = [("func", "fwd"), ("func", "rev"), ("autograd", "fwd")]


# ----------------------------------------------------------------------------- closed forms


def f3(p):
    """(a, b, c) -> (a^3 b^2 c, sin(a) exp(b) c^2, a b + c^4); works pointwise and batched."""
    a, b, c = p[..., 0], p[..., 1], p[..., 2]
    return torch.stack([a**3 * b**2 * c, torch.sin(a) * torch.exp(b) * c**2, a * b + c**4], -1)


def exact(x):
    a, b, c = x[:, 0], x[:, 1], x[:, 2]
    s, co, e = torch.sin(a), torch.cos(a), torch.exp(b)
    z = torch.zeros_like(a)
    jac = torch.stack([
        torch.stack([3 * a**2 * b**2 * c, 2 * a**3 * b * c, a**3 * b**2], -1),
        torch.stack([co * e * c**2, s * e * c**2, 2 * s * e * c], -1),
        torch.stack([b, a, 4 * c**3], -1),
    ], 1)
    h0 = torch.stack([
        torch.stack([6 * a * b**2 * c, 6 * a**2 * b * c, 3 * a**2 * b**2], -1),
        torch.stack([6 * a**2 * b * c, 2 * a**3 * c, 2 * a**3 * b], -1),
        torch.stack([3 * a**2 * b**2, 2 * a**3 * b, z], -1)], 1)
    h1 = torch.stack([
        torch.stack([-s * e * c**2, co * e * c**2, 2 * co * e * c], -1),
        torch.stack([co * e * c**2, s * e * c**2, 2 * s * e * c], -1),
        torch.stack([2 * co * e * c, 2 * s * e * c, 2 * s * e], -1)], 1)
    one = torch.ones_like(a)
    h2 = torch.stack([
        torch.stack([z, one, z], -1),
        torch.stack([one, z, z], -1),
        torch.stack([z, z, 12 * c**2], -1)], 1)
    return f3(x), jac, torch.stack([h0, h1, h2], 1)


@pytest.fixture(scope="module")
def pts():
    g = torch.Generator().manual_seed(0)
    return torch.rand(11, 3, generator=g, dtype=F64) * 2 - 0.5


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1.0)
    assert err <= tol * scale, err


@pytest.mark.parametrize("backend,mode", BACKENDS)
def test_first_and_second_derivatives_match_closed_forms(pts, backend, mode):
    val, jac, hess = exact(pts)
    kw = {"backend": backend, "mode": mode}
    close(P.jacobian(f3, pts, **kw), jac)
    close(P.gradient(f3, pts, 1, **kw), jac[:, 1])
    close(P.hessian(f3, pts, **kw), hess)
    close(P.hessian(f3, pts, 0, **kw), hess[:, 0])
    j = P.jet(f3, pts, 2, **kw)
    close(j.value, val)
    close(j.jacobian, jac)
    close(j.hessian, hess)
    close(j.d(1, 0, 2), hess[:, 1, 0, 2])
    close(j.laplacian(1), hess[:, 1].diagonal(dim1=-2, dim2=-1).sum(-1))
    j1 = P.jet(f3, pts, 1, **kw)
    assert j1.hessian is None
    close(j1.jacobian, jac)
    jr = P.jet(f3, pts, 2, hessian_components=(2, 0), **kw)
    assert jr.hessian.shape == (11, 2, 3, 3)
    close(jr.d(0, 1, 1), hess[:, 0, 1, 1])
    close(jr.laplacian(2), hess[:, 2].diagonal(dim1=-2, dim2=-1).sum(-1))
    with pytest.raises(ValueError, match="no second derivatives"):
        jr.laplacian(1)
    jd = P.jet(f3, pts, 2, hessian_dims=(2,), hessian_components=(0,), **kw)
    assert jd.hessian.shape == (11, 1, 1, 3)
    close(jd.d(0, 2, 1), hess[:, 0, 2, 1])
    close(jd.d(0, 0, 2), hess[:, 0, 0, 2])          # symmetric lookup
    close(jd.laplacian(0, dims=(2,)), hess[:, 0, 2, 2])
    with pytest.raises(ValueError, match="no second derivative along"):
        jd.d(0, 0, 1)


@pytest.mark.parametrize("backend,mode", BACKENDS)
def test_partials_of_any_order_laplacian_and_divergence(pts, backend, mode):
    a, b, c = pts[:, 0], pts[:, 1], pts[:, 2]
    _, jac, hess = exact(pts)
    kw = {"backend": backend, "mode": mode}
    close(P.partial(f3, pts, (), **kw), f3(pts))
    close(P.partial(f3, pts, 0, 1, **kw), jac[:, 1, 0])
    close(P.partial(f3, pts, (0, 1), **kw), hess[:, :, 0, 1])           # mixed, all components
    close(P.partial(f3, pts, (1, 0), 0, **kw), 6 * a**2 * b * c)        # symmetric
    close(P.partial(f3, pts, (0, 0, 1), 0, **kw), 12 * a * b * c)       # third order, mixed
    close(P.partial(f3, pts, (2, 2, 2, 2), 2, **kw), torch.full_like(a, 24.0))  # fourth order
    close(P.partial(f3, pts, (0, 0, 0), 1, **kw), -torch.cos(a) * torch.exp(b) * c**2)
    lap = hess.diagonal(dim1=-2, dim2=-1).sum(-1)
    close(P.laplacian(f3, pts, **kw), lap)
    close(P.laplacian(f3, pts, 1, **kw), lap[:, 1])
    close(P.laplacian(f3, pts, 0, dims=(0, 1), **kw), 6 * a * b**2 * c + 2 * a**3 * c)
    close(P.divergence(f3, pts, **kw), jac[:, 0, 0] + jac[:, 1, 1] + jac[:, 2, 2])
    close(P.divergence(f3, pts, components=(2, 0), dims=(0, 1), **kw),
          jac[:, 2, 0] + jac[:, 0, 1])


@pytest.mark.parametrize("backend,mode", BACKENDS)
def test_scalar_functions_drop_the_component_axis(backend, mode):
    x = torch.rand(5, 2, dtype=F64)

    def g(p):
        return torch.exp(p[..., 0]) * torch.sin(2 * p[..., 1])

    kw = {"backend": backend, "mode": mode}
    e, s, c = torch.exp(x[:, 0]), torch.sin(2 * x[:, 1]), torch.cos(2 * x[:, 1])
    close(P.gradient(g, x, **kw), torch.stack([e * s, 2 * e * c], -1))
    close(P.laplacian(g, x, **kw), e * s - 4 * e * s)
    assert P.hessian(g, x, **kw).shape == (5, 2, 2)
    j = P.jet(g, x, **kw)
    assert j.value.shape == (5,) and j.jacobian.shape == (5, 2) and j.hessian.shape == (5, 2, 2)
    close(j.d(None, 1, 1), -4 * e * s)
    with pytest.raises(ValueError, match="component"):
        P.partial(g, x, (0,), component=0, **kw)


def test_linear_functions_give_zero_second_derivatives():
    x = torch.rand(4, 2, dtype=F64)
    lin = torch.nn.Linear(2, 3).double()
    for backend in ("func", "autograd"):
        assert P.hessian(lin, x, backend=backend).abs().max() == 0
        assert P.laplacian(lin, x, backend=backend).shape == (4, 3)


def test_bad_arguments():
    x = torch.rand(4, 2, dtype=F64)
    with pytest.raises(ValueError, match="backend"):
        P.jacobian(f3, x, backend="jax")
    with pytest.raises(ValueError, match="shape"):
        P.jacobian(f3, x[0])
    with pytest.raises(ValueError, match="out of range"):
        P.partial(f3, x, (5,))
    with pytest.raises(ValueError, match="mode"):
        P.partial(f3, x, (0,), mode="sideways")


@pytest.mark.parametrize("backend,mode", BACKENDS)
def test_derivatives_work_under_no_grad(pts, backend, mode):
    """Evaluation code runs under torch.no_grad(): both backends still differentiate in x."""
    _, jac, hess = exact(pts)
    with torch.no_grad():
        close(P.laplacian(f3, pts, 1, backend=backend, mode=mode),
              hess[:, 1].diagonal(dim1=-2, dim2=-1).sum(-1))
        j = P.jet(f3, pts, backend=backend, mode=mode)
        close(j.jacobian, jac)
        assert not j.hessian.requires_grad


# ----------------------------------------------------------------------------- networks


def mlp(seed=0, out=2):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, out)).double()


def test_func_and_autograd_agree_on_a_network():
    net = mlp()
    x = torch.rand(20, 2, dtype=F64)
    a = P.jet(net, x, backend="func")
    b = P.jet(net, x, backend="autograd")
    c = P.jet(net, x, backend="func", mode="rev")
    for u, v in ((a, b), (a, c)):
        close(u.value, v.value)
        close(u.jacobian, v.jacobian)
        close(u.hessian, v.hessian)
    close(P.partial(net, x, (0, 0, 1), 1), P.partial(net, x, (0, 0, 1), 1, backend="autograd"))


@pytest.mark.parametrize("backend", ["func", "autograd"])
def test_parameter_gradients_of_a_laplacian_loss_match_finite_differences(backend):
    """Composition: loss = mean((Δu - g)^2) + mean(u_x^2), differentiated w.r.t. the weights."""
    net = mlp(1, out=1)
    x = torch.rand(16, 2, dtype=F64)
    g = torch.sin(x[:, 0])

    def loss_fn():
        lap = P.laplacian(net, x, 0, backend=backend)
        ux = P.partial(net, x, (0,), 0, backend=backend)
        return (lap - g).pow(2).mean() + ux.pow(2).mean()

    loss = loss_fn()
    params = list(net.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    h = 1e-6
    with torch.no_grad():
        for p, gp in zip(params, grads, strict=True):
            flat, gflat = p.view(-1), gp.reshape(-1)
            for i in range(0, flat.numel(), max(flat.numel() // 4, 1)):
                old = flat[i].item()
                flat[i] = old + h
                up = loss_fn().item()
                flat[i] = old - h
                dn = loss_fn().item()
                flat[i] = old
                fd = (up - dn) / (2 * h)
                assert abs(fd - gflat[i].item()) <= 1e-6 * max(1.0, abs(fd)), (fd, gflat[i])


def test_pointwise_functional_call_gives_gradients_for_explicit_parameters():
    net = mlp(2, out=1)
    x = torch.rand(8, 2, dtype=F64)
    params = {k: v.detach().clone() for k, v in net.named_parameters()}

    def loss_of(ps):
        return P.laplacian(P.pointwise(net, ps), x, 0).pow(2).mean()

    g = torch.func.grad(loss_of)(params)
    loss = P.laplacian(net, x, 0).pow(2).mean()
    grads = torch.autograd.grad(loss, list(net.parameters()), allow_unused=True,
                                materialize_grads=True)
    ref = dict(zip(params, grads, strict=True))
    for k in params:
        close(g[k], ref[k])


# ----------------------------------------------------------------------------- chunking


def kovasznay_like(net):
    def residual(x):
        j = P.jet(net, x, 2, hessian_components=(0, 1))
        u, v = j.value[:, 0], j.value[:, 1]
        return {"mx": u * j.jacobian[:, 0, 0] + v * j.jacobian[:, 0, 1] + j.jacobian[:, 2, 0]
                - 0.05 * j.laplacian(0),
                "div": j.jacobian[:, 0, 0] + j.jacobian[:, 1, 1]}

    return residual


def three_out():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 3)).double()


@pytest.mark.parametrize("impl", ["recompute", "checkpoint"])
def test_chunked_gradient_equals_unchunked(impl):
    net = three_out()
    res = kovasznay_like(net)
    x = torch.rand(1000, 2, dtype=F64)
    params = list(net.parameters())
    full = P.chunked_mse(res, x)
    g_full = torch.autograd.grad(full["mx"] + 3 * full["div"], params)
    part = P.chunked_mse(res, x, chunk_size=137, params=params, impl=impl)
    assert set(part) == {"mx", "div"}
    for k in full:
        assert abs(part[k].item() - full[k].item()) <= 1e-12 * full[k].item()
    g_part = torch.autograd.grad(part["mx"] + 3 * part["div"], params)
    for a, b in zip(g_part, g_full, strict=True):
        close(a, b, 1e-10)


def test_chunked_supports_point_gradients_and_scalars():
    net = three_out()
    x = torch.rand(50, 2, dtype=F64, requires_grad=True)

    def contrib(xc):
        return P.laplacian(net, xc, 0).pow(2).sum()

    g_full = torch.autograd.grad(contrib(x), x)[0]
    total = P.chunked_sum(contrib, x, 7, params=list(net.parameters()))
    assert total.dim() == 0
    g_part = torch.autograd.grad(total, x)[0]
    close(g_part, g_full, 1e-10)
    with pytest.raises(ValueError, match="params"):
        P.chunked_sum(contrib, x, 7)


def test_chunked_lowers_the_peak_of_saved_tensors_and_respects_a_budget():
    net = three_out()
    res = kovasznay_like(net)
    x = torch.rand(4000, 2, dtype=F64)
    params = list(net.parameters())
    with P.SavedBytes() as full:
        loss = sum(P.chunked_mse(res, x).values())
        loss.backward()
    per_point, _ = P.bytes_per_point(lambda xc: _mse_contribution(res(xc), 4000), x)
    assert 0.8 * per_point * 4000 <= full.peak <= 1.3 * per_point * 4000 + 2**16
    budget = int(per_point * 500)
    chunk = P.chunk_size_for_budget(lambda xc: _mse_contribution(res(xc), 4000), x, budget)
    assert abs(chunk - 500) <= 1
    cr = P.ChunkedResidual(res, params=params, budget=budget)
    with P.SavedBytes() as part:
        loss = sum(cr(x).values())
        loss.backward()
    assert cr.chunk_size(x) == chunk
    assert part.peak < full.peak / 4
    assert part.peak <= 1.2 * budget + x.numel() * 8 + 2**16   # one chunk + the stored points
    assert part.live == 0 and full.live == 0                     # nothing leaks


def test_saved_bytes_sees_through_torch_func():
    net = three_out()
    x = torch.rand(300, 2, dtype=F64)
    with P.SavedBytes() as m:
        P.jet(net, x).hessian.pow(2).sum().backward()
    assert m.peak > 300 * 32 * 8     # at least one activation per point
    assert m.live == 0


# ----------------------------------------------------------------------------- geometry


@pytest.mark.parametrize("method", ["uniform", "sobol", "halton", "lhs"])
def test_samplers_stay_in_the_domain(method):
    rect = P.Rectangle((-0.5, -0.5), (1.0, 1.5))
    xi = rect.sample_interior(500, method, seed=3, dtype=F64)
    assert xi.shape == (500, 2) and rect.contains(xi).all()
    xb = rect.sample_boundary(203, method, seed=3, dtype=F64)
    assert xb.shape == (203, 2) and rect.on_boundary(xb, 1e-12).all()
    # faces get points in proportion to their length: 1.5 (x faces) vs 2 (y faces)
    on_left = (xb[:, 0] == -0.5).sum().item()
    assert abs(on_left - 203 * 2 / 7) <= 1
    st = P.SpaceTime(P.Interval(-1, 1), 0, 2)
    xs = st.sample_interior(100, method, 1, dtype=F64)
    assert st.contains(xs).all() and xs[:, 1].max() > 1.0
    lat = st.sample_boundary(40, method, 1, dtype=F64)
    assert st.on_boundary(lat, 1e-12).all() and ((lat[:, 0].abs() - 1).abs() < 1e-15).all()
    assert (lat[:, 0] == -1).sum() == 20
    init = st.sample_initial(30, method, 1, dtype=F64)
    assert st.on_initial(init, 1e-15).all() and st.contains(init).all()
    cube = P.Box((0, 0, 0), (1, 2, 3))
    xc = cube.sample_boundary(220, method, 5, dtype=F64)
    assert cube.on_boundary(xc, 1e-12).all()


def test_interval_boundary_and_normals():
    iv = P.Interval(-1.0, 2.0)
    xb = iv.sample_boundary(5, dtype=F64)
    assert sorted(xb[:, 0].tolist()) == [-1, -1, 2, 2, 2] or sorted(xb[:, 0].tolist()) == [
        -1, -1, -1, 2, 2]
    assert iv.normals(xb).abs().eq(1).all()
    rect = P.Rectangle((0, 0), (2, 1))
    pts = torch.tensor([[0.0, 0.5], [2.0, 0.3], [1.0, 0.0], [1.0, 1.0], [2.0, 1.0], [1.0, 0.5]],
                       dtype=F64)
    n = rect.normals(pts)
    s = 2**-0.5
    close(n, torch.tensor([[-1, 0], [1, 0], [0, -1], [0, 1], [s, s], [0, 0]], dtype=F64))
    st = P.SpaceTime(rect, 0, 1)
    nst = st.normals(torch.tensor([[0.0, 0.5, 0.0], [1.0, 0.5, 0.5]], dtype=F64))
    close(nst, torch.tensor([[-1, 0, 0], [0, 0, 0]], dtype=F64))
    g = rect.grid((3, 2), dtype=F64)
    assert g.shape == (6, 2) and g[1].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("method", ["sobol", "halton", "lhs", "uniform"])
def test_sampling_is_deterministic_given_a_seed(method):
    rect = P.Rectangle((0, 0), (1, 1))
    a = rect.sample_interior(64, method, seed=7, dtype=F64)
    b = rect.sample_interior(64, method, seed=7, dtype=F64)
    c = rect.sample_interior(64, method, seed=8, dtype=F64)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(rect.sample_boundary(30, method, 7), rect.sample_boundary(30, method, 7))
    if method in ("sobol", "halton"):  # low discrepancy: both halves of the square are hit
        counts = [((a[:, 0] < 0.5) & (a[:, 1] < 0.5)).sum().item(), (a[:, 0] >= 0.5).sum().item()]
        assert counts[0] == 16 or abs(counts[0] - 16) <= 3
        assert abs(counts[1] - 32) <= 3
    with pytest.raises(ValueError, match="method"):
        P.unit_samples(4, 2, "random-walk")


# ----------------------------------------------------------------------------- collocation, RAR


def test_collocation_resamples_every_k_iterations_and_is_idempotent():
    rect = P.Rectangle((0, 0), (1, 1))
    coll = P.Collocation(lambda n, s: rect.sample_interior(n, "sobol", s, F64), 32,
                         resample_every=5, seed=1)
    p0 = coll.points(0)
    assert torch.equal(coll.points(4), p0) and torch.equal(coll.points(0), p0)
    p5 = coll.points(5)
    assert not torch.equal(p5, p0) and torch.equal(coll.points(9), p5)
    again = P.Collocation(lambda n, s: rect.sample_interior(n, "sobol", s, F64), 32,
                          resample_every=5, seed=1)
    assert torch.equal(again.points(7), p5)  # reproducible per epoch (resumed runs)
    fixed = P.Collocation(lambda n, s: rect.sample_interior(n, "sobol", s, F64), 32)
    assert torch.equal(fixed.points(0), fixed.points(1000))


def test_rar_adds_the_points_of_largest_residual():
    rect = P.Rectangle((0, 0), (1, 1))
    center = torch.tensor([0.8, 0.3], dtype=F64)

    def residual(x):  # a sharp bump at `center`
        return torch.exp(-200 * (x - center).pow(2).sum(-1))

    coll = P.Collocation(lambda n, s: rect.sample_interior(n, "uniform", s, F64), 100, seed=0)
    added = coll.refine(residual, 5000, 20, iteration=10)
    assert added.shape == (20, 2) and len(coll) == 120
    assert (added - center).norm(dim=-1).max() < 0.05
    mags = residual(added)
    pool = rect.sample_interior(5000, "uniform", 123, F64)
    assert mags.min() >= torch.quantile(residual(pool), 0.99)
    assert coll.refine(residual, 5000, 20, iteration=10).shape[0] == 0  # idempotent
    assert len(coll) == 120
    pts = coll.points(11)
    assert pts.shape == (120, 2) and torch.equal(pts[100:], added)
    # several equations: the combined magnitude decides
    top, mag = P.select_largest(lambda x: {"a": residual(x), "b": 0 * x[:, 0]}, pool, 3)
    assert (top - center).norm(dim=-1).max() < 0.1 and (mag[:-1] >= mag[1:]).all()
    state = coll.state_dict()
    fresh = P.Collocation(lambda n, s: rect.sample_interior(n, "uniform", s, F64), 100, seed=0)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.points(11), pts)


# ----------------------------------------------------------------------------- weighting


def toy_terms(theta, scale_r=100.0, scale_b=0.01):
    return {"pde": scale_r * theta.pow(2).sum(), "bc": scale_b * (theta - 1).pow(2).sum()}


def test_annealing_raises_the_weight_of_a_term_with_small_gradients():
    theta = torch.tensor([0.5, -0.3, 2.0], dtype=F64, requires_grad=True)
    w = P.make_weights("annealing", {"pde": 1.0, "bc": 1.0}, reference=("pde",), alpha=1.0,
                       every=1)
    terms = toy_terms(theta)
    assert w.update_from(terms, [theta], 0)
    g_r = (200 * theta).detach().abs().max()
    g_b = (0.02 * (theta - 1)).detach().abs().mean()
    assert w["bc"] == pytest.approx(float(g_r / g_b), rel=1e-12) and w["bc"] > 1000
    assert w["pde"] == 1.0
    assert not w.update_from(terms, [theta], 0)  # once per iteration (L-BFGS closures)
    # the moving average: alpha = 0.9 moves 90 % of the way
    w9 = P.AnnealingWeights({"bc": 1.0}, ("pde",), alpha=0.9, every=1)
    w9.update_from(terms, [theta], 0)
    assert w9["bc"] == pytest.approx(0.1 + 0.9 * float(g_r / g_b), rel=1e-12)
    # and a term with large gradients gets a smaller weight
    big = toy_terms(theta, scale_r=0.01, scale_b=100.0)
    w2 = P.AnnealingWeights({"bc": 1.0}, ("pde",), alpha=0.5, every=1)
    w2.update_from(big, [theta], 0)
    assert w2["bc"] < 1.0
    # no updates off schedule or after `until`
    w3 = P.AnnealingWeights({"bc": 1.0}, ("pde",), every=10, until=20)
    assert not w3.update_from(terms, [theta], 5) and w3["bc"] == 1.0
    assert not w3.update_from(terms, [theta], 20) and w3["bc"] == 1.0


def test_annealing_balances_a_toy_fit():
    """Fitting θ to two targets: annealing shifts the solution towards the weakly scaled term."""
    results = {}
    for name in ("fixed", "annealing"):
        theta = torch.zeros(2, dtype=F64, requires_grad=True)
        w = P.make_weights(name, {}, reference=("pde",), alpha=0.9, every=5)
        opt = torch.optim.Adam([theta], lr=0.05)
        for it in range(300):
            opt.zero_grad()
            terms = {"pde": 10 * (theta - 1).pow(2).sum(), "bc": 1e-3 * (theta + 1).pow(2).sum()}
            w.update_from(terms, [theta], it)
            w.total(terms).backward()
            opt.step()
        results[name] = theta.detach().mean().item()
    assert results["fixed"] > 0.99                  # the boundary term is ignored
    assert results["annealing"] < results["fixed"] - 0.05
    with pytest.raises(ValueError, match="weighting"):
        P.make_weights("softadapt")


# ----------------------------------------------------------------------------- optimiser


def test_adam_then_lbfgs_switches_and_saves_its_phase():
    target = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    theta = torch.zeros(3, dtype=F64, requires_grad=True)
    opt = P.AdamLBFGS([theta], switch_at=3, adam_lr=0.1, lr=1.0, max_iter=20)
    assert isinstance(opt, torch.optim.LBFGS) and opt.phase == "adam"
    assert opt.param_groups[0]["lr"] == 0.1

    def closure():
        opt.zero_grad()
        loss = (theta - target).pow(4).sum() + (theta - target).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    assert opt.phase == "lbfgs" and opt.param_groups[0]["lr"] == 1.0
    adam_point = theta.detach().clone()
    assert (adam_point - target).norm() > 0.5
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    for _ in range(3):
        opt.step(closure)
    assert (theta.detach() - target).norm() < 1e-6
    # restore: a fresh optimizer continues in the L-BFGS phase
    theta2 = adam_point.clone().requires_grad_(True)
    opt2 = P.AdamLBFGS([theta2], switch_at=3, adam_lr=0.1)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.phase == "lbfgs" and opt2.steps_taken == 3
    with pytest.raises(ValueError, match="closure"):
        opt2.step(None)


@pytest.mark.parametrize("at", [2, 5])
def test_on_step_switches_precision_between_steps(at):
    """on_step(k) runs before step k; a True return resets the L-BFGS memory and casts Adam's
    moments, so Adam (at=2) and L-BFGS (at=5) continue in float64 and still converge."""
    target = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    net = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        net.weight.zero_()
    calls = []

    def on_step(k):
        calls.append(k)
        return k >= at and P.switch_precision(net, None, F64)

    opt = P.AdamLBFGS(net.parameters(), switch_at=3, adam_lr=0.1, max_iter=20, on_step=on_step)

    def closure():
        opt.zero_grad()
        w = net.weight[0]
        loss = (w - target.to(w.dtype)).pow(4).sum() + (w - target.to(w.dtype)).pow(2).sum()
        loss.backward()
        return loss

    for k in range(8):
        opt.step(closure)
        assert net.weight.dtype == (F64 if k >= at else torch.float32)
    assert calls == list(range(8))
    assert all(v.dtype == F64 for st in opt.adam.state.values() for key, v in st.items()
               if key != "step")
    assert (net.weight.detach()[0] - target).norm() < 1e-9   # beyond float32's reach


def test_lbfgs_step_ending_on_nan_is_undone():
    """A line search that runs into NaN (here: a log barrier crossed by the first trial step)
    leaves the parameters where the step started, finite, with a finite loss returned."""
    theta = torch.zeros(2, dtype=F64, requires_grad=True)
    opt = P.AdamLBFGS([theta], switch_at=0, max_iter=20)

    def closure():
        opt.zero_grad()
        loss = (theta - 1).pow(2).sum() - 1e-3 * torch.log(0.3 - theta[0])
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert opt.nonfinite_steps == 1
    assert torch.equal(theta.detach(), torch.zeros(2, dtype=F64))
    assert math.isfinite(float(loss)) and torch.isfinite(theta.grad).all()
    assert float(loss) == pytest.approx(2 - 1e-3 * math.log(0.3))


def test_budget_measurement_explains_reverse_mode_under_hooks():
    net = three_out()
    x = torch.rand(200, 2, dtype=F64)

    def contrib(xc):
        return P.laplacian(net, xc, 0, mode="rev").pow(2).sum()

    with pytest.raises(RuntimeError, match="mode='fwd'"):
        P.bytes_per_point(contrib, x)
    # without hooks (a fixed chunk size) reverse mode is fine
    total = P.chunked_sum(contrib, x, 64, params=list(net.parameters()))
    total.backward()
    assert all(p.grad is not None for p in list(net.parameters())[:-1])


def test_lbfgs_rescaling_keeps_tiny_float32_losses_moving():
    """torch's L-BFGS drops curvature pairs with y's < 1e-10: a loss of 1e-6 scale crawls; the
    rescaled one converges, and the gradient left for the trainer is the true one."""
    a = torch.tensor([1.0, 3.0, 10.0, 30.0, 100.0])

    def run(make):
        th = torch.zeros(5, requires_grad=True)
        opt = make([th])

        def closure():
            opt.zero_grad()
            loss = 1e-6 * ((a * (th - 1)) ** 2).sum() + 1e-6 * ((th - 1) ** 4).sum()
            loss.backward()
            return loss

        opt.step(closure)
        first_grad = th.grad.abs().max().item()   # what the trainer would log
        for _ in range(9):
            opt.step(closure)
        return (th.detach() - 1).abs().max().item(), first_grad

    plain, _ = run(lambda p: torch.optim.LBFGS(p, max_iter=20, line_search_fn="strong_wolfe"))
    ours, grad = run(lambda p: P.AdamLBFGS(p, switch_at=0, max_iter=20))
    assert plain > 1e-3 and ours < 1e-5
    assert grad < 1e-2          # the true gradient (~1e-6 scale), not the rescaled one (~1)


# ----------------------------------------------------------------------------------------
# AdamLBFGSTraining: the hooks PINN problem classes share


def _mixin_ctx(**cfg):
    from types import SimpleNamespace

    base = dict(optimizer="adam+lbfgs", adam_iterations=4, lr=1e-3, lbfgs_iters=2,
                lbfgs_history=5, switch_at=-1, switch_dtype="float64")
    base.update(cfg)
    model = torch.nn.Linear(2, 1)
    coll = P.Collocation(lambda n, s: torch.rand(n, 2, generator=torch.Generator()
                                                 .manual_seed(s)), 8, resample_every=1)
    data = {"weights": P.make_weights("fixed", {"pde": 1.0}), "collocation": coll,
            "test": torch.zeros(3)}
    return SimpleNamespace(cfg=SimpleNamespace(**base), model=model, data=data)


@pytest.mark.parametrize("name,start,used,cls,second", [
    ("adam+lbfgs", 4, [0, 1, 2, 3, 3, 3], P.AdamLBFGS, None),
    ("adam", 2**62, [0, 1, 2, 3, 4, 5], P.AdamLBFGS, None),
    ("lbfgs", 0, [0, 0, 0, 0, 0, 0], P.AdamLBFGS, None),
    ("ssbroyden", 2, [0, 1, 2, 3, 4, 5], P.AdamWarmup, P.SelfScaledBroyden),
    ("bfgs", 2, [0, 1, 2, 3, 4, 5], P.AdamWarmup, P.SelfScaledBroyden),
    ("gauss_newton", 2, [0, 1, 2, 3, 4, 5], P.AdamWarmup, P.GaussNewton),
])
def test_training_mixin_phases_and_point_sets(name, start, used, cls, second):
    """The phases, which point set each iteration uses (L-BFGS keeps the last Adam set; the
    second-order methods may take new ones), and the optimizer built for each name."""
    mix = P.AdamLBFGSTraining()
    ctx = _mixin_ctx(optimizer=name, warmup=2)
    assert mix.lbfgs_start(ctx) == start
    assert [mix.adam_phase(ctx, k) for k in range(6)] == [k < start for k in range(6)]
    assert [mix.collocation_iteration(ctx, k) for k in range(6)] == used
    opt = mix.optimizer(ctx, list(ctx.model.parameters()))
    assert type(opt) is cls
    if second is not None:
        assert type(opt.second) is second and opt.warmup == 2 and opt.needs_closure
    with pytest.raises(ValueError, match="optimizer must be one of 'adam\\+lbfgs'"):
        mix.optimizer(_mixin_ctx(optimizer="sgd"), list(ctx.model.parameters()))


def test_training_mixin_switches_precision_and_restores_it():
    mix = P.AdamLBFGSTraining()
    ctx = _mixin_ctx(switch_at=3)
    assert not mix.on_step(ctx, 2) and ctx.model.weight.dtype == torch.float32
    assert mix.on_step(ctx, 3)  # switched now: the L-BFGS memory must be reset
    assert ctx.model.weight.dtype == torch.float64 and ctx.data["test"].dtype == torch.float64
    assert not mix.on_step(ctx, 4)  # already there
    ctx.data["weights"]["pde"] = 3.0
    state = mix.state_dict(ctx)
    assert state["dtype"] == "float64" and state["weights"] == {"pde": 3.0}
    fresh = _mixin_ctx(switch_at=3)
    mix.load_state_dict(fresh, state)
    assert fresh.model.weight.dtype == torch.float64 and fresh.data["weights"]["pde"] == 3.0
    assert fresh.data["collocation"].state_dict().keys() == state["collocation"].keys()
