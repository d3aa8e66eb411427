"""The random state a restart file records: torch's CPU and CUDA generators, numpy's and
Python's global ones (one :class:`~deepsolve.engine.RngState`, the record the engine's replay
and the gradient check use too), and the problem's own ``ctx.generator``.

A resumed run draws the same numbers as the run it continues: :func:`rng_state` captures them
at a restart, :func:`set_rng_state` puts them back, and :func:`check_rng_state` tries a
recorded state on scratch generators first, so a restart file whose state does not fit this
process is refused before anything is changed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

from ..engine import RngState
from ..problem import Context

__all__ = ["rng_state", "set_rng_state", "check_rng_state", "rng_state_problem"]


#: Mersenne Twister state words (numpy's MT19937 key, Python's ``random``).
_MT_WORDS = 624


def rng_state(ctx: Context) -> dict[str, Any]:
    """The generators' state (:class:`~deepsolve.engine.RngState`, every CUDA device's where
    CUDA is available) and ``ctx.generator``'s, in the restart file's form."""
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else ()
    s = RngState.capture(devices, host=True)
    np_state = cast("tuple[str, np.ndarray, int, int, float]", s.numpy)
    state = {
        "torch": s.cpu,
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": list(s.python[1]) + [s.python[0]],
        "generator": ctx.generator.get_state(),
    }
    if s.devices:
        state["cuda"] = list(s.cuda)
    return state


def _record(state: Mapping[str, Any], devices: int = 0) -> RngState:
    """The :class:`~deepsolve.engine.RngState` of a restart file's ``rng`` (its first
    ``devices`` CUDA states)."""
    name, keys, pos, has_gauss, gauss = state["numpy"]
    py = state["python"]
    cuda = tuple(state.get("cuda", ())[:devices])
    return RngState(state["torch"], tuple(range(len(cuda))), cuda,
                    (py[-1], tuple(py[:-1]), None),
                    (name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def set_rng_state(ctx: Context, state: dict[str, Any]) -> None:
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _record(state, devices).restore()
    ctx.generator.set_state(state["generator"])


def _int(v: Any) -> int | None:
    """``v`` as a Python int when it is an integer (not a bool; a one-element integer
    tensor counts), else ``None``."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() \
            and v.dtype != torch.bool:
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _byte_state(v: Any, field: str, size: int | None) -> str | None:
    """Why ``v`` is not a generator state of torch's form: a 1-D uint8 tensor (of ``size``
    bytes where given)."""
    if not isinstance(v, torch.Tensor):
        return f"'{field}' is a {type(v).__name__}, not a uint8 tensor"
    if v.dtype != torch.uint8 or v.dim() != 1 or not v.numel():
        return f"'{field}' is a {v.dtype} tensor of shape {tuple(v.shape)}, not a 1-D uint8 one"
    if size is not None and v.numel() != size:
        return f"'{field}' holds {v.numel()} bytes, not the {size} of torch's CPU generator"
    return None


def _numpy_problem(v: Any) -> str | None:
    """Why ``v`` is not numpy's legacy MT19937 state ``[name, key, pos, has_gauss,
    gauss]``: key 624 values in [0, 2**32), pos in 0..624, has_gauss 0 or 1, gauss finite."""
    if not isinstance(v, (list, tuple)) or len(v) != 5:
        return (f"'rng.numpy' is {type(v).__name__} {' '.join(repr(v).split())[:40]}, not "
                "[name, key, pos, has_gauss, gauss]")
    name, key, pos, has_gauss, gauss = v
    if name != "MT19937":
        return f"'rng.numpy' names the generator {str(name)[:40]!r}, not 'MT19937'"
    if isinstance(key, np.ndarray):
        key = torch.from_numpy(np.asarray(key))
    if not isinstance(key, torch.Tensor) or key.is_floating_point() or key.is_complex() \
            or key.dtype == torch.bool or tuple(key.shape) != (_MT_WORDS,):
        what = f"{key.dtype} tensor of shape {tuple(key.shape)}" \
            if isinstance(key, torch.Tensor) else type(key).__name__
        return f"'rng.numpy' key is a {what}, not {_MT_WORDS} unsigned 32-bit integers"
    k = key.to(torch.int64)
    if bool((k < 0).any()) or bool((k >= 2**32).any()):
        return f"'rng.numpy' key has values outside [0, 2**32) (from {int(k.min())} to " \
            f"{int(k.max())})"
    p = _int(pos)
    if p is None or not 0 <= p <= _MT_WORDS:
        return f"'rng.numpy' pos is {' '.join(repr(pos).split())[:40]}, not in 0..{_MT_WORDS}"
    g = _int(has_gauss)
    if g not in (0, 1):
        return f"'rng.numpy' has_gauss is {' '.join(repr(has_gauss).split())[:40]}, not 0 or 1"
    if isinstance(gauss, bool) or not isinstance(gauss, (int, float)) or \
            not math.isfinite(gauss):
        return f"'rng.numpy' gauss is {' '.join(repr(gauss).split())[:40]}, not a finite number"
    return None


