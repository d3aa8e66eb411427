"""The trainer: problem file in, trained model, HDF5 log and restart files out.

``train("problems/navier_stokes.py", overrides={"iterations": 20})`` loads the problem,
builds its model and data, and runs the optimisation loop. Each iteration appends one row to
``RUN_DIR/log.h5`` (loss terms, times, peak memory, step counts, schedule, learning rate,
gradient norm, metrics); every ``checkpoint_every`` iterations, at the end, and when SIGTERM or
SIGUSR1 arrives (batch systems send these before killing a job) it writes
``RUN_DIR/restart.pt`` atomically. ``resume=True`` continues from the restart file and
drops log rows written after it, so the iteration column stays complete and strictly
increasing.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .problem import Context, Problem, ProblemError, apply_overrides, load_problem

__all__ = ["train", "TrainResult", "PREEMPTED_EXIT_CODE", "plan_problem"]

#: Exit code of a run stopped by SIGTERM/SIGUSR1 after writing its restart file
#: (EX_TEMPFAIL: "try again"); a batch script requeues on it.
PREEMPTED_EXIT_CODE = 75

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


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


def resolve_config(problem: Problem, overrides: Mapping[str, Any] | None = None,
                   sets: list[str] | None = None) -> dict[str, Any]:
    """Problem defaults, then ``--set key=value`` pairs (typed), then explicit options."""
    cfg = apply_overrides(problem.config(), sets or [])
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in cfg:
            raise ValueError(f"unknown setting {k!r}")
        cfg[k] = v
    if int(cfg["iterations"]) < 0:
        raise ValueError(f"iterations must be >= 0, got {cfg['iterations']}")
    if cfg["dtype"] not in _DTYPES:
        raise ValueError(f"dtype {cfg['dtype']!r} is not one of {', '.join(_DTYPES)}")
    return cfg


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available here; "
                         "use --device cpu")
    return dev


def _rng_state(ctx: Context) -> dict[str, Any]:
    np_state = np.random.get_state()
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


def save_restart(path: str, *, iteration: int, model, optimizer, scheduler, ctx: Context,
                 cfg: dict, sha: str, problem_state: dict | None = None) -> None:
    """Write the restart file atomically: a temporary file in the same directory, fsync,
    then ``os.replace`` — a kill at any moment leaves the previous restart file intact."""
    payload = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "rng": _rng_state(ctx),
        "config": json.dumps(cfg, default=str),
        "problem_sha256": sha,
        "problem": problem_state or {},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_restart(path: str) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ValueError(f"--resume: no restart file at {path}") from None
    except Exception as e:
        raise ValueError(f"--resume: cannot read the restart file {path}: "
                         f"{type(e).__name__}: {e}") from e


class _Preemption:
    """SIGTERM/SIGUSR1 set a flag; the loop finishes the iteration, saves, and exits."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame):
        self.signal = signum

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _git_commit(path: str) -> str:
    try:
        out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(path)) or ".",
                              "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _attrs(problem_path: str, sha: str, cfg: dict, device: torch.device) -> dict[str, Any]:
    from . import __version__

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine())
    return {
        "config": cfg,
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


def build(problem_path: str, cfg: dict, rank: int = 0,
          world_size: int = 1) -> tuple[Problem, Context, str]:
    from .distributed import DistributedContext

    problem, sha = load_problem(problem_path)
    device = _device(cfg["device"])
    ctx = DistributedContext(cfg, device, _DTYPES[cfg["dtype"]], rank, world_size)
    torch.manual_seed(int(cfg["seed"]))
    np.random.seed(int(cfg["seed"]) % 2**32)
    random.seed(int(cfg["seed"]))
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
    cfg = resolve_config(problem0, overrides, sets)
    dist, cfg["device"] = D.setup(cfg["device"])
    try:
        res = _train(problem_path, cfg, dist, out, resume, quiet, locking)
        D.barrier(dist)  # the others wait for rank 0's restart file and log
        return res
    finally:
        D.cleanup(dist)


class _NoLog:
    """The log of ranks other than 0: they write nothing."""

    columns: list[str] = []

    def append(self, row):
        pass

    def flush(self):
        pass

    def close(self):
        pass

    def truncate_after(self, iteration):
        return 0


def _train(problem_path: str, cfg: dict, dist, out: str | None, resume: bool, quiet: bool,
           locking: bool | None) -> TrainResult:
    from . import distributed as D
    from .io import H5Log
    from .memory.meter import MemoryMeter

    main = dist.is_main
    run_dir = out or os.path.join("runs", os.path.splitext(os.path.basename(problem_path))[0])
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "log.h5")
    restart_path = os.path.join(run_dir, "restart.pt")
    if not resume and os.path.exists(log_path):
        raise ValueError(f"{run_dir} already holds a run (log.h5); continue it with --resume "
                         "or give a new --out directory")
    D.barrier(dist)  # every rank has checked before rank 0 creates the log

    problem, ctx, sha = build(problem_path, cfg, dist.rank, dist.world_size)
    D.check_batch(dist, problem, ctx)
    model = ctx.model
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ProblemError(f"{problem_path}: ctx.model has no trainable parameters")
    optimizer = problem.optimizer(ctx, params)
    scheduler = getattr(problem, "scheduler", lambda ctx, opt: None)(ctx, optimizer)
    start = 0
    if resume:
        state = load_restart(restart_path)
        problem.load_state_dict(ctx, state.get("problem") or {})  # may change the dtype
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(ctx, state["rng"])
        start = int(state["iteration"])
    D.broadcast_model(dist, model)

    attrs = dict(_attrs(problem_path, sha, cfg, ctx.device), world_size=dist.world_size)
    log = H5Log(log_path, attrs=attrs, resume=resume, locking=locking) if main else _NoLog()
    if resume:
        log.truncate_after(start - 1)
    weights = problem.weights(ctx)
    iterations = int(cfg["iterations"])
    eval_every = int(cfg["eval_every"])
    ckpt_every = max(int(cfg["checkpoint_every"]), 1)
    clip = float(cfg["grad_clip"]) or math.inf
    track = ctx.device.type == "cpu" and bool(cfg["budget"])
    memory_every = max(int(cfg.get("memory_every", 1)), 1)
    closure_opt = isinstance(optimizer, torch.optim.LBFGS)
    with torch.no_grad():  # the metric names fix the log's columns; also a baseline
        baseline = {k: float(v) for k, v in (problem.evaluate(ctx) or {}).items()}
    bar = _progress(iterations, start, quiet or not main)
    last_loss = math.nan
    preempted = False
    it = start
    with _Preemption() as stop:
        try:
            for it in range(start, iterations):
                D.broadcast_buffers(dist, model)
                row, last_loss = _iteration(problem, ctx, model, params, optimizer, scheduler,
                                            weights, it, clip, closure_opt,
                                            track and it % memory_every == 0,
                                            MemoryMeter, dist)
                _add_rank_peaks(dist, log, row, ctx.device)
                last = it == iterations - 1
                for k in baseline:
                    row[f"metric/{k}"] = math.nan
                if (eval_every and (it + 1) % eval_every == 0) or last:
                    with torch.no_grad():
                        for k, v in (problem.evaluate(ctx) or {}).items():
                            row[f"metric/{k}"] = float(v)
                log.append(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{last_loss:.3e}",
                                    mem=_fmt_mem(row.get("peak_device_memory")))
                if not math.isfinite(last_loss):
                    log.flush()
                    raise FloatingPointError(f"the loss became {last_loss} at iteration {it}; "
                                             "lower the learning rate (--set lr=...)")
                stopping = D.any_rank(dist, stop.signal is not None, ctx.device)
                if main and (stopping or (it + 1) % ckpt_every == 0 or last):
                    save_restart(restart_path, iteration=it + 1, model=model,
                                 optimizer=optimizer, scheduler=scheduler, ctx=ctx, cfg=cfg,
                                 sha=sha, problem_state=problem.state_dict(ctx))
                    log.flush()
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
    return TrainResult(run_dir, log_path, restart_path, it, last_loss, preempted, dist.rank)


