"""Replay: run a recomputed step under the random-number and autocast state of its first run.

A step that draws random numbers (dropout, stochastic forcing) must draw the same numbers
when the reverse sweep recomputes it, and a step run under ``torch.autocast`` must be
recorded under the same autocast settings, or the gradient is that of another function.
:class:`Replay` is that state for one unroll: the CUDA devices whose generators matter, the
autocast settings in force when the unroll started, and whether to replay random numbers
at all. ``capture()`` is stored with each snapshot, ``restore(rng)`` puts it back before the
recomputation from that snapshot, and ``reverse_sweep()`` is the context of the whole reverse
sweep: the caller's generators are forked (left as they were afterwards) and the forward
sweep's autocast settings are re-entered.

A step that draws no random numbers leaves the generators as they were, so every snapshot
would hold an identical copy of their state (5 KiB for the CPU generator: more than a small
state itself). ``capture()`` therefore returns the previous capture when the generators have
not moved since — one shared object, compared with ``torch.equal`` — and a deterministic step
pays for one RNG state per unroll, not one per snapshot, while a stochastic one keeps exactly
the states it needs. Nothing is assumed about the step: a step that draws only now and then
gets a new state exactly at the snapshots after a draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .rng import RngState

__all__ = ["Replay", "Autocast", "autocast_state", "cuda_devices"]


def cuda_devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The indices of the CUDA devices the tensors live on, sorted."""
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def autocast_state() -> list[tuple[str, torch.dtype]]:
    """The autocast settings in force: ``[(device_type, dtype), ...]`` for enabled ones."""
    out = []
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError):  # pragma: no cover - backend missing
            pass
    return out


class Autocast:
    """Re-enter the settings of :func:`autocast_state` (``cache``: autocast's cast cache)."""

    def __init__(self, state: list[tuple[str, torch.dtype]], cache: bool = True):
        self.ctx = [torch.autocast(dev, dtype=dt, cache_enabled=cache) for dev, dt in state]

    def __enter__(self):
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


class Replay:
    """The random-number and autocast state of one unroll; see the module docstring.

    Args:
        cuda: the CUDA devices whose generators are captured (:func:`cuda_devices`).
        preserve_rng: whether random numbers are replayed; when false, ``capture`` returns
            ``None`` and ``restore(None)`` does nothing.
    """

    __slots__ = ("cuda", "preserve_rng", "autocast", "last")

    def __init__(self, cuda: list[int], preserve_rng: bool):
        self.cuda = cuda
        self.preserve_rng = preserve_rng
        self.autocast = autocast_state()
        self.last: Any = None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], preserve_rng: bool = True) -> Replay:
        """The replay state for an unroll over ``tensors`` (state leaves and parameters)."""
        return cls(cuda_devices(tensors), preserve_rng)

    def capture(self) -> Any:
        """The generators' state now, or ``None`` when random numbers are not replayed; the
        previous capture itself when the generators have not moved since (shared, not
        copied)."""
        if not self.preserve_rng:
            return None
        now = RngState.capture(self.cuda)
        last = self.last
        if last is not None and now.same_torch(last):
            return last
        self.last = now
        return now

    def restore(self, rng: Any) -> None:
        """Put back a state from :meth:`capture` (``None``: nothing to do)."""
        if rng is not None:
            rng.restore()

    @contextlib.contextmanager
    def reverse_sweep(self) -> Iterator[None]:
        """The context of a reverse sweep: the caller's generators forked (restored on exit)
        when random numbers are replayed, the forward sweep's autocast settings entered."""
        with contextlib.ExitStack() as stack:
            if self.preserve_rng:
                stack.enter_context(torch.random.fork_rng(devices=self.cuda))
            stack.enter_context(Autocast(self.autocast))
            yield
