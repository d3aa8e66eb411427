"""Reversible steppers: time steps with an algebraic inverse, for memory flat in the step count.

A step ``x_{i+1} = f_i(x_i)`` whose inverse ``x_i = f_i^{-1}(x_{i+1})`` is cheap lets the
reverse sweep rebuild every state from the next one instead of storing or recomputing it:
``unroll(step, x0, n, schedule=deepsolve.Reversible())`` holds a few snapshots whatever
``n``, at the cost of about one inverse per step (:mod:`deepsolve.schedules.reversible`,
docs/reversible.md). A reversible step is any callable ``step(state, i)`` with a method
``step.inverse(state, i)``; this module builds them:

* :func:`coupled` / :func:`explicit` — the McCallum–Foster coupling makes *any* explicit
  one-step method reversible. With the base method's increment ``Phi_h(t, y)`` (one step
  ``y + Phi_h(t, y)``; :func:`explicit` integrates a vector field with a Butcher tableau:
  Euler, midpoint, Heun, Ralston, RK4, SSPRK3, or your own :class:`Tableau`) the state is
  the pair ``(y, z)`` and::

      y_{i+1} = lam y_i + (1 - lam) z_i + Phi_h(t_i, z_i)
      z_{i+1} = z_i - Phi_{-h}(t_{i+1}, y_{i+1})

  with the inverse ``z_i = z_{i+1} + Phi_{-h}(t_{i+1}, y_{i+1})``,
  ``y_i = (y_{i+1} - (1 - lam) z_i - Phi_h(t_i, z_i)) / lam``. The method keeps the base
  method's order; each step (and each inverse) costs two base steps. The coupling ``lam``
  in ``(0, 1]``: smaller widens the forward's stability region on the negative real axis
  (a decaying mode ``R(w) < 1`` has a partner growing like ``lam / R(w)``: stable only while
  ``R(w) >= lam``, about ``|h mu| < 1 - lam``), larger is more stable backward (the inverse
  amplifies rounding by about ``1 / lam`` per step: ``e^{n (1 - lam)}`` over ``n`` steps);
  0.999 (the authors' default) amplifies by ``e^10 = 2.2e4`` over 10^4 steps and suits
  oscillatory, advective and Hamiltonian steps, not diffusive or stiff ones
  (:mod:`deepsolve.stability`, checked before every unroll). (McCallum & Foster, "Efficient,
  accurate and stable gradients for Neural ODEs", arXiv:2410.11648, 2024.)
* :func:`leapfrog` — kick-drift-kick (velocity Verlet) for ``q'' = a(q, t)``, state
  ``(q, v)``: symplectic, second order, its own inverse with ``-h``.
* :func:`reversible_heun` — Kidger et al.'s reversible Heun method for ``y' = f(t, y)``,
  state ``(y, y^, f(t, y^))``: one evaluation of ``f`` per step and per inverse, second
  order, stable on the imaginary segment ``|h mu| <= 1`` only. ("Efficient and accurate
  gradients for neural SDEs", NeurIPS 2021.)
* :func:`invertible` — your own step and its inverse, as one reversible step.

Each stepper's ``init(y0)`` builds the carried state from the solution ``y0`` and
``solution(state)`` takes it back; step ``i`` runs from ``t_i = t0 + i dt`` to ``t_{i+1}``;
``stability(state, i, n)`` is the scheme's linear stability for the step at hand
(:class:`deepsolve.stability.Stability`). Solutions ``y`` may be tensors or pytrees of
tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .stability import (
    Flat,
    Stability,
    amplification,
    confirm,
    coupled_matrix,
    fmt_mode,
    heun_matrix,
    isolated,
    jvp,
    largest,
    leapfrog_matrix,
    report,
    ritz,
    rk_stability_function,
)

__all__ = ["ReversibleStep", "Coupled", "Leapfrog", "ReversibleHeun", "Tableau", "TABLEAUS",
           "coupled", "explicit", "leapfrog", "reversible_heun", "invertible", "rk_increment"]


def _map(fn: Callable, *trees: Any) -> Any:
    """``fn`` leaf by leaf over trees of the same structure (a tensor is its own leaf)."""
    if isinstance(trees[0], torch.Tensor):
        return fn(*trees)
    return pytree.tree_map(fn, *trees)


def _step_size(dt: Any) -> float:
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not math.isfinite(dt) \
            or dt == 0:
        raise ValueError(f"reversible: dt must be a finite nonzero number, got {dt!r}")
    return float(dt)


class ReversibleStep:
    """A step ``step(state, i) -> next state`` with ``inverse(state, i) -> previous state``
    (``x_i`` from ``x_{i+1}``); subclasses implement :meth:`forward` and :meth:`inverse`.

    Attributes:
        dt: the step size; step ``i`` runs from ``t0 + i dt`` to ``t0 + (i + 1) dt``.
        t0: the initial time.
    """

    dt: float = 1.0
    t0: float = 0.0

    def __call__(self, state: Any, i: int) -> Any:
        return self.forward(state, i)

    def forward(self, state: Any, i: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def inverse(self, state: Any, i: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def time(self, i: int) -> float:
        """``t_i = t0 + i dt``."""
        return self.t0 + i * self.dt

    def init(self, y0: Any) -> Any:
        """The carried state whose solution is ``y0`` (the state itself by default)."""
        return y0

    def solution(self, state: Any) -> Any:
        """The solution ``y`` the carried state holds (the state itself by default)."""
        return state

    def _confirmed(self) -> dict:
        """This stepper's trajectories measured stable (:func:`deepsolve.stability.confirm`)."""
        return self.__dict__.setdefault("_confirmed_stable", {})

    def stability(self, state: Any, i: int = 0, n: int | None = None) -> Stability | None:
        """The scheme's linear stability at ``state`` and step ``i``
        (:class:`deepsolve.stability.Stability`: the largest growth of a mode beyond the
        solution's, and of rounding under the inverse), or ``None`` where the scheme is
        not known (:func:`invertible`: your own step). With ``n`` (the steps to be run),
        an instability the linearisation predicts is measured along the first steps of
        the trajectory before it is reported. :func:`deepsolve.unroll` checks it before the
        forward sweep and the budget planner before it weighs the reversible schedule."""
        return None


