"""Compiled artefacts that outlive the process: ``torch.compile``'s caches kept in a file that
the next process loads (a resumed run, a requeued job, another task of an array job, the next
script that unrolls the same step), checked before they are trusted.

What is kept. :func:`torch.compiler.save_cache_artifacts` returns, as bytes, what this
process's compiles put in PyTorch's caches — Inductor's graphs and their generated code,
AOTAutograd's forward and backward graphs, Dynamo's profile; :func:`torch.compiler.
load_cache_artifacts` puts them back, so that the same graphs compiled later in a process find
them: Dynamo still traces the step (a fraction of a second for a loop body), but nothing is
lowered or compiled again.

The file::

    {"format": "deepsolve-compiled/1", "torch": ..., "python": ..., "machine": ...,
     "bytes": N, "sha256": ...}\\n
    <N bytes>

written to a temporary name, fsynced and renamed into place (a reader never sees half a
file; two writers leave one whole file). It is loaded only when its format, PyTorch version,
Python version and machine are this process's and its checksum holds; otherwise it is ignored
with one warning line saying why (:class:`StaleArtefacts`), never an error. And never trusted
blindly: a compiled segment made from loaded artefacts is still run beside the eager steps at
its first call and refused on any difference (:mod:`deepsolve.engine.segments`).

Where. A library call keeps one file per step under :func:`cache_dir` — ``$DEEPSOLVE_COMPILE_
CACHE``, or ``compiled/`` under ``$DEEPSOLVE_CACHE_DIR`` (``~/.cache/deepsolve``) — named by the
step's code (its file, name and first line) and PyTorch's version; ``DEEPSOLVE_COMPILE_CACHE=0``
turns it off. The trainer binds its run directory's ``compiled.bin`` (:func:`bound`): read
before the per-step file, written beside it, so that ``--resume`` and a requeued job find it
in the run directory whatever machine they land on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "RUN_FILE", "StaleArtefacts", "cache_dir", "path_for", "load", "save", "bound",
           "load_for", "save_for", "header"]

FORMAT = "deepsolve-compiled/1"
#: the file a run directory keeps (the trainer binds it, :func:`bound`)
RUN_FILE = "compiled.bin"

_loaded: set[str] = set()  # files loaded (or refused) in this process: once each
_bound: list[Path] = []  # the trainer's run-directory file, innermost last


class StaleArtefacts(RuntimeWarning):
    """A compiled-artefacts file made elsewhere (another PyTorch, Python or machine) or
    damaged: ignored, and compiled afresh."""


def header(nbytes: int, digest: str) -> dict[str, Any]:
    """What the file says of the process that wrote it (and of its bytes)."""
    return {"format": FORMAT, "torch": torch.__version__,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "machine": platform.machine(), "bytes": nbytes, "sha256": digest}


def cache_dir() -> Path | None:
    """The directory of a library call's files, or ``None`` when turned off
    (``DEEPSOLVE_COMPILE_CACHE=0``)."""
    given = os.environ.get("DEEPSOLVE_COMPILE_CACHE")
    if given is not None:
        if given.strip().lower() in ("0", "off", "false", "no", ""):
            return None
        return Path(given)
    root = os.environ.get("DEEPSOLVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "deepsolve")
    return Path(root) / "compiled"


def path_for(step: Any) -> Path | None:
    """The library's file for ``step``: named by its code (file, qualified name, first
    line; a bound method's function; the functions a wrapper closes over) and PyTorch's
    version."""
    root = cache_dir()
    if root is None:
        return None
    fn = getattr(step, "__func__", step)
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: its class's __call__ (or forward)
        method = getattr(type(fn), "forward", None) or type(fn).__call__
        code = getattr(method, "__code__", None)
    where = (f"{getattr(code, 'co_filename', type(fn).__module__)}:"
             f"{getattr(fn, '__qualname__', type(fn).__qualname__)}:"
             f"{getattr(code, 'co_firstlineno', 0)}")
    # a wrapper (a problem's bound step) is told apart by the functions it closes over
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        inner = getattr(inner, "__func__", inner)
        if callable(inner) and hasattr(inner, "__code__"):
            where += f"|{inner.__code__.co_filename}:{inner.__qualname__}"
    key = hashlib.sha256(f"{where}|{torch.__version__}".encode()).hexdigest()[:20]
    return root / f"{key}.bin"


def _why_not(head: dict[str, Any], data: bytes) -> str | None:
    """Why a file's header or bytes cannot be trusted here (``None``: they can)."""
    mine = header(len(data), "")
    for field in ("format", "torch", "python", "machine"):
        if head.get(field) != mine[field]:
            return f"made by {field} {head.get(field)!r}, this process has {mine[field]!r}"
    if head.get("bytes") != len(data):
        return f"it holds {len(data)} bytes where its header says {head.get('bytes')}"
    if head.get("sha256") != hashlib.sha256(data).hexdigest():
        return "its checksum does not match its bytes"
    return None


def load(path: Path) -> bool:
    """Load ``path`` into PyTorch's caches, once per process: ``True`` when it was loaded
    now. A missing file is ``False`` in silence; a stale, foreign or damaged one ``False``
    with one :class:`StaleArtefacts` warning line."""
    key = str(path)
    if key in _loaded:
        return False
    _loaded.add(key)
    try:
        with open(path, "rb") as f:
            first = f.readline()
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError as e:
        _stale(path, f"it cannot be read ({e.strerror or e})")
        return False
    try:
        head = json.loads(first)
        if not isinstance(head, dict):
            raise ValueError("not an object")
    except ValueError:
        _stale(path, "it has no deepsolve header")
        return False
    why = _why_not(head, data)
    if why is not None:
        _stale(path, why)
        return False
    try:
        torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # a format PyTorch no longer reads
        _stale(path, f"PyTorch cannot load it ({type(e).__name__}: {e})")
        return False
    return True


def _stale(path: Path, why: str) -> None:
    warnings.warn(f"deepsolve: ignoring the compiled artefacts {path}: {why}; compiling "
                  "afresh (the file is replaced once this process has compiled)",
                  StaleArtefacts, stacklevel=4)


def save(path: Path) -> bool:
    """Write what this process's compiles hold to ``path`` (atomically); ``False`` when
    there is nothing to write or the directory cannot be written (the next process then
    compiles again: nothing is lost)."""
    try:
        got = torch.compiler.save_cache_artifacts()
    except Exception:
        return False
    if not got or not got[0]:
        return False
    data = got[0]
    head = json.dumps(header(len(data), hashlib.sha256(data).hexdigest())).encode() + b"\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    _loaded.add(str(path))  # what it holds is in this process already
    return True


@contextlib.contextmanager
def bound(path: str | os.PathLike) -> Iterator[Path]:
    """Within the block, compiled unrolls read ``path`` (the trainer's run directory's
    ``compiled.bin``) before their per-step file and write it beside it."""
    p = Path(path)
    _bound.append(p)
    try:
        yield p
    finally:
        _bound.remove(p)


def _paths(step: Any) -> list[Path]:
    out = list(reversed(_bound[-1:]))
    own = path_for(step)
    if own is not None:
        out.append(own)
    return out


def load_for(step: Any) -> bool:
    """Before ``step`` is compiled: load its files (the bound run file, then the per-step
    file); whether any was loaded."""
    loaded = False
    for p in _paths(step):
        loaded = load(p) or loaded
    return loaded


def save_for(step: Any) -> None:
    """After ``step`` was compiled: write its files."""
    for p in _paths(step):
        save(p)
