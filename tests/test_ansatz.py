"""deepsolve.pinn.ansatz: the hard-constraint ansatz u = g + b N, the transfinite lift and
the symmetric (even/odd) network.

The ansatz's Taylor-mode derivatives (network by its own one-pass jet, lift by torch.func,
joined by the product rule) are compared with torch.func derivatives of the whole ansatz in
float64, including parameter gradients of a residual loss and points changed in place (the
lift's cache); the transfinite interpolant with functions it must reproduce exactly;
Symmetric's parity at mirrored points and its Taylor-mode derivatives against torch.func.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepsolve.pinn import FNN, Ansatz, Symmetric, jet, transfinite

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

F64 = torch.float64
LO, HI = (-0.5, -0.5), (1.0, 1.5)
PAIRS = ((0, 0), (1, 1), (0, 1))


def close(a, b, tol=1e-12):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def smooth(p):
    """A smooth function of ``(..., 2)`` points, three components."""
    x, y = p[..., 0], p[..., 1]
    return torch.stack([torch.exp(x) * torch.cos(2 * y), x * y * y + 1,
                        torch.sin(x + 2 * y)], -1)


def box_lift(k):
    g = transfinite(lambda p: smooth(p)[..., :k], LO, HI)

    def lift(p):
        x, y = p[..., 0], p[..., 1]
        xi, eta = (x - LO[0]) / (HI[0] - LO[0]), (y - LO[1]) / (HI[1] - LO[1])
        b = torch.stack([16 * xi * (1 - xi) * eta * (1 - eta), 1 - xi, eta * eta][:k], -1)
        return g(p), b

    return lift


def scalar_lift(p):
    g, b = box_lift(1)(p)
    return g[..., 0], b[..., 0]


def points(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = torch.tensor(LO, dtype=F64), torch.tensor(HI, dtype=F64)
    return lo + (hi - lo) * torch.rand(n, 2, generator=gen, dtype=F64)


def model(k, scalar=False):
    torch.manual_seed(1)
    net = FNN(2, k, 12, 3, scalar=scalar).double()
    return Ansatz(net, scalar_lift if scalar else box_lift(k))


@pytest.mark.parametrize("k,scalar", [(3, False), (1, True)], ids=["vector", "scalar"])
def test_taylor_equals_torch_func(k, scalar):
    m = model(k, scalar)
    x = points(40)
    jt = jet(m, x, 2, backend="taylor", hessian_pairs=PAIRS)
    jf = jet(m, x, 2, backend="func", hessian_pairs=PAIRS)
    close(jt.value, jf.value)
    close(jt.jacobian, jf.jacobian)
    close(jt.hessian, jf.hessian)
    j1 = jet(m, x, 1, backend="taylor")
    close(j1.jacobian, jf.jacobian)
    # the lift contributes: the same jet without the lift differs
    bare = jet(m.net, x, 2, backend="taylor", hessian_pairs=PAIRS)
    assert (bare.hessian - jt.hessian).abs().max() > 1e-3


def test_parameter_gradients_equal_torch_func():
    m = model(3)
    x = points(30)

    def loss(backend):
        j = jet(m, x, 2, backend=backend, hessian_pairs=((0, 0), (1, 1)))
        r = j.value[:, 0] * j.jacobian[:, 0, 0] + j.hessian[:, 1, 0] + j.hessian[:, 2, 1]
        return r.pow(2).mean()

    gt = torch.autograd.grad(loss("taylor"), list(m.parameters()))
    gf = torch.autograd.grad(loss("func"), list(m.parameters()))
    for a, b in zip(gt, gf, strict=True):
        close(a, b)


def test_points_changed_in_place_are_not_served_from_the_cache():
    m = model(3)
    x = points(20)
    first = jet(m, x, 2, backend="taylor", hessian_pairs=PAIRS)
    close(jet(m, x, 2, backend="taylor", hessian_pairs=PAIRS).hessian, first.hessian)
    x.add_(0.05)  # same tensor object, new values
    again = jet(m, x, 2, backend="taylor", hessian_pairs=PAIRS)
    ref = jet(m, x, 2, backend="func", hessian_pairs=PAIRS)
    close(again.value, ref.value)
    close(again.hessian, ref.hessian)
    # other pairs at the same points are not served from the cache either
    other = jet(m, x, 2, backend="taylor", hessian_pairs=((0, 1),))
    close(other.hessian, ref.hessian[..., 2:])


def test_precomputed_lift_jet_and_a_mismatched_one():
    """taylor(lift=lift_jet(x, ...)) (the form for torch.compile) equals taylor(x); a lift
    jet for other points, order or pairs is refused."""
    m = model(3)
    x = points(25)
    pairs = ((0, 0), (1, 1))
    lift = m.lift_jet(x, 2, pairs)
    for a, b in zip(m.taylor(x, 2, pairs, lift=lift), m.taylor(x, 2, pairs), strict=True):
        close(a, b)
    for bad in (m.lift_jet(points(24), 2, pairs), m.lift_jet(x, 2, ((0, 0),)),
                m.lift_jet(x, 1)):
        with pytest.raises(ValueError, match="lift= does not match"):
            m.taylor(x, 2, pairs, lift=bad)


def test_forward_on_one_point_and_batches():
    m = model(3)
    x = points(5)
    close(torch.stack([m(p) for p in x]), m(x))
    assert dict(m.state_dict()).keys() == {f"net.{k}" for k in m.net.state_dict()}


def edge_points(n=9):
    t = torch.linspace(0, 1, n, dtype=F64)
    xs = LO[0] + (HI[0] - LO[0]) * t
    ys = LO[1] + (HI[1] - LO[1]) * t
    return torch.cat([torch.stack([torch.full_like(ys, LO[0]), ys], -1),
                      torch.stack([torch.full_like(ys, HI[0]), ys], -1),
                      torch.stack([xs, torch.full_like(xs, LO[1])], -1),
                      torch.stack([xs, torch.full_like(xs, HI[1])], -1)])


def test_transfinite_equals_f_on_the_edges_and_reproduces_its_range():
    g = transfinite(smooth, LO, HI)
    e = edge_points()
    close(g(e), smooth(e), 1e-14)
    # the Boolean sum of the two linear blends reproduces any f(x, y) linear in x (any
    # y-dependence) plus one linear in y (any x-dependence) ...
    def blended(p):
        x, y = p[..., 0], p[..., 1]
        return ((1 + 2 * x) * torch.sin(3 * y) + (2 - y) * torch.cos(x)
                + x * y).unsqueeze(-1)

    x = points(50)
    close(transfinite(blended, LO, HI)(x), blended(x), 1e-13)
    # ... and not a function curved in both directions, which it only matches on the edges
    def bump(p):
        return (torch.sin(math.pi * p[..., 0]) * torch.sin(math.pi * p[..., 1])).unsqueeze(-1)

    assert (transfinite(bump, LO, HI)(x) - bump(x)).abs().max() > 0.1
    close(transfinite(bump, LO, HI)(e), bump(e), 1e-14)


def test_ansatz_holds_the_boundary_values_for_any_network():
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = Ansatz(FNN(2, 3, 8, 2).double(), box_lift(3))
        e = edge_points()
        close(m(e)[:, 0], smooth(e)[:, 0], 1e-14)  # b = 0 on all four edges
        right = e[:, 0] == HI[0]
        close(m(e[right])[:, 1], smooth(e[right])[:, 1], 1e-14)  # b = 1 - xi: x = x1 only


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="lift must be a function"):
        Ansatz(FNN(2, 1, 4, 1), 3.0)
    plain = Ansatz(torch.nn.Linear(2, 3).double(), box_lift(3))
    with pytest.raises(ValueError, match="taylor"):
        jet(plain, points(4), 2, backend="taylor")
    with pytest.raises(ValueError, match="lo < hi"):
        transfinite(smooth, (0.0, 1.0), (1.0, 0.5))


@pytest.mark.parametrize("parity,axis,center", [(-1, 0, 0.0), (1, 1, 0.3), (-1, 1, 0.5)])
def test_symmetric_has_its_parity_and_taylor_equals_torch_func(parity, axis, center):
    torch.manual_seed(2)
    m = Symmetric(FNN(2, 3, 10, 2).double(), axis=axis, parity=parity, center=center)
    x = points(30)
    mirrored = x.clone()
    mirrored[:, axis] = 2 * center - x[:, axis]
    close(m(mirrored), parity * m(x), 1e-14)
    assert (m(x) - m.net(x)).abs().max() > 1e-2  # not the bare network
    jt = jet(m, x, 2, backend="taylor", hessian_pairs=PAIRS)
    jf = jet(m, x, 2, backend="func", hessian_pairs=PAIRS)
    ja = jet(m, x, 2, backend="autograd", hessian_pairs=PAIRS)
    for j in (jt, ja):
        close(j.value, jf.value)
        close(j.jacobian, jf.jacobian)
        close(j.hessian, jf.hessian)
    close(jet(m, x, 1, backend="taylor").jacobian, jf.jacobian)
    close(torch.stack([m(p) for p in x[:4]]), m(x[:4]))


def test_symmetric_parameter_gradients_and_bad_input():
    torch.manual_seed(3)
    m = Symmetric(FNN(2, 1, 8, 2, scalar=True).double())
    x = points(25)

    def loss(backend):
        j = jet(m, x, 2, backend=backend, hessian_pairs=((0, 0),))
        return (j.jacobian[:, 1] + j.value * j.jacobian[:, 0] - 0.1 * j.d(None, 0, 0)
                ).pow(2).mean()

    gt = torch.autograd.grad(loss("taylor"), list(m.parameters()))
    gf = torch.autograd.grad(loss("func"), list(m.parameters()))
    for a, b in zip(gt, gf, strict=True):
        close(a, b)
    with pytest.raises(ValueError, match="parity must be 1"):
        Symmetric(FNN(2, 1, 4, 1), parity=0)
    with pytest.raises(ValueError, match="coordinate 2"):
        Symmetric(FNN(2, 1, 4, 1).double(), axis=2)(x)
    with pytest.raises(ValueError, match="taylor"):
        Symmetric(torch.nn.Linear(2, 1).double()).taylor(x)