class _Invertible(ReversibleStep):
    def __init__(self, step: Callable[[Any, int], Any], inverse: Callable[[Any, int], Any]):
        for name, fn in (("step", step), ("inverse", inverse)):
            if not callable(fn):
                raise TypeError(f"invertible: {name} must be callable as {name}(state, i), "
                                f"got {type(fn).__name__}")
        self._f, self._g = step, inverse

    def forward(self, state: Any, i: int) -> Any:
        return self._f(state, i)

    def inverse(self, state: Any, i: int) -> Any:
        return self._g(state, i)

    def __repr__(self) -> str:
        name = getattr(self._f, "__name__", type(self._f).__name__)
        return f"invertible({name})"


def invertible(step: Callable[[Any, int], Any],
               inverse: Callable[[Any, int], Any]) -> ReversibleStep:
    """Your own reversible step: ``step(state, i) -> x_{i+1}`` and ``inverse(state, i) ->
    x_i`` (from ``x_{i+1}``). The unroll checks the pair on its first step."""
    return _Invertible(step, inverse)


@dataclass(frozen=True)
class Tableau:
    """An explicit Runge–Kutta method: stages ``k_s = f(t + c_s h, y + h sum_{j<s} a_sj k_j)``,
    increment ``Phi_h(t, y) = h sum_s b_s k_s``. ``a`` is strictly lower triangular (rows of
    length ``s``, only the entries before the diagonal are read)."""

    a: Sequence[Sequence[float]]
    b: Sequence[float]
    c: Sequence[float]
    name: str = "tableau"

    def __post_init__(self):
        s = len(self.b)
        if s < 1 or len(self.c) != s or len(self.a) != s:
            raise ValueError(f"Tableau {self.name}: a, b and c must describe the same number "
                             f"of stages (got {len(self.a)}, {len(self.b)}, {len(self.c)})")
        for r, row in enumerate(self.a):
            if any(row[j] != 0 for j in range(r, len(row))):
                raise ValueError(f"Tableau {self.name}: row {r} of a has entries on or above "
                                 "the diagonal; only explicit methods are reversible here")
        if abs(sum(self.b) - 1.0) > 1e-12:
            raise ValueError(f"Tableau {self.name}: the weights b sum to {sum(self.b)}, not 1 "
                             "(the method would not be consistent)")


