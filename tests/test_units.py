"""The engine's bytes per unit (a snapshot, a kept tape, a link of a plain chain): measured on a
short probe, they are what the engine holds per unit at scale, the same in every process, and
they count the objects around small tensors; the snapshot pool and the shared RNG state make
small-state snapshots cheap without changing a gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import rel_strict as rel

import deepsolve
from deepsolve.engine import Replay, SnapshotPool
from deepsolve.memory import hostalloc, profile_step
from deepsolve.memory.live import heap_in_use
from deepsolve.memory.units import OBJECTS_RESOLUTION, quantize, resolution

DT = torch.float64
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "data"))
from real_peak import build  # noqa: E402

pytestmark = pytest.mark.skipif(not hostalloc.install() or heap_in_use() is None,
                                reason="needs the host allocator and glibc's counters")


def test_quantize_rounds_up_by_at_most_an_eighth():
    last = 0
    for x in list(range(1, 5000, 7)) + [10**6 + 3, 2**30 - 1]:
        q = quantize(x)
        assert x <= q <= max(x * 9 / 8, x + 16) and q >= last
        last = q
    assert quantize(1000) == quantize(1001) and quantize(0) == 0
    for tensors in (0, 100, 1024, 8192, 10**6):  # objects beside tensors: a coarser floor
        step, last = resolution(tensors), 0
        assert step <= max(16, tensors / 16) and step <= OBJECTS_RESOLUTION
        for x in range(1, 5000, 7):
            q = quantize(x, step)
            assert x <= q <= max(x * 9 / 8, x + step) and q % step == 0 and q >= last
            last = q
    assert quantize(600, resolution(8192)) == quantize(1000, resolution(8192)) == 1024


SCALE = r"""
import ctypes, gc, json, sys
sys.path.insert(0, sys.argv[1])
from real_peak import build
import deepsolve
from deepsolve.memory import hostalloc, profile_step
from deepsolve.memory.meter import process_status
kind, unit, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
step, x0, _ = build(kind)
p = profile_step(step, x0)
model = {"slot": p.slot_bytes, "kept": p.kept_bytes, "link": p.chain_bytes}[unit]
schedule, n = {"slot": (deepsolve.Revolve(count), count + 1),
               "kept": (deepsolve.RevolveTail(2, count), count + 2),
               "link": ("store_all", count)}[unit]
gc.collect()
hostalloc.set_limit(hostalloc.live() + 2**34)  # as under a budget: large blocks mapped
ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages returned: what is touched counts
before = process_status("VmRSS:")
y = deepsolve.unroll(step, x0, n, schedule=schedule)
real = process_status("VmRSS:")
if unit == "link":  # a chain is held for its backward, which adds its record of the nodes
    seen = []
    y.register_hook(lambda g: seen.append(process_status("VmRSS:")))
    y.sum().backward()
    real = seen[0]
