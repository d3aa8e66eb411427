"""deepsolve.unroll: exact gradients, exact step counts, bounded memory, clear errors."""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import rel as rel_err
from torch import nn

from deepsolve import schedules as S
from deepsolve.unroll import UnrollStats, unroll

DT = torch.float64


class Counter:
    """Wraps a step and counts unrecorded (no grad) and recorded (grad) evaluations."""

    def __init__(self, fn):
        self.fn = fn
        self.unrecorded = 0
        self.recorded = 0

    def __call__(self, x, i):
        if torch.is_grad_enabled():
            self.recorded += 1
        else:
            self.unrecorded += 1
        return self.fn(x, i)


# --- the steps ---------------------------------------------------------------------------

def make_linear():
    g = torch.Generator().manual_seed(1)
    A = nn.Parameter(0.3 * torch.randn(6, 6, generator=g, dtype=DT))
    x0 = torch.randn(2, 6, generator=g, dtype=DT, requires_grad=True)

    def step(x, i):
        return x @ A.T

    def loss(res):
        return (res * torch.linspace(-1, 1, 6, dtype=DT)).sum()

    return step, x0, [A], loss


def make_reaction_diffusion():
    """u_t = D u_xx + MLP(u) on a periodic 1D grid, explicit Euler."""
    torch.manual_seed(2)
    mlp = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    D = torch.tensor(0.1, dtype=DT, requires_grad=True)
    x = torch.linspace(0, 1, 17, dtype=DT)[:-1]
    u0 = torch.sin(2 * torch.pi * x).unsqueeze(0).repeat(3, 1).requires_grad_()
    dt, dx = 1e-3, 1.0 / 16

    def step(u, i):
        lap = (u.roll(1, -1) - 2 * u + u.roll(-1, -1)) / dx**2
        return u + dt * (D * lap + mlp(u.unsqueeze(-1)).squeeze(-1))

    def loss(res):
        return (res**2).mean()

    return step, u0, [D, *mlp.parameters()], loss


