"""Settings: what a run can be told, each declared once with its default, its range, how a
``--set key=text`` string becomes its value, and its help line.

A :class:`Setting` is one entry of a table ``{name: Setting}``. :data:`TRAINER_SETTINGS` is
the trainer's table (iterations, lr, steps, budget, ...); a problem adds its own in
``defaults`` — a plain value (``"nu": 0.01``: typed by the value, no range, no help) or a
:class:`Setting` (``"nu": Setting(0.01, "viscosity", low=0.0)``) — and may give a trainer
setting a new default with a plain value (``"iterations": 300``; its range and help stay).
:func:`settings_table` merges the two.

Every value passes :meth:`Setting.validate` (its type, then its range, then the setting's own
check) and every command-line string :meth:`Setting.from_text`; errors are one-line
:class:`ConfigError` s (a ``ValueError``) naming the setting, the bad value and what to give
instead. The run
configuration (:mod:`deepsolve.config`) applies the table once, before any work, and parses
the settings that become objects (device, dtype, the budget as one
:class:`~deepsolve.memory.budget.MemoryBudget`); ``deepsolve settings PROBLEM`` prints the
table (:func:`describe`).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from .memory.budget import budget_form, no_budget

__all__ = ["ConfigError", "Setting", "TRAINER_SETTINGS", "TRAINER_DEFAULTS", "settings_table",
           "describe", "parse_compile", "parse_curriculum", "parse_target", "Target",
           "apply_overrides"]

class ConfigError(ValueError):
    """A setting that cannot be used; the message is one line naming it, its value and what
    to give instead."""


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Setting:
    """One setting: its ``default`` (whose type is the setting's type), a ``help`` line,
    the lowest value ``low`` of a number (``allowed`` says the range in words for errors and
    help), whether ``inf`` is allowed (``infinite``), and ``check``, a function that checks
    a value in a form of its own (budget, compile, curriculum) and raises a one-line
    ``ValueError``. A setting with ``check`` takes any value ``check`` accepts; a value is
    stored as given, never rewritten, so the settings a log and a restart file record are the
    user's."""

    default: Any
    help: str = ""
    low: float | None = None
    allowed: str = ""
    infinite: bool = False
    check: Callable[[Any], Any] | None = None

    @property
    def kind(self) -> str:
        """The setting's type in words (``an integer``, ``a number``, ...)."""
        d = self.default
        if isinstance(d, bool):
            return _KINDS[bool]
        if isinstance(d, numbers.Integral):
            return _KINDS[int]
        if isinstance(d, numbers.Real):
            return _KINDS[float]
        if isinstance(d, (list, tuple)):
            return "a list such as 1,2,3"
        return _KINDS[str] if isinstance(d, str) else type(d).__name__

    def from_text(self, key: str, text: str) -> Any:
        """The value of ``--set key=text``, typed by the default."""
        default = self.default
        if isinstance(default, bool):
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"--set {key}={text}: expected true or false")
        if isinstance(default, int):
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"--set {key}={text}: expected an integer") from None
        if isinstance(default, float):
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"--set {key}={text}: expected a number") from None
        if isinstance(default, str) or default is None:
            return text
        if isinstance(default, (list, tuple)):
            try:
                val = json.loads(text)
            except json.JSONDecodeError:
                val = [v.strip() for v in text.split(",") if v.strip()]
            if not isinstance(val, list):
                raise ConfigError(f"--set {key}={text}: expected a list such as 1,2,3")
            return type(default)(val)
        raise ConfigError(f"--set {key}: settings of type {type(default).__name__} cannot be set "
                         "from the command line")

    def validate(self, key: str, value: Any) -> Any:
        """``value`` if it is one this setting takes (type, range, ``check``); else a
        one-line ``ValueError``."""
        if self.check is not None:
            self.check(value)
            return value
        default = self.default
        if default is None:
            return value
        if isinstance(default, bool):
            ok = isinstance(value, (bool, np.bool_))
        elif isinstance(default, numbers.Integral):
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) or \
                isinstance(value, float) and value.is_integer()
        elif isinstance(default, numbers.Real):
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        elif isinstance(default, (list, tuple)):
            ok = isinstance(value, (list, tuple))
        else:
            return value
        if not ok:
            raise ConfigError(f"setting {key}={value!r} is a {type(value).__name__}, not "
                             f"{self.kind}; use --set {key}=VALUE with VALUE {self.kind} (the "
                             f"default is {default!r})")
        if isinstance(default, numbers.Real) and not isinstance(default, bool):
            if not math.isfinite(value) and not (self.infinite and value == math.inf):
                raise ConfigError(f"setting {key}={value!r} is not a finite number; use --set "
                                 f"{key}=VALUE with VALUE {self.allowed or 'finite'}")
            if self.low is not None and value < self.low:
                raise ConfigError(f"setting {key}={value!r} is out of range: {key} must be "
                                 f"{self.allowed or f'>= {self.low}'} (--set {key}=...)")
        return value

    def describe(self) -> str:
        """``help (default ...; allowed)`` for ``deepsolve settings``."""
        extra = f"; {self.allowed}" if self.allowed else ""
        return f"{self.help} (default {self.default!r}{extra})".strip()


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
    raise ConfigError(f"setting compile={value!r}: use auto, on, off or a segment length k >= 1 "
                     "(--set compile=auto)")


