"""The forward sweep's watch for NaN and inf states (deepsolve.engine.finite): every unroll —
plain loop, checkpointed, budgeted, open-ended, truncated, compiled segments, without grad —
names the first step whose result is not finite, in one line; a leaf that was not finite in
x_0 is left alone; and the watch is not a per-step cost."""

from __future__ import annotations

import pytest
import torch

import deepsolve as ds
from deepsolve.engine import finite as fin
from deepsolve.engine.segments import segments

pytestmark = pytest.mark.usefixtures("single_thread")

D = torch.float64
BAD = 37  # x_{BAD+1} = step(x_BAD, BAD) is the first state with a NaN


def make(bad: int = BAD):
    """A step whose state goes below zero at step ``bad`` and through a square root there."""
    a = torch.nn.Parameter(torch.tensor(1.0, dtype=D))
    x0 = torch.linspace(1.0, 2.0, 32, dtype=D) * (bad + 0.5) * 0.01

    def step(x, i):
        y = x - 0.01 * a
        return y + 0 * torch.sqrt(y)  # NaN where y < 0

    return step, x0, a


CASES = {
    "store_all": {},
    "revolve": {"snapshots": 4},
    "periodic": {"schedule": "periodic"},
    "budget": {"budget": "1MiB"},
    "truncate": {"snapshots": 3, "truncate": 16},
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_first_non_finite_step_is_named(case):
    step, x0, _ = make()
    with pytest.raises(ds.NonFiniteError) as err:
        ds.unroll(step, x0, 400, **CASES[case])
    msg = str(err.value)
    assert "\n" not in msg
    assert f"at step {BAD}: x_{BAD + 1} = step(x_{BAD}, {BAD})" in msg
    assert isinstance(err.value, FloatingPointError)


def test_without_grad_and_open_ended():
    step, x0, _ = make()
    with torch.no_grad(), pytest.raises(ds.NonFiniteError, match=f"at step {BAD}:"):
        ds.unroll(step, x0, 400)
    for kw in ({}, {"snapshots": 4}):
        with pytest.raises(ds.NonFiniteError, match=f"at step {BAD}:"):
            ds.unroll(step, x0, until=lambda x, i: i >= 300, **kw)


def test_compiled_segments_name_the_step_and_its_segment():
    step, x0, _ = make()
    seg = segments(step, 8, 400, compiled=False)
    with pytest.raises(ds.NonFiniteError,
                       match=rf"at step {BAD}, in segment 4 \(steps 32\.\.39\): "
                             rf"x_{BAD + 1} = step\(x_{BAD}, {BAD}\)"):
        ds.unroll(seg, x0, seg.segments, snapshots=3)


def test_the_budget_planners_probes_are_not_watched():
    """The planner measures memory on a chain of the step run again and again as step 0,
    beyond the unroll's length: a step finite over its own 4 steps but not over the probe's
    chain runs, with plain autograd's gradient (the report's fault harness: it was refused
    as non-finite at "step 5" of a 4-step unroll)."""
    a = torch.nn.Parameter(torch.tensor(1.0, dtype=D))
    x0 = torch.linspace(1.0, 2.0, 32, dtype=D) * 0.055

    def step(x, i):
        return torch.sqrt(x - 0.01 * a) * torch.sqrt(x - 0.01 * a)

    (want,) = torch.autograd.grad(ds.unroll(step, x0, 4).sum(), a)
    (got,) = torch.autograd.grad(ds.unroll(step, x0, 4, budget="1MiB").sum(), a)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_a_leaf_not_finite_in_x0_is_not_watched():
    """A sentinel (inf distance, a -inf mask) carried in the state stays allowed."""
    def step(state, i):
        x, mask = state
        return (x * 0.99, mask)

    x0 = (torch.ones(8, dtype=D, requires_grad=True),
          torch.tensor([0.0, float("-inf")], dtype=D))
    x, _ = ds.unroll(step, x0, 200, snapshots=3)
    assert float(x.detach().sum()) == pytest.approx(8 * 0.99**200)


def test_a_finite_unroll_is_unchanged_and_checked_rarely(monkeypatch):
    """The watch costs a reduction every EVERY steps of a plain loop and one per action of a
    schedule, not one per step; finite results are the plain ones."""
    calls = []
    real = fin.all_finite
    monkeypatch.setattr(fin, "all_finite", lambda t: calls.append(1) or real(t))
    a = torch.nn.Parameter(torch.tensor(0.5, dtype=D))
    x0 = torch.ones(16, dtype=D)
    x = ds.unroll(lambda x, i: x * (1 - 1e-3 * a), x0, 1000)
    (g,) = torch.autograd.grad(x.sum(), a)
    assert float(g) == pytest.approx(-16 * 1000 * 1e-3 * (1 - 5e-4) ** 999, rel=1e-12)
    assert len(calls) <= 1 + 1000 // fin.EVERY + 1
    calls.clear()
    ds.unroll(lambda x, i: x * (1 - 1e-3 * a), x0, 1000, snapshots=5)
    assert 0 < len(calls) <= 60


def test_finite_is_exact_where_the_sum_overflows():
    big = torch.full((4,), 1e308, dtype=D)
    assert fin.all_finite(big)  # the sum overflows, no element does
    assert not fin.all_finite(torch.tensor([1.0, float("nan")], dtype=D))
    assert not fin.all_finite(torch.tensor([float("inf"), -float("inf")], dtype=D))
    assert fin.all_finite(torch.empty(0, dtype=D))
