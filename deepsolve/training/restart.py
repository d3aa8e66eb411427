"""Restart files: written atomically, read with every field checked, matched against the run
before anything is loaded.

``RUN_DIR/restart.pt`` (``torch.save``) holds the iteration to continue from, the model's,
optimiser's and scheduler's state dicts, the random state (:mod:`.rng`), the settings as JSON,
the problem file's sha256 and the problem's own ``state_dict(ctx)``. :func:`save_restart`
writes a temporary file, fsyncs it and renames it over the old one, so a kill at any moment
leaves the previous file intact; :func:`load_restart` refuses what is not a regular file, not
a dict, or has fields of the wrong type; :func:`restore` checks the model keys and shapes, the
optimiser's groups and per-parameter state, the random state and the settings against the
run, and loads only when everything fits. Errors are :class:`RestartError`, one line.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..config import RunConfig
from ..problem import Context, Problem
from .rng import check_rng_state, rng_state, rng_state_problem, set_rng_state

__all__ = ["RestartError", "save_restart", "load_restart", "restore", "changed_settings",
           "settings_dict", "remove_quietly"]


class RestartError(ValueError):
    """A restart file cannot be written, read or used; the message is one line naming it."""


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def settings_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as the plain dict that restart files and logs record."""
    return cfg.as_dict() if isinstance(cfg, RunConfig) else dict(cfg)


def save_restart(path: str, *, iteration: int, model, optimizer, scheduler, ctx: Context,
                 cfg: Mapping[str, Any], sha: str,
                 problem_state: dict | None = None,
                 stopping: Mapping[str, Any] | None = None) -> None:
    """Write the restart file atomically (``stopping``: the training time and why the run
    stopped, :meth:`.stopping.Stopping.state`): a temporary file ``PATH.tmp-<pid>`` in the same
    directory, fsync, then ``os.replace`` — a kill at any moment leaves the previous restart
    file intact. On failure (a full disk) the temporary file is removed and
    :class:`RestartError` says why."""
    payload = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "rng": rng_state(ctx),
        "config": json.dumps(settings_dict(cfg), default=str),
        "problem_sha256": sha,
        "problem": problem_state or {},
        **(stopping or {}),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)
        if isinstance(e, (OSError, RuntimeError)):
            why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
            prev = "the previous restart file is intact" if os.path.exists(path) else \
                "there is no restart file yet"
            raise RestartError(f"{path}: cannot write the restart file at iteration "
                               f"{iteration} ({why}); {prev}") from None
        raise


_REQUIRED = ("iteration", "model", "optimizer", "rng")


_TYPES: dict[str, tuple[type, ...]] = {
    "model": (Mapping,), "optimizer": (Mapping,), "rng": (Mapping,), "scheduler": (Mapping,),
    "problem": (Mapping,), "config": (str,), "problem_sha256": (str,),
    "elapsed": (float, int), "stopped": (str,), "stopped_by": (str,),
}


