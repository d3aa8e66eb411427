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
the system's C++ compiler — ``CXX``, else ``c++`` — against the installed PyTorch's headers
and cached under ``$DEEPSOLVE_CACHE_DIR``, else ``~/.cache/deepsolve``) as PyTorch's CPU
allocator. The cached library is written atomically beside its sha256 (``<library>.sha256``:
each a temporary file in the same directory, fsynced and renamed, the directory fsynced, one
building process at a time under a lock on the directory), and the checksum is verified
before the library is loaded: a truncated or damaged library — mapping one kills the process
with SIGBUS — or one without its checksum is rebuilt, never loaded. A library that loads but
is not the allocator (another shared object in its place: it lacks the allocator's symbols)
or whose ``ds_install`` fails is damaged too: rebuilt once, and where the rebuilt one does
not work either, deepsolve falls back (below). A builder holding the lock removes the
temporary files that builds killed before their renames left behind (only its own temporary
files' pattern, only under the lock: a live builder's are never removed). It

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
glibc thresholds — where there is no C++ compiler, the cache directory cannot be written,
the library, rebuilt, still does not load or is not the allocator, there is no glibc (macOS),
or when the environment variable ``DEEPSOLVE_HOST_ALLOCATOR=0`` is set. Except for the last
two, the fallback is announced once per process by a :class:`HostAllocatorWarning`: the
reason, the cost and the fix in one line (:func:`why_inactive` holds the reason).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["install", "active", "live", "peak", "mapped", "reset_peak", "set_limit", "stats",
           "mapping",
           "library_path", "build", "BIG_FROM", "why_inactive", "HostAllocatorWarning"]

BIG_FROM = 64 * 1024
"""Bytes from which a block is mapped and cached under a budget."""

_SOURCE = Path(__file__).with_name("_hostalloc.cpp")
_SYMBOLS = ("ds_install", "ds_set_limit", "ds_set_big_from", "ds_stats", "ds_live", "ds_peak",
            "ds_mapped", "ds_reset_peak")
"""What the library exports: one that loads without all of them is not the allocator."""
_lib: ctypes.CDLL | None = None
_tried = False
_why = ""


class HostAllocatorWarning(RuntimeWarning):
    """deepsolve's host allocator could not be installed and CPU budgets fall back to glibc's
    thresholds (issued once per process, not where ``DEEPSOLVE_HOST_ALLOCATOR=0``)."""


class _Unavailable(RuntimeError):
    """Why the allocator cannot be built or loaded (``what``) and what to do (``fix``)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what}; {fix}")
        self.what, self.fix = what, fix


class _Damaged(Exception):
    """The cached library loads but does not work (``what``): it is rebuilt once."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.what, self.fix = what, fix


_CACHE_FIX = "set DEEPSOLVE_CACHE_DIR to a writable directory"
_COMPILER_FIX = "install a working C++ compiler (g++ or clang++) or set CXX to one"
_LOAD_FIX = "check that CXX builds for this Python's PyTorch (its C++ library and ABI)"


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


def _checksum_path(path: Path) -> Path:
    """The file that records the sha256 of the library at ``path`` (``sha256sum`` format)."""
    return path.with_name(path.name + ".sha256")


def _recorded(path: Path) -> str | None:
    try:
        words = _checksum_path(path).read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    digest = words[0] if words else ""
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) \
        else None


def _verified(path: Path) -> bool:
    """Whether the library at ``path`` is whole: its sha256 is the one its build recorded
    (``<library>.sha256``). A truncated or damaged library, or one without a record, is
    not loaded (mapping it can kill the process with SIGBUS) but rebuilt."""
    expected = _recorded(path)
    if expected is None:
        return False
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == expected


def _make_dir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _Unavailable(f"the cache directory {d} of deepsolve's host allocator cannot be "
                           f"created ({e.strerror or e})", _CACHE_FIX) from None


