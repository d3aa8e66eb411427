"""deepsolve.pinn.causal: causal residual weights, the loss, the eps schedule, time slices.

The weights and the loss are checked against hand-computed numbers; the gradient against
autograd of the formula with the weights held fixed (so a weight that let gradient through
would fail); the schedule against its advance rule; bad settings against one-line errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepsolve.pinn import (
    PAPER_EPS,
    CausalWeighting,
    causal_loss,
    causal_weights,
    sample_time_slices,
    slice_mse,
)


def test_weights_and_loss_by_hand():
    # per-slice losses 0.5, 0.2, 0.1, 0.3 with eps = 2:
    # w = exp(-2 * (0, 0.5, 0.7, 0.8)), loss = mean(w * L)
    sq = torch.tensor([[0.4, 0.6], [0.1, 0.3], [0.0, 0.2], [0.3, 0.3]], dtype=torch.float64)
    loss, w = causal_loss(sq, 2.0)
    want_w = [1.0, math.exp(-1.0), math.exp(-1.4), math.exp(-1.6)]
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float64), rtol=1e-14,
                               atol=0)
    want = (0.5 * want_w[0] + 0.2 * want_w[1] + 0.1 * want_w[2] + 0.3 * want_w[3]) / 4
    assert float(loss) == pytest.approx(want, rel=1e-14)
    # per-slice means give the same; eps = 0 is the plain mean over slices
    loss_m, w_m = causal_loss(sq.mean(1), 2.0)
    assert float(loss_m) == pytest.approx(want, rel=1e-14) and torch.equal(w_m, w)
    loss0, w0 = causal_loss(sq, 0.0)
    assert torch.equal(w0, torch.ones(4, dtype=torch.float64))
    assert float(loss0) == pytest.approx(float(sq.mean()), rel=1e-14)
    assert torch.equal(causal_weights(sq.mean(1), 2.0), w)


def test_weights_are_detached_and_the_gradient_holds_them_fixed():
    torch.manual_seed(0)
    theta = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.linspace(0, 1, 40, dtype=torch.float64).reshape(5, 8)   # 5 slices × 8 points
    r = 0.1 * (theta[0] * torch.sin(3 * x) + theta[1] * x**2 - theta[2])  # L_i ~ 0.1
    loss, w = causal_loss(r.pow(2), 5.0)
    assert not w.requires_grad
    (g,) = torch.autograd.grad(loss, theta, retain_graph=True)
    # manual: sum_i w_i dL_i/dθ / M with w computed from the same L but as constants
    L = r.pow(2).mean(1)
    w_fixed = torch.exp(-5.0 * torch.cat([L.new_zeros(1), torch.cumsum(L, 0)[:-1]])).detach()
    (g_want,) = torch.autograd.grad((w_fixed * L).mean(), theta, retain_graph=True)
    torch.testing.assert_close(g, g_want, rtol=1e-13, atol=1e-15)
    # differentiating through the weights would give something else
    w_live = torch.exp(-5.0 * torch.cat([L.new_zeros(1), torch.cumsum(L, 0)[:-1]]))
    (g_live,) = torch.autograd.grad((w_live * L).mean(), theta)
    assert (g - g_live).abs().max() > 0.1 * g.abs().max()


def test_weights_are_monotone_non_increasing():
    torch.manual_seed(1)
    sq = torch.rand(64, 16, dtype=torch.float64) ** 3
    for eps in (0.0, 1e-2, 1.0, 100.0):
        _, w = causal_loss(sq, eps)
        assert w[0] == 1.0 and (w[1:] <= w[:-1]).all() and (w > 0).all() | (eps > 1)


def test_schedule_advances_when_the_minimum_weight_exceeds_the_threshold():
    cw = CausalWeighting(eps=[0.1, 1.0, 10.0], threshold=0.99)
    assert cw.eps == 0.1 and math.isnan(cw.min_weight) and not cw.done
    small = torch.full((4, 3), 1e-3, dtype=torch.float64)   # sum of 3 slices: 3e-3
    big = torch.full((4, 3), 1.0, dtype=torch.float64)
    cw(big, 0)
    assert cw.min_weight == pytest.approx(math.exp(-0.3))
    cw(small, 1)                       # the last weights were below 0.99: no advance
    assert cw.eps == 0.1 and cw.min_weight == pytest.approx(math.exp(-3e-4))
    cw(small, 1)                       # same iteration (an L-BFGS line search): no advance
    assert cw.eps == 0.1
    cw(small, 2)                       # new iteration, min weight 0.9997 > 0.99: advance
    assert cw.eps == 1.0 and cw.history == [(2, 1.0)]
    assert cw.min_weight == pytest.approx(math.exp(-3e-3))
    cw(small, 3)                       # exp(-3e-3) = 0.997 > 0.99: advance again
    assert cw.eps == 10.0
    assert cw.min_weight == pytest.approx(math.exp(-3e-2))   # 0.970: stays
    cw(small, 4)
    assert cw.eps == 10.0 and not cw.done
    cw(torch.full((4, 3), 1e-5, dtype=torch.float64), 5)
    assert cw.done and cw.eps == 10.0                       # the last value stays
    # the loss is the one of causal_loss with the current eps
    loss = cw(big, 6)
    assert float(loss) == pytest.approx(float(causal_loss(big, 10.0)[0]), rel=1e-14)


def test_frozen_weights_stay_fixed_within_an_iteration_and_state_round_trips():
    cw = CausalWeighting(eps=[1.0, 2.0], freeze=True)
    a = torch.tensor([[0.2], [0.3], [0.4]], dtype=torch.float64)
    cw(a, 0)
    w0 = cw.weights.clone()
    loss = cw(4 * a, 0)                # same iteration: the first call's weights
    assert torch.equal(cw.weights, w0)
    assert float(loss) == pytest.approx(float((w0 * 4 * a[:, 0]).mean()), rel=1e-14)
    cw(4 * a, 1)                       # next iteration: recomputed
    assert not torch.equal(cw.weights, w0)
    unfrozen = CausalWeighting(eps=1.0)
    unfrozen(a, 0)
    unfrozen(4 * a, 0)
    assert not torch.equal(unfrozen.weights, w0)
    state = cw.state_dict()
    other = CausalWeighting(eps=[1.0, 2.0], freeze=True)
    other.load_state_dict(state)
    assert other.eps == cw.eps and torch.equal(other.weights, cw.weights)
    assert other.min_weight == cw.min_weight


@pytest.mark.parametrize("call,msg", [
    (lambda: causal_loss(torch.ones(3, 2), -1.0), "eps must be finite and >= 0"),
    (lambda: causal_loss(torch.ones(3, 2), float("nan")), "eps must be finite and >= 0"),
    (lambda: causal_loss(torch.ones(3, 2, 1), 1.0), r"\(M, N\) or per-slice means"),
    (lambda: causal_loss(torch.ones(0), 1.0), r"\(M, N\) or per-slice means"),
    (lambda: causal_loss(torch.ones(3, 0), 1.0), r"\(M, N\) or per-slice means"),
    (lambda: causal_weights(torch.ones(()), 1.0), r"\(M, N\) or per-slice means"),
    (lambda: CausalWeighting(eps=[]), "schedule is empty"),
    (lambda: CausalWeighting(eps=[1.0, 0.1]), "non-decreasing"),
    (lambda: CausalWeighting(eps=[0.1, -1.0]), "finite and >= 0"),
    (lambda: CausalWeighting(threshold=1.5), r"threshold must be in \(0, 1\]"),
    (lambda: sample_time_slices(0, 4, (-1.0,), (1.0,), 0.0, 1.0), "at least one slice"),
    (lambda: sample_time_slices(2, 4, (1.0,), (-1.0,), 0.0, 1.0), "lo < hi"),
    (lambda: sample_time_slices(2, 4, (-1.0,), (1.0,), 1.0, 1.0), "t0 < t1"),
])
def test_bad_settings_give_one_line_errors(call, msg):
    with pytest.raises(ValueError, match=msg) as info:
        call()
    assert "\n" not in str(info.value)


def test_time_slices_layout():
    pts = sample_time_slices(8, 16, (-1.0, 0.0), (1.0, 2.0), 0.5, 1.3, "sobol", seed=3,
                             dtype=torch.float64)
    assert pts.shape == (8, 16, 3) and pts.dtype == torch.float64
    dt = 0.1
    t = pts[..., 2]
    lo = 0.5 + dt * torch.arange(8, dtype=torch.float64)[:, None]
    assert ((t >= lo - 1e-15) & (t < lo + dt + 1e-15)).all()          # slice i in its window
    assert (pts[..., 0].abs() <= 1).all() and (pts[..., 1] >= 0).all() and (pts[..., 1] <= 2).all()
    again = sample_time_slices(8, 16, (-1.0, 0.0), (1.0, 2.0), 0.5, 1.3, "sobol", seed=3,
                               dtype=torch.float64)
    assert torch.equal(pts, again)                                     # deterministic
    assert PAPER_EPS == (1e-2, 1e-1, 1.0, 10.0, 100.0)


def test_slice_mse_in_chunks_equals_the_whole_set():
    """Per-slice mean squares over chunks that cut across slices (recomputed in backward)
    equal the unchunked ones, values and parameter gradients, to rounding."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 2)).double()
    params = list(net.parameters())
    x = sample_time_slices(5, 12, (-1.0,), (1.0,), 0.0, 1.0, "sobol", 3,
                           torch.float64).reshape(-1, 2)

    def residual(xc):  # two components, so the mean runs over them too
        return net(xc) * xc[:, 1:]

    whole = slice_mse(residual, x, 5)
    by_hand = residual(x).pow(2).mean(1).reshape(5, 12).mean(1)
    assert torch.allclose(whole, by_hand, rtol=1e-14, atol=0)
    g_whole = torch.autograd.grad(causal_loss(whole, 2.0)[0], params)
    for chunk in (7, 12, 25):
        part = slice_mse(residual, x, 5, chunk, params=params)
        assert torch.allclose(part, whole, rtol=1e-12, atol=0)
        g = torch.autograd.grad(causal_loss(part, 2.0)[0], params)
        for a, b in zip(g, g_whole, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="do not split into 7 equal slices"):
        slice_mse(residual, x, 7)
