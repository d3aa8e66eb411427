r"""Adam, then L-BFGS: the usual PINN optimiser schedule, as one optimizer object.

:class:`AdamLBFGS` takes ``switch_at`` Adam steps, then L-BFGS steps (``torch.optim.LBFGS``
with a strong-Wolfe line search; ``max_iter`` inner iterations per step). It is a subclass of
``torch.optim.LBFGS``, so deepsolve's trainer calls ``step(closure)`` for every step of both
phases (it does so for any ``LBFGS`` instance); the closure recomputes the loss and its
gradient, which is all Adam needs as well.

* The phase follows the optimizer's own step count (saved in its ``state_dict``), so a
  resumed run continues in the right phase.
* Loss rescaling (``rescale=True``): ``torch.optim.LBFGS`` has absolute thresholds — it only
  stores a curvature pair when :math:`y^\top s > 10^{-10}` and stops when the loss changes by
  less than ``tolerance_change`` — which PINN losses of :math:`10^{-6}` and below (in float32
  in particular) fall under, after which every step fails its line search and nothing moves.
  The optimizer therefore hands L-BFGS the loss (and gradient) times a scale set to
  ``1/loss`` when L-BFGS starts, and re-normalises (clearing the L-BFGS memory) whenever the
  scaled loss has dropped below ``rescale_below``, or a step made no progress. The trainer
  still sees and logs the true loss and gradient.
* A step that ends on a non-finite loss or parameters (a line search lost in round-off, seen
  in float32 at a stalled loss) is undone: the parameters go back to where the step started,
  the memory is cleared and the loss is evaluated there again (``nonfinite_steps`` counts
  these).
* ``param_groups[0]["lr"]`` (what the trainer logs) holds the active phase's learning rate.
* The trainer's gradient clipping does not apply to closure optimisers.

:func:`switch_precision` casts a model (in place, so optimisers holding its parameters stay
valid) and the tensors of a problem's data to another dtype: the PINN problem files run Adam
in float32 and L-BFGS in float64, where float32 round-off would stall the line search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch

__all__ = ["AdamLBFGS", "AdamWarmup", "switch_precision"]


def flat_parameters(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters' values, flattened and concatenated (detached), ``(P,)``."""
    return torch.nn.utils.parameters_to_vector(params).detach()


def load_flat_parameters(params: Iterable[torch.Tensor], theta: torch.Tensor) -> None:
    """Copy the flat vector ``theta`` (``(P,)``, as :func:`flat_parameters` lays it out)
    into the parameters, in place (they stay the same tensors, not views of ``theta``)."""
    with torch.no_grad():
        a = 0
        for p in params:
            p.copy_(theta[a:a + p.numel()].view_as(p))
            a += p.numel()


def switch_precision(model: torch.nn.Module, data: MutableMapping[str, Any] | None,
                     dtype: torch.dtype) -> bool:
    """Cast ``model``'s floating parameters and buffers and the floating tensors among the
    values of ``data`` to ``dtype``; returns whether anything changed.

    The parameters stay the same ``Parameter`` objects (``Module.to`` swaps their ``.data``),
    so an optimizer created before keeps working; state it already holds (Adam's moments)
    keeps its old dtype, so switch where that state is no longer used — at the Adam → L-BFGS
    switch of :class:`AdamLBFGS`, before L-BFGS builds its state."""
    if not dtype.is_floating_point:
        raise ValueError(f"switch_precision needs a floating dtype, got {dtype}")
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), dtype)
    changed = current != dtype
    if changed:
        model.to(dtype=dtype)
    for k, v in list((data or {}).items()):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
            assert data is not None  # it has items
            data[k] = v.to(dtype)
            changed = True
    return changed


