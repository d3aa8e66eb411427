"""LiveBytes: the bytes a block allocates and still holds, at its peak, at marks and at its end.

In this process deepsolve's host allocator is installed, so LiveBytes reads its counters (the
CPU counterpart of CUDA's); a child process with ``DEEPSOLVE_HOST_ALLOCATOR=0`` checks the
fallback that reads PyTorch's profiler events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepsolve.memory import hostalloc
from deepsolve.memory.live import LiveBytes
from deepsolve.memory.profiling import profile_step

DT = torch.float64
N = 1 << 16  # elements: 512 KiB in float64
B = N * 8

pytestmark = pytest.mark.skipif(not hostalloc.install(), reason=f"no host allocator: "
                                f"{hostalloc.why_inactive()}")

# what the C library adds to a block of B bytes (the allocator's 64-byte alignment prefix,
# the block's header, page rounding of a mapped block)
ROUND = 4096 + 128


def test_sees_temporaries_that_are_freed_inside():
    x = torch.randn(N, dtype=DT)
    with LiveBytes() as lb:
        s = ((x * 2) + 1).sum()  # two state-sized temporaries, a 0-dim result
    assert lb.measured
    assert 2 * B <= lb.peak <= 2 * B + 3 * ROUND  # x * 2 and (x * 2) + 1 are alive together
    assert 0 < lb.end <= ROUND  # only the sum is left
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
    assert B <= lb.at(k0) <= B + ROUND and B <= lb.peak_until(k0) <= B + 2 * ROUND
    assert 2 * B <= lb.at(k1) <= 2 * B + 2 * ROUND  # a and c alive
    assert 3 * B <= lb.peak_until(k1) <= 3 * B + 4 * ROUND  # a, b and c at once
    assert lb.end <= 64 and lb.peak == lb.peak_until(k1)


def test_freeing_older_memory_lowers_the_count_as_on_cuda():
    old = torch.randn(4 * N, dtype=DT)
    with LiveBytes() as lb:
        del old  # 2 MiB from before the window, freed inside it
        y = torch.ones(N, dtype=DT)
    assert lb.peak == 0  # never above what was live on entry
    assert -3 * B - ROUND <= lb.end <= -3 * B + ROUND
    del y


def test_counts_under_a_running_profiler_too():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with LiveBytes() as lb:
            torch.ones(N, dtype=DT)
    assert lb.measured and B <= lb.peak <= B + ROUND


def test_profile_measures_the_working_set_of_a_pointwise_step():
    """``x + 0.01 tanh(w x) sin(x + 1e-3 i)``: the figures follow from what each op
    allocates."""
    w = torch.tensor(1.3, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + 0.01 * torch.tanh(w * x) * torch.sin(x + 1e-3 * i)

    p = profile_step(step, torch.randn(N, dtype=DT), cache=False)
    slack = 8 * ROUND  # rounding of each block, the 0-dim tensors
    graph = 65536  # a kept step's autograd graph itself (nodes, saved-variable records)
    assert p.measured and p.units_measured
    # unrecorded: w x, tanh, 0.01 tanh, x + c, sin, product, sum -- three alive at once
    assert 3 * B <= p.advance_bytes <= 3 * B + slack
    # recorded: the tape (tanh, 0.01 tanh, x + c, sin) and the next state stay alive
    assert 5 * B <= p.kept_bytes <= 5 * B + slack + graph and p.tape_bytes == 4 * B
    # reversed: two gradient buffers at once on top (the adjoint seed excluded)
    assert 7 * B <= p.reverse_bytes <= 7 * B + slack + graph
    # chained: one more step adds its tape and output (its input, the first output, is saved)
    assert 5 * B <= p.chain_bytes <= 5 * B + slack + graph


FALLBACK = r"""
import json, torch
from deepsolve.memory import hostalloc
from deepsolve.memory.live import LiveBytes
hostalloc.install()
B = (1 << 16) * 8
x = torch.randn(1 << 16, dtype=torch.float64)
with LiveBytes() as lb:
    s = ((x * 2) + 1).sum()
old = torch.randn(1 << 18, dtype=torch.float64)
with LiveBytes() as lb2:
    del old
    y = torch.ones(1 << 16, dtype=torch.float64)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
    with LiveBytes() as lb3:
        torch.ones(1 << 16, dtype=torch.float64)
print(json.dumps(dict(active=hostalloc.active(), why=hostalloc.why_inactive(),
                      peak=lb.peak, end=lb.end, peak2=lb2.peak, end2=lb2.end,
                      measured3=lb3.measured)))
"""


def test_without_the_host_allocator_the_profiler_events_are_summed():
    """The fallback (no compiler, ``DEEPSOLVE_HOST_ALLOCATOR=0``): exact tensor bytes from the
    profiler's events; memory from before the window does not lower the count; a user's
    running profiler makes the window unmeasured."""
    env = dict(os.environ, DEEPSOLVE_HOST_ALLOCATOR="0")
    out = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert not r["active"] and r["why"] == "DEEPSOLVE_HOST_ALLOCATOR=0"
    assert 2 * B <= r["peak"] <= 2 * B + 64 and 0 < r["end"] <= 64
    assert r["peak2"] == r["end2"] == B
    assert r["measured3"] is False
