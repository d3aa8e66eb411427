"""The run configuration: a run's settings, validated and parsed once, before any work.

:func:`run_config` takes the problem's settings table (:meth:`~deepsolve.problem.Problem.settings`:
the trainer's :data:`~deepsolve.settings.TRAINER_SETTINGS` and the problem's ``defaults``),
applies the ``--set key=value`` pairs (each typed by its :class:`~deepsolve.settings.Setting`)
and the explicit options (``--budget``, ``--device``, ...), validates every setting by its
entry and parses the ones the trainer needs as objects. The result is a frozen
:class:`RunConfig`: a read-only mapping of the settings (``cfg["steps"]``; ``cfg["steps"] =
5`` raises ``TypeError``) with the parsed values as attributes — ``device`` (a
``torch.device`` that exists here), ``dtype``, ``threads`` (the torch CPU thread count the
run uses) and ``budget`` (the unroll budget as one
:class:`~deepsolve.memory.budget.MemoryBudget`, a ``"%"`` budget read on ``device``; ``None``
without one), which everything downstream takes.

Every error is a :class:`ConfigError` (a ``ValueError``) of one line naming the setting, the
bad value and what to give instead; the trainer, ``plan`` and ``check`` make the
configuration before they load data, build a model or make a run directory, so a bad
``--budget``, ``--device`` or ``--set`` costs nothing and leaves nothing behind. Where the
settings are written down (the restart file, the log's ``config`` attribute, the settings a
``--resume`` compares) they stay a plain dict: :meth:`RunConfig.as_dict`.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .memory.budget import MemoryBudget, no_budget, read_budget
from .problem import Problem
from .settings import TRAINER_SETTINGS, ConfigError, Setting, apply_overrides, parse_curriculum

__all__ = ["RunConfig", "ConfigError", "run_config", "config_from_settings", "parse_device",
           "resolve_threads", "parse_curriculum", "horizon", "DTYPES", "DEFAULT_THREADS"]


#: The dtypes a run may use (the ``dtype`` setting, ``--dtype``).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64,
                                  "bfloat16": torch.bfloat16, "float16": torch.float16}

#: torch's CPU threads when neither ``threads`` nor ``OMP_NUM_THREADS`` says otherwise; chosen
#: from measurements on the shipped problems (docs/problems.md, "Threads"): one thread is as
#: fast as two on a quiet 2-core machine for these step sizes and several times faster on a
#: loaded one, where threads wait for each other at every operation.
DEFAULT_THREADS = 1


@dataclass(frozen=True, eq=False)
class RunConfig(Mapping):
    """A run's validated settings (a read-only mapping) and their parsed values.

    Made by :func:`run_config` (or :func:`config_from_settings`); never changed. A changed
    configuration is a new one: :meth:`replace` validates it again.
    """

    settings: Mapping[str, Any]        # read-only view of the settings
    device: torch.device               # where the run computes (exists on this machine)
    dtype: torch.dtype
    threads: int                       # torch CPU threads the run uses (resolved, >= 1)
    budget: MemoryBudget | None        # the unroll budget, read once (None: no budget)
    table: Mapping[str, Setting] = field(default_factory=dict, repr=False)

    @property
    def budget_bytes(self) -> int | None:
        """The budget's bytes as read (``None`` without a budget)."""
        return None if self.budget is None else self.budget.nbytes

    @property
    def defaults(self) -> dict[str, Any]:
        """The default value of every setting of the table."""
        return {k: s.default for k, s in self.table.items()}

    def __getitem__(self, key: str) -> Any:
        return self.settings[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.settings)

    def __len__(self) -> int:
        return len(self.settings)

    def as_dict(self) -> dict[str, Any]:
        """The settings as a new plain dict (what the restart file and the log record)."""
        return copy.deepcopy(dict(self.settings))

    def replace(self, **changes: Any) -> RunConfig:
        """A new configuration with ``changes`` applied, validated like the first."""
        return config_from_settings({**self.settings, **changes}, self.table)

    def on_device(self, name: str) -> RunConfig:
        """The same configuration with the ``device`` setting written as ``name`` (the name
        :func:`deepsolve.distributed.setup` gives this rank's device, ``cuda`` ->
        ``cuda:LOCAL_RANK``); ``name`` must be :attr:`device`, which the budget was resolved
        on, so nothing is parsed again."""
        if self.settings.get("device") == name:
            return self
        if parse_device(name) != self.device:
            raise ConfigError(f"--device {name}: the configuration was made for "
                              f"{self.device}; make a new one")
        settings = dict(self.settings, device=name)
        return RunConfig(MappingProxyType(settings), self.device, self.dtype, self.threads,
                         self.budget, self.table)


