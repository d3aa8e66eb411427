"""Plain helper functions shared by the test modules (fixtures are in conftest.py).

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject.toml): ``from helpers import rel``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from deepsolve.problem import Context, Problem


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``||a - b|| / ||b||`` (2-norm over all elements) as a float.

    The denominator is floored at 1e-300, so ``rel(0, 0) == 0``: an exactly-zero reference
    (the gradient of an unused leaf) is matched only by an exact zero.
    """
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rel_strict(a: torch.Tensor, b: torch.Tensor) -> float:
    """:func:`rel` without the floor: a zero reference gives inf or nan, which fails every
    ``rel_strict(a, b) < tol``."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


def make_ctx(problem: Problem, sets: Iterable[str] = (), *, base: Iterable[str] = (),
             values: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None,
             seed: int | None = None) -> Context:
    """``problem`` built on the CPU, as the trainer builds it with ``--set`` options.

    The configuration is ``problem.config()`` with the ``key=value`` strings of ``base`` (a
    module's tiny settings), then of ``sets``, applied by
    :func:`~deepsolve.problem.apply_overrides` (typed, unknown keys fail), then ``values``
    stored as they are. ``dtype`` defaults to the configuration's (float64 for
    ``"float64"``, float32 otherwise); ``seed`` seeds torch's global generator just before
    ``problem.build``. A module binds its settings once:
    ``make_ctx = functools.partial(helpers.make_ctx, base=SMALL)``.
    """
    from deepsolve.distributed import DistributedContext as Context  # what the trainer builds
    from deepsolve.problem import apply_overrides

    cfg = apply_overrides(problem.config(), [*base, *sets])
    cfg.update(values or {})
    if dtype is None:
        dtype = torch.float64 if cfg["dtype"] == "float64" else torch.float32
    ctx = Context(cfg, torch.device("cpu"), dtype)
    if seed is not None:
        torch.manual_seed(seed)
    problem.build(ctx)
    return ctx


def stop_resume_and_compare(path, sets: list[str], tmp_path, stop: int, total: int,
                            rtol: float = 1e-10):
    """Train ``path`` with ``--set sets`` for ``stop`` iterations, resume it to ``total``,
    and train another run straight to ``total``; assert the two logs hold the same
    iterations and losses (``rtol``) and return both results ``(resumed, whole)``."""
    import numpy as np

    from deepsolve.io.h5log import read_log
    from deepsolve.train import train

    out = str(tmp_path / "run")
    train(str(path), sets=sets, overrides={"iterations": stop}, out=out, quiet=True)
    res = train(str(path), sets=sets, overrides={"iterations": total}, out=out, resume=True,
                quiet=True)
    whole = train(str(path), sets=sets, overrides={"iterations": total},
                  out=str(tmp_path / "whole"), quiet=True)
    a, b = read_log(res.log_path).columns, read_log(whole.log_path).columns
    assert list(a["iteration"]) == list(range(total))
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=rtol, atol=0)
    return res, whole
