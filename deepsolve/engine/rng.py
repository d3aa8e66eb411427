"""One record of random-generator state: :class:`RngState`.

Three parts of deepsolve put generators back where they were: the engine replays a
recomputed step under the state of its first run (:mod:`.replay`: torch's CPU generator and
the CUDA generators of the unroll's devices), ``check_gradients`` runs the same loss twice
from one state and names a global generator the loss drew from (the host generators too:
Python's ``random`` and numpy's global one), and the trainer writes all of them into a
restart file so that a resumed run draws the numbers the run it continues would have
(:mod:`deepsolve.training.rng`). All three capture and restore this record;
``host=True`` adds the host generators, which the engine's hot path leaves out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RngState", "cuda_generators"]


def cuda_generators() -> list[int]:
    """Every CUDA device whose generator may have been used: all visible devices once CUDA
    is initialised, none before (reading them would initialise CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


@dataclass(frozen=True, eq=False, slots=True)
class RngState:
    """The state of torch's CPU generator (``cpu``), of the CUDA generators of ``devices``
    (``cuda``, in the same order) and, when captured with ``host=True``, of Python's
    ``random`` (``python``, as ``random.getstate()``) and numpy's global generator
    (``numpy``, as ``np.random.get_state()``, the legacy tuple)."""

    cpu: torch.Tensor
    devices: tuple[int, ...] = ()
    cuda: tuple[torch.Tensor, ...] = ()
    python: Any = None
    numpy: Any = None

    @classmethod
    def capture(cls, devices: Sequence[int] = (), host: bool = False) -> RngState:
        """The generators' state now: the CPU generator, those of the CUDA ``devices``, and
        with ``host`` Python's and numpy's."""
        devs = tuple(devices)
        cuda = tuple(torch.cuda.get_rng_state(d) for d in devs)
        if not host:
            return cls(torch.get_rng_state(), devs, cuda)
        return cls(torch.get_rng_state(), devs, cuda, random.getstate(), np.random.get_state())

    @classmethod
    def everything(cls) -> RngState:
        """Every generator a computation may draw from: the CPU's, every CUDA generator in
        use (:func:`cuda_generators`), Python's and numpy's."""
        return cls.capture(cuda_generators(), host=True)

    def restore(self) -> None:
        """Put every generator of the record back (those it did not capture are left)."""
        torch.set_rng_state(self.cpu)
        for d, st in zip(self.devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(st, d)
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)

    def same_torch(self, other: RngState) -> bool:
        """Whether torch's generators (CPU and the CUDA devices) are in the same state."""
        return (self.devices == other.devices and torch.equal(self.cpu, other.cpu)
                and all(torch.equal(a, b) for a, b in zip(self.cuda, other.cuda, strict=True)))

    def moved_host(self, later: RngState) -> list[str]:
        """The host generators whose state differs in ``later`` (both captured with
        ``host=True``), by name."""
        out = []
        if self.python != later.python:
            out.append("Python's random module")
        a, b = self.numpy, later.numpy
        if a is not None and b is not None and (
                a[2] != b[2] or a[3] != b[3] or not np.array_equal(a[1], b[1])):
            out.append("numpy's global generator (np.random.*)")
        return out
