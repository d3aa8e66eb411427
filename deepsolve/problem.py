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

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from types import MethodType, SimpleNamespace
from typing import Any, NamedTuple, cast

import torch

from .engine import UnrollStats, forget_step
from .memory.budget import MemoryBudget, no_budget, read_budget
from .memory.strategies import Reversible
from .settings import TRAINER_DEFAULTS, Setting, apply_overrides, parse_compile, settings_table
from .unroll import unroll

__all__ = ["Problem", "Context", "Curve", "load_problem", "ProblemError", "TRAINER_DEFAULTS",
           "Setting", "apply_overrides", "parse_compile"]



class Curve(NamedTuple):
    """A curve that :meth:`Problem.evaluate` returns beside its numbers: ``values[j]`` at
    the integer ``steps[j]`` (a rollout's step count, say), at most
    :data:`deepsolve.io.log.CURVE_WIDTH` points (more are thinned evenly, the first and the
    last kept). Logged as the curve group ``eval_<name>`` (:func:`deepsolve.io.read_curves`)."""

    steps: Any
    values: Any

class ProblemError(ValueError):
    """A problem file is missing, broken, or does not define ``problem`` correctly."""


class Context:
    """What a problem works with: configuration, device, model, data and a budgeted unroll.

    Attributes:
        cfg: the resolved configuration (attribute access: ``ctx.cfg.steps``).
        device, dtype: where and in which precision to build tensors.
        model: the ``nn.Module`` the optimiser trains (set by :meth:`Problem.build`).
        data: anything the problem needs (set by :meth:`Problem.build`).
        generator: a ``torch.Generator`` seeded from ``cfg.seed`` (CPU).
        rank, world_size: this process's place in a distributed run (0 and 1 otherwise).
        budget: the unroll budget :meth:`unroll` passes on, a
            :class:`~deepsolve.memory.budget.MemoryBudget` (``None`` without one): the run
            configuration's, held at the bytes it was read as (``budget_once``: a ``"5%"``
            budget then means the same bytes, and the same schedule, on every iteration) or
            resolved again at every unroll.
    """

    def __init__(self, cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype,
                 rank: int = 0, world_size: int = 1, budget: MemoryBudget | None = None):
        self.cfg = SimpleNamespace(**cfg)
        self.device = device
        self.dtype = dtype
        self.model: torch.nn.Module | None = None
        self.data: Any = None
        self.generator = torch.Generator().manual_seed(int(cfg.get("seed", 0)))
        self.rank = rank
        self.world_size = world_size
        self.unroll_stats: list[UnrollStats] = []
        if budget is None and not no_budget(cfg.get("budget")):
            budget = read_budget(cfg["budget"], device)
        self.budget: MemoryBudget | None = budget
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
        if directory is None and where == TRAINER_DEFAULTS["cache_dir"]:
            where = os.environ.get("DEEPSOLVE_CACHE_DIR") or where
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
        reversible = 0
        if "budget" not in kw and "snapshots" not in kw and "schedule" not in kw:
            reversible = int(getattr(self.cfg, "reversible", 0) or 0)
            if reversible > 0:
                kw["schedule"] = Reversible(snapshots=reversible)
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
        if reversible > 0 and not callable(getattr(fn, "inverse", None)):
            raise ValueError(_no_inverse(step, reversible))
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

    def release(self) -> None:
        """Drop the compiled segments of this context's bound steps (they hold the steps,
        and through them this context, its model and data); the trainer calls it when a run
        ends, so that the run is freed with its last reference."""
        for step in self._bound.values():
            forget_step(step)
        self._bound.clear()

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
    ``x_{i+1}``) becomes the bound step's ``inverse``, which makes it reversible, and
    ``step_stability(ctx, x, i, n)`` its ``stability`` (:mod:`deepsolve.stability`: the
    reversible stepper's own, checked before every unroll)."""

    def step(x, i):
        return method(ctx, x, i)

    owner, name = method.__self__, method.__name__
    inverse = getattr(owner, f"{name}_inverse", None)
    if callable(inverse):
        step.inverse = lambda x, i: inverse(ctx, x, i)  # type: ignore[attr-defined]
    stability = getattr(owner, f"{name}_stability", None)
    if callable(stability):
        step.stability = (  # type: ignore[attr-defined]
            lambda x, i=0, n=None: stability(ctx, x, i, n))
    return step


def _no_inverse(step: Callable, reversible: int) -> str:
    """Why ``--set reversible=N`` cannot unroll ``step``: it has no inverse. One line that
    names the problem (its file) and the method it must define."""
    owner = getattr(step, "__self__", None)
    if isinstance(owner, Problem):
        name = getattr(step, "__name__", "step")
        cls = type(owner).__name__
        where = getattr(sys.modules.get(type(owner).__module__), "__file__", None)
        return (f"--set reversible={reversible} needs a step with an inverse: the problem "
                f"{cls}{f' ({where})' if where else ''} defines {name} but no "
                f"{name}_inverse; define a method {name}_inverse(ctx, x, i) beside it (x_i "
                "from x_(i+1); docs/reversible.md), or leave reversible at 0")
    name = getattr(step, "__name__", None) or type(step).__name__
    return (f"--set reversible={reversible} needs a step with an inverse: the step {name} "
            "has none; give it step.inverse(x, i) -> the state before (deepsolve.reversible "
            "builds such steps; docs/reversible.md), or leave reversible at 0")


class Problem:
    """Base class of problems; see the module docstring for a complete example.

    Override:
        defaults: a dict of settings: a default value (``"nu": 0.01``, typed by the value) or
            a :class:`~deepsolve.settings.Setting` with help and range (``"nu":
            Setting(0.01, "viscosity", low=0.0)``); every key can be changed with ``--set
            key=value``. Adds to the trainer's settings (iterations, lr, steps, budget, ...:
            :data:`~deepsolve.settings.TRAINER_SETTINGS`), whose defaults a plain value
            replaces.
        build(ctx): create ``ctx.model`` (an ``nn.Module``) and ``ctx.data``. Required.
        residuals(ctx, iteration) -> dict[str, Tensor]: named scalar loss terms. Required.
        step(ctx, state, i): the solver step, for problems that unroll (call
            ``ctx.unroll(self.step, x0)`` inside ``residuals``).
        weights(ctx) -> dict[str, float]: weight per loss term (default 1 for each).
        evaluate(ctx) -> dict[str, float | Curve]: metrics on held-out data (relative
            errors...), logged every ``eval_every`` iterations and at the end: a number as
            the column ``metric/<name>``, a :class:`Curve` (an error against rollout time,
            say) as the log's curve group ``eval_<name>`` (the model as built at iteration
            -1), which ``deepsolve report`` draws in evaluation.png.
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

    def settings(self) -> dict[str, Setting]:
        """The trainer's settings updated with this problem's ``defaults``
        (:func:`deepsolve.settings.settings_table`)."""
        return settings_table(self.defaults)

    def config(self) -> dict[str, Any]:
        """The default value of every setting (:meth:`settings`)."""
        return {k: s.default for k, s in self.settings().items()}


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