TABLEAUS: dict[str, Tableau] = {
    "euler": Tableau([[0.0]], [1.0], [0.0], "euler"),
    "midpoint": Tableau([[0.0, 0.0], [0.5, 0.0]], [0.0, 1.0], [0.0, 0.5], "midpoint"),
    "heun": Tableau([[0.0, 0.0], [1.0, 0.0]], [0.5, 0.5], [0.0, 1.0], "heun"),
    "ralston": Tableau([[0.0, 0.0], [2 / 3, 0.0]], [0.25, 0.75], [0.0, 2 / 3], "ralston"),
    "ssprk3": Tableau([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.0]],
                      [1 / 6, 1 / 6, 2 / 3], [0.0, 1.0, 0.5], "ssprk3"),
    "rk4": Tableau([[0.0] * 4, [0.5, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]],
                   [1 / 6, 1 / 3, 1 / 3, 1 / 6], [0.0, 0.5, 0.5, 1.0], "rk4"),
}
"""The named explicit Runge–Kutta methods of :func:`explicit`."""


def rk_increment(f: Callable[[float, Any], Any],
                 method: str | Tableau = "rk4") -> Callable[[Any, float, float], Any]:
    """The increment ``Phi_h(t, y)`` of one explicit Runge–Kutta step of ``y' = f(t, y)``
    (``method``: a name from :data:`TABLEAUS` or a :class:`Tableau`)."""
    tab = _tableau(method)
    a, b, c = [list(r) for r in tab.a], list(tab.b), list(tab.c)
    stages = len(b)

    def increment(y: Any, t: float, h: float) -> Any:
        ks: list = []
        for s in range(stages):
            ys = _combine(y, [(h * a[s][j], ks[j]) for j in range(s) if a[s][j] != 0])
            ks.append(f(t + c[s] * h, ys))
        return _combine(None, [(h * b[j], ks[j]) for j in range(stages) if b[j] != 0])

    increment.__name__ = f"{tab.name}_increment"
    return increment


def _combine(y: Any, terms: list[tuple[float, Any]]) -> Any:
    """``y + sum_j w_j k_j`` leaf by leaf (``y`` may be ``None``: the sum alone)."""
    if not terms:
        return y
    weights = [w for w, _ in terms]

    def comb(*leaves):
        total = leaves[0] if y is not None else 0
        for w, k in zip(weights, leaves[1 if y is not None else 0:], strict=True):
            total = total + w * k
        return total

    return _map(comb, *(([y] if y is not None else []) + [k for _, k in terms]))


def _tableau(method: str | Tableau) -> Tableau:
    if isinstance(method, Tableau):
        return method
    tab = TABLEAUS.get(method) if isinstance(method, str) else None
    if tab is None:
        raise ValueError(f"reversible: unknown method {method!r}; use one of "
                         f"{', '.join(TABLEAUS)} or a Tableau(a, b, c)")
    return tab


