"""Live bytes: what a block of code allocates and still holds, at its peak and at marks.

``with LiveBytes(device) as lb: ...; k = lb.mark(); ...`` gives ``lb.peak`` — the most bytes
allocated inside the block and alive at one moment — ``lb.end`` (alive when it exits),
``lb.at(k)`` (alive at mark ``k``) and ``lb.peak_until(k)``. Memory that existed before the
block is not counted, and freeing it does not lower the count, so the numbers are what the
block adds on top of whatever it found.

How it is observed:

* **CUDA**: the caching allocator's own counters, ``torch.cuda.memory_allocated`` and
  ``max_memory_allocated`` (reset on entry).
* **CPU, with deepsolve's host allocator** (:mod:`deepsolve.memory.hostalloc`, installed by
  the profile): its counters, the same way — every CPU tensor block it hands out, counted at
  its usable size (the request plus the C library's rounding). Free of cost and of memory.
* **CPU, without it** (no C++ compiler, ``DEEPSOLVE_HOST_ALLOCATOR=0``): PyTorch's CPU
  allocator reports every allocation and free (pointer, size, time) to the profiler when
  memory profiling is on; this is what ``torch.profiler.profile(profile_memory=True)``
  records. The block runs under that profiler (CPU activity only, no stacks or shapes) and
  the events are summed in time order to the running total of live bytes, keeping only
  frees of blocks allocated inside the window. Cost: about a millisecond to start and stop,
  a few microseconds per allocation, and about 3 MiB resident after its first start. Marks
  are one-byte sentinel allocations whose pointers identify their event in the stream.

This sees the step's *working set* — the temporaries of its forward, the gradient buffers
of its backward, the im2col buffers of a convolution, the complex intermediates of an FFT —
which ``saved_tensors_hooks`` (tensors kept for backward) cannot see. It sees tensor memory
only: Python objects and the C++ objects around tensors are not counted, nor freed memory
that the C library keeps in its heap (see :mod:`deepsolve.memory.allocator`).

With the counters (CUDA, the host allocator), memory from before the window that is freed
inside it lowers the count, as ``torch.cuda.memory_allocated`` does. Without them, when the
profiler is already running (a user profiling their own job), the CPU window cannot nest;
``lb.measured`` is then ``False`` and every figure is 0, and callers fall back to an
estimate.

Beside the tensors, :func:`heap_in_use` reads the C library's own count: the bytes ``malloc``
has handed out (glibc's ``mallinfo2``), tensors *and* the C++ objects around them — autograd
graph nodes, saved-variable records, tensor metadata — plus the host allocator's mapped
blocks, which ``malloc`` does not see. A recorded step of the Navier–Stokes benchmark keeps
about 140 KiB of such objects beside its tensors. Without the host allocator, read it
outside a ``LiveBytes`` window: the profiler's own event records come from ``malloc`` too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from typing import cast

import torch

from . import hostalloc

__all__ = ["LiveBytes", "heap_in_use"]


class LiveBytes:
    """See the module docstring. ``device``: where the tensors of interest live."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak = 0
        self.end = 0
        self.measured = False
        self._marks: list = []
        self._at: list[int] = []
        self._peak_at: list[int] = []
        self._cfg = None
        self._counters = False
        self._base = 0

    # -- counters: CUDA's allocator, or the host allocator on the CPU -------------------------
    def _now(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.memory_allocated(self.device) - self._base,
                    torch.cuda.max_memory_allocated(self.device) - self._base)
        return hostalloc.live() - self._base, hostalloc.peak() - self._base

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> LiveBytes:
        self._counters = self.device.type == "cuda" or hostalloc.active()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.measured = True
            return self
        if self._counters:
            self._base = hostalloc.live()
            hostalloc.reset_peak()
            self.measured = True
            return self
        self._cfg = _start_profiler()
        self.measured = self._cfg is not None
        return self

    def mark(self) -> int:
        """Remember this moment; returns the mark's index for :meth:`at`/:meth:`peak_until`."""
        k = len(self._marks)
        if self._counters:
            live, peak = self._now()
            self._marks.append(None)
            self._at.append(live)
            self._peak_at.append(peak)
        else:
            self._marks.append(torch.empty(1, dtype=torch.uint8))  # its allocation event
        return k

    def at(self, k: int) -> int:
        """Bytes allocated inside the window and alive at mark ``k``."""
        return self._at[k]

    def peak_until(self, k: int) -> int:
        """The most bytes alive at one moment between entry and mark ``k``."""
        return self._peak_at[k]

    def __exit__(self, *exc) -> None:
        if self._counters:
            self.end, self.peak = self._now()
            self.peak = max(self.peak, self.end)
            return
        if self._cfg is None:
            self._at = [0] * len(self._marks)
            self._peak_at = [0] * len(self._marks)
            return
        events = _stop_profiler()
        sentinels = {t.data_ptr(): k for k, t in enumerate(self._marks)}
        self._at = [0] * len(self._marks)
        self._peak_at = [0] * len(self._marks)
        live = peak = 0
        mine: set[int] = set()
        for _, size, ptr, dev in events:
            if dev != "cpu":
                continue
            if size > 0:
                k = sentinels.pop(ptr, None) if size == 1 else None
                if k is not None:  # a mark: the sum just before it, earlier marks' bytes out
                    self._at[k], self._peak_at[k] = live - k, peak
                mine.add(ptr)
            elif ptr in mine:
                mine.discard(ptr)
            else:  # memory from before the window: freeing it is not ours to count
                continue
            live += size
            if live > peak:
                peak = live
        self.peak, self.end = peak, live - (len(self._marks) - len(sentinels))
        self._marks.clear()


