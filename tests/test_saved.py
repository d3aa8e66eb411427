"""deepsolve.memory.SavedTensors: the one saved-tensor meter, on graphs whose saved tensors
are known exactly."""

from __future__ import annotations

import gc
import weakref

import torch

from deepsolve.memory import SavedTensors
from deepsolve.memory.meter import MemoryMeter

F64 = torch.float64
KB8 = 1000 * 8  # a float64 vector of 1000


def test_counts_known_saved_tensors_once_per_storage_not_leaves_and_frees_them():
    a = torch.randn(1000, dtype=F64, requires_grad=True)
    c = torch.randn(500, dtype=F64)
    with SavedTensors() as s:
        h = a.sin()                          # saves a: a leaf requiring grad, not counted
        assert s.live == 0
        p = h * h                            # saves h twice: one storage
        assert s.live == KB8
        v = h[:500] * h[500:]                # two views of h: still that storage
        assert s.live == KB8
        q = h[:500] * c                      # saves c only (h's view is not needed)
        assert s.live == KB8 + 500 * 8
        loss = p.sum() + v.sum() + q.sum()
        del h, p, v, q
        assert s.live == s.peak == KB8 + 500 * 8 and s.packed == s.live
        loss.backward()                      # the graph frees its saved tensors
        assert s.live == 0
    assert s.peak == KB8 + 500 * 8           # the peak is kept
    assert torch.allclose(a.grad, (2 * a.sin() + torch.cat([a.sin()[500:], a.sin()[:500]])
                                   + torch.cat([c, torch.zeros(500, dtype=F64)])) * a.cos())


def test_a_graph_dropped_without_backward_is_freed_no_cycle():
    a = torch.randn(1000, dtype=F64, requires_grad=True)
    with SavedTensors() as s:
        h = torch.tanh(a * 2)                # tanh saves its own output
        alive = weakref.ref(h)
        assert s.live == KB8
        del h
        assert alive() is None               # freed at once: the hook holds no cycle
        assert s.live == 0
        gc.collect()
        assert s.live == 0 and s.peak == KB8


def test_skip_record_and_on_grow():
    x = torch.randn(1000, dtype=F64)
    w = torch.randn(1000, dtype=F64, requires_grad=True)
    grown = []
    s = SavedTensors(skip={SavedTensors.key(x)[0]}, record=True,
                     on_grow=lambda: grown.append(s.live))
    with s:
        y = x * w                            # saves x: skipped by its storage
        y2 = x[:10] * w[:10]                 # a view of x: skipped too
        z = (w * 3).exp()                    # saves its output
        assert s.live == KB8
        (y.sum() + y2.sum() + z.sum()).backward()
    assert s.live == 0 and grown == [KB8]
    key, nbytes = SavedTensors.key(z)
    assert s.seen == {key: nbytes} and nbytes == KB8  # recorded, though freed


_I, _V = torch.tensor([[0, 1, 2], [2, 0, 1]]), torch.ones(3, dtype=F64)


def _sparse():  # a tensor without storage (its numel: 30 * 40)
    return torch.sparse_coo_tensor(_I, _V, (30, 40), check_invariants=True)


def test_tensors_without_storage_by_numel_and_their_id_is_not_reused():
    w = torch.randn(40, 5, dtype=F64, requires_grad=True)
    key, nbytes = SavedTensors.key(s0 := _sparse())
    assert key == ("tensor", id(s0)) and nbytes == 30 * 40 * 8
    with SavedTensors() as s:
        ys = [torch.sparse.mm(_sparse(), w) for _ in range(4)]  # each saves its own sparse
        assert s.live == 4 * nbytes          # the dead matrices' ids are not reused
        sum(y.sum() for y in ys).backward()
        assert s.live == 0


class _Stats:
    snapshot_bytes_peak = 0


def test_memory_meter_samples_its_total_whenever_the_saved_bytes_grow():
    """Snapshots stored while fewer bytes are saved than at the saved peak still make a
    total peak: 8000 saved, freed, 5000 of snapshots, then 4000 saved -> 9000."""
    a = torch.randn(1000, dtype=F64, requires_grad=True)
    st = _Stats()
    with MemoryMeter("cpu", stats=st, extra_bytes=10) as m:
        (a.exp() * 1.0).sum().backward()     # exp saves its output: 8000
        assert m.saved_live == 0 and m.saved_peak == KB8
        st.snapshot_bytes_peak = 5000
        b = a[:500]
        (b.exp() * 1.0).sum().backward()     # 4000
    assert m.saved_peak == KB8
    assert m.tracked_peak == 4000 + 5000 + 10
