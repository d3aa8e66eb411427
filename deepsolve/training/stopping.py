"""When a run stops before its last iteration: a target reached, or its time limit.

Two settings, both honoured for every problem (:data:`deepsolve.settings.TRAINER_SETTINGS`):

* ``target`` (:func:`~deepsolve.settings.parse_target`): ``NAME:LEVEL`` or ``LEVEL``. The
  run stops after the first iteration at which ``NAME`` is at or below ``LEVEL``. The loss
  and its terms (``loss``, ``loss/pde``) are read at every iteration (the value the row
  logs: the loss before the optimiser's step); a metric of ``Problem.evaluate`` when it is
  evaluated (every ``eval_every`` iterations and at the last), so a metric target is seen
  within ``eval_every`` iterations of being reached. ``LEVEL`` alone names the problem's
  ``target_metric`` (a class attribute), else the loss.
* ``time_limit`` (minutes): the training time, counted from the run's first iteration,
  resumes included (the restart file carries it), evaluations and restart files included.
  After each iteration's optimiser step the run asks whether one more iteration of the
  pace just measured would pass the limit; if so this iteration is the last: it is
  evaluated, logged and written to a restart file. The run so ends within its limit when
  its pace holds, and past it by at most one iteration's change of pace and one
  evaluation otherwise.

A run that stops so writes the reason in the log's ``stopped`` column (its last row; the
others hold ``""``), in the restart file (``stopped``, ``elapsed``) and in
:class:`~.run.TrainResult`. Every row also holds ``elapsed``, the training time in seconds
at its end. ``--resume`` of a run that stopped at its target or its limit continues only
when the setting that stopped it was changed (a lower target, none, a longer limit):
otherwise there is nothing to train, and :func:`check_resume` says what to give.

In a distributed run every rank takes the same decision: the ranks' clocks differ, so the
time limit is decided by any rank's (:func:`deepsolve.distributed.any_rank`); the loss is
the ranks' average, the same on each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..problem import ProblemError
from ..settings import Target, parse_target
from .restart import RestartError

__all__ = ["Stopping", "check_resume", "check_target_name"]


class Stopping:
    """A run's stopping rules, its training clock and the reason it stopped.

    Args:
        target: the parsed ``target`` setting or ``None``.
        time_limit: minutes; 0: none.
        elapsed: seconds of training before this process's start (a resumed run's).
        metrics: the metric names ``Problem.evaluate`` gives (a metric target must be one).
        target_metric: the problem's ``target_metric`` (a target given as a level alone).
        where: the problem file, for the error messages.
        terms: the names of the problem's loss terms, asked for only when the target names
            one (``loss/<term>``) or nothing the problem has (for the error's list): they
            are known from an evaluation of the residuals (:func:`.terms.loss_term_names`).

    Raises:
        ProblemError: (one line) a target that names neither the loss, one of its terms
            nor a metric, with the names there are.
    """

    def __init__(self, target: Target | None, time_limit: float, elapsed: float,
                 metrics: Mapping[str, Any], target_metric: str | None, where: str,
                 terms: Callable[[], list[str]] | None = None):
        self.limit = 60.0 * float(time_limit) if time_limit else math.inf
        self.name = None if target is None else (target.name or target_metric or "loss")
        self.level = math.nan if target is None else target.level
        if self.name is not None and self.name != "loss" and self.name not in metrics:
            check_target_name(self.name, self.level, metrics, terms, where)
        self.metric = self.name is not None and self.name in metrics
        self.t0 = time.perf_counter() - float(elapsed)
        self.started = self.t0
        self.reason = ""

    @property
    def timed(self) -> bool:
        """Whether a time limit applies (the ranks must then agree on it)."""
        return math.isfinite(self.limit)

    def elapsed(self) -> float:
        """Seconds of training, resumes included."""
        return time.perf_counter() - self.t0

    def deadline(self) -> float | None:
        """The ``time.perf_counter()`` at which the limit is reached, or ``None``."""
        return self.t0 + self.limit if self.timed else None

    def start_iteration(self) -> None:
        self.started = time.perf_counter()

    def out_of_time(self) -> bool:
        """After the optimiser's step: would one more iteration of this one's pace pass the
        limit?"""
        now = time.perf_counter()
        return self.timed and (now - self.t0) + (now - self.started) > self.limit

    def loss_reached(self, loss: float, terms: Mapping[str, float]) -> bool:
        """Whether the loss (or the named term) is at or below the target's level."""
        if self.name is None or self.metric:
            return False
        value = loss if self.name == "loss" else terms.get(self.name[len("loss/"):], math.nan)
        return value <= self.level

    def metric_reached(self, metrics: Mapping[str, float]) -> bool:
        """Whether the target's metric, just evaluated, is at or below its level."""
        return self.metric and metrics.get(str(self.name), math.nan) <= self.level

    def after_step(self, row: Mapping[str, Any], agree: Callable[[bool], bool]) -> None:
        """After the optimiser's step, its log ``row`` (``loss``, ``loss/<term>``) known:
        stop at the loss target, or at the time limit when any rank (``agree``) is out of
        time."""
        terms = {k[len("loss/"):]: v for k, v in row.items() if k.startswith("loss/")}
        if self.loss_reached(float(row["loss"]), terms):
            self.stop("target", float(row[str(self.name)]))
        elif self.timed and agree(self.out_of_time()):
            self.stop("time_limit")

    def after_evaluation(self, metrics: Mapping[str, float],
                         agree: Callable[[bool], bool]) -> None:
        """After an evaluation: stop at the metric target (when any rank reached it)."""
        if self.metric and not self.reason and agree(self.metric_reached(metrics)):
            self.stop("target", metrics.get(str(self.name), math.nan))

    def stop(self, why: str, value: float | None = None) -> None:
        """Record why the run stops: ``"target"`` (with the value reached) or
        ``"time_limit"``; the reason's text is the log's ``stopped``."""
        if why == "target":
            self.reason = f"target {self.name} {value:.3e} <= {self.level:g}"
        else:
            self.reason = f"time_limit {self.limit / 60:g} min"

    def state(self) -> dict[str, Any]:
        """What the restart file keeps: the training time, the reason and what set it."""
        return {"elapsed": self.elapsed(), "stopped": self.reason,
                "stopped_by": (f"{self.name}:{self.level!r}" if self.reason.startswith("target")
                               else f"{self.limit!r}" if self.reason else "")}


def check_target_name(name: str, level: float, metrics: Mapping[str, Any],
                      terms: Callable[[], list[str]] | None, where: str) -> None:
    """Refuse a target ``name`` that is not the loss, ``loss/<term>`` of a term the
    residuals return (``terms()``; without it any ``loss/...`` passes) or a metric: a
    one-line :class:`ProblemError` naming it and listing the names there are."""
    if name == "loss" or name in metrics:
        return
    if terms is None:
        if name.startswith("loss/"):
            return
        have: list[str] | None = None
    else:
        have = list(terms())
        if name.startswith("loss/") and name[len("loss/"):] in have:
            return
    known = ", ".join(["loss", *(f"loss/{t}" for t in have or ["<term>"]), *sorted(metrics)])
    what = "loss term" if name.startswith("loss/") else "loss term or metric"
    hint = ""
    if have is not None and name in have:
        hint = f" (did you mean loss/{name}?)"
    elif name.startswith("metric/") and name[len("metric/"):] in metrics:
        hint = f" (did you mean {name[len('metric/'):]}?)"
    raise ProblemError(f"--set target={name}:{level:g}: {where} has no {what} {name!r}{hint}; "
                       f"name one of {known}, as --set target=NAME:LEVEL")


def check_resume(restart: Mapping[str, Any], cfg: Mapping[str, Any], path: str) -> None:
    """Refuse ``--resume`` of a run that stopped at its target or time limit when the
    setting that stopped it is unchanged (nothing to train); a one-line
    :class:`RestartError` naming what to give."""
    reason = str(restart.get("stopped", ""))
    by = str(restart.get("stopped_by", ""))
    if reason.startswith("target"):
        name, _, level = by.rpartition(":")
        target = parse_target(cfg.get("target", ""))
        if target is not None and (target.name in (None, name)) and target.level >= float(level):
            raise RestartError(f"{path}: the run reached its target ({reason}) at iteration "
                               f"{restart['iteration']}: nothing to train; give a lower "
                               "--set target=... (or target= for none) to continue it")
    elif reason.startswith("time_limit"):
        limit = 60.0 * float(cfg.get("time_limit", 0) or 0)
        if limit and limit <= float(by) + 1e-9:
            trained = float(restart.get("elapsed", 0.0))
            took = f"{trained / 60:.1f} min" if trained >= 120 else f"{trained:.0f} s"
            raise RestartError(f"{path}: the run stopped at its time limit ({reason}, "
                               f"{took} trained) at iteration "
                               f"{restart['iteration']}: nothing to train; give a longer "
                               "--set time_limit=MINUTES (or 0 for none) to continue it")