def run_config(problem: Problem, overrides: Mapping[str, Any] | None = None,
               sets: list[str] | None = None, *, rank_device: bool = True) -> RunConfig:
    """The run configuration of ``problem``: its defaults, then the ``--set key=value``
    pairs (typed by their settings), then ``overrides`` (explicit options; ``None`` values are
    left out), all checked. ``rank_device``: under torchrun, ``device`` is this rank's
    (``cuda`` -> ``cuda:LOCAL_RANK``). Raises :class:`ConfigError` (one line)."""
    table = problem.settings()
    defaults = {k: s.default for k, s in table.items()}
    sets = list(sets or [])
    for pair in sets:
        key = pair.split("=", 1)[0].strip() if "=" in pair else None
        if key is not None and key not in defaults:
            raise ConfigError(f"--set {key}: unknown setting{_did_you_mean(key, defaults)}; "
                              f"known settings: {', '.join(sorted(defaults))}")
    cfg = apply_overrides(defaults, sets, table)
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in cfg:
            raise ConfigError(f"unknown setting {k!r}{_did_you_mean(k, cfg)}; known settings: "
                              f"{', '.join(sorted(cfg))}")
        cfg[k] = v
    return config_from_settings(cfg, table, rank_device=rank_device)


def config_from_settings(settings: Mapping[str, Any], table: Mapping[str, Setting] | None = None,
                         *, rank_device: bool = True) -> RunConfig:
    """A :class:`RunConfig` from complete settings (a configuration's ``as_dict()``, possibly
    changed): each value validated by its entry in ``table`` (default: the trainer's
    settings; a key without an entry is taken as it is), then the device, the thread count,
    the budget and the curriculum parsed."""
    cfg = dict(settings)
    table = dict(table) if table is not None else dict(TRAINER_SETTINGS)
    for k, v in cfg.items():
        if k == "device" and isinstance(v, torch.device):
            cfg[k] = v = str(v)
        if k in table:
            table[k].validate(k, v)
    dtype_name = cfg.get("dtype", "float32")
    if dtype_name not in DTYPES:
        raise ConfigError(f"--dtype {dtype_name}: not a dtype the trainer knows; use --dtype "
                          f"{', '.join(list(DTYPES)[:-1])} or {list(DTYPES)[-1]}")
    name = cfg.get("device", "cpu")
    if rank_device:
        from .distributed import rank_device as _rank_device

        try:
            name_here = _rank_device(str(name)) if isinstance(name, str) else name
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        name_here = name
    device = parse_device(name_here)
    threads = resolve_threads(cfg.get("threads", 0))
    budget = _read_budget(cfg.get("budget"), device)
    stages = parse_curriculum(cfg.get("curriculum", ""), cfg.get("iterations"),
                              cfg.get("steps"))
    if stages and "steps" in cfg and max(n for _, n in stages) > int(cfg["steps"]):
        raise ConfigError(f"--set curriculum={cfg['curriculum']}: its longest stage "
                          f"({max(n for _, n in stages)} steps) exceeds steps={cfg['steps']}, "
                          "the horizon the problem's data is made for; raise --steps or "
                          "shorten the stage")
    return RunConfig(MappingProxyType(copy.deepcopy(cfg)), device, DTYPES[dtype_name],
                     threads, budget, MappingProxyType(table))


def horizon(stages: tuple[tuple[int, int], ...], iteration: int) -> int:
    """The unroll length of ``iteration`` under curriculum ``stages``."""
    n = stages[0][1]
    for start, steps in stages:
        if start > iteration:
            break
        n = steps
    return n


def parse_device(name: Any) -> torch.device:
    """The ``torch.device`` of ``--device name``, which must exist here: ``cpu``, or ``cuda``
    / ``cuda:N`` with CUDA available and N below the visible device count. One-line
    :class:`ConfigError` otherwise."""
    text = str(name) if isinstance(name, torch.device) else name
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"--device {text!r}: not a device name; use --device cpu, cuda or "
                          "cuda:N")
    text = text.strip()
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {text}: not a device; use --device cpu, cuda or "
                          "cuda:N") from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ConfigError(f"--device {text}: there is one CPU device; use --device cpu")
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ConfigError(f"--device {text}: CUDA is not available here ({why}); use "
                              "--device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            have = "cuda:0" if n == 1 else f"cuda:0 to cuda:{n - 1}"
            raise ConfigError(f"--device {text}: this machine has {n} CUDA device"
                              f"{'s' if n != 1 else ''} ({have}); use --device cuda or one "
                              "of those")
        return dev
    raise ConfigError(f"--device {text}: the trainer runs on cpu or cuda, not {dev.type}; use "
                      "--device cpu, cuda or cuda:N")


def resolve_threads(threads: Any) -> int:
    """The torch CPU thread count of a run: ``threads`` when it is > 0; with 0, the
    ``OMP_NUM_THREADS`` environment variable when it is set (a batch script's choice is
    kept), else :data:`DEFAULT_THREADS` (at most the CPUs this process may use)."""
    n = int(threads)
    if n > 0:
        return n
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(DEFAULT_THREADS, usable))


def _read_budget(budget: Any, device: torch.device) -> MemoryBudget | None:
    if no_budget(budget):
        return None
    try:
        return read_budget(budget, device)
    except (ValueError, OverflowError) as e:
        why = " ".join(str(e).split())
        named = repr(budget) in why or str(budget) in why
        raise ConfigError(f"--budget: {why}" if named else
                          f"--budget {budget!r}: {why}") from None


def _did_you_mean(key: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=2, cutoff=0.7)
    return f" (did you mean {' or '.join(close)}?)" if close else ""