def _python_problem(v: Any) -> str | None:
    """Why ``v`` is not Python's ``random`` state as recorded: 624 words in [0, 2**32),
    the position in 0..624, then the version 3."""
    n = _MT_WORDS + 2
    if not isinstance(v, (list, tuple)) or len(v) != n:
        got = f"{len(v)} entries" if isinstance(v, (list, tuple)) else type(v).__name__
        return f"'rng.python' is {got}, not {n} integers (the state words, position, version)"
    values = [_int(x) for x in v]
    if any(x is None for x in values):
        bad = next(i for i, x in enumerate(values) if x is None)
        return f"'rng.python' entry {bad} is {type(v[bad]).__name__}, not an integer"
    if values[-1] != 3:
        return f"'rng.python' version is {values[-1]}, not 3"
    if not 0 <= values[-2] <= _MT_WORDS:  # type: ignore[operator]
        return f"'rng.python' position is {values[-2]}, not in 0..{_MT_WORDS}"
    words = values[:-2]
    if any(not 0 <= w < 2**32 for w in words):  # type: ignore[operator]
        return "'rng.python' has state words outside [0, 2**32)"
    return None


def rng_state_problem(state: Any) -> str | None:
    """What is wrong with a restart file's ``rng`` field, naming the entry (``'rng.numpy'
    pos is -1, not in 0..624``), or ``None`` when it is well formed: torch's CPU state and
    ``generator`` 1-D uint8 tensors of the CPU generator's size, each CUDA state a 1-D
    uint8 tensor, numpy's MT19937 and Python's Mersenne Twister states in range — and all of
    them accepted by scratch generators (:func:`check_rng_state`), so nothing is changed."""
    if not isinstance(state, Mapping):
        return f"'rng' is a {type(state).__name__}, not a dict"
    missing = [k for k in ("torch", "numpy", "python", "generator") if k not in state]
    if missing:
        return f"'rng' has no {', '.join(map(repr, missing))} state"
    size = torch.Generator().get_state().numel()
    why = (_byte_state(state["torch"], "rng.torch", size)
           or _byte_state(state["generator"], "rng.generator", size)
           or _numpy_problem(state["numpy"]) or _python_problem(state["python"]))
    if why:
        return why
    cuda = state.get("cuda", [])
    if not isinstance(cuda, (list, tuple)):
        return f"'rng.cuda' is a {type(cuda).__name__}, not a list of uint8 tensors"
    for i, c in enumerate(cuda):
        why = _byte_state(c, f"rng.cuda[{i}]", None)
        if why:
            return why
    try:
        check_rng_state(state)
    except Exception as e:
        return (f"'rng' does not fit this process's generators ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:160]})")
    return None


def check_rng_state(state: Any) -> None:
    """Raise if ``state`` (a restart's ``rng``) does not fit this process's generators;
    tried on scratch generators, so nothing is changed."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a {type(state).__name__}, not a dict")
    missing = [k for k in ("torch", "numpy", "python", "generator") if k not in state]
    if missing:
        raise KeyError(f"no {', '.join(missing)} state")
    r = _record(state)
    torch.Generator().set_state(r.cpu)
    np.random.RandomState().set_state(r.numpy)
    random.Random().setstate(r.python)
    torch.Generator().set_state(state["generator"])
