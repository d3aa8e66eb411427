"""The engine's bytes per unit: what one snapshot, one kept tape and one link of a plain
autograd chain really hold, measured by running the engine itself on a short chain.

A budget is real memory, and at small states the bytes beside the tensors *are* the memory.
A snapshot of a 1 KiB state is also a tensor object, its storage's C++ objects, the C
library's rounding of the block, and the snapshot's record; a recorded step of 1 KiB tensors
keeps an autograd node, saved-variable records and tensor metadata for each of its ops.
Measured on a 1-D Kuramoto–Sivashinsky step with a 1 KiB state: 6.8 KiB per snapshot (a 5
KiB copy of the CPU generator's state among them, now shared while the step draws no random
numbers: :class:`~deepsolve.engine.replay.Replay`) and 25.8 KiB per kept tape whose tensors
are 14 KiB. Whatever scales with the schedule has to be counted as the engine holds it, so it
is measured by running the engine:

* ``execute`` runs a *probe* schedule on the step (called as step 0 throughout: a step may
  be defined for its own unroll's indices only): ``k`` snapshots, each stored after one
  advance, then ``m`` steps recorded and kept (``Record``) — the actions of a revolve and of
  a recorded tail — and reads what is in use after each action: the C library's in-use
  bytes (``mallinfo2``) plus the host allocator's mapped blocks
  (:func:`~deepsolve.memory.live.heap_in_use`); a second pass of the same probe reads
  the objects Python's own allocator serves (``tracemalloc``, requests of 512 bytes or less:
  the tensor objects and the records in lists and tuples, which ``malloc`` does not see;
  larger ones come from ``malloc`` and are in its count already);
* the plain loop of ``store_all`` over ``c`` recorded steps (run as an unroll of unknown
  length, whose stop condition reads after every step) gives one link of an autograd
  chain, read the same way; what the backward of the whole chain adds when it starts —
  autograd's engine keeps a record of every node of the graph it runs, a few KiB per step of
  small ops — is :data:`BACKWARD_BYTES_PER_NODE` times the step's nodes.

Per unit: the median of the later half of the differences between consecutive readings (the
first units of a code path allocate caches and grow lists that are not the units'; a tuple or
a list taken from Python's free lists is not a new allocation, and the median does not see
such luck). A
snapshot also costs what the schedule keeps of it (revolve's frames) and its entry in the
interpreter's table: :func:`bookkeeping`, measured once on a revolve of 1024 snapshots.
What is in use is not all that is resident: the C library's free holes between small
blocks and Python's partly used pools are counted by the factors :data:`HEAP_RESIDENT` and
:data:`PYMALLOC_RESIDENT`, measured on the steps of the tests (resident set against in-use
bytes over 10^3–10^4 units). The probe holds sixteen snapshots of a small state and two of a
larger one, four kept tapes and chain links of small steps, two or one of larger ones
(:func:`probe_counts`);
the planner runs it only where it holds no more than the minimum budget, or under a budget
eight times what it holds (below that few units fit, and they are estimated).

*One budget, one plan.* The probe runs in a thread of its own (:func:`in_fresh_thread`),
so the C library serves its blocks from an arena and a thread cache that this process's
history has not touched: the readings are the same in every process, to the byte. The
objects' bytes are then rounded *up* to 1/8 of their binary order of magnitude, and to
:func:`resolution` at least (see :func:`quantize`): what Python's free lists, torch's
own small blocks and the C library's reuse of a slightly larger chunk move by tens of bytes
does not move the figure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import statistics
import sys
import threading
import tracemalloc
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..engine import POOL_BELOW, Autocast, autocast_state, execute
from ..schedules import Schedule
from ..schedules.actions import Advance, Record, Reverse, Store
from . import hostalloc
from .live import heap_in_use

__all__ = ["Units", "measure_units", "quantize", "resolution", "OBJECTS_RESOLUTION",
           "probe_counts", "probe_peak", "PROBE_BYTES", "HEAP_RESIDENT", "PYMALLOC_RESIDENT",
           "python_objects", "in_fresh_thread", "bookkeeping", "backward_bytes_per_node",
           "BACKWARD_BYTES_PER_NODE"]

PROBE_BYTES = 64 * 1024
"""Units smaller than this get a second pass that traces Python's objects."""


