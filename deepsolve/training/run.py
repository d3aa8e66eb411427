"""The trainer's loop: :func:`train` starts a run, a :class:`Run` trains it.

``train(problem_path)`` resolves the settings (every one checked before any work,
:mod:`.prepare`), sets up torch.distributed when the process runs under torchrun, makes and
locks the run directory and decides the start from what it holds (:mod:`.start`,
:mod:`.rundir`; a resumed run with nothing left to train is answered there, nothing built),
then hands over to a :class:`Run`:

1. :meth:`Run.setup` builds the problem (model, data, optimiser, scheduler), loads the
   restart file when the run resumes (:mod:`.restart`) and checks the ``target`` (a loss
   term's name against one evaluation of the residuals, :mod:`.terms`);
2. :meth:`Run.open_log` opens the HDF5 log (rank 0; the other ranks write nothing);
3. the loop (:meth:`Run.train`) calls :meth:`Run.iteration` once per iteration — loss terms,
   backward, optimiser step, one log row — and :meth:`Run.checkpoint` every
   ``checkpoint_every`` iterations, at the end, and when a signal asks the run to stop
   (:mod:`.signals`) or it reaches its ``target`` or ``time_limit`` (:mod:`.stopping`).

A checkpoint flushes the log to the disk before it publishes the restart file, so the log
always holds the rows of the restart file's iterations. A fresh run that fails before its
first row leaves nothing behind: its new log, its TensorBoard directory and the run directory
it made are removed.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import artefacts
from ..config import RunConfig, horizon, parse_curriculum
from ..memory.allocator import release_budget
from ..memory.meter import host_high_water_mark, process_status, reset_high_water_mark
from ..problem import ProblemError
from ..settings import parse_target
from .prepare import build, check_curriculum, check_mesh, log_attrs, prepare, run_threads
from .progress import note, progress
from .restart import restore, save_restart
from .rows import (
    NoLog,
    StatsSum,
    add_rank_peaks,
    budget_bytes,
    check_terms,
    log_adjoint_norms,
    log_evaluation_curves,
    mirrored,
    split_evaluation,
)
from .rundir import RunFiles, RunStart, discard_start, remove_empty_dir
from .signals import Preemption
from .start import decide_start, nothing_to_train, untrained_outcome
from .stopping import Stopping
from .terms import loss_term_names

if TYPE_CHECKING:
    from ..distributed.data import DistInfo
    from ..io.log import Log

__all__ = ["train", "TrainResult", "Run"]


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
    stopped: str = ""        # the target reached or the time limit (the log's `stopped`)
    # --resume of a run with nothing left to train (it had finished, or its training time
    # is past time_limit): no iteration ran, the loss and metrics are the log's last
    nothing_to_train: bool = False


def train(problem_path: str, *, overrides: Mapping[str, Any] | None = None,
          sets: list[str] | None = None, out: str | None = None, resume: bool = False,
          quiet: bool = False, locking: bool | None = None) -> TrainResult:
    """Train ``problem_path``'s problem; see the module docstring. Returns a
    :class:`TrainResult`; ``preempted`` is set when a signal stopped the run early.

    Under torchrun (``WORLD_SIZE > 1``) every rank trains on its shard of the batch with
    averaged gradients, rank 0 alone writes the log and restart files, and a signal on any
    rank stops all of them after the same iteration (see :mod:`deepsolve.distributed`)."""
    from .. import distributed as D

    config = prepare(problem_path, overrides, sets)   # a bad setting fails here: nothing made
    with run_threads(config.threads):   # the caller's thread count is restored after
        dist, device_name = D.setup(config["device"], float(config["dist_timeout"]))
        try:
            D.parse_mesh(config["mesh"], dist.world_size)   # a bad mesh fails before the build
            config = config.on_device(device_name)   # "cuda" -> "cuda:LOCAL_RANK" recorded
            res = _start(problem_path, config, dist, RunFiles.of(problem_path, out, locking),
                         resume, quiet)
            D.barrier(dist)  # the others wait for rank 0's restart file and log
            return res
        finally:
            D.cleanup(dist)


def _start(problem_path: str, cfg: RunConfig, dist: DistInfo, files: RunFiles, resume: bool,
           quiet: bool) -> TrainResult:
    """Decide the start (:func:`.start.decide_start`: rank 0 locks the run directory, the
    others follow its decision; a start refused on any rank is refused on all) and run, or
    answer a resumed run with nothing left to train without building anything."""
    from .._process import cli_start

    # from here on a SIGTERM (or Ctrl-C) stops the run cleanly; in the command line's own
    # process (not torchrun's workers, which torchrun stops with SIGTERM) one after the run
    # leaves the exit code as the run decides it
    with Preemption(hard_second=cli_start(),
                    hold_after=cli_start() and not dist.enabled) as stop:
        start, lock = decide_start(cfg, dist, files, resume)
        why = nothing_to_train(start, cfg)
        if why is not None:   # nothing is built, nothing written: the run stays as it was
            try:
                loss, metrics = untrained_outcome(files, dist, start, why)
                return TrainResult(files.run_dir, files.log, files.restart, start.start, loss,
                                   rank=dist.rank, metrics=metrics, stopped=why,
                                   nothing_to_train=True)
            finally:
                if lock is not None:
                    lock.release()
        run = Run(problem_path, cfg, dist, files, start, stop, quiet)
        try:
            run.setup()
            res = run.train()
            res.interrupted = stop.interrupted
            return res
        finally:
            run.close()
            if lock is not None:
                lock.release()


class Run:
    """One training run, from its decided start to its last row.

    Args:
        problem_path: the problem file.
        cfg: the run's settings, resolved and checked.
        dist: the process's place in a distributed run (:func:`deepsolve.distributed.setup`).
        files: the run directory, log and restart file.
        start: the first iteration and the restart file's contents, as decided from the run
            directory (:func:`~.rundir.inspect_run_dir`).
        stop: the signal flag the loop reads after each iteration.
        quiet: no progress output.
    """

    def __init__(self, problem_path: str, cfg: RunConfig, dist: DistInfo, files: RunFiles,
                 start: RunStart, stop: Preemption, quiet: bool = False):
        self.problem_path, self.cfg, self.dist, self.files = problem_path, cfg, dist, files
        self.begin, self.stop, self.quiet = start, stop, quiet
        self.main = dist.is_main
        self.log: Log = NoLog()
        self.wrote = {"rows": False, "restart": False}

    # -- set-up --------------------------------------------------------------------------

    def setup(self) -> None:
        """Build the problem, its optimiser and scheduler; load the restart file when the
        run resumes; evaluate the model as built (the metric names fix the log's columns).
        A failure removes the run directory this trainer made (if still empty)."""
        from .. import distributed as D

        cfg, dist = self.cfg, self.dist
        try:
            problem, ctx, sha = build(self.problem_path, cfg, dist.rank, dist.world_size)
            check_mesh(self.problem_path, dist, ctx)
            D.check_batch(dist, problem, ctx)
            model = ctx.model
            assert model is not None  # build() checked it
            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                raise ProblemError(f"{self.problem_path}: ctx.model has no trainable "
                                   "parameters")
            stages = parse_curriculum(cfg["curriculum"], cfg["iterations"], cfg.get("steps"))
            if stages:  # the longest stage must fit before the first iteration
                check_curriculum(self.problem_path, problem, ctx, stages)
            optimizer = problem.optimizer(ctx, params)
            scheduler = getattr(problem, "scheduler", lambda ctx, opt: None)(ctx, optimizer)
            elapsed = float((self.begin.restart or {}).get("elapsed", 0.0))
            warned: list[str] = []   # said once the target has been checked too
            if self.begin.restart is not None:
                warned = restore(self.files.restart, self.begin.restart, problem, ctx,
                                 optimizer, scheduler, self.problem_path, sha)
                self.begin.restart = None
            with torch.no_grad():  # a new log's baseline
                baseline, baseline_curves = split_evaluation(problem.evaluate(ctx))
            # a target's name is checked now, before the log is opened: a loss term's
            # against the terms one evaluation of the residuals returns (made only then)
            self.stopping = Stopping(parse_target(cfg["target"]), float(cfg["time_limit"]),
                                     elapsed, baseline, getattr(problem, "target_metric", None),
                                     self.problem_path,
                                     terms=lambda: loss_term_names(problem, ctx,
                                                                   self.begin.start, stages))
            for line in warned:
                note(line)
        except BaseException:
            if self.begin.created and self.main:
                remove_empty_dir(self.files.run_dir)
            raise
        self.problem, self.ctx, self.sha, self.model = problem, ctx, sha, model
        self.params, self.optimizer, self.scheduler = params, optimizer, scheduler
        self.stages, self.baseline, self.baseline_curves = stages, baseline, baseline_curves
        self.weights = problem.weights(ctx)
        # optimizers that evaluate the loss themselves: L-BFGS and those saying so
        self.closure_opt = (isinstance(optimizer, torch.optim.LBFGS)
                            or bool(getattr(optimizer, "needs_closure", False)))

    def open_log(self) -> None:
        """Open the HDF5 log (rank 0), after the restart file and the log's rows have been
        checked: a resumed log keeps its rows before the start and drops the others."""
        from ..io import H5Log

        cfg, start = self.cfg, self.begin.start
        attrs = dict(log_attrs(self.problem_path, self.sha, cfg, self.ctx.device),
                     world_size=self.dist.world_size, threads=torch.get_num_threads())
        if cfg.budget is not None:
            attrs["budget_bytes"] = cfg.budget.nbytes
        attrs["weights"] = {k: float(v) for k, v in self.weights.items()}
        if not self.begin.resume_log:   # before training: the model as built
            attrs["initial_metrics"] = self.baseline
        if not self.main:
            return
        curves = (("adjoint_norms",) if int(cfg["adjoint_every"]) else ()) + tuple(
            f"eval_{k}" for k in self.baseline_curves)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            self.log = H5Log(self.files.log, attrs=attrs, resume=self.begin.resume_log,
                             keep_through=start - 1, locking=self.files.locking,
                             curves=curves)
        if not self.begin.resume_log:
            log_evaluation_curves(self.log, -1, self.baseline_curves)
        for w in caught:
            note(" ".join(str(w.message).split()))
        if cfg["tensorboard"]:
            self.log = mirrored(self.log, os.path.join(self.files.run_dir, cfg["tensorboard"]),
                                start)

    def close(self) -> None:
        """Let go of the run: the context's compiled steps (which hold the context, its
        model and, in a distributed run, its mesh's process groups) are dropped, so that
        ``train`` can end the process groups whole (:func:`deepsolve.distributed.cleanup`)."""
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.release()

    # -- the loop ------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Train from the start to ``iterations`` (or a signal); see the module docstring.
        A fresh run that fails before its first row or restart file removes what it made."""
        files, cfg = self.files, self.cfg
        # a fresh run (no restart file) that fails or is interrupted before its first row
        # leaves nothing: its new log (and TensorBoard directory) and the run directory
        fresh = self.main and self.begin.start == 0 and not os.path.lexists(files.restart)
        tb_dir = os.path.join(files.run_dir, cfg["tensorboard"]) if cfg["tensorboard"] \
            else None
        tb_new = tb_dir is not None and not os.path.lexists(tb_dir)
        try:
            # compiled steps load and keep their artefacts in the run directory, where
            # --resume and a requeued job find them (deepsolve.artefacts)
            with artefacts.bound(os.path.join(files.run_dir, artefacts.RUN_FILE)):
                return self._loop()
        except BaseException:
            if fresh and not self.wrote["rows"] and not self.wrote["restart"]:
                discard_start(files.run_dir, files.log, tb_dir if tb_new else None,
                              self.begin.created)
            raise

    def _loop(self) -> TrainResult:
        from .. import distributed as D

        dist, ctx, start = self.dist, self.ctx, self.begin.start
        iterations = int(self.cfg["iterations"])
        ckpt_every = max(int(self.cfg["checkpoint_every"]), 1)
        D.broadcast_model(dist, self.model)
        self.open_log()
        bar = None
        last_loss, preempted, it = math.nan, False, start
        self.metrics = dict(self.baseline)
        try:
            self.stop.training = True   # from here on SIGINT stops after the iteration
            if D.any_rank(dist, self.stop.signal is not None, ctx.device):  # during set-up
                if self.main:
                    self.checkpoint(start)
                preempted = True
            else:
                bar = progress(iterations, start, self.quiet or not self.main,
                               float(self.cfg["progress_every"]), self.stopping.deadline(),
                               self.stages)
                # freed blocks an earlier budgeted call in this process left cached (the
                # host allocator keeps its last limit) would count in this run's real peaks:
                # emptied, the C library's own behaviour; a budgeted unroll sets its limit
                release_budget()
                self.host_base = math.inf  # the real-peak baseline: set at each iteration
                for it in range(start, iterations):
                    row, last_loss = self.iteration(it)
                    self.log.append(row)
                    self.wrote["rows"] = True
                    if bar is not None:
                        bar.update(it, last_loss, row)
                    if not math.isfinite(last_loss):
                        self.log.flush()
                        raise FloatingPointError(f"the loss became {last_loss} at iteration "
                                                 f"{it}; lower the learning rate "
                                                 "(--set lr=...)")
                    stopping = D.any_rank(dist, self.stop.signal is not None, ctx.device)
                    done = bool(self.stopping.reason)   # a target or the time limit
                    if self.main and (stopping or done or (it + 1) % ckpt_every == 0
                                      or it == iterations - 1):
                        self.checkpoint(it + 1)
                    if stopping or done:
                        preempted, it = stopping, it + 1
                        break
                else:
                    it = iterations
        finally:
            self.log.close()
            if bar is not None:
                bar.close()
        if self.stopping.reason and not self.quiet and self.main:
            note(f"stopped after iteration {it}: {self.stopping.reason}")
        return TrainResult(self.files.run_dir, self.files.log, self.files.restart, it,
                           last_loss, preempted, dist.rank, self.metrics,
                           stopped=self.stopping.reason)

    def checkpoint(self, k: int) -> None:
        """Write the restart file at iteration ``k``. The log's rows up to iteration ``k-1``
        reach the disk before it is published, so a kill between the two leaves rows that
        resume drops, never a gap."""
        self.log.flush(sync=True)
        save_restart(self.files.restart, iteration=k, model=self.model,
                     optimizer=self.optimizer, scheduler=self.scheduler, ctx=self.ctx,
                     cfg=self.cfg, sha=self.sha,
                     problem_state=self.problem.state_dict(self.ctx),
                     stopping=self.stopping.state())
        self.wrote["restart"] = True

    # -- one iteration -------------------------------------------------------------------

    def iteration(self, it: int) -> tuple[dict[str, Any], float]:
        """Iteration ``it``: the loss and its gradient (averaged over the ranks), the
        optimiser's step, the scheduler's, and the log row (:mod:`.rows`). Returns
        ``(row, loss)``."""
        from .. import distributed as D

        cfg, ctx, dist, log = self.cfg, self.ctx, self.dist, self.log
        D.broadcast_buffers(dist, self.model)
        if self.stages:
            ctx.horizon = horizon(self.stages, it)
        adjoint_every = int(cfg["adjoint_every"])
        adjoint = adjoint_every and it % adjoint_every == 0
        ctx.want_adjoint_norms = bool(adjoint)
        track = (ctx.device.type == "cpu" and bool(cfg["budget"])
                 and it % max(int(cfg.get("memory_every", 1)), 1) == 0)
        stopping = self.stopping
        stopping.start_iteration()
        row, loss = self._step(it, track)

        def agree(flag: bool) -> bool:   # every rank takes the same decision
            return D.any_rank(dist, flag, ctx.device)

        stopping.after_step(row, agree)
        row["budget_bytes"] = budget_bytes(ctx)
        if self.stages:
            row["n_steps"] = int(ctx.horizon)
        if adjoint:
            log_adjoint_norms(log, it, ctx.unroll_stats)
        add_rank_peaks(dist, row, ctx.device)
        for k in self.baseline:
            row[f"metric/{k}"] = math.nan
        eval_every = int(cfg["eval_every"])
        if ((eval_every and (it + 1) % eval_every == 0) or it == int(cfg["iterations"]) - 1
                or stopping.reason):
            with torch.no_grad():
                numbers, curves = split_evaluation(self.problem.evaluate(ctx))
            for k, v in numbers.items():
                row[f"metric/{k}"] = self.metrics[k] = v
            log_evaluation_curves(log, it, curves)
            stopping.after_evaluation(numbers, agree)
        row["elapsed"] = stopping.elapsed()
        if stopping.reason:
            row["stopped"] = stopping.reason
        return row, loss

    def _step(self, it: int, track: bool) -> tuple[dict[str, Any], float]:
        """The optimiser's step of iteration ``it`` and the row's loss, time, memory and
        unroll columns; ``track``: meter the bytes deepsolve holds (CPU budgets)."""
        from ..distributed import average_gradients
        from ..memory.meter import MemoryMeter

        ctx, dist, optimizer, params = self.ctx, self.dist, self.optimizer, self.params
        dev = ctx.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            reset_high_water_mark()  # this iteration's real peak, where the kernel allows
            # the run's baseline: the lowest resident size at an iteration's start, so that
            # memory freed during the run (garbage of earlier work collected, a cache
            # trimmed) cannot hide this run's peaks below where the run started
            self.host_base = min(self.host_base, process_status("VmRSS:"))
        ctx.unroll_stats.clear()
        meter = MemoryMeter(dev, stats=StatsSum(ctx.unroll_stats)) if track else None
        t0 = time.perf_counter()
        timing: dict[str, Any] = {}

        def evaluate_loss():
            optimizer.zero_grad(set_to_none=True)
            if meter is not None:   # this evaluation's unrolls (the earlier ones released)
                meter.stats.start = len(ctx.unroll_stats)
            ta = time.perf_counter()
            terms = check_terms(self.problem.residuals(ctx, it), it)
            # a tensor: check_terms refused an empty dict (sum() types it `| Literal[0]`)
            loss = cast(torch.Tensor, sum(float(self.weights.get(k, 1.0)) * v.reshape(())
                                          for k, v in terms.items()))
            tb = time.perf_counter()
            loss.backward()
            if dist is not None and dist.enabled:  # average gradients, terms and loss
                terms, loss = average_gradients(dist, params, terms, loss)
            timing.update(forward=tb - ta, backward=time.perf_counter() - tb, terms=terms,
                          loss=loss)
            return loss

        if meter is not None:
            meter.__enter__()
        try:
            if self.closure_opt:
                optimizer.step(evaluate_loss)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
            else:
                evaluate_loss()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(
                    params, float(self.cfg["grad_clip"]) or math.inf))
                optimizer.step()
        finally:
            if meter is not None:
                meter.__exit__(None, None, None)
        if self.scheduler is not None:
            self.scheduler.step()
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
            row["peak_real_memory"] = float(max(hwm - self.host_base, 0))
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
