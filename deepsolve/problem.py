"""Problem files: what a user writes to train something with deepsolve.

A problem file is a plain Python file that defines ``problem``, an instance of a
:class:`Problem` subclass::

    import torch
    import deepsolve

    class Decay(deepsolve.Problem):
        defaults = {"iterations": 50, "lr": 0.05, "steps": 200, "dt": 0.01}

        def build(self, ctx):
            ctx.model = torch.nn.Linear(1, 1)            # what the optimiser trains
            ctx.data = {"target": torch.tensor(0.3)}

        def step(self, ctx, x, i):                       # one solver step (unrolled problems)
            return x + ctx.cfg.dt * ctx.model(x[..., None])[..., 0]

        def residuals(self, ctx, iteration):            # named loss terms
            x0 = torch.ones(8, device=ctx.device, dtype=ctx.dtype)
            xT = ctx.unroll(self.step, x0)             # checkpointed, under the budget
            return {"misfit": (xT.mean() - ctx.data["target"]) ** 2}

    problem = Decay()

The trainer (:mod:`deepsolve.train`) builds a :class:`Context`, calls :meth:`Problem.build`
once, then every iteration :meth:`Problem.residuals`, weights and sums the terms, steps the
optimiser and logs each term, times, memory and step counts to the HDF5 log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from types import MethodType, SimpleNamespace
from typing import Any, NamedTuple, cast

import torch

from .engine import UnrollStats
from .memory.strategies import Reversible
from .unroll import unroll

__all__ = ["Problem", "Context", "load_problem", "ProblemError", "TRAINER_DEFAULTS",
           "check_settings", "parse_compile"]


class ProblemError(ValueError):
    """A problem file is missing, broken, or does not define ``problem`` correctly."""


#: Defaults every problem has; a problem's own ``defaults`` add to and override them.
TRAINER_DEFAULTS: dict[str, Any] = {
    "iterations": 100,       # optimiser steps
    "lr": 1e-3,              # learning rate
    "steps": 100,            # unroll length for ctx.unroll
    "budget": "",            # memory budget for ctx.unroll ("" = none: snapshots or store_all)
    "snapshots": 0,          # revolve slots when no budget is given (0 = store_all)
    "reversible": 0,         # > 0: rebuild states by the step's inverse, with this many
                             # snapshots (deepsolve.Reversible; the step needs an inverse)
    "seed": 0,
    "device": "cpu",
    "dtype": "float32",
    "eval_every": 10,        # iterations between Problem.evaluate calls (0 = only at the end)
    "checkpoint_every": 25,  # iterations between restart files
    "grad_clip": 0.0,        # clip the global gradient norm (0 = off)
    "memory_every": 1,       # CPU runs with a budget: measure tracked memory every N iterations
    "threads": 0,            # torch CPU threads (0: OMP_NUM_THREADS if set, else DEFAULT_THREADS)
    "progress_every": 30.0,  # seconds between progress lines when stderr is not a terminal
    "budget_once": True,     # resolve a "%" budget once at the start (False: every unroll)
    "cache_dir": "runs/cache",  # where ctx.cache keeps a problem's derived data
    "curriculum": "",        # unroll horizon by iteration, "0:50,200:400" ("" = steps throughout)
    "adjoint_every": 0,      # log the adjoint norms of one unroll every N iterations (0 = off)
    "mesh": "",              # distributed runs: DATAxSPACE ranks ("" = all space with ctx.slab)
    "dist_timeout": 600.0,   # seconds a rank waits for the others before it stops with an error
    "tensorboard": "",       # mirror the log's scalars to TensorBoard in this directory
                             # ("" = off; relative: inside the run directory)
    "compile": "auto",       # compiled step segments (docs/compile.md): auto = when the
                             # model says the compile time is repaid within the run's
                             # iterations; on, off, or a segment length k
}


#: Ranges of the trainer's numeric settings: (kind, lowest value, what the bound means).
#: ``int`` settings must be integers, ``float`` ones finite numbers (``grad_clip`` may also be
#: ``inf``, which like 0 turns clipping off).
SETTING_RANGES: dict[str, tuple[type, float, str]] = {
    "iterations": (int, 0, ">= 0"),
    "lr": (float, 0.0, ">= 0"),
    "steps": (int, 0, ">= 0"),
    "snapshots": (int, 0, ">= 0 (0: store every step)"),
    "eval_every": (int, 0, ">= 0 (0: evaluate only at the end)"),
    "checkpoint_every": (int, 1, ">= 1"),
    "grad_clip": (float, 0.0, ">= 0 (0: no clipping)"),
    "memory_every": (int, 1, ">= 1"),
    "threads": (int, 0, ">= 0 (0: the default, see docs/problems.md)"),
    "progress_every": (float, 0.0, ">= 0 (seconds; 0: a line every iteration)"),
    "adjoint_every": (int, 0, ">= 0 (0: no adjoint norms logged)"),
    "dist_timeout": (float, 0.1, ">= 0.1 (seconds)"),
}


def check_settings(cfg: Mapping[str, Any]) -> None:
    """Check the trainer settings of a resolved configuration against
    :data:`SETTING_RANGES` (and ``seed`` is an integer); one-line ``ValueError`` naming the
    setting, its value and the allowed range."""
    import math
    import numbers

    for key, (kind, low, allowed) in SETTING_RANGES.items():
        if key not in cfg:
            continue
        v = cfg[key]
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        if ok and kind is int:
            ok = isinstance(v, numbers.Integral) or (isinstance(v, float) and v.is_integer())
            what = "an integer"
        else:
            what = "a number"
            if ok and not math.isfinite(v) and not (key == "grad_clip" and v == math.inf):
                ok = False
                what = "a finite number"
        if not ok:
            raise ValueError(f"setting {key}={v!r} is not {what}; use --set {key}=VALUE with "
                             f"VALUE {allowed}")
        if v < low:
            raise ValueError(f"setting {key}={v!r} is out of range: {key} must be {allowed} "
                             f"(--set {key}=...)")
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"setting seed={seed!r} is not an integer")
    parse_compile(cfg.get("compile", False))


class Context:
    """What a problem works with: configuration, device, model, data and a budgeted unroll.

    Attributes:
        cfg: the resolved configuration (attribute access: ``ctx.cfg.steps``).
        device, dtype: where and in which precision to build tensors.
        model: the ``nn.Module`` the optimiser trains (set by :meth:`Problem.build`).
        data: anything the problem needs (set by :meth:`Problem.build`).
        generator: a ``torch.Generator`` seeded from ``cfg.seed`` (CPU).
        rank, world_size: this process's place in a distributed run (0 and 1 otherwise).
        budget: the unroll budget :meth:`unroll` passes on: ``cfg.budget`` as written, or the
            bytes the trainer resolved it to once at the start (``budget_once``: a ``"5%"``
            budget then means the same bytes, and the same schedule, on every iteration).
    """

    def __init__(self, cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype,
                 rank: int = 0, world_size: int = 1):
        self.cfg = SimpleNamespace(**cfg)
        self.device = device
        self.dtype = dtype
        self.model: torch.nn.Module | None = None
        self.data: Any = None
        self.generator = torch.Generator().manual_seed(int(cfg.get("seed", 0)))
        self.rank = rank
        self.world_size = world_size
        self.unroll_stats: list[UnrollStats] = []
        self.budget: int | str = cfg.get("budget", "")
        self.cached: dict[str, tuple[str, bool]] = {}
        self._bound: dict = {}
        self._capturing = False
        #: the unroll length of this iteration: ``cfg.steps``, or the curriculum's stage
        self.horizon = int(cfg.get("steps", 0) or 0)
        #: the next ``ctx.unroll`` records its adjoint norms (the trainer's adjoint_every)
        self.want_adjoint_norms = False

    def cache(self, name: str, key: Mapping[str, Any], compute: Callable[[], Mapping[str, Any]],
              *, directory: str | None = None,
              attrs: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Arrays that ``build`` derives at some cost (a reference solution), computed once
        per ``key`` and read back on every later build (``plan``, ``check``, ``--resume``,
        the next run): :func:`deepsolve.io.load_or_compute` in ``directory`` (default
        ``cfg.cache_dir``, ``runs/cache``). ``key`` holds everything the arrays depend on
        (JSON values; add a version number); ``compute()`` returns ``{name: array or
        tensor}``. Returns CPU tensors; :attr:`cached` records ``name -> (path, computed)``.
        """
        from .io.cache import load_or_compute

        where = directory if directory is not None else getattr(
            self.cfg, "cache_dir", TRAINER_DEFAULTS["cache_dir"])
        arrays, path, computed = load_or_compute(where, name, key, compute, attrs=attrs)
        self.cached[name] = (path, computed)
        return {k: torch.from_numpy(v) for k, v in arrays.items()}

    def unroll_request(self, step: Callable, state: Any, n_steps: int | None = None,
                       **kw: Any) -> UnrollRequest:
        """What ``ctx.unroll(step, state, n_steps, **kw)`` runs: ``n_steps`` defaults to
        :attr:`horizon` (``cfg.steps``, or the stage of ``--set curriculum=...``);
        ``budget``/``snapshots`` come from the configuration unless the call gives a
        budget, snapshots or a schedule; a problem method ``problem.step(ctx, x, i)``
        becomes ``step(x, i)`` (one closure per method, so the step profile is cached)."""
        n = self.horizon if n_steps is None else n_steps
        if "budget" not in kw and "snapshots" not in kw and "schedule" not in kw:
            if int(getattr(self.cfg, "reversible", 0) or 0) > 0:
                kw["schedule"] = Reversible(snapshots=int(self.cfg.reversible))
            elif self.budget:
                kw["budget"] = self.budget
            elif self.cfg.snapshots:
                kw["snapshots"] = int(self.cfg.snapshots)
        mode = parse_compile(getattr(self.cfg, "compile", False))
        if mode is not False and "compile" not in kw:
            kw["compile"] = mode  # compile time spread over the run's iterations
            kw.setdefault("compile_runs", max(1, int(getattr(self.cfg, "iterations", 1) or 1)))
        fn = step
        if hasattr(step, "__self__") and isinstance(step.__self__, Problem):
            method = cast(MethodType, step)  # a method bound to a Problem
            key = (id(method.__func__), id(method.__self__))
            bound = self._bound.get(key)
            if bound is None:
                bound = self._bound[key] = _bind_ctx(step, self)
            fn = bound
        return UnrollRequest(fn, state, n, kw)

    def unroll(self, step: Callable, state: Any, n_steps: int | None = None, **kw) -> Any:
        """``deepsolve.unroll`` with the run's settings (:meth:`unroll_request`). Its
        :class:`UnrollStats` go into the iteration's log row."""
        req = self.unroll_request(step, state, n_steps, **kw)
        if self._capturing:
            raise _FirstUnroll(req)
        stats = req.options.pop("stats", None) or UnrollStats()
        if self.want_adjoint_norms:
            stats.adjoint_norms = True
            self.want_adjoint_norms = False
        self.unroll_stats.append(stats)
        return unroll(req.step, req.state, req.n_steps, stats=stats, **req.options)

    def first_unroll(self, run: Callable[[], Any]) -> UnrollRequest | None:
        """Call ``run()`` (e.g. ``lambda: problem.residuals(ctx, 0)``) up to its first
        ``ctx.unroll`` and return what that call asked for, without running the unroll
        (``plan`` and ``check`` plan or check that unroll); ``None`` when ``run`` returns
        without unrolling."""
        self._capturing = True
        try:
            run()
        except _FirstUnroll as e:
            return e.request
        finally:
            self._capturing = False
        return None


