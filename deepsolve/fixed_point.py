r"""Fixed-point layers: solve ``z* = f(z*)`` and differentiate through the solution.

``z = fixed_point(f, z0)`` iterates a solver (Picard, Anderson or Broyden) without recording
a graph until the relative residual ``||f(z) - z|| / (||f(z)|| + eps)`` of every batch element
is below ``tol`` (with an absolute residual that has come down: a diverging iterate never
passes as converged), and returns the last iterate ``z_k`` so that it can be differentiated with
respect to every tensor ``f`` uses (module parameters, closed-over inputs such as ``x`` in
``tanh(W z + x)``). Four backward modes:

* ``"implicit"`` (default): the implicit function theorem. The backward solves the adjoint
  fixed point ``g = J_f(z*)^T g + dL/dz*`` with the same family of solvers, one
  vector-Jacobian product (VJP) of ``f`` at ``z*`` per iteration, and pulls ``g`` through one
  recorded evaluation of ``f`` at ``z*``: ``dL/dθ = (∂f/∂θ)^T g``. Memory: one recorded
  evaluation of ``f``, whatever the number of iterations. ``z0`` gets no gradient (the fixed
  point does not depend on it).
* ``"unrolled"``: the exact gradient of the iterations actually run, through
  :func:`deepsolve.unroll` (checkpointed under ``snapshots=`` / ``budget=``; plain autograd
  otherwise). Works for all three solvers: the solver's state (iterate, ``f`` of it, and the
  Anderson / Broyden history) is the unroll's state.
* ``"auto"``: ``"implicit"`` when the forward solve converged to ``tol``, ``"unrolled"``
  (through the ``max_iter`` iterations run) when it did not.
* ``"phantom"``: the phantom gradient of Geng et al. (NeurIPS 2021): ``phantom_steps`` damped
  iterations ``z <- (1 - λ) z + λ f(z)`` recorded from ``z*`` (λ = ``phantom_damping``);
  ``phantom_steps=1, phantom_damping=1`` is the Jacobian-free backward of Fung et al. (AAAI
  2022), ``g = dL/dz*``. The forward value is still ``z_k``.

See docs/fixed-point.md for a guide.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.autograd.function import once_differentiable

from .engine import Replay, UnrollStats
from .unroll import unroll

__all__ = [
    "fixed_point", "FixedPointStats", "FixedPointError", "FixedPointWarning", "SOLVERS",
    "BACKWARDS", "Implicit", "Unrolled", "Phantom", "Auto", "backward_mode",
]

#: Forward (and adjoint) solvers and their options with defaults.
SOLVERS: dict[str, dict[str, Any]] = {
    "picard": {"beta": 1.0},
    "anderson": {"m": 5, "lam": 1e-8, "beta": 1.0},
    "broyden": {"m": 30},
}
#: Options every solver takes: a batch element has converged when its relative residual is
#: <= tol or its absolute residual ||f(z) - z|| is <= atol; eps guards the relative residual.
_COMMON = {"atol": 0.0, "eps": 1e-12}
BACKWARDS = ("implicit", "unrolled", "auto", "phantom")


class _BackwardMode:
    """What a backward mode does (as diffrax's adjoints carry their ``loop``): after the
    forward solve, :meth:`differentiate` turns its last iterate into the differentiable
    output; a mode that runs the forward solve itself (``one_pass``, :class:`Unrolled`)
    does it in :meth:`solve`."""

    one_pass: ClassVar[bool] = False

    def differentiate(self, s: _Solve, res: _Result) -> torch.Tensor:
        """The output ``z_k`` of the forward solve ``res``, differentiable by this mode."""
        raise NotImplementedError

    def solve(self, s: _Solve) -> torch.Tensor:
        """The forward solve and the differentiable output in one pass (``one_pass``)."""
        raise NotImplementedError

    def hint(self, res: _Result) -> str:
        """What the warning of an unconverged forward solve adds for this mode."""
        return ""


@dataclass(frozen=True)
class Implicit(_BackwardMode):
    """The implicit backward: solve ``g = J_f(z*)^T g + dL/dz*`` by ``solver`` (default: the
    forward solver) to ``tol`` within ``max_iter`` iterations (defaults: the forward's), one
    VJP of ``f`` per iteration, then ``dL/dtheta = (df/dtheta)^T g``. Memory: one recorded
    evaluation of ``f``."""

    solver: str | None = None
    tol: float | None = None
    max_iter: int | None = None
    name = "implicit"

    def differentiate(self, s: _Solve, res: _Result) -> torch.Tensor:
        return _implicit(s, res.state[0], self)


@dataclass(frozen=True)
class Unrolled(_BackwardMode):
    """The exact gradient of the iterations run, through :func:`deepsolve.unroll`:
    checkpointed with ``snapshots`` slots or under ``budget`` (an online schedule, since the
    number of iterations is not known in advance), plain autograd with neither."""

    snapshots: int | None = None
    budget: int | str | None = None
    name = "unrolled"

    one_pass: ClassVar[bool] = True

    def __post_init__(self):
        if self.snapshots is not None and self.budget is not None:
            raise ValueError("fixed_point: give budget= or snapshots=, not both")

    def differentiate(self, s: _Solve, res: _Result) -> torch.Tensor:
        return _unrolled(s, res.k, self)  # the iterations run, re-run recorded

    def solve(self, s: _Solve) -> torch.Tensor:
        return _unrolled_until(s, self)  # the solver runs once, inside the unroll


@dataclass(frozen=True)
class Phantom(_BackwardMode):
    """The phantom gradient (Geng et al., NeurIPS 2021): ``steps`` damped iterations
    ``z <- (1 - damping) z + damping f(z)`` recorded from ``z*``; ``Phantom(1, 1.0)`` is the
    Jacobian-free backward (Fung et al., AAAI 2022)."""

    steps: int = 5
    damping: float = 0.5
    name = "phantom"

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"fixed_point: phantom_steps must be an integer >= 1, got "
                             f"{self.steps!r}")
        if not 0 < self.damping <= 1:
            raise ValueError(f"fixed_point: phantom_damping must be in (0, 1], got "
                             f"{self.damping}")

    def differentiate(self, s: _Solve, res: _Result) -> torch.Tensor:
        return _phantom(s, res.state[0], self)


@dataclass(frozen=True)
class Auto(_BackwardMode):
    """``implicit`` when the forward solve converged to ``tol``, else ``unrolled`` through
    the iterations run."""

    implicit: Implicit = field(default_factory=Implicit)
    unrolled: Unrolled = field(default_factory=Unrolled)
    name = "auto"

    def differentiate(self, s: _Solve, res: _Result) -> torch.Tensor:
        return (self.implicit if res.converged else self.unrolled).differentiate(s, res)

    def hint(self, res: _Result) -> str:
        return "" if res.converged else \
            "; differentiating through the iterations run (backward='unrolled')"


Backward = Implicit | Unrolled | Phantom | Auto


def backward_mode(backward: str | Backward = "implicit", *, solver: str | None = None,
                  tol: float | None = None, max_iter: int | None = None,
                  snapshots: int | None = None, budget: int | str | None = None,
                  phantom_steps: int = 5, phantom_damping: float = 0.5) -> Backward:
    """The backward-mode object of ``fixed_point``'s arguments: ``backward`` is one (an
    :class:`Implicit`, :class:`Unrolled`, :class:`Phantom` or :class:`Auto`) or its name,
    completed by the short-form keywords (``backward_solver``/``backward_tol``/
    ``backward_max_iter``, ``snapshots``/``budget``, ``phantom_steps``/``phantom_damping``)."""
    if not isinstance(backward, str):
        if not isinstance(backward, (Implicit, Unrolled, Phantom, Auto)):
            raise ValueError(f"fixed_point: backward must be one of {', '.join(BACKWARDS)} or "
                             f"Implicit(...), Unrolled(...), Phantom(...), Auto(...), got "
                             f"{type(backward).__name__}")
        return backward
    if backward not in BACKWARDS:
        raise ValueError(f"fixed_point: unknown backward {backward!r}; use one of "
                         f"{', '.join(BACKWARDS)}")
    implicit = Implicit(solver, tol, max_iter)
    unrolled = Unrolled(snapshots, budget)
    phantom = Phantom(phantom_steps, phantom_damping)  # checked whichever mode is asked
    if backward == "implicit":
        return implicit
    if backward == "unrolled":
        return unrolled
    if backward == "phantom":
        return phantom
    return Auto(implicit, unrolled)

class FixedPointError(ValueError):
    """The solve did not converge (with ``strict=True``), or an iterate became NaN/Inf."""


class FixedPointWarning(RuntimeWarning):
    """The forward or adjoint solve stopped at ``max_iter`` above the tolerance."""


@dataclass
class FixedPointStats:
    """What one :func:`fixed_point` call did: pass ``stats=FixedPointStats()`` or use
    ``return_stats=True``. The backward fields are set when the backward has run.

    Attributes:
        solver: the forward solver.
        backward: the backward used: ``"implicit"``, ``"unrolled"``, ``"phantom"`` (what
            ``"auto"`` picked), or ``"none"`` when no graph was recorded (no grad).
        iterations: solver iterations (updates) run; ``f`` was evaluated ``iterations + 1``
            times (twice that with ``backward="unrolled"`` until unknown-length unrolls land).
        residuals: the largest relative residual over the batch at each iterate ``z_0 .. z_k``.
        residual: the last of them.
        sample_residuals: the relative residual of each batch element at ``z_k`` (a CPU
            tensor of shape ``(B,)``).
        converged: whether every batch element reached ``tol`` (or ``atol``).
        backward_solver, backward_iterations, backward_residuals, backward_converged: the
            adjoint solve (implicit backward); for ``"unrolled"``, ``backward_iterations`` is
            the number of steps differentiated, for ``"phantom"`` the phantom steps.
        forward_time, backward_time: wall time [s] of the solve (and the recording) and of
            the backward (implicit only; see ``unroll`` for the unrolled one).
        unroll: the :class:`~deepsolve.UnrollStats` of the unroll (``"unrolled"`` only).
    """

    solver: str = ""
    backward: str = ""
    iterations: int = 0
    residuals: list[float] = field(default_factory=list)
    residual: float = math.nan
    sample_residuals: torch.Tensor | None = None
    converged: bool = False
    backward_solver: str = ""
    backward_iterations: int = 0
    backward_residuals: list[float] = field(default_factory=list)
    backward_converged: bool | None = None
    forward_time: float = 0.0
    backward_time: float = 0.0
    unroll: UnrollStats | None = None

    def _reset(self) -> None:
        for k, v in FixedPointStats().__dict__.items():
            setattr(self, k, v)


# ----------------------------------------------------------------------------------------
# batch layout


class _Layout:
    """``z`` of shape ``(*batch, *features)`` seen as ``(B, n)`` for norms and mixing."""

    def __init__(self, z: torch.Tensor, batch_dims: int | None):
        nb = (1 if z.dim() >= 2 else 0) if batch_dims is None else batch_dims
        if isinstance(nb, bool) or not isinstance(nb, int) or not 0 <= nb <= z.dim():
            raise ValueError(f"fixed_point: batch_dims must be an integer in 0..{z.dim()} "
                             f"for a state of shape {tuple(z.shape)}, got {batch_dims!r}")
        self.shape = z.shape
        self.batch_shape = z.shape[:nb]
        self.B = math.prod(z.shape[:nb])
        self.n = math.prod(z.shape[nb:])

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.B, self.n)

    def unflat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.shape)


def _bdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample dot products of ``(B, n)`` tensors."""
    return (a * b).sum(-1)


# ----------------------------------------------------------------------------------------
# solvers: functional steps on a tuple state (z, f(z), history...)
#
# The same step serves the no-grad solve, the adjoint solve and the unrolled backward
# (where the tuple is deepsolve.unroll's state), so the unrolled forward repeats the solve's
# iterates exactly. ``step(f, state, i)`` makes iteration i: the new iterate and f of it.


class _Picard:
    """``z <- (1 - beta) z + beta f(z)``."""

    def __init__(self, lay: _Layout, beta: float = 1.0):
        if not 0 < beta <= 1:
            raise ValueError(f"fixed_point: picard beta must be in (0, 1], got {beta}")
        self.lay, self.beta = lay, float(beta)

    def init(self, f, z):
        return (z, f(z))

    def step(self, f, state, i, inplace=False):
        z, fz = state[0], state[1]
        new = fz if self.beta == 1.0 else z + self.beta * (fz - z)
        return (new, f(new))


class _Anderson:
    """Anderson acceleration (type II) in the difference form of Walker & Ni (SIAM J. Numer.
    Anal. 49(4), 2011), with memory ``m``, mixing ``beta`` and a Tikhonov term ``lam``
    relative to the mean squared residual difference::

        gamma = argmin ||r_k - dR gamma||^2 + lam * mean|dR_j|^2 * ||gamma||^2
        z_{k+1} = z_k + beta r_k - (dZ + beta dR) gamma

    per batch element, where ``r = f(z) - z`` and ``dZ``, ``dR`` hold the differences of the
    last ``min(k, m - 1) + 1`` iterates and residuals. The first step is a damped Picard
    step, and so is the step of a batch element whose least-squares system is singular
    (``lam`` is raised to at least 10 machine epsilons of the dtype). State:
    ``(z, f(z), Z, F)``, ``Z``/``F`` the last ``m - 1`` iterates and images ``(B, m-1, n)``.
    """

    def __init__(self, lay: _Layout, m: int = 5, lam: float = 1e-8, beta: float = 1.0):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"fixed_point: anderson m must be an integer >= 1, got {m!r}")
        if not 0 < beta <= 1:
            raise ValueError(f"fixed_point: anderson beta must be in (0, 1], got {beta}")
        if lam < 0:
            raise ValueError(f"fixed_point: anderson lam must be >= 0, got {lam}")
        self.lay, self.m, self.lam, self.beta = lay, m, float(lam), float(beta)

    def init(self, f, z):
        lay = self.lay
        hist = z.new_zeros(lay.B, self.m - 1, lay.n)
        return (z, f(z), hist, hist.clone())

    def step(self, f, state, i, inplace=False):
        lay, m, beta = self.lay, self.m, self.beta
        z, fz, Z, F = state
        zf, ff = lay.flat(z), lay.flat(fz)
        h = min(i, m - 1)  # usable history
        if h == 0:
            new = ff if beta == 1.0 else zf + beta * (ff - zf)
        else:
            Zw = torch.cat((Z[:, m - 1 - h:], zf[:, None]), 1)  # (B, h+1, n), oldest first
            Fw = torch.cat((F[:, m - 1 - h:], ff[:, None]), 1)
            Rw = Fw - Zw
            dR = Rw[:, 1:] - Rw[:, :-1]
            dZ = Zw[:, 1:] - Zw[:, :-1]
            r = Rw[:, -1]
            A = torch.bmm(dR, dR.transpose(1, 2))  # (B, h, h)
            rhs = torch.bmm(r[:, None, :], dR.transpose(1, 2))[:, 0]  # (B, h)
            fi = torch.finfo(A.dtype)
            lam = max(self.lam, 10 * fi.eps)  # at least what the dtype can resolve
            reg = lam * A.diagonal(dim1=1, dim2=2).mean(-1) + fi.tiny
            A = A + reg[:, None, None] * torch.eye(h, dtype=A.dtype, device=A.device)
            gamma, info = torch.linalg.solve_ex(A, rhs)  # (B, h)
            bad = (info != 0)[:, None] | ~torch.isfinite(gamma)
            gamma = torch.where(bad, torch.zeros_like(gamma), gamma)  # fall back to Picard
            corr = torch.bmm(gamma[:, None, :], dZ + beta * dR)[:, 0]
            new = zf + beta * r - corr
        if m > 1:
            Z = torch.cat((Z[:, 1:], zf[:, None]), 1)
            F = torch.cat((F[:, 1:], ff[:, None]), 1)
        new = lay.unflat(new)
        return (new, f(new), Z, F)


