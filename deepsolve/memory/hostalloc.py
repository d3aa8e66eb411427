"""deepsolve's host allocator: exact live bytes on the CPU, and large blocks cached within a budget.

PyTorch's CPU tensors come from the C library's ``malloc`` and it keeps no counters, so a
CPU budget has two problems that CUDA's caching allocator does not have:

* **what is live** cannot be read: the profile of a step had to run PyTorch's profiler to
  see allocation events (about 3 MiB resident after its first start, milliseconds per
  window);
* **what is resident** drifts from what is live: glibc serves state-sized blocks from its
  heap once its dynamic mmap threshold has risen, and a heap that serves snapshots,
  temporaries and tapes of one size fragments — measured here, an unroll holding 240 MiB of
  live tensors kept a 420–520 MiB heap. Fixing glibc's thresholds so that every large
  block is its own mapping (``mallopt``, :mod:`deepsolve.memory.allocator`) bounds the
  resident set but costs a fresh zero-filled page per page of every new tensor: 3.3× the CPU
  time of the unroll with glibc's defaults on a pointwise step (14.6 s against 4.4 s, system
  time 10 s), 1.4–2.3× on a convolutional one.

This module installs a small C++ allocator (``_hostalloc.cpp``, compiled on first use with
the system's C++ compiler against the installed PyTorch's headers and cached under
``~/.cache/deepsolve``) as PyTorch's CPU allocator. It

* counts the usable size of every block it hands out (``malloc_usable_size``: the request
  plus the C library's rounding) — :func:`live` and :func:`peak`, the CPU counterpart of
  ``torch.cuda.memory_allocated``/``max_memory_allocated``;
* under a budget (:func:`set_limit`), maps blocks of 64 KiB and more as whole pages and keeps
  a freed one in a cache keyed by its size class as long as the live bytes plus the cached
  bytes stay within the limit; the next request of that size (up to a quarter larger) gets
  it back warm. Large-tensor memory never exceeds the limit while the live bytes do not,
  and a step that allocates the same sizes at every step reuses its pages — measured in
  docs/benchmarks.md: the CPU time of glibc's defaults with the bound of fixed thresholds;
* below 64 KiB, and for every size outside a budget, gets its blocks from ``malloc``
  exactly as PyTorch's default allocator does, and still reports every allocation and free
  to PyTorch's profiler.

The budget layer calls :func:`set_limit` at the start of each budgeted CPU call with
``live() + budget``: the cache is emptied first, so the resident set a call starts from
holds no cached blocks, and it stays bounded by the limit afterwards.
:func:`install` returns ``False`` — and deepsolve falls back to the profiler and to fixed
glibc thresholds — where there is no C++ compiler, no glibc (macOS), or when the
environment variable ``DEEPSOLVE_HOST_ALLOCATOR=0`` is set.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["install", "active", "live", "peak", "mapped", "reset_peak", "set_limit", "stats",
           "mapping",
           "library_path", "build", "BIG_FROM", "why_inactive"]

BIG_FROM = 64 * 1024
"""Bytes from which a block is mapped and cached under a budget."""

_SOURCE = Path(__file__).with_name("_hostalloc.cpp")
_lib: ctypes.CDLL | None = None
_tried = False
_why = ""


def _cache_dir() -> Path:
    root = os.environ.get("DEEPSOLVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "deepsolve")
    return Path(root)


def _flags() -> tuple[list[str], str]:
    import torch

    root = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{root / 'include'}", f"-L{root / 'lib'}", "-lc10",
             f"-Wl,-rpath,{root / 'lib'}"]
    return flags, torch.__version__


def library_path() -> Path:
    """Where the compiled allocator for this PyTorch and this source lives."""
    flags, version = _flags()
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return _cache_dir() / f"hostalloc-torch{version}-{tag}-{key}.so"


def build(path: Path | None = None) -> Path:
    """Compile ``_hostalloc.cpp`` into ``path`` (default :func:`library_path`); atomic, so
    processes that build at the same moment do not see a half-written file. Raises
    ``RuntimeError`` with the compiler's last line when it fails. ``make`` builds it ahead
    of use: ``python -c "from deepsolve.memory import hostalloc; hostalloc.build()"``."""
    path = library_path() if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    flags, _ = _flags()
    cxx = os.environ.get("CXX", "c++")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        out = subprocess.run([cxx, str(_SOURCE), "-o", tmp, *flags], capture_output=True,
                             text=True, timeout=300)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"compiling deepsolve's host allocator failed: {last}")
        os.replace(tmp, path)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"compiling deepsolve's host allocator failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def install() -> bool:
    """Install the allocator as PyTorch's CPU allocator (once per process; built on first
    use). ``False`` where it cannot be (see :func:`why_inactive`)."""
    global _lib, _tried, _why
    if _tried:
        return _lib is not None
    _tried = True
    if os.environ.get("DEEPSOLVE_HOST_ALLOCATOR", "1").strip().lower() in ("0", "false", "no",
                                                                            "off"):
        _why = "DEEPSOLVE_HOST_ALLOCATOR=0"
        return False
    if not sys.platform.startswith("linux"):
        _why = f"not Linux ({sys.platform})"
        return False
    try:
        path = library_path()
        if not path.exists():
            build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        _why = str(e)
        return False
    lib.ds_install.restype = ctypes.c_int
    lib.ds_set_limit.argtypes = [ctypes.c_int64]
    lib.ds_set_big_from.argtypes = [ctypes.c_uint64]
    lib.ds_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.ds_live.restype = ctypes.c_int64
    lib.ds_peak.restype = ctypes.c_int64
    lib.ds_mapped.restype = ctypes.c_int64
    lib.ds_set_big_from(BIG_FROM)
    if lib.ds_install() != 1:
        _why = "another CPU allocator of higher priority is installed"
        return False
    _lib = lib
    return True


def active() -> bool:
    """Whether the allocator is installed in this process (without trying to install)."""
    return _lib is not None


def why_inactive() -> str:
    """Why :func:`install` returned ``False`` (empty when it is active or was not tried)."""
    return _why


def live() -> int:
    """Bytes of CPU tensor memory handed out now (0 when the allocator is not active)."""
    return int(_lib.ds_live()) if _lib is not None else 0


def peak() -> int:
    """The most bytes live at once since the last :func:`reset_peak`."""
    return int(_lib.ds_peak()) if _lib is not None else 0


def mapped() -> int:
    """Bytes of the mapped (large, budgeted) blocks handed out now: tensor memory that the C
    library's own counters do not see."""
    return int(_lib.ds_mapped()) if _lib is not None else 0


