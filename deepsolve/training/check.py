"""``python -m deepsolve check PROBLEM.py``: the gradient check of a problem file.

:func:`check_problem` builds the problem as ``train`` would (:mod:`.prepare`), captures its
first ``ctx.unroll`` call (step, ``x0``, the run's ``budget``/``snapshots``) and checks its
first ``--steps`` steps with the library's :func:`deepsolve.check_gradients` (default 20). A
problem that does not unroll (the PINN files) gets the residual check: its loss gradient at
iteration 0 under chunked, recomputed residuals against plain autograd. See docs/check.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..engine import RngState
from ..gradcheck import (
    ADVICE,
    DEFAULT_STEPS,
    FLOOR,
    SCHEDULE_KW,
    GradientCheck,
    GradientRow,
    check_gradients,
    default_rtol,
    format_error,
    grad_of,
    name_list,
    relative_error,
    zero_note,
)
from .prepare import build, prepare, run_threads

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..problem import UnrollRequest

__all__ = ["check_problem"]


def check_problem(problem_path: str, *, steps: int | None = None,
                  sets: list[str] | None = None,
                  overrides: Mapping[str, Any] | None = None,
                  rtol: float | None = None) -> GradientCheck:
    """``deepsolve check PROBLEM.py``: build the problem as ``train`` would (settings,
    ``--set`` pairs and ``overrides``, seeded), then

    * **a problem that unrolls**: capture its first ``ctx.unroll(step, x0, ...)`` call in
      ``residuals(ctx, 0)`` with the keyword arguments the run would pass (its ``budget`` or
      ``snapshots`` setting unless the problem gives a schedule itself) and run
      :func:`check_gradients` on its first ``steps`` steps (default
      ``min(DEFAULT_STEPS, the run's steps)``), comparing the gradients of ``x0`` and of
      every model parameter;
    * **a problem that does not** (the PINN files): the gradient of its loss at iteration 0
      (the terms weighted by ``weights(ctx)``) with respect to every model parameter is
      computed with plain autograd (``residual_budget`` and ``budget`` empty), with the
      residual chunked and recomputed in backward (``residual_budget``, or ``budget`` where
      the problem has no ``residual_budget``, set to a quarter of the bytes the plain loss
      saves for backward: about four chunks) and with the run's own settings, each compared
      with plain autograd; the run's evaluation runs twice (replay). Tolerances and
      measures as in :func:`check_gradients`, with the loss value in the ``(result)`` row.

    Returns a :class:`GradientCheck` (``title`` names the problem). One-line
    ``ValueError`` for a bad ``steps`` or a problem whose unroll has no fixed length.
    """

    cfg = prepare(problem_path, overrides, sets)   # every setting checked before the build
    with run_threads(cfg.threads):
        return _check_problem(problem_path, cfg, steps, rtol)


def _check_problem(problem_path: str, cfg: RunConfig, steps: int | None,
                   rtol: float | None) -> GradientCheck:
    problem, ctx, _ = build(problem_path, cfg)
    rng0 = RngState.everything()

    terms = None

    def residuals():
        nonlocal terms
        terms = problem.residuals(ctx, 0)

    req = ctx.first_unroll(residuals)
    if req is not None:
        req.options.pop("stats", None)
        return _check_unroll(problem_path, ctx, req, steps, rtol)
    res = _check_residuals(problem_path, problem, ctx, cfg, terms, rng0, rtol)
    if steps is not None:
        res.notes.append(f"--steps {steps} has no effect: {problem_path} does not unroll")
    return res


def _check_unroll(problem_path: str, ctx, c: UnrollRequest, steps: int | None,
                  rtol: float | None) -> GradientCheck:
    if "until" in c.options or c.n_steps is None:
        raise ValueError(f"{problem_path}: its unroll has no fixed length (until=); check "
                         "needs a fixed number of steps")
    n_run = int(c.n_steps)
    if n_run < 1:
        raise ValueError(f"{problem_path} unrolls {n_run} steps: nothing to check "
                         "(give --set steps=N with N >= 1)")
    if steps is None:
        steps = min(DEFAULT_STEPS, n_run)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps {steps!r}: expected a whole number >= 1")
    if steps > n_run:
        raise ValueError(f"--steps {steps}: {problem_path} unrolls {n_run} steps; check at "
                         f"most {n_run} (or lengthen the run with --set steps=...)")
    named = {k: p for k, p in ctx.model.named_parameters() if p.requires_grad}
    kw = dict(c.options)
    res = check_gradients(c.step, c.state, steps, wrt=named, rtol=rtol, **kw)
    how = ", ".join(f"{k}={v!r}" for k, v in kw.items() if k in SCHEDULE_KW) or "store_all"
    res.title = (f"deepsolve check {problem_path}: the first {steps} of the run's {n_run} "
                 f"steps (run settings: {how}), each schedule run twice, against store_all:")
    return res


def _loss_and_grads(problem, ctx, terms, weights: Mapping[str, float],
                    params: list[torch.Tensor]) -> tuple[float, list[torch.Tensor | None]]:
    loss = sum(float(weights.get(k, 1.0)) * v for k, v in terms.items())
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise ValueError("the problem's loss does not depend on its model's parameters: "
                         "nothing to check")
    return float(loss.detach()), grad_of(loss, params, [True] * len(params))


def _evaluate(problem, ctx, rng0: RngState) -> tuple[dict, int, list[str]]:
    from ..pinn import SavedBytes

    rng0.restore()
    with SavedBytes() as meter:
        terms = problem.residuals(ctx, 0)
        saved = meter.peak
    return terms, saved, rng0.moved_host(RngState.everything())


def _check_residuals(problem_path: str, problem, ctx, cfg: RunConfig, terms0, rng0: RngState,
                     rtol: float | None) -> GradientCheck:
    named = [(k, p) for k, p in ctx.model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    weights = dict(problem.weights(ctx) or {})
    tol = float(rtol) if rtol is not None else default_rtol(params)
    keys = [k for k in ("residual_budget", "budget") if k in cfg]
    run_chunks = any(str(cfg[k]) for k in keys)
    escaped: set[str] = set()
    try:
        loss_run, g_run = _loss_and_grads(problem, ctx, terms0, weights, params)
        del terms0
        terms, saved_run, esc = _evaluate(problem, ctx, rng0)
        escaped.update(esc)
        loss_replay, g_replay = _loss_and_grads(problem, ctx, terms, weights, params)
        del terms

        def other(settings: dict) -> tuple[float, list, int]:
            prob2, ctx2, _ = build(problem_path, cfg.replace(**settings))
            assert ctx2.model is not None  # build() makes it
            ctx2.model.load_state_dict(ctx.model.state_dict())
            p2: list[torch.Tensor] = [p for _, p in ctx2.model.named_parameters()
                                      if p.requires_grad]
            t2, saved, esc2 = _evaluate(prob2, ctx2, rng0)
            escaped.update(esc2)
            loss, g = _loss_and_grads(prob2, ctx2, t2, weights, p2)
            return loss, g, saved

        if run_chunks:
            loss_plain, g_plain, saved_plain = other({k: "" for k in keys})
        else:
            loss_plain, g_plain, saved_plain = loss_run, g_run, saved_run
        key = "residual_budget" if "residual_budget" in cfg else "budget"
        chunk_budget = f"{max(saved_plain // 4, 1)}B"
        loss_chunk, g_chunk, saved_chunk = other({**{k: "" for k in keys}, key: chunk_budget})
    finally:
        rng0.restore()

    big = max([float(g.double().norm()) for g in g_plain if g is not None] or [0.0])
    floor = FLOOR * big
    labels = {"chunked": (g_chunk, loss_chunk)}
    if run_chunks:
        labels = {"run": (g_run, loss_run), **labels}
    rows = []
    for k, (name, p) in enumerate(named):
        ref = g_plain[k]
        row = GradientRow(name, tuple(p.shape),
                          float(ref.double().norm()) if ref is not None else 0.0,
                          reached=ref is not None)
        for label, (g, _) in labels.items():
            row.errors[label] = relative_error(g[k], ref, floor)
            if g[k] is None and ref is not None and row.ref_norm > 0:
                row.missing.append(label)
        row.replay = relative_error(g_replay[k], g_run[k], floor)
        rows.append(row)

    def lrel(a: float, b: float) -> float:
        return 0.0 if a == b else abs(a - b) / max(abs(b), 1e-300)

    forward = {label: lrel(v, loss_plain) for label, (_, v) in labels.items()}
    schedules = {label: "" for label in labels}
    if run_chunks:
        schedules["run"] = ("the run's settings: "
                            + ", ".join(f"{k}={cfg[k]!r}" for k in keys if str(cfg[k])))
    schedules["chunked"] = (f"{key}={chunk_budget!r} (a quarter of the {saved_plain} bytes the "
                            f"plain loss saves; {saved_chunk} saved chunked)")
    problems: list[str] = []
    notes: list[str] = [f"{problem_path} does not unroll: the residual check compares its "
                        "loss gradient (iteration 0) under chunked, recomputed residuals with "
                        "plain autograd"]
    if saved_plain > 0 and saved_chunk >= 0.75 * saved_plain:
        notes.append(f"setting {key} did not chunk the loss (it saves {saved_chunk} of "
                     f"{saved_plain} bytes): nothing is recomputed, so there are no "
                     "checkpointed gradients to compare; checked that the gradient is "
                     "deterministic")
    if escaped:
        notes.append(f"residuals() draws from {' and '.join(sorted(escaped))}; that is fine "
                     "outside the residual function, but chunks recomputed in backward do not "
                     f"replay it: inside it, {ADVICE}")
    for label, (_g, v) in labels.items():
        missing = [r.name for r in rows if label in r.missing]
        wrong = [f"{r.name} ({format_error(r.errors[label])})" for r in rows
                 if label not in r.missing and not r.errors[label] <= tol]
        if not forward[label] <= tol:
            problems.append(f"{label} ({schedules[label]}): the loss is {v!r}, plain autograd "
                            f"gives {loss_plain!r}")
        if missing:
            problems.append(f"{label}: {name_list(missing)} get no gradient, plain autograd's is "
                            "non-zero")
        if wrong:
            problems.append(f"{label}: the gradient of {name_list(wrong)} differs from plain "
                            f"autograd's by more than rtol {tol:.0e}")
    replay = [r.name for r in rows if not r.replay <= tol]
    if replay or not lrel(loss_replay, loss_run) <= tol:
        problems.append(f"two evaluations of the loss at iteration 0 give different gradients "
                        f"of {name_list(replay) or 'the loss'}: the loss is not deterministic; "
                        f"{ADVICE}")
    bad = [r.name for r in rows if not math.isfinite(r.ref_norm)]
    if bad:
        problems.append(f"the plain-autograd gradient of {name_list(bad)} is not finite")
    notes += zero_note(rows, "plain-autograd")
    return GradientCheck(ok=not problems, n_steps=0, rtol=tol, reference="plain autograd",
                         schedules=schedules, rows=rows, forward=forward, problems=problems,
                         notes=notes,
                         title=f"deepsolve check {problem_path}: no unroll; the loss gradient "
                               "at iteration 0, chunked residuals against plain autograd:")