class Coupled(ReversibleStep):
    """The McCallum–Foster reversible version of a one-step method with increment
    ``increment(y, t, h) = Phi_h(t, y)``; state ``(y, z)``. See the module docstring."""

    def __init__(self, increment: Callable[[Any, float, float], Any], dt: float,
                 lam: float = 0.999, t0: float = 0.0,
                 field: tuple[Callable[[float, Any], Any], Tableau] | None = None):
        if not callable(increment):
            raise TypeError(f"coupled: increment must be callable as increment(y, t, h), got "
                            f"{type(increment).__name__}")
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 < lam <= 1:
            raise ValueError(f"coupled: lam must be a number in (0, 1], got {lam!r}")
        self.increment = increment
        self.dt = _step_size(dt)
        self.lam = float(lam)
        self.t0 = float(t0)
        self.field = field  # (f, tableau) when built by explicit(): the modes are h eig(df/dy)

    def forward(self, state: Any, i: int) -> Any:
        y, z = state
        lam, h = self.lam, self.dt
        t = self.t0 + i * h
        dz = self.increment(z, t, h)
        y1 = _map(lambda a, b, d: lam * a + (1 - lam) * b + d, y, z, dz)
        dy = self.increment(y1, t + h, -h)
        return (y1, _map(lambda a, d: a - d, z, dy))

    def inverse(self, state: Any, i: int) -> Any:
        y1, z1 = state
        lam, h = self.lam, self.dt
        t = self.t0 + i * h
        z = _map(lambda a, d: a + d, z1, self.increment(y1, t + h, -h))
        dz = self.increment(z, t, h)
        return (_map(lambda a, b, d: (a - (1 - lam) * b - d) / lam, y1, z, dz), z)

    def init(self, y0: Any) -> tuple[Any, Any]:
        """``(y0, y0)``: both halves of the coupled state start at the solution."""
        return (y0, _map(torch.clone, y0))

    def stability(self, state: Any, i: int = 0, n: int | None = None) -> Stability:
        """Per mode the coupling's 2 x 2 amplification matrix
        (:func:`deepsolve.stability.coupled_matrix`) against the exact flow ``e^w``
        (:func:`explicit`: ``w = h mu`` from the vector field's Jacobian and the tableau's
        stability function) or against the base method's own factor ``1 + a`` (a bare
        increment: ``a`` and ``b`` from the increments' Jacobians). With ``n``, a predicted
        instability over ``n`` steps is measured along the trajectory
        (:func:`deepsolve.stability.confirm`)."""
        y, z = state
        lam, h, t = self.lam, self.dt, self.time(i)
        flat = Flat(z)
        tab = self.field[1] if self.field is not None else None

        def factors(w):
            assert tab is not None  # explicit() only
            return (rk_stability_function(tab.a, tab.b, w) - 1,
                    rk_stability_function(tab.a, tab.b, -w) - 1)

        with isolated(state):
            if self.field is not None:
                f = self.field[0]
                found = ritz(jvp(lambda u: f(t, u), z, flat), flat)
                w = np.append(h * found.values, 0)
                a, b = factors(w)
                with np.errstate(over="ignore"):
                    allowed = np.abs(np.exp(w))
                labels = [fmt_mode(x) for x in w]
            else:
                y1 = self.forward(state, i)[0]
                found = ritz(jvp(lambda u: self.increment(u, t, h), z, flat), flat,
                             also=jvp(lambda u: self.increment(u, t + h, -h), y1, flat))
                assert found.quotients is not None  # asked for
                a, b = np.append(found.values, 0), np.append(found.quotients, 0)
                allowed = np.abs(1 + a)
                labels = [f"a mode the base step multiplies by {fmt_mode(1 + x, '')[3:]}"
                          for x in a]
        rho, sigma = amplification(coupled_matrix(a, b, lam))
        seed = (1 + a) * (1 + b) - 1  # y and z step the solution forward and back

        def grows(lam_, a_=a, b_=b, allowed_=allowed) -> bool:
            # the coupling cannot mend the base method: compare with its own factor too
            r, _ = amplification(coupled_matrix(a_, b_, lam_))
            ref = np.maximum(np.maximum(allowed_, np.abs(1 + a_)), 1.0)
            return bool(np.all(r <= ref * (1 + 1e-12)))

        def fix() -> str:
            out = []
            top = largest(grows, lam)
            if top is not None and top < lam:
                out.append(f"a coupling lam <= {_below(top)}")
            if self.field is not None:
                def small(s_: float) -> bool:
                    a_, b_ = factors(s_ * w)
                    with np.errstate(over="ignore"):
                        al = np.abs(np.exp(s_ * w))
                    return grows(lam, a_, b_, al)
                s_ = largest(small, 1.0)
                if s_ is not None and s_ < 1:
                    out.append(f"dt <= {0.8 * s_ * abs(h):.2g}")
            out.append("the plain method (not reversible) with Revolve(s) or budget=")
            return "use " + (", ".join(out[:-1]) + " or " if len(out) > 1 else "") + out[-1]

        rep = report(repr(self), labels, rho, allowed, sigma, seed, _eps(flat),
                     "the coupling is stable on the negative real axis only while the base "
                     "method's factor stays above lam (about |h·μ| < 1 - lam), on the "
                     "imaginary axis up to the base method's limit", fix)
        if n is None:
            return rep

        def tangent(j: int) -> Any:
            u = found.vector(j)
            if u is None:
                return None
            d = flat.tree(u)
            return (d, _map(torch.neg, d))  # the y - z direction of the spurious partner

        return confirm(rep, n, self.forward, state, tangent, i, self._confirmed())

    def solution(self, state: Any) -> Any:
        return state[0]

    def __repr__(self) -> str:
        name = getattr(self.increment, "__name__", "increment")
        return f"coupled({name}, dt={self.dt:g}, lam={self.lam:g})"


