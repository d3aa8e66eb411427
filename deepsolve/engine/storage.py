"""Snapshot storage: the slots a schedule stores states in, and the levels they live on.

Level 0 is the device the unroll runs on: a snapshot there is the state's own tensors (no
copy) — or, for a small CPU state, a row of a :class:`SnapshotPool`. A level ``>= 1`` is a
:class:`Storage` backend (``put``/``get``/``drop``/``close``):
:class:`HostStorage` (pinned host memory, asynchronous copies) here, a disk spill directory
in :mod:`deepsolve.memory.offload`. A stored state is a :class:`Slot`. With
``snapshot_dtype`` (opt-in, inexact) the floating leaves of snapshots other than ``x_0`` are
stored rounded to a smaller float type and cast back on restore.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

__all__ = ["Storage", "HostStorage", "Slot", "SnapshotPool", "POOL_BELOW", "check_snapshot_dtype",
           "snapshot_nbytes"]


class Slot(NamedTuple):
    """One stored state.

    Attributes:
        data: the state's leaves (level 0), ``None`` when a backend holds them.
        versions: the leaves' version counters when stored (the state's own tensors are
            held, so an in-place change of them is detected on restore), else ``None``.
        rng: the generators' state when stored (:meth:`Replay.capture`), or ``None``.
        index: ``i`` of the stored ``x_i``.
        lowered: whether the floating leaves are stored in the snapshot dtype.
        row: the row of the :class:`SnapshotPool` holding it (``-1``: none).
    """

    data: list[torch.Tensor] | None
    versions: list[int] | None
    rng: Any
    index: int  # type: ignore[assignment]  # a field that shadows tuple.index, on purpose
    lowered: bool
    row: int = -1


@runtime_checkable
class Storage(Protocol):
    """A storage level ``>= 1`` for snapshots. ``meta`` is ``[(shape, dtype, device), ...]``
    of the state's leaves: ``get`` returns tensors on the leaves' devices."""

    def put(self, key: Any, tensors: list[torch.Tensor]) -> None: ...

    def get(self, key: Any, meta: Sequence[tuple]) -> list[torch.Tensor]: ...

    def drop(self, key: Any) -> None: ...

    def close(self) -> None: ...



class HostStorage:
    """A second storage level in host memory: device tensors are copied to (pinned) CPU
    memory with ``non_blocking=True`` so the copy overlaps compute; restored on demand."""

    def __init__(self):
        self.data: dict = {}

    def put(self, key, tensors: list[torch.Tensor]) -> None:
        out = []
        for t in tensors:
            if t.device.type == "cuda":
                h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                h.copy_(t, non_blocking=True)
            else:
                h = t.clone()
            out.append(h)
        self.data[key] = out

    def get(self, key, meta) -> list[torch.Tensor]:
        return [t.to(m[2], non_blocking=True) for t, m in zip(self.data[key], meta, strict=True)]

    def drop(self, key) -> None:
        del self.data[key]

    def close(self) -> None:
        self.data.clear()


POOL_BELOW = 64 * 1024
"""CPU states smaller than this (bytes) are snapshotted into a :class:`SnapshotPool`."""


class SnapshotPool:
    """Level-0 snapshots of a small CPU state, packed as rows of a few large tensors.

    A snapshot held as the state's own tensors costs, beside the state, a tensor object and
    its storage's C++ objects per leaf and the C library's rounding and free holes around
    small blocks: measured on a 1 KiB state, 1.9 KiB of resident memory per snapshot. Copied
    into a row of a preallocated block (one tensor per leaf, ``rows`` rows each), a snapshot
    costs its bytes and its record; a freed row is reused by the next store. Blocks are
    allocated as they are needed (their pages become resident as rows are written) and
    freed with the pool. A restore returns new tensors (a copy of the row), so a tape that
    holds a restored state never sees the row overwritten.

    ``meta``: ``[(shape, dtype, device)]`` of the leaves as stored (the snapshot dtype
    where snapshots are lowered)."""

    def __init__(self, meta: Sequence[tuple], rows: int | None = None):
        self.meta = list(meta)
        nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d, _ in self.meta)
        self.rows = rows or max(16, min(4096, (64 * 1024) // max(nbytes, 1)))
        self.blocks: list[list[torch.Tensor]] = []
        self.free: list[int] = []
        self.used = 0

    def put(self, leaves: Sequence[torch.Tensor], index: int = 0) -> int:
        """Copy ``leaves`` (the state ``x_index``) into a free row; returns the row. A leaf
        on another device or of another shape than the pool's is a one-line error (the
        per-step check looks at shapes and dtypes only)."""
        for k, (t, (shape, _, dev)) in enumerate(zip(leaves, self.meta, strict=True)):
            if t.device != dev or t.shape != shape:
                raise ValueError(
                    f"unroll: step {index - 1} changed state leaf {k}: it returned "
                    f"{tuple(t.shape)} {t.dtype} on {t.device}, but x_0 has {tuple(shape)} on "
                    f"{dev}; a step must return the state's shapes, dtypes and devices")
        if self.free:
            row = self.free.pop()
        else:
            row = self.used
            self.used += 1
            if row // self.rows == len(self.blocks):
                self.blocks.append([torch.empty((self.rows, *s), dtype=d, device=dev)
                                    for s, d, dev in self.meta])
        block = self.blocks[row // self.rows]
        r = row % self.rows
        with torch.no_grad():
            for buf, t in zip(block, leaves, strict=True):
                buf[r].copy_(t)
        return row

    def get(self, row: int) -> list[torch.Tensor]:
        """New tensors holding the row."""
        block = self.blocks[row // self.rows]
        r = row % self.rows
        return [buf[r].clone() for buf in block]

    def drop(self, row: int) -> None:
        self.free.append(row)

    def close(self) -> None:
        self.blocks.clear()
        self.free.clear()
        self.used = 0


def check_snapshot_dtype(dtype: Any) -> torch.dtype | None:
    """``None`` or a floating-point ``torch.dtype``; a one-line error otherwise."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unroll: snapshot_dtype must be a floating-point torch.dtype such as "
                         f"torch.bfloat16, got {dtype!r}")
    return dtype


def snapshot_nbytes(leaves: Sequence[torch.Tensor], dtype: torch.dtype | None) -> int:
    """Bytes of one snapshot of a state whose floating leaves are stored as ``dtype``."""
    return sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point()
                            else t.element_size()) for t in leaves)
