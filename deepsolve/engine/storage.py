"""Snapshot storage: the slots a schedule stores states in, and the levels they live on.

Level 0 is the device the unroll runs on: a snapshot there is the state's own tensors (no
copy). A level ``>= 1`` is a :class:`Storage` backend (``put``/``get``/``drop``/``close``):
:class:`HostStorage` (pinned host memory, asynchronous copies) here, a disk spill directory
in :mod:`deepsolve.memory.offload`. A stored state is a :class:`Slot`. With
``snapshot_dtype`` (opt-in, inexact) the floating leaves of snapshots other than ``x_0`` are
stored rounded to a smaller float type and cast back on restore.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

__all__ = ["Storage", "HostStorage", "Slot", "check_snapshot_dtype", "snapshot_nbytes"]


class Slot(NamedTuple):
    """One stored state.

    Attributes:
        data: the state's leaves (level 0), ``None`` when a backend holds them.
        versions: the leaves' version counters when stored (the state's own tensors are
            held, so an in-place change of them is detected on restore), else ``None``.
        rng: the generators' state when stored (:meth:`Replay.capture`), or ``None``.
        index: ``i`` of the stored ``x_i``.
        lowered: whether the floating leaves are stored in the snapshot dtype.
    """

    data: list[torch.Tensor] | None
    versions: list[int] | None
    rng: Any
    index: int  # type: ignore[assignment]  # a field that shadows tuple.index, on purpose
    lowered: bool


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