class UnrollRequest(NamedTuple):
    """One ``ctx.unroll`` call as :func:`deepsolve.unroll` receives it."""

    step: Callable
    state: Any
    n_steps: int  # the context's horizon when the call gives none
    options: dict


class _FirstUnroll(Exception):
    """Stops ``run()`` at its first ``ctx.unroll`` (:meth:`Context.first_unroll`)."""

    def __init__(self, request: UnrollRequest):
        self.request = request


def _bind_ctx(method, ctx):
    """``problem.step(ctx, x, i)`` as ``step(x, i)`` (the model's parameters are closed-over
    leaves, found by the unroll); a problem method ``step_inverse(ctx, x, i)`` (``x_i`` from
    ``x_{i+1}``) becomes the bound step's ``inverse``, which makes it reversible."""

    def step(x, i):
        return method(ctx, x, i)

    inverse = getattr(method.__self__, f"{method.__name__}_inverse", None)
    if callable(inverse):
        step.inverse = lambda x, i: inverse(ctx, x, i)  # type: ignore[attr-defined]
    return step


class Problem:
    """Base class of problems; see the module docstring for a complete example.

    Override:
        defaults: a dict of settings and their default values; every key can be changed with
            ``--set key=value`` (typed by the default's type). Adds to
            :data:`TRAINER_DEFAULTS` (iterations, lr, steps, budget, ...).
        build(ctx): create ``ctx.model`` (an ``nn.Module``) and ``ctx.data``. Required.
        residuals(ctx, iteration) -> dict[str, Tensor]: named scalar loss terms. Required.
        step(ctx, state, i): the solver step, for problems that unroll (call
            ``ctx.unroll(self.step, x0)`` inside ``residuals``).
        weights(ctx) -> dict[str, float]: weight per loss term (default 1 for each).
        evaluate(ctx) -> dict[str, float]: metrics on held-out data (relative errors...),
            logged every ``eval_every`` iterations and at the end.
        optimizer(ctx, params) -> torch.optim.Optimizer: default Adam with ``cfg.lr``.
        batch_size(ctx) -> int: the size of the batch dimension that distributed runs shard
            (0 = not shardable).
        state_dict(ctx) -> dict / load_state_dict(ctx, state): problem state beyond the
            model and optimiser that a restart needs (adapted loss weights, refined
            collocation points, the precision the run has switched to); tensors, numbers,
            strings and containers of them. The trainer saves it in every restart file and
            calls ``load_state_dict`` on resume *before* loading the model and optimiser, so
            it may change the model's dtype first. Default: nothing.
    """

    defaults: dict[str, Any] = {}

    def build(self, ctx: Context) -> None:
        raise NotImplementedError(f"{type(self).__name__}.build(ctx) must create ctx.model")

    def residuals(self, ctx: Context, iteration: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__}.residuals(ctx, iteration) must "
                                  "return a dict of named loss terms")

    def weights(self, ctx: Context) -> dict[str, float]:
        return {}

    def evaluate(self, ctx: Context) -> dict[str, float]:
        return {}

    def optimizer(self, ctx: Context, params) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=ctx.cfg.lr)

    def state_dict(self, ctx: Context) -> dict[str, Any]:
        return {}

    def load_state_dict(self, ctx: Context, state: dict[str, Any]) -> None:
        return None

    def config(self) -> dict[str, Any]:
        """Trainer defaults updated with this problem's ``defaults``."""
        cfg = dict(TRAINER_DEFAULTS)
        cfg.update(self.defaults)
        return cfg