def _add_rank_peaks(dist, log, row, device) -> None:
    """Distributed runs: ``peak_device_memory_max`` and ``peak_host_memory_max``, the largest
    peak over the ranks (``peak_device_memory``/``peak_host_memory`` stay rank 0's). Kept
    in a resumed log that has them, left out of one that does not (columns are fixed)."""
    from .distributed import gather_floats, nanmax

    keys = ("peak_device_memory", "peak_host_memory")
    per_rank = gather_floats(dist, [row[k] for k in keys], device)
    if per_rank is None:
        return
    cols = log.columns
    if (dist.enabled and not cols) or "peak_host_memory_max" in cols:
        for j, k in enumerate(keys):
            row[f"{k}_max"] = nanmax([r[j] for r in per_rank])


def _iteration(problem, ctx, model, params, optimizer, scheduler, weights, it, clip,
               closure_opt, track, MemoryMeter, dist=None):
    from .distributed import average_gradients

    dev = ctx.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    ctx.unroll_stats.clear()
    meter = MemoryMeter(dev, stats=_StatsSum(ctx.unroll_stats)) if track else None
    t0 = time.perf_counter()
    timing = {}

    def evaluate_loss():
        optimizer.zero_grad(set_to_none=True)
        ta = time.perf_counter()
        terms = _check_terms(problem.residuals(ctx, it), it)
        loss = sum(float(weights.get(k, 1.0)) * v.reshape(()) for k, v in terms.items())
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
    if dev.type == "cuda":
        row["peak_device_memory"] = float(torch.cuda.max_memory_allocated(dev) - base)
    else:
        row["peak_device_memory"] = float(meter.tracked_peak) if meter is not None else math.nan
    from .memory.meter import host_high_water_mark

    row["peak_host_memory"] = float(host_high_water_mark())
    stats = ctx.unroll_stats
    row["advances"] = sum(s.advances for s in stats)
    row["recorded"] = sum(s.recorded for s in stats)
    row["snapshots"] = max((s.snapshots_peak for s in stats), default=0)
    row["schedule"] = stats[0].schedule if stats else ""
    row["lr"] = float(optimizer.param_groups[0]["lr"])
    row["grad_norm"] = grad_norm
    return row, loss


