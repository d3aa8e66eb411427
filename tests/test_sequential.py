"""deepsolve.sequential: exact gradients (float64, against plain autograd) on heterogeneous
chains, the saved-tensor peak under the budget, dropout replay, profiling, caching, errors."""

from __future__ import annotations

import weakref

import pytest
import torch

from deepsolve.memory import BudgetError
from deepsolve.schedules.hetero import ChainCosts, least_memory
from deepsolve.sequential import (
    SequentialStats,
    clear_sequential_cache,
    profile_chain,
    sequential,
)


@pytest.fixture(autouse=True)
def float64():
    """Every test of this module in float64 (restored afterwards: other modules use float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class Residual(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def make_chain(seed: int = 0, dropout: float = 0.0, widths=(6, 24, 12, 30, 6, 18, 9) * 4 + (6,)):
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for k in range(len(widths) - 1):
        layers.append(torch.nn.Sequential(torch.nn.Linear(widths[k], widths[k + 1]),
                                          torch.nn.Tanh()))
        if k == 9:
            layers.append(Residual(widths[k + 1]))
            if dropout:
                layers.append(torch.nn.Dropout(dropout))
    return torch.nn.ModuleList(layers)


def grads(layers, x, fn, seed=123):
    """Output and gradients w.r.t. x and all parameters of loss = sum(y^2 * w)."""
    params = [p for layer in layers for p in layer.parameters()]
    torch.manual_seed(seed)
    y = fn()
    w = torch.linspace(0.5, 1.5, y.numel()).reshape(y.shape)
    g = torch.autograd.grad((y * y * w).sum(), [x, *params])
    return y.detach(), g


def plain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


class SavedMeter:
    """Peak bytes of tensors saved for backward (unique storages, alive), parameters and the
    caller's input excluded: the measure the budget bounds from below."""

    def __init__(self, exclude):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}
        self.now = 0
        self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [0, t.untyped_storage().nbytes()]
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        box = _Box(t)
        weakref.finalize(box, self.release, ptr)
        return box

    def release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[ptr]
            self.now -= entry[1]

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(
            self.pack, lambda b: b if isinstance(b, torch.Tensor) else b.t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def between(layers, x, frac: float) -> int:
    """A budget ``frac`` of the way from the least-memory schedule's need (plus rounding
    slack) to more than recording everything needs."""
    c = profile_chain(layers, x).costs
    lo = (least_memory(c, charge_input=False) + c.states[-1]) * 1.1  # + the output's gradient
    return int(lo + frac * (sum(c.states) + sum(c.tapes) + max(c.backward_overhead)))


# --- gradients ----------------------------------------------------------------------------

@pytest.mark.parametrize("frac", [0.0, 0.05, 0.15, 2.0])
def test_gradients_equal_plain_autograd(frac):
    layers = make_chain()
    x = torch.randn(64, 6, requires_grad=True)
    y0, g0 = grads(layers, x, lambda: plain(layers, x))
    st = SequentialStats()
    budget = between(layers, x, frac)
    y1, g1 = grads(layers, x, lambda: sequential(layers, x, budget=budget, stats=st))
    assert torch.allclose(y0, y1, rtol=0, atol=1e-12)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert st.predicted_peak <= budget
    if frac < 0.2:
        assert st.advances > 0 and st.recorded == len(layers)  # it did recompute


def test_gradients_with_dropout_replay_the_masks():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
                   torch.nn.Dropout(0.5)]
    x = torch.randn(64, 16, requires_grad=True)
    budget = between(layers, x, 0.0)  # least memory: every layer is recomputed
    y0, g0 = grads(layers, x, lambda: plain(layers, x))
    st = SequentialStats()
    y1, g1 = grads(layers, x, lambda: sequential(layers, x, budget=budget, stats=st))
    assert st.advances > 0
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    # without replay the recomputed masks differ and the gradients are wrong
    _, g2 = grads(layers, x, lambda: sequential(layers, x, budget=budget, preserve_rng=False))
    assert any(not torch.allclose(a, b) for a, b in zip(g0, g2, strict=True))


def test_caller_rng_stream_is_that_of_plain_autograd():
    layers = make_chain(dropout=0.3)
    x = torch.randn(64, 6, requires_grad=True)
    budget = between(layers, x, 0.1)
    torch.manual_seed(5)
    plain(layers, x).sum().backward()
    after_plain = torch.rand(3)
    torch.manual_seed(5)
    sequential(layers, x, budget=budget).sum().backward()
    assert torch.equal(torch.rand(3), after_plain)