def load_problem(path: str | os.PathLike) -> tuple[Problem, str]:
    """Import a problem file and return ``(problem, sha256 of the file)``.

    Raises :class:`ProblemError` with a one-line message when the file does not exist, fails
    to import, or does not define ``problem`` as a :class:`Problem` instance.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ProblemError(f"problem file {path!r} does not exist")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    name = "deepsolve_problem_" + hashlib.md5(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ProblemError(f"cannot import {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ProblemError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, "problem"):
        raise ProblemError(f"{path} does not define `problem`; add `problem = MyProblem()` "
                           "at the end of the file")
    prob = module.problem
    if isinstance(prob, type) and issubclass(prob, Problem):
        raise ProblemError(f"{path}: `problem` is the class {prob.__name__}; make it an "
                           f"instance: `problem = {prob.__name__}()`")
    if not isinstance(prob, Problem):
        raise ProblemError(f"{path}: `problem` is a {type(prob).__name__}, not an instance "
                           "of deepsolve.Problem")
    return prob, digest


def parse_compile(value: Any) -> bool | int | str:
    """The ``compile`` setting as ``unroll``'s ``compile=``: ``"auto"``, ``True`` (``on``,
    ``true``), ``False`` (``off``, ``false``, ``""``) or a segment length ``k >= 1``; one line
    otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 1:
        return value
    text = str(value).strip().lower()
    if text in ("auto", "on", "true", "off", "false", ""):
        return "auto" if text == "auto" else text in ("on", "true")
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"setting compile={value!r}: use auto, on, off or a segment length k >= 1 "
                     "(--set compile=auto)")


