"""The trainer: problem file in, trained model, HDF5 log and restart files out.

``train("problems/navier_stokes.py", overrides={"iterations": 20})`` loads the problem,
builds its model and data, and runs the optimisation loop. Each iteration appends one row to
``RUN_DIR/log.h5`` (loss terms, times, peak memory, step counts, schedule, learning rate,
gradient norm, metrics); every ``checkpoint_every`` iterations, at the end, and when SIGTERM or
SIGUSR1 arrives (batch systems send these before killing a job) or SIGINT (Ctrl-C; a second
one stops at once) it flushes the log and then writes ``RUN_DIR/restart.pt`` atomically, so
the log always holds the restart file's rows.

Before any work — loading data, building the model, making the run directory — the
settings become one frozen :class:`~deepsolve.config.RunConfig` (:func:`resolve_config`):
every setting checked, the budget, device, dtype and thread count parsed, so a bad
``--budget``, ``--device`` or ``--set`` is a one-line error that leaves nothing behind. A
fresh run that fails before its first row (a ``build`` that raises, a ``BudgetError`` at the
first iteration, a Ctrl-C in the set-up) leaves no run directory either (the one this run
made is removed, by the trainer that made it and holds its lock).

A run directory has one writer (an exclusive ``flock`` on it, released by the kernel however
the trainer ends). A start decides from what the directory holds, before changing anything:
no restart file — start at iteration 0 (a log without one, from a run stopped before its first
restart file, is replaced; with neither, ``--resume`` is refused: nothing to resume); a
restart file — refused without ``--resume``; with it, the file's
fields are checked (types, ranges, iteration <= the log's rows) and matched against the run
(model keys and shapes, optimiser groups, RNG states) before the log is touched, then the log
rows after it are dropped, so the iteration column stays complete and strictly increasing.
See docs/problems.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import platform
import random
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from .config import (
    DEFAULT_THREADS,
    DTYPES,
    ConfigError,
    RunConfig,
    config_from_settings,
    horizon,
    parse_curriculum,
    resolve_threads,
    run_config,
)
from .memory.budget import BudgetError
from .memory.meter import host_high_water_mark, process_status, reset_high_water_mark
from .memory.strategies import Budget
from .problem import Context, Problem, ProblemError, load_problem

__all__ = ["train", "TrainResult", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE",
           "plan_problem", "RestartError",
           "RunDirBusy", "save_restart", "load_restart", "remove_stale_temporaries",
           "RunConfig", "ConfigError", "resolve_config", "DEFAULT_THREADS"]

#: Exit code of a run stopped by SIGTERM/SIGUSR1 after writing its restart file
#: (EX_TEMPFAIL: "try again"); a batch script requeues on it.
PREEMPTED_EXIT_CODE = 75

#: Exit code of a run stopped by SIGINT (Ctrl-C), after writing its restart file or, in its
#: set-up, before anything was trained (128 + SIGINT, what a shell reports for Ctrl-C).
INTERRUPTED_EXIT_CODE = 130

_DTYPES = DTYPES   # the dtype names a run may use (deepsolve.config.DTYPES)


@dataclass
class TrainResult:
    """What a training run produced."""

    run_dir: str
    log_path: str
    restart_path: str
    iterations: int          # iterations completed in total (including earlier, resumed ones)
    final_loss: float
    preempted: bool = False
    rank: int = 0            # this process's rank in a distributed run (only rank 0 writes)
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluate()'s values
    interrupted: bool = False  # stopped by SIGINT (Ctrl-C): the CLI exits with 130


def resolve_config(problem: Problem, overrides: Mapping[str, Any] | None = None,
                   sets: list[str] | None = None) -> RunConfig:
    """The run's frozen, validated configuration: problem defaults, then ``--set key=value``
    pairs (typed), then explicit options; see :func:`deepsolve.config.run_config`."""
    return run_config(problem, overrides, sets)


def apply_threads(threads: int) -> int:
    """Set torch's intra-op CPU threads for the run and return the count
    (:func:`deepsolve.config.resolve_threads`: ``threads`` when it is > 0; with 0,
    ``OMP_NUM_THREADS`` when it is set, else :data:`DEFAULT_THREADS`)."""
    n = resolve_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def run_threads(threads: int):
    """:func:`apply_threads` for the ``with`` block; the caller's count is restored after."""
    old = torch.get_num_threads()
    try:
        yield apply_threads(threads)
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def _rng_state(ctx: Context) -> dict[str, Any]:
    # numpy's stub types the result `dict | tuple`; legacy=True (the default) gives the tuple
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": list(random.getstate()[1]) + [random.getstate()[0]],
        "generator": ctx.generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def _set_rng_state(ctx: Context, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = state["python"]
    random.setstate((py[-1], tuple(py[:-1]), None))
    ctx.generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _check_rng_state(state: Any) -> None:
    """Raise if ``state`` (a restart's ``rng``) does not fit this process's generators;
    tried on scratch generators, so nothing is changed."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a {type(state).__name__}, not a dict")
    missing = [k for k in ("torch", "numpy", "python", "generator") if k not in state]
    if missing:
        raise KeyError(f"no {', '.join(missing)} state")
    torch.Generator().set_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.RandomState().set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss,
                                       gauss))
    py = state["python"]
    random.Random().setstate((py[-1], tuple(py[:-1]), None))
    torch.Generator().set_state(state["generator"])


class RestartError(ValueError):
    """A restart file cannot be written, read or used; the message is one line naming it."""


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def save_restart(path: str, *, iteration: int, model, optimizer, scheduler, ctx: Context,
                 cfg: Mapping[str, Any], sha: str,
                 problem_state: dict | None = None) -> None:
    """Write the restart file atomically: a temporary file ``PATH.tmp-<pid>`` in the same
    directory, fsync, then ``os.replace`` — a kill at any moment leaves the previous restart
    file intact. On failure (a full disk) the temporary file is removed and
    :class:`RestartError` says why."""
    payload = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "rng": _rng_state(ctx),
        "config": json.dumps(_settings(cfg), default=str),
        "problem_sha256": sha,
        "problem": problem_state or {},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp)
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
    steps = _optimizer_steps(state["optimizer"])
    if steps is not None and steps > k:
        raise RestartError(f"{path}: 'iteration' is {k} but the optimizer has taken {steps} "
                           "steps (one per iteration): the file's fields do not belong "
                           "together")
    return state


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


def _restore(path: str, state: dict[str, Any], problem: Problem, ctx: Context, model,
             optimizer, scheduler, problem_path: str, sha: str) -> None:
    """Check a restart file's contents against the run and load them. Everything is checked
    before anything is loaded; one-line :class:`RestartError` naming what does not match
    (and the problem file's recorded hash when it differs). Warns (one line) when the
    problem file changed but the restart still fits."""
    recorded = state.get("problem_sha256")
    changed = isinstance(recorded, str) and recorded != sha
    note = (f" (restart.pt was written for a problem file with sha256 {recorded}; "
            f"{problem_path} has {sha})") if changed else ""
    settings = changed_settings(state.get("config"), ctx.cfg.__dict__)
    if settings:
        note += (f"; settings changed since the restart file: {_names(settings, 4)} (resume "
                 "with the recorded ones, or start a new --out)")

    def fail(what: str) -> RestartError:
        return RestartError(f"{path} does not match this run: {what}{note}")

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
        _check_rng_state(state["rng"])
    except Exception as e:
        raise fail(f"the RNG state does not fit ({type(e).__name__}: "
                   f"{' '.join(str(e).split())[:200]})") from None
    steps = (("the problem state", lambda: problem.load_state_dict(ctx, state.get("problem")
                                                                   or {})),
             ("the model state", lambda: model.load_state_dict(state["model"])),
             ("the optimizer state", lambda: optimizer.load_state_dict(state["optimizer"])),
             ("the scheduler state", lambda: scheduler.load_state_dict(state["scheduler"])
              if scheduler is not None and state.get("scheduler") else None),
             ("the RNG state", lambda: _set_rng_state(ctx, state["rng"])))
    for what, load in steps:
        try:
            load()
        except Exception as e:
            raise fail(f"{what} does not load ({type(e).__name__}: "
                       f"{' '.join(str(e).split())[:200]})") from None
    if changed:
        _note(f"warning: {problem_path} has changed since {path} was written (recorded "
              f"sha256 {recorded}, now {sha}); resuming with the changed file")
    if settings:
        _note(f"warning: resuming with settings that differ from {path}'s: "
              f"{_names(settings, 8)}")


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


def _note(msg: str) -> None:
    """One line on stderr (the trainer's notes and warnings)."""
    print(f"deepsolve train: {msg}", file=sys.stderr, flush=True)


class _Preemption:
    """SIGTERM/SIGUSR1/SIGINT set a flag; the loop finishes the iteration, saves, and exits.

    SIGINT (Ctrl-C) is SIGTERM's twin with two differences. In the set-up, before the first
    iteration starts (``training`` is False), there is nothing to save: it raises
    ``KeyboardInterrupt`` at once and the start is abandoned (a run directory made for it is
    removed again). In the loop, the first one sets the flag and says so on stderr, and a
    second one stops at once. In the command line's process (``hard_second``) SIGINT's
    default action is restored after the first, so the second ends the process even inside a
    long native operation, like a SIGKILL at that moment: the log and the last restart file
    stay valid and paired, and ``--resume`` continues from that restart file. Called from a
    program (a notebook, whose kernel must survive) the second raises ``KeyboardInterrupt``
    instead; the log is closed on the way out, the restart file left as it was."""

    def __init__(self, hard_second: bool = False):
        self.signal: int | None = None
        self.interrupted = False     # a SIGINT arrived (the CLI exits with 130)
        self.training = False        # the loop has started: SIGINT stops after the iteration
        self.hard_second = hard_second
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            if not self.training or self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            if self.hard_second:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(signal.SIGINT, signal.SIG_DFL)   # the second: at once
            with contextlib.suppress(OSError):
                os.write(2, b"\ndeepsolve train: interrupted: the iteration in progress "
                            b"finishes, then the restart file is written; press Ctrl-C again "
                            b"to stop at once (--resume then continues from the last restart "
                            b"file)\n")
        if self.signal is None:
            self.signal = signum

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
                # restart interrupted system calls (SA_RESTART): a signal that arrives while
                # a rank waits in a collective must set the flag, not hand the
                # communication library an EINTR it may treat as fatal
                signal.siginterrupt(sig, False)
            except (ValueError, OSError):  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, old)


def _git_commit(path: str) -> str:
    try:
        out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(path)) or ".",
                              "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as the plain dict that restart files and logs record."""
    return cfg.as_dict() if isinstance(cfg, RunConfig) else dict(cfg)


def _attrs(problem_path: str, sha: str, cfg: Mapping[str, Any],
           device: torch.device) -> dict[str, Any]:
    from . import __version__

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine())
    return {
        "config": _settings(cfg),
        "problem_file": os.path.abspath(problem_path),
        "problem_sha256": sha,
        "deepsolve_version": __version__,
        "torch_version": str(torch.__version__),
        "cuda_version": torch.version.cuda or "",
        "device": str(device),
        "device_name": dev_name,
        "host": socket.gethostname(),
        "git_commit": _git_commit(problem_path),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python_version": sys.version.split()[0],
    }


