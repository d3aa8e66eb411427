"""The host allocator: exact live-byte counters on the CPU, and large blocks cached within a
budget's limit (the resident memory of large tensors never above the limit while the live
bytes are not), reused warm; tensors it hands out behave as any CPU tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import deepsolve
from deepsolve.memory import hostalloc
from deepsolve.memory.allocator import cache_reserve

pytestmark = pytest.mark.skipif(not hostalloc.install(), reason=f"no host allocator: "
                                f"{hostalloc.why_inactive()}")

MiB = 2**20
PAGE = 4096


@pytest.fixture
def budget_mode():
    """A limit for the test, the previous one (none) restored after."""
    yield
    hostalloc.set_limit(None)


def test_counts_every_block_at_its_size_and_rounding():
    base = hostalloc.live()
    small = torch.empty(1000, dtype=torch.uint8)  # malloc's chunk for 1000 + 64 bytes
    assert hostalloc.live() - base == (1000 + 64 + 8 + 15) // 16 * 16
    big = torch.empty(MiB, dtype=torch.uint8)
    assert MiB <= hostalloc.live() - base - 1064 <= MiB + PAGE + 128
    del small, big
    assert hostalloc.live() == base


def test_tensors_it_hands_out_behave(budget_mode):
    hostalloc.set_limit(hostalloc.live() + 64 * MiB)
    for n in (0, 1, 3, 4096, 1 << 20):
        x = torch.arange(n, dtype=torch.float64)
        assert x.data_ptr() % 64 == 0 or n == 0  # PyTorch's alignment
        y = x.clone()
        y.resize_(2 * n)  # grows through the allocator
        assert torch.equal(y[:n], x)
        assert torch.equal(torch.from_numpy(x.numpy().copy()), x)
        del x, y
    a = torch.randn(300, 300, requires_grad=True)
    (a @ a).sum().backward()
    assert torch.allclose(a.grad, (torch.ones(300, 300) @ a.T + a.T @ torch.ones(300, 300)))


def test_large_blocks_are_cached_within_the_limit_and_reused(budget_mode):
    base = hostalloc.live()
    limit = base + 24 * MiB
    hostalloc.set_limit(limit)
    s0 = hostalloc.stats()
    blocks = [torch.empty(4 * MiB // 8, dtype=torch.float64) for _ in range(4)]  # 16 MiB
    del blocks  # kept warm: live + cached stay within the limit
    s1 = hostalloc.stats()
    assert s1["cached"] == 16 * MiB and s1["live"] + s1["cached"] <= limit
    again = [torch.empty(4 * MiB // 8, dtype=torch.float64) for _ in range(4)]
    s2 = hostalloc.stats()
    assert s2["hits"] - s1["hits"] == 4 and s2["misses"] == s1["misses"] and s2["cached"] == 0
    assert s1["misses"] - s0["misses"] == 4
    # a request the cache cannot serve evicts what is cached beyond the limit first
    del again
    other = torch.empty(12 * MiB // 8, dtype=torch.float64)
    s3 = hostalloc.stats()
    assert s3["evictions"] > s2["evictions"] and s3["live"] + s3["cached"] <= limit
    del other


def test_mapped_and_cached_never_exceed_the_limit_while_live_does_not(budget_mode):
    """A random sequence of sizes and frees under a limit: after every operation the live
    bytes plus the cached ones stay within the limit whenever the live bytes alone do."""
    gen = torch.Generator().manual_seed(0)
    base = hostalloc.live()
    limit = base + 20 * MiB
    hostalloc.set_limit(limit)
    held: list[torch.Tensor] = []
    for _ in range(300):
        if held and torch.rand(1, generator=gen).item() < 0.45:
            held.pop(int(torch.randint(len(held), (1,), generator=gen)))
        elif sum(t.numel() for t in held) < 12 * MiB:
            size = int(torch.randint(64 * 1024, 3 * MiB, (1,), generator=gen))
            held.append(torch.empty(size, dtype=torch.uint8))
        s = hostalloc.stats()
        if s["live"] <= limit:
            assert s["live"] + s["cached"] <= limit, s
    held.clear()
    hostalloc.set_limit(None)
    assert hostalloc.stats()["cached"] == 0


def test_counts_are_exact_under_threads(budget_mode):
    hostalloc.set_limit(hostalloc.live() + 64 * MiB)
    base = hostalloc.live()

    def work():
        for _ in range(200):
            a = torch.randn(1 << 14)
            b = torch.randn(1 << 16)
            (a.sum() + b.sum()).item()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hostalloc.live() == base


CHILD = r"""
import json, torch, deepsolve
from deepsolve.memory import hostalloc
from deepsolve.memory.allocator import cache_reserve
torch.manual_seed(0)
w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
x0 = torch.randn(1 << 15, dtype=torch.float64, requires_grad=True)
step = lambda x, i: x + 0.01 * torch.tanh(w * x)
st = deepsolve.UnrollStats()
y = deepsolve.unroll(step, x0, 30, budget="12MiB", stats=st)
g = torch.autograd.grad(y.sum(), [x0, w])
y = x0
for i in range(30):
    y = step(y, i)
r = torch.autograd.grad(y.sum(), [x0, w])
print(json.dumps(dict(active=hostalloc.active(), why=hostalloc.why_inactive(),
                      plan=st.extra["plan"].describe(),
                      err=max(((a - b).norm() / b.norm()).item() for a, b in zip(g, r)))))
"""


def test_without_a_compiler_deepsolve_falls_back_and_stays_exact(tmp_path):
    """No C++ compiler (``CXX`` names a program that fails) and an empty cache: the allocator
    is not installed, ``why_inactive`` says why in one line, and a budgeted unroll runs on
    glibc's fixed thresholds with exact gradients."""
    env = dict(os.environ, CXX="false", DEEPSOLVE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert not r["active"] and r["why"].startswith("compiling deepsolve's host allocator")
    assert "\n" not in r["why"] and r["err"] <= 1e-10
    assert os.listdir(tmp_path) == []  # no half-written library left behind


def test_build_is_atomic_and_cached(tmp_path):
    path = hostalloc.build(tmp_path / "lib.so")
    assert path.exists() and [p.name for p in tmp_path.iterdir()] == ["lib.so"]
    assert hostalloc.library_path().name.startswith(f"hostalloc-torch{torch.__version__}")


def test_a_budgeted_unroll_sets_the_limit_to_live_plus_budget(budget_mode):
    """A checkpointed plan: the cache limited to the live bytes at the call plus the budget
    less the reserve; a plan that keeps every step (plain backpropagation): no cache."""
    torch.manual_seed(0)
    x0 = torch.randn(1 << 16, dtype=torch.float64, requires_grad=True)
    step = lambda x, i: x * 0.99 + 0.01 * torch.sin(x)  # noqa: E731
    before = hostalloc.live()
    st = deepsolve.UnrollStats()
    y = deepsolve.unroll(step, x0, 60, budget="6MiB", stats=st)
    assert st.extra["plan"].kind != "store_all"
    s = hostalloc.stats()
    assert s["limit"] == before + 6 * MiB - cache_reserve(6 * MiB)
    assert s["live"] + s["cached"] <= s["limit"]
    y.sum().backward()
    assert torch.isfinite(x0.grad).all()
    st = deepsolve.UnrollStats()
    deepsolve.unroll(step, x0, 4, budget="64MiB", stats=st)
    assert st.extra["plan"].kind == "store_all" and hostalloc.stats()["limit"] == -1