def _eps(flat: Flat) -> float:
    return float(torch.finfo(flat.dtype).eps)


def _below(top: float) -> str:
    """A coupling safely below the largest stable one ``top``: ``1 - 1.25 (1 - top)``, to
    two significant digits of ``1 - lam``."""
    gap = 1.25 * (1 - top)
    if gap <= 0:
        return f"{top:g}"
    digits = max(2, 1 - math.floor(math.log10(gap)))
    return f"{math.floor((1 - gap) * 10**digits) / 10**digits:g}"


def coupled(increment: Callable[[Any, float, float], Any], dt: float, *, lam: float = 0.999,
            t0: float = 0.0) -> Coupled:
    """Any explicit one-step method, given by its increment ``increment(y, t, h)`` (the step
    is ``y + increment(y, t, h)``; ``h`` is signed: the inverse calls it with ``-dt``),
    made reversible by the McCallum–Foster coupling with parameter ``lam`` (module
    docstring). The state is ``(y, z)``: ``init(y0)`` builds it."""
    return Coupled(increment, dt, lam, t0)


def explicit(f: Callable[[float, Any], Any], dt: float, *, method: str | Tableau = "rk4",
             lam: float = 0.999, t0: float = 0.0) -> Coupled:
    """The explicit Runge–Kutta ``method`` (:data:`TABLEAUS` or a :class:`Tableau`) for
    ``y' = f(t, y)`` made reversible by the McCallum–Foster coupling (:func:`coupled`)."""
    return Coupled(rk_increment(f, method), dt, lam, t0, field=(f, _tableau(method)))