def make_dropout():
    torch.manual_seed(3)
    lin = nn.Linear(5, 5).to(DT)
    drop = nn.Dropout(0.3)
    x0 = torch.randn(4, 5, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + 0.1 * torch.tanh(drop(lin(x)))

    def loss(res):
        return res.pow(2).sum()

    return step, x0, list(lin.parameters()), loss


def make_noise_forcing():
    w = torch.tensor([0.9, -0.2, 0.4], dtype=DT, requires_grad=True)
    x0 = torch.randn(3, dtype=DT, requires_grad=True)

    def step(x, i):
        return torch.sin(w * x) + 0.05 * torch.randn(3, dtype=DT)

    def loss(res):
        return res.sum()

    return step, x0, [w], loss


def make_pytree_outputs():
    """A dict state (position, velocity) with a tuple of per-step outputs."""
    torch.manual_seed(4)
    k = torch.tensor(1.3, dtype=DT, requires_grad=True)
    net = nn.Linear(2, 2).to(DT)
    x0 = {"q": torch.randn(2, dtype=DT, requires_grad=True), "p": torch.randn(2, dtype=DT)}

    def step(s, i):
        q, p = s["q"], s["p"]
        p = p - 0.05 * (k * q + torch.tanh(net(q)))
        q = q + 0.05 * p
        return {"q": q, "p": p}, (0.5 * (p**2).sum(), q * i)

    def loss(res):
        final, (energy, qs) = res
        return final["q"].sum() + (final["p"] ** 2).sum() + energy.sum() + (qs**2).sum()

    return step, x0, [k, *net.parameters()], loss


STEPS = {
    "linear": make_linear,
    "reaction_diffusion": make_reaction_diffusion,
    "dropout": make_dropout,
    "noise_forcing": make_noise_forcing,
    "pytree_outputs": make_pytree_outputs,
}


def leaves_of(x0):
    return list(x0.values()) if isinstance(x0, dict) else [x0]


def plain_grads(step, x0, params, loss, n, seed=0):
    torch.manual_seed(seed)
    x, outs = x0, []
    for i in range(n):
        r = step(x, i)
        if isinstance(r, tuple):
            x, o = r
            outs.append(o)
        else:
            x = r
    if outs:
        stacked = tuple(torch.stack(c) for c in zip(*outs, strict=True))
        res = (x, stacked)
    else:
        res = x
    inputs = [t for t in leaves_of(x0) if t.requires_grad] + params
    return torch.autograd.grad(loss(res), inputs)


def unroll_grads(step, x0, params, loss, n, seed=0, **kw):
    torch.manual_seed(seed)
    res = unroll(step, x0, n, **kw)
    inputs = [t for t in leaves_of(x0) if t.requires_grad] + params
    return torch.autograd.grad(loss(res), inputs)


N = 13


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("kw", [
    {"snapshots": 2}, {"snapshots": 3}, {"snapshots": 5}, {"snapshots": N},
    {"schedule": "store_all"}, {"schedule": "periodic"}, {"schedule": S.periodic(N, 4)},
    {"snapshots": 1}, {"schedule": S.revolve_tail(N, 3, 4)}, {"schedule": S.mixed(N, 4)},
    {"schedule": S.two_level(N, 2, 3, write_cost=0.5, read_cost=0.5)},
], ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_gradients_equal_plain_autograd(name, kw):
    step, x0, params, loss = STEPS[name]()
    ref = plain_grads(step, x0, params, loss, N)
    got = unroll_grads(step, x0, params, loss, N, **kw)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("n,s", [(1, 1), (2, 1), (13, 2), (13, 3), (30, 5), (30, 30), (64, 4)])
def test_step_counts_equal_closed_form(n, s):
    step, x0, params, loss = make_reaction_diffusion()
    counted = Counter(step)
    st = UnrollStats()
    res = unroll(counted, x0, n, snapshots=s, stats=st)
    loss(res).backward()
    assert counted.unrecorded == S.optimal_cost(n, s) == st.advances
    assert counted.recorded == n == st.recorded


def test_forward_sweep_records_only_the_last_step():
    step, x0, params, loss = make_linear()
    counted = Counter(step)
    unroll(counted, x0, 20, snapshots=4)
    assert counted.recorded == 1 and counted.unrecorded == 19


def test_snapshot_memory_bounded_by_s_states():
    """Count the distinct state buffers alive whenever the step runs: at most s + 2
    (s snapshots, the working state and the one being made), never n."""
    n, s = 60, 4
    alive: weakref.WeakSet = weakref.WeakSet()
    peak = 0

    w = torch.tensor(0.99, dtype=DT, requires_grad=True)

    def step(x, i):
        nonlocal peak
        ptrs = {t.untyped_storage().data_ptr() for t in list(alive)}
        peak = max(peak, len(ptrs))
        y = torch.sin(w * x) + x
        alive.add(y)
        return y

    x0 = torch.randn(1000, dtype=DT, requires_grad=True)
    st = UnrollStats()
    unroll(step, x0, n, snapshots=s, stats=st).sum().backward()
    assert st.snapshots_peak <= s
    assert st.snapshot_bytes_peak <= s * x0.numel() * 8
    assert peak <= s + 2, peak
    # and the same probe sees store_all keep every state
    alive.clear()
    peak = 0
    unroll(step, x0, n, schedule="store_all").sum().backward()
    assert peak >= n - 1


def test_saved_tensor_bytes_within_one_step():
    """Live saved-for-backward bytes during the reverse sweep stay within one step's worth."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(DT)

    def step(x, i):
        return x + 0.1 * net(x)

    x0 = torch.randn(32, 64, dtype=DT, requires_grad=True)
    live = 0
    peak = 0

    def pack(t):
        nonlocal live, peak
        nbytes = t.numel() * t.element_size()
        live += nbytes
        peak = max(peak, live)
        box = [t]

        def release(b=nbytes):
            nonlocal live
            live -= b

        holder = _Holder(box)
        weakref.finalize(holder, release)
        return holder

    def unpack(h):
        return h.box[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = step(x0, 0)
    one_step = peak
    del y
    live, peak = 0, 0
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        unroll(step, x0, 40, snapshots=5).sum().backward()
    assert one_step > 0
    assert peak <= one_step * 1.01, (peak, one_step)
    # plain autograd for comparison keeps all 40
    live, peak = 0, 0
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        unroll(step, x0, 40, schedule="store_all").sum().backward()
    assert peak >= 39 * one_step


class _Holder:
    __slots__ = ("box", "__weakref__")

    def __init__(self, box):
        self.box = box


def test_rng_stream_matches_plain_loop():
    """After the unroll (and its backward) the global RNG is where the plain loop leaves it."""
    step, x0, params, loss = make_noise_forcing()
    torch.manual_seed(7)
    x = x0
    for i in range(9):
        x = step(x, i)
    after_plain = torch.rand(3)
    torch.manual_seed(7)
    res = unroll(step, x0, 9, snapshots=2)
    after_unroll = torch.rand(3)
    loss(res).backward()
    assert torch.equal(after_plain, after_unroll)
    assert torch.allclose(res, x, rtol=0, atol=0)


def test_no_grad_is_the_plain_loop():
    step, x0, params, loss = make_linear()
    counted = Counter(step)
    with torch.no_grad():
        y = unroll(counted, x0, 25, snapshots=3)
    assert counted.unrecorded == 25 and counted.recorded == 0
    assert not y.requires_grad


def test_nothing_requires_grad():
    counted = Counter(lambda x, i: x * 0.5)
    y = unroll(counted, torch.ones(3, dtype=DT), 10, snapshots=2)
    assert not y.requires_grad and torch.allclose(y, torch.full((3,), 0.5**10, dtype=DT))


def test_functional_call_step():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).to(DT)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}

    def step(x, i):
        return x + 0.2 * torch.func.functional_call(model, params, (x,))

    x0 = torch.randn(2, 3, dtype=DT)
    ref = plain_grads(step, x0, list(params.values()), lambda r: r.sum(), 12)
    got = unroll_grads(step, x0, list(params.values()), lambda r: r.sum(), 12, snapshots=3)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


def test_module_method_and_closure_discovery():
    """Parameters are found without params=: a module's method, and closed-over leaves."""

    class Stepper(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor(0.7, dtype=DT))

        def step(self, x, i):
            return torch.cos(self.a * x)

    m = Stepper()
    x0 = torch.linspace(0, 1, 5, dtype=DT)
    unroll(m.step, x0, 11, snapshots=3).sum().backward()
    g = m.a.grad.clone()
    m.a.grad = None
    x = x0
    for i in range(11):
        x = m.step(x, i)
    x.sum().backward()
    assert rel_err(g, m.a.grad) <= 1e-12


def test_closed_over_nonleaf_needs_params():
    theta = torch.tensor(0.3, dtype=DT, requires_grad=True)
    p = theta.exp()
    with pytest.raises(ValueError, match=r"params=\[") as e:
        unroll(lambda x, i: x * p, torch.ones(3, dtype=DT), 5, snapshots=2)
    assert "ExpBackward" in str(e.value)
    y = unroll(lambda x, i: x * p, torch.ones(3, dtype=DT), 5, snapshots=2, params=[p])
    (g,) = torch.autograd.grad(y.sum(), theta)
    assert rel_err(g, 3 * 5 * torch.exp(5 * theta.detach())) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_dtypes(dtype):
    torch.manual_seed(6)
    lin = nn.Linear(8, 8).to(dtype)
    x0 = torch.randn(4, 8, dtype=dtype, requires_grad=True)

    def step(x, i):
        return x + 0.1 * torch.tanh(lin(x))

    ref = plain_grads(step, x0, list(lin.parameters()), lambda r: r.float().sum(), 20)
    got = unroll_grads(step, x0, list(lin.parameters()), lambda r: r.float().sum(), 20,
                       snapshots=3)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, b)  # same ops in the same order: bit-identical


def test_autocast_is_replayed():
    """Recomputed and recorded steps in the reverse sweep run under the caller's autocast."""
    torch.manual_seed(8)
    lin = nn.Linear(8, 8).to(torch.float32)
    x0 = torch.randn(4, 8, requires_grad=True)
    modes = []

    def step(x, i):
        modes.append(torch.is_autocast_enabled("cpu"))
        return (x + 0.1 * torch.tanh(lin(x))).float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = plain_grads(step, x0, list(lin.parameters()), lambda r: r.sum(), 10)
        modes.clear()
        got = unroll_grads(step, x0, list(lin.parameters()), lambda r: r.sum(), 10,
                           snapshots=2)
    assert len(modes) == S.optimal_cost(10, 2) + 10 and all(modes)
    assert torch.equal(got[0], ref[0])  # the state's adjoint chain: bit-identical
    # parameter gradients: plain autograd sums the cached bf16 weight copy's gradient in
    # bf16, deepsolve sums per-step float32 gradients; they agree to bf16 precision
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert rel_err(a, b) <= 2e-2


@pytest.mark.slow
def test_compiled_step():
    torch.manual_seed(9)
    lin = nn.Linear(4, 4).to(DT)

    def raw(x, i):
        return x + 0.1 * torch.tanh(lin(x))

    try:
        compiled = torch.compile(raw, dynamic=False)
        compiled(torch.zeros(2, 4, dtype=DT), 0)
    except Exception as e:  # no C++ compiler or inductor backend on this machine
        pytest.skip(f"torch.compile unavailable here: {type(e).__name__}: {e}")
    x0 = torch.randn(2, 4, dtype=DT, requires_grad=True)
    ref = plain_grads(raw, x0, list(lin.parameters()), lambda r: r.sum(), 8)
    got = unroll_grads(compiled, x0, list(lin.parameters()), lambda r: r.sum(), 8, snapshots=3)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


def test_stats_are_filled():
    step, x0, params, loss = make_linear()
    st = UnrollStats()
    loss(unroll(step, x0, 100, snapshots=10, stats=st)).backward()
    assert st.n_steps == 100 and "revolve" in st.schedule
    assert st.advances == S.optimal_cost(100, 10) and st.recorded == 100
    assert st.snapshots_peak == 10 and st.state_bytes == 2 * 6 * 8
    assert st.forward_time > 0 and st.backward_time > 0


def test_zero_steps_returns_state():
    x0 = torch.ones(3, dtype=DT, requires_grad=True)
    assert unroll(lambda x, i: 2 * x, x0, 0, snapshots=2) is x0


# --- errors ------------------------------------------------------------------------------

def test_error_negative_steps():
    with pytest.raises(ValueError, match="n_steps must be an integer >= 0"):
        unroll(lambda x, i: x, torch.ones(2), -1)


def test_error_shape_change_names_leaf_and_step():
    def step(x, i):
        return x if i < 4 else torch.cat([x, x])

    x0 = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"step 4 changed state leaf 0 from \(3,\)"):
        unroll(step, x0, 8, snapshots=2)


