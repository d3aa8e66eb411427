"""The reverse sweep, steerable: adjoint norms, adjoint hooks and truncated backpropagation,
each against plain autograd in float64."""

from __future__ import annotations

import pytest
import torch

import deepsolve
from deepsolve import schedules as S
from deepsolve.memory.meter import MemoryMeter

F64 = torch.float64  # every tensor here is float64 (the default dtype is left alone)


def _problem(seed: int = 0, m: int = 5):
    torch.manual_seed(seed)
    W = (0.6 * torch.randn(m, m, dtype=F64)).requires_grad_()
    b = (0.1 * torch.randn(m, dtype=F64)).requires_grad_()
    x0 = {"u": torch.randn(m, dtype=F64, requires_grad=True),
          "v": torch.randn(m, dtype=F64, requires_grad=True)}

    def step(x, i):
        u = torch.tanh(W @ x["u"] + x["v"]) + b
        v = 0.9 * x["v"] + 0.05 * torch.sin(x["u"] * (1 + 0.01 * i))
        return {"u": u, "v": v}, (u * v).sum()

    return step, x0, [W, b]


def _loss(final, outs):
    return (final["u"] ** 2).sum() + final["v"].sum() + (outs ** 2).sum()


def _plain(step, x0, n, *, hook=None, cut=None):
    """The plain loop: every state kept with retain_grad, a hook on every leaf of every state,
    the state detached at multiples of ``cut``."""
    x, states, outs = x0, [], []
    for i in range(n + 1):
        if cut and i and i % cut == 0 and i < n:  # boundaries inside the chain
            x = {k: v.detach().requires_grad_() for k, v in x.items()}
        for v in x.values():
            if v.requires_grad:
                if not v.is_leaf:
                    v.retain_grad()
                if hook is not None:
                    v.register_hook(hook)
        states.append(x)
        if i < n:
            x, o = step(x, i)
            outs.append(o)
    return x, torch.stack(outs), states


def _norms(states):
    return torch.tensor([sum(float((v.grad ** 2).sum()) for v in s.values()
                             if v.grad is not None) ** 0.5 for s in states], dtype=F64)


