"""What a restart file must hold, field by field: its contents judged on their own, before
the run they are for is known.

:func:`restart_problem` takes what ``torch.load`` returned and says what is wrong with it,
naming the field, or ``None``: a dict with ``iteration`` (an int >= 0, and no fewer than the
steps its optimiser records), ``model`` (parameter names to tensors), ``optimizer`` (groups of
distinct parameter ids, per-parameter state with step counts >= 0, finite moments — second
moments >= 0 — of one shape), ``rng`` (:func:`.rng.rng_state_problem`); and the optional
fields of the right types and ranges: ``scheduler`` (its counters), ``config`` (the JSON
object of the settings), ``problem_sha256`` (a SHA-256), ``elapsed`` (finite, >= 0),
``stopped`` / ``stopped_by`` (a reason the trainer writes). It raises nothing and changes
nothing; :func:`.restart.load_restart` turns its answer into a one-line
:class:`~.restart.RestartError`. Matching the contents against the run (the model's keys and
shapes, the optimiser's groups and settings) is :func:`.restart.restore`'s; the checks of one
parameter's optimiser state (:func:`param_state_problem`) serve both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .rng import rng_state_problem

__all__ = ["restart_problem", "param_state_problem", "PARAM_SHAPED", "listed", "scalar"]


_REQUIRED = ("iteration", "model", "optimizer", "rng")


_TYPES: dict[str, tuple[type, ...]] = {
    "model": (Mapping,), "optimizer": (Mapping,), "rng": (Mapping,), "scheduler": (Mapping,),
    "problem": (Mapping,), "config": (str,), "problem_sha256": (str,),
    "elapsed": (float, int), "stopped": (str,), "stopped_by": (str,),
}


def restart_problem(state: Any) -> str | None:
    """What is wrong with a restart file's contents (what ``torch.load`` returned), as the
    rest of a one-line message after the file's name; ``None`` when every field is well
    formed (see the module docstring). ``state["iteration"]`` may still be a one-element
    integer tensor or a numpy integer: the caller makes it an ``int``."""
    if not isinstance(state, dict):
        return f"not a restart file (it holds a {type(state).__name__}, not a dict)"
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        return f"not a complete restart file: no {', '.join(map(repr, missing))}"
    for name, types in _TYPES.items():
        if name in state and not isinstance(state[name], types):
            return (f"{name!r} is a {type(state[name]).__name__}, not a "
                    f"{'dict' if types == (Mapping,) else 'str'}")
    k = state["iteration"]
    if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.is_floating_point():
        k = int(k.item())
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        return f"'iteration' is {type(k).__name__} {str(k)[:40]}, not an integer"
    if k < 0:
        return f"'iteration' is {k}; a restart file's iteration is >= 0"
    bad = _field_problem(state)
    if bad:
        return (f"{bad}: the file is damaged or was edited; put back the one the run wrote, "
                "or move it away to start the run over")
    steps = _optimizer_steps(state["optimizer"])
    if steps is not None and steps > k:
        return (f"'iteration' is {k} but the optimizer has taken {steps} steps (one per "
                "iteration): the file's fields do not belong together")
    return None


def _shown(v: Any) -> str:
    """``v`` for an error message: its repr on one line, at most 40 characters."""
    return " ".join(repr(v).split())[:40]


def _field_problem(state: Mapping[str, Any]) -> str | None:
    """What is wrong with a restart file's fields taken on their own (before the run is
    known), naming the field; ``None`` when every field is well formed. The required fields
    and the types of the optional ones were checked before; here: the model's entries are
    tensors; the optimizer's groups, parameter ids and per-parameter state (step counts
    >= 0, moments finite, one shape per parameter); the scheduler's counters; the RNG
    states (:func:`.rng.rng_state_problem`); ``config`` the JSON object of the settings;
    ``problem_sha256`` a SHA-256; ``elapsed`` finite and >= 0; ``stopped`` and
    ``stopped_by`` a reason the trainer writes."""
    for k, v in state["model"].items():
        if not isinstance(k, str):
            return f"'model' has a key {_shown(k)}, not a parameter or buffer name"
        if not isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):
            return f"'model' entry {k!r} is a {type(v).__name__}, not a tensor"
    why = _optimizer_problem(state["optimizer"])
    if why:
        return why
    sched = state.get("scheduler") or {}
    for key, low in (("last_epoch", -1), ("_step_count", 0)):
        if key in sched:
            n = scalar(sched[key])
            if isinstance(n, bool) or not isinstance(n, int) or n < low:
                return f"'scheduler' {key} is {_shown(sched[key])}, not an integer >= {low}"
    why = rng_state_problem(state["rng"])
    if why:
        return why
    if "config" in state:
        try:
            cfg = json.loads(state["config"])
        except ValueError as e:
            return (f"'config' is not JSON ({_shown(state['config'])}: "
                    f"{str(e).split(':')[0]})")
        if not isinstance(cfg, dict):
            return f"'config' is a JSON {type(cfg).__name__}, not the object of the settings"
    sha = state.get("problem_sha256")
    if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
        return f"'problem_sha256' is {_shown(sha)}, not a SHA-256 (64 hex digits)"
    if "elapsed" in state:
        t = state["elapsed"]
        if isinstance(t, bool) or not math.isfinite(t) or t < 0:
            return f"'elapsed' is {_shown(t)}, not a finite number of seconds >= 0"
    return _stopped_problem(state.get("stopped", ""), state.get("stopped_by", ""))


def _stopped_problem(reason: str, by: str) -> str | None:
    """Why ``stopped`` / ``stopped_by`` are not what :meth:`.stopping.Stopping.state`
    writes: ``""`` and ``""``; ``"target NAME VALUE <= LEVEL"`` and ``"NAME:LEVEL"``;
    ``"time_limit M min"`` and the limit in seconds."""
    if reason == "":
        return None if by == "" else f"'stopped_by' is {_shown(by)} but 'stopped' is empty"
    if reason.startswith("target "):
        name, _, level = by.rpartition(":")
        try:
            ok = bool(name) and math.isfinite(float(level)) and float(level) > 0
        except ValueError:
            ok = False
        return None if ok else (f"'stopped_by' is {_shown(by)}, not the NAME:LEVEL of the "
                                "target the run reached")
    if reason.startswith("time_limit "):
        try:
            ok = math.isfinite(float(by)) and float(by) > 0
        except ValueError:
            ok = False
        return None if ok else (f"'stopped_by' is {_shown(by)}, not the time limit in "
                                "seconds (> 0)")
    return f"'stopped' is {_shown(reason)}, not a reason the trainer writes (target, time_limit)"


def _optimizer_problem(opt: Mapping, name: str = "optimizer") -> str | None:
    """What is wrong with a ``torch.optim`` state dict on its own: ``param_groups`` a list
    of dicts whose ``params`` are distinct integer ids >= 0, ``state`` a dict of those ids
    to dicts, each with a step count >= 0, finite moments (second moments >= 0) of one
    shape. An optimizer of its own that nests such state dicts (Adam then L-BFGS) has each
    checked (``name``: where, for the message); :func:`.restart.restore` compares all of
    them with the optimizer."""
    if "param_groups" not in opt and "state" not in opt:
        for key, sub in opt.items():
            why = _optimizer_problem(sub, f"{name}.{key}") if isinstance(sub, Mapping) else None
            if why:
                return why
        return None
    groups, st = opt.get("param_groups"), opt.get("state")
    if not isinstance(groups, list) or not isinstance(st, Mapping):
        return f"'{name}' has no 'param_groups' list and 'state' dict"
    ids: list[int] = []
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), list):
            return f"'{name}' parameter group {i} has no 'params' list"
        for pid in g["params"]:
            if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
                return (f"'{name}' parameter group {i} names the parameter {_shown(pid)}, "
                        "not an id >= 0")
            ids.append(pid)
    if len(set(ids)) != len(ids):
        twice = sorted({p for p in ids if ids.count(p) > 1})
        return f"'{name}' names parameter {listed([str(p) for p in twice])} twice"
    for pid, entry in st.items():
        if pid not in set(ids):
            return (f"'{name}' has state for parameter {_shown(pid)}, which no parameter "
                    "group holds")
        if not isinstance(entry, Mapping):
            return (f"'{name}' state of parameter {pid} is a {type(entry).__name__}, not "
                    "a dict")
        step = entry.get("step")
        if isinstance(step, torch.Tensor) and step.numel() != 1:
            return (f"'{name}' step of parameter {pid} is a tensor of shape "
                    f"{tuple(step.shape)}, not one count")
        why = param_state_problem(entry, pid, "")
        if why:
            detail = why.removeprefix("the optimizer's ")
            return f"'{name}' {detail}"
        shapes = {k: tuple(v.shape) for k, v in entry.items()
                  if k in PARAM_SHAPED and isinstance(v, torch.Tensor)}
        if len(set(shapes.values())) > 1:
            return (f"'{name}' state of parameter {pid} has moments of different shapes "
                    f"({', '.join(f'{k} {v}' for k, v in shapes.items())})")
    return None


def _optimizer_steps(opt_state: Mapping) -> int | None:
    """The most steps a standard ``torch.optim`` state records (Adam's ``step``), if any."""
    st = opt_state.get("state")
    if not isinstance(st, Mapping):
        return None
    most = None
    for entry in st.values():
        v = entry.get("step") if isinstance(entry, Mapping) else None
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            most = int(v) if most is None else max(most, int(v))
    return most


def listed(keys: list[str], at_most: int = 5) -> str:
    """``"a, b, c and 2 more"``: at most ``at_most`` of ``keys``, for a one-line message."""
    more = f" and {len(keys) - at_most} more" if len(keys) > at_most else ""
    return ", ".join(keys[:at_most]) + more


#: Per-parameter optimizer state of the parameter's own shape (the moments).
PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                "acc_delta", "sum")