HEAP_RESIDENT = 1 + 1 / 16
"""Resident bytes per in-use byte of the C library's small blocks (objects, small tensors):
the free holes between them. Measured: 1.03 on a kept tape of 1 KiB tensors, 0.98–1.00 on a
chain link and on 64 KiB states."""

PYMALLOC_RESIDENT = 1.5
"""Resident bytes per traced byte of Python's pooled objects (records, tensor objects):
Python's allocator keeps them in pools that they share with the step's short-lived objects,
and a pool a long-lived record pins stays resident. Measured: 1.0 on snapshot records
written one after another, about 2 on the tapes of a recorded tail in a cold unroll."""

SMALL_OBJECT = 512
"""Python's allocator serves requests up to this many bytes from its pools; larger ones go to
the C library, whose in-use count already sees them."""


def python_objects() -> int:
    """Bytes of the Python objects traced (``tracemalloc``) that Python's own allocator
    serves (requests of at most :data:`SMALL_OBJECT` bytes)."""
    return sum(t.size for t in tracemalloc.take_snapshot().traces if t.size <= SMALL_OBJECT)


_bookkeeping: int | None = None


def bookkeeping() -> int:
    """Bytes per snapshot that the schedule and the interpreter's table keep beside the
    engine's record of it: revolve's frames (measured by running ``revolve(2049, 1024)`` to
    its first reverse step) and an entry of a dict of 1024 snapshots. Measured once per
    process."""
    global _bookkeeping
    if _bookkeeping is None:
        from ..schedules import revolve

        s = 1024
        tracing = tracemalloc.is_tracing()
        collecting = gc.isenabled()
        gc.disable()  # a collection would free others' garbage between the readings
        if not tracing:
            tracemalloc.start(1)
        try:
            it = iter(revolve(2 * s + 1, s))
            before, stores = python_objects(), 0
            for a in it:
                stores += type(a) is Store
                if type(a) is Reverse:
                    break
            frames = (python_objects() - before) / max(stores, 1)
            del it
        finally:
            if not tracing:
                tracemalloc.stop()
            if collecting:
                gc.enable()
        table = sys.getsizeof({(0, i): None for i in range(s)}) / s
        _bookkeeping = quantize(PYMALLOC_RESIDENT * frames + HEAP_RESIDENT * table)
    return _bookkeeping


OBJECTS_RESOLUTION = 512
"""The coarsest step, in bytes, to which a unit's objects (what is not its tensors) are
rounded; the step is 1/16 of the binary order of the unit's tensors up to this (see
:func:`resolution`). Objects are known to a few hundred bytes between processes: the traced
pass of the Navier–Stokes closure step (an 8 KiB state) read 299–478 bytes of objects a
snapshot in fresh processes (450–720 bytes resident), in steps of 67 bytes — a small block
that torch's own ops (``reshape``, ``new_zeros``) allocate and keep in some units and not in
others, which the median over units flips between."""


def resolution(tensor_bytes: int) -> int:
    """The step for the objects beside ``tensor_bytes`` of tensors: 1/16 of their binary
    order of magnitude (at most 6.25 % of the unit), from 16 bytes to
    :data:`OBJECTS_RESOLUTION`."""
    order = math.floor(math.log2(tensor_bytes)) if tensor_bytes > 0 else 0
    return min(OBJECTS_RESOLUTION, max(16, 2 ** (order - 4)))


