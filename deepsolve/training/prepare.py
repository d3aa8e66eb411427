"""What comes before a run: its settings resolved and checked, its threads, the problem built,
the checks that must fail before the first iteration (curriculum, mesh), and the plan of its
unroll (``deepsolve plan``).

:func:`prepare` is the one entry from a problem file and its overrides to a frozen
:class:`~deepsolve.config.RunConfig`; :func:`build` imports the problem file and builds its
model and data under the run's seed; ``train``, ``plan`` and ``check`` share both.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..config import ConfigError, RunConfig, config_from_settings, resolve_threads, run_config
from ..memory.budget import BudgetError, MemoryBudget
from ..memory.strategies import Budget
from ..problem import Context, Problem, ProblemError, load_problem
from .restart import settings_dict

__all__ = ["prepare", "resolve_config", "apply_threads", "run_threads", "build", "check_curriculum",
           "check_mesh", "plan_problem", "log_attrs"]


def prepare(problem_path: str, overrides: Mapping[str, Any] | None = None,
            sets: list[str] | None = None) -> RunConfig:
    """What ``train``, ``plan`` and ``check`` do first: import the problem file and make its
    run configuration (every setting checked and parsed: budget, device, dtype, threads)
    before any data is loaded, model built or directory made, so that a bad setting fails
    here, in a second, and leaves nothing behind."""
    problem, _ = load_problem(problem_path)
    return run_config(problem, overrides, sets)


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


def build(problem_path: str, cfg: RunConfig | Mapping[str, Any], rank: int = 0,
          world_size: int = 1) -> tuple[Problem, Context, str]:
    """Load the problem file and build it with the configuration ``cfg`` (settings that are
    not a :class:`RunConfig` yet are validated into one first, before the import)."""
    from ..distributed import DistributedContext

    config = cfg if isinstance(cfg, RunConfig) else config_from_settings(cfg)
    problem, sha = load_problem(problem_path)
    budget = config.budget
    if budget is not None and config.get("budget_once", True):
        budget = budget.fixed()  # a "%" budget: the same bytes on every iteration
    ctx = DistributedContext(config.as_dict(), config.device, config.dtype, rank, world_size,
                             budget=budget)
    torch.manual_seed(int(config["seed"]))
    np.random.seed(int(config["seed"]) % 2**32)
    random.seed(int(config["seed"]))
    problem.build(ctx)
    if not isinstance(ctx.model, torch.nn.Module):
        raise ProblemError(f"{problem_path}: build(ctx) must set ctx.model to an nn.Module, got "
                           f"{type(ctx.model).__name__}")
    return problem, ctx, sha


def check_curriculum(problem_path: str, problem, ctx, stages) -> None:
    """Plan the problem's unroll at the curriculum's longest horizon under the run's budget
    (the first ``ctx.unroll`` of ``residuals(ctx, 0)``, not run; random generators left as
    they were): a horizon that does not fit fails now, with the minimum it needs, not at the
    stage where it starts."""
    longest = max(n for _, n in stages)
    if ctx.budget is None:
        return
    from ..memory.planner import plan

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


def check_mesh(problem_path: str, dist, ctx) -> None:
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


def git_commit(path: str) -> str:
    try:
        out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(path)) or ".",
                              "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def log_attrs(problem_path: str, sha: str, cfg: Mapping[str, Any],
           device: torch.device) -> dict[str, Any]:
    from .._version import __version__

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine())
    return {
        "config": settings_dict(cfg),
        "problem_file": os.path.abspath(problem_path),
        "problem_sha256": sha,
        "deepsolve_version": __version__,
        "torch_version": str(torch.__version__),
        "cuda_version": torch.version.cuda or "",
        "device": str(device),
        "device_name": dev_name,
        "host": socket.gethostname(),
        "git_commit": git_commit(problem_path),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python_version": sys.version.split()[0],
    }


def plan_problem(problem_path: str, *, budget: str | int | None = None,
                 sets: list[str] | None = None, overrides: Mapping[str, Any] | None = None):
    """The plan ``train`` would use for the problem's unroll under ``budget`` (default: the
    problem's ``budget`` setting, as ``train`` uses it): builds the problem, captures its
    first ``ctx.unroll`` call and plans it."""
    # the plan's budget is the run's: checked with the other settings, before the build
    config = prepare(problem_path, {**(overrides or {}), "budget": budget}, sets)
    chosen = config.budget
    if chosen is None:
        raise ConfigError(f"plan {problem_path}: the problem has no default budget; give "
                          "--budget (e.g. --budget 2GiB or 80%)")
    with run_threads(config.threads):
        return _plan_problem(problem_path, config, chosen)


def _plan_problem(problem_path: str, cfg: RunConfig, budget: MemoryBudget):
    from ..memory.planner import plan

    problem, ctx, _ = build(problem_path, cfg)
    req = ctx.first_unroll(lambda: problem.residuals(ctx, 0))
    if req is not None:
        return plan(req.step, req.state, req.n_steps, budget=budget)
    raise ProblemError(f"{problem_path} does not unroll (its residuals never call ctx.unroll), "
                       "so there is no schedule to plan")