class _Broyden:
    """Good Broyden with limited memory ``m`` on ``g(z) = f(z) - z = 0``.

    The inverse Jacobian of ``g`` is ``H = -I + sum_j u_j v_j^T`` (at most ``m`` rank-one
    updates; when they are all used, ``H`` restarts from ``-I``, which is more robust than
    dropping the oldest), ``z <- z - H g`` (a Picard step while ``H = -I``) and,
    with ``s = dz``, ``y = dg``, the Sherman–Morrison form of the good Broyden update
    ``u = (s - H y) / (s^T H y)``, ``v = H^T s``, skipped for a batch element when
    ``|s^T H y|`` is below ``sqrt(machine eps) ||s|| ||H y||``. State: ``(z, f(z), U, V)``.
    """

    def __init__(self, lay: _Layout, m: int = 30):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"fixed_point: broyden m must be an integer >= 1, got {m!r}")
        self.lay, self.m = lay, m

    def init(self, f, z):
        lay = self.lay
        U = z.new_zeros(lay.B, self.m, lay.n)
        return (z, f(z), U, U.clone())

    def step(self, f, state, i, inplace=False):
        lay = self.lay
        z, fz, U, V = state
        c = i % self.m  # updates in use: slots 0 .. c-1
        if i > 0 and c == 0:  # memory full: restart from H = -I
            if inplace:
                U.zero_()
                V.zero_()
            else:
                U, V = torch.zeros_like(U), torch.zeros_like(V)
        Uc, Vc = U[:, :c], V[:, :c]
        zf = lay.flat(z)
        g = lay.flat(fz) - zf

        def H(x):  # H x = -x + U^T (V x), as row-vector products (fast batched matvecs)
            if c == 0:
                return -x
            return -x + torch.bmm(torch.bmm(x[:, None, :], Vc.transpose(1, 2)), Uc)[:, 0]

        def Ht(x):  # H^T x
            if c == 0:
                return -x
            return -x + torch.bmm(torch.bmm(x[:, None, :], Uc.transpose(1, 2)), Vc)[:, 0]

        s = -H(g)
        new = lay.unflat(zf + s)
        fnew = f(new)
        y = (lay.flat(fnew) - (zf + s)) - g
        Hy = H(y)
        den = _bdot(s, Hy)
        tiny = math.sqrt(torch.finfo(den.dtype).eps) * s.norm(dim=-1) * Hy.norm(dim=-1)
        ok = (den.abs() > tiny) & torch.isfinite(den)
        den = torch.where(ok, den, torch.ones_like(den))
        u = torch.where(ok[:, None], (s - Hy) / den[:, None], torch.zeros_like(s))
        v = torch.where(ok[:, None], Ht(s), torch.zeros_like(s))
        if inplace:  # the no-grad solve owns its buffers
            U[:, c] = u
            V[:, c] = v
        else:
            U = torch.cat((U[:, :c], u[:, None], U[:, c + 1:]), 1)
            V = torch.cat((V[:, :c], v[:, None], V[:, c + 1:]), 1)
        return (new, fnew, U, V)