SCHEDULES = {
    "revolve": lambda n: dict(snapshots=3),
    "store_all": lambda n: dict(schedule="store_all"),
    "two_level": lambda n: dict(schedule=S.two_level(n, 2, 3, write_cost=1, read_cost=1)),
    "periodic": lambda n: dict(schedule=deepsolve.Periodic(4)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_adjoint_norms_are_the_norms_of_every_states_gradient(name):
    n = 17
    step, x0, params = _problem()
    st = deepsolve.UnrollStats(adjoint_norms=True)
    final, outs = deepsolve.unroll(step, x0, n, stats=st, **SCHEDULES[name](n))
    g = torch.autograd.grad(_loss(final, outs), [*x0.values(), *params])
    final_p, outs_p, states = _plain(step, x0, n)
    _loss(final_p, outs_p).backward()
    ref = _norms(states)
    assert st.adjoint_norms.dtype == torch.float64 and st.adjoint_norms.device.type == "cpu"
    assert st.adjoint_norms.shape == (n + 1,)
    assert torch.allclose(st.adjoint_norms, ref, rtol=1e-10, atol=1e-12)
    for a, t in zip(g, [*x0.values(), *params], strict=True):
        assert torch.allclose(a, t.grad, rtol=1e-10, atol=1e-12)


def test_adjoint_norms_online():
    step, x0, params = _problem(1)
    n = 23
    st = deepsolve.UnrollStats(adjoint_norms=True)
    final, outs = deepsolve.unroll(step, x0, until=lambda x, i: i >= n, snapshots=3, stats=st)
    _loss(final, outs).backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    for v in x0.values():
        v.grad = None
    final_p, outs_p, states = _plain(step, x0, n)
    _loss(final_p, outs_p).backward()
    assert torch.allclose(st.adjoint_norms, _norms(states), rtol=1e-10, atol=1e-12)
    for a, p in zip(grads, params, strict=True):
        assert torch.allclose(a, p.grad, rtol=1e-10, atol=1e-12)


def test_the_default_path_computes_no_norms():
    step, x0, _ = _problem()
    st = deepsolve.UnrollStats()
    final, outs = deepsolve.unroll(step, x0, 9, snapshots=2, stats=st)
    _loss(final, outs).backward()
    assert st.adjoint_norms is False


@pytest.mark.parametrize("name", ["revolve", "store_all", "two_level"])
def test_an_adjoint_hook_equals_register_hook_on_every_state(name):
    n, c = 15, 0.3
    step, x0, params = _problem(2)

    def clip(i, adj):
        return {k: v.clamp(-c, c) for k, v in adj.items()}

    seen = []

    def hook(i, adj):
        seen.append(i)
        return clip(i, adj)

    final, outs = deepsolve.unroll(step, x0, n, adjoint_hook=hook, **SCHEDULES[name](n))
    g = torch.autograd.grad(_loss(final, outs), [*x0.values(), *params])
    final_p, outs_p, _ = _plain(step, x0, n, hook=lambda gr: gr.clamp(-c, c))
    ref = torch.autograd.grad(_loss(final_p, outs_p), [*x0.values(), *params])
    assert seen == list(range(n, -1, -1))
    for a, b in zip(g, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    plain = torch.autograd.grad(_loss(*deepsolve.unroll(step, x0, n)), params)
    assert not torch.allclose(plain[0], g[2])  # the hook did change something


def test_an_adjoint_hook_of_the_wrong_shape_is_a_one_line_error():
    step, x0, _ = _problem()
    final, outs = deepsolve.unroll(step, x0, 5, snapshots=2,
                                   adjoint_hook=lambda i, a: {"u": a["u"][:2], "v": a["v"]})
    with pytest.raises(ValueError, match="adjoint_hook returned") as err:
        _loss(final, outs).backward()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("n, K", [(20, 5), (23, 5), (7, 10), (12, 1)])
@pytest.mark.parametrize("how", ["revolve", "store_all", "budget", "periodic"])
def test_truncate_equals_the_detaching_plain_loop(n, K, how):
    step, x0, params = _problem(3)
    kw = {"revolve": dict(snapshots=2), "store_all": dict(schedule="store_all"),
          "budget": dict(budget="256KiB"), "periodic": dict(schedule=deepsolve.Periodic(2))}[how]
    st = deepsolve.UnrollStats(adjoint_norms=True)
    final, outs = deepsolve.unroll(step, x0, n, truncate=K, stats=st, **kw)
    g = torch.autograd.grad(_loss(final, outs), [*x0.values(), *params])
    final_p, outs_p, states = _plain(step, x0, n, cut=K)
    _loss(final_p, outs_p).backward()
    for a, t in zip(g, [*x0.values(), *params], strict=True):
        assert torch.allclose(a, t.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(st.adjoint_norms, _norms(states), rtol=1e-10, atol=1e-12)
    if K < n:
        untruncated = torch.autograd.grad(_loss(*deepsolve.unroll(step, x0, n)), params)
        assert not torch.allclose(untruncated[0], g[2])


def test_truncate_replays_random_numbers():
    torch.manual_seed(5)
    w = torch.randn(4, dtype=F64, requires_grad=True)

    def step(x, i):
        return torch.tanh(x * w + 0.1 * torch.randn(4, dtype=F64)), x.sum()

    x0 = torch.randn(4, dtype=F64)
    torch.manual_seed(9)
    y, o = deepsolve.unroll(step, x0, 19, snapshots=2, truncate=6)
    (g,) = torch.autograd.grad(y.sum() + o.square().sum(), w)
    torch.manual_seed(9)
    z, outs = x0, []
    for i in range(19):
        if i and i % 6 == 0:
            z = z.detach()
        z, oi = step(z, i)
        outs.append(oi)
    (ref,) = torch.autograd.grad(z.sum() + torch.stack(outs).square().sum(), w)
    assert torch.allclose(g, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kw, message", [
    (dict(truncate=0), "truncate must be an integer >= 1"),
    (dict(truncate=3, until=lambda x, i: i > 4), "truncate= needs a known n_steps"),
    (dict(truncate=3, schedule=S.revolve(10, 2)), "one schedule per window"),
])
def test_bad_truncations_are_one_line_errors(kw, message):
    step, x0, _ = _problem()
    n = None if "until" in kw else 10
    with pytest.raises(ValueError, match=message) as err:
        deepsolve.unroll(step, x0, n, **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("n, K", [(20, 5), (23, 5), (7, 10)])
def test_the_executor_takes_truncation_as_its_own_argument(n, K):
    """``execute(..., None, truncate=Truncation(n, K, window))`` is the truncated unroll
    (windows reversed by ``window(length)``'s schedules); a schedule beside it, or a bad
    ``K``, is refused."""
    from deepsolve.engine import Truncation, execute

    step, x0, params = _problem(3)
    final, outs = execute(step, x0, None, truncate=Truncation(n, K, lambda m: S.revolve(m, 2)))
    g = torch.autograd.grad(_loss(final, outs), [*x0.values(), *params])
    final_p, outs_p, _ = _plain(step, x0, n, cut=K)
    _loss(final_p, outs_p).backward()
    for a, t in zip(g, [*x0.values(), *params], strict=True):
        assert torch.allclose(a, t.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="give schedule=None"):
        execute(step, x0, S.revolve(n, 2), truncate=Truncation(n, K, S.store_all))
    with pytest.raises(ValueError, match="truncate must be an integer >= 1"):
        Truncation(n, 0, S.store_all)


def test_truncate_under_a_budget_holds_one_window_whatever_n():
    """The tracked peak (saved tensors and snapshots) of ``truncate=K`` under ``budget=``
    does not grow with ``n``: n = 10 K and 100 K within 5 %."""
    torch.manual_seed(0)
    m, K = 1 << 15, 20
    w = torch.tensor(0.97, dtype=F64, requires_grad=True)

    def step(x, i):
        y = torch.tanh(x * w) + 0.01
        return y, y[:8].sum()

    peaks = []
    for n in (10 * K, 100 * K):
        x0 = torch.randn(m, dtype=F64)
        st = deepsolve.UnrollStats()
        with MemoryMeter("cpu", stats=st) as meter:
            y, outs = deepsolve.unroll(step, x0, n, budget="4MiB", truncate=K, stats=st)
            (y.sum() + outs.sum()).backward()
        assert st.extra["truncate"] == K
        assert st.extra["plan"].n_steps == K
        peaks.append(meter.tracked_peak)
    assert peaks[0] > 2 * m * 8  # the meter saw the window's snapshots and tapes
    assert abs(peaks[1] / peaks[0] - 1) < 0.05, peaks