def parse_curriculum(text: Any, iterations: int | None = None,
                     steps: int | None = None) -> tuple[tuple[int, int], ...]:
    """The stages of ``--set curriculum=0:50,200:400,600:2000``: ``((start_iteration,
    steps), ...)``, starts strictly increasing from 0, steps >= 1; ``""``: none. One-line
    ``ConfigError`` otherwise.

    A start or a length may be a percentage: of ``iterations`` (a start) or of ``steps``
    (a length), so ``0:10%,30%:30%,60%:100%`` scales with ``--iterations`` and ``--steps``.
    A start ``p%`` is iteration ``round(p * iterations / 100)``, a length
    ``max(1, round(p * steps / 100))``; stages whose starts round to the same iteration keep
    the last. A percentage without its total (``None``) is a ``ConfigError``.
    """
    if text is None or (isinstance(text, str) and not text.strip()):
        return ()
    hint = ("give stages start:steps from iteration 0 on, e.g. --set "
            "curriculum=0:50,200:400,600:2000 or 0:10%,30%:30%,60%:100%")
    if not isinstance(text, str):
        raise ConfigError(f"--set curriculum={text!r}: not a list of stages; {hint}")

    def number(token: str, low: float) -> tuple[float, bool]:
        token = token.strip()
        pct = token.endswith("%")
        value = float(token[:-1]) if pct else int(token)
        if pct and not (low <= value <= 100 and math.isfinite(value)):
            raise ValueError
        return value, pct

    written: list[tuple[float, bool, float, bool]] = []
    for part in text.split(","):
        a, sep, b = part.partition(":")
        try:
            if not sep:
                raise ValueError
            start, start_pct = number(a, 0.0)
            length, length_pct = number(b, 1e-300)
        except ValueError:
            raise ConfigError(f"--set curriculum={text}: stage {part.strip()!r} is not "
                              f"start:steps (integers, or percentages up to 100%); "
                              f"{hint}") from None
        prev = written[-1] if written else None
        if (length < 1 and not length_pct) or start < 0 or (
                prev is not None and prev[1] == start_pct and start <= prev[0]):
            raise ConfigError(f"--set curriculum={text}: stage {part.strip()!r} needs steps >= "
                              "1 and a start after the previous stage's; " + hint)
        written.append((start, start_pct, length, length_pct))
    if written[0][0] != 0:
        raise ConfigError(f"--set curriculum={text}: the first stage must start at iteration "
                          f"0; {hint}")
    for pct, total, what in ((any(w[1] for w in written), iterations, "iterations"),
                             (any(w[3] for w in written), steps, "steps")):
        if pct and total is None:
            raise ConfigError(f"--set curriculum={text}: a percentage of {what} needs a run "
                              f"with a {what} setting; give that stage in {what}")
    its, n = int(iterations or 0), int(steps or 0)
    stages: list[tuple[int, int]] = []
    for start, start_pct, length, length_pct in written:
        first = round(start * its / 100) if start_pct else int(start)
        size = max(1, round(length * n / 100)) if length_pct else int(length)
        if stages and first < stages[-1][0]:
            raise ConfigError(f"--set curriculum={text}: its starts are not increasing with "
                              f"{its} iterations; {hint}")
        if stages and first == stages[-1][0]:
            stages.pop()
        stages.append((first, size))
    return tuple(stages)