_primed = False


def _start_profiler():
    """Start PyTorch's profiler with CPU memory events only; ``None`` if it cannot start."""
    try:
        from torch._C._profiler import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            _ExperimentalConfig,
        )
        from torch.autograd import _enable_profiler, _prepare_profiler, _profiler_enabled

        if _profiler_enabled():  # a user's profiler is running: the window cannot nest
            return None
        # (state, record_shapes, profile_memory, with_stack, with_flops, with_modules, exp.)
        cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                             _ExperimentalConfig())
        acts = {ProfilerActivity.CPU}
        global _primed
        primer = None if _primed else torch.empty(1, dtype=torch.uint8)
        with _quiet_stderr():  # Kineto prints a line at every start and stop
            _prepare_profiler(cfg, acts)
            _enable_profiler(cfg, acts)
            # freeing a block from before the window makes the allocator warn, once per
            # process ("Memory block of unknown size..."); have it say so here, silenced
            del primer
            _primed = True
        return cfg
    except (ImportError, AttributeError, RuntimeError, TypeError):  # pragma: no cover
        return None


def _stop_profiler() -> list[tuple[int, int, int, str]]:
    """Stop the profiler; its allocation events as ``(time_ns, bytes, ptr, device type)``,
    frees with negative bytes, in time order."""
    from torch._C._profiler import _EventType, _ExtraFields_Allocation
    from torch.autograd import _disable_profiler

    with _quiet_stderr():
        result = _disable_profiler()
    events = []
    todo = list(result.experimental_event_tree())
    alloc = _EventType.Allocation
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == alloc:
            f = cast(_ExtraFields_Allocation, e.extra_fields)  # the tag says which
            events.append((e.start_time_ns, f.alloc_size, f.ptr, f.device.type))
    # time order; at an equal time a free first (a pointer is freed before it is reused)
    events.sort(key=lambda e: (e[0], e[1] > 0))
    return events


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ logging) for the duration of the block."""
    try:
        saved = os.dup(2)
    except OSError:  # pragma: no cover - no stderr
        yield
        return
    try:
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _load_mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_mallinfo2 = _load_mallinfo2()


def heap_in_use() -> int | None:
    """Bytes glibc's ``malloc`` has handed out and not taken back (``mallinfo2``: in-use heap
    blocks plus mapped blocks, all arenas) plus the host allocator's mapped blocks, or
    ``None`` without glibc. It walks the heap's
    free lists, so it takes microseconds to milliseconds: for measurements, not hot paths."""
    if _mallinfo2 is None:
        return None
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd) + hostalloc.mapped()
