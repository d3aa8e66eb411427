"""deepsolve.pinn.networks: FNN and the one-pass (Taylor-mode) derivatives of backend="taylor".

Every derivative is compared with nested autograd in float64 (1e-12) and against closed forms
on a network whose function is known; parameter gradients of a residual loss built from
Taylor derivatives equal those of the same loss built with autograd derivatives.
"""

from __future__ import annotations

import math

import pytest
import torch

import deepsolve.pinn as P
from deepsolve.pinn import FNN

F64 = torch.float64


def close(a, b, tol=1e-12):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


@pytest.mark.parametrize("activation", sorted(P.ACTIVATIONS))
@pytest.mark.parametrize("scalar", [False, True])
def test_taylor_jet_equals_nested_autograd(activation, scalar):
    torch.manual_seed(0)
    net = FNN(3, 1 if scalar else 2, 9, 3, activation, lo=(-1, 0, 2), hi=(1, 1, 3),
              scalar=scalar).to(F64)
    x = torch.rand(13, 3, dtype=F64)
    options = [{}, {"hessian_dims": (0,)}, {"hessian_dims": (2, 0)},
               {"hessian_pairs": ((0, 0), (2, 1), (1, 1))}]
    if not scalar:
        options.append({"hessian_components": (1,), "hessian_pairs": ((1, 2),)})
    for kw in options:
        a = P.jet(net, x, 2, backend="autograd", **kw)
        t = P.jet(net, x, 2, backend="taylor", **kw)
        close(t.value, a.value)
        close(t.jacobian, a.jacobian)
        close(t.hessian, a.hessian)
        c = None if scalar else (kw.get("hessian_components") or (0,))[0]
        for i, j in kw.get("hessian_pairs", ((0, 0), (0, 1))):
            if kw.get("hessian_dims") and i not in kw["hessian_dims"]:
                continue
            close(t.d(c, i, j), a.d(c, i, j))
            close(t.d(c, j, i), a.d(c, i, j))
    t1 = P.jet(net, x, 1, backend="taylor")
    assert t1.hessian is None
    close(t1.jacobian, P.jet(net, x, 1, backend="autograd").jacobian)


def test_taylor_operators_equal_autograd_and_func():
    torch.manual_seed(1)
    net = FNN(3, 2, 8, 2, lo=(0, 0, 0), hi=(2, 1, 1)).to(F64)
    x = torch.rand(10, 3, dtype=F64)
    ops = [
        lambda b: P.laplacian(net, x, 1, dims=(0, 2), backend=b),
        lambda b: P.laplacian(net, x, backend=b),
        lambda b: P.partial(net, x, (1, 2), 1, backend=b),
        lambda b: P.partial(net, x, 2, 0, backend=b),
        lambda b: P.partial(net, x, (), 1, backend=b),
        lambda b: P.hessian(net, x, 1, backend=b),
        lambda b: P.hessian(net, x, backend=b),
        lambda b: P.gradient(net, x, 0, backend=b),
        lambda b: P.jacobian(net, x, backend=b),
        lambda b: P.divergence(net, x, components=(0, 1), dims=(0, 2), backend=b),
    ]
    for op in ops:
        close(op("taylor"), op("autograd"))
        close(op("taylor"), op("func"))


def test_pairs_work_on_every_backend():
    torch.manual_seed(2)
    net = FNN(2, 3, 8, 2).to(F64)
    x = torch.rand(7, 2, dtype=F64)
    pairs = ((0, 0), (1, 1))
    ref = P.jet(net, x, 2, backend="autograd")
    for backend in ("func", "autograd", "taylor"):
        j = P.jet(net, x, 2, backend=backend, hessian_pairs=pairs, hessian_components=(0, 1))
        assert j.hessian.shape == (7, 2, 2)
        close(j.laplacian(0), ref.hessian[:, 0, 0, 0] + ref.hessian[:, 0, 1, 1])
        close(j.laplacian(1), ref.hessian[:, 1, 0, 0] + ref.hessian[:, 1, 1, 1])
        with pytest.raises(ValueError, match="no second derivative along 0, 1"):
            j.d(0, 0, 1)