def load_restart(path: str) -> dict[str, Any]:
    """Load a restart file (``torch.load(weights_only=True)``; a FIFO, device or directory is
    refused before it is opened) and check its fields: a dict
    with ``iteration`` (an int >= 0), ``model``, ``optimizer`` and ``rng`` (dicts), and the
    optional fields of the right types. Raises :class:`RestartError` (one line)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RestartError(f"--resume: no restart file at {path}") from None
    except OSError as e:
        raise RestartError(f"{path}: cannot read the restart file "
                           f"({e.strerror or ' '.join(str(e).split())})") from None
    if not stat.S_ISREG(st.st_mode):   # a FIFO would block the open, a device read forever
        what = "a directory" if stat.S_ISDIR(st.st_mode) else \
            "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else \
            "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file"
        raise RestartError(f"{path}: not a regular file ({what}); a restart file is a regular "
                           "file written by deepsolve: move it away to start the run over")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise RestartError(f"--resume: no restart file at {path}") from None
    except Exception as e:
        why = " ".join(str(e).split()).split(". ")[0][:200].rstrip(" .")
        raise RestartError(f"--resume: cannot read the restart file {path} "
                           f"({type(e).__name__}: {why}); it is not a restart file written by "
                           "deepsolve, or it is damaged") from None
    if not isinstance(state, dict):
        raise RestartError(f"{path}: not a restart file (it holds a {type(state).__name__}, "
                           "not a dict)")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise RestartError(f"{path}: not a complete restart file: no "
                           f"{', '.join(map(repr, missing))}")
    for name, types in _TYPES.items():
        if name in state and not isinstance(state[name], types):
            raise RestartError(f"{path}: {name!r} is a {type(state[name]).__name__}, not a "
                               f"{'dict' if types == (Mapping,) else 'str'}")
    k = state["iteration"]
    if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.is_floating_point():
        k = int(k.item())
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise RestartError(f"{path}: 'iteration' is {type(k).__name__} {str(k)[:40]}, not an "
                           "integer")
    if k < 0:
        raise RestartError(f"{path}: 'iteration' is {k}; a restart file's iteration is >= 0")
    state["iteration"] = int(k)
    bad = _field_problem(state)
    if bad:
        raise RestartError(f"{path}: {bad}: the file is damaged or was edited; put back the "
                           "one the run wrote, or move it away to start the run over")
    steps = _optimizer_steps(state["optimizer"])
    if steps is not None and steps > k:
        raise RestartError(f"{path}: 'iteration' is {k} but the optimizer has taken {steps} "
                           "steps (one per iteration): the file's fields do not belong "
                           "together")
    return state


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
            n = _scalar(sched[key])
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
    checked (``name``: where, for the message); :func:`restore` compares all of them with
    the optimizer."""
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
        return f"'{name}' names parameter {_names([str(p) for p in twice])} twice"
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
        why = _bad_param_state(entry, pid, "")
        if why:
            detail = why.removeprefix("the optimizer's ")
            return f"'{name}' {detail}"
        shapes = {k: tuple(v.shape) for k, v in entry.items()
                  if k in _PARAM_SHAPED and isinstance(v, torch.Tensor)}
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


def _names(keys: list[str], at_most: int = 5) -> str:
    more = f" and {len(keys) - at_most} more" if len(keys) > at_most else ""
    return ", ".join(keys[:at_most]) + more


def _model_mismatch(model: torch.nn.Module, sd: Mapping[str, Any]) -> str | None:
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [str(k) for k in sd if k not in own]
    parts = []
    if missing:
        parts.append(f"missing {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected {_names(unexpected)}")
    shapes = []
    for k, v in own.items():
        if k in sd:
            w = sd[k]
            if not isinstance(w, torch.Tensor):
                shapes.append(f"{k} is a {type(w).__name__}")
            elif tuple(w.shape) != tuple(v.shape):
                shapes.append(f"{k} {tuple(w.shape)} in the restart, {tuple(v.shape)} in the "
                              "model")
    if shapes:
        parts.append("shape " + _names(shapes, 3))
    return "; ".join(parts) if parts else None


_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                 "acc_delta", "sum")