_CLASSES = {"picard": _Picard, "anderson": _Anderson, "broyden": _Broyden}


def _make_solver(name: str, lay: _Layout, options: dict[str, Any]):
    own = {k: v for k, v in options.items() if k in SOLVERS[name]}
    return _CLASSES[name](lay, **own)


# ----------------------------------------------------------------------------------------
# the no-grad iteration


@dataclass
class _Result:
    state: tuple
    k: int
    converged: bool
    history: list[float]
    sample: torch.Tensor
    growing: bool = False    # below tol only because the iterate grew (see _Criterion)
    abs_residual: float = math.nan


def _norms(t: torch.Tensor) -> torch.Tensor:
    """Per-sample 2-norms of a ``(B, n)`` tensor without overflow: ``m * ||t / m||`` with
    ``m`` the largest magnitude, so entries near the dtype's maximum (whose squares overflow
    to inf) give their true, finite norm. inf or NaN entries give inf or NaN."""
    m = t.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(torch.isfinite(m) & (m > 0), m, torch.ones_like(m))
    return (t / safe).norm(dim=-1) * safe[:, 0] + torch.where(torch.isfinite(m[:, 0]),
                                                               torch.zeros_like(m[:, 0]),
                                                               m[:, 0])


class _Criterion:
    """The convergence test of one solve. A batch element has converged when

    * its relative residual ``||f(z) - z|| / (||f(z)|| + eps)`` is <= ``tol``, or its
      absolute residual ``||f(z) - z||`` is <= ``atol``, and
    * its absolute residual has come down from the start's (or is 0, or <= ``atol``): an
      iterate that grows without bound has a relative residual that shrinks with ``1/||z||``
      (``f(z) = z + 1``) while ``f(z) - z`` does not, and is not a fixed point.

    Norms are overflow-safe (:func:`_norms`): an iterate near the dtype's largest value
    neither overflows the relative residual's denominator to inf (which made the residual 0
    and "converged") nor passes as finite when it is not."""

    def __init__(self, lay: _Layout, tol: float, atol: float, eps: float):
        self.lay, self.tol, self.atol, self.eps = lay, tol, atol, eps
        self.r0: torch.Tensor | None = None   # the absolute residuals at the start
        self.growing = False                  # the last call: converged but for growth
        self.r = math.nan                     # the last call's largest absolute residual

    def __call__(self, z, fz) -> tuple[bool, float, torch.Tensor]:
        """``(converged, max relative residual, relative per sample)``; the max is NaN or
        inf when an iterate or f of it is not finite. One host synchronisation."""
        lay = self.lay
        fzf = lay.flat(fz)
        r = _norms(fzf - lay.flat(z))
        nf = _norms(fzf)
        rel = r / (nf + self.eps)
        if rel.numel() == 0:
            return True, 0.0, rel
        finite = torch.isfinite(r) & torch.isfinite(nf)
        rel = torch.where(finite, rel, torch.full_like(rel, math.nan))
        small = rel <= self.tol
        if self.atol > 0:
            small = small | (r <= self.atol)
        if self.r0 is None:
            self.r0 = r
            down = torch.ones_like(small)
        else:
            down = (r < self.r0) | (r == 0) | (r <= self.atol)
        ok = (small & down).all()
        near = small.all()
        conv, grow, mx, rmax = torch.stack((ok.to(rel.dtype), (near & ~ok).to(rel.dtype),
                                            rel.max(), r.max())).tolist()
        self.growing = bool(grow)
        self.r = rmax
        return bool(conv), mx, rel

