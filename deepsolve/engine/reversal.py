"""Reversal: the inverse of a reversible step, checked, and the drift of rebuilt states.

A reversible step ``x_{i+1} = f_i(x_i)`` comes with an inverse ``x_i = f_i^{-1}(x_{i+1})``
(``step.inverse(state, i)``; :mod:`deepsolve.reversible` builds such steps). The reverse
sweep of the reversible schedule (:mod:`deepsolve.schedules.reversible`) rebuilds every
state from the next one by the inverse instead of storing or recomputing it. In floating
point the rebuilt ``x~_i`` differs from the forward sweep's ``x_i``: each inverse step adds
rounding, and an inverse that is unstable (an amplification ``|d f^{-1} / dx| > 1``, as
``1 / lambda`` in the McCallum–Foster coupling) amplifies it. :class:`Reversal` holds what the
executor needs about it:

* :meth:`Reversal.leaves` — the user's inverse on flat leaves, its result checked like a
  step's (structure, shapes, dtypes);
* :meth:`Reversal.check_pair` — before the forward sweep: the inverse must give back ``x_0``
  from ``f_0(x_0)`` within the tolerance, and the step must draw no random numbers (a
  random draw cannot be inverted); each failure is one line;
* :func:`relative_error` — the measure of drift, per leaf
  ``max |x~ - x| / max |x|`` (absolute where ``x`` is zero), the largest over the leaves;
* :func:`default_tolerance` — ``sqrt(eps)`` of the state's least precise floating dtype
  (``1.5e-8`` for float64, ``3.5e-4`` for float32): half the digits may be lost.

The executor measures the drift wherever a rebuilt state meets its stored snapshot and
either raises :class:`ReconstructionError` or recomputes the window (``on_drift``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .replay import Replay
from .rng import RngState
from .state import Step, is_diff

__all__ = ["Reversal", "ReconstructionError", "relative_error", "default_tolerance",
           "ON_DRIFT"]

#: what a reversible unroll does when a rebuilt state drifts beyond the tolerance
ON_DRIFT = ("raise", "recompute")


class ReconstructionError(RuntimeError):
    """A state rebuilt by a reversible step's inverse drifted beyond the tolerance."""


def relative_error(rebuilt: Sequence[torch.Tensor], exact: Sequence[torch.Tensor]) -> float:
    """The drift of ``rebuilt`` against ``exact`` (flat leaves): per leaf
    ``max |rebuilt - exact| / max |exact|`` (the absolute error where ``exact`` is zero,
    equality for integer leaves), the largest over the leaves; ``inf`` for NaN."""
    worst = 0.0
    for a, b in zip(rebuilt, exact, strict=True):
        if not is_diff(b):
            if not torch.equal(a, b):
                return math.inf
            continue
        if b.numel() == 0:
            continue
        d = float((a - b).abs().max())
        s = float(b.abs().max())
        e = d / s if s > 0 else d
        if not e <= worst:  # larger, or NaN
            worst = e if e == e else math.inf
    return worst


def default_tolerance(meta: Sequence[tuple]) -> float:
    """``sqrt(eps)`` of the least precise floating dtype among the leaves' ``(shape, dtype,
    device)``; ``sqrt(eps(float64))`` when none is floating."""
    eps = [torch.finfo(dt).eps for _, dt, _ in meta if dt.is_floating_point or dt.is_complex]
    return math.sqrt(max(eps, default=torch.finfo(torch.float64).eps))


class Reversal:
    """The inverse of one unroll's reversible step and its drift control.

    Args:
        inverse: ``inverse(state, i) -> state``: ``x_i`` from ``x_{i+1}`` (the user's
            structure).
        step: the checked step wrapper of the unroll (its structure and metadata).
        tolerance: the largest relative drift accepted (:func:`relative_error`); ``None``:
            :func:`default_tolerance`.
        on_drift: ``"raise"`` (:class:`ReconstructionError`) or ``"recompute"`` (the
            executor recomputes the window from its snapshot with revolve).
        advice: what the caller knows of the inverse and of how the schedule was chosen
            (one clause), for the drift error; empty: the generic advice.
    """

    def __init__(self, inverse: Callable[[Any, int], Any], step: Step,
                 tolerance: float | None = None, on_drift: str = "raise", advice: str = ""):
        if not callable(inverse):
            raise TypeError(f"unroll: the step's inverse must be callable as inverse(state, i),"
                            f" got {type(inverse).__name__}")
        if on_drift not in ON_DRIFT:
            raise ValueError(f"unroll: on_drift must be 'raise' or 'recompute', got "
                             f"{on_drift!r}")
        if tolerance is None:
            tolerance = default_tolerance(step.meta)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or \
                not tolerance > 0:
            raise ValueError(f"unroll: the reconstruction tolerance must be a number > 0, got "
                             f"{tolerance!r}")
        self.fn = inverse
        self.step = step
        self.tolerance = float(tolerance)
        self.on_drift = on_drift
        self.advice = advice

    def leaves(self, nxt: list[torch.Tensor], i: int) -> list[torch.Tensor]:
        """``x_i`` from ``x_{i+1}`` (flat leaves) by the inverse, checked like a step's
        result."""
        step = self.step
        res = self.fn(step._unflat(nxt), i)
        flat = step._flat(res)
        if flat is None:
            raise step.structure_error(res, "the step's inverse returned", f" at step {i}")
        step.fast_check(flat, i)
        return flat

    def check_pair(self, x0: list[torch.Tensor], replay: Replay) -> None:
        """Step 0 and its inverse on ``x_0``, before the forward sweep: the step must draw no
        random numbers, and ``inverse(step(x_0, 0), 0)`` must be ``x_0`` within the
        tolerance; a one-line error otherwise. Costs one step and one inverse (and one more
        step when the pair fails: a step whose result changes from call to call draws
        random numbers from a generator no capture sees, such as a numpy ``Generator``)."""
        before = RngState.capture(replay.cuda, host=True)
        with torch.no_grad():
            x1, _ = self.step.first(list(x0), 0)
            after = RngState.capture(replay.cuda, host=True)
            moved = (["torch's generator"] if not before.same_torch(after) else []) + \
                before.moved_host(after)
            if moved:
                raise ValueError(
                    f"unroll: the reversible schedule needs a step that draws no random "
                    f"numbers, but step 0 drew some ({', '.join(moved)}; an inverse cannot "
                    "give them back); use Revolve(s) or budget= for a stochastic step")
            back = self.leaves(x1, 0)
        err = relative_error(back, x0)
        if err <= self.tolerance:
            return
        before.restore()
        with torch.no_grad():
            again, _ = self.step(list(x0), 0)
        if relative_error(again, x1) > 0:
            raise ValueError(
                "unroll: the reversible schedule needs a deterministic step, but step 0 gave "
                "two different results from x_0 (it draws random numbers from a generator "
                "deepsolve cannot replay, such as a numpy Generator, or runs a "
                "nondeterministic operation); use Revolve(s) or budget= for such a step")
        raise ValueError(
            f"unroll: the step's inverse does not invert it: inverse(step(x_0, 0), 0) "
            f"differs from x_0 by {err:.3g} (relative), above the tolerance "
            f"{self.tolerance:.3g}; check step.inverse (it must return x_i from x_(i+1))")
