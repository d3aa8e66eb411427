"""The forward sweep's watch for a state that becomes NaN or inf.

A time stepper outside its stability region, an overflow or a division by zero turns the
state into NaN or inf, and every later step, the loss and the gradient inherit it: the
unroll would return garbage that looks like a result. :class:`FiniteCheck` is the engine's
watch over it, in every unroll:

* **where**: after each advance of the forward sweep (one action of the schedule: a few per
  unroll), at the end of the forward sweep, and every :data:`EVERY` steps of the plain and
  the open-ended loops — never per step;
* **how**: per floating leaf, ``isfinite(sum(x))`` (one reduction, no state-sized
  temporary: a NaN or inf element makes the sum NaN or inf), confirmed by
  ``isfinite(x).all()`` when the sum is not finite (a sum may overflow where no element
  does);
* **which step**: on failure the steps are replayed from ``x_0`` under the random-number
  state the unroll started with, without recording, until the first state with a
  non-finite leaf — ``x_{i+1} = step(x_i, i)`` names step ``i``; a compiled segment's own
  steps are then run eagerly to name the step inside it — and
  :class:`NonFiniteError` says so in one line, with the step's own diagnosis where the caller
  gives one (a reversible stepper's stability). The replay costs at most the steps already
  run, and only on failure.

Leaves of ``x_0`` that hold NaN or inf already (a sentinel, a mask) are not watched, nor
meta tensors (no values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .rng import RngState
from .state import Step

__all__ = ["FiniteCheck", "NonFiniteError", "EVERY", "all_finite"]

EVERY = 64
"""Steps between two checks of the plain and the open-ended loops."""


class NonFiniteError(FloatingPointError):
    """A state of the forward sweep became NaN or inf (one line: the step and the leaf)."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (one reduction; exact)."""
    if t.numel() == 0 or t.is_meta:  # a meta tensor has no values to check
        return True
    t = t.detach()
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


class FiniteCheck:
    """The watch of one unroll (see the module docstring).

    Args:
        step: the unroll's checked step.
        x0: the initial leaves.
        cuda: the CUDA devices whose generators the step may draw from.
        who: the error prefix (``"unroll"``).
        hint: called on failure for the step's own diagnosis (one clause), or ``None``.
    """

    __slots__ = ("step", "x0", "rng", "idx", "who", "hint")

    def __init__(self, step: Step, x0: Sequence[torch.Tensor], cuda: list[int],
                 who: str = "unroll", hint: Callable[[], str] | None = None):
        self.step = step
        self.x0 = [t.detach() for t in x0]
        self.idx = [k for k, t in enumerate(self.x0)
                    if (t.is_floating_point() or t.is_complex()) and all_finite(t)]
        self.rng = RngState.capture(cuda) if self.idx else None
        self.who = who
        self.hint = hint

    def __call__(self, leaves: Sequence[torch.Tensor], upto: int) -> None:
        """Raise :class:`NonFiniteError` when a watched leaf of ``leaves`` (``x_upto``) is not
        finite."""
        for k in self.idx:
            if not all_finite(leaves[k]):
                raise self.error(upto)

    def error(self, upto: int) -> NonFiniteError:
        """The error for a non-finite ``x_upto``, with the first bad step found by replay."""
        step, k, raised, where = self.locate(upto)
        what = f"x_{step + 1} = step(x_{step}, {step})"
        if raised:
            head = (f"the state became non-finite (NaN or inf) by {where} ({what} raised "
                    f"{raised} when replayed)")
        else:
            head = (f"the state became non-finite (NaN or inf) at {where}: {what} has "
                    f"non-finite values in state leaf {k} where x_{step} was finite")
        hint = ""
        if self.hint is not None:
            try:
                hint = self.hint()
            except Exception:  # a diagnosis must not hide the error it explains
                hint = ""
        if not hint:
            hint = ("an explicit step outside its stability region (reduce the time step), "
                    "an overflow or a division by zero; check the step at that state")
        return NonFiniteError(f"{self.who}: {head}; {hint}")

    def locate(self, upto: int) -> tuple[int, int, str, str]:
        """``(i, k, raised, where)``: the first step ``i < upto`` whose result has a
        non-finite watched leaf ``k``, replayed from ``x_0`` (``raised``: the exception a
        replayed step raised instead, by name; ``where``: the step in words). A step of
        compiled segments (``fn.eager_steps``) is found inside its segment by running the
        segment's own steps eagerly, and named by both. ``(upto - 1, k, "", ...)`` when the
        replay does not reproduce it."""
        step = self.step
        cur = list(self.x0)
        devices = list(self.rng.devices) if self.rng is not None else []
        inner = getattr(step.fn, "eager_steps", None)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            if self.rng is not None:
                self.rng.restore()
            for i in range(upto):
                rng = RngState.capture(devices) if inner is not None else None
                prev = cur
                try:
                    cur, _ = step(cur, i)
                except Exception as e:  # a step that fails on the non-finite state
                    return i, -1, type(e).__name__, f"step {i}"
                for k in self.idx:
                    if not all_finite(cur[k]):
                        if inner is None:
                            return i, k, "", f"step {i}"
                        assert rng is not None  # captured for segments
                        rng.restore()
                        return self._inside(inner, prev, i, k)
        last = max(upto - 1, 0)
        return last, self.idx[0] if self.idx else 0, "", f"step {last}"

    def _inside(self, inner: Callable, prev: list[torch.Tensor], j: int,
                k: int) -> tuple[int, int, str, str]:
        """The user's step inside segment ``j`` (from its start ``prev``) whose result is
        the first non-finite one."""
        step = self.step
        name = step.fn.steps_of(j) if hasattr(step.fn, "steps_of") else f"segment {j}"
        start = step._unflat(prev) if step.spec is not None else prev[0]
        last = j
        for i, x in inner(start, j):
            last = i
            leaves = [x] if step.spec is None else step._flat(x)
            if leaves is None:
                break
            for kk in self.idx:
                if not all_finite(leaves[kk]):
                    return i, kk, "", f"step {i}, in {name}"
        return last, k, "", name