def _not_finite(where: str, i: int, rel: torch.Tensor, history: list[float]) -> FixedPointError:
    bad = (~torch.isfinite(rel)).nonzero().flatten().tolist()
    more = f" (batch elements {bad[:8]}{' ...' if len(bad) > 8 else ''})" if rel.numel() > 1 \
        else ""
    last = f"; the residual at iteration {i - 1} was {history[-1]:.3e}" if history else ""
    return FixedPointError(
        f"{where}: the iterate or f of it is not finite (NaN/Inf) at iteration {i}{more}{last}. "
        "f may not be a contraction here: try damping (beta < 1), solver='anderson', or a "
        "better starting point"
    )


def _iterate(f, z0, method, crit: _Criterion, max_iter: int, where: str) -> _Result:
    """Run ``method`` on ``f`` from ``z0`` without recording until converged or max_iter."""
    with torch.no_grad():
        state = method.init(f, z0)
        history: list[float] = []
        i = 0
        while True:
            done, mx, rel = crit(state[0], state[1])
            if not math.isfinite(mx):
                raise _not_finite(where, i, rel, history)
            history.append(mx)
            if done:
                return _Result(state, i, True, history, rel)
            if i == max_iter:
                return _Result(state, i, False, history, rel, crit.growing, crit.r)
            state = method.step(f, state, i, inplace=True)
            i += 1