def quantize(nbytes: float, resolution: int = 16) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of its binary order of magnitude
    (``2**(floor(log2(x)) - 3)``, at least ``resolution`` bytes): at most 12.5 % or
    ``resolution`` bytes more (of the objects' part only: tensors are counted exactly), and
    a quantity that moves by less than a step between processes gives the same number."""
    if nbytes <= 0:
        return 0
    step = max(resolution, 2 ** (math.floor(math.log2(nbytes)) - 3))
    return int(math.ceil(nbytes / step) * step)


@dataclass(frozen=True)
class Units:
    """Bytes the engine holds per unit (tensors and everything around them) and the part of
    it that is tensors (``*_tensors``; counted by the host allocator, else estimated).

    Attributes:
        slot: one snapshot the interpreter stores (a state, its objects, its record and,
            when the step draws random numbers, the generators' state).
        kept: one recorded step kept for a later reverse (its tape, output and objects).
        link: one more step of a plain autograd chain (store-all).
        measured: whether the C library's counts were available (glibc).
        peak: the most the probe held at once (its tensors' peak, counted by the host
            allocator, and the objects of the units it held); 0 when not counted.
    """

    slot: int
    kept: int
    link: int
    slot_tensors: int
    kept_tensors: int
    link_tensors: int
    measured: bool = True
    peak: int = 0


class _Probe(Schedule):
    """``k`` snapshots after one advance each, then ``m`` kept recordings, then the Reverse
    that ends the forward sweep; ``read()`` after each unit."""

    kind = "probe"

    def __init__(self, k: int, m: int, read):
        self.n_steps = k + m
        self.slots = {0: k + 1}
        self.k, self.m, self.read = k, m, read
        self.slot_reads: list = []
        self.tape_reads: list = []

    def __iter__(self):
        k, m = self.k, self.m
        yield Store(0, 0)
        for i in range(1, k + 1):
            yield Advance(i - 1, i)
            yield Store(i, i)
            self.slot_reads.append(self.read())
        for j in range(m):
            yield Record(k + j, k + j + 1)
            self.tape_reads.append(self.read())
        yield Reverse(k + m - 1)


SINGLE_FROM = 1024 * 1024
"""Kept tapes of this size and more are measured one at a time (the first one's own
allocations are then a small part of it); smaller ones two at a time."""


def probe_counts(state_bytes: int, kept: int) -> tuple[int, int, int]:
    """``(k, m, c)``: snapshots, kept recordings and chain links of the probe — sixteen
    snapshots of a state the engine pools (rows of a block: a few bytes each beside the
    state), two of a larger one; four recordings and links of less than
    :data:`PROBE_BYTES` (the median of three differences after the first, whose own
    allocations are left out), two below :data:`SINGLE_FROM`, one from there on; two links
    of a chain at least (the first one differs: its input is a leaf)."""
    k = 16 if state_bytes < POOL_BELOW else 2
    m = 4 if kept < PROBE_BYTES else 2 if kept < SINGLE_FROM else 1
    return k, m, max(m, 2)  # a chain's first link saves less (its input is a leaf)


def probe_peak(slot: int, kept: int, link: int, state_bytes: int, working: int) -> int:
    """An estimate of what the probe holds at its most, before it ran: its snapshots and
    the kept tapes before the last (or the chain's links before the last), and the working
    set of the step being recorded beside them."""
    k, m, c = probe_counts(state_bytes, kept)
    return max(k * slot + (m - 1) * kept, (c - 1) * link) + working


def _per_unit(reads: list, before, mean: bool = False) -> tuple[float, ...]:
    """Per unit from readings after each unit (``before``: the reading before the first):
    the median of the later half of the differences between consecutive readings — the same
    units allocate the same bytes once the lists and tables around them have grown, and a
    one-off allocation among them (a cache filled) moves one difference, not the median; or
    their ``mean``, which spreads the growth of the
    interpreter's own tables (dicts of snapshots and tapes) over the units."""
    if len(reads) >= 2:
        if mean:
            return tuple((b - a) / (len(reads) - 1) for a, b in zip(reads[0], reads[-1],
                                                                  strict=True))
        later = list(zip(reads, reads[1:], strict=False))
        later = later[len(later) // 2:]  # the steady state: lists and tables grown already
        return tuple(statistics.median(b[j] - a[j] for a, b in later)
                     for j in range(len(reads[0])))
    return tuple(b - a for a, b in zip(before, reads[0], strict=True))


def _run(step, x0, params, k: int, m: int, c: int, read, policy: Any,
         mean: bool = False) -> tuple:
    """One pass: the probe and the chain, read by ``read() -> tuple``; per-unit deltas."""
    probe = _Probe(k, m, read)
    collecting = gc.isenabled()
    gc.disable()  # a collection in the middle would free others' garbage between readings
    try:
        if any(t.device.type == "cuda" for t in pytree.tree_leaves(x0)):  # read from CUDA
            return _probe_and_chain(step, x0, params, k, m, c, read, policy, mean, probe)
        return in_fresh_thread(_probe_and_chain, step, x0, params, k, m, c, read, policy,
                                mean, probe)
    finally:
        if collecting:
            gc.enable()


def _load_trim():
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


_trim = _load_trim()


_inside = threading.local()  # set in a measuring thread: nested calls run in it
_parked: list[threading.Event] = []
PARKED = 8
"""Measuring threads kept (idle) after their measurement, so that their malloc arenas are
never handed to a later thread; beyond these, threads exit and later measurements may take
over an arena with a history (their figures can then differ by a few bytes per unit)."""


def in_fresh_thread(fn, *args):
    """``fn(*args)`` in a new thread (autocast settings carried over, exceptions re-raised;
    called from inside such a thread, it runs there).

    The C library gives a new thread a malloc arena and a thread cache of its own, so what
    the measured blocks cost does not depend on the free blocks this process's history left
    in the main thread's arena — which differ between processes (the order of frees follows
    object addresses). An arena of an exited thread would be handed to the next new thread
    with its own history, so a measuring thread is kept, idle, after its work (up to
    :data:`PARKED` of them, their free pages given back with ``malloc_trim``): each
    measurement starts from an arena that has served nothing else, and its figures are the
    same in every process. A parked thread holds nothing of the work it did (not ``fn``, its
    arguments or its result), so the step it measured and what the step closes over are
    freed with their last reference."""
    if getattr(_inside, "active", False):
        return fn(*args)
    out: list = []
    done = threading.Event()
    release = threading.Event()
    autocast = autocast_state()  # thread-local in PyTorch: carried over
    park = len(_parked) < PARKED

    job = [fn, args]  # taken by the thread: a parked thread keeps nothing of the step

    def run() -> None:
        _inside.active = True
        f, a = job
        job.clear()
        try:
            with Autocast(autocast):
                out.append((True, f(*a)))
        except BaseException as e:  # re-raised in the caller
            out.append((False, e))
        del f, a
        done.set()
        if park:
            if _trim is not None:
                _trim(0)  # the arena's free pages back to the system
            release.wait()

    t = threading.Thread(target=run, name="deepsolve-measure", daemon=True)
    t.start()
    done.wait()
    if park:
        _parked.append(release)
    else:
        t.join()
    ok, value = out.pop()
    if not ok:
        raise value
    return value


def _probe_and_chain(user_step, x0, params, k, m, c, read, policy, mean, probe) -> tuple:
    def step(x, i):  # every unit is step 0: a step may be defined for its unroll's i < n only
        return user_step(x, 0)

    with torch.enable_grad():
        # a probe, not the trajectory: the step is run again and again from x_0 as step 0
        y = execute(step, x0, probe, params=params, policy=policy, watch_finite=False)
        del y  # the run and everything it holds go with the result
        chain: list = []

        def links(state, i: int) -> bool:  # the plain loop asks after every step
            chain.append(read())
            return i >= c

        leaves = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex())
                  for t in pytree.tree_leaves(x0)]
        xg = pytree.tree_unflatten(leaves, pytree.tree_structure(x0))
        y = execute(step, xg, None, until=links, params=params, policy=policy,
                    watch_finite=False)
        del y
    slot = _per_unit(probe.slot_reads, probe.slot_reads[0], mean)
    kept = _per_unit(probe.tape_reads, probe.slot_reads[-1], mean)
    link = _per_unit(chain[1:], chain[0], mean)
    return slot, kept, link


BACKWARD_BYTES_PER_NODE = 128
"""What autograd's engine keeps per node of a graph it runs, from the start of a backward:
its dependency count and, for ``torch.autograd.grad``, what to capture, in hash tables that
grow with the graph. Measured at the first hook of the backward of long chains: 143–146
bytes a node of the C library's in-use count over 10^3–4·10^3 small products; 65–100 bytes of
resident memory a node over 10^4 steps of the Kuramoto–Sivashinsky step of the tests. A
chain reversed whole (store-all) pays it per node on top of its links; a constant rather
than a measurement because the tables grow in steps, so that a short calibration chain
misjudges a long one."""


def backward_bytes_per_node() -> int:
    """:data:`BACKWARD_BYTES_PER_NODE`."""
    return BACKWARD_BYTES_PER_NODE


def measure_units(step, state, params, state_bytes: int, kept_estimate: int,
                  policy: Any = None, device: torch.device | None = None) -> Units:
    """Measure :class:`Units` for ``step`` on ``state`` (a pytree of tensors; leaves that
    are floating point require grad for the recordings). ``kept_estimate`` sizes the probe
    (the tensors a recorded step keeps). ``policy``: record kept tapes and the chain under
    this recomputation policy (the snapshots do not depend on it). On a CUDA ``device`` the
    budget is device memory: the units are read from CUDA's allocator (tensors only)."""
    k, m, c = probe_counts(state_bytes, kept_estimate)
    if device is not None and device.type == "cuda":
        def cuda() -> tuple[int, int]:
            torch.cuda.synchronize(device)
            now = torch.cuda.memory_allocated(device)
            return now, now

        slot, kept, link = _run(step, state, params, k, m, c, cuda, policy)
        s_, k_, l_ = (int(math.ceil(u[0])) for u in (slot, kept, link))
        return Units(s_, k_, l_, s_, k_, l_)
    counted = hostalloc.active()
    if heap_in_use() is None:  # no glibc: tensors only, as the allocator counts them
        return Units(state_bytes, kept_estimate, kept_estimate, state_bytes, kept_estimate,
                     kept_estimate, measured=False)

    def heap() -> tuple[int, int]:
        return heap_in_use() or 0, hostalloc.live()

    start = hostalloc.live()
    hostalloc.reset_peak()
    slot, kept, link = _run(step, state, params, k, m, c, heap, policy)
    tensor_peak = hostalloc.peak() - start
    python = (0.0,), (0.0,), (0.0,)
    small = min(state_bytes, kept_estimate) < PROBE_BYTES
    if small:  # Python's objects matter beside small tensors: a second pass, traced
        tracing = tracemalloc.is_tracing()
        if not tracing:
            tracemalloc.start(1)
        try:
            python = _run(step, state, params, k, m, c, lambda: (python_objects(),), policy)
        finally:
            if not tracing:
                tracemalloc.stop()

    def unit(h: tuple, py: tuple, tensors_fallback: int, beside: int = 0,
             size: int | None = None) -> tuple[int, int]:
        total, tensors = h
        if not counted:
            tensors = tensors_fallback
        objects = HEAP_RESIDENT * max(total - tensors, 0) + PYMALLOC_RESIDENT * max(py[0], 0)
        step = resolution(int(tensors) if size is None else size)
        return int(tensors) + quantize(objects + beside, step), int(tensors)

    # a snapshot also costs what the schedule and the interpreter's table keep of it
    s, s_t = unit(slot, python[0], state_bytes, bookkeeping(), size=state_bytes)
    if state_bytes < POOL_BELOW:  # the engine packs small states into its snapshot pool:
        # a block of rows allocated before the readings, so a snapshot is its state's bytes
        # in a row plus what the differences saw (its record, the objects around it and the
        # random generators' state when the step draws random numbers)
        s, s_t = state_bytes + s, state_bytes + s_t
    kk, k_t = unit(kept, python[1], kept_estimate)
    ln, l_t = unit(link, python[2], kept_estimate)
    peak = 0
    if counted:  # the tensors' peak, and the objects of the units held beside them
        peak = tensor_peak + max(k * (s - s_t), m * (kk - k_t), c * (ln - l_t))
    return Units(s, kk, ln, s_t, k_t, l_t, peak=peak)