#: Per-parameter optimizer state that is >= 0 by construction (second moments, sums of
#: squares; Adam's step count).
_NONNEGATIVE_STATE = ("step", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum")


def scalar(v: Any) -> Any:
    """A one-element tensor as its Python number; anything else as it is."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return v


def param_state_problem(entry: Mapping, pid: Any, at: str) -> str | None:
    """What is wrong with one parameter's optimizer state (moments, step count): non-finite
    values, or negative ones where they cannot be."""
    for k, v in entry.items():
        tensors = [v] if isinstance(v, torch.Tensor) else \
            [t for t in v if isinstance(t, torch.Tensor)] if isinstance(v, (list, tuple)) else []
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                if not bool(torch.isfinite(t).all()):
                    return f"the optimizer's {k} of parameter {pid}{at} is not finite (NaN/inf)"
            if k in _NONNEGATIVE_STATE and not t.is_complex() and t.numel() and \
                    bool((t < 0).any()):
                return (f"the optimizer's {k} of parameter {pid}{at} is negative "
                        f"({float(t.min()):.4g}); it is >= 0 in any run")
        if k == "step" and not isinstance(v, torch.Tensor):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or v < 0:
                return (f"the optimizer's step of parameter {pid}{at} is "
                        f"{' '.join(repr(v).split())[:40]}, not a count >= 0")
    return None