def _checked(f: Callable, z0: torch.Tensor) -> Callable:
    """``f`` wrapped to check, once, that it keeps the shape, dtype and device of ``z``."""
    done: list[bool] = []

    def g(z):
        out = f(z)
        if not done:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"fixed_point: f returned a {type(out).__name__}; it must "
                                "return a tensor of the shape of z")
            if out.shape != z0.shape or out.dtype != z0.dtype or out.device != z0.device:
                raise ValueError(
                    f"fixed_point: f maps z of shape {tuple(z0.shape)} {z0.dtype} on "
                    f"{z0.device} to {tuple(out.shape)} {out.dtype} on {out.device}; f(z) "
                    "must have the shape, dtype and device of z")
            done.append(True)
        return out

    return g


def _report(res: _Result, tol: float, max_iter: int, strict: bool, where: str,
            hint: str = "", stacklevel: int = 3) -> None:
    if res.converged:
        return
    if res.growing:
        msg = (f"{where} did not converge in {max_iter} iterations: the relative residual "
               f"{res.history[-1]:.3e} is below tol={tol:.1e} only because the iterate grew; "
               f"the absolute residual ||f(z) - z|| ({res.abs_residual:.3e}) has not come down "
               f"from the start's, so this is no fixed point (f may have none here){hint}")
    else:
        msg = (f"{where} did not converge in {max_iter} iterations: relative residual "
               f"{res.history[-1]:.3e} > tol={tol:.1e}{hint}")
    if strict:
        raise FixedPointError(msg)
    warnings.warn(msg, FixedPointWarning, stacklevel=stacklevel)


