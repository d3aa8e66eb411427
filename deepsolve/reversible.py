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
  in ``(0, 1]``: smaller is more stable forward (the ``y - z`` difference decays like
  ``lam^i``), larger more stable backward (the inverse amplifies rounding by about
  ``1 / lam`` per step: ``e^{n (1 - lam)}`` over ``n`` steps); 0.999 (the authors' default)
  amplifies by ``e^10 = 2.2e4`` over 10^4 steps. (McCallum & Foster, "Efficient, accurate
  and stable gradients for Neural ODEs", arXiv:2410.11648, 2024.)
* :func:`leapfrog` — kick-drift-kick (velocity Verlet) for ``q'' = a(q, t)``, state
  ``(q, v)``: symplectic, second order, its own inverse with ``-h``.
* :func:`reversible_heun` — Kidger et al.'s reversible Heun method for ``y' = f(t, y)``,
  state ``(y, y^, f(t, y^))``: one evaluation of ``f`` per step and per inverse, second
  order. ("Efficient and accurate gradients for neural SDEs", NeurIPS 2021.)
* :func:`invertible` — your own step and its inverse, as one reversible step.

Each stepper's ``init(y0)`` builds the carried state from the solution ``y0`` and
``solution(state)`` takes it back; step ``i`` runs from ``t_i = t0 + i dt`` to ``t_{i+1}``.
Solutions ``y`` may be tensors or pytrees of tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

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
                 lam: float = 0.999, t0: float = 0.0):
        if not callable(increment):
            raise TypeError(f"coupled: increment must be callable as increment(y, t, h), got "
                            f"{type(increment).__name__}")
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 < lam <= 1:
            raise ValueError(f"coupled: lam must be a number in (0, 1], got {lam!r}")
        self.increment = increment
        self.dt = _step_size(dt)
        self.lam = float(lam)
        self.t0 = float(t0)

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

    def solution(self, state: Any) -> Any:
        return state[0]

    def __repr__(self) -> str:
        name = getattr(self.increment, "__name__", "increment")
        return f"coupled({name}, dt={self.dt:g}, lam={self.lam:g})"


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
    return Coupled(rk_increment(f, method), dt, lam, t0)


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

    def solution(self, state: Any) -> Any:
        return state[0]

    def __repr__(self) -> str:
        return f"reversible_heun(dt={self.dt:g})"


def reversible_heun(f: Callable[[float, Any], Any], dt: float, *,
                    t0: float = 0.0) -> ReversibleHeun:
    """The reversible Heun method for ``y' = f(t, y)`` (state ``(y, y^, f^)``)."""
    return ReversibleHeun(f, dt, t0)