class Leapfrog(ReversibleStep):
    """Kick-drift-kick for ``q'' = accel(q, t)``, state ``(q, v)``::

        v' = v + h/2 a(q, t_i);  q_{i+1} = q + h v';  v_{i+1} = v' + h/2 a(q_{i+1}, t_{i+1})

    and the inverse, the same three updates undone in reverse order."""

    def __init__(self, accel: Callable[[Any, float], Any], dt: float, t0: float = 0.0):
        if not callable(accel):
            raise TypeError(f"leapfrog: accel must be callable as accel(q, t), got "
                            f"{type(accel).__name__}")
        self.accel = accel
        self.dt = _step_size(dt)
        self.t0 = float(t0)

    def forward(self, state: Any, i: int) -> Any:
        q, v = state
        h = self.dt
        t = self.t0 + i * h
        vh = _map(lambda a, g: a + 0.5 * h * g, v, self.accel(q, t))
        q1 = _map(lambda a, b: a + h * b, q, vh)
        return (q1, _map(lambda a, g: a + 0.5 * h * g, vh, self.accel(q1, t + h)))

    def inverse(self, state: Any, i: int) -> Any:
        q1, v1 = state
        h = self.dt
        t = self.t0 + i * h
        vh = _map(lambda a, g: a - 0.5 * h * g, v1, self.accel(q1, t + h))
        q = _map(lambda a, b: a - h * b, q1, vh)
        return (q, _map(lambda a, g: a - 0.5 * h * g, vh, self.accel(q, t)))

    def stability(self, state: Any, i: int = 0, n: int | None = None) -> Stability:
        """Per mode ``w2 = h^2 kappa`` (``kappa`` an eigenvalue of ``da/dq`` at ``q``) the
        2 x 2 matrix of :func:`deepsolve.stability.leapfrog_matrix` against the exact
        ``e^{sqrt(w2)}``: stable for ``h omega <= 2``. With ``n``, a predicted instability
        is measured along the trajectory (:func:`deepsolve.stability.confirm`)."""
        q, _ = state
        h, t = self.dt, self.time(i)
        flat = Flat(q)
        with isolated(state):
            found = ritz(jvp(lambda u: self.accel(u, t), q, flat), flat)
        w2 = np.append(h * h * found.values, 0)

        def rates(w2_):
            r, s_ = amplification(leapfrog_matrix(w2_))
            root = np.sqrt(w2_.astype(complex))
            with np.errstate(over="ignore"):
                exact = np.maximum(np.abs(np.exp(root)), np.abs(np.exp(-root)))
            return r, s_, exact

        rho, sigma, allowed = rates(w2)

        def fix() -> str:
            def ok(s_: float) -> bool:
                r, _, ex = rates(s_ * s_ * w2)
                return bool(np.all(r <= np.maximum(ex, 1.0) * (1 + 1e-12)))
            s_ = largest(ok, 1.0)
            dt = f"dt <= {0.9 * s_ * abs(h):.2g}" if s_ is not None else "a smaller dt"
            return f"use {dt}"

        labels = [f"h·ω = {math.sqrt(-x.real):.3g}" if x.real < 0 and
                  abs(x.imag) <= 1e-9 * abs(x) else fmt_mode(x, "h²·κ") for x in w2]
        rep = report(repr(self), labels, rho, allowed, sigma, np.abs(w2) ** 2 / 24,
                     _eps(flat), "leapfrog is stable for h·ω <= 2", fix)
        if n is None:
            return rep

        def tangent(j: int) -> Any:
            u = found.vector(j)
            return None if u is None else (flat.tree(u), _map(torch.zeros_like, state[1]))

        return confirm(rep, n, self.forward, state, tangent, i, self._confirmed())

    def __repr__(self) -> str:
        return f"leapfrog(dt={self.dt:g})"


def leapfrog(accel: Callable[[Any, float], Any], dt: float, *, t0: float = 0.0) -> Leapfrog:
    """Leapfrog (velocity Verlet) for ``q'' = accel(q, t)`` with state ``(q, v)``."""
    return Leapfrog(accel, dt, t0)