# ----------------------------------------------------------------------------------------
# implicit backward


class _Adjoint:
    """What the implicit backward needs: ``f``, ``z*``, the RNG state of the recording and
    the adjoint solver settings."""

    def __init__(self, s: _Solve, z: torch.Tensor, rng: Any, replay: Replay, mode: Implicit):
        self.f, self.z, self.rng, self.replay, self.lay = s.f, z, rng, replay, s.lay
        self.solver = s.solver if mode.solver is None else mode.solver
        self.options = s.opts
        self.tol = s.tol if mode.tol is None else float(mode.tol)
        self.max_iter = s.max_iter if mode.max_iter is None else mode.max_iter
        self.strict, self.stats = s.strict, s.stats

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        """``g = J_f(z*)^T g + v`` by the adjoint solver, one VJP per iteration."""
        t0 = time.perf_counter()
        zr = self.z.detach().requires_grad_()
        with torch.random.fork_rng(devices=self.replay.cuda), torch.enable_grad():
            self.replay.restore(self.rng)
            fz = self.f(zr)
        v = v.contiguous()
        if not fz.requires_grad:  # f does not depend on z: J = 0
            g, res = v, None
        else:
            def h(u):
                (jt,) = torch.autograd.grad(fz, zr, u, retain_graph=True, allow_unused=True)
                return v if jt is None else jt + v

            method = _make_solver(self.solver, self.lay, self.options)
            crit = _Criterion(self.lay, self.tol, self.options.get("atol", 0.0),
                              self.options.get("eps", _COMMON["eps"]))
            res = _iterate(h, v, method, crit, self.max_iter,
                           f"fixed_point backward ({self.solver} adjoint solve)")
            g = res.state[0]
        st = self.stats
        st.backward_solver = self.solver
        if res is None:
            st.backward_iterations, st.backward_residuals, st.backward_converged = 0, [0.0], True
        else:
            st.backward_iterations = res.k
            st.backward_residuals = res.history
            st.backward_converged = res.converged
        st.backward_time = time.perf_counter() - t0
        if res is not None:
            _report(res, self.tol, self.max_iter, self.strict,
                    f"fixed_point backward: the {self.solver} adjoint solve",
                    "; the gradient is approximate", stacklevel=2)
        return g


class _ImplicitFunction(torch.autograd.Function):
    """Forward: ``z*`` (given). Backward: the adjoint ``g``, handed to ``out = f(z*)``'s graph
    (recorded with ``z*`` constant), which turns it into ``(∂f/∂θ)^T g`` for every θ."""

    @staticmethod
    def forward(ctx, adj: _Adjoint, out: torch.Tensor):
        ctx.adj = adj
        ctx.set_materialize_grads(False)
        return adj.z.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, gz):
        if gz is None:
            return None, None
        return None, ctx.adj.solve(gz)


# ----------------------------------------------------------------------------------------
# public entry point