def _check_terms(terms: Any, it: int) -> dict[str, torch.Tensor]:
    if not isinstance(terms, Mapping) or not terms:
        raise ProblemError(f"residuals() must return a non-empty dict of named loss terms, got "
                           f"{type(terms).__name__} at iteration {it}")
    for k, v in terms.items():
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            raise ProblemError(f"loss term {k!r} must be a scalar tensor, got "
                               f"{type(v).__name__}{tuple(getattr(v, 'shape', ()))}")
    return dict(terms)


def build(problem_path: str, cfg: RunConfig | Mapping[str, Any], rank: int = 0,
          world_size: int = 1) -> tuple[Problem, Context, str]:
    """Load the problem file and build it with the configuration ``cfg`` (settings that are
    not a :class:`RunConfig` yet are validated into one first, before the import)."""
    from .distributed import DistributedContext

    config = cfg if isinstance(cfg, RunConfig) else config_from_settings(cfg)
    problem, sha = load_problem(problem_path)
    ctx = DistributedContext(config.as_dict(), config.device, config.dtype, rank, world_size)
    torch.manual_seed(int(config["seed"]))
    np.random.seed(int(config["seed"]) % 2**32)
    random.seed(int(config["seed"]))
    problem.build(ctx)
    if not isinstance(ctx.model, torch.nn.Module):
        raise ProblemError(f"{problem_path}: build(ctx) must set ctx.model to an nn.Module, got "
                           f"{type(ctx.model).__name__}")
    return problem, ctx, sha


