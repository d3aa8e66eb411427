"""Peak-memory meters for CUDA and CPU.

``with MemoryMeter(device, stats=s) as m: ...`` measures what the code inside adds at its
peak:

* ``m.cuda_peak`` — on CUDA, ``torch.cuda.max_memory_allocated`` above the allocation on
  entry (reset on entry);
* ``m.host_peak`` — the process high-water mark (``VmHWM``) above the resident size on entry,
  after resetting the mark through /proc/self/clear_refs where the kernel allows
  (``m.host_reset`` says whether it could);
* ``m.tracked_peak`` — the bytes deepsolve itself holds: tensors saved for backward (counted
  by :class:`~deepsolve.memory.saved.SavedTensors`: unique storages, not leaves that require
  grad, which are the caller's parameters and inputs; ``m.saved_live`` and ``m.saved_peak``
  are this part alone), device snapshots (from the :class:`~deepsolve.UnrollStats` passed as
  ``stats``, updated by the executor) and stacked outputs. This is the CPU measure the budget
  is checked against.
"""

from __future__ import annotations

import torch

from .saved import SavedTensors

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
        self.tracked_peak = 0
        self.cuda_peak = 0
        self.host_peak = 0
        self.host_reset = False
        self._saved = SavedTensors(on_grow=self._sample)

    @property
    def saved_live(self) -> int:
        """Bytes saved for backward now (unique storages)."""
        return self._saved.live

    @property
    def saved_peak(self) -> int:
        """The most bytes saved for backward at once."""
        return self._saved.peak

    def _sample(self) -> None:  # each time the saved bytes grow, and on exit
        snaps = self.stats.snapshot_bytes_peak if self.stats is not None else 0
        self.tracked_peak = max(self.tracked_peak, self._saved.live + snaps + self.extra)

    # context ----------------------------------------------------------------------------
    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.host_reset = reset_high_water_mark()
        self._host_base = process_status("VmRSS:")
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        self._sample()
        if self.stats is not None:
            self.tracked_peak = max(self.tracked_peak,
                                    self.stats.snapshot_bytes_peak + self.extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        hwm = process_status("VmHWM:")
        self.host_peak = hwm - self._host_base if self.host_reset else hwm