def fixed_point(
    f: Callable[[torch.Tensor], torch.Tensor],
    z0: torch.Tensor,
    *,
    params: Sequence[torch.Tensor] | None = None,
    solver: str = "anderson",
    tol: float = 1e-6,
    max_iter: int = 100,
    backward: str | Backward = "implicit",
    budget: int | str | None = None,
    snapshots: int | None = None,
    return_stats: bool = False,
    strict: bool = False,
    stats: FixedPointStats | None = None,
    batch_dims: int | None = None,
    backward_solver: str | None = None,
    backward_tol: float | None = None,
    backward_max_iter: int | None = None,
    phantom_steps: int = 5,
    phantom_damping: float = 0.5,
    **solver_options: Any,
) -> Any:
    """Solve ``z = f(z)`` from ``z0`` and return the solution, differentiably.

    Args:
        f: maps a tensor to a tensor of the same shape, dtype and device; close over inputs
            (``lambda z: torch.tanh(z @ W.T + x)``) and modules. It is called without grad
            during the solve, so it must be a deterministic function of ``z`` (dropout draws
            are replayed for the implicit backward's recomputation, not between iterations).
        z0: the starting point, a floating-point tensor ``(*batch, *features)``.
        params: tensors to differentiate that ``deepsolve.unroll`` cannot find on its own
            (computed outside ``f`` from parameters, e.g. ``Ux = U @ x``), for
            ``backward="unrolled"`` with ``snapshots=``/``budget=``; see docs/unroll.md. The
            implicit and phantom backwards and the plain unrolled one reach every tensor ``f``
            uses through autograd and need none.
        solver: ``"anderson"`` (options ``m=5``, ``lam=1e-8``, ``beta=1``), ``"picard"``
            (``beta=1``: damping ``z <- (1 - beta) z + beta f(z)``) or ``"broyden"`` (good
            Broyden, memory ``m=30``). Every solver also takes ``atol=0`` and ``eps=1e-12``.
        tol: relative residual ``||f(z) - z|| / (||f(z)|| + eps)`` to reach in every batch
            element (or absolute residual ``<= atol``), with an absolute residual that has
            come down from the start's: a growing iterate is not a fixed point, however small
            its relative residual. Norms are overflow-safe. In float32 ``1e-6`` is near
            round-off; use ``1e-4``.
        max_iter: most solver iterations; ``f`` is evaluated at most ``max_iter + 1`` times.
        backward: a backward mode — :class:`Implicit`, :class:`Unrolled`, :class:`Phantom`
            or :class:`Auto` — or its name ``"implicit"``, ``"unrolled"``, ``"auto"``,
            ``"phantom"`` (module docs), completed by the keywords below.
        budget, snapshots: the checkpoint schedule of ``backward="unrolled"`` (and of
            ``"auto"`` when it unrolls), as in :func:`deepsolve.unroll`; plain autograd
            through the iterations without either.
        return_stats: return ``(z, stats)``.
        strict: raise :class:`FixedPointError` instead of warning
            (:class:`FixedPointWarning`) when the forward or the adjoint solve stops at
            ``max_iter`` above the tolerance.
        stats: a :class:`FixedPointStats` to fill (also with ``return_stats=False``).
        batch_dims: how many leading dimensions of ``z`` index independent problems: the
            residual, the convergence test and the Anderson / Broyden mixing are per batch
            element. Default: 1 when ``z`` has 2 or more dimensions, else 0 (one problem).
            Pass ``batch_dims=0`` for one problem with a multi-dimensional state.
        backward_solver, backward_tol, backward_max_iter: the adjoint solve of the implicit
            backward (default: ``solver``, ``tol``, ``max_iter``; ``solver_options`` apply).
        phantom_steps, phantom_damping: ``k`` and ``λ`` of ``backward="phantom"``.
        **solver_options: options of ``solver`` and ``backward_solver`` (see ``solver``).

    Returns:
        ``z_k``, the first iterate whose residual meets the tolerance (the last one otherwise),
        or ``(z_k, stats)``. With grad enabled and something in ``f`` requiring grad it is
        differentiable as ``backward`` says; ``z0`` gets a gradient only from ``"unrolled"``.

    Raises:
        FixedPointError: an iterate (or ``f`` of it) is NaN/Inf — the message names the
            iteration; with ``strict=True``, no convergence.
    """
    if solver not in SOLVERS:
        raise ValueError(f"fixed_point: unknown solver {solver!r}; use one of "
                         f"{', '.join(SOLVERS)}")
    for name, val in (("max_iter", max_iter), ("backward_max_iter", backward_max_iter)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 0):
            raise ValueError(f"fixed_point: {name} must be an integer >= 0, got {val!r}")
    mode = backward_mode(backward, solver=backward_solver, tol=backward_tol,
                         max_iter=backward_max_iter, snapshots=snapshots, budget=budget,
                         phantom_steps=phantom_steps, phantom_damping=phantom_damping)
    imp = mode.implicit if isinstance(mode, Auto) else mode
    bsolver = solver if not isinstance(imp, Implicit) or imp.solver is None else imp.solver
    if bsolver not in SOLVERS:
        raise ValueError(f"fixed_point: unknown backward_solver {bsolver!r}; use one of "
                         f"{', '.join(SOLVERS)}")
    allowed = {**_COMMON, **SOLVERS[solver], **SOLVERS[bsolver]}
    unknown = sorted(set(solver_options) - set(allowed))
    if unknown:
        raise TypeError(f"fixed_point: unknown option(s) {', '.join(unknown)} for solver "
                        f"{solver!r}" + (f" / backward_solver {bsolver!r}" if bsolver != solver
                                         else "") + f"; options: {', '.join(sorted(allowed))}")
    if not isinstance(z0, torch.Tensor) or not z0.is_floating_point():
        raise TypeError("fixed_point: z0 must be a floating-point tensor, got "
                        f"{getattr(z0, 'dtype', type(z0).__name__)}")
    if not tol >= 0:
        raise ValueError(f"fixed_point: tol must be >= 0, got {tol}")
    explicit = list(params or [])
    for k, p in enumerate(explicit):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"fixed_point: params[{k}] is a {type(p).__name__}, not a tensor")

    st = stats if stats is not None else FixedPointStats()
    st._reset()
    st.solver = solver
    lay = _Layout(z0, batch_dims)
    opts = {**_COMMON, **solver_options}
    s = _Solve(_checked(f, z0), z0, lay, solver, _make_solver(solver, lay, opts),
               _Criterion(lay, float(tol), float(opts["atol"]), float(opts["eps"])), opts,
               float(tol), max_iter, strict, st, explicit or None)
    t0 = time.perf_counter()
    if mode.one_pass and torch.is_grad_enabled():
        z = mode.solve(s)
    else:
        res = _iterate(s.f, z0, s.method, s.crit, max_iter, s.where)
        st.iterations, st.residuals, st.converged = res.k, res.history, res.converged
        st.residual, st.sample_residuals = res.history[-1], res.sample.detach().cpu()
        _report(res, tol, max_iter, strict, s.where, mode.hint(res))
        if torch.is_grad_enabled():
            z = mode.differentiate(s, res)
        else:
            st.backward = "none"
            z = res.state[0]
    st.forward_time = time.perf_counter() - t0
    return (z, st) if return_stats else z