@dataclass(frozen=True)
class Target:
    """A level at which a run has trained enough: ``name`` (the loss, ``loss/<term>`` or a
    metric of ``Problem.evaluate``; ``None``: the problem's ``target_metric``, else the
    loss) at or below ``level``."""

    name: str | None
    level: float

    def __str__(self) -> str:
        return f"{self.name or 'target'} <= {self.level:g}"


def parse_target(value: Any) -> Target | None:
    """``--set target=``: ``""`` (none), ``LEVEL`` (the problem's ``target_metric``, else the
    loss) or ``NAME:LEVEL`` (``loss``, ``loss/pde``, ``u_rel_l2``...), the level a finite
    number > 0. One-line ``ConfigError`` otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    hint = "give --set target=1e-8 (the problem's target metric) or target=NAME:LEVEL " \
        "such as target=loss:1e-6"
    if isinstance(value, bool):
        raise ConfigError(f"--set target={value}: not a level; {hint}")
    name, sep, level = str(value).strip().rpartition(":") if isinstance(value, str) \
        else ("", "", str(value))
    name = name.strip()
    try:
        number = float(level)
    except ValueError:
        raise ConfigError(f"--set target={value}: {level.strip()!r} is not a number; "
                          f"{hint}") from None
    if sep and not name:
        raise ConfigError(f"--set target={value}: the name before ':' is empty; {hint}")
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(f"--set target={value}: the level must be a finite number > 0; "
                          f"{hint}")
    return Target(name or None, number)


def _check_curriculum(value: Any) -> None:
    """A curriculum's form; its percentages are checked against a run of 100 iterations of
    100 steps (the run's own totals resolve them: :func:`parse_curriculum`)."""
    parse_curriculum(value, 100, 100)


def _check_budget(value: Any) -> None:
    """A budget's form (bytes, ``"2GiB"``, ``"80%"``; ``""`` or ``None``: none); the bytes of
    a percentage are resolved later, on the run's device."""
    if no_budget(value):
        return
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise ConfigError(f"setting budget={value!r} is a {type(value).__name__}, not bytes or "
                         "a string such as '2GiB' or '80%'")
    try:
        budget_form(value if isinstance(value, str) else float(value))
    except (ValueError, OverflowError) as e:
        why = " ".join(str(e).split())
        named = repr(value) in why or str(value) in why
        raise ConfigError(f"--budget: {why}" if named else f"--budget {value!r}: {why}") from None


def _check_device(value: Any) -> None:
    if not isinstance(value, (str, torch.device)):
        raise ConfigError(f"--device {value!r}: not a device name; use --device cpu, cuda or "
                         "cuda:N")


def _check_seed(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"setting seed={value!r} is not an integer")


def _check_choice(key: str, choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"--{key} {value}: not a {key} the trainer knows; use --{key} "
                             f"{', '.join(choices[:-1])} or {choices[-1]}")
    return check


#: The trainer's settings: every problem has them; ``--set key=value`` changes any of them.
TRAINER_SETTINGS: Mapping[str, Setting] = MappingProxyType({
    "iterations": Setting(100, "optimiser steps", low=0, allowed=">= 0"),
    "lr": Setting(1e-3, "learning rate", low=0.0, allowed=">= 0"),
    "steps": Setting(100, "unroll length of ctx.unroll", low=0, allowed=">= 0"),
    "budget": Setting("", "memory budget of ctx.unroll: bytes, 512MiB, 2GB or 80% (\"\": "
                      "none, then snapshots or every step stored)", check=_check_budget),
    "snapshots": Setting(0, "revolve slots when no budget is given", low=0,
                         allowed=">= 0 (0: store every step)"),
    "reversible": Setting(0, "> 0: rebuild states by the step's inverse, with this many "
                          "snapshots (the step needs an inverse)", low=0, allowed=">= 0"),
    "seed": Setting(0, "seed of torch, numpy, random and ctx.generator", check=_check_seed),
    "device": Setting("cpu", "where the run computes: cpu, cuda or cuda:N",
                      check=_check_device),
    "dtype": Setting("float32", "floating-point precision of the model and the data",
                     check=_check_choice("dtype", ("float32", "float64", "bfloat16",
                                                   "float16"))),
    "eval_every": Setting(10, "iterations between Problem.evaluate calls", low=0,
                          allowed=">= 0 (0: evaluate only at the end)"),
    "time_limit": Setting(0.0, "minutes of training after which the run stops (resumes "
                          "included; it ends with an evaluation and a restart file)", low=0.0,
                          allowed=">= 0 (minutes; 0: no limit)"),
    "target": Setting("", "stop once this level is reached: LEVEL (the problem's target "
                      "metric, else the loss) or NAME:LEVEL, such as loss:1e-6 or "
                      "u_rel_l2:1e-8 (\"\": none)", check=parse_target),
    "checkpoint_every": Setting(25, "iterations between restart files", low=1, allowed=">= 1"),
    "grad_clip": Setting(0.0, "clip the global gradient norm", low=0.0, infinite=True,
                         allowed=">= 0 (0: no clipping)"),
    "memory_every": Setting(1, "CPU runs with a budget: measure tracked memory every N "
                            "iterations", low=1, allowed=">= 1"),
    "threads": Setting(0, "torch CPU threads", low=0,
                       allowed=">= 0 (0: the default, see docs/problems.md)"),
    "progress_every": Setting(30.0, "seconds between progress lines when stderr is not a "
                              "terminal", low=0.0,
                              allowed=">= 0 (seconds; 0: a line every iteration)"),
    "budget_once": Setting(True, "resolve a \"%\" budget once at the start (false: at every "
                           "unroll)"),
    "cache_dir": Setting("runs/cache", "where ctx.cache keeps a problem's derived data (the "
                         "DEEPSOLVE_CACHE_DIR environment variable, when set, replaces the "
                         "default)"),
    "curriculum": Setting("", "unroll horizon by iteration, start:steps,... such as "
                          "0:50,200:400 or 0:10%,50%:100% (percentages of iterations and of steps; "
                          "\"\": steps throughout)", check=_check_curriculum),
    "adjoint_every": Setting(0, "log the adjoint norms of one unroll every N iterations",
                             low=0, allowed=">= 0 (0: no adjoint norms logged)"),
    "mesh": Setting("", "distributed runs: DATAxSPACE ranks (\"\": all space with ctx.slab)"),
    "dist_timeout": Setting(600.0, "seconds a rank waits for the others before it stops "
                            "with an error", low=0.1, allowed=">= 0.1 (seconds)"),
    "tensorboard": Setting("", "mirror the log's scalars to TensorBoard in this directory "
                           "(\"\": off; relative: inside the run directory)"),
    "compile": Setting("auto", "compiled step segments (docs/compile.md): auto, on, off or a "
                       "segment length k", check=parse_compile),
})

#: The trainer's defaults, read-only (:data:`TRAINER_SETTINGS`' defaults).
TRAINER_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {k: s.default for k, s in TRAINER_SETTINGS.items()})