def test_error_dtype_change():
    with pytest.raises(ValueError, match="torch.float32 .* torch.float64"):
        unroll(lambda x, i: x.double(), torch.ones(3, requires_grad=True), 3, snapshots=2)


def test_error_structure_change():
    def step(s, i):
        return {"a": s["a"]}

    with pytest.raises(TypeError, match="step 0 returned a state of structure"):
        unroll(step, {"a": torch.ones(2), "b": torch.ones(2)}, 3, snapshots=2)


def test_error_non_tensor_leaf():
    with pytest.raises(TypeError, match="state leaf 1 is a float"):
        unroll(lambda s, i: s, (torch.ones(2), 3.0), 3)


def test_error_double_backward():
    step, x0, params, loss = make_linear()
    y = unroll(step, x0, 10, snapshots=3)
    loss(y).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can run only once"):
        loss(y).backward()
    y = unroll(step, x0, 10, snapshots=3)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss(y), x0, create_graph=True)


def test_error_in_place_step():
    def step(x, i):
        x.mul_(0.5)
        return x

    with pytest.raises(RuntimeError, match="modified its input state in place"):
        y = unroll(step, torch.ones(3, requires_grad=True).clone(), 10, snapshots=3)
        y.sum().backward()


def test_error_bad_schedule_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        unroll(lambda x, i: x, torch.ones(2), 3, schedule="binomial")
    with pytest.raises(ValueError, match="is for 5 steps but n_steps=3"):
        unroll(lambda x, i: x, torch.ones(2), 3, schedule=S.revolve(5, 2))
    with pytest.raises(ValueError, match="snapshots"):
        unroll(lambda x, i: x, torch.ones(2), 3, snapshots=0)