def test_shared_module_and_function_layers():
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 8)
    scale = torch.randn(8, requires_grad=True)
    layers = [lin, torch.tanh, lin, lambda z: z * scale, torch.nn.Linear(8, 3)]
    x = torch.randn(6, 8, requires_grad=True)
    params = [*lin.parameters(), scale, *layers[4].parameters()]

    def run(fn):
        y = fn()
        return torch.autograd.grad((y ** 2).sum(), [x, *params])

    g0 = run(lambda: plain(layers, x))
    budget = between(layers, x, 0.1)
    g1 = run(lambda: sequential(layers, x, budget=budget))  # scale is found when profiling
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_explicit_costs_need_params_for_closures():
    torch.manual_seed(2)
    w = torch.randn(4, 4, requires_grad=True)
    layers = [lambda z: torch.tanh(z @ w) for _ in range(6)]
    x = torch.randn(3, 4, requires_grad=True)
    costs = ChainCosts.uniform(6, state=96, tape=96)
    with pytest.raises(ValueError, match="params=\\[...\\]"):
        sequential(layers, x, budget=700, costs=costs).sum().backward()
    y = sequential(layers, x, budget=700, costs=costs, params=[w])
    g1 = torch.autograd.grad(y.sum(), [x, w])
    g0 = torch.autograd.grad(plain(layers, x).sum(), [x, w])
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_long_chain_in_block_mode():
    torch.manual_seed(3)
    widths = [4, 16, 8] * 60 + [4]
    layers = [torch.nn.Sequential(torch.nn.Linear(widths[k], widths[k + 1]), torch.nn.Tanh())
              for k in range(len(widths) - 1)]
    x = torch.randn(2, 4, requires_grad=True)
    y0, g0 = grads(layers, x, lambda: plain(layers, x))
    st = SequentialStats()
    budget = between(layers, x, 0.02)
    y1, g1 = grads(layers, x, lambda: sequential(layers, x, budget=budget, slots=128,
                                                 mode="blocks", block=4, stats=st))
    assert st.mode == "blocks" and st.advances > len(layers)
    assert torch.allclose(y0, y1, rtol=0, atol=1e-12)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


# --- memory -------------------------------------------------------------------------------

def test_saved_bytes_stay_under_the_budget():
    torch.manual_seed(4)
    widths = [16, 128, 64, 256] * 8 + [16]
    layers = [torch.nn.Sequential(torch.nn.Linear(widths[k], widths[k + 1]), torch.nn.ReLU())
              for k in range(len(widths) - 1)]
    x = torch.randn(32, 16, requires_grad=True)
    params = [p for layer in layers for p in layer.parameters()]
    with SavedMeter([x, *params]) as plain_meter:
        (plain(layers, x) ** 2).sum().backward()
    c = profile_chain(layers, x).costs
    lo = (least_memory(c, charge_input=False) + c.states[-1]) * 1.1
    assert plain_meter.peak > 2 * lo
    for budget in (int(lo), int((lo + plain_meter.peak) / 2)):
        st = SequentialStats()
        with SavedMeter([x, *params]) as meter:
            (sequential(layers, x, budget=budget, stats=st) ** 2).sum().backward()
        assert meter.peak <= st.predicted_peak <= budget < plain_meter.peak
        assert st.advances > 0


def test_budget_strings_and_errors():
    layers = make_chain()
    x = torch.randn(64, 6, requires_grad=True)
    y = sequential(layers, x, budget="1MiB")
    assert torch.allclose(y, plain(layers, x))
    assert sequential(layers, x, budget="50%").shape == (64, 6)
    with pytest.raises(BudgetError, match="least-memory schedule .* needs .*raise the budget"):
        sequential(layers, x, budget=64)
    with pytest.raises(ValueError, match="cannot read the budget"):
        sequential(layers, x, budget="lots")


def test_input_errors():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="layers is empty"):
        sequential([], x, budget="1MiB")
    with pytest.raises(TypeError, match="x must be a tensor"):
        sequential([torch.tanh], [1.0, 2.0], budget="1MiB")
    with pytest.raises(TypeError, match=r"layers\[1\] is a int, not callable"):
        sequential([torch.tanh, 3], x, budget="1MiB")
    with pytest.raises(TypeError, match="layer 1 returned a tuple"):
        sequential([torch.tanh, lambda z: (z, z)], x.requires_grad_(), budget="1MiB")
    with pytest.raises(TypeError, match="not a single module"):
        sequential(torch.nn.Linear(3, 3), x, budget="1MiB")
    with pytest.raises(ValueError, match="costs must be a ChainCosts for 2 layers"):
        sequential([torch.tanh, torch.tanh], x, budget="1MiB", costs=ChainCosts.uniform(3))


# --- profiling, caching, plain paths ------------------------------------------------------