print(json.dumps({"model": model, "real": (real - before) / count}))
"""


@pytest.mark.parametrize("unit", ["slot", "kept", "link"])
@pytest.mark.parametrize("kind, count", [("ks", 10_000), ("ks64", 300)])
def test_units_are_what_the_engine_holds_at_scale(kind, count, unit):
    """The resident memory per snapshot of a revolve, per tape of a recorded tail or per
    link of a store-all chain (with what its backward adds when it starts), a few hundred
    to a few thousand of them in a fresh process (large blocks mapped as under a budget, the
    heap's free pages returned first, so that what the unroll touches is what it costs): the
    probe's unit (what the planner prices schedules with) is within -5 % and +20 % of it —
    never much below, so a budget holds, and not far above, so it is used."""
    out = subprocess.run([sys.executable, "-c", SCALE, os.path.join(HERE, "data"), kind, unit,
                          str(count)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.95 * r["real"] <= r["model"] <= 1.2 * r["real"], r
    if kind == "ks" and unit == "kept":  # at 1 KiB the objects are most of a kept tape
        step, x0, _ = build(kind)
        p = profile_step(step, x0)
        assert p.kept_bytes > 4 * p.tensors_kept


UNITS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from real_peak import build
from deepsolve.memory import hostalloc, profile_step
hostalloc.install()
rows = {}
for kind in ("ks", "ks64", "spectral-small"):
    step, x0, _ = build(kind)
    p = profile_step(step, x0)
    rows[kind] = [p.slot_bytes, p.kept_bytes, p.chain_bytes, p.reverse_bytes, p.advance_bytes,
                  p.profile_peak]
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_the_units_are_the_same_in_every_process():
    """Three fresh processes with different hash seeds (and so different orders of frees in
    the C library's main arena) measure the same bytes to the byte, for each of three steps
    profiled one after the other."""
    seen = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", UNITS, os.path.join(HERE, "data")],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.add(out.stdout.strip().splitlines()[-1])
    assert len(seen) == 1, seen
    assert len(json.loads(seen.pop())) == 3


def test_the_probe_calls_the_step_as_step_zero():
    """A step defined only for its unroll's indices (a reference trajectory of one step)
    profiles: the probe's many steps are all step 0."""
    ref = torch.randn(2, 64, dtype=DT)
    w = torch.tensor(0.5, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + w * (ref[i + 1] - x)  # defined for i = 0 only

    p = profile_step(step, torch.zeros(64, dtype=DT), cache=False)
    assert p.units_measured
    y = deepsolve.unroll(step, torch.zeros(64, dtype=DT), 1, budget="4MiB")
    assert torch.allclose(y, w.detach() * ref[1])


def test_rng_state_is_shared_while_the_generator_does_not_move():
    r = Replay([], True)
    a = r.capture()
    assert r.capture() is a  # a deterministic step: one state for every snapshot
    torch.rand(3)
    b = r.capture()
    assert b is not a and r.capture() is b
    assert Replay([], False).capture() is None


def test_profile_detects_random_draws_and_prices_their_state():
    x0 = torch.randn(256, dtype=DT)
    w = torch.tensor(0.9, dtype=DT, requires_grad=True)
    plain = profile_step(lambda x, i: w * torch.tanh(x), x0, cache=False)
    noisy = profile_step(lambda x, i: w * torch.tanh(x) + 1e-3 * torch.randn_like(x), x0,
                         cache=False)
    assert not plain.draws_random and noisy.draws_random
    # each snapshot of the stochastic step keeps the CPU generator's state (5 KiB)
    assert noisy.slot_bytes - plain.slot_bytes >= torch.get_rng_state().numel()


@pytest.mark.parametrize("schedule", [dict(snapshots=3), dict(snapshots=7),
                                      dict(schedule=deepsolve.RevolveTail(3, 4)),
                                      dict(budget="2MiB")])
def test_small_state_snapshots_in_the_pool_give_exact_gradients(schedule):
    """A small state (pooled snapshots) with a stochastic step under several schedules: the
    gradients of plain autograd (the random draws replayed from the shared or kept states)."""
    torch.manual_seed(3)
    w = torch.tensor(0.8, dtype=DT, requires_grad=True)
    x0 = torch.randn(32, dtype=DT, requires_grad=True)

    def step(x, i):
        noise = torch.randn_like(x) if i % 3 == 0 else 0.0  # draws at some steps only
        return x + 0.1 * torch.tanh(w * x) + 0.01 * noise

    def plain():
        torch.manual_seed(7)
        y = x0
        for i in range(20):
            y = step(y, i)
        return torch.autograd.grad((y**2).sum(), [x0, w])

    ref = plain()
    torch.manual_seed(7)
    y = deepsolve.unroll(step, x0, 20, **schedule)
    got = torch.autograd.grad((y**2).sum(), [x0, w])
    for a, b in zip(got, ref, strict=True):
        assert rel(a, b) <= 1e-12


def test_snapshot_pool_reuses_rows_and_restores_copies():
    pool = SnapshotPool([((4,), DT, torch.device("cpu"))], rows=2)
    a, b, c = (torch.full((4,), float(v), dtype=DT) for v in (1, 2, 3))
    ra, rb = pool.put([a], 1), pool.put([b], 2)
    rc = pool.put([c], 3)  # a second block
    assert len(pool.blocks) == 2 and {ra, rb, rc} == {0, 1, 2}
    out = pool.get(rb)[0]
    pool.drop(rb)
    assert pool.put([c], 4) == rb  # the freed row is reused
    assert torch.equal(out, b)  # the restored copy is not the row
    with pytest.raises(ValueError, match=r"step 4 changed state leaf 0: it returned \(5,\)"):
        pool.put([torch.zeros(5, dtype=DT)], 5)
