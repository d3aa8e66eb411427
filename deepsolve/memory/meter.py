"""Peak-memory meters for CUDA and CPU.

``with MemoryMeter(device, stats=s) as m: ...`` measures what the code inside adds at its
peak:

* ``m.cuda_peak`` — on CUDA, ``torch.cuda.max_memory_allocated`` above the allocation on
  entry (reset on entry);
* ``m.host_peak`` — the process high-water mark (``VmHWM``) above the resident size on entry,
  after resetting the mark through /proc/self/clear_refs where the kernel allows
  (``m.host_reset`` says whether it could);
* ``m.tracked_peak`` — the bytes deepsolve itself holds: tensors saved for backward (unique
  storages, not counting leaves that require grad — the caller's parameters and inputs),
  device snapshots (from the :class:`~deepsolve.UnrollStats` passed as ``stats``, updated by
  the executor) and stacked outputs. This is the CPU measure the budget is checked against.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["MemoryMeter", "host_high_water_mark", "reset_high_water_mark", "process_status"]


def process_status(key: str) -> int:
    """A byte count from /proc/self/status (``"VmRSS:"``, ``"VmHWM:"``), 0 where missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 0


def reset_high_water_mark() -> bool:
    """Reset VmHWM to the current resident size (/proc/self/clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_high_water_mark() -> int:
    """The process's peak resident set size in bytes (VmHWM), 0 where unavailable."""
    return process_status("VmHWM:")


class MemoryMeter:
    """See the module docstring."""

    def __init__(self, device: torch.device | str | None = None, stats=None,
                 extra_bytes: int = 0):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.stats = stats
        self.extra = extra_bytes
        self.saved_live = 0
        self.saved_peak = 0
        self.tracked_peak = 0
        self.cuda_peak = 0
        self.host_peak = 0
        self.host_reset = False
        self._storages: dict[int, list[int]] = {}

    # saved-tensor hooks -----------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.is_leaf and t.requires_grad:
            return t
        try:
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # torch.func wrappers have no storage
            ptr, nbytes = ("tensor", id(t)), t.numel() * t.element_size()
        entry = self._storages.get(ptr)
        if entry is None:
            self._storages[ptr] = [1, nbytes]
            self.saved_live += nbytes
            self._sample()
        else:
            entry[0] += 1
        # hold a detached alias (same storage and version counter, no grad_fn): holding the
        # saved tensor itself would tie an output to its own grad_fn, a reference cycle
        # through C++ that keeps a graph dropped without backward alive for good
        box = _Saved(t.detach())
        weakref.finalize(box, self._release, ptr)
        return box

    def _release(self, ptr: int) -> None:
        entry = self._storages.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self._storages[ptr]
            self.saved_live -= entry[1]

    @staticmethod
    def _unpack(box):
        return box if isinstance(box, torch.Tensor) else box.t

    def _sample(self) -> None:
        snaps = self.stats.snapshot_bytes_peak if self.stats is not None else 0
        total = self.saved_live + snaps + self.extra
        if total > self.tracked_peak:
            self.tracked_peak = total
        if self.saved_live > self.saved_peak:
            self.saved_peak = self.saved_live

    # context ----------------------------------------------------------------------------
    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.host_reset = reset_high_water_mark()
        self._host_base = process_status("VmRSS:")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._sample()
        if self.stats is not None:
            self.tracked_peak = max(self.tracked_peak,
                                    self.stats.snapshot_bytes_peak + self.extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        hwm = process_status("VmHWM:")
        self.host_peak = hwm - self._host_base if self.host_reset else hwm


class _Saved:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t