class AdamLBFGS(torch.optim.LBFGS):
    """Adam for ``switch_at`` steps, then L-BFGS (strong Wolfe).

    Args:
        params: the parameters (one group).
        switch_at: number of Adam steps (0 = L-BFGS only).
        adam_lr: Adam's learning rate; ``adam_kwargs`` go to ``torch.optim.Adam``.
        lr, max_iter, max_eval, tolerance_grad, tolerance_change, history_size: L-BFGS
            settings (``max_iter`` inner iterations per step).
        rescale: normalise the loss handed to L-BFGS (see the module docstring).
        rescale_below: re-normalise when the scaled loss is below this.
        max_scale: the largest scale (a loss at round-off level gains nothing from more).
        on_step: called as ``on_step(k)`` before step ``k`` (the optimizer's own step
            count, which the trainer's iteration equals); when it returns True — it changed
            the parameters' dtype, say, by :func:`switch_precision` — the L-BFGS memory
            and loss scale are reset, so the next L-BFGS step starts afresh. This is the
            safe place for such a change: inside the closure L-BFGS already holds state.
    """

    def __init__(self, params: Iterable[torch.Tensor], switch_at: int, adam_lr: float = 1e-3,
                 lr: float = 1.0, max_iter: int = 20, max_eval: int | None = None,
                 tolerance_grad: float = 1e-9, tolerance_change: float = 1e-12,
                 history_size: int = 50, adam_kwargs: dict | None = None,
                 rescale: bool = True, rescale_below: float = 1e-6, max_scale: float = 1e12,
                 on_step: Callable[[int], bool] | None = None):
        params = list(params)
        super().__init__(params, lr=lr, max_iter=max_iter, max_eval=max_eval,
                         tolerance_grad=tolerance_grad, tolerance_change=tolerance_change,
                         history_size=history_size, line_search_fn="strong_wolfe")
        if int(switch_at) < 0:
            raise ValueError(f"switch_at must be >= 0, got {switch_at}")
        self.adam = torch.optim.Adam(params, lr=adam_lr, **(adam_kwargs or {}))
        self.switch_at = int(switch_at)
        self.lbfgs_lr = float(lr)
        self.steps_taken = 0
        self.rescale = bool(rescale)
        self.rescale_below = float(rescale_below)
        self.max_scale = float(max_scale)
        self.scale = 0.0          # 0: set from the first L-BFGS loss
        self.restarts = 0
        self.nonfinite_steps = 0  # L-BFGS steps undone because they ended on NaN/inf
        self.on_step = on_step
        self._show_lr()

    @property
    def phase(self) -> str:
        """``"adam"`` or ``"lbfgs"``: what the next step does."""
        return "adam" if self.steps_taken < self.switch_at else "lbfgs"

    def _show_lr(self) -> None:
        lr = self.adam.param_groups[0]["lr"] if self.phase == "adam" else self.lbfgs_lr
        self.param_groups[0]["lr"] = lr

    def step(self, closure: Callable[[], torch.Tensor]):  # type: ignore[override]
        if closure is None:
            raise ValueError("AdamLBFGS.step needs a closure that returns the loss after "
                             "calling backward()")
        if self.on_step is not None and self.on_step(self.steps_taken):
            self.state[self._params[0]].clear()
            self.scale = 0.0
            for st in self.adam.state.values():  # Adam's moments follow the parameters
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                        st[k] = v.to(self._params[0].dtype)
        if self.phase == "adam":
            with torch.enable_grad():
                loss = closure()
            self.adam.step()
        else:
            self.param_groups[0]["lr"] = self.lbfgs_lr
            loss = self._lbfgs_step(closure) if self.rescale else super().step(closure)
        self.steps_taken += 1
        self._show_lr()
        return loss

    def _params_with_grad(self):
        return [p for p in self.param_groups[0]["params"] if p.grad is not None]

    def _scale_for(self, loss: float) -> float:
        if not (loss > 0 and loss < float("inf")):
            return self.scale if self.scale > 0 else 1.0
        return min(1.0 / loss, self.max_scale)

    def _restart(self) -> None:
        """Forget the L-BFGS memory: the next iteration starts with steepest descent."""
        self.state[self._params[0]].clear()
        self.restarts += 1

    def _lbfgs_step(self, closure):
        seen: list[float] = []

        def scaled():
            loss = closure()
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            if self.scale <= 0:
                self.scale = self._scale_for(value)
            seen.append(value)
            with torch.no_grad():
                for p in self._params_with_grad():
                    p.grad.mul_(self.scale)
            return loss * self.scale

        params = self.param_groups[0]["params"]
        before = [p.detach().clone() for p in params]
        try:
            orig = super().step(scaled)
            finite = all(math.isfinite(v) for v in seen[-1:]) and all(
                bool(torch.isfinite(p).all()) for p in params)
        except IndexError:  # torch's strong-Wolfe search fails this way on NaN losses
            if all(math.isfinite(v) for v in seen):
                raise
            finite = False
        if not finite:
            # a line search that ran into round-off (float32 at a stalled loss) can end on
            # NaN: go back to the point before the step, forget the memory, re-evaluate there
            with torch.no_grad():
                for p, b in zip(params, before, strict=True):
                    p.copy_(b)
            self._restart()
            self.scale = 0.0
            seen.clear()
            orig = scaled()
            self.nonfinite_steps += 1
        with torch.no_grad():  # the trainer reads the true gradient after the step
            for p in self._params_with_grad():
                p.grad.div_(self.scale)
        if not finite:
            return orig.detach() / self.scale
        start, end = seen[0], min(seen)  # no progress: no evaluation beat the start
        new = self._scale_for(end)
        if (end * self.scale < self.rescale_below and new > self.scale) or not end < start:
            self.scale = new
            self._restart()
        return orig.detach() / self.scale if isinstance(orig, torch.Tensor) else orig

    def state_dict(self) -> dict:
        self.param_groups[0]["lr"] = self.lbfgs_lr
        lbfgs = super().state_dict()
        self._show_lr()
        return {"steps_taken": self.steps_taken, "switch_at": self.switch_at,
                "scale": self.scale, "restarts": self.restarts,
                "adam": self.adam.state_dict(), "lbfgs": lbfgs}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict["lbfgs"])
        self.adam.load_state_dict(state_dict["adam"])
        self.steps_taken = int(state_dict["steps_taken"])
        self.scale = float(state_dict.get("scale", 0.0))
        self.restarts = int(state_dict.get("restarts", 0))
        self.lbfgs_lr = float(self.param_groups[0]["lr"])
        self._show_lr()