def train(problem_path: str, *, overrides: Mapping[str, Any] | None = None,
          sets: list[str] | None = None, out: str | None = None, resume: bool = False,
          quiet: bool = False, locking: bool | None = None) -> TrainResult:
    """Train ``problem_path``'s problem; see the module docstring. Returns a
    :class:`TrainResult`; ``preempted`` is set when a signal stopped the run early.

    Under torchrun (``WORLD_SIZE > 1``) every rank trains on its shard of the batch with
    averaged gradients, rank 0 alone writes the log and restart files, and a signal on any
    rank stops all of them after the same iteration (see :mod:`deepsolve.distributed`)."""
    from . import distributed as D

    problem0, _ = load_problem(problem_path)
    # every setting checked and parsed (budget, device, dtype, threads) before any work: a
    # bad one fails here, and nothing has been made
    config = run_config(problem0, overrides, sets)
    with run_threads(config.threads):   # the caller's thread count is restored after
        dist, device_name = D.setup(config["device"], float(config["dist_timeout"]))
        try:
            D.parse_mesh(config["mesh"], dist.world_size)   # a bad mesh fails before the build
            config = config.on_device(device_name)   # "cuda" -> "cuda:LOCAL_RANK" recorded
            res = _train(problem_path, config, dist, out, resume, quiet, locking)
            D.barrier(dist)  # the others wait for rank 0's restart file and log
            return res
        finally:
            D.cleanup(dist)


class _NoLog:
    """The log of ranks other than 0: they write nothing."""

    columns: list[str] = []

    def append(self, row):
        pass

    def flush(self, sync: bool = False):
        pass

    def close(self):
        pass

    def truncate_after(self, iteration):
        return 0

    def append_curve(self, *args):
        pass


_UNSUPPORTED_LOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL, errno.ENOSYS}


class RunDirBusy(ValueError):
    """Another trainer writes the run directory."""