# --- unknown length: until= with an online schedule ----------------------------------------

@pytest.mark.parametrize("name", ["reaction_diffusion", "noise_forcing", "pytree_outputs",
                                  "dropout"])
@pytest.mark.parametrize("kw", [{"snapshots": 2}, {"snapshots": 4}, {"snapshots": 50}, {}])
def test_until_gradients_equal_plain_autograd(name, kw):
    step, x0, params, loss = STEPS[name]()
    n = 29
    ref = plain_grads(step, x0, params, loss, n)
    torch.manual_seed(0)
    st = UnrollStats()
    res = unroll(step, x0, until=lambda x, i: i >= n, stats=st, **kw)
    inputs = [t for t in leaves_of(x0) if t.requires_grad] + params
    got = torch.autograd.grad(loss(res), inputs)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10
    assert st.n_steps == n and st.recorded == n
    if kw:
        s = kw["snapshots"]
        assert st.snapshots_peak <= s
        expected = S.stats(S.online(s).for_length(n)).advances + S.Online.extra_advances
        assert st.advances == expected


def test_until_stops_on_the_state():
    """The stop condition sees the state: iterate x -> x/2 until it is below a tolerance."""
    w = torch.tensor(0.5, dtype=DT, requires_grad=True)
    counted = Counter(lambda x, i: x * w)
    x0 = torch.tensor([1.0, 3.0], dtype=DT)
    y = unroll(counted, x0, until=lambda x, i: bool(x.abs().max() < 1e-3), snapshots=3)
    n = 12  # 3 / 2^12 < 1e-3 <= 3 / 2^11
    assert torch.allclose(y, x0 * 0.5**n)
    (g,) = torch.autograd.grad(y.sum(), w)
    assert rel_err(g, torch.tensor(4.0 * n * 0.5 ** (n - 1), dtype=DT)) <= 1e-12
    assert counted.recorded == n
    assert counted.unrecorded == S.stats(S.online(3).for_length(n)).advances + 1