def coerce(key: str, text: str, default: Any) -> Any:
    """Turn ``--set key=text`` into the type of ``default``; one-line errors."""
    if isinstance(default, bool):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {key}={text}: expected true or false")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--set {key}={text}: expected an integer") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"--set {key}={text}: expected a number") from None
    if isinstance(default, str):
        return text
    if isinstance(default, (list, tuple)):
        import json

        try:
            val = json.loads(text)
        except json.JSONDecodeError:
            val = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(val, list):
            raise ValueError(f"--set {key}={text}: expected a list such as 1,2,3")
        return type(default)(val)
    if default is None:
        return text
    if dataclasses.is_dataclass(default):  # pragma: no cover - not used by shipped problems
        raise ValueError(f"--set {key}: structured settings cannot be set from the command line")
    raise ValueError(f"--set {key}: settings of type {type(default).__name__} cannot be set "
                     "from the command line")


def apply_overrides(cfg: dict[str, Any], pairs: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` strings to ``cfg`` (typed by the defaults); unknown keys fail."""
    out = dict(cfg)
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set {pair!r}: expected key=value")
        key, text = pair.split("=", 1)
        key = key.strip()
        if key not in cfg:
            known = ", ".join(sorted(cfg))
            raise ValueError(f"--set {key}: unknown setting; known settings: {known}")
        out[key] = coerce(key, text, cfg[key])
    return out