def test_profile_measures_sizes_and_is_cached():
    clear_sequential_cache()
    layers = [torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.ReLU()),
              torch.nn.Linear(40, 10)]
    x = torch.randn(7, 6)
    prof = profile_chain(layers, x)
    c = prof.costs
    assert c.states == (7 * 6 * 8, 7 * 40 * 8, 7 * 10 * 8)
    # Linear+ReLU saves its input and its output (states, not tape) and its weight (a
    # parameter); a bare Linear saves its input: neither has a tape of its own. The ReLU output
    # kept by the record of layer 0 is charged to its reverse step, with its weight gradients
    assert c.tapes == (0, 0)
    assert c.backward_overhead[0] == 7 * 40 * 8 * 2 + (6 * 40 + 40) * 8
    assert c.backward_overhead[1] == (40 * 10 + 10) * 8
    assert prof.shapes == ((7, 6), (7, 40), (7, 10))
    assert [len(p) for p in prof.params] == [2, 2]
    assert all(t >= 0 for t in (*c.forward, *c.backward))
    assert profile_chain(layers, x) is prof
    assert profile_chain(layers, torch.randn(3, 6)) is not prof


def test_plain_paths():
    layers = make_chain()
    x = torch.randn(64, 6, requires_grad=True)
    st = SequentialStats()
    assert torch.equal(sequential(layers, x, stats=st), plain(layers, x))
    assert st.schedule == "plain"
    with torch.no_grad():
        y = sequential(layers, x, budget="1MiB")
    assert not y.requires_grad
    st = SequentialStats()
    y = sequential(layers, x, budget=between(layers, x, 3.0), stats=st)
    assert st.schedule == "plain" and y.requires_grad  # everything fits recorded


def test_backward_twice_is_refused():
    layers = make_chain()
    x = torch.randn(64, 6, requires_grad=True)
    y = sequential(layers, x, budget=between(layers, x, 0.1))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run only once"):
        y.sum().backward()


def test_backward_accumulates_into_grad_like_plain_autograd():
    layers = make_chain()
    x = torch.randn(64, 6, requires_grad=True)
    params = [p for layer in layers for p in layer.parameters()]
    budget = between(layers, x, 0.05)

    def two_passes(fn):
        for p in params:
            p.grad = None
        x.grad = None
        for _ in range(2):  # gradient accumulation: the second pass adds to existing .grad
            (fn() ** 2).sum().backward()
        return [x.grad.clone(), *[p.grad.clone() for p in params]]

    g0 = two_passes(lambda: plain(layers, x))
    g1 = two_passes(lambda: sequential(layers, x, budget=budget))
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    # backward(inputs=[x]) leaves the parameters alone
    for p in params:
        p.grad = None
    x.grad = None
    (sequential(layers, x, budget=budget) ** 2).sum().backward(inputs=[x])
    assert all(p.grad is None for p in params)
    assert torch.allclose(x.grad, g0[0] / 2, rtol=0, atol=1e-10)
    # a parameter with a hook gets its gradient through the engine (the hook also sees the
    # per-layer partial gradients, as with deepsolve.unroll)
    seen = []
    h = params[0].register_hook(lambda g: seen.append(g.clone()))
    params[0].grad = None
    (sequential(layers, x, budget=budget) ** 2).sum().backward()
    h.remove()
    assert seen and torch.allclose(params[0].grad, g0[1] / 2, rtol=0, atol=1e-10)


def _chain_run(actions: list, n: int, x: torch.Tensor):
    """The chain executor on a listed schedule (the planner's are built in; this is what a
    bug in one would look like)."""
    from deepsolve.sequential import _Chain, _ChainFunction, _Listed

    layers = [lambda z, k=k: torch.sin(z) * (1 + 0.1 * k) for k in range(n)]
    run = _Chain(layers, [[] for _ in range(n)], [], _Listed(tuple(actions), n=n), True, [],
                 None)
    run.forward(x)
    return _ChainFunction.apply(run, x)


def test_the_chain_executor_checks_every_action():
    """Actions that do not fit the chain executor's state raise a one-line ScheduleError
    naming the action (before: a wrong gradient or a bare KeyError); a valid listed schedule
    gives plain autograd's gradient."""
    from deepsolve.schedules import Advance, Free, Restore, Reverse, Store
    from deepsolve.schedules.check import ScheduleError

    x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
    good = [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0), Advance(0, 1), Reverse(1),
            Restore(0, 0), Free(0, 0), Reverse(0)]
    (g,) = torch.autograd.grad(_chain_run(good, 3, x).sum(), x)
    z = x
    for k in range(3):
        z = torch.sin(z) * (1 + 0.1 * k)
    (ref,) = torch.autograd.grad(z.sum(), x)
    assert torch.allclose(g, ref, rtol=1e-12, atol=0)
    bad = {
        "reverse from x_2": [Advance(0, 2), Reverse(1)],
        "restore an empty slot": [Advance(0, 2), Reverse(2), Restore(1, 0)],
        "reverse out of order": [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0),
                                 Reverse(0)],
        "a layer never reversed": [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0),
                                   Advance(0, 1), Reverse(1), Free(0, 0)],
    }
    for name, acts in bad.items():
        with pytest.raises(ScheduleError, match=r"^sequential: ") as err:
            _chain_run(acts, 3, x).sum().backward()
        assert "\n" not in str(err.value), name
