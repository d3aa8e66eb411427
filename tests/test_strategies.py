"""Checkpoint strategies (deepsolve.memory.strategies): each builds the schedule of its
function form, counts its recomputations as the schedule does, prices itself as the planner's
memory model does, and runs through ``unroll(schedule=...)`` with plain autograd's
gradients."""

from __future__ import annotations

import pytest
import torch

import deepsolve
from deepsolve import schedules as S
from deepsolve.memory import StepProfile
from deepsolve.memory.planner import choose, predicted_peak
from deepsolve.memory.strategies import as_strategy

PROFILE = StepProfile(state_bytes=1000, tape_bytes=3000, output_bytes=8, grad_bytes=400,
                      scratch_bytes=0, t_advance=1e-3, t_record=1.5e-3, t_backward=2e-3,
                      device="cpu", kept_bytes=3500, reverse_bytes=6000, advance_bytes=2500,
                      chain_bytes=3200)


def _actions(schedule) -> list:
    return list(schedule)


@pytest.mark.parametrize("strategy, function", [
    (deepsolve.Revolve(4), lambda n: S.revolve(n, 4)),
    (deepsolve.StoreAll(), S.store_all),
    (deepsolve.Periodic(5), lambda n: S.periodic(n, 5)),
    (deepsolve.Periodic(), S.periodic),
    (deepsolve.RevolveTail(3, 4), lambda n: S.revolve_tail(n, 3, 4)),
    (deepsolve.Mixed(6, 1), lambda n: S.mixed(n, 6, tape_units=1)),
], ids=lambda v: repr(v) if isinstance(v, deepsolve.Strategy) else "builder")
@pytest.mark.parametrize("n", [7, 23, 60])
def test_a_strategy_builds_its_schedule_and_counts_its_recomputations(strategy, function, n):
    built = strategy.build(n)
    assert _actions(built) == _actions(function(n))
    assert strategy.advances(n) == S.stats(built).advances
    S.check(built)


def test_revolve_counts_the_closed_form():
    """t(n, s) = r n - beta(s + 1, r - 1) (Griewank 1992): the design card's sanity values."""
    for n, s, t in ((10, 2, 20), (100, 5, 316), (1000, 10, 3636)):
        assert deepsolve.Revolve(s).advances(n) == t


@pytest.mark.parametrize("kind, strategy, slots", [
    ("store_all", deepsolve.StoreAll(), 0),
    ("revolve", deepsolve.Revolve(5), 5),
    ("two_level", deepsolve.TwoLevel(5, 3), 5),
    ("mixed", deepsolve.Mixed(7), 7),
    ("revolve_tail", deepsolve.RevolveTail(4, 6), (4, 6)),
])
def test_a_strategy_prices_itself_as_the_memory_model(kind, strategy, slots):
    n = 50
    assert strategy.predicted_peak(PROFILE, n) == predicted_peak(PROFILE, n, kind, slots)
    terms = strategy.peak_terms(PROFILE, n)
    assert sum(terms.values()) == strategy.predicted_peak(PROFILE, n)
    assert terms["parameter gradients"] == 2 * PROFILE.grad_bytes
    assert terms["stacked outputs"] == 2 * n * PROFILE.output_bytes


def test_revolve_memory_and_time_by_hand():
    s, n = 5, 40
    r = deepsolve.Revolve(s)
    expected = (s - 1) * 1000 + 6000 + 4 * 1000 + 2 * 400 + 2 * n * 8
    assert r.predicted_peak(PROFILE, n) == expected
    adv = S.optimal_cost(n, s)
    plain = n * 3.5e-3
    assert r.predicted_time(PROFILE, n) == pytest.approx((adv * 1e-3 + plain) / plain)


def test_the_planner_takes_the_fastest_strategy_that_fits():
    """Each budget's plan names its strategy, fits, and no weighed alternative that fits
    is predicted faster by more than the planner's 10 % margin."""
    n = 200
    for budget in (16_000, 25_000, 60_000, 400_000, 10**8):
        plan = choose(PROFILE, n, budget)
        assert plan.strategy is not None and plan.describe() == plan.strategy.describe()
        assert plan.strategy.kind == plan.kind
        assert plan.predicted_peak == plan.strategy.predicted_peak(PROFILE, n) <= budget
        assert _actions(plan.schedule) == _actions(plan.strategy.build(n))
        fastest = min(a.time for a in plan.alternatives if a.fits)
        assert plan.predicted_time <= fastest / 0.9 + 1e-12