def test_until_edge_cases_and_errors():
    x0 = torch.ones(3, dtype=DT, requires_grad=True)
    assert unroll(lambda x, i: 2 * x, x0, until=lambda x, i: True, snapshots=2) is x0
    with pytest.raises(RuntimeError, match="max_steps=7"):
        unroll(lambda x, i: 2 * x, x0, until=lambda x, i: False, snapshots=2, max_steps=7)
    with pytest.raises(ValueError, match="not both"):
        unroll(lambda x, i: 2 * x, x0, 5, until=lambda x, i: True)
    with pytest.raises(ValueError, match="give n_steps, or until="):
        unroll(lambda x, i: 2 * x, x0)
    with pytest.raises(ValueError, match="online"):
        unroll(lambda x, i: 2 * x, x0, until=lambda x, i: i > 3, schedule="revolve")


def test_until_with_a_budget_keeps_memory_bounded():
    from deepsolve.memory import predicted_peak, profile_step

    step, x0, params, loss = make_reaction_diffusion()
    prof = profile_step(step, x0)
    need = predicted_peak(prof, 0, "revolve", 1) + prof.state_bytes  # x_{i-1} beside x_i
    budget = need + 6 * prof.slot_bytes
    st = UnrollStats()
    y = unroll(step, x0, until=lambda x, i: i >= 80, budget=budget, stats=st)
    ref = plain_grads(step, x0, params, loss, 80)
    got = torch.autograd.grad(loss(y), [x0, *params])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10
    s = st.extra["online_snapshots"]
    assert s == 7 and (s - 1) * prof.slot_bytes + need <= budget
    assert st.snapshot_bytes_peak <= (s - 1) * prof.state_bytes


