"""Compiled step segments (``unroll(..., compile=...)``, deepsolve/engine/segments.py) and the
choice of their length (deepsolve/memory/segments.py).

Float64 throughout: the compiled unroll equals plain autograd through the same compiled code
to 1e-12 and the eager unroll to 1e-10 (relative), for every feature the executor has. The
tests share two tiny steps so that each compiles once per process (the compiled code is
reused across unrolls, which one test checks)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers import rel

import deepsolve
from deepsolve.engine.segments import CompileError, Segments, segments
from deepsolve.memory.segments import choose_segment, segment_profile
from deepsolve.memory.strategies import Revolve, StoreAll

pytestmark = pytest.mark.timeout(600)

N, DT, K = 8, 0.01, 4


def l96(y: torch.Tensor, i: int, F: torch.Tensor) -> torch.Tensor:
    """One Heun step of Lorenz-96 with a time-dependent forcing (the index is used)."""
    def f(y):
        return (torch.roll(y, -1) - torch.roll(y, 2)) * torch.roll(y, 1) - y + F * (1 + 0.01 * i)
    k1 = f(y)
    return y + 0.5 * DT * (k1 + f(y + DT * k1))


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    F = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    y0 = (8 + torch.randn(N, dtype=torch.float64)).requires_grad_()

    def step(y, i):
        return l96(y, i, F)

    return step, F, y0


def grads(out, inputs):
    return torch.autograd.grad(out, inputs)


def loss_of(y):
    return (y ** 2).sum()


def eager_grads(step, y0, F, n, **kw):
    return grads(loss_of(deepsolve.unroll(step, y0, n, **kw)), (F, y0))


def assert_close(a, b, tol):
    for x, y in zip(a, b, strict=True):
        assert rel(x, y) < tol, (rel(x, y), tol)


@pytest.mark.parametrize("n", [16, 23])  # a multiple of k, and a remainder of 3 steps
def test_revolve_equals_plain_autograd_through_the_same_compiled_code(problem, n):
    step, F, y0 = problem
    stats = deepsolve.UnrollStats()
    g = grads(loss_of(deepsolve.unroll(step, y0, n, snapshots=3, compile=K, stats=stats)),
              (F, y0))
    assert stats.segment == K and stats.n_steps == -(-n // K)
    seg = segments(step, K, n)
    x = y0
    for j in range(seg.segments):  # plain autograd through the very same compiled segments
        x = seg(x, j)
    assert seg._compiled.get(K) is not None  # it ran compiled, not eagerly
    assert_close(g, grads(loss_of(x), (F, y0)), 1e-12)
    assert_close(g, eager_grads(step, y0, F, n), 1e-10)


def test_compiled_code_is_reused_across_unrolls(problem):
    step, F, y0 = problem
    deepsolve.unroll(step, y0, 12, snapshots=2, compile=K).sum().backward()
    stats = deepsolve.UnrollStats()
    deepsolve.unroll(step, y0, 12, snapshots=2, compile=K, stats=stats).sum().backward()
    assert stats.compile_time == 0.0


@pytest.mark.timeout(180)
def test_a_long_segment_of_a_step_that_reads_its_state_twice_compiles():
    """``x - dt r x`` reads the state twice: under Inductor's default inlining a 20-step
    segment costs 2^20 evaluations of the chain (hours; 12 steps took 140 s). Stored once
    per reuse (``INDUCTOR_OPTIONS``), it compiles in seconds — this test times out otherwise."""
    rate = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    x0 = torch.linspace(0.5, 1.5, 4, dtype=torch.float64).requires_grad_()

    def decay(x, i):
        return x - 0.02 * rate * x

    n, k = 40, 20
    stats = deepsolve.UnrollStats()
    g = grads(loss_of(deepsolve.unroll(decay, x0, n, snapshots=1, compile=k, stats=stats)),
              (rate, x0))
    assert stats.segment == k and stats.compile_time > 0
    factor = (1 - 0.02 * rate.detach()) ** n  # x_n = (1 - dt r)^n x_0, in closed form
    xn = factor * x0.detach()
    exact = (-2 * n * 0.02 * factor / (1 - 0.02 * rate.detach()) * (xn * x0.detach()).sum(),
             2 * factor * xn)
    assert_close(g, exact, 1e-12)


def test_two_level_and_store_all_segments(problem):
    step, F, y0 = problem
    n = 20
    ref = eager_grads(step, y0, F, n)
    two = deepsolve.TwoLevel(2, 2)
    assert_close(eager_grads(step, y0, F, n, schedule=two, compile=K), ref, 1e-10)
    assert_close(eager_grads(step, y0, F, n, compile=K), ref, 1e-10)


def test_truncate_takes_a_segment_length_dividing_the_window(problem):
    step, F, y0 = problem
    n, window = 22, 6  # k = 4 does not divide 6: segments of 3 (a divisor) or fewer
    stats = deepsolve.UnrollStats()
    g = grads(loss_of(deepsolve.unroll(step, y0, n, snapshots=2, truncate=window,
                                       compile=K, stats=stats)), F)
    assert stats.segment == 3  # the largest divisor of the window up to k
    e = grads(loss_of(deepsolve.unroll(step, y0, n, snapshots=2, truncate=window)), F)
    assert_close(g, e, 1e-10)


def test_until_hooks_and_adjoint_norms_run_single_compiled_steps(problem):
    step, F, y0 = problem
    seen_c, seen_e = [], []

    def hook(seen):
        def h(i, a):
            seen.append(i)
            return a * 0.5 if i % 3 == 0 else None
        return h

    def stop(y, i):
        return i >= 9

    sc, se = deepsolve.UnrollStats(adjoint_norms=True), deepsolve.UnrollStats(adjoint_norms=True)
    gc = grads(loss_of(deepsolve.unroll(step, y0, until=stop, snapshots=3, compile=K,
                                        adjoint_hook=hook(seen_c), stats=sc)), (F, y0))
    ge = grads(loss_of(deepsolve.unroll(step, y0, until=stop, snapshots=3,
                                        adjoint_hook=hook(seen_e), stats=se)), (F, y0))
    assert sc.segment == 1 and sc.n_steps == 9 and seen_c == seen_e
    assert_close(gc, ge, 1e-10)
    assert rel(sc.adjoint_norms, se.adjoint_norms) < 1e-10


def test_pytree_state_and_per_step_outputs_with_a_remainder():
    torch.manual_seed(1)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def step(s, i):
        u = torch.tanh(s["u"] @ w) + 0.1 * s["v"]
        v = s["v"] - 0.05 * u
        return {"u": u, "v": v}, (u.sum(), v * i)

    s0 = {"u": torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
          "v": torch.randn(2, 3, dtype=torch.float64)}
    n = 11  # segments of 4, 4 and 3 steps

    def run(**kw):
        x, (a, b) = deepsolve.unroll(step, s0, n, snapshots=2, **kw)
        assert a.shape == (n,) and b.shape == (n, 2, 3)
        return (x["u"] ** 2).sum() + (a * torch.arange(n)).sum() + b.pow(2).sum()

    g = grads(run(compile=4), (w, s0["u"]))
    assert_close(g, grads(run(), (w, s0["u"])), 1e-10)


def test_randomness_is_refused_or_run_eagerly():
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)

    def noisy(y, i):
        return y + 0.1 * w * torch.randn(4, dtype=torch.float64)

    y0 = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(CompileError, match="draws random numbers"):
        deepsolve.unroll(noisy, y0, 8, snapshots=2, compile=4)
    torch.manual_seed(3)
    with pytest.warns(RuntimeWarning, match="random numbers"):
        seg = Segments(noisy, 4, 8, strict=False)
        g = torch.autograd.grad(deepsolve.unroll(seg, y0, 2, snapshots=2).sum(), w)[0]
    torch.manual_seed(3)
    assert_close([g], [torch.autograd.grad(deepsolve.unroll(noisy, y0, 8).sum(), w)[0]], 1e-12)


def test_a_graph_break_runs_eagerly_with_one_warning_line():
    w = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    def branchy(y, i):
        if float(y.sum()) > 0:  # data-dependent Python control flow
            return y * w
        return y - w

    y0 = torch.ones(3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        g = torch.autograd.grad(
            deepsolve.unroll(branchy, y0, 6, snapshots=2, compile=2).sum(), w)[0]
    msgs = [str(x.message) for x in got if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "eagerly" in msgs[0], msgs
    assert_close([g], [torch.autograd.grad(deepsolve.unroll(branchy, y0, 6).sum(), w)[0]],
                 1e-12)


def test_budget_plans_the_compiled_segment(problem):
    step, F, y0 = problem
    stats = deepsolve.UnrollStats()
    g = grads(loss_of(deepsolve.unroll(step, y0, 40, budget="1GiB", compile=True,
                                       stats=stats)), (F, y0))
    plan = stats.extra["plan"]
    assert plan.segment is not None and plan.segment.k == stats.segment
    # the compiler's resident host memory (its first compile in this process: 0 when another
    # test loaded it already) is taken off the budget the schedule plans with
    lib = stats.extra["compiler_memory"]
    assert lib >= 0 and plan.budget == 2**30 - lib
    assert plan.predicted_peak <= plan.budget
    assert f"compiled segments of {stats.segment}" in stats.explain()
    assert_close(g, eager_grads(step, y0, F, 40), 1e-10)


def test_compiled_segments_weigh_no_recomputation_policies(problem, monkeypatch):
    # a compiled backward keeps what the compiler chose to save: a policy's profile fails on
    # the segment and costs host memory, so a budget that weighs policies for the eager step
    # does not profile the compiled segment under them
    import deepsolve.memory.planner as planner
    import deepsolve.memory.segments as ms
    step, F, y0 = problem
    monkeypatch.setattr(ms, "_compiler", {"resident": 0, "peak": 0})
    monkeypatch.setattr(planner, "affordable", lambda budget: True)  # weigh them here
    monkeypatch.setattr(planner, "load_policy_machinery", lambda: 0)
    profiled = []
    real_profile = planner.profile_step

    def profile_step(*a, **kw):
        profiled.append(kw.get("policy"))
        return real_profile(*a, **kw)

    monkeypatch.setattr(planner, "profile_step", profile_step)
    full = deepsolve.plan(step, y0, 40, budget="1GiB").predicted_peak
    grads(loss_of(deepsolve.unroll(step, y0, 40, budget=full // 3)), (F, y0))
    assert [p for p in profiled if p is not None]  # the eager step: policies weighed
    n = 400  # a compiled tape is smaller: a longer chain for a budget below store-all
    st = deepsolve.UnrollStats()
    deepsolve.unroll(step, y0, n, budget="1GiB", compile=K, stats=st)
    store_all = st.extra["plan"].predicted_peak
    profiled.clear()
    st = deepsolve.UnrollStats()
    g = grads(loss_of(deepsolve.unroll(step, y0, n, budget=store_all // 2, compile=K,
                                       stats=st)), (F, y0))
    assert st.extra["plan"].strategy.kind != "store_all"
    assert profiled and not [p for p in profiled if p is not None], profiled
    assert_close(g, eager_grads(step, y0, F, n), 1e-10)


def test_a_budget_too_small_for_the_compiler(problem, monkeypatch):
    step, _, y0 = problem
    # the figure this process measured at its first compile (0 when a compile outside
    # deepsolve loaded the compiler first): set to what a fresh process measures
    import deepsolve.memory.segments as ms
    monkeypatch.setattr(ms, "_compiler", {"resident": 110 * 2**20, "peak": 135 * 2**20})
    with pytest.raises(deepsolve.BudgetError, match="compiler's one-time host memory"):
        deepsolve.unroll(step, y0, 40, budget="64KiB", compile=K)
    stats = deepsolve.UnrollStats()  # "auto" stays eager there (estimated or measured)
    deepsolve.unroll(step, y0, 40, budget="64KiB", compile="auto", compile_runs=10**6,
                     stats=stats).sum().backward()
    assert stats.segment == 1


def test_bad_compile_arguments_are_one_line_errors(problem):
    step, _, y0 = problem
    for bad in ("yes", 0, -2, 1.5):
        with pytest.raises(ValueError, match="compile must be"):
            deepsolve.unroll(step, y0, 4, compile=bad)
    with pytest.raises(ValueError, match="compile_runs"):
        deepsolve.unroll(step, y0, 4, compile="auto", compile_runs=0)


# -- the model (no compilation) -------------------------------------------------------------

def _profile(t_adv: float) -> deepsolve.memory.StepProfile:
    return deepsolve.memory.StepProfile(
        state_bytes=320, tape_bytes=2000, output_bytes=0, grad_bytes=8, scratch_bytes=0,
        t_advance=t_adv, t_record=1.5 * t_adv, t_backward=2 * t_adv, device="cpu",
        kept_bytes=2000, reverse_bytes=3000, advance_bytes=1000, chain_bytes=2000)


def _revolve_time(p, m):
    return Revolve(min(8, m)).predicted_time(p, m), True


def test_model_compiles_dispatch_bound_steps_and_not_arithmetic_bound_ones():
    d = 2e-6
    dispatch_bound = _profile(40 * d)  # 40 ops of pure dispatch per step
    arithmetic_bound = _profile(0.05)  # 50 ms of arithmetic per step
    c = choose_segment(dispatch_bound, 4000, 40, d, mode=True, runs=10_000,
                       time_of=_revolve_time)
    assert c.k > 1 and c.compiled_time < c.eager_time
    once = choose_segment(dispatch_bound, 4000, 40, d, mode=True, runs=1, time_of=_revolve_time)
    assert once.k < c.k  # a single unroll does not repay a long segment's compile
    auto_short = choose_segment(dispatch_bound, 100, 40, d, mode="auto", time_of=_revolve_time)
    assert auto_short.k == 0 and "not repaid" in auto_short.reason
    auto_long = choose_segment(dispatch_bound, 4000, 40, d, mode="auto", runs=10_000,
                               time_of=_revolve_time)
    assert auto_long.k > 1
    auto_arith = choose_segment(arithmetic_bound, 4000, 40, d, mode="auto", runs=100,
                                time_of=lambda p, m: (StoreAll().predicted_time(p, m), True))
    assert auto_arith.k == 0


def test_model_counts_k_tapes_against_the_budget():
    p = _profile(1e-4)
    for k in (1, 4, 16):
        q = segment_profile(p, k, 40, 2e-6)
        assert q.tape_bytes == k * p.tape_bytes and q.state_bytes == p.state_bytes

    def tight(prof, m):  # fits only while a segment's tape is at most 4 steps'
        return 1.0, prof.tape_bytes <= 4 * p.tape_bytes

    c = choose_segment(p, 4000, 40, 2e-6, mode=True, time_of=tight)
    assert 1 <= c.k <= 4
    assert all(fits == (k <= 4) for k, _, _, _, fits in c.table)
    assert dataclasses.replace(p).tape_bytes == p.tape_bytes


def test_a_strategy_carries_compile_and_auto_compiles_once_it_pays(problem):
    step, F, y0 = problem
    stats = deepsolve.UnrollStats()
    g = grads(loss_of(deepsolve.unroll(step, y0, 16, schedule=Revolve(3).compiled(K),
                                       stats=stats)), (F, y0))
    assert stats.segment == K
    assert_close(g, eager_grads(step, y0, F, 16), 1e-10)
    assert deepsolve.Budget("1MiB", compile="auto").compile == "auto"
    runs = []  # "auto": the first unroll runs eagerly and is timed; the next one decides
    for kw in ({"compile_runs": 10**7}, {"compile_runs": 10**7}, {"compile_runs": 2}):
        st = deepsolve.UnrollStats()
        deepsolve.unroll(step, y0, 8, snapshots=3, compile="auto", stats=st, **kw).sum() \
            .backward()
        runs.append(st)
    assert runs[0].segment == 1 and "compile" not in runs[0].extra
    assert runs[1].segment > 1 and runs[1].extra["compile"].k == runs[1].segment
    assert runs[2].segment == runs[1].segment and runs[2].compile_time == 0  # kept, no recompile

    def other(y, i):  # a step of its own: without compile_runs, as many runs ahead as so far
        return l96(y, i, F)

    for _ in range(2):
        st = deepsolve.UnrollStats()
        deepsolve.unroll(other, y0, 8, snapshots=3, compile="auto", stats=st).sum().backward()
    assert st.segment == 1 and "not repaid" in st.extra["compile"].reason


def test_auto_decides_from_the_fastest_eager_unroll_not_one_slow_sample(problem):
    """One slow eager sample (a GC pass, a busy machine) after fast ones must not buy a
    compile: "auto" weighs the fastest eager unroll of this length seen so far."""
    _, F, y0 = problem

    def step(y, i):  # a step of its own, so "auto" has seen nothing of it
        return l96(y, i, F)

    seen = []
    for outlier in (None, 1000.0, None):
        st = deepsolve.UnrollStats()
        deepsolve.unroll(step, y0, 8, compile="auto", compile_runs=50, stats=st).sum() \
            .backward()
        assert st.segment == 1, [s.extra.get("compile") for s in seen + [st]]
        if outlier is not None:  # as if this eager unroll had been held up 1000 s
            st.forward_time = outlier
        seen.append(st)
    # 50 runs of a few milliseconds never repay a compile; 50 runs of 1000 s would have
    assert "not repaid" in seen[-1].extra["compile"].reason
    assert seen[-1].extra["compile"].k == 0


def test_trainer_setting_compiles_and_logs_the_first_call(tmp_path, capsys):
    import os

    import numpy as np

    from deepsolve.cli import main
    from deepsolve.io import read_log

    tiny = os.path.join(os.path.dirname(__file__), "data", "tiny_problem.py")
    cols = {}
    for mode in ("off", "5"):
        out = str(tmp_path / mode)
        assert main(["train", tiny, "--out", out, "--iterations", "3", "--quiet", "--dtype",
                     "float64", "--set", f"compile={mode}"]) == 0
        cols[mode] = read_log(os.path.join(out, "log.h5")).columns
    c = cols["5"]
    assert c["compile_time"][0] > 0 and np.all(c["compile_time"][1:] == 0)
    assert np.all(cols["off"]["compile_time"] == 0)
    assert np.all(c["recorded"] == 10)  # 50 steps as 10 recorded segments of 5
    np.testing.assert_allclose(c["loss"], cols["off"]["loss"], rtol=1e-10)
    assert main(["train", tiny, "--out", str(tmp_path / "bad"), "--set", "compile=maybe"]) == 2
    assert "compile" in capsys.readouterr().err


# -- the loop form: the step compiled once as a loop body -----------------------------------

def _captured(fn) -> int:
    """The operations Dynamo captured while compiling ``fn()`` (a fresh count)."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["calls_captured"]
    fn()
    return counters["stats"]["calls_captured"] - before


