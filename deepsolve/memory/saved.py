"""The saved-tensor meter: the bytes autograd keeps for backward.

``with SavedTensors() as s: ...`` installs :func:`torch.autograd.graph.saved_tensors_hooks`
and counts what the graphs built inside save for their backward. It is the one pack hook
behind deepsolve's CPU memory figures: the memory meter's tracked peak
(:class:`~deepsolve.memory.meter.MemoryMeter`), the chunked PINN residual's bytes per point
(:class:`deepsolve.pinn.SavedBytes` is this class), the tape of a profiled step
(:func:`~deepsolve.memory.profile_step`) and of each layer of a chain
(:func:`deepsolve.sequential.profile_chain`).

What is counted:

* each storage once, however many saved tensors (views, the same tensor saved twice) lie on
  it, at ``untyped_storage().nbytes()``: the memory held, not the size of the views;
* not leaves that require grad (the caller's parameters and inputs: they exist whether or
  not a graph is built), nor the storages whose keys are in ``skip`` (e.g. the state a
  profiled step starts from, saved as a view);
* a tensor inside a ``torch.func`` transform by the storage under its wrappers; one with no
  readable storage at all by ``numel() * element_size()`` under the key ``("tensor", id)``
  (that tensor is kept alive while counted, so that its id is not reused — unless it has a
  ``grad_fn``, which may hold this very hook's box: see below).

A storage is live from the first time a tensor on it is saved until autograd frees the last
one (backward ran, or the graph was dropped): ``live`` is what is held now, ``peak`` the most
held at once, ``packed`` the bytes of all storages counted. Two options serve the other
meters:

* ``record=True`` keeps ``seen``: key -> bytes of every storage saved inside (the largest
  size seen under a key), freed or not — for profilers that sort the union of what one
  recorded step saved (:meth:`key` gives the key of a tensor, e.g. a parameter's);
* ``on_grow()`` is called each time a storage is counted (``live`` grew), so that a meter
  whose total has other parts (the memory meter: device snapshots) samples that total
  whenever its saved part grows; a new saved peak alone would miss a total peak reached with
  fewer saved bytes but more of the rest.

Why the hook holds a detached alias: what the pack hook returns is what the graph keeps.
Returning the saved tensor itself ties an op's output that its own ``grad_fn`` saves (tanh,
exp, sigmoid) into a cycle, output -> grad_fn -> saved box -> output, through C++ objects
that Python's collector cannot see: a graph dropped without backward would never be freed.
The box holds ``t.detach()`` instead (the same storage and version counter, so in-place
changes are still caught, but no ``grad_fn``), and a :func:`weakref.finalize` on the box
releases the storage's count when autograd lets the box go.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable

import torch

__all__ = ["SavedTensors"]


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``torch.func`` wrappers (vmap/grad levels)."""
    try:
        from torch._C._functorch import get_unwrapped, is_batchedtensor, is_gradtrackingtensor
    except ImportError:  # pragma: no cover - very old torch
        return t
    while is_batchedtensor(t) or is_gradtrackingtensor(t):
        t = get_unwrapped(t)
    return t


def _locate(t: torch.Tensor) -> tuple[Hashable, int, torch.Tensor | None]:
    """``(key, nbytes, pin)`` of the storage under ``t``; ``pin``: the tensor to keep alive
    while an id-keyed entry is counted (``None`` for a storage)."""
    u = _unwrap(t)
    try:
        st = u.untyped_storage()
        return st.data_ptr(), st.nbytes(), None
    except (RuntimeError, NotImplementedError):  # no readable storage
        return ("tensor", id(u)), u.numel() * u.element_size(), u


class _Saved:
    __slots__ = ("t", "pin", "__weakref__")

    def __init__(self, t: torch.Tensor, pin: torch.Tensor | None):
        self.t = t
        self.pin = pin


class SavedTensors:
    """Context manager: live and peak bytes of the tensors saved for backward inside it; see
    the module docstring. ``skip``: storage keys not counted (:meth:`key`); ``record``: keep
    ``seen``; ``on_grow``: called after each storage counted."""

    def __init__(self, skip: Iterable[Hashable] = (), *, record: bool = False,
                 on_grow: Callable[[], None] | None = None):
        self.skip = frozenset(skip)
        self.seen: dict[Hashable, int] | None = {} if record else None
        self.on_grow = on_grow
        self.live = 0
        self.peak = 0
        self.packed = 0
        self._counts: dict[Hashable, list[int]] = {}  # key -> [saved tensors, nbytes]

    @staticmethod
    def key(t: torch.Tensor) -> tuple[Hashable, int]:
        """``(key, nbytes)`` of the storage under ``t``, as the meter counts it: the storage's
        data pointer and size, or ``("tensor", id)`` and ``numel * element_size`` for a tensor
        without readable storage."""
        key, nbytes, _ = _locate(t)
        return key, nbytes

    def _pack(self, t: torch.Tensor):
        if t.is_leaf and t.requires_grad:  # no grad_fn: holding it forms no cycle
            return t
        key, nbytes, pin = _locate(t)
        if key in self.skip:
            return t.detach()
        if self.seen is not None:
            self.seen[key] = max(self.seen.get(key, 0), nbytes)
        entry = self._counts.get(key)
        if entry is None:
            self._counts[key] = [1, nbytes]
            self.live += nbytes
            self.packed += nbytes
            self.peak = max(self.peak, self.live)
            if self.on_grow is not None:
                self.on_grow()
        else:
            entry[0] += 1
        # a detached alias, and a pin only without grad_fn: see the module docstring
        box = _Saved(t.detach(), pin if pin is not None and pin.grad_fn is None else None)
        weakref.finalize(box, self._release, key)
        return box

    def _release(self, key: Hashable) -> None:
        entry = self._counts.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self._counts[key]
            self.live -= entry[1]

    @staticmethod
    def _unpack(box):
        return box if isinstance(box, torch.Tensor) else box.t

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