def _chain(n: int):
    torch.manual_seed(0)
    w = torch.randn(6, 6, dtype=torch.float64) * 0.4
    w.requires_grad_()
    x0 = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def step(x, i):
        return torch.tanh(w @ x) + 0.01 * i

    return step, x0, w


@pytest.mark.parametrize("strategy", [deepsolve.Revolve(3), deepsolve.Periodic(4),
                                      deepsolve.RevolveTail(2, 3), deepsolve.StoreAll(),
                                      deepsolve.Mixed(4)], ids=repr)
def test_unroll_runs_a_strategy_with_plain_autograds_gradients(strategy):
    n = 17
    step, x0, w = _chain(n)
    st = deepsolve.UnrollStats()
    y = deepsolve.unroll(step, x0, n, schedule=strategy, stats=st)
    g = torch.autograd.grad(y.square().sum(), (x0, w))
    z = x0
    for i in range(n):
        z = step(z, i)
    ref = torch.autograd.grad(z.square().sum(), (x0, w))
    for a, b in zip(g, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    if strategy.kind != "store_all":
        assert st.advances == strategy.advances(n)


def test_online_strategy_with_until():
    step, x0, w = _chain(0)
    y = deepsolve.unroll(step, x0, until=lambda x, i: i >= 11, schedule=deepsolve.Online(3))
    g = torch.autograd.grad(y.sum(), w)[0]
    z = x0
    for i in range(11):
        z = step(z, i)
    assert torch.allclose(g, torch.autograd.grad(z.sum(), w)[0], rtol=1e-12, atol=1e-14)


def test_budget_strategy_is_the_budget_short_form():
    n = 30
    step, x0, w = _chain(n)
    st1, st2 = deepsolve.UnrollStats(), deepsolve.UnrollStats()
    deepsolve.unroll(step, x0, n, budget="256KiB", stats=st1).sum().backward()
    deepsolve.unroll(step, x0, n, schedule=deepsolve.Budget("256KiB"), stats=st2).sum().backward()
    assert st1.extra["plan"].describe() == st2.extra["plan"].describe()
    assert st1.schedule == st2.schedule


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget="12 parsecs"), "parsecs"),
    (dict(schedule=deepsolve.Revolve(3), snapshots=3), "not both"),
    (dict(schedule=deepsolve.Budget("1MiB"), snapshots=3), "not both"),
    (dict(budget="1MiB", schedule="revolve"), "not both"),
    (dict(offload="disk"), "offload= works with budget="),
    (dict(budget=deepsolve.Budget("1MiB"), offload="disk"), "inside Budget"),
    (dict(schedule=deepsolve.Online(3)), "unknown length"),
    (dict(schedule="revolve"), "needs snapshots"),
    (dict(schedule="binomial"), "unknown schedule"),
])
def test_bad_combinations_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        as_strategy(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("make, message", [
    (lambda: deepsolve.Revolve(0), "snapshots must be an integer >= 1"),
    (lambda: deepsolve.Periodic(0), "every must be an integer >= 1"),
    (lambda: deepsolve.RevolveTail(2, 0), "tail must be an integer >= 1"),
    (lambda: deepsolve.Budget("1MiB", offload="tape"), "offload must be"),
    (lambda: deepsolve.Budget("1MiB", spill_dir="/tmp"), "offload='disk'"),
])
def test_bad_strategies_are_refused_when_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_strategies_compare_and_name_themselves():
    assert deepsolve.Revolve(4) == deepsolve.Revolve(4) != deepsolve.Revolve(5)
    assert len({deepsolve.Revolve(4), deepsolve.Revolve(4)}) == 1
    assert deepsolve.Revolve(4).describe() == "revolve(s=4)"
    assert deepsolve.TwoLevel(3, 2, level="disk").describe() == "two_level(s=3, disk=2)"
    assert "save_fft" in deepsolve.StoreAll("save_fft").describe()