def test_a_loop_compiles_the_step_once_whatever_its_length():
    """The graph of a loop segment does not grow with k (what its compile time follows):
    the operations Dynamo captures for 64 steps are those for 8, where the unrolled form
    captures eight times as many."""
    def step(y, i):
        return y + 0.01 * (torch.roll(y, 1) - 2 * y + torch.roll(y, -1)) - 0.001 * y ** 3

    x = torch.randn(16, dtype=torch.float64)
    loops = [_captured(lambda k=k: Segments(step, k, 10**6, form="loop")(x, 0))
             for k in (8, 64)]
    unrolled = [_captured(lambda k=k: Segments(step, k, 10**6)(x, 0)) for k in (2, 4)]
    assert loops[0] == loops[1] > 0
    assert unrolled[1] >= 1.8 * unrolled[0]


def test_loop_segments_equal_eager_for_pytrees_outputs_and_a_leaf_returned_as_is():
    """A dict state with a leaf the step returns unchanged (a loop body may not alias its
    carry: deepsolve copies it), per-step outputs and closed-over parameters: a loop of 16
    steps under revolve gives the eager unroll's gradients to 1e-10, its outputs to 1e-12."""
    a = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)

    def step(s, i):
        u = s["u"] + DT * (a * torch.sin(s["u"]) - s["mask"] * s["u"]) * (1 + 0.01 * i)
        return {"u": u, "mask": s["mask"]}, u.sum()

    u0 = torch.randn(32, dtype=torch.float64, requires_grad=True)
    s0 = {"u": u0, "mask": torch.linspace(0, 1, 32, dtype=torch.float64)}
    stats = deepsolve.UnrollStats()
    x, outs = deepsolve.unroll(step, s0, 80, snapshots=3, compile=16, stats=stats)
    assert stats.segment == 16
    seg = segments(step, 16, 80, form="loop")
    assert seg.form == "loop" and seg.loop_reason is None
    got = grads(loss_of(x["u"]) + (outs ** 2).sum(), (a, u0))
    xe, oe = deepsolve.unroll(step, s0, 80)
    assert rel(outs.detach(), oe.detach()) < 1e-12
    assert_close(got, grads(loss_of(xe["u"]) + (oe ** 2).sum(), (a, u0)), 1e-10)