class AdamWarmup(torch.optim.Optimizer):
    """Adam for ``warmup`` steps, then ``second`` — a closure optimizer (``needs_closure``,
    such as :class:`~deepsolve.pinn.GaussNewton` or
    :class:`~deepsolve.pinn.SelfScaledBroyden`).

    Every step takes the trainer's closure; the phase follows the optimizer's own step count
    (in its ``state_dict`` with both optimizers' states), so a resumed run continues in the
    right phase. ``on_step(k)`` is called before step ``k`` (a precision switch goes there:
    ``second`` builds its state, in the parameters' dtype, at its first step); when it
    returns True in the second phase, ``second.reset()`` (if it has one) drops the
    curvature it gathered, as :class:`AdamLBFGS` clears its memory.
    ``param_groups[0]["lr"]`` shows Adam's learning rate during the warm-up and 1 after.

    Args:
        params: the parameters (one group).
        second: the optimizer that follows (over the same parameters).
        warmup: Adam steps first (0: ``second`` only).
        adam_lr, adam_kwargs: Adam's settings.
        on_step: the hook above.
    """

    needs_closure = True

    def __init__(self, params: Iterable[torch.Tensor], second: torch.optim.Optimizer,
                 warmup: int = 0, adam_lr: float = 1e-3, adam_kwargs: dict | None = None,
                 on_step: Callable[[int], object] | None = None):
        params = list(params)
        super().__init__(params, {"lr": float(adam_lr)})
        if int(warmup) < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.adam = torch.optim.Adam(params, lr=adam_lr, **(adam_kwargs or {}))
        self.second = second
        self.warmup = int(warmup)
        self.steps_taken = 0
        self.on_step = on_step
        self._show_lr()

    @property
    def phase(self) -> str:
        """``"adam"`` or ``"second"``: what the next step does."""
        return "adam" if self.steps_taken < self.warmup else "second"

    def _show_lr(self) -> None:
        self.param_groups[0]["lr"] = (self.adam.param_groups[0]["lr"] if self.phase == "adam"
                                      else 1.0)

    def step(self, closure: Callable[[], torch.Tensor]):  # type: ignore[override]
        if closure is None:
            raise ValueError("AdamWarmup.step needs a closure that returns the loss after "
                             "calling backward()")
        if (self.on_step is not None and self.on_step(self.steps_taken)
                and self.phase == "second" and hasattr(self.second, "reset")):
            self.second.reset()   # the objective changed: forget the curvature
        loss: Any
        if self.phase == "adam":
            with torch.enable_grad():
                loss = closure()
            self.adam.step()
        else:
            loss = self.second.step(closure)  # type: ignore[arg-type]  # returns the loss
        self.steps_taken += 1
        self._show_lr()
        return loss

    def state_dict(self) -> dict:
        return {"steps_taken": self.steps_taken, "warmup": self.warmup,
                "adam": self.adam.state_dict(), "second": self.second.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.adam.load_state_dict(state_dict["adam"])
        self.second.load_state_dict(state_dict["second"])
        self.steps_taken = int(state_dict["steps_taken"])
        self._show_lr()
