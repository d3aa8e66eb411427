r"""Gradient checks: :func:`check_gradients` and ``python -m deepsolve check PROBLEM.py``.

A checkpointed unroll recomputes most steps in its reverse sweep. Its gradients are exact
only if every recomputed step gives what the forward sweep gave: same state, same random
numbers, same parameters found. :func:`check_gradients` tests that for one step function
at a short horizon, with nothing but the public API (:func:`deepsolve.unroll`,
:class:`deepsolve.UnrollStats`, :mod:`deepsolve.schedules`):

1. the **reference**: ``unroll(step, x0, n, schedule="store_all")`` -- plain autograd
   through the recorded graph, no recomputation;
2. the **schedules under test**: ``"run"``, the unroll with the given keyword arguments
   (the schedule the run uses: ``budget=``, ``snapshots=``, ``schedule=``, ``policy=``...),
   and, unless ``also=()``, ``"revolve"`` = ``revolve(n, 2)`` (every step recomputed, many
   times) and ``"periodic"`` = ``periodic(n)`` (kept tapes under the run's ``policy``);
3. each schedule under test runs **twice** (the replay);

every run starting from the same RNG states (torch's CPU and CUDA generators, Python's
``random``, numpy's global generator). The loss is a fixed random projection
:math:`L = \sum_\ell \langle w_\ell, y_\ell\rangle` of every floating-point leaf
:math:`y_\ell` of the result (``x_n`` and the stacked per-step outputs), with
:math:`w_\ell \sim N(0, 1)` from a private generator seeded with 0, so every component of
the result reaches the gradient. Gradients are taken with ``torch.autograd.grad`` (the
tensors' ``.grad`` are left alone) with respect to ``x0`` (a detached copy of its
floating-point leaves that requires grad) and to every tensor requiring grad that the
reference's graph reaches (module parameters, closed-over leaves; ``wrt=`` names or adds
tensors).

What is compared, and when the check fails (``.ok`` is ``False``, ``.problems`` says why):

* **gradients**: for every tensor, :math:`e = \|g - g_{\text{ref}}\|_2 /
  \max(\|g_{\text{ref}}\|_2,\ 10^{-3} G)` with :math:`G` the largest reference gradient norm
  of all compared tensors (so tensors whose gradient is a thousandth of the largest are
  compared in absolute terms); fails when :math:`e > \text{rtol}`, when a tensor with a
  non-zero reference gradient gets none (``missing``: the unroll did not find it), or when a
  tensor the reference does not reach gets a non-zero one;
* **forward**: the result's leaves, :math:`\|y - y_{\text{ref}}\| / \|y_{\text{ref}}\|`
  (largest over the leaves) :math:`\le` rtol;
* **replay**: the two runs of a schedule, gradients and results, the same measure
  :math:`\le` rtol;
* **escaped randomness**: Python's ``random`` or numpy's global generator changed state
  during an unroll: the step draws from a generator that the unroll does not snapshot, so
  recomputed steps draw other numbers. Randomness from another source that the RNG
  snapshots do not cover (a ``torch.Generator`` object, the clock) shows as a forward or
  replay mismatch.

``rtol`` defaults by the lowest floating-point precision of ``x0``: 1e-9 (float64), 1e-4
(float32), 1e-2 (bfloat16, float16) -- the differences between exact schedules are
summation-order rounding (float64 runs agree to ~1e-15). ``snapshot_dtype=`` in the keyword
arguments makes the run inexact by design; give a looser ``rtol`` then.

``python -m deepsolve check PROBLEM.py`` (:mod:`deepsolve.training.check`, built on this
module) builds the problem as ``train`` would, captures its first ``ctx.unroll`` call (step,
``x0``, the run's ``budget``/``snapshots``) and checks its first ``--steps`` steps (default
20). A problem that does not unroll (the PINN files) gets the residual check of that
command. See docs/check.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from .engine import RngState
from .memory import BudgetError
from .schedules import Schedule, periodic, revolve
from .unroll import UnrollStats, unroll

if TYPE_CHECKING:
    pass


__all__ = ["check_gradients", "GradientCheck", "GradientRow", "DEFAULT_STEPS"]

#: Horizon of ``deepsolve check`` when ``--steps`` is not given.
DEFAULT_STEPS = 20

_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2,
         torch.complex128: 1e-9, torch.complex64: 1e-4}
#: Gradients smaller than this fraction of the largest are compared in absolute terms.
FLOOR = 1e-3
_PRECISION = [torch.float16, torch.bfloat16, torch.float32, torch.complex64, torch.float64,
              torch.complex128]

ADVICE = ("draw from torch's generator instead (torch.randn/rand/randint/dropout on the "
           "default generator: unroll snapshots its state with every stored state and replays "
           "it), or from a generator seeded inside the step from the step index "
           "(torch.Generator().manual_seed(seed + i), np.random.default_rng(seed + i))")


# --------------------------------------------------------------------------------------
# the result


@dataclass
class GradientRow:
    """One compared tensor.

    Attributes:
        name: ``x0`` (or ``x0<path>`` for a leaf of a pytree state), a parameter name, or
            ``leaf k`` for a tensor found in the graph that has no name.
        shape: its shape.
        ref_norm: :math:`\\|g_{\\text{ref}}\\|_2` (``nan`` when the reference reaches it
            but its gradient is not finite; 0 when the reference does not reach it).
        errors: schedule label -> relative error ``e`` (see the module docstring);
            ``inf`` for a missing or unexpected gradient.
        missing: labels under which the tensor got no gradient although the reference
            gives a non-zero one.
        replay: largest relative difference between the two runs of any schedule.
        reached: whether the reference's graph reaches the tensor at all (a parameter that
            acts only through ``x0``, computed outside the unroll, is not reached; the
            gradient with respect to ``x0`` carries its part).
    """

    name: str
    shape: tuple[int, ...]
    ref_norm: float
    errors: dict[str, float] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    replay: float = 0.0
    reached: bool = True


@dataclass
class GradientCheck:
    """What :func:`check_gradients` (or ``deepsolve check``) found; ``str()`` or
    :meth:`table` gives the printable table.

    Attributes:
        ok: every comparison within ``rtol``, no missing gradient, no escaped randomness.
        n_steps: the horizon checked.
        rtol: the tolerance used.
        reference: the reference's label (``"store_all"``, or ``"plain autograd"`` for a
            residual check).
        schedules: label -> what ran under it (``UnrollStats.schedule`` of the run).
        rows: one :class:`GradientRow` per compared tensor.
        forward: label -> largest relative difference of the result from the reference's.
        problems: why the check failed (empty when ``ok``), one line each, with what to do.
        notes: facts that do not fail the check (a run that was store_all anyway...).
        title: first line of the table.
        failed: label -> the one-line error of a schedule whose unroll raised (store_all
            ran); its column reads ``error``.
    """

    ok: bool
    n_steps: int
    rtol: float
    reference: str
    schedules: dict[str, str]
    rows: list[GradientRow]
    forward: dict[str, float]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    title: str = ""
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def zero_gradient(self) -> list[str]:
        """The tensors whose reference gradient is identically zero: their rows compare a
        zero with a zero, so they are not checked (see the note the table prints)."""
        return [r.name for r in self.rows if r.reached and r.ref_norm == 0]

    def table(self) -> str:
        """The per-tensor table, the schedules' legend, the notes and the verdict."""
        labels = list(self.schedules)
        lines = [self.title] if self.title else []
        lines += [f"  {k:<10} {v}" for k, v in self.schedules.items()]
        head = ["tensor", "shape", f"|grad| {self.reference}", *labels, "replay"]
        body = []
        for r in self.rows:
            cells = [r.name, "x".join(map(str, r.shape)) or "scalar",
                     "0 (not checked)" if r.reached and r.ref_norm == 0 else
                     _num(r.ref_norm) if r.reached else "not reached"]
            for lb in labels:
                cells.append("error" if lb in self.failed else
                             "missing" if lb in r.missing else format_error(r.errors.get(lb)))
            cells.append(format_error(r.replay))
            body.append(cells)
        body.append(["(result)", "", "",
                     *["error" if lb in self.failed else format_error(self.forward.get(lb))
                       for lb in labels], ""])
        widths = [max(len(row[c]) for row in [head, *body]) for c in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" if c < 2 else f"{{:>{w}}}" for c, w in enumerate(widths))
        lines += ["", fmt.format(*head), *(fmt.format(*row) for row in body), ""]
        lines.append(f"relative errors against {self.reference} (rtol {self.rtol:.0e}); "
                     "(result): the unroll's x_n and outputs (the loss for a residual check)")
        lines += [f"note: {n}" for n in self.notes]
        zero = self.zero_gradient
        if self.ok and zero:
            lines.append(f"ok: every non-zero gradient matches ({len(zero)} of {len(self.rows)} "
                         "tensors have a zero reference gradient and were not checked, see the "
                         "note), recomputation is deterministic")
        elif self.ok:
            lines.append("ok: every gradient matches, recomputation is deterministic")
        else:
            lines += [f"MISMATCH: {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def zero_note(rows: list[GradientRow], reference: str) -> list[str]:
    """The note on tensors whose reference gradient is identically zero."""
    zero = [r.name for r in rows if r.reached and r.ref_norm == 0]
    if not zero:
        return []
    return [f"{name_list(zero)}: the {reference} gradient is identically zero, so "
            f"{'these are' if len(zero) > 1 else 'this is'} not checked (a zero compared with "
            "a zero). Nothing flows back to them from this loss at these parameter values: "
            "typically a layer after them starts at zero (a closure whose last layer is "
            "initialised to zero, so the model starts as the uncorrected solver, gives every "
            "earlier layer a zero gradient at first), or they act only where the loss does "
            "not look. To check them, run the check from parameters where the gradient "
            "flows (a trained model, other initial values)"]


def _num(x: float) -> str:
    return "nan" if x != x else f"{x:.3e}"


def format_error(e: float | None) -> str:
    if e is None:
        return "-"
    if e == 0:
        return "0"
    return "inf" if math.isinf(e) else ("nan" if e != e else f"{e:.1e}")


# --------------------------------------------------------------------------------------
# helpers


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _leaves(tree: Any) -> list[Any]:
    return [tree] if isinstance(tree, torch.Tensor) else pytree.tree_leaves(tree)


def _x0_names(x0: Any) -> list[str]:
    if isinstance(x0, torch.Tensor):
        return ["x0"]
    try:
        flat, _ = pytree.tree_flatten_with_path(x0)
        return [f"x0{pytree.keystr(path)}" for path, _ in flat]
    except Exception:  # pragma: no cover - old pytree without paths
        return [f"x0[{k}]" for k in range(len(pytree.tree_leaves(x0)))]


def _projection(result: Any) -> torch.Tensor | None:
    """``sum_l <w_l, y_l>`` over the floating-point leaves ``y_l`` of ``result`` that require
    grad, ``w_l ~ N(0, 1)`` drawn (in float64) from a generator seeded with 0 for every
    floating leaf in order, so the weights are the same in every run."""
    g = torch.Generator().manual_seed(0)
    total = None
    for y in _leaves(result):
        if not _floating(y):
            continue
        v = torch.view_as_real(y) if y.is_complex() else y
        w = torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device)
        if not y.requires_grad:
            continue
        term = (w * v.double()).sum()
        total = term if total is None else total + term
    return total


def _graph_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that the graph of ``roots`` reaches (their
    ``AccumulateGrad`` nodes), in the order first found."""
    found: dict[int, torch.Tensor] = {}
    seen: set = set()
    stack = []
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found[id(t)] = t
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            found.setdefault(id(var), var)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return list(found.values())


def relative_error(a: torch.Tensor | None, b: torch.Tensor | None, floor: float) -> float:
    """``||a - b|| / max(||b||, floor)``; ``inf`` when exactly one is absent (or zero while
    the other is not)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        t = a if b is None else b
        assert t is not None  # exactly one is absent
        return 0.0 if not bool((t != 0).any()) else math.inf
    a, b = a.detach().double(), b.detach().double()
    if a.is_complex() or b.is_complex():
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    d = float((a - b).norm())
    if d == 0:
        return 0.0
    return d / max(float(b.norm()), floor, 1e-300)


def _forward_diff(ys: list, refs: list) -> float:
    """Largest ``||y - r|| / ||r||`` over the floating-point leaves (``inf`` for a leaf of
    another shape or dtype, ``nan`` as soon as one is not finite)."""
    out = 0.0
    for y, r in zip(ys, refs, strict=True):
        if y is None or r is None:
            continue
        if y.shape != r.shape or y.dtype != r.dtype:
            return math.inf
        e = relative_error(y, r, 0.0)
        if e != e:
            return e
        out = max(out, e)
    return out


def default_rtol(x0_leaves: list[torch.Tensor]) -> float:
    dts = [t.dtype for t in x0_leaves if _floating(t)]
    if not dts:
        return 1e-4
    low = min(dts, key=lambda d: _PRECISION.index(d) if d in _PRECISION else 2)
    return _RTOL.get(low, 1e-4)


# --------------------------------------------------------------------------------------
# check_gradients

SCHEDULE_KW = ("budget", "snapshots", "schedule", "offload", "spill_dir")


def check_gradients(step: Callable[[Any, int], Any], x0: Any, n_steps: int, *,
                    wrt: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | None = None,
                    also: Sequence[str | Schedule] = ("revolve", "periodic"),
                    rtol: float | None = None, verbose: bool = False,
                    **unroll_kwargs: Any) -> GradientCheck:
    """Check the gradients of ``unroll(step, x0, n_steps, **unroll_kwargs)`` against plain
    autograd, and that recomputation is deterministic (see the module docstring for what is
    compared and the tolerances).

    Args:
        step, x0, n_steps: as for :func:`deepsolve.unroll`; use a short horizon (tens of
            steps): the reference keeps every step's graph.
        wrt: tensors whose gradients to compare, as ``{name: tensor}`` (names for the table)
            or a list, in addition to ``x0`` and to the leaves requiring grad that the
            reference's graph reaches (found automatically; the parameters of the module
            whose method ``step`` is are named after it).
        also: schedules checked besides the run's: ``"revolve"`` (``revolve(n, 2)``),
            ``"periodic"`` (``periodic(n)``) or schedule objects for ``n_steps`` steps. They
            run with the run's ``policy=``, ``preserve_rng=``, ``params=``,
            ``has_output=`` and ``snapshot_dtype=``, without its ``budget=``/
            ``snapshots=``/``schedule=``.
        rtol: tolerance (default by ``x0``'s dtype: 1e-9 float64, 1e-4 float32, 1e-2
            16-bit).
        verbose: print the table.
        **unroll_kwargs: the run's arguments of :func:`deepsolve.unroll` (``budget=``,
            ``snapshots=``, ``schedule=``, ``policy=``, ``preserve_rng=``...); not
            ``until=``/``max_steps=`` (the check needs a fixed horizon) or ``stats=``.

    Returns:
        a :class:`GradientCheck`; ``.ok`` says whether everything matched. It prints nothing
        unless ``verbose``. Global RNG states are left as they were.

    Raises:
        ValueError: bad arguments, or nothing in the unroll requires grad.
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"check_gradients: n_steps must be an integer >= 1, got {n_steps!r}")
    for k in ("until", "max_steps", "stats"):
        if k in unroll_kwargs:
            raise ValueError(f"check_gradients: {k}= is not supported (the check runs a fixed "
                             "number of steps and fills its own UnrollStats)")
    x0_leaves = _leaves(x0)
    spec = None if isinstance(x0, torch.Tensor) else pytree.tree_structure(x0)
    leaves_in = [t.detach().clone().requires_grad_(True) if _floating(t) else t
                 for t in x0_leaves]
    x0c = leaves_in[0] if spec is None else pytree.tree_unflatten(leaves_in, spec)
    x0_inputs = [(name, t) for name, t in zip(_x0_names(x0), leaves_in, strict=True)
                 if _floating(t)]
    tol = float(rtol) if rtol is not None else default_rtol(x0_leaves)

    names: dict[int, str] = {}
    extra: list[torch.Tensor] = []
    if isinstance(wrt, Mapping):
        for k, t in wrt.items():
            names.setdefault(id(t), str(k))
            extra.append(t)
    elif wrt is not None:
        extra.extend(wrt)
    owner = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        for pname, param in owner.named_parameters():
            names.setdefault(id(param), pname)
    extra.extend(p for p in (unroll_kwargs.get("params") or []) if isinstance(p, torch.Tensor))

    base = {k: v for k, v in unroll_kwargs.items() if k not in SCHEDULE_KW}
    runs: list[tuple[str, dict]] = [("run", dict(unroll_kwargs))]
    for a in also:
        if isinstance(a, Schedule):
            runs.append((getattr(a, "kind", "schedule"), {**base, "schedule": a}))
        elif a == "revolve":
            runs.append(("revolve", {**base, "schedule": revolve(n_steps, 2)}))
        elif a == "periodic":
            runs.append(("periodic", {**base, "schedule": periodic(n_steps)}))
        else:
            raise ValueError(f"check_gradients: also= takes 'revolve', 'periodic' or schedule "
                             f"objects, got {a!r}")
    ref_kw = {k: v for k, v in base.items() if k in ("params", "has_output")}

    rng0 = RngState.everything()
    escaped: dict[str, list[str]] = {}
    try:
        # the reference: plain autograd through the recorded graph
        rng0.restore()
        stats = UnrollStats()
        res = unroll(step, x0c, n_steps, schedule="store_all", stats=stats, **ref_kw)
        loss = _projection(res)
        if loss is None:
            raise ValueError("check_gradients: nothing in the unroll's result requires grad "
                             "(x0 has no floating-point leaves and the step uses no tensor "
                             "that requires grad)")
        ref_values = [y.detach().clone() if _floating(y) else None for y in _leaves(res)]
        ids = {id(t) for _, t in x0_inputs}
        found = [t for t in _graph_leaves([y for y in _leaves(res) if _floating(y)])
                 if id(t) not in ids]
        params = list({id(t): t for t in [*extra, *found] if id(t) not in ids}.values())
        unnamed = 0
        inputs: list[tuple[str, torch.Tensor]] = list(x0_inputs)
        for p in params:
            name = names.get(id(p))
            if name is None:
                name, unnamed = f"leaf {unnamed}", unnamed + 1
            inputs.append((name, p))
        tensors = [t for _, t in inputs]
        need = [t.requires_grad for t in tensors]
        ref_grads = grad_of(loss, tensors, need)
        if esc := rng0.moved_host(RngState.everything()):
            escaped["store_all"] = esc
        del res, loss

        results: dict[str, list[tuple[list, list]]] = {}
        schedules: dict[str, str] = {}
        failed: dict[str, str] = {}
        for label, kw in runs:
            results[label] = []
            for _ in range(2):
                rng0.restore()
                stats = UnrollStats()
                try:
                    res = unroll(step, x0c, n_steps, stats=stats, **kw)
                    loss = _projection(res)
                    values = [y.detach().clone() if _floating(y) else None
                              for y in _leaves(res)]
                    grads = (grad_of(loss, tensors, need) if loss is not None
                             else [None] * len(need))
                except BudgetError:  # the run's budget does not fit: bad input, not a finding
                    raise
                except Exception as e:  # store_all ran: a failure here is a finding
                    text = str(e).splitlines()[0] if str(e) else ""
                    failed[label] = f"{type(e).__name__}: {text}".rstrip(": ")
                    schedules[label] = stats.schedule or ", ".join(
                        f"{k}={v!r}" for k, v in kw.items() if k in SCHEDULE_KW) or "?"
                    del results[label]
                    break
                finally:
                    if esc := rng0.moved_host(RngState.everything()):
                        escaped.setdefault(label, esc)
                results[label].append((values, grads))
                schedules[label] = stats.schedule or "?"
                del res, loss
    finally:
        rng0.restore()

    # drop extra schedules that are the run's own
    for label in [lb for lb in schedules if lb != "run"]:
        if schedules[label] == schedules.get("run"):
            results.pop(label, None)
            failed.pop(label, None)
            del schedules[label]

    finite_norms = [float(g.detach().double().norm()) for g in ref_grads if g is not None]
    big = max([n for n in finite_norms if math.isfinite(n)] or [0.0])
    floor = FLOOR * big
    rows = []
    for j, (name, t) in enumerate(inputs):
        g_ref = ref_grads[j]
        ref_norm = float(g_ref.detach().double().norm()) if g_ref is not None else 0.0
        row = GradientRow(name, tuple(t.shape), ref_norm, reached=g_ref is not None)
        for label, ((_, g1), (_, g2)) in results.items():
            err = relative_error(g1[j], g_ref, floor)
            row.errors[label] = err
            if g1[j] is None and g_ref is not None and ref_norm > 0:
                row.missing.append(label)
            row.replay = max(row.replay, relative_error(g2[j], g1[j], floor))
        rows.append(row)
    forward = {label: max(_forward_diff(v1, ref_values), _forward_diff(v2, v1))
               for label, ((v1, _), (v2, _)) in results.items()}

    problems: list[str] = []
    notes: list[str] = []
    advice = ADVICE
    for label, msg in failed.items():
        problems.append(f"{label} ({schedules[label]}): the unroll failed where store_all ran: "
                        f"{msg}")
    if escaped:
        srcs = sorted({s for v in escaped.values() for s in v})
        problems.append(f"the step draws from {' and '.join(srcs)} (its state changed during "
                        "the unroll), which unroll does not snapshot: recomputed steps draw "
                        f"other numbers and checkpointed gradients are wrong; {ADVICE}")
        advice = "see above"
    bad_ref = [r.name for r in rows if not math.isfinite(r.ref_norm)]
    if bad_ref:
        problems.append(f"the reference (store_all) gradient of {name_list(bad_ref)} is not "
                        "finite: the step itself overflows or divides by zero at this horizon")
    fwd = [f"{lb} ({format_error(f)})" for lb, f in forward.items() if not f <= tol]
    if fwd:
        problems.append(f"the result of {name_list(fwd)} differs from store_all's or between two "
                        "runs although every run starts from the same RNG states: the step is "
                        "not a deterministic function of (state, i) and torch's RNG (it draws "
                        "from a torch.Generator object, numpy, Python's random or the clock, "
                        f"or keeps state between calls); {advice}")
        advice = "see above"
    for r in rows:
        if r.missing:
            problems.append(
                f"{r.name} gets no gradient under {name_list(r.missing)} (store_all's has norm "
                f"{_num(r.ref_norm)}): the unroll did not find it (a tensor used only at some "
                "steps?); pass it with params=[...]")
    wrong = []
    for label in results:
        bad = [f"{r.name} {format_error(r.errors[label])}" for r in rows
               if label not in r.missing and not r.errors[label] <= tol]
        if bad:
            wrong.append(f"{label}: {name_list(bad)}")
    if wrong:
        problems.append(f"gradients differ from store_all's by more than rtol {tol:.0e}: "
                        + "; ".join(wrong))
    replay = [r.name for r in rows if not r.replay <= tol]
    if replay:
        problems.append(f"two runs of one schedule from the same RNG states give different "
                        f"gradients of {name_list(replay)}: recomputation is not deterministic; "
                        f"{advice}")
    unreached = [r.name for r in rows if not r.reached]
    if unreached:
        notes.append(f"{name_list(unreached)}: not reached by the unroll's graph (unused, or "
                     "acting only through x0, which is computed outside the unroll and whose "
                     "gradient is compared)")
    if schedules.get("run", "").startswith("store_all"):
        notes.append(f"the run's settings unroll {n_steps} steps with store_all here (nothing "
                     "recomputed); the other schedules exercise recomputation")
    if unroll_kwargs.get("snapshot_dtype") is not None:
        notes.append("snapshot_dtype= stores rounded snapshots: those gradients are inexact "
                     "by design")
    notes += zero_note(rows, "store_all")
    out = GradientCheck(ok=not problems, n_steps=n_steps, rtol=tol, reference="store_all",
                        schedules=schedules, rows=rows, forward=forward, problems=problems,
                        notes=notes, failed=failed,
                        title=f"gradient check: {n_steps} steps, schedules against store_all "
                              "(each run twice):")
    if verbose:
        print(out.table())
    return out


def grad_of(loss: torch.Tensor, tensors: list[torch.Tensor], need: list[bool]
          ) -> list[torch.Tensor | None]:
    idx = [k for k, n in enumerate(need) if n]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    if not idx or not loss.requires_grad:
        return out
    gs = torch.autograd.grad(loss, [tensors[k] for k in idx], allow_unused=True)
    for k, g in zip(idx, gs, strict=True):
        out[k] = g
    return out


def name_list(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