@dataclass
class _Solve:
    """One call's forward solve, as the backward modes see it: ``f`` (checked), ``z0``, the
    batch layout, the solver's name and object, the convergence test, the solver options,
    ``tol``, ``max_iter``, ``strict``, the stats to fill and the explicit ``params``."""

    f: Callable[[torch.Tensor], torch.Tensor]
    z0: torch.Tensor
    lay: _Layout
    solver: str
    method: Any
    crit: _Criterion
    opts: dict[str, Any]
    tol: float
    max_iter: int
    strict: bool
    stats: FixedPointStats
    params: list[torch.Tensor] | None

    @property
    def where(self) -> str:
        return f"fixed_point ({self.solver})"


def _implicit(s: _Solve, zk: torch.Tensor, mode: Implicit) -> torch.Tensor:
    z = zk.detach()
    replay = Replay.of([z])
    rng = replay.capture()
    with torch.enable_grad():
        out = s.f(z)
    if not out.requires_grad:  # nothing in f requires grad
        s.stats.backward = "none"
        return zk
    s.stats.backward = "implicit"
    adj = _Adjoint(s, z, rng, replay, mode)
    return _ImplicitFunction.apply(adj, out)


def _phantom(s: _Solve, zk: torch.Tensor, mode: Phantom) -> torch.Tensor:
    z = zk.detach()
    p = z
    lam = float(mode.damping)
    for _ in range(mode.steps):
        fp = s.f(p)
        p = fp if lam == 1.0 else p + lam * (fp - p)
    if not p.requires_grad:
        s.stats.backward = "none"
        return zk
    s.stats.backward = "phantom"
    s.stats.backward_iterations = mode.steps
    return z + (p - p.detach())  # the value of z_k, the gradient of the phantom iterations


def _unroll_options(s: _Solve, mode: Unrolled) -> dict[str, Any]:
    return {"snapshots": mode.snapshots, "budget": mode.budget, "params": s.params}


def _unrolled(s: _Solve, k: int, mode: Unrolled) -> torch.Tensor:
    """Differentiate the first ``k`` iterations of the solver from ``z0`` (re-run, recorded
    or checkpointed, by deepsolve.unroll)."""
    st = s.stats
    st.backward = "unrolled"
    st.backward_iterations = k
    st.unroll = UnrollStats()
    method, f = s.method, s.f
    state0 = method.init(f, s.z0)

    def step(state, i):
        return method.step(f, state, i)

    final = unroll(step, state0, k, has_output=False, stats=st.unroll,
                   **_unroll_options(s, mode))
    return final[0]


def _unrolled_until(s: _Solve, mode: Unrolled) -> torch.Tensor:
    """backward="unrolled" in one pass: the unroll stops at the first converged state
    (``stop(x_i, i)`` is asked after each step, ``i >= 1``; ``x_0`` is checked here); an
    unconverged solve warns (or raises, ``strict``) as the forward solve does."""
    st, crit, method, f, max_iter, where = s.stats, s.crit, s.method, s.f, s.max_iter, s.where
    st.backward = "unrolled"
    st.unroll = UnrollStats()
    state0 = method.init(f, s.z0)
    with torch.no_grad():
        done, mx, rel = crit(state0[0], state0[1])
    if not math.isfinite(mx):
        raise _not_finite(where, 0, rel, [])
    history: list[float] = [mx]
    last: dict[str, Any] = {"done": done, "rel": rel, "growing": crit.growing}

    def stop(state, i):
        with torch.no_grad():
            done, mx, rel = crit(state[0], state[1])
        if not math.isfinite(mx):
            raise _not_finite(where, i, rel, history)
        if i == len(history):
            history.append(mx)
            last["done"], last["rel"], last["growing"] = done, rel, crit.growing
        return done or i >= max_iter  # max_iter: stop, then warn (not an error)

    def step(state, i):
        return method.step(f, state, i)

    if done or max_iter == 0:
        z = state0[0]
    else:
        z = unroll(step, state0, None, until=stop, has_output=False, stats=st.unroll,
                   **_unroll_options(s, mode))[0]
    st.iterations = st.backward_iterations = len(history) - 1
    st.residuals, st.residual = history, history[-1]
    st.converged = bool(last["done"])
    st.sample_residuals = last["rel"].detach().cpu()
    growing = bool(last["growing"]) and not st.converged
    # the caller of fixed_point is 5 frames up: _report, here, Unrolled.solve, fixed_point
    _report(_Result((), st.iterations, st.converged, st.residuals, st.sample_residuals,
                    growing, crit.r), s.tol, max_iter, s.strict, where, stacklevel=5)
    return z