def settings_table(defaults: Mapping[str, Any]) -> dict[str, Setting]:
    """The trainer's settings updated with a problem's ``defaults``: a :class:`Setting`
    replaces or adds one; a plain value is a new default (a trainer setting keeps its help,
    range and check) or a new setting typed by the value."""
    table = dict(TRAINER_SETTINGS)
    for k, v in defaults.items():
        if isinstance(v, Setting):
            table[k] = v
        elif k in table:
            table[k] = replace(table[k], default=v)
        else:
            table[k] = Setting(v)
    return table


def apply_overrides(cfg: Mapping[str, Any], pairs: list[str],
                    table: Mapping[str, Setting] | None = None) -> dict[str, Any]:
    """Apply ``key=value`` strings to the settings ``cfg`` (typed by ``table``, default: by
    the values of ``cfg``); unknown keys fail."""
    out = dict(cfg)
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected key=value")
        key, text = pair.split("=", 1)
        key = key.strip()
        if key not in cfg:
            known = ", ".join(sorted(cfg))
            raise ConfigError(f"--set {key}: unknown setting; known settings: {known}")
        setting = table[key] if table is not None and key in table else Setting(cfg[key])
        out[key] = setting.from_text(key, text)
    return out


def describe(table: Mapping[str, Setting]) -> str:
    """The table as text: one line per setting, ``name  help (default ...; range)``."""
    width = max((len(k) for k in table), default=0)
    return "\n".join(f"{k:<{width}}  {s.describe()}" for k, s in table.items())
