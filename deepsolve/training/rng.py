"""The random state a restart file records: torch's CPU and CUDA generators, numpy's and
Python's global ones, and the problem's own ``ctx.generator``.

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

from ..problem import Context

__all__ = ["rng_state", "set_rng_state", "check_rng_state"]


def rng_state(ctx: Context) -> dict[str, Any]:
    # numpy's stub types the result `dict | tuple`; legacy=True (the default) gives the tuple
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
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


def set_rng_state(ctx: Context, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = state["python"]
    random.setstate((py[-1], tuple(py[:-1]), None))
    ctx.generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def check_rng_state(state: Any) -> None:
    """Raise if ``state`` (a restart's ``rng``) does not fit this process's generators;
    tried on scratch generators, so nothing is changed."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a {type(state).__name__}, not a dict")
    missing = [k for k in ("torch", "numpy", "python", "generator") if k not in state]
    if missing:
        raise KeyError(f"no {', '.join(missing)} state")
    torch.Generator().set_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.RandomState().set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss,
                                       gauss))
    py = state["python"]
    random.Random().setstate((py[-1], tuple(py[:-1]), None))
    torch.Generator().set_state(state["generator"])