class _StatsSum:
    """The snapshot bytes of all unrolls of an iteration, for the memory meter."""

    def __init__(self, stats):
        self.stats = stats

    @property
    def snapshot_bytes_peak(self) -> int:
        return sum(s.snapshot_bytes_peak for s in self.stats)


def _fmt_mem(x) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x / 2**20:.0f}MiB"


def _progress(total: int, start: int, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="it", dynamic_ncols=True)


class _Captured(Exception):
    def __init__(self, step, state, n, kw):
        self.step, self.state, self.n, self.kw = step, state, n, kw


def plan_problem(problem_path: str, *, budget: str, sets: list[str] | None = None,
                 overrides: Mapping[str, Any] | None = None):
    """The plan ``train`` would use for the problem's unroll under ``budget``: builds the
    problem, captures its first ``ctx.unroll`` call and plans it."""
    from .memory.planner import plan

    problem0, _ = load_problem(problem_path)
    cfg = resolve_config(problem0, overrides, sets)
    problem, ctx, _ = build(problem_path, cfg)

    def capture(step, state, n_steps=None, **kw):
        n = ctx.cfg.steps if n_steps is None else n_steps
        fn = step
        if hasattr(step, "__self__") and isinstance(step.__self__, Problem):
            meth = step

            def fn(x, i):
                return meth(ctx, x, i)

        raise _Captured(fn, state, n, kw)

    ctx.unroll = capture
    try:
        problem.residuals(ctx, 0)
    except _Captured as c:
        return plan(c.step, c.state, c.n, budget=budget)
    raise ProblemError(f"{problem_path} does not unroll (its residuals never call ctx.unroll), "
                       "so there is no schedule to plan")