def test_a_step_the_loop_cannot_take_runs_unrolled_and_is_remembered():
    """A step that returns a closed-over tensor as a state leaf (a loop body's output may
    not alias its inputs) cannot be a loop body: as a segment of 4 it runs unrolled, no
    warning (it is still compiled), with the eager result and gradient, and later choices
    weigh no loop for it; as a loop of 32 (longer than an unrolled segment may be) it runs
    eagerly with one warning line."""
    from deepsolve.engine.segments import loop_refused
    c = torch.linspace(0, 1, 8, dtype=torch.float64)
    F = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)

    def step(s, i):
        return (s[0] + DT * (F * s[1] - s[0]), c)

    y0 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    seg = Segments(step, 4, 64, form="loop")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no warning line of deepsolve's
        x = (y0, c)
        for j in range(seg.segments):
            x = seg(x, j)
    assert seg.form == "unrolled" and seg.eager_reason is None
    assert "loop body" in str(loop_refused(step))
    want = deepsolve.unroll(step, (y0, c), 64)
    assert rel(x[0].detach(), want[0].detach()) < 1e-12
    assert_close(grads(loss_of(x[0]), (F, y0)), grads(loss_of(want[0]), (F, y0)), 1e-10)

    def other(s, i):
        return (s[0] - DT * F * s[0], c)

    long = Segments(other, 32, 64, form="loop")
    with pytest.warns(RuntimeWarning, match="loop body.*32 unrolled steps would compile") as w:
        long((y0.detach(), c), 0)
    assert len(w) == 1 and long.eager_reason is not None


def test_the_model_takes_long_loops_for_a_cheap_step_and_bounds_them_by_memory():
    """A dispatch-bound step over 4000 steps and many unrolls: a loop longer than any
    unrolled segment (its compile does not grow); the loop lengths stop where a loop's tape
    (k states) would pass the snapshots' memory or the free allowance."""
    from deepsolve.memory.segments import LOOP_FREE_BYTES, loop_lengths
    d = 2e-6
    p = _profile(40 * d)
    c = choose_segment(p, 4000, 40, d, mode=True, runs=1000, time_of=_revolve_time,
                       loops=loop_lengths(4000, p.state_bytes, 8))
    assert c.form == "loop" and c.k > 64
    assert any(f == "unrolled" for _, f, _, _, _ in c.table)
    big = 2**20  # a 1 MiB state with 8 snapshots: loops up to 8 states (8 MiB > 4 MiB)
    assert max(loop_lengths(4000, big, 8)) == 8
    assert max(loop_lengths(4000, 320, 8)) == max(k for k in (2 ** j for j in range(3, 13))
                                                   if k * 320 <= LOOP_FREE_BYTES and k <= 4000)
    assert loop_lengths(4000, big, None)[-1] == 2048 and loop_lengths(5, 320, 8) == ()