def test_store_all_that_cannot_fit_is_refused_before_it_starts():
    """Plain backpropagation through 10^20 steps would grow until the system kills it: the
    predicted peak is checked against the device's memory first (one-line BudgetError)."""
    from deepsolve import BudgetError

    w = torch.tensor(1.1, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + 0.01 * torch.tanh(w * x)

    x0 = torch.randn(64, dtype=DT, requires_grad=True)
    with pytest.raises(BudgetError, match=r"store_all for \d+ steps needs about .* give budget="):
        unroll(step, x0, 10**20)
    y = unroll(step, x0, 10_000)  # long but small: runs, exactly as plain autograd
    g = torch.autograd.grad(y.sum(), [x0, w])
    ref = x0
    for i in range(10_000):
        ref = step(ref, i)
    for a, b in zip(g, torch.autograd.grad(ref.sum(), [x0, w]), strict=True):
        assert rel_err(a, b) <= 1e-10


# --- the first week: mistakes a new user makes get one line ------------------------------

def test_a_step_without_the_index_or_a_wrong_argument_order_is_one_line():
    """``step(u)`` ended in a raw Python TypeError from inside the executor; ``unroll(5, x0,
    10)`` in "'int' object is not callable"."""
    x0 = torch.ones(3, dtype=DT, requires_grad=True)

    def step(u):
        return 0.5 * u

    with pytest.raises(TypeError, match=r"the step step\(u\) cannot be called as "
                                        r"step\(state, i\).*def step\(state, i\)") as e:
        unroll(step, x0, 10, snapshots=3)
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match=r"step must be a function step\(state, i\).*got int 5"
                                        r".*unroll\(step, x0, n_steps\)"):
        unroll(5, x0, 10)
    with pytest.raises(TypeError, match="got Tensor"):
        unroll(x0, step, 10)
    net = torch.nn.Linear(3, 3)            # forward(input): not a step either
    with pytest.raises(TypeError, match=r"cannot be called as step\(state, i\)"):
        unroll(net, x0, 4)
    # what may be called as step(state, i) is accepted: defaults, *args, a callable object
    assert unroll(lambda x, i, scale=0.5: scale * x, x0, 2).shape == (3,)
    assert unroll(lambda *a: a[0] * 0.5, x0, 2).shape == (3,)


@pytest.mark.parametrize("kw", [{"snapshots": 3}, {}, {"schedule": "periodic"}])
def test_an_in_place_step_is_refused_at_step_0(kw):
    """In place at step 0, before any further step runs; under no_grad (the plain loop,
    nothing recomputed) it stays allowed."""
    calls = []

    def step(x, i):
        calls.append(i)
        x.mul_(0.5)
        return x

    with pytest.raises(RuntimeError, match=r"^unroll: step 0 modified its input state in place"):
        unroll(step, torch.ones(3, dtype=DT, requires_grad=True).clone(), 100, **kw)
    assert calls == [0]
    with pytest.raises(RuntimeError, match=r"^unroll: step 0 modified its input state in place"):
        unroll(step, torch.ones(3, dtype=DT, requires_grad=True), 100, **kw)   # a leaf
    with torch.no_grad():
        assert torch.equal(unroll(step, torch.ones(2), 3), torch.full((2,), 0.125))


def test_unroll_stats_print_one_line_and_explain_everything():
    """Printing UnrollStats dumped the plan and its profile on one line."""
    w = torch.tensor(0.9, dtype=DT, requires_grad=True)
    st = UnrollStats()
    y = unroll(lambda x, i: w * x, torch.ones(4, dtype=DT), 200, budget="1MiB", stats=st)
    y.sum().backward()
    for text in (repr(st), str(st)):
        assert "\n" not in text and len(text) < 300, text
        assert text.startswith("UnrollStats(n_steps=200, schedule=") and "extra=[plan" in text
    full = st.explain()
    assert full.count("\n") >= 5 and "plan: budget" in full and "chosen:" in full
    assert f"{st.advances} unrecorded, {st.recorded} recorded" in full


def test_until_without_max_steps_stops_at_the_default_bound(monkeypatch):
    """A stop condition that never holds ran forever (and grew memory without snapshots)."""
    import sys

    U = sys.modules["deepsolve.unroll"]        # (deepsolve.unroll is also the function)
    monkeypatch.setattr(U, "DEFAULT_MAX_STEPS", 50)
    x0 = torch.ones(3, dtype=DT, requires_grad=True)
    for kw in ({}, {"snapshots": 3}):
        with pytest.raises(RuntimeError, match="not met within 50 steps, the default bound of "
                                               "an until= unroll without max_steps="):
            unroll(lambda x, i: 0.5 * x, x0, until=lambda x, i: False, **kw)
    with pytest.raises(RuntimeError, match="within max_steps=60"):   # an explicit bound
        unroll(lambda x, i: 0.5 * x, x0, until=lambda x, i: False, max_steps=60)
    y = unroll(lambda x, i: 0.5 * x, x0, until=lambda x, i: i >= 70, max_steps=80)
    assert torch.allclose(y, x0 * 0.5**70)
    assert U.DEFAULT_MAX_STEPS == 50 and U.unroll.__doc__ and "100 000" in U.unroll.__doc__