def test_closed_form_one_hidden_unit():
    """u(x, y) = c·tanh(a x + b y + e): the derivatives are known exactly."""
    net = FNN(2, 1, 1, 1, scalar=True).to(F64)
    a, b, e, c = 0.7, -1.3, 0.2, 1.9
    with torch.no_grad():
        net.layers[0].weight.copy_(torch.tensor([[a, b]], dtype=F64))
        net.layers[0].bias.fill_(e)
        net.layers[1].weight.fill_(c)
        net.layers[1].bias.zero_()
    x = torch.rand(9, 2, dtype=F64)
    t = torch.tanh(a * x[:, 0] + b * x[:, 1] + e)
    s1, s2 = 1 - t**2, -2 * t * (1 - t**2)
    j = P.jet(net, x, 2, backend="taylor")
    close(j.value, c * t)
    close(j.jacobian, torch.stack((c * a * s1, c * b * s1), 1))
    hess = c * s2[:, None, None] * torch.tensor([[a * a, a * b], [a * b, b * b]], dtype=F64)
    close(j.hessian, hess)


def test_parameter_gradients_of_a_residual_equal_autograd():
    """Composition: the Kovasznay-like residual built from Taylor derivatives has the same
    parameter gradient as the one built from nested autograd."""
    torch.manual_seed(3)
    net = FNN(2, 3, 12, 3, lo=(-0.5, -0.5), hi=(1, 1.5)).to(F64)
    x = torch.rand(31, 2, dtype=F64)

    def loss(backend):
        j = P.jet(net, x, 2, backend=backend, hessian_components=(0, 1),
                  hessian_pairs=((0, 0), (1, 1)))
        u, v = j.value[:, 0], j.value[:, 1]
        mx = u * j.d(0, 0) + v * j.d(0, 1) + j.d(2, 0) - 0.05 * j.laplacian(0)
        my = u * j.d(1, 0) + v * j.d(1, 1) + j.d(2, 1) - 0.05 * j.laplacian(1)
        return mx.pow(2).mean() + my.pow(2).mean() + (j.d(0, 0) + j.d(1, 1)).pow(2).mean()

    params = list(net.parameters())
    ga = torch.autograd.grad(loss("autograd"), params)
    gt = torch.autograd.grad(loss("taylor"), params)
    for a, t in zip(ga, gt, strict=True):
        close(t, a)


def test_forward_on_points_and_batches_and_input_scaling():
    torch.manual_seed(4)
    net = FNN(2, 2, 5, 2, lo=(1, 2), hi=(3, 6)).to(F64)
    x = torch.rand(4, 2, dtype=F64)
    close(net(x)[2], net(x[2]))
    assert torch.allclose(net.scale, torch.tensor([1.0, 0.5], dtype=F64))
    assert torch.allclose(net.shift, torch.tensor([-2.0, -2.0], dtype=F64))
    std = net.layers[1].weight.std().item()
    assert 0.2 < std / math.sqrt(2 / 10) < 5  # Glorot normal
    assert (net.layers[0].bias == 0).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        FNN(2, 1, 4, 2, "relu6")
    with pytest.raises(ValueError, match="scalar=True needs out_dim=1"):
        FNN(2, 2, 4, 2, scalar=True)
    with pytest.raises(ValueError, match="give both lo and hi"):
        FNN(2, 1, 4, 2, lo=(0, 0))
    with pytest.raises(ValueError, match="lo < hi"):
        FNN(2, 1, 4, 2, lo=(0, 1), hi=(1, 0))
    net = FNN(2, 1, 4, 2)
    with pytest.raises(ValueError, match=r"points must have shape \(N, 2\)"):
        net.taylor(torch.zeros(3, 3))
    seq = torch.nn.Sequential(torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match="backend='taylor' needs a deepsolve.pinn.FNN"):
        P.jet(seq, torch.zeros(3, 2), backend="taylor")
    with pytest.raises(ValueError, match="up to order 2"):
        P.partial(net, torch.zeros(3, 2), (0, 0, 1), backend="taylor")
    with pytest.raises(ValueError, match="hessian_dims or hessian_pairs"):
        P.jet(net, torch.zeros(3, 2), hessian_dims=(0,), hessian_pairs=((0, 0),))
    with pytest.raises(ValueError, match="out of range"):
        P.jet(net, torch.zeros(3, 2), hessian_pairs=((0, 2),))


def test_switch_precision_keeps_parameters_and_casts_data():
    net = FNN(2, 1, 4, 2)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    data = {"x": torch.zeros(3, 2), "n": torch.arange(3), "name": "a"}
    assert P.switch_precision(net, data, F64)
    assert all(p.dtype == F64 for p in net.parameters()) and net.scale.dtype == F64
    assert [id(p) for p in net.parameters()] == [id(p) for p in params]
    assert data["x"].dtype == F64 and data["n"].dtype == torch.int64 and data["name"] == "a"
    assert not P.switch_precision(net, data, F64)
    net(data["x"]).sum().backward()
    opt.step()  # the optimizer still holds the (now float64) parameters
    with pytest.raises(ValueError, match="floating dtype"):
        P.switch_precision(net, data, torch.int32)