def reset_peak() -> None:
    """Make the peak the bytes live now."""
    if _lib is not None:
        _lib.ds_reset_peak()


def set_limit(limit: int | None) -> None:
    """Cache freed large blocks while live + cached bytes stay within ``limit`` (``None``:
    no budget — no mapping or caching). Empties the cache first."""
    if _lib is not None:
        _lib.ds_set_limit(-1 if limit is None else int(limit))


@contextlib.contextmanager
def mapping() -> Iterator[None]:
    """Large blocks mapped (whole pages: their sizes the same in every process) for the
    duration, where no budget maps them already; nothing is cached."""
    if _lib is None or _lib_limit() >= 0:
        yield
        return
    set_limit(live())
    try:
        yield
    finally:
        set_limit(None)


def _lib_limit() -> int:
    return stats()["limit"]


def stats() -> dict[str, int]:
    """Counters: ``live``, ``peak``, ``cached``, ``limit`` (-1: none), cache ``hits``,
    ``misses``, ``evictions``, and ``mapped`` (bytes of mapped blocks live)."""
    if _lib is None:
        return {}
    buf = (ctypes.c_int64 * 8)()
    _lib.ds_stats(buf)
    names = ("live", "peak", "cached", "limit", "hits", "misses", "evictions", "mapped")
    return dict(zip(names, (int(v) for v in buf), strict=True))