class _RunLock:
    """One writer per run directory: an exclusive ``flock`` on the directory itself (on a
    lock file ``.deepsolve.lock`` inside it where a filesystem cannot lock directories). The
    kernel releases it when the process ends, however it ends, so a killed trainer leaves
    no lock behind. ``locking=False`` (``--no-file-locking``): where the filesystem supports
    no locks at all, run without one."""

    LOCK_FILE = ".deepsolve.lock"

    def __init__(self, run_dir: str, locking: bool | None):
        self.run_dir = run_dir
        self.fd: int | None = None
        self.path: str | None = None   # the locked file: None for the directory itself
        self.held = False
        self.gone = False              # the directory vanished before it could be opened
        err: OSError | None = None
        for path, flags in ((run_dir, os.O_RDONLY | os.O_DIRECTORY),
                            (os.path.join(run_dir, self.LOCK_FILE), os.O_RDWR | os.O_CREAT)):
            try:
                fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:   # removed since it was made: the caller makes it again
                self.gone = True
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                os.close(fd)
                raise RunDirBusy(
                    f"{run_dir}: another trainer{holder} is writing this run directory; wait "
                    "for it to end, or give another --out") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _UNSUPPORTED_LOCK:
                    raise
                err = e
                continue
            self.fd, self.held = fd, True
            self.path = None if path == run_dir else path
            return
        if locking is False:
            return
        why = err.strerror if err is not None and err.strerror else "not supported"
        raise ValueError(f"{run_dir}: cannot lock the run directory ({why}); the filesystem "
                         "does not support locks: retry with --no-file-locking (and make sure "
                         "no other trainer writes it)")

    def on(self, run_dir: str) -> bool:
        """Whether the locked file is still the one at its path (not removed or replaced
        since it was opened); True without a lock."""
        if self.gone:
            return False
        if self.fd is None:
            return True
        path = self.path if self.path is not None else run_dir
        try:
            a, b = os.fstat(self.fd), os.stat(path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.held = False


def _lock_holder(fd: int) -> str:
    """`` (pid N)`` of the process holding a flock on ``fd``'s file, from /proc/locks."""
    try:
        st = os.fstat(fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
                    return f" (pid {parts[4]})"
    except (OSError, ValueError):
        pass
    return ""


_TMP = re.compile(r"^(?:restart\.pt|log\.h5)\.tmp-(\d+)$|^log\.h5\.recover\.tmp$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temporaries(run_dir: str, *, all_of_them: bool = False) -> list[str]:
    """Remove the temporary files a killed or failed trainer left in ``run_dir``
    (``restart.pt.tmp-<pid>``, ``log.h5.tmp-<pid>``): those of dead processes, or all of them
    when the caller holds the run directory's lock (``all_of_them``). Returns their names."""
    removed: list[str] = []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if m is None:
            continue
        pid = int(m.group(1)) if m.group(1) else None
        if all_of_them or pid is None or pid == os.getpid() or not _pid_alive(pid):
            path = os.path.join(run_dir, name)
            if os.path.isfile(path) and not os.path.islink(path):
                _remove_quietly(path)
                removed.append(name)
    return removed


@dataclass
class _RunState:
    """How a run starts, as decided from what its directory holds."""

    start: int = 0                      # first iteration to train
    restart: dict[str, Any] | None = None
    resume_log: bool = False            # continue the existing log (else a new one)


def _inspect_run_dir(run_dir: str, log_path: str, restart_path: str, resume: bool,
                     iterations: int) -> _RunState:
    """Decide how to start from what the directory holds; one-line errors. Nothing is
    changed here: the restart file's fields and the log's rows are checked first.

    * nothing (no log, no restart file): a fresh run starts at iteration 0; ``--resume`` is
      refused (a mistyped ``--out`` must not start a new run in silence);
    * a log but no restart file (a run stopped before its first one): it cannot be
      continued; the run starts at iteration 0, with or without ``--resume``, and the log
      is replaced by the new run's, with a note saying so;
    * a restart file and no ``--resume``: refused (``--resume`` continues it);
    * ``--resume`` with a restart file at iteration k: the log must hold iterations 0..k-1;
      its rows after them are dropped (they are re-run).
    """
    from .io import LogError, log_iterations

    has_restart = os.path.lexists(restart_path)
    try:
        rows = log_iterations(log_path)
        log_err = None
    except LogError as e:
        rows, log_err = None, e
    if not has_restart:
        if log_err is not None:
            raise ValueError(f"{log_err}; there is no restart file either, so nothing in "
                             f"{run_dir} can be continued: move log.h5 away, or give another "
                             "--out")
        n = 0 if rows is None else len(rows)
        if resume and rows is None:
            raise ValueError(f"--resume: {run_dir} holds no run to resume (no log.h5, no "
                             "restart.pt); check --out, or run without --resume for a fresh "
                             "run")
        if resume:
            _note(f"--resume: {run_dir} holds no restart file (the run stopped before its "
                  f"first one): starting from iteration 0"
                  + (f"; the log's {n} rows are replaced" if n else ""))
        elif n:
            _note(f"{log_path} holds {n} rows but no restart file (the run stopped before "
                  "its first one): starting the run over; the new log replaces it")
        return _RunState()
    if not resume:
        raise ValueError(f"{run_dir} already holds a run (restart.pt); continue it with "
                         "--resume or give a new --out directory")
    state = load_restart(restart_path)
    k = state["iteration"]
    if k > iterations:
        raise RestartError(f"{restart_path} is at iteration {k}, past iterations={iterations}: "
                           f"nothing to train; give --iterations {k} or more to continue the "
                           "run")
    if k > 0:
        if log_err is not None:
            raise RestartError(f"{log_err}; the restart file (iteration {k}) needs the log's "
                               f"rows 0..{k - 1}")
        have = np.zeros(0, np.int64) if rows is None else rows
        if len(have) < k or not np.array_equal(have[:k], np.arange(k)):
            what = "no log" if rows is None else "no rows" if not len(have) else \
                f"{len(have)} rows (iterations {int(have[0])}..{int(have[-1])})"
            raise RestartError(
                f"{restart_path} is at iteration {k} but {log_path} has {what}, not "
                f"iterations 0..{k - 1}: the two do not belong together; move restart.pt away "
                "to start the run over, or put back the log that goes with it")
    return _RunState(start=k, restart=state, resume_log=rows is not None and len(rows) > 0)


def _train(problem_path: str, cfg: RunConfig, dist, out: str | None, resume: bool,
           quiet: bool, locking: bool | None) -> TrainResult:
    from . import distributed as D
    from .memory.offload import remove_stale_spill_dirs

    main = dist.is_main
    run_dir = out or os.path.join("runs", os.path.splitext(os.path.basename(problem_path))[0])
    log_path = os.path.join(run_dir, "log.h5")
    restart_path = os.path.join(run_dir, "restart.pt")
    from . import _cli_start

    # from here on a SIGTERM (or Ctrl-C) stops the run cleanly
    with _Preemption(hard_second=_cli_start()) as stop:
        lock: _RunLock | None = None
        created = False
        err: BaseException | None = None
        run = _RunState()
        if main:   # rank 0 alone writes, so it alone locks and checks the directory
            try:
                if resume and not os.path.isdir(run_dir):
                    raise ValueError(f"--resume: {run_dir} does not exist, so there is no run "
                                     "to resume; check --out, or run without --resume for a "
                                     "fresh run")
                created, lock = _make_and_lock(run_dir, locking)
                remove_stale_temporaries(run_dir, all_of_them=lock.held)
                remove_stale_spill_dirs()
                run = _inspect_run_dir(run_dir, log_path, restart_path, resume,
                                       int(cfg["iterations"]))
            except BaseException as e:
                err = e
        try:
            failed = D.any_rank(dist, err is not None, cfg.device)
        except BaseException:
            failed = True
            if err is None:
                raise
        if failed or err is not None:
            if lock is not None:   # a directory is removed only by the trainer that made it
                if created:        # and holds its lock (another may have locked it first)
                    _remove_empty_dir(run_dir)
                lock.release()
            if err is not None:
                raise err
            raise ValueError(f"rank 0 could not start the run in {run_dir} (see its message)")
        if not main and resume and os.path.lexists(restart_path):
            state = load_restart(restart_path)   # rank 0 has checked it against the log
            run = _RunState(start=state["iteration"], restart=state)
        try:
            res = _run(problem_path, cfg, dist, run, run_dir, log_path, restart_path, quiet,
                       locking, stop, created)
            res.interrupted = stop.interrupted
            return res
        finally:
            if lock is not None:
                lock.release()


def _make_dir(run_dir: str) -> bool:
    """Make the run directory (and its parents); True if this call made it. ``os.mkdir`` is
    atomic: of two trainers starting at the same instant exactly one makes it, so the other
    never takes it for its own (and never removes it)."""
    parent = os.path.dirname(os.path.abspath(run_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(run_dir)
        return True
    except FileExistsError:
        if os.path.isdir(run_dir):
            return False
        raise ValueError(f"--out {run_dir}: cannot make the run directory (File exists)") \
            from None
    except OSError as e:
        raise ValueError(f"--out {run_dir}: cannot make the run directory "
                         f"({e.strerror or e})") from None


def _make_and_lock(run_dir: str, locking: bool | None) -> tuple[bool, _RunLock]:
    """``(made by this call, lock)``: the run directory made if it is missing, and locked.
    A trainer that cannot lock it (:class:`RunDirBusy`: another holds it) leaves it alone.
    A directory removed between its creation and the lock (a failed start cleaning up what
    it made) is made and locked again, so the lock held is always on the directory at
    ``run_dir``."""
    for _ in range(20):
        created = _make_dir(run_dir)
        lock = _RunLock(run_dir, locking)
        if lock.on(run_dir):
            return created, lock
        lock.release()
    raise ValueError(f"--out {run_dir}: the run directory kept disappearing while the trainer "
                     "locked it (another program removes it?); give another --out")


def _remove_empty_dir(path: str) -> None:
    """Remove a run directory this run made, if nothing (but its lock file) is in it."""
    try:
        names = os.listdir(path)
        if names == [_RunLock.LOCK_FILE]:
            os.remove(os.path.join(path, _RunLock.LOCK_FILE))
            names = []
        if not names:
            os.rmdir(path)
    except OSError:
        pass


def _mirrored(log, logdir: str, start: int):
    """The log with its rows mirrored to TensorBoard event files in ``logdir`` (a resumed
    run hides the events a killed run wrote from ``start`` on)."""
    from .io.tracking import MirroredLog, TensorBoardMirror

    try:
        return MirroredLog(log, TensorBoardMirror(logdir, purge_step=start or None))
    except BaseException:
        log.close()
        raise


def _run(problem_path: str, cfg: RunConfig, dist, run: _RunState, run_dir: str,
         log_path: str, restart_path: str, quiet: bool, locking: bool | None,
         stop: _Preemption, created: bool) -> TrainResult:
    """Build the problem, restore the restart file, open the log and train."""
    from . import distributed as D

    main = dist.is_main
    budget = cfg.budget_bytes
    try:
        problem, ctx, sha = build(problem_path, cfg, dist.rank, dist.world_size)
        if budget is not None and cfg["budget_once"]:
            ctx.budget = budget
        _check_mesh(problem_path, dist, ctx)
        D.check_batch(dist, problem, ctx)
        model = ctx.model
        assert model is not None  # build() checked it
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ProblemError(f"{problem_path}: ctx.model has no trainable parameters")
        stages = parse_curriculum(cfg["curriculum"])
        if stages:  # the longest stage must fit before the first iteration
            _check_curriculum(problem_path, problem, ctx, stages)
        optimizer = problem.optimizer(ctx, params)
        scheduler = getattr(problem, "scheduler", lambda ctx, opt: None)(ctx, optimizer)
        if run.restart is not None:
            _restore(restart_path, run.restart, problem, ctx, model, optimizer, scheduler,
                     problem_path, sha)
            run.restart = None
        with torch.no_grad():  # the metric names fix the log's columns; a new log's baseline
            baseline = {k: float(v) for k, v in (problem.evaluate(ctx) or {}).items()}
    except BaseException:
        if created and main:
            _remove_empty_dir(run_dir)
        raise
    # a fresh run (no restart file) that fails or is interrupted before its first row
    # leaves nothing: its new log (and TensorBoard directory) and the run directory it made
    fresh = main and run.start == 0 and not os.path.lexists(restart_path)
    tb_dir = os.path.join(run_dir, cfg["tensorboard"]) if cfg["tensorboard"] else None
    tb_new = tb_dir is not None and not os.path.lexists(tb_dir)
    done = {"rows": False, "restart": False}
    try:
        return _train_loop(problem, ctx, cfg, dist, run, model, params, optimizer, scheduler,
                           stages, sha, baseline, budget, problem_path, run_dir, log_path,
                           restart_path, quiet, locking, stop, done)
    except BaseException:
        if fresh and not done["rows"] and not done["restart"]:
            _discard_start(run_dir, log_path, tb_dir if tb_new else None, created)
        raise


def _discard_start(run_dir: str, log_path: str, tb_dir: str | None, created: bool) -> None:
    """Remove what a fresh run made before it failed, or was interrupted, ahead of its first
    row: the new, empty log, the TensorBoard directory it made and, if it made it, the run
    directory (a directory that was there before is left, as it was)."""
    import shutil

    if os.path.isfile(log_path) and not os.path.islink(log_path):
        _remove_quietly(log_path)
    if tb_dir is not None and os.path.isdir(tb_dir) and not os.path.islink(tb_dir):
        shutil.rmtree(tb_dir, ignore_errors=True)
    if created:
        _remove_empty_dir(run_dir)


def _train_loop(problem, ctx, cfg: RunConfig, dist, run: _RunState, model, params, optimizer,
                scheduler, stages, sha: str, baseline: dict, budget, problem_path: str,
                run_dir: str, log_path: str, restart_path: str, quiet: bool,
                locking: bool | None, stop: _Preemption, done: dict) -> TrainResult:
    """Open the log and train from ``run.start``; ``done`` records whether a row or a
    restart file has been written."""
    from . import distributed as D
    from .io import H5Log
    from .memory.meter import MemoryMeter

    main = dist.is_main
    start = run.start
    log: H5Log | _NoLog  # or a MirroredLog (duck-typed as an H5Log)
    D.broadcast_model(dist, model)

    weights = problem.weights(ctx)
    attrs = dict(_attrs(problem_path, sha, cfg, ctx.device), world_size=dist.world_size,
                 threads=torch.get_num_threads())
    if budget is not None:
        attrs["budget_bytes"] = int(budget)
    attrs["weights"] = {k: float(v) for k, v in weights.items()}
    if not run.resume_log:   # before training: the model as built (kept by a resumed log)
        attrs["initial_metrics"] = baseline
    if main:   # the restart file and the log's rows have been checked: now the log changes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            log = H5Log(log_path, attrs=attrs, resume=run.resume_log, keep_through=start - 1,
                        locking=locking,
                        curves=("adjoint_norms",) if int(cfg["adjoint_every"]) else ())
        for w in caught:
            _note(" ".join(str(w.message).split()))
        if cfg["tensorboard"]:
            log = _mirrored(log, os.path.join(run_dir, cfg["tensorboard"]), start)
    else:
        log = _NoLog()
    bar = None
    try:
        iterations = int(cfg["iterations"])
        eval_every = int(cfg["eval_every"])
        ckpt_every = max(int(cfg["checkpoint_every"]), 1)
        clip = float(cfg["grad_clip"]) or math.inf
        adjoint_every = int(cfg["adjoint_every"])
        track = ctx.device.type == "cpu" and bool(cfg["budget"])
        memory_every = max(int(cfg.get("memory_every", 1)), 1)
        # optimizers that evaluate the loss themselves: L-BFGS and those saying so
        closure_opt = (isinstance(optimizer, torch.optim.LBFGS)
                       or bool(getattr(optimizer, "needs_closure", False)))

        def checkpoint(k: int) -> None:
            """The log's rows up to iteration k-1 reach the disk before the restart file at k is
            published, so a kill between the two leaves rows that resume drops, never a gap."""
            log.flush(sync=True)
            save_restart(restart_path, iteration=k, model=model, optimizer=optimizer,
                         scheduler=scheduler, ctx=ctx, cfg=cfg, sha=sha,
                         problem_state=problem.state_dict(ctx))
            done["restart"] = True

        last_loss = math.nan
        preempted = False
        it = start
        metrics = dict(baseline)
        stop.training = True   # from here on SIGINT stops after the iteration, as SIGTERM
        if D.any_rank(dist, stop.signal is not None, ctx.device):   # a signal during setup
            if main:
                checkpoint(start)
            preempted = True
        else:
            bar = _progress(iterations, start, quiet or not main,
                            float(cfg["progress_every"]))
            host_base = process_status("VmRSS:")  # the run's baseline for the real peak
            for it in range(start, iterations):
                D.broadcast_buffers(dist, model)
                if stages:
                    ctx.horizon = horizon(stages, it)
                adjoint = adjoint_every and it % adjoint_every == 0
                ctx.want_adjoint_norms = bool(adjoint)
                row, last_loss = _iteration(problem, ctx, model, params, optimizer, scheduler,
                                            weights, it, clip, closure_opt,
                                            track and it % memory_every == 0,
                                            MemoryMeter, dist, host_base)
                row["budget_bytes"] = _budget_bytes(ctx)
                if stages and (not log.columns or "n_steps" in log.columns):
                    row["n_steps"] = int(ctx.horizon)  # (a resumed log without it: left out)
                if adjoint:
                    _log_adjoint_norms(log, it, ctx.unroll_stats)
                _add_rank_peaks(dist, log, row, ctx.device)
                _fit_memory_columns(log, row)
                last = it == iterations - 1
                for k in baseline:
                    row[f"metric/{k}"] = math.nan
                if (eval_every and (it + 1) % eval_every == 0) or last:
                    with torch.no_grad():
                        for k, v in (problem.evaluate(ctx) or {}).items():
                            row[f"metric/{k}"] = metrics[k] = float(v)
                log.append(row)
                done["rows"] = True
                if bar is not None:
                    bar.update(it, last_loss, row)
                if not math.isfinite(last_loss):
                    log.flush()
                    raise FloatingPointError(f"the loss became {last_loss} at iteration {it}; "
                                             "lower the learning rate (--set lr=...)")
                stopping = D.any_rank(dist, stop.signal is not None, ctx.device)
                if main and (stopping or (it + 1) % ckpt_every == 0 or last):
                    checkpoint(it + 1)
                if stopping:
                    preempted = True
                    it += 1
                    break
            else:
                it = iterations
    finally:
        log.close()
        if bar is not None:
            bar.close()
    return TrainResult(run_dir, log_path, restart_path, it, last_loss, preempted, dist.rank,
                       metrics)


def _log_adjoint_norms(log, it: int, stats) -> None:
    """The adjoint norms of the iteration's first unroll, at most ``CURVE_WIDTH`` points
    evenly spread over its steps ``0..n`` (the first and the last included)."""
    from .io.h5log import CURVE_WIDTH

    norms = next((s.adjoint_norms for s in stats if isinstance(s.adjoint_norms, torch.Tensor)),
                 None)
    if norms is None:
        return
    n = len(norms) - 1
    steps = np.unique(np.round(np.linspace(0, n, min(n + 1, CURVE_WIDTH))).astype(np.int64))
    log.append_curve("adjoint_norms", it, steps, norms.numpy()[steps])


def _check_curriculum(problem_path: str, problem, ctx, stages) -> None:
    """Plan the problem's unroll at the curriculum's longest horizon under the run's budget
    (the first ``ctx.unroll`` of ``residuals(ctx, 0)``, not run; random generators left as
    they were): a horizon that does not fit fails now, with the minimum it needs, not at the
    stage where it starts."""
    longest = max(n for _, n in stages)
    if not ctx.budget:
        return
    from .memory.planner import plan

    state = ctx.generator.get_state()
    old = ctx.horizon
    ctx.horizon = longest
    try:
        cuda = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            req = ctx.first_unroll(lambda: problem.residuals(ctx, 0))
            if req is None or "budget" not in req.options:
                return
            b = req.options["budget"]
            try:
                if isinstance(b, Budget):   # a distributed run: planned across the ranks
                    plan(req.step, req.state, req.n_steps, budget=b.budget, group=b.group)
                else:
                    plan(req.step, req.state, req.n_steps, budget=b)
            except BudgetError as e:
                raise BudgetError(f"--set curriculum: its longest stage ({longest} steps) does "
                                  f"not fit the budget: {e}") from None
    finally:
        ctx.horizon = old
        ctx.generator.set_state(state)


def _check_mesh(problem_path: str, dist, ctx) -> None:
    """A distributed run's mesh after the build: ``--set mesh=DxS`` with ``S > 1`` needs a
    problem that decomposes its domain (``ctx.slab``), else each space rank would compute
    the whole loss and the sum over them would count it ``S`` times. Records the number of
    data ranks, the divisor of the gradient average."""
    if not dist.enabled:
        return
    mesh = ctx.mesh
    if mesh.space > 1 and not ctx.decomposed:
        raise ProblemError(f"--set mesh={ctx.cfg.mesh}: {problem_path} does not decompose its "
                           f"domain (ctx.slab), so {mesh.space} space ranks would compute the "
                           "same loss; drop the mesh setting (data parallelism over all "
                           "ranks) or decompose the grid with ctx.slab")
    dist.data_size = mesh.data


def _add_rank_peaks(dist, log, row, device) -> None:
    """Distributed runs: ``peak_device_memory_max``, ``peak_host_memory_max``,
    ``peak_real_memory_max`` and ``peak_tracked_memory_max``, the largest peak over the
    ranks (the columns without ``_max`` stay rank 0's). Each is kept in a resumed log that
    has it and left out of one that does not (columns are fixed)."""
    from .distributed import gather_floats, nanmax

    keys = ("peak_device_memory", "peak_host_memory", "peak_real_memory",
            "peak_tracked_memory")
    per_rank = gather_floats(dist, [row[k] for k in keys], device)
    if per_rank is None:
        return
    cols = log.columns
    for j, k in enumerate(keys):
        if (dist.enabled and not cols) or f"{k}_max" in cols:
            row[f"{k}_max"] = nanmax([r[j] for r in per_rank])


def _fit_memory_columns(log, row) -> None:
    """A log resumed from a run that did not log the real and tracked peaks keeps its
    columns (they are fixed by the first row): leave those two out of its rows."""
    cols = log.columns
    if cols:
        for k in _MEMORY_COLUMNS:
            if k not in cols:
                row.pop(k, None)


_MEMORY_COLUMNS = ("peak_real_memory", "peak_tracked_memory", "budget_bytes")


def _budget_bytes(ctx: Context) -> float:
    """The run's budget in bytes for the log row (NaN without one): the bytes resolved once
    at the start, or, with ``budget_once`` off, a ``"%"`` budget resolved again at the end of
    the iteration (what the next unroll will be given, up to memory that changes meanwhile)."""
    from .memory.budget import parse_budget

    b = ctx.budget
    if not b:
        return math.nan
    return float(b) if isinstance(b, (int, float)) else float(parse_budget(b, ctx.device))


def _iteration(problem, ctx, model, params, optimizer, scheduler, weights, it, clip,
               closure_opt, track, MemoryMeter, dist=None, host_base: int = 0):
    from .distributed import average_gradients

    dev = ctx.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        reset_high_water_mark()  # this iteration's real peak, where the kernel allows
    ctx.unroll_stats.clear()
    meter = MemoryMeter(dev, stats=_StatsSum(ctx.unroll_stats)) if track else None
    t0 = time.perf_counter()
    timing: dict[str, Any] = {}

    def evaluate_loss():
        optimizer.zero_grad(set_to_none=True)
        if meter is not None:   # this evaluation's unrolls (the earlier ones are released)
            meter.stats.start = len(ctx.unroll_stats)
        ta = time.perf_counter()
        terms = _check_terms(problem.residuals(ctx, it), it)
        # a tensor: _check_terms refused an empty dict (sum() types it `| Literal[0]`)
        loss = cast(torch.Tensor,
                    sum(float(weights.get(k, 1.0)) * v.reshape(()) for k, v in terms.items()))
        tb = time.perf_counter()
        loss.backward()
        if dist is not None and dist.enabled:  # average gradients, terms and loss over ranks
            terms, loss = average_gradients(dist, params, terms, loss)
        timing["forward"] = tb - ta
        timing["backward"] = time.perf_counter() - tb
        timing["terms"] = terms
        timing["loss"] = loss
        return loss

    if meter is not None:
        meter.__enter__()
    try:
        if closure_opt:
            optimizer.step(evaluate_loss)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
        else:
            evaluate_loss()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            optimizer.step()
    finally:
        if meter is not None:
            meter.__exit__(None, None, None)
    if scheduler is not None:
        scheduler.step()
    wall = time.perf_counter() - t0
    loss = float(timing["loss"].detach())
    row: dict[str, Any] = {"iteration": it, "loss": loss}
    for k, v in timing["terms"].items():
        row[f"loss/{k}"] = float(v.detach())
    row.update(time=wall, time_forward=timing["forward"], time_backward=timing["backward"])
    tracked = float(meter.tracked_peak) if meter is not None else math.nan
    hwm = host_high_water_mark()
    if dev.type == "cuda":
        row["peak_device_memory"] = float(torch.cuda.max_memory_allocated(dev) - base)
        row["peak_real_memory"] = row["peak_device_memory"]
    else:
        row["peak_device_memory"] = tracked
        row["peak_real_memory"] = float(max(hwm - host_base, 0))
    row["peak_tracked_memory"] = tracked
    row["peak_host_memory"] = float(hwm)
    stats = ctx.unroll_stats
    row["advances"] = sum(s.advances for s in stats)
    row["recorded"] = sum(s.recorded for s in stats)
    row["snapshots"] = max((s.snapshots_peak for s in stats), default=0)
    row["schedule"] = stats[0].schedule if stats else ""
    row["compile_time"] = float(sum(s.compile_time for s in stats))
    row["lr"] = float(optimizer.param_groups[0]["lr"])
    row["grad_norm"] = grad_norm
    return row, loss


class _StatsSum:
    """The snapshot bytes of the unrolls of one loss evaluation, for the memory meter: those
    from ``start`` on (an L-BFGS iteration evaluates the loss several times, one after the
    other; their unrolls never hold snapshots at once)."""

    def __init__(self, stats):
        self.stats = stats
        self.start = 0

    @property
    def snapshot_bytes_peak(self) -> int:
        return sum(s.snapshot_bytes_peak for s in self.stats[self.start:])


def _fmt_mem(x) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x / 2**20:.0f}MiB"


def _fmt_time(seconds: float) -> str:
    s = max(int(round(seconds)), 0)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class _Bar:
    """Progress on a terminal: a tqdm bar with the loss and the real peak."""

    def __init__(self, total: int, start: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True)

    def update(self, it: int, loss: float, row: Mapping[str, Any]) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3e}", mem=_fmt_mem(row.get("peak_real_memory")))

    def close(self) -> None:
        self.bar.close()


class _Lines:
    """Progress off a terminal (a redirected or batch run): one line on stderr after the
    first iteration, then after any iteration that ends ``every`` seconds or more after the
    last line, and after the last iteration: iterations done, loss, seconds per iteration
    (mean since the start), the iteration's real peak and the time left at that pace."""

    def __init__(self, total: int, start: int, every: float):
        self.total, self.start, self.every = total, start, every
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def update(self, it: int, loss: float, row: Mapping[str, Any]) -> None:
        now, done = time.perf_counter(), it + 1
        if self.last is not None and done < self.total and now - self.last < self.every:
            return
        self.last = now
        per = (now - self.t0) / max(done - self.start, 1)
        print(f"deepsolve train: iteration {done}/{self.total}  loss {loss:.4e}  "
              f"{per:.2f} s/it  peak {_fmt_mem(row.get('peak_real_memory'))}  "
              f"ETA {_fmt_time(per * (self.total - done))}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, start: int, quiet: bool, every: float = 30.0):
    """A tqdm bar on a terminal, one line per ``every`` seconds off it, nothing if quiet."""
    if quiet:
        return None
    return _Bar(total, start) if sys.stderr.isatty() else _Lines(total, start, every)


def plan_problem(problem_path: str, *, budget: str | int | None = None,
                 sets: list[str] | None = None, overrides: Mapping[str, Any] | None = None):
    """The plan ``train`` would use for the problem's unroll under ``budget`` (default: the
    problem's ``budget`` setting, as ``train`` uses it): builds the problem, captures its
    first ``ctx.unroll`` call and plans it."""
    problem0, _ = load_problem(problem_path)
    # the plan's budget is the run's: checked with the other settings, before the build
    config = run_config(problem0, {**(overrides or {}), "budget": budget}, sets)
    chosen = config.get("budget")
    if chosen in (None, "", 0) or (isinstance(chosen, str) and not chosen.strip()):
        raise ConfigError(f"plan {problem_path}: the problem has no default budget; give "
                          "--budget (e.g. --budget 2GiB or 80%)")
    with run_threads(config.threads):
        return _plan_problem(problem_path, config, chosen)


def _plan_problem(problem_path: str, cfg: RunConfig, budget: str | int):
    from .memory.planner import plan

    problem, ctx, _ = build(problem_path, cfg)
    req = ctx.first_unroll(lambda: problem.residuals(ctx, 0))
    if req is not None:
        return plan(req.step, req.state, req.n_steps, budget=budget)
    raise ProblemError(f"{problem_path} does not unroll (its residuals never call ctx.unroll), "
                       "so there is no schedule to plan")