class _Lock(NamedTuple):
    fd: int | None  # the directory's descriptor (for fsync); None where it cannot be opened
    held: bool      # whether this process holds the directory's lock


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[_Lock]:
    """The directory ``d`` locked (``flock``) against other processes building into it.
    Best effort: where the file system has no locks (``held`` false), the checksum still
    keeps a mixed pair from being loaded."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield _Lock(None, False)
        return
    try:
        import fcntl

        held = False
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        yield _Lock(fd, held)
    finally:
        os.close(fd)  # releases the lock


def _remove_stale(path: Path, lock: _Lock) -> None:
    """Remove the temporary files that earlier builds of ``path`` left behind (killed before
    their renames): only names of the build's own pattern (``.<library>.XXXXXXXX.tmp`` and
    ``.<library>.XXXXXXXX.sha256.tmp``, ``tempfile``'s eight characters), and only while this
    process holds the directory's lock — every build writes its temporary files under it, so
    none of them belongs to a live builder."""
    if not lock.held:
        return
    stale = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}(\.sha256)?\.tmp")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if stale.fullmatch(name):
            with contextlib.suppress(OSError):
                os.unlink(path.parent / name)


def _compiler() -> tuple[str, list[str]]:
    words = shlex.split(os.environ.get("CXX") or "c++")
    exe = shutil.which(words[0]) if words else None
    if exe is None:
        name = words[0] if words else ""
        raise _Unavailable(f"compiling deepsolve's host allocator failed: no C++ compiler "
                           f"{name!r} found (CXX, else c++ on PATH)",
                           "install g++ or clang++, or set CXX to one")
    return exe, words[1:]


def _compile_into(path: Path, dir_fd: int | None) -> None:
    """Compile into a temporary file beside ``path``, fsync it, record its sha256 beside it
    the same way, rename both into place and fsync the directory."""
    exe, extra = _compiler()
    flags, _ = _flags()
    fix = _COMPILER_FIX
    temps: list[str] = []
    try:
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            temps.append(tmp)
        except OSError as e:
            raise _Unavailable(f"the cache directory {path.parent} of deepsolve's host "
                               f"allocator is not writable ({e.strerror or e})",
                               _CACHE_FIX) from None
        try:
            out = subprocess.run([exe, *extra, str(_SOURCE), "-o", tmp, *flags],
                                 capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise _Unavailable(f"compiling deepsolve's host allocator failed: {exe} ran for "
                               "more than 300 s", fix) from None
        except OSError as e:
            raise _Unavailable(f"compiling deepsolve's host allocator failed: {exe}: "
                               f"{e.strerror or e}", fix) from None
        if out.returncode != 0:
            lines = [s.strip() for s in (out.stdout + "\n" + out.stderr).splitlines()
                     if s.strip()]
            tail = f": {lines[-1]}" if lines else " and no output"
            raise _Unavailable(f"compiling deepsolve's host allocator failed: {exe} exited "
                               f"with code {out.returncode}{tail}", fix)
        with open(tmp, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
            os.fsync(f.fileno())
        fd, tmp_sum = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".sha256.tmp",
                                       dir=path.parent)
        temps.append(tmp_sum)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{digest}  {path.name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_sum, 0o644)
        # the library first: between the two renames, and after a crash between them, the
        # pair does not match and the next process rebuilds rather than loads
        os.replace(tmp, path)
        os.replace(tmp_sum, _checksum_path(path))
        temps.clear()
        if dir_fd is not None:
            with contextlib.suppress(OSError):  # file systems that cannot sync a directory
                os.fsync(dir_fd)
    except OSError as e:
        raise _Unavailable(f"writing deepsolve's host allocator to {path.parent} failed "
                           f"({e.strerror or e})", _CACHE_FIX) from None
    finally:
        for t in temps:
            with contextlib.suppress(OSError):
                os.unlink(t)


def build(path: Path | None = None) -> Path:
    """Compile ``_hostalloc.cpp`` into ``path`` (default :func:`library_path`) and record its
    sha256 in ``<library>.sha256``; both written atomically (a temporary file in the same
    directory, fsynced, renamed; the directory fsynced), one process at a time (a lock on
    the directory), so no process ever sees a half-written library. Raises ``RuntimeError``
    in one line (the compiler's path and the last line of its output, or the cache
    directory that cannot be written) when it fails. ``make`` builds it ahead of use:
    ``python -c "from deepsolve.memory import hostalloc; hostalloc.build()"``."""
    path = library_path() if path is None else Path(path)
    _make_dir(path.parent)
    with _locked(path.parent) as lock:
        _remove_stale(path, lock)
        _compile_into(path, lock.fd)
    return path


def _load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` installed as PyTorch's CPU allocator, loaded only once its
    checksum matches; built (or rebuilt: damaged, without a record, not loadable, without
    the allocator's symbols, or its ``ds_install`` failing) under the directory's lock
    otherwise — once: where the rebuilt library does not work either, ``_Unavailable``."""
    damaged = False
    if _verified(path):
        try:
            return _ready(_open(path, 0), path)
        except _Damaged:  # loads but is not the allocator, or does not install: rebuilt
            damaged = True
    _make_dir(path.parent)
    with _locked(path.parent) as lock:
        _remove_stale(path, lock)
        loads = int(damaged)
        if not damaged and _verified(path):  # another process built it meanwhile
            try:
                return _ready(_open(path, 0), path)
            except _Damaged:
                loads = 1
        _compile_into(path, lock.fd)
        try:
            return _ready(_open(path, loads), path)
        except _Damaged as e:
            raise _Unavailable(e.what, e.fix) from None


