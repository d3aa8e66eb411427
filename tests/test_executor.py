"""The executor trusts no schedule and no step: every action is checked against its state,
every recomputed state against the forward sweep's metadata, every recorded step's graph
against the differentiated tensors; constants stay constants. Gradients are compared with
plain autograd in float64."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import rel as rel_err

import deepsolve
from deepsolve import schedules as S
from deepsolve.schedules import Advance, Free, Record, Restore, Reverse, Schedule, Store
from deepsolve.schedules.check import ScheduleError
from deepsolve.unroll import unroll

DT = torch.float64


class Listed(Schedule):
    """Any list of actions as a schedule object (as a user's own schedule would be)."""

    kind = "listed"

    def __init__(self, n_steps: int, actions: list):
        self.n_steps = n_steps
        self.actions = list(actions)
        self.slots = {0: 64, 1: 64}

    def __iter__(self):
        return iter(self.actions)


def make():
    w = torch.tensor(0.9, dtype=DT, requires_grad=True)
    x0 = torch.linspace(-1, 1, 4, dtype=DT).requires_grad_()

    def step(x, i):
        return torch.sin(w * x) + 0.1 * i

    return step, x0, w


def plain(step, x0, n):
    x = x0
    for i in range(n):
        x = step(x, i)
    return x


def grads(y, inputs):
    return torch.autograd.grad((y * torch.arange(1, y.numel() + 1, dtype=DT)).sum(), inputs)


# --- 1. actions that do not fit the executor's state ------------------------------------

INVALID = {
    # Advance(0 -> 2) then Reverse(1) from x_2 (97 % off on the old executor)
    "reverse_from_wrong_state": (2, [Advance(0, 2), Reverse(1), Reverse(0)],
                                 r"action 1 \(Reverse\(index=1\)\).*needs x_1.*holds x_2"),
    # Reverse(0) while the adjoint is at x_2 (170 % off)
    "reverse_out_of_order": (3, [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0),
                                 Reverse(0), Free(0, 0)],
                             r"action 4 .*adjoint is at x_2.*Reverse\(1\)"),
    # a step never reversed (150 % off)
    "step_never_reversed": (3, [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0),
                                Advance(0, 1), Reverse(1), Free(0, 0)],
                            r"steps 0\.\.0 never reversed"),
    # Restore of an empty slot (a bare KeyError: (0, 1))
    "restore_empty_slot": (2, [Advance(0, 1), Reverse(1), Restore(1, 0), Reverse(0)],
                           r"action 2 \(Restore.*slot 1 \(level 0\) is empty"),
    "store_into_full_slot": (2, [Store(0, 0), Advance(0, 1), Store(0, 1), Reverse(1)],
                             r"action 2 .*already holds x_0; Free it first"),
    "free_empty_slot": (2, [Store(0, 0), Advance(0, 1), Reverse(1), Free(1, 0)],
                        r"action 3 \(Free.*slot 1 \(level 0\) is empty"),
    "free_wrong_index": (2, [Store(0, 0), Advance(0, 1), Free(0, 1)],
                         r"action 2 .*holds x_0, not x_1"),
    "restore_wrong_index": (2, [Store(0, 0), Advance(0, 1), Reverse(1), Restore(0, 1)],
                            r"action 3 .*holds x_0, not x_1"),
    "advance_from_wrong_state": (3, [Store(0, 0), Advance(1, 2)],
                                 r"action 1 \(Advance.*starts at x_1 but the executor holds x_0"),
    "advance_past_the_end": (3, [Advance(0, 4)], r"action 0 .*0 < stop <= n_steps=3"),
    "empty_advance": (3, [Advance(0, 0)], r"action 0 .*0 < stop <= n_steps=3"),
    "advance_after_reverse": (2, [Store(0, 0), Advance(0, 1), Reverse(1), Advance(1, 2)],
                              r"action 3 .*holds no state"),
    "store_wrong_state": (2, [Advance(0, 1), Store(0, 0)], r"action 1 .*stores x_0 .*holds x_1"),
    "record_twice": (3, [Store(0, 0), Record(0, 3), Reverse(2), Restore(0, 0), Record(0, 1)],
                     r"action 4 .*step 0 is already recorded"),
    "record_reversed_step": (3, [Store(0, 0), Advance(0, 2), Reverse(2), Restore(0, 0),
                                 Record(0, 3)],
                             r"action 4 .*steps 2\.\.2 are already reversed"),
    "not_an_action": (2, [Advance(0, 1), "Reverse(1)"], r"action 1 .*is not a schedule action"),
    "no_reverse_at_all": (2, [Advance(0, 2)], r"ended after 1 actions without a Reverse"),
    "first_reverse_not_last_step": (3, [Advance(0, 1), Reverse(0)],
                                    r"action 1 .*adjoint is at x_3.*Reverse\(2\)"),
    "level_1_restore_empty": (2, [Store(0, 0, 1), Advance(0, 1), Reverse(1), Restore(0, 0, 0)],
                              r"slot 0 \(level 0\) is empty"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_schedule_is_refused_with_a_one_line_error(name):
    """Each schedule is one that ``schedules.check`` rejects; the executor refuses it too,
    naming the action and its position, before any wrong gradient can come out."""
    n, actions, pattern = INVALID[name]
    with pytest.raises(ScheduleError):
        S.check(Listed(n, actions))
    step, x0, w = make()
    with pytest.raises(ScheduleError, match=pattern) as err:
        y = unroll(step, x0, n, schedule=Listed(n, actions))
        grads(y, [x0, w])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("unroll: ")
    assert isinstance(err.value, ValueError)


def test_valid_custom_schedules_give_plain_gradients():
    """Listed copies of built-in schedules (and a leaked slot, which check() rejects but
    which does not change any gradient) run and give plain autograd's gradients."""
    step, x0, w = make()
    n = 9
    ref = grads(plain(step, x0, n), [x0, w])
    built = [S.revolve(n, 2), S.revolve(n, 4), S.periodic(n, 3), S.revolve_tail(n, 2, 3),
             S.mixed(n, 4), S.two_level(n, 2, 2, write_cost=0.5, read_cost=0.5),
             S.online(3).for_length(n)]
    for sched in built:
        acts = list(sched)
        got = grads(unroll(step, x0, n, schedule=Listed(n, acts)), [x0, w])
        for a, b in zip(got, ref, strict=True):
            assert rel_err(a, b) <= 1e-10, sched
    leaky = list(S.revolve(n, 3))[:-1]  # the last Free dropped
    assert type(list(S.revolve(n, 3))[-1]) is Free
    got = grads(unroll(step, x0, n, schedule=Listed(n, leaky)), [x0, w])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


def test_online_controller_actions_are_checked():
    """The online sweep applies its controller's Store/Free actions through the same checks."""

    class Bad(S.Online):
        def start(self):
            ctl = super().start()

            class Ctl:
                def at(self, i):
                    acts = ctl.at(i)
                    return (Store(0, i),) if i == 2 else acts  # slot 0 holds x_0 already

                def finish(self, n):
                    return ctl.finish(n)

            return Ctl()

    step, x0, w = make()
    with pytest.raises(ScheduleError, match=r"online controller action .* step 2 .*already "
                                            r"holds x_0"):
        unroll(step, x0, until=lambda x, i: i >= 6, schedule=Bad(3))


# --- 2. recomputed states are checked against the forward sweep --------------------------

def _count_calls(n: int, s: int) -> int:
    calls = 0
    step, x0, w = make()

    def counted(x, i):
        nonlocal calls
        calls += 1
        return step(x, i)

    grads(unroll(counted, x0, n, snapshots=s), [x0, w])
    return calls


@pytest.mark.parametrize("change", ["dtype", "shape", "device"])
def test_a_step_that_changes_metadata_at_any_call_is_refused(change):
    """A step that returns another dtype (float32 for a float64 state), shape or device from
    its k-th call on, for every k over the forward and the reverse sweep of
    ``unroll(step, x0, 6, snapshots=2)``: always deepsolve's one-line error, never a
    gradient. (The old executor returned a gradient for the float32 case from a call in the
    reverse sweep, and failed inside autograd for a shape change.)"""
    n, s = 6, 2
    total = _count_calls(n, s)
    assert total == S.optimal_cost(n, s) + n
    for k in range(1, total + 1):
        step, x0, w = make()
        calls = 0

        def bad(x, i, k=k, step=step):
            nonlocal calls
            calls += 1
            y = step(x, i)
            if calls < k:
                return y
            if change == "dtype":
                return y.float()
            if change == "shape":
                return torch.cat([y, y])
            return y.to("meta")

        with pytest.raises(ValueError, match=r"unroll: step \d+ changed state leaf 0") as err:
            y = unroll(bad, x0, n, snapshots=s)
            grads(y, [x0, w])
        assert "\n" not in str(err.value)


def test_a_dict_built_in_another_key_order_keeps_each_leaf_in_place():
    """A step may build its dict state in any key order: leaves are taken by key (the old
    executor took them in insertion order and silently swapped equal-shaped leaves)."""
    k = torch.tensor(0.7, dtype=DT, requires_grad=True)
    x0 = {"q": torch.tensor([0.3, -0.2], dtype=DT, requires_grad=True),
          "p": torch.tensor([0.1, 0.5], dtype=DT, requires_grad=True)}

    def step(s, i):
        q, p = s["q"], s["p"]
        p = p - 0.1 * torch.sin(k * q)
        q = q + 0.1 * p
        return {"p": p, "q": q} if i % 2 else {"q": q, "p": p}

    def loss(r):
        return (r["q"] * torch.tensor([1.0, 2.0], dtype=DT)).sum() + r["p"].pow(2).sum()

    n = 11
    inputs = [x0["q"], x0["p"], k]
    ref = torch.autograd.grad(loss(plain(step, x0, n)), inputs)
    for kw in ({"snapshots": 2}, {"schedule": "periodic"}, {"schedule": "store_all"}):
        got = torch.autograd.grad(loss(unroll(step, x0, n, **kw)), inputs)
        for a, b in zip(got, ref, strict=True):
            assert rel_err(a, b) <= 1e-10, kw


def test_a_structure_change_in_the_reverse_sweep_is_refused():
    x0 = {"a": torch.ones(3, dtype=DT, requires_grad=True), "b": torch.ones(3, dtype=DT)}
    calls = 0

    def step(s, i):
        nonlocal calls
        calls += 1
        out = {"a": s["a"] * 0.9, "b": s["b"] + 1}
        if calls > 8:  # in the reverse sweep of revolve(6, 2)
            out["c"] = out["b"]
        return out

    with pytest.raises(TypeError, match=r"returned a state of structure .* but the state has "
                                        r"structure") as err:
        y = unroll(step, x0, 6, snapshots=2)
        y["a"].sum().backward()
    assert "\n" not in str(err.value)


def test_an_output_change_in_a_recorded_step_is_refused():
    w = torch.tensor(0.9, dtype=DT, requires_grad=True)
    calls = 0

    def step(x, i):
        nonlocal calls
        calls += 1
        y = x * w
        out = y.sum() if calls < 12 else y.sum().float()
        return y, out

    y, outs = unroll(step, torch.ones(3, dtype=DT), 6, snapshots=2)
    with pytest.raises(ValueError, match=r"changed output leaf 0 from \(\) torch.float64"):
        (y.sum() + outs.sum()).backward()


# --- 3. constants stay constants ---------------------------------------------------------

def _dict_step(w):
    def step(s, i):
        return {"a": s["a"] * w + 0.01 * s["b"], "b": s["b"] * 2 + 1}

    return step


@pytest.mark.parametrize("kw", [{"snapshots": 2}, {"schedule": "periodic"},
                                {"schedule": S.revolve_tail(9, 2, 3)}, {"schedule": S.mixed(9, 4)},
                                {"schedule": "store_all"}, {"until": True}],
                         ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_a_leaf_that_depends_on_nothing_requiring_grad_stays_a_constant(kw):
    """{"a": depends on a0 and w, "b": depends on b0 only}: b comes back with
    requires_grad=False, as from plain autograd; a's gradients are plain autograd's."""
    w = torch.tensor(0.8, dtype=DT, requires_grad=True)
    x0 = {"a": torch.tensor([1.0, -2.0], dtype=DT, requires_grad=True),
          "b": torch.tensor([0.5, 0.25], dtype=DT)}
    step = _dict_step(w)
    n = 9
    ref_y = plain(step, x0, n)
    assert not ref_y["b"].requires_grad
    if kw.get("until"):
        y = unroll(step, x0, until=lambda s, i: i >= n, snapshots=3)
    else:
        y = unroll(step, x0, n, **kw)
    assert y["a"].requires_grad and not y["b"].requires_grad
    assert torch.equal(y["b"], ref_y["b"])
    ref = torch.autograd.grad(ref_y["a"].sum(), [x0["a"], w])
    got = torch.autograd.grad(y["a"].sum(), [x0["a"], w])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


def test_a_leaf_that_reaches_a_parameter_later_requires_grad():
    """b <- b + a (and c <- c + b): a chain of dependence reaching x0's a; they require grad
    as in plain autograd, and their gradients are exact."""
    w = torch.tensor(0.8, dtype=DT, requires_grad=True)
    x0 = {"a": torch.tensor([1.0, -2.0], dtype=DT), "b": torch.tensor([0.5, 0.25], dtype=DT),
          "c": torch.tensor([0.1, 0.2], dtype=DT), "t": torch.zeros((), dtype=DT)}

    def step(s, i):
        return {"a": torch.sin(s["a"] * w), "b": s["b"] + s["a"], "c": s["c"] + s["b"],
                "t": s["t"] + 0.1}

    n = 8
    ref_y = plain(step, x0, n)
    y = unroll(step, x0, n, snapshots=2)
    for key in "abct":
        assert y[key].requires_grad == ref_y[key].requires_grad, key
    assert not y["t"].requires_grad
    ref = torch.autograd.grad(ref_y["c"].sum() + ref_y["a"].sum(), w)
    got = torch.autograd.grad(y["c"].sum() + y["a"].sum(), w)
    assert rel_err(got[0], ref[0]) <= 1e-10


def test_a_constant_that_stops_being_one_at_an_early_step_is_refused():
    """b depends on w only at step 1; the recorded last step shows b constant, so the unroll
    returns it with requires_grad=False; the reverse sweep records step 1, sees the
    dependence and raises instead of dropping b's share of the gradient."""
    w = torch.tensor(0.8, dtype=DT, requires_grad=True)
    x0 = {"a": torch.tensor([1.0, -2.0], dtype=DT, requires_grad=True),
          "b": torch.tensor([0.5, 0.25], dtype=DT)}

    def step(s, i):
        b = s["b"] * w if i == 1 else s["b"] * 1.0
        return {"a": s["a"] * w + b, "b": b}

    y = unroll(step, x0, 6, snapshots=2)
    with pytest.raises(ValueError, match=r"step 1 made state leaf 1 depend on a tensor that "
                                         r"requires grad.*requires_grad_\(\)"):
        y["a"].sum().backward()
    x0["b"].requires_grad_()  # what the message says to do: now b is differentiated
    ref = torch.autograd.grad(plain(step, x0, 6)["a"].sum(), [x0["a"], x0["b"], w])
    got = torch.autograd.grad(unroll(step, x0, 6, snapshots=2)["a"].sum(),
                              [x0["a"], x0["b"], w])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


# --- 4. parameter discovery does not depend on the schedule ------------------------------

@pytest.mark.parametrize("kw", [{"schedule": "store_all"}, {"snapshots": 2}, {"snapshots": 3},
                                {"schedule": "periodic"}, {"schedule": S.revolve_tail(20, 2, 4)},
                                {"schedule": S.two_level(20, 2, 2, write_cost=1, read_cost=1)},
                                {"budget": 1.1}, {"budget": 1.6}],
                         ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_a_parameter_used_only_at_early_steps_gets_its_gradient(kw):
    """p is used at steps 0..2 of 20 only; its gradient is plain autograd's under every
    schedule (the old executor found parameters in the last step's graph only: None under
    revolve, the right value under store_all)."""
    p = torch.tensor(0.4, dtype=DT, requires_grad=True)
    w = torch.tensor(0.95, dtype=DT, requires_grad=True)
    x0 = torch.linspace(0, 1, 4096, dtype=DT)  # large enough that store_all needs more

    def step(x, i):
        return x * w + p * torch.cos(x) if i < 3 else x * w

    n = 20
    ref = torch.autograd.grad(plain(step, x0, n).sum(), [p, w])
    if "budget" in kw:  # a factor of the planner's minimum budget
        from deepsolve.memory import profile_step
        from deepsolve.memory.planner import minimum_budget

        least = minimum_budget(profile_step(step, x0), n)
        kw = {"budget": int(kw["budget"] * least)}
    st = deepsolve.UnrollStats()
    y = unroll(step, x0, n, stats=st, **kw)
    if "budget" in kw:  # a small budget: revolve or mixed (1 GiB would be store_all)
        assert st.extra["plan"].kind != "store_all", st.extra["plan"]
    got = torch.autograd.grad(y.sum(), [p, w])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


def test_closure_discovery_reaches_modules_objects_and_partials():
    """Parameters behind a callable object, a functools.partial and a bound method."""
    import functools

    net = torch.nn.Linear(3, 3).to(DT)
    other = torch.nn.Linear(3, 3).to(DT)  # reachable but unused: no gradient, as plain

    class Stepper:
        def __init__(self):
            self.parts = {"net": net, "spare": other}

        def __call__(self, x, i, scale=0.1):
            return x + scale * torch.tanh(self.parts["net"](x)) if i == 0 else x * 0.99

    for step in (Stepper(), functools.partial(Stepper(), scale=0.1)):
        x0 = torch.ones(2, 3, dtype=DT)
        ref = torch.autograd.grad(plain(step, x0, 7).sum(), list(net.parameters()))
        y = unroll(step, x0, 7, snapshots=2)
        got = torch.autograd.grad(y.sum(), [*net.parameters(), *other.parameters()],
                                  allow_unused=True)
        for a, b in zip(got[:2], ref, strict=True):
            assert rel_err(a, b) <= 1e-10
        assert got[2] is None and got[3] is None


def test_a_hidden_parameter_used_at_an_early_step_raises_in_the_reverse_sweep():
    """A leaf that no discovery can see (behind a module object) and that the forward sweep's
    recorded steps do not use: the reverse sweep's check of every recorded step's graph
    raises a one-line error naming params=; with params=[p] the gradient is exact."""
    p = torch.tensor(0.4, dtype=DT, requires_grad=True)
    hidden = types.ModuleType("hidden")
    hidden.p = p

    def step(x, i):
        return x * 0.9 + hidden.p * x.sin() if i == 1 else x * 0.9

    x0 = torch.linspace(0, 1, 5, dtype=DT, requires_grad=True)
    y = unroll(step, x0, 10, snapshots=3)
    with pytest.raises(ValueError, match=r"step 1 uses a \(\) torch.float64 tensor that "
                                         r"requires grad.*params=\[") as err:
        y.sum().backward()
    assert "\n" not in str(err.value)
    ref = torch.autograd.grad(plain(step, x0, 10).sum(), [x0, p])
    got = torch.autograd.grad(unroll(step, x0, 10, snapshots=3, params=[p]).sum(), [x0, p])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


def test_a_tensor_computed_outside_and_used_at_an_early_step_raises():
    theta = torch.tensor(0.3, dtype=DT, requires_grad=True)
    q = theta.exp()

    def step(x, i):
        return x * q if i == 2 else x * 0.9

    x0 = torch.ones(3, dtype=DT, requires_grad=True)
    y = unroll(step, x0, 9, snapshots=2)
    with pytest.raises(ValueError, match=r"step 2 uses a tensor computed outside the step "
                                         r"\(graph node ExpBackward0\).*params=\["):
        y.sum().backward()
    (ref,) = torch.autograd.grad(plain(step, x0, 9).sum(), theta, retain_graph=True)
    (g,) = torch.autograd.grad(unroll(step, x0, 9, snapshots=2, params=[q]).sum(), theta)
    assert rel_err(g, ref) <= 1e-10


# --- 5. an inference-mode x0 ---------------------------------------------------------------

@pytest.mark.parametrize("kw", [{"snapshots": 2}, {"schedule": "store_all"},
                                {"until": True}], ids=str)
def test_an_inference_mode_x0_gets_a_one_line_error(kw):
    step, _, w = make()
    with torch.inference_mode():
        x0 = torch.ones(4, dtype=DT)
    with pytest.raises(ValueError, match=r"inference tensor.*x0\.clone\(\)") as err:
        if kw.get("until"):
            unroll(step, x0, until=lambda x, i: i >= 5, snapshots=2)
        else:
            unroll(step, x0, 5, **kw)
    assert "\n" not in str(err.value)
    with torch.no_grad():  # no graph to record: the plain loop runs
        assert torch.allclose(unroll(step, x0, 5, snapshots=2), plain(step, x0, 5))
    got = grads(unroll(step, x0.clone(), 5, snapshots=2), [w])  # what the message says
    assert rel_err(got[0], grads(plain(step, x0.clone(), 5), [w])[0]) <= 1e-10


@pytest.mark.parametrize("backward", [True, False])
def test_a_checkpointed_unroll_lets_its_final_state_and_outputs_go(backward):
    """The run behind the autograd node must not hold the tensors the node produced: that
    cycle passes through C++ and Python's gc never frees it (one state and the stacked
    outputs kept per unroll, for good)."""
    import gc
    import weakref

    w = torch.tensor(0.5, requires_grad=True)
    x0 = torch.ones(4, requires_grad=True)
    for schedule in ({"snapshots": 3}, {"schedule": "periodic"}, {"budget": "1MiB"}):
        xT, outs = deepsolve.unroll(lambda x, i: (x * w, x.sum()), x0, 20, **schedule)
        refs = [weakref.ref(xT), weakref.ref(outs)]
        if backward:
            (xT.sum() + outs.sum()).backward()
        del xT, outs
        gc.collect()
        assert all(r() is None for r in refs), schedule
