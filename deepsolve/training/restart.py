"""Restart files: written atomically, read with every field checked, matched against the run
before anything is loaded.

``RUN_DIR/restart.pt`` (``torch.save``) holds the iteration to continue from, the model's,
optimiser's and scheduler's state dicts, the random state (:mod:`.rng`), the settings as JSON,
the problem file's sha256 and the problem's own ``state_dict(ctx)``. :func:`save_restart`
writes a temporary file, fsyncs it and renames it over the old one, so a kill at any moment
leaves the previous file intact; :func:`load_restart` refuses what is not a regular file, and
contents that are not what a restart file holds, field by field (:mod:`.restart_check`);
:func:`restore` checks the model keys and shapes, the optimiser's groups and per-parameter
state, the random state and the settings against the run, and loads only when everything
fits. Errors are :class:`RestartError`, one line.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from typing import Any

import torch

from ..config import RunConfig
from ..problem import Context, Problem
from .restart_check import PARAM_SHAPED, listed, param_state_problem, restart_problem, scalar
from .rng import check_rng_state, rng_state, set_rng_state

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


def load_restart(path: str) -> dict[str, Any]:
    """Load a restart file (``torch.load(weights_only=True)``; a FIFO, device or directory is
    refused before it is opened) and check its fields (:func:`.restart_check.restart_problem`):
    a dict with ``iteration`` (an int >= 0, returned as an ``int``), ``model``, ``optimizer``
    and ``rng`` (dicts), and the optional fields of the right types, each well formed. Raises
    :class:`RestartError` (one line)."""
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
    bad = restart_problem(state)
    if bad:
        raise RestartError(f"{path}: {bad}")
    state["iteration"] = int(scalar(state["iteration"]))
    return state


def _model_mismatch(model: torch.nn.Module, sd: Mapping[str, Any]) -> str | None:
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [str(k) for k in sd if k not in own]
    parts = []
    if missing:
        parts.append(f"missing {listed(missing)}")
    if unexpected:
        parts.append(f"unexpected {listed(unexpected)}")
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
        parts.append("shape " + listed(shapes, 3))
    return "; ".join(parts) if parts else None


#: Hyperparameters in [0, 1) (each entry of ``betas``) or [0, 1].
_UNIT_OPEN = ("betas",)


_UNIT_CLOSED = ("momentum", "dampening", "rho")


def _bad_setting(key: str, own: Any, got: Any) -> str | None:
    """Why ``got`` (a restart's value of the setting ``key``) cannot stand for ``own`` (the
    value the optimizer the problem builds has): a different type, a sign or a range that
    value cannot have, NaN; ``None`` when it fits."""
    own, got = scalar(own), scalar(got)
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
            return (f"the optimizer state's parameter mapping{at} {listed(list(map(str, ids)))} "
                    f"is not the optimizer's {listed(list(map(str, own_ids)))} (its moments "
                    "would go to other parameters)")
        extra = [str(k) for k in st if k not in set(own_ids)]
        if extra:
            return (f"the optimizer state{at} has entries for parameters {listed(extra)}, which "
                    "the optimizer does not have")
        for pid, entry in st.items():
            if isinstance(entry, Mapping):
                why = param_state_problem(entry, pid, at)
                if why:
                    return why
        if not where and hasattr(optimizer, "param_groups"):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if len(params) == len(ids):
                for pid, p in zip(ids, params, strict=True):
                    entry = st.get(pid)
                    if not isinstance(entry, Mapping):
                        continue
                    for k in PARAM_SHAPED:
                        v = entry.get(k)
                        if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(p.shape):
                            return (f"the optimizer's {k} of parameter {pid} has shape "
                                    f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
        return None
    missing = [str(k) for k in own if k not in got]
    if missing:
        return f"the optimizer state{at} has no {listed(missing)}"
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
        context += (f"; settings changed since the restart file: {listed(settings, 4)} (resume "
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
                    f"{listed(settings, 8)}")
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