class ReversibleHeun(ReversibleStep):
    """The reversible Heun method for ``y' = f(t, y)``, state ``(y, y^, f^)`` with
    ``f^ = f(t, y^)``::

        y^_{i+1} = 2 y_i - y^_i + h f^_i,   f^_{i+1} = f(t_{i+1}, y^_{i+1}),
        y_{i+1} = y_i + h/2 (f^_i + f^_{i+1});

    inverse: ``y^_i = 2 y_{i+1} - y^_{i+1} - h f^_{i+1}``, ``f^_i = f(t_i, y^_i)``,
    ``y_i = y_{i+1} - h/2 (f^_i + f^_{i+1})``."""

    def __init__(self, f: Callable[[float, Any], Any], dt: float, t0: float = 0.0):
        if not callable(f):
            raise TypeError(f"reversible_heun: f must be callable as f(t, y), got "
                            f"{type(f).__name__}")
        self.f = f
        self.dt = _step_size(dt)
        self.t0 = float(t0)

    def forward(self, state: Any, i: int) -> Any:
        y, yh, fh = state
        h = self.dt
        t1 = self.t0 + (i + 1) * h
        yh1 = _map(lambda a, b, g: 2 * a - b + h * g, y, yh, fh)
        fh1 = self.f(t1, yh1)
        return (_map(lambda a, g0, g1: a + 0.5 * h * (g0 + g1), y, fh, fh1), yh1, fh1)

    def inverse(self, state: Any, i: int) -> Any:
        y1, yh1, fh1 = state
        h = self.dt
        t = self.t0 + i * h
        yh = _map(lambda a, b, g: 2 * a - b - h * g, y1, yh1, fh1)
        fh = self.f(t, yh)
        return (_map(lambda a, g0, g1: a - 0.5 * h * (g0 + g1), y1, fh, fh1), yh, fh)

    def init(self, y0: Any) -> tuple[Any, Any, Any]:
        """``(y0, y0, f(t0, y0))``."""
        return (y0, _map(torch.clone, y0), self.f(self.t0, y0))

    def stability(self, state: Any, i: int = 0, n: int | None = None) -> Stability:
        """Per mode ``w = h mu`` (``mu`` an eigenvalue of ``df/dy`` at ``y^``) the 2 x 2
        matrix of :func:`deepsolve.stability.heun_matrix` against ``e^w``: stable on the
        imaginary segment ``|w| <= 1`` only. With ``n``, a predicted instability is
        measured along the trajectory (:func:`deepsolve.stability.confirm`)."""
        y, yh, fh = state
        h, t = self.dt, self.time(i)
        flat = Flat(yh)
        with isolated(state):
            found = ritz(jvp(lambda u: self.f(t, u), yh, flat), flat)
        w = np.append(h * found.values, 0)
        rho, sigma = amplification(heun_matrix(w))
        with np.errstate(over="ignore"):
            allowed = np.abs(np.exp(w))

        def fix() -> str:
            tab = TABLEAUS["heun"]
            a = rk_stability_function(tab.a, tab.b, w) - 1
            b = rk_stability_function(tab.a, tab.b, -w) - 1
            ref = np.maximum(np.maximum(allowed, np.abs(1 + a)), 1.0)

            def grows(lam_: float) -> bool:
                r, _ = amplification(coupled_matrix(a, b, lam_))
                return bool(np.all(r <= ref * (1 + 1e-12)))

            top = largest(grows, 0.999)
            coupled = (f"deepsolve.reversible.explicit(f, dt, method='heun', "
                       f"lam={_below(top)}) or " if top is not None else "")
            return (f"a smaller dt does not help (the growth over a fixed time stays); use "
                    f"{coupled}the plain method (not reversible) with Revolve(s) or budget=")

        rep = report(repr(self), [fmt_mode(x) for x in w], rho, allowed, sigma,
                     np.abs(w) ** 3 / 6, _eps(flat),
                     "reversible Heun is stable on the imaginary segment |h·μ| <= 1 only: "
                     "every decaying mode has a growing partner", fix)
        if n is None:
            return rep

        def tangent(j: int) -> Any:
            u = found.vector(j)
            if u is None:
                return None
            return (_map(torch.zeros_like, y), flat.tree(u), _map(torch.zeros_like, fh))

        return confirm(rep, n, self.forward, state, tangent, i, self._confirmed())

    def solution(self, state: Any) -> Any:
        return state[0]

    def __repr__(self) -> str:
        return f"reversible_heun(dt={self.dt:g})"


def reversible_heun(f: Callable[[float, Any], Any], dt: float, *,
                    t0: float = 0.0) -> ReversibleHeun:
    """The reversible Heun method for ``y' = f(t, y)`` (state ``(y, y^, f^)``)."""
    return ReversibleHeun(f, dt, t0)
