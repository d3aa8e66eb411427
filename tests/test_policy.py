"""Recomputation policies for the recorded step (selective activation checkpointing):
exact gradients under every policy and schedule that keeps tapes, smaller measured tapes,
the planner weighing (schedule, policy) pairs, and a default path that never checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import rel
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import deepsolve
from deepsolve import engine
from deepsolve import schedules as S
from deepsolve.engine import POLICIES, execute, policies, save_expensive
from deepsolve.memory import choose, predicted_peak, profile_step

DT = torch.float64
MUST_SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def make_step():
    """A step with a convolution, FFTs, a matrix product and pointwise ops; it returns an
    output too (an energy per step)."""
    torch.manual_seed(0)
    conv = nn.Conv1d(1, 3, 3, padding=1, padding_mode="circular").to(DT)
    lin = nn.Linear(3, 1).to(DT)
    k = torch.tensor(0.3, dtype=DT, requires_grad=True)  # a closed-over leaf

    def step(x, i):
        h = torch.tanh(conv(x.unsqueeze(1)))                    # (B, 3, N)
        h = lin(h.transpose(1, 2)).squeeze(-1)                  # (B, N)
        spec = torch.fft.rfft(x) * torch.exp(-k * torch.arange(x.shape[-1] // 2 + 1))
        y = x + 0.05 * (torch.fft.irfft(spec, n=x.shape[-1]) - x + torch.sin(h))
        return y, (y * y).mean()

    x0 = torch.randn(2, 8, dtype=DT, requires_grad=True)
    return step, x0, [x0, k, *conv.parameters(), *lin.parameters()]


def only_mm(ctx, op, *args, **kwargs):
    return MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) \
        else RECOMPUTE


ALL_POLICIES = [*POLICIES, only_mm, [torch.ops.aten._fft_r2c.default]]
N = 12


@pytest.fixture(scope="module")
def reference():
    step, x0, leaves = make_step()
    y, e = deepsolve.unroll(step, x0, N, schedule="store_all")
    return torch.autograd.grad(y.pow(2).sum() + e.sum(), leaves)


def assert_exact_under(policy, schedule, reference):
    """Unroll ``make_step`` under ``policy`` and ``schedule``; its gradients equal plain
    autograd's to 1e-10. Returns the differentiated leaves and the unroll's stats."""
    step, x0, leaves = make_step()
    stats = deepsolve.UnrollStats()
    y, e = execute(step, x0, schedule, policy=policy, stats=stats)
    grads = torch.autograd.grad(y.pow(2).sum() + e.sum(), leaves)
    for g, r in zip(grads, reference, strict=True):
        assert rel(g, r) <= 1e-10
    return leaves, stats


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policies.policy_name)
@pytest.mark.parametrize("schedule", [S.store_all(N), S.revolve_tail(N, 3, 5), S.periodic(N),
                                      S.mixed(N, 6, tape_units=1), S.revolve(N, 3)],
                         ids=lambda s: s.kind)
def test_gradients_equal_plain_autograd(policy, schedule, reference):
    leaves, stats = assert_exact_under(policy, schedule, reference)
    assert stats.extra.get("policy", "none") == policies.policy_name(policy)
    if schedule.kind != "store_all":  # parameter discovery runs through the policy's graph
        assert stats.extra["params"] == len(leaves) - 1


def test_stochastic_step_replays_its_random_numbers():
    torch.manual_seed(3)
    drop = nn.Dropout(0.3)
    w = torch.tensor(0.8, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + 0.1 * drop(torch.tanh(w * x)) + 1e-3 * torch.randn_like(x)

    x0 = torch.randn(64, dtype=DT, requires_grad=True)
    torch.manual_seed(7)
    ref = torch.autograd.grad(deepsolve.unroll(step, x0, 10).sum(), [x0, w])
    after_ref = torch.rand(())
    for policy in ("save_expensive", "recompute_all"):
        torch.manual_seed(7)
        y = execute(step, x0, S.revolve_tail(10, 2, 4), policy=policy)
        g = torch.autograd.grad(y.sum(), [x0, w])
        assert torch.rand(()) == after_ref  # the global stream is where the plain loop leaves it
        for a, b in zip(g, ref, strict=True):
            assert rel(a, b) <= 1e-10


def test_functional_call_step_and_online_unroll():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).to(DT)
    theta = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}

    def step(x, i):
        return x + 0.1 * torch.func.functional_call(net, theta, (x,))

    x0 = torch.randn(5, 4, dtype=DT, requires_grad=True)
    leaves = [x0, *theta.values()]
    ref = torch.autograd.grad(deepsolve.unroll(step, x0, 15).sum(), leaves)
    for kw in (dict(snapshots=3), dict(schedule="store_all")):
        y = deepsolve.unroll(step, x0, 15, policy="save_expensive", **kw)
        for a, b in zip(torch.autograd.grad(y.sum(), leaves), ref, strict=True):
            assert rel(a, b) <= 1e-10

    def stop(x, i):
        return i >= 15

    for kw in (dict(snapshots=3), dict()):  # online schedule; every step kept (plain loop)
        y = deepsolve.unroll(step, x0, until=stop, policy="recompute_all", **kw)
        for a, b in zip(torch.autograd.grad(y.sum(), leaves), ref, strict=True):
            assert rel(a, b) <= 1e-10


def test_default_path_never_checkpoints(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("checkpoint called without a policy")

    monkeypatch.setattr(policies, "checkpoint", boom)
    step, x0, leaves = make_step()
    for kw in (dict(snapshots=3), dict(schedule="store_all"), dict(policy="none"),
               dict(schedule=S.revolve_tail(N, 3, 5))):
        y, e = deepsolve.unroll(step, x0, N, **kw)
        torch.autograd.grad(y.sum() + e.sum(), leaves)


def test_bad_policies_are_one_line_errors():
    step, x0, _ = make_step()
    with pytest.raises(ValueError, match="unknown policy 'cheap'"):
        deepsolve.unroll(step, x0, 3, snapshots=2, policy="cheap")
    with pytest.raises(ValueError, match="op overloads"):
        deepsolve.unroll(step, x0, 3, snapshots=2, policy=[torch.ops.aten.mm])
    with pytest.raises(ValueError, match="policy must be"):
        deepsolve.unroll(step, x0, 3, snapshots=2, policy=3)


def pointwise_heavy():
    """One matrix product, then pointwise ops that each save a state-sized tensor."""
    torch.manual_seed(5)
    W = torch.randn(16, 16, dtype=DT, requires_grad=True)

    def step(x, i):
        h = x @ W
        return x + 0.01 * torch.exp(torch.sin(h) * torch.cos(h))

    return step, torch.randn(256, 16, dtype=DT)


def test_profile_measures_the_tape_under_each_policy():
    step, x0 = pointwise_heavy()
    plain = profile_step(step, x0, repeats=1)
    keep = profile_step(step, x0, repeats=1, policy="save_expensive")
    alls = profile_step(step, x0, repeats=1, policy="recompute_all")
    S_ = plain.state_bytes
    assert plain.tape_bytes >= 4 * S_  # h, sin h, cos h, exp(...)
    # only h = x @ W is kept (and the CPU RNG state the checkpoint stashes, about 5 KB)
    assert S_ <= keep.tape_bytes <= S_ + 8192
    assert alls.tape_bytes <= 8192
    # measured live bytes: what a kept step holds after its forward (its output state and
    # the policy's cache), and the peak of its backward, which recomputes what was dropped
    assert plain.kept_bytes >= 5 * S_
    # (and the objects around them, measured in the engine: graph nodes, checkpoint frames)
    assert 2 * S_ <= keep.kept_bytes <= 2 * S_ + 32768 and S_ <= alls.kept_bytes <= S_ + 32768
    assert keep.saves >= 1  # it kept the product's output
    for q in (keep, alls):
        assert q.base_tape_bytes == plain.tape_bytes
        assert q.base_reverse_bytes == plain.reverse_bytes
        assert q.reverse_bytes >= plain.tape_bytes  # the recomputed tape exists in backward
        assert q.state_bytes == S_ and q.t_advance == plain.t_advance
    assert profile_step(step, x0, policy="save_expensive") is keep  # cached per policy name
    # (the kept tape's objects, measured in the engine, are part of both: graph nodes, and
    # under the policy the checkpoint's frames)
    assert predicted_peak(keep, 100, "store_all") < 0.6 * predicted_peak(plain, 100, "store_all")


def test_planner_takes_a_policy_when_it_pays_and_explains_it():
    step, x0 = pointwise_heavy()
    p = profile_step(step, x0, repeats=1)
    # a policy that is cheap in time: the planner should keep every step under it
    # (and a step whose recomputation is dear: an unrecorded step costs a recorded one)
    p = dataclasses.replace(p, t_advance=p.t_record + p.t_backward)
    q = dataclasses.replace(p, policy="save_expensive", tape_bytes=p.state_bytes,
                            kept_bytes=2 * p.state_bytes, chain_bytes=2 * p.state_bytes,
                            base_tape_bytes=p.tape_bytes, t_record=p.t_record * 1.01, saves=1)
    n = 200
    budget = (predicted_peak(q, n, "store_all") + predicted_peak(p, n, "store_all")) // 2
    plain = choose(p, n, budget)
    both = choose(p, n, budget, policies=[p, q])
    assert plain.policy == "none" and plain.kind != "store_all"
    assert both.policy == "save_expensive" and both.kind == "store_all"
    assert both.predicted_peak <= budget and both.predicted_time < plain.predicted_time
    text = both.explain()
    assert "store_all [save_expensive]" in text and "policy for kept tapes: save_expensive" in text
    # a policy that is slow: the plain plan stays
    slow = dataclasses.replace(q, t_record=p.t_record + 10 * p.t_advance)
    assert choose(p, n, budget, policies=[p, slow]).policy == "none"
    # a fixed policy is used for every kept tape, even where plain store-all would fit
    fixed = choose(p, n, 10 * predicted_peak(p, n, "store_all"), policies=[q])
    assert fixed.kind == "store_all" and fixed.policy == "save_expensive"


def test_unroll_with_budget_and_policy_is_exact():
    step, x0 = pointwise_heavy()
    x0 = x0.requires_grad_()
    W = step.__closure__[0].cell_contents
    n = 40
    ref = torch.autograd.grad(deepsolve.unroll(step, x0, n).pow(2).sum(), [x0, W])
    p = profile_step(step, x0)
    q = profile_step(step, x0, policy="save_expensive")
    budget = (predicted_peak(q, n, "store_all") + predicted_peak(p, n, "store_all")) // 2
    for policy in (None, "save_expensive", save_expensive):
        st = deepsolve.UnrollStats()
        y = deepsolve.unroll(step, x0, n, budget=budget, policy=policy, stats=st)
        g = torch.autograd.grad(y.pow(2).sum(), [x0, W])
        for a, b in zip(g, ref, strict=True):
            assert rel(a, b) <= 1e-10
        plan = st.extra["plan"]
        assert plan.predicted_peak <= budget
        if plan.kind in ("store_all", "revolve_tail") and policy is not None:
            assert plan.policy is policy  # the caller's object reaches the executor
            assert st.extra["policy"] == policies.policy_name(policy)
        elif plan.policy == "none":  # no kept tapes (revolve): no policy, no checkpoint
            assert "policy" not in st.extra
    # forced: a long tail of kept tapes, smaller under the policy
    s_t, m = 3, 20
    assert predicted_peak(q, n, "revolve_tail", (s_t, m)) < \
        0.7 * predicted_peak(p, n, "revolve_tail", (s_t, m))
    y = execute(step, x0, S.revolve_tail(n, s_t, m), policy="save_expensive")
    for a, b in zip(torch.autograd.grad(y.pow(2).sum(), [x0, W]), ref, strict=True):
        assert rel(a, b) <= 1e-10


# ----------------------------------------------------------------------------------------
# policies applied by torch.compile (CompiledPolicy)


def test_saved_bytes_reads_the_same_tape_as_the_profiler():
    """``saved_bytes`` (which measures compiled tapes) agrees with the saved-tensor hooks
    the plain profile uses."""
    step, x0 = pointwise_heavy()
    x = x0.clone().requires_grad_()
    y = step(x, 0)
    W = next(t for t in engine.graph_leaves([y], {}, 0, set()) if t is not x)
    graph = engine.saved_bytes([y], (x, W))
    hooks = profile_step(step, x0, repeats=1).tape_bytes
    assert hooks >= 4 * x0.numel() * 8  # h, sin h, cos h, exp(...)
    assert 0 <= graph - hooks <= 16  # the graph also shows the 0-dim scalar 0.01 it keeps


@pytest.fixture(scope="module")
def compiled_fft():
    return deepsolve.CompiledPolicy("save_fft")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [S.store_all(N), S.revolve_tail(N, 3, 5)],
                         ids=lambda s: s.kind)
def test_compiled_policy_gradients_equal_plain_autograd(schedule, reference, compiled_fft):
    _, stats = assert_exact_under(compiled_fft, schedule, reference)
    assert stats.extra["policy"] == "compiled:save_fft"
    # the kept steps ran the compiled function: one is cached for this step and structure
    assert len(compiled_fft._cache) >= 1


@pytest.mark.slow
def test_compiled_policies_shrink_the_measured_tape():
    step, x0 = pointwise_heavy()
    plain = profile_step(step, x0, repeats=1)
    keep = profile_step(step, x0, repeats=1, policy=deepsolve.CompiledPolicy("save_expensive"))
    alls = profile_step(step, x0, repeats=1, policy=deepsolve.CompiledPolicy("recompute_all"))
    assert keep.policy == "compiled:save_expensive" and alls.policy == "compiled:recompute_all"
    assert keep.tape_bytes <= plain.state_bytes < plain.tape_bytes  # at most h = x @ W
    assert alls.tape_bytes < plain.state_bytes  # nothing state-sized
    assert keep.base_tape_bytes == plain.tape_bytes


@pytest.mark.slow
def test_compiled_policy_under_a_budget_is_exact(reference, compiled_fft):
    """The planner profiles the compiled policy (its tape read from the compiled graph) and
    hands the caller's object to the executor; gradients equal plain autograd's."""
    step, x0, leaves = make_step()
    p = profile_step(step, x0.detach(), cache=False)
    q = profile_step(step, x0.detach(), policy=compiled_fft)
    assert 0 < q.tape_bytes < p.tape_bytes
    budget = (predicted_peak(q, N, "store_all") + predicted_peak(p, N, "store_all")) // 2
    st = deepsolve.UnrollStats()
    y, e = deepsolve.unroll(step, x0, N, budget=budget, policy=compiled_fft, stats=st)
    for g, r in zip(torch.autograd.grad(y.pow(2).sum() + e.sum(), leaves), reference,
                    strict=True):
        assert rel(g, r) <= 1e-10
    plan = st.extra["plan"]
    assert plan.predicted_peak <= budget
    if plan.kind in ("store_all", "revolve_tail"):  # kept tapes: the caller's object
        assert plan.policy is compiled_fft
    assert "compiled:save_fft" in plan.explain()  # weighed, whether it paid or not


def test_compiled_policy_bad_input_is_one_line_errors():
    with pytest.raises(ValueError, match="give the policy to compile"):
        deepsolve.CompiledPolicy("none")
    with pytest.raises(ValueError, match="unknown policy 'cheap'"):
        deepsolve.CompiledPolicy("cheap")