def _open(path: Path, loads: int) -> ctypes.CDLL:
    """``dlopen`` the library at ``path``, raising ``_Damaged`` where it does not load. A
    shared object stays loaded once it was (``ctypes`` never closes one), and the dynamic
    loader hands the object it loaded under the same name back; so after ``loads`` loads in
    this process, the library is opened under a name none of them used
    (``<dir>/./<library>``: the same file)."""
    name = os.path.join(str(path.parent), *["."] * loads, path.name)
    try:
        return ctypes.CDLL(name)
    except OSError as e:  # whole but not loadable (libraries changed under it): rebuilt
        raise _Damaged(f"loading deepsolve's host allocator failed: {e}", _LOAD_FIX) from None


def _ready(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    """``lib`` (loaded from ``path``) with its functions' types set and installed as
    PyTorch's CPU allocator; ``_Damaged`` where it lacks one of the allocator's symbols
    (another shared object in the library's place) or its ``ds_install`` fails."""
    missing = [s for s in _SYMBOLS if not hasattr(lib, s)]
    if missing:
        more = f" and {len(missing) - 1} more of its symbols" if len(missing) > 1 else ""
        raise _Damaged(f"loading deepsolve's host allocator failed: {path} is not the "
                       f"allocator (it does not define {missing[0]}{more})", _LOAD_FIX)
    lib.ds_install.restype = ctypes.c_int
    lib.ds_set_limit.argtypes = [ctypes.c_int64]
    lib.ds_set_big_from.argtypes = [ctypes.c_uint64]
    lib.ds_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.ds_live.restype = ctypes.c_int64
    lib.ds_peak.restype = ctypes.c_int64
    lib.ds_mapped.restype = ctypes.c_int64
    lib.ds_set_big_from(BIG_FROM)
    if lib.ds_install() != 1:
        raise _Damaged("deepsolve's host allocator cannot be installed: another CPU "
                       "allocator of higher priority is",
                       "do not install another CPU allocator in a process that uses CPU "
                       "budgets")
    return lib


def install() -> bool:
    """Install the allocator as PyTorch's CPU allocator (once per process; built on first
    use, rebuilt where the cached library is damaged). ``False`` where it cannot be (see
    :func:`why_inactive`); unless turned off with ``DEEPSOLVE_HOST_ALLOCATOR=0``, the
    fallback is announced once per process with a :class:`HostAllocatorWarning`."""
    global _lib, _tried, _why
    if _tried:
        return _lib is not None
    _tried = True
    if os.environ.get("DEEPSOLVE_HOST_ALLOCATOR", "1").strip().lower() in ("0", "false", "no",
                                                                            "off"):
        _why = "DEEPSOLVE_HOST_ALLOCATOR=0"
        return False
    if not sys.platform.startswith("linux"):
        _why = f"not Linux ({sys.platform})"  # documented, and nothing to fix: not announced
        return False
    try:
        lib = _load(library_path())
    except _Unavailable as e:
        _why = str(e)
        _announce(e.what, e.fix)
        return False
    except OSError as e:  # its source not readable: a broken installation
        what = f"deepsolve's host allocator cannot be built: {e}"
        _why = what
        _announce(what, "reinstall deepsolve")
        return False
    _lib = lib
    return True


def _announce(what: str, fix: str) -> None:
    """The fallback in one line: why, what it costs, what to do (once: install runs once)."""
    if os.environ.get("DEEPSOLVE_MALLOPT", "1").strip().lower() in ("0", "false", "no", "off"):
        cost = ("CPU budgets fall back to glibc's defaults (DEEPSOLVE_MALLOPT=0), which do "
                "not hold the resident set to the budget")
    else:
        cost = ("CPU budgets fall back to glibc's fixed thresholds, measured 1.2-3.6x the "
                "host allocator's CPU time on budgeted unrolls (docs/budget.md)")
    warnings.warn(f"{what}: {cost}; fix: {fix}, or set DEEPSOLVE_HOST_ALLOCATOR=0 to accept "
                  "the fallback",
                  HostAllocatorWarning, stacklevel=3)


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

