"""The C library's heap under a CPU budget: the host allocator, or glibc's thresholds fixed.

:func:`hold_to_budget` prepares the process for a CPU budget: it installs deepsolve's host
allocator (:mod:`deepsolve.memory.hostalloc`) and sets its limit to the live bytes plus the
budget, so large blocks are cached within the budget and reused warm; where the allocator
cannot be built (no C++ compiler, no glibc, ``DEEPSOLVE_HOST_ALLOCATOR=0``) it falls back to
fixing glibc's thresholds, described below — the bound without the reuse.

PyTorch's CPU tensors come from ``malloc``. glibc serves a large request with its own
``mmap`` (returned to the system by ``free``) only above the *mmap threshold*, and that
threshold is dynamic: each time a large mmapped block is freed, glibc raises the threshold to
its size (up to 32 MiB on 64-bit systems), so from then on blocks of that size come from the
heap, and freed heap memory stays resident until it happens to lie at the top of the heap.
An unroll that frees and allocates state-sized tensors at every step then grows the process's
resident set (RSS) far beyond the bytes it holds: measured here, a 4 MiB float64 state under
``budget=64MiB`` held 80 MiB of live tensors at its peak but reached 639 MiB of RSS with the
default settings, and 82 MiB with the thresholds fixed.

:func:`return_freed_memory` fixes the thresholds through ``mallopt`` (what the environment
variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` do at start-up): blocks of
64 KiB and more are mmapped and unmapped on free, so RSS follows the live bytes. The planner
calls it once per process when a budget is given for a CPU unroll (``deepsolve.plan``,
``unroll(..., budget=...)``), because that is when RSS must stay inside the budget.

The price is a page fault per fresh page: a freed block is not reused warm, so each new
tensor of 64 KiB or more is zero-filled by the kernel on first touch (measured in
docs/benchmarks.md). Opt out with the environment variable ``DEEPSOLVE_MALLOPT=0``; it is
also left alone when ``MALLOC_MMAP_THRESHOLD_`` is set (your own choice wins), and on systems
without glibc (macOS, musl), where it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from . import hostalloc

__all__ = ["return_freed_memory", "hold_to_budget", "release_budget", "cache_reserve",
           "MMAP_THRESHOLD"]

MMAP_THRESHOLD = 64 * 1024
"""Bytes from which glibc serves a block with its own mapping once the thresholds are fixed."""

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3

_done: bool | None = None


def return_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds (64 KiB, 128 KiB) so that freed tensor memory goes
    back to the system; once per process. Returns whether the thresholds are fixed (by this
    call, an earlier one, or ``MALLOC_MMAP_THRESHOLD_`` in the environment); ``False`` where
    glibc is absent or ``DEEPSOLVE_MALLOPT=0``."""
    global _done
    if _done is not None:
        return _done
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        _done = True
        return _done
    if os.environ.get("DEEPSOLVE_MALLOPT", "1").strip().lower() in ("0", "false", "no", "off"):
        _done = False
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        _done = False
        return _done
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD))
    return _done


def cache_reserve(nbytes: int) -> int:
    """What the host allocator's cache leaves of a budget of ``nbytes`` to memory it does
    not govern — the C library's heap of small blocks and objects, Python's pools, what a
    first call loads: 1/32 of the budget, at least 1 MiB."""
    return min(int(nbytes), max(int(nbytes) // 32, 2**20))


def hold_to_budget(nbytes: int) -> str:
    """Prepare the process for a CPU call that may add ``nbytes`` at its peak: the host
    allocator with its cache limited to the live bytes now plus ``nbytes`` less
    :func:`cache_reserve` (the cache is emptied first: live large blocks are never refused,
    only cached ones given back), or glibc's thresholds fixed where the allocator is
    unavailable. Returns what holds the heap: ``"host allocator"``, ``"glibc thresholds"``
    or ``"nothing"``."""
    if hostalloc.install():
        hostalloc.set_limit(hostalloc.live() + int(nbytes) - cache_reserve(nbytes))
        return "host allocator"
    return "glibc thresholds" if return_freed_memory() else "nothing"


def release_budget() -> None:
    """No budget to hold (a plan that keeps every step, as plain backpropagation does): the
    host allocator's cache emptied and large blocks left to the C library, so the process
    behaves as it would without deepsolve."""
    hostalloc.set_limit(None)