#: Per-parameter optimizer state that is >= 0 by construction (second moments, sums of
#: squares; Adam's step count).
_NONNEGATIVE_STATE = ("step", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum")


#: Hyperparameters in [0, 1) (each entry of ``betas``) or [0, 1].
_UNIT_OPEN = ("betas",)


_UNIT_CLOSED = ("momentum", "dampening", "rho")


def _scalar(v: Any) -> Any:
    """A one-element tensor as its Python number; anything else as it is."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return v


def _bad_setting(key: str, own: Any, got: Any) -> str | None:
    """Why ``got`` (a restart's value of the setting ``key``) cannot stand for ``own`` (the
    value the optimizer the problem builds has): a different type, a sign or a range that
    value cannot have, NaN; ``None`` when it fits."""
    own, got = _scalar(own), _scalar(got)
    shown = " ".join(repr(got).split())[:40]
    if own is None:                     # e.g. foreach=None: torch decides
        return None
    if isinstance(own, bool):
        return None if isinstance(got, bool) else f"is {shown}, not true or false"
    if isinstance(own, (int, float)):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"is {type(got).__name__} {shown}, not a number"
        if isinstance(own, int) and not isinstance(got, int):
            return f"is {shown}, not an integer"
        if math.isfinite(own) and not math.isfinite(got):
            return f"is {shown}, not a finite number"
        if own >= 0 > got:
            return f"is {shown}, negative (the optimizer's is {own!r})"
        if key in _UNIT_OPEN and not 0 <= got < 1:
            return f"is {shown}, outside [0, 1)"
        if key in _UNIT_CLOSED and not 0 <= got <= 1:
            return f"is {shown}, outside [0, 1]"
        return None
    if isinstance(own, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(own):
            return f"is {shown}, not {len(own)} values like the optimizer's {own!r}"
        for a, b in zip(own, got, strict=True):
            why = _bad_setting(key, a, b)
            if why:
                return f"is {shown}: an entry {why.removeprefix('is ')}"
        return None
    if isinstance(own, str) and not isinstance(got, str):
        return f"is {type(got).__name__} {shown}, not a string"
    return None


def _bad_param_state(entry: Mapping, pid: Any, at: str) -> str | None:
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


def _optimizer_mismatch(optimizer: Any, own: Mapping, got: Any, where: str = "") -> str | None:
    """What does not fit between an optimizer's own state dict and a restart's; None if
    nothing visible. Standard ``torch.optim`` layouts are compared group by group: the
    parameter mapping (the parameters' numbers in the groups, which torch's ``state_dict``
    writes as 0, 1, 2, ... in group order), every hyperparameter (type, sign, range,
    finite), the per-parameter moment buffers (shape, finite, >= 0 where they cannot be
    negative). Other layouts are compared by their keys, recursively, and their number,
    boolean and string entries as hyperparameters."""
    at = f" ({where[:-1]})" if where else ""
    if not isinstance(got, Mapping):
        return f"the optimizer state{at} is a {type(got).__name__}, not a dict"
    if "param_groups" in own:
        groups, st = got.get("param_groups"), got.get("state")
        if not isinstance(groups, list) or not isinstance(st, Mapping):
            return f"the optimizer state{at} has no 'param_groups' list and 'state' dict"
        if len(groups) != len(own["param_groups"]):
            return (f"the optimizer state{at} has {len(groups)} parameter group(s), the "
                    f"optimizer {len(own['param_groups'])}")
        ids: list[Any] = []
        own_ids: list[Any] = []
        for i, (g, o) in enumerate(zip(groups, own["param_groups"], strict=True)):
            if not isinstance(g, Mapping) or not isinstance(g.get("params"), list):
                return f"parameter group {i} of the optimizer state{at} has no 'params' list"
            if len(g["params"]) != len(o["params"]):
                return (f"parameter group {i} of the optimizer state{at} holds "
                        f"{len(g['params'])} parameters, the optimizer {len(o['params'])}")
            ids.extend(g["params"])
            own_ids.extend(o["params"])
            for key, value in o.items():
                if key in ("params", "param_names") or key not in g:
                    continue   # (a key an older torch did not write: its __setstate__ fills it)
                why = _bad_setting(key, value, g[key])
                if why:
                    return f"the optimizer's {key} in parameter group {i}{at} {why}"
        if ids != own_ids:
            return (f"the optimizer state's parameter mapping{at} {_names(list(map(str, ids)))} "
                    f"is not the optimizer's {_names(list(map(str, own_ids)))} (its moments "
                    "would go to other parameters)")
        extra = [str(k) for k in st if k not in set(own_ids)]
        if extra:
            return (f"the optimizer state{at} has entries for parameters {_names(extra)}, which "
                    "the optimizer does not have")
        for pid, entry in st.items():
            if isinstance(entry, Mapping):
                why = _bad_param_state(entry, pid, at)
                if why:
                    return why
        if not where and hasattr(optimizer, "param_groups"):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if len(params) == len(ids):
                for pid, p in zip(ids, params, strict=True):
                    entry = st.get(pid)
                    if not isinstance(entry, Mapping):
                        continue
                    for k in _PARAM_SHAPED:
                        v = entry.get(k)
                        if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(p.shape):
                            return (f"the optimizer's {k} of parameter {pid} has shape "
                                    f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
        return None
    missing = [str(k) for k in own if k not in got]
    if missing:
        return f"the optimizer state{at} has no {_names(missing)}"
    for k, v in own.items():
        if isinstance(v, Mapping):
            r = _optimizer_mismatch(optimizer, v, got[k], f"{where}{k}.")
        elif isinstance(v, (bool, int, float, str, torch.Tensor)):
            why = _bad_setting(str(k), v, got[k])
            r = f"the optimizer's {k}{at} {why}" if why else None
        else:
            r = None
        if r:
            return r
    return None


def _model_not_finite(model: torch.nn.Module, sd: Mapping[str, Any]) -> str | None:
    """The first entry of a restart's model state with NaN/inf where the model the problem
    builds has finite values."""
    for k, v in model.state_dict().items():
        w = sd.get(k)
        if isinstance(w, torch.Tensor) and (w.is_floating_point() or w.is_complex()) and \
                not bool(torch.isfinite(w).all()) and bool(torch.isfinite(v).all()):
            bad = "NaN" if bool(torch.isnan(w).any()) else "inf"
            return f"{k} holds {bad} (the file is damaged or was edited)"
    return None


def restore(path: str, state: dict[str, Any], problem: Problem, ctx: Context, optimizer: Any,
            scheduler: Any, problem_path: str, sha: str) -> list[str]:
    """Check a restart file's contents against the run (its model ``ctx.model``, optimiser,
    scheduler, random state and settings) and load them. Everything is checked before
    anything is loaded; one-line :class:`RestartError` naming what does not match (and the
    problem file's recorded hash when it differs). Returns the warnings (one line each) for
    the caller to print once the rest of the set-up has passed its checks: the problem file
    changed, or settings changed, but the restart still fits."""
    model = ctx.model
    assert model is not None  # build() checked it
    recorded = state.get("problem_sha256")
    changed = isinstance(recorded, str) and recorded != sha
    context = (f" (restart.pt was written for a problem file with sha256 {recorded}; "
            f"{problem_path} has {sha})") if changed else ""
    settings = changed_settings(state.get("config"), ctx.cfg.__dict__)
    if settings:
        context += (f"; settings changed since the restart file: {_names(settings, 4)} (resume "
                 "with the recorded ones, or start a new --out)")

    def fail(what: str) -> RestartError:
        return RestartError(f"{path} does not match this run: {what}{context}")

    why = _model_mismatch(model, state["model"])
    if why:
        raise fail(f"the model state has {why}")
    why = _model_not_finite(model, state["model"])
    if why:
        raise fail(f"the model state's {why}")
    why = _optimizer_mismatch(optimizer, optimizer.state_dict(), state["optimizer"])
    if why:
        raise fail(why)
    try:
        check_rng_state(state["rng"])
    except Exception as e:
        raise fail(f"the RNG state does not fit ({type(e).__name__}: "
                   f"{' '.join(str(e).split())[:200]})") from None
    steps = (("the problem state", lambda: problem.load_state_dict(ctx, state.get("problem")
                                                                   or {})),
             ("the model state", lambda: model.load_state_dict(state["model"])),
             ("the optimizer state", lambda: optimizer.load_state_dict(state["optimizer"])),
             ("the scheduler state", lambda: scheduler.load_state_dict(state["scheduler"])
              if scheduler is not None and state.get("scheduler") else None),
             ("the RNG state", lambda: set_rng_state(ctx, state["rng"])))
    for what, load in steps:
        try:
            load()
        except Exception as e:
            raise fail(f"{what} does not load ({type(e).__name__}: "
                       f"{' '.join(str(e).split())[:200]})") from None
    said: list[str] = []
    if changed:
        said.append(f"warning: {problem_path} has changed since {path} was written (recorded "
                    f"sha256 {recorded}, now {sha}); resuming with the changed file")
    if settings:
        said.append(f"warning: resuming with settings that differ from {path}'s: "
                    f"{_names(settings, 8)}")
    return said


#: Settings a resumed run may change without a warning: how long and how it runs, not what.
_RUN_CONTROL = frozenset({"iterations", "threads", "progress_every", "tensorboard"})


def changed_settings(recorded: Any, cfg: Mapping[str, Any]) -> list[str]:
    """``["width 4 -> 8", ...]``: the settings of ``cfg`` that differ from a restart file's
    recorded configuration (its JSON text), leaving out :data:`_RUN_CONTROL`; ``[]`` when
    nothing is recorded."""
    if not isinstance(recorded, str):
        return []
    try:
        old = json.loads(recorded)
    except ValueError:
        return []
    if not isinstance(old, dict):
        return []
    now = json.loads(json.dumps(dict(cfg), default=str))
    out = []
    for k in sorted(set(old) | set(now)):
        if k in _RUN_CONTROL or old.get(k) == now.get(k):
            continue
        out.append(f"{k} {old.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}")
    return out
