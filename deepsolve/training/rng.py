"""The random state a restart file records: torch's CPU and CUDA generators, numpy's and
Python's global ones (one :class:`~deepsolve.engine.RngState`, the record the engine's replay
and the gradient check use too), and the problem's own ``ctx.generator``.

A resumed run draws the same numbers as the run it continues: :func:`rng_state` captures them
at a restart, :func:`set_rng_state` puts them back, and :func:`check_rng_state` tries a
recorded state on scratch generators first, so a restart file whose state does not fit this
process is refused before anything is changed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

from ..engine import RngState
from ..problem import Context

__all__ = ["rng_state", "set_rng_state", "check_rng_state"]


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
