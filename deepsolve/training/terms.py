"""The names of a problem's loss terms, learned before training by one evaluation of the
residuals that leaves no trace.

A ``target`` on a loss term (``loss/pde``) is checked before the log is opened
(:mod:`.stopping`), but the terms are known only from what ``problem.residuals(ctx,
iteration)`` returns. :func:`loss_term_names` evaluates them once — no backward, no
optimiser step, at the horizon of the start's curriculum stage — and puts back everything the
evaluation may change, as a restart would: the random generators (:mod:`.rng`), the model's
state, the problem's own ``state_dict``, the context's horizon, its adjoint-norm flag and its
unroll statistics. The run then draws and trains exactly as it would have without it.
"""

from __future__ import annotations

import copy

import torch

from ..config import horizon
from ..problem import Context, Problem
from .rng import rng_state, set_rng_state
from .rows import check_terms

__all__ = ["loss_term_names"]


def loss_term_names(problem: Problem, ctx: Context, iteration: int,
                    stages: tuple[tuple[int, int], ...] = ()) -> list[str]:
    """The names of the loss terms ``problem.residuals(ctx, iteration)`` returns, from one
    evaluation before training (no backward, no optimiser step; the horizon of
    ``iteration``'s curriculum stage). Everything the evaluation may change is put back as
    a restart would: the random generators (:mod:`.rng`), the model's state, the problem's
    own ``state_dict`` and the context's horizon — so the run then draws and trains exactly
    as it would have without it."""
    model = ctx.model
    assert model is not None  # build() checked it
    rng = rng_state(ctx)
    model_state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                   for k, v in model.state_dict().items()}
    problem_state = copy.deepcopy(problem.state_dict(ctx))
    old_horizon, old_adjoint = ctx.horizon, ctx.want_adjoint_norms
    try:
        if stages:
            ctx.horizon = horizon(stages, iteration)
        ctx.want_adjoint_norms = False
        return list(check_terms(problem.residuals(ctx, iteration), iteration))
    finally:
        ctx.horizon, ctx.want_adjoint_norms = old_horizon, old_adjoint
        ctx.unroll_stats.clear()
        problem.load_state_dict(ctx, problem_state)
        model.load_state_dict(model_state)
        set_rng_state(ctx, rng)
