"""LiveBytes: the bytes a block allocates and still holds, at its peak, at marks and at its end."""

from __future__ import annotations

import torch

from deepsolve.memory.live import LiveBytes
from deepsolve.memory.profiling import profile_step

DT = torch.float64
N = 1 << 16  # elements: 512 KiB in float64
B = N * 8


def test_sees_temporaries_that_are_freed_inside():
    x = torch.randn(N, dtype=DT)
    with LiveBytes() as lb:
        s = ((x * 2) + 1).sum()  # two state-sized temporaries, a 0-dim result
    assert lb.measured  # (the Python scalars become 0-dim tensors: a few bytes)
    assert 2 * B <= lb.peak <= 2 * B + 64  # x * 2 and (x * 2) + 1 are alive together
    assert 0 < lb.end <= 64  # only the sum is left
    del s


def test_marks_give_live_and_peak_at_that_moment():
    x = torch.randn(N, dtype=DT)
    with LiveBytes() as lb:
        a = x * 2
        k0 = lb.mark()
        b = a + 1
        c = b * b
        del b
        k1 = lb.mark()
        del a, c
    slack = 64  # the Python scalars become 0-dim tensors
    assert lb.at(k0) == B and B <= lb.peak_until(k0) <= B + slack
    assert lb.at(k1) == 2 * B  # a and c alive
    assert 3 * B <= lb.peak_until(k1) <= 3 * B + slack  # a, b and c at once
    assert lb.end == 0 and lb.peak == lb.peak_until(k1)


def test_freeing_older_memory_does_not_lower_the_count():
    old = torch.randn(4 * N, dtype=DT)
    with LiveBytes() as lb:
        del old  # 2 MiB from before the window: not the window's to count
        y = torch.ones(N, dtype=DT)
    assert lb.peak == lb.end == B
    del y


def test_not_measured_under_a_running_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with LiveBytes() as lb:
            torch.ones(N, dtype=DT)
    assert not lb.measured and lb.peak == 0


def test_profile_measures_the_working_set_of_a_pointwise_step():
    """``x + 0.01 tanh(w x) sin(x + 1e-3 i)``: the figures follow from what each op
    allocates."""
    w = torch.tensor(1.3, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + 0.01 * torch.tanh(w * x) * torch.sin(x + 1e-3 * i)

    p = profile_step(step, torch.randn(N, dtype=DT), cache=False)
    slack = 64  # 0-dim tensors (the parameter's gradient, the scalar 0.01)
    graph = 65536  # a kept step's autograd graph itself (nodes, saved-variable records),
    # counted by the C library, which also sees the interpreter's own allocations meanwhile
    assert p.measured
    # unrecorded: w x, tanh, 0.01 tanh, x + c, sin, product, sum -- three alive at once
    assert 3 * B <= p.advance_bytes <= 3 * B + slack
    # recorded: the tape (tanh, 0.01 tanh, x + c, sin) and the next state stay alive
    assert 5 * B <= p.kept_bytes <= 5 * B + graph and p.tape_bytes == 4 * B
    # reversed: two gradient buffers at once on top (the adjoint seed excluded)
    assert 7 * B <= p.reverse_bytes <= 7 * B + graph
    # chained: one more step adds its tape and output (its input, the first output, is saved)
    assert 5 * B <= p.chain_bytes <= 5 * B + graph
    assert p.scratch_bytes == p.reverse_bytes - p.kept_bytes
