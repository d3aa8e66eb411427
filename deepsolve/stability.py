"""Linear stability of a time stepper at the state at hand: the modes it amplifies that the
solution does not.

A scheme used outside its stability region gives a wrong answer as surely as a wrong adjoint,
and a reversible scheme has a region of its own. Linearise one step about the state ``x``:
for ``y' = f(t, y)`` the modes are the eigenvalues ``mu`` of the Jacobian ``J = df/dy`` and
``w = h mu`` their step-size products; a one-step method maps a mode by a small matrix
``M(w)`` (its *amplification matrix*: 1 x 1 for Runge–Kutta, 2 x 2 for the schemes below),
while the exact flow multiplies it by ``e^w``. The scheme is stable for the step at hand when
no mode grows faster than the solution does:

    excess = max_modes  rho(M(w)) / max(1, |e^w|)   (rho: spectral radius)

and an unroll of ``n`` steps amplifies a spurious mode by ``excess^n``. What it amplifies is
small — rounding, or the scheme's own per-step error in that direction — so
:class:`Stability` calls the scheme unstable for ``n`` steps when a mode grown from its seed
reaches ``sqrt(eps)`` of the solution (half the digits lost). The inverse
of a reversible step maps a mode by ``M(w)^-1``: rounding grows by ``gamma = max 1/|eig M|``
per inverse step, which bounds the window a reversible schedule may rebuild
(:meth:`Stability.window`).

The schemes of :mod:`deepsolve.reversible`, per mode:

* McCallum–Foster coupling of a base method with increment ``Phi_h`` (``a = R(w) - 1``,
  ``b = R(-w) - 1``, ``R`` the base method's stability function), state ``(y, z)``::

      M = [[lam, 1 - lam + a], [-b lam, 1 - b (1 - lam + a)]],   det M = lam;

  its eigenvalues are close to ``R(w)`` and ``lam / R(w)``: a decaying mode (``R(w) < 1``)
  has a partner growing like ``lam / R(w)``, so on the negative real axis the coupling is
  stable only while ``R(w) >= lam`` — roughly ``|w| < 1 - lam`` — and on the imaginary axis up
  to about the base method's own limit. It suits oscillatory, advective and Hamiltonian
  steps, not diffusive or stiff ones (McCallum & Foster, arXiv:2410.11648, 2024).
* Reversible Heun, state ``(y, y^)``: ``M = [[1 + w, w^2 / 2], [2, w - 1]]``, ``det M = -1``:
  stable on the imaginary segment ``|w| <= 1`` only (Kidger et al., NeurIPS 2021): any
  decaying mode has a growing partner, whatever ``h``.
* Leapfrog for ``q'' = a(q)`` with ``K = da/dq``, ``w2 = h^2 kappa`` (``kappa`` an eigenvalue of
  ``K``), in ``(q, h v)``: ``M = [[1 + w2/2, 1], [w2 (1 + w2/4), 1 + w2/2]]``, ``det M = 1``:
  stable for ``-4 <= w2 <= 0`` (``h omega <= 2``); the exact flow grows like
  ``e^{sqrt(w2)}``.

The modes come from a Krylov space of the Jacobian: ``m`` steps of Arnoldi's method (with
re-orthogonalisation) on Jacobian–vector products (central differences: two evaluations
of the field each) from a seeded random vector, whose
Ritz values approximate the outer part of the spectrum — the modes that limit stability —
plus the mode ``w = 0`` (the ``y - z`` difference of a coupled state). For the coupling of a
base method given only by its increment, the Ritz pairs of ``A = dPhi_h/dy`` give ``a`` and the
Rayleigh quotients of ``B = dPhi_{-h}/dy`` on the same Ritz vectors give ``b``, and the base
method's ``|1 + a|`` stands in for ``|e^w|``. The analysis costs ``m`` (``2 m`` for a bare
increment) Jacobian–vector products and ``m + 1`` state-sized vectors, draws from no global
generator, and is exact for a linear step with a normal Jacobian (diffusion, advection);
for a nonlinear step it is the linearisation at the state given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

__all__ = ["Stability", "StabilityError", "KRYLOV_STEPS", "CONFIRM_STEPS", "ritz", "Ritz",
           "window", "growth_along", "confirm",
           "rk_stability_function", "coupled_matrix", "heun_matrix", "leapfrog_matrix",
           "amplification"]

KRYLOV_STEPS = 12
"""Arnoldi steps of the stability analysis (Jacobian–vector products per operator)."""

_DRIFT_SAFETY = 10.0  # rounding per inverse step, in units of eps, assumed by window()
_AMPLIFIED = 10.0  # a mode's error over a stable scheme's beyond which it counts


class StabilityError(ValueError):
    """A time stepper is used outside its stability region for the step at hand (one line:
    the mode, its growth, and what to change)."""


# -- per-mode amplification matrices ------------------------------------------------------


def rk_stability_function(a: Sequence[Sequence[float]], b: Sequence[float],
                          w: np.ndarray) -> np.ndarray:
    """``R(w) = 1 + w b^T (I - w A)^-1 1`` of an explicit Runge–Kutta tableau ``(a, b)``
    (``a`` strictly lower triangular) at the complex points ``w``."""
    w = np.asarray(w, dtype=complex)
    stages: list[np.ndarray] = []
    for s in range(len(b)):
        k = np.ones_like(w)
        for j in range(s):
            if a[s][j] != 0:
                k = k + w * a[s][j] * stages[j]
        stages.append(k)
    return 1 + w * sum(bs * k for bs, k in zip(b, stages, strict=True))


def coupled_matrix(a: np.ndarray, b: np.ndarray, lam: float) -> np.ndarray:
    """The McCallum–Foster coupling's amplification matrices, shape ``(..., 2, 2)``, for the
    base increments ``a = R(w) - 1`` (forward) and ``b = R(-w) - 1`` (backward)."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=complex), np.asarray(b, dtype=complex))
    c = 1 - lam + a
    return np.stack([np.stack([np.full_like(a, lam), c], -1),
                     np.stack([-b * lam, 1 - b * c], -1)], -2)


def heun_matrix(w: np.ndarray) -> np.ndarray:
    """Reversible Heun's amplification matrices on ``(y, y^)``, shape ``(..., 2, 2)``."""
    w = np.asarray(w, dtype=complex)
    return np.stack([np.stack([1 + w, w * w / 2], -1),
                     np.stack([np.full_like(w, 2), w - 1], -1)], -2)


def leapfrog_matrix(w2: np.ndarray) -> np.ndarray:
    """Leapfrog's amplification matrices on ``(q, h v)`` for ``w2 = h^2 kappa``."""
    w2 = np.asarray(w2, dtype=complex)
    d = 1 + w2 / 2
    return np.stack([np.stack([d, np.ones_like(w2)], -1),
                     np.stack([w2 * (1 + w2 / 4), d], -1)], -2)


def amplification(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rho, sigma)`` of 2 x 2 matrices ``(..., 2, 2)``: the largest and the smallest
    eigenvalue modulus (the growth of the step and ``1 / `` that of its inverse)."""
    tr = m[..., 0, 0] + m[..., 1, 1]
    det = m[..., 0, 0] * m[..., 1, 1] - m[..., 0, 1] * m[..., 1, 0]
    root = np.sqrt(tr * tr - 4 * det + 0j)
    e1, e2 = np.abs((tr + root) / 2), np.abs((tr - root) / 2)
    return np.maximum(e1, e2), np.minimum(e1, e2)


# -- the report ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stability:
    """The linear stability of one stepper at one state (see the module docstring).

    A mode ``j`` that grows by ``g_j > 1`` per step beyond the solution is fed at every
    step by what the step puts into it — rounding, ``eps``, or the scheme's own per-step
    error in that direction (for the coupling ``|R(w) R(-w) - 1|``: ``y`` and ``z`` step the
    same solution forward and back) — its *seed* ``s_j``; after ``n`` steps it holds about
    ``E_j = s_j (g_j^n - 1) / (g_j - 1)`` of the solution, where a stable scheme would hold
    ``s_j n``. The scheme is unstable for ``n`` steps when some mode is both large —
    ``E_j > tolerance`` (``sqrt(eps)``, half the digits: the drift tolerance of the
    reversible schedule too) — and amplified — ``E_j > 10 s_j n``, ten times a stable
    scheme's error.

    Attributes:
        scheme: the stepper, as its ``repr``.
        excess: the largest growth per step of a mode beyond the solution's,
            ``max rho(M) / max(1, |e^w|)`` (1: no spurious growth).
        worst: where it is, in words (``"h·μ = -0.0328"``).
        inverse_growth: the largest growth per step of rounding under the inverse,
            ``max 1 / |eig M|``.
        modes: the modes examined (Ritz values and ``w = 0``).
        region: the scheme's stability region, in words, for messages.
        fix: what makes it stable (a coupling, a step size, another method), worked out by
            ``fix_of`` when first read (bisections over the modes: only a message needs it).
        growing: ``(g_j, s_j, where, j, allowed_j)`` of every mode with ``g_j > 1``
            (``allowed_j``: the solution's own growth there).
        eps, tolerance: the state's machine epsilon and ``sqrt(eps)``.
        trajectory: per-step growths of the worst mode's direction measured along the
            trajectory (:func:`confirm`; empty: the linearisation at the state only),
            relative to the solution's growth there.
        blowup: the step at which that trajectory stopped being finite (0: it did not).
        predicted: the growth the linearisation at the state predicted for that mode.
    """

    scheme: str
    excess: float
    worst: str
    inverse_growth: float
    modes: int
    region: str = ""
    fix_of: Callable[[], str] | None = dataclasses.field(default=None, repr=False,
                                                         compare=False)
    growing: tuple[tuple[float, float, str, int, float], ...] = ()
    eps: float = float(np.finfo(np.float64).eps)
    trajectory: tuple[float, ...] = ()
    blowup: int = 0
    predicted: float = 1.0

    @property
    def fix(self) -> str:
        if self.fix_of is None or self.excess <= 1:
            return ""
        done = self.__dict__.get("_fix")
        if done is None:
            done = self.fix_of()
            object.__setattr__(self, "_fix", done)  # computed once, for messages
        return done

    @property
    def tolerance(self) -> float:
        return math.sqrt(self.eps)

    def error(self, n: int) -> tuple[float, float, str]:
        """``(E_j, E_j / (s_j n), where)`` of the mode ``j`` that is largest after ``n``
        steps among those amplified beyond a stable scheme's error; ``(0, 1, "")`` when
        none is (``inf`` on overflow). With a measured :attr:`trajectory` the error is
        accumulated step by step, ``e_{k+1} = gamma_k e_k + s`` (beyond the measured steps
        at the mean growth of their second half)."""
        if self.blowup and self.blowup <= n:
            return math.inf, math.inf, self.worst
        if self.trajectory:
            if not self.growing:
                return 0.0, 1.0, ""
            _, seed, at, _, _ = self.growing[0]
            total = _accumulate(self.trajectory, n)
            ratio = total / n
            return (seed * total, ratio, at) if ratio > _AMPLIFIED else (0.0, 1.0, "")
        worst = (0.0, 1.0, "")
        for g, seed, at, _, _ in self.growing:
            e = n * math.log(g)
            total = math.expm1(e) / (g - 1) if e < 700 else math.inf  # sum of g^k, k < n
            ratio = total / n
            value = seed * total
            if ratio > _AMPLIFIED and value > worst[0]:
                worst = (value, ratio, at)
        return worst

    def amplification(self, n: int) -> float:
        """The largest spurious amplification over ``n`` steps, ``excess ** n``."""
        if self.excess <= 1.0:
            return 1.0
        e = n * math.log(self.excess)
        return math.exp(e) if e < 700 else math.inf

    def stable(self, n: int) -> bool:
        """Whether no mode amplified beyond a stable scheme's error reaches
        :attr:`tolerance` in ``n`` steps."""
        return self.error(n)[0] <= self.tolerance

    def window(self, tolerance: float, eps: float) -> int:
        """The longest window a reversible schedule may rebuild by the inverse within
        ``tolerance`` (:func:`window`)."""
        return window(self.inverse_growth, tolerance, eps)

    def explain(self) -> str:
        """Several lines: the growths, where, the region and the fix."""
        lines = [f"{self.scheme}: {self.modes} modes examined",
                 f"  largest growth beyond the solution: {self.excess:.6g} per step "
                 f"(at {self.worst})",
                 f"  inverse: rounding grows by up to {self.inverse_growth:.6g} per step"]
        if self.region:
            lines.append(f"  stability region: {self.region}")
        if self.excess > 1 and self.fix:
            lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)

    def check(self, n: int, who: str = "unroll") -> None:
        """Raise :class:`StabilityError` (one line) when ``n`` steps are unstable."""
        if self.blowup and self.blowup <= n:
            raise StabilityError(
                f"{who}: {self.scheme} is unstable for this step: the forward sweep from this "
                f"state stops being finite (NaN or inf) at step {self.blowup - 1} (the "
                f"linearisation at the start predicted a mode at {self.worst} growing by "
                f"{self.predicted:.4g} per step more than the solution); {self.region}; "
                f"{self.fix} (docs/reversible.md, 'Stability')")
        err, ratio, where = self.error(n)
        if err <= self.tolerance:
            return
        growth = next(e[0] for e in self.growing if e[2] == where)
        size = "beyond float range" if not math.isfinite(err) else f"{err:.2g}"
        times = "beyond float range" if not math.isfinite(ratio) else f"{ratio:.2g}x"
        raise StabilityError(
            f"{who}: {self.scheme} is unstable for this step: a mode at {where} grows by "
            f"{growth:.4g} per step more than the solution; over {n} steps it amplifies the "
            f"step's rounding and truncation {times} beyond a stable scheme's, to {size} of "
            f"the solution (limit {self.tolerance:.2g}); {self.region}; {self.fix} "
            "(docs/reversible.md, 'Stability')")


def window(growth: float, tolerance: float, eps: float) -> int:
    """The longest window ``k`` of steps an inverse whose rounding grows by ``growth`` per
    step rebuilds with a drift below ``tolerance``: rounding of about ``10 eps`` per step,
    ``10 eps (growth^k - 1) / (growth - 1) <= tolerance`` (``2**31 - 1`` at most)."""
    room = tolerance / (_DRIFT_SAFETY * eps)
    if room < 1 or not math.isfinite(growth):
        return 0
    if growth <= 1 + 1e-12:
        return int(min(room, 2**31 - 1))
    k = math.log1p(room * (growth - 1)) / math.log(growth)
    return int(min(k, 2**31 - 1))


def report(scheme: str, labels: Sequence[str], rho: np.ndarray, allowed: np.ndarray,
           sigma: np.ndarray, seed: np.ndarray, eps: float, region: str,
           fix: Callable[[], str]) -> Stability:
    """The :class:`Stability` of per-mode growths ``rho`` against ``allowed`` (the
    solution's growth, at least 1), smallest eigenvalue moduli ``sigma`` and per-step
    seeds (each at least ``eps``); ``fix`` is called only when a message needs it."""
    ratio = rho / np.maximum(allowed, 1.0)
    ratio = np.where(np.isfinite(ratio), ratio, np.inf)
    ratio = np.where(ratio <= 1 + 1e-12, np.minimum(ratio, 1.0), ratio)  # rounding
    j = int(np.argmax(ratio))
    excess = float(ratio[j])
    with np.errstate(divide="ignore"):
        inv = np.where(sigma > 0, 1.0 / sigma, np.inf)
    seeds = np.maximum(np.nan_to_num(np.abs(seed), nan=1.0, posinf=1.0), eps)
    floor = np.maximum(allowed, 1.0)
    growing = tuple((float(ratio[k]), float(seeds[k]), labels[k], k, float(floor[k]))
                    for k in range(len(labels)) if ratio[k] > 1)
    return Stability(scheme, excess, labels[j], float(np.max(inv)), len(labels), region,
                     fix_of=fix, growing=growing, eps=eps)


def largest(stable: Callable[[float], bool], hi: float, lo: float = 0.0,
            iters: int = 40) -> float | None:
    """The largest ``x`` in ``(lo, hi]`` with ``stable(x)`` (assumed monotone: stable below
    some point), by bisection; ``None`` when even ``x`` near ``lo`` is not."""
    if stable(hi):
        return hi
    a, b = lo, hi
    found = None
    for _ in range(iters):
        mid = (a + b) / 2
        if stable(mid):
            a = found = mid
        else:
            b = mid
    return found


def fmt_mode(w: complex, name: str = "h·μ") -> str:
    """``"h·μ = -0.0328"`` or ``"h·μ = -0.01 + 0.5i"``."""
    if abs(w.imag) <= 1e-9 * max(abs(w), 1e-300):
        return f"{name} = {w.real:.3g}"
    if abs(w.real) <= 1e-9 * abs(w):
        return f"{name} = {w.imag:.3g}i"
    sign = "+" if w.imag >= 0 else "-"
    return f"{name} = {w.real:.3g} {sign} {abs(w.imag):.3g}i"


# -- Krylov estimates of a Jacobian's spectrum --------------------------------------------


@contextlib.contextmanager
def isolated(state: Any) -> Iterator[None]:
    """No graph recorded and the global generators left as they were (the analysis must not
    move the random stream an unroll replays)."""
    devices = sorted({t.device.index or 0 for t in pytree.tree_leaves(state)
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        yield


class Flat:
    """A state's floating leaves as one real vector (complex leaves as pairs of reals);
    other leaves are held as they are."""

    def __init__(self, state: Any):
        leaves, self.spec = pytree.tree_flatten(state)
        self.leaves = leaves
        self.idx = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)
                    and (t.is_floating_point() or t.is_complex())]
        if not self.idx:
            raise TypeError("stability: the state has no floating-point tensor to analyse")
        self.sizes = [self._real(leaves[k]).numel() for k in self.idx]
        first = leaves[self.idx[0]]
        dtype = self._real(first).dtype
        for k in self.idx:
            dtype = torch.promote_types(dtype, self._real(leaves[k]).dtype)
        self.dtype = dtype
        self.device = first.device

    @staticmethod
    def _real(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(t) if t.is_complex() else t

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def flat(self, tree: Any) -> torch.Tensor:
        """The floating leaves of ``tree`` (this structure) as one vector."""
        leaves = pytree.tree_leaves(tree)
        return torch.cat([self._real(leaves[k]).reshape(-1).to(self.dtype) for k in self.idx])

    def tree(self, vec: torch.Tensor) -> Any:
        """The state whose floating leaves are ``vec`` (the others as given)."""
        leaves = list(self.leaves)
        off = 0
        for k, n in zip(self.idx, self.sizes, strict=True):
            proto = self.leaves[k]
            part = vec[off:off + n]
            off += n
            if proto.is_complex():
                real = part.reshape(*proto.shape, 2).to(self._real(proto).dtype)
                leaves[k] = torch.view_as_complex(real.contiguous())
            else:
                leaves[k] = part.reshape(proto.shape).to(proto.dtype)
        return pytree.tree_unflatten(leaves, self.spec)


def _scale(x: torch.Tensor) -> float:
    """The size of a state for a difference step: its largest entry (1 for a zero state)."""
    top = float(x.abs().max()) if x.numel() else 0.0
    return top if top > 0 and math.isfinite(top) else 1.0


def jvp(fn: Callable[[Any], Any], x: Any, flat: Flat) -> Callable[[torch.Tensor], torch.Tensor]:
    """``v -> J v`` (flat vectors) of ``fn`` (a map from states of ``flat``'s structure to
    states of the same structure) at the state ``x``, by central differences
    ``(fn(x + e v) - fn(x - e v)) / 2e`` with ``e |v| = eps^(1/3) max|x|``: two evaluations of
    ``fn``, any operation (forward-mode AD costs 10 to 300 evaluations' time per product
    here, through its dual tensors), an error of about ``eps^(2/3)`` relative (5e-11 in
    float64, 2e-5 in float32) — ample for a stability region."""
    xf = flat.flat(x)
    e0 = torch.finfo(flat.dtype).eps ** (1 / 3) * _scale(xf)

    def g(vec: torch.Tensor) -> torch.Tensor:
        return flat.flat(fn(flat.tree(vec)))

    def apply(v: torch.Tensor) -> torch.Tensor:
        nv = float(v.norm())
        if nv == 0:
            return torch.zeros_like(v)
        e = e0 / nv
        return (g(xf + e * v) - g(xf - e * v)) / (2 * e)

    return apply


@dataclass
class Ritz:
    """Ritz values of an operator from an Arnoldi basis: ``values``; ``quotients`` of a second
    operator on the Ritz vectors (or ``None``); :meth:`vector` gives Ritz vector ``j``."""

    values: np.ndarray
    quotients: np.ndarray | None
    basis: list[torch.Tensor]
    coefficients: np.ndarray

    def vector(self, j: int) -> torch.Tensor | None:
        """The real part of Ritz vector ``j`` (its imaginary part when that is larger),
        normalised; ``None`` for an index beyond the Ritz values (an added mode)."""
        if not 0 <= j < len(self.values):
            return None
        y = self.coefficients[:, j]
        part = y.real if np.linalg.norm(y.real) >= np.linalg.norm(y.imag) else y.imag
        v = sum(float(c) * b for c, b in zip(part, self.basis, strict=False))
        assert isinstance(v, torch.Tensor)  # at least one basis vector
        return v / v.norm()


def ritz(matvec: Callable[[torch.Tensor], torch.Tensor], flat: Flat, m: int = KRYLOV_STEPS,
         seed: int = 0, also: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Ritz:
    """Ritz values of the operator ``matvec`` (flat vectors) after ``m`` Arnoldi steps (with
    re-orthogonalisation) from a seeded random vector; with ``also`` (a second operator that
    commutes with the first, as ``dPhi_{-h}/dy`` with ``dPhi_h/dy``), also its Rayleigh
    quotients on the Ritz vectors."""
    n = flat.size
    m = max(1, min(m, n))
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    v = torch.randn(n, generator=gen, dtype=flat.dtype, device=flat.device)
    basis = [v / v.norm()]
    H = np.zeros((m + 1, m))
    top = 0.0
    for j in range(m):
        w = matvec(basis[j])
        if not bool(torch.isfinite(w).all()):
            raise StabilityError("stability: the step's Jacobian-vector product is not finite "
                                 "at this state (NaN or inf); check the step and the state")
        for _ in range(2):  # classical Gram–Schmidt, twice
            for i in range(j + 1):
                hij = float(torch.dot(basis[i], w))
                H[i, j] += hij
                w = w - hij * basis[i]
        h = float(w.norm())
        H[j + 1, j] = h
        top = max(top, float(np.abs(H[:j + 2, j]).max()))
        if h <= 1e-10 * max(top, 1e-300) or j == m - 1:
            m = j + 1
            break
        basis.append(w / h)
    basis = basis[:m]
    vals, vecs = np.linalg.eig(H[:m, :m])
    quot = None
    if also is not None:
        HB = np.zeros((m, m))
        for j in range(m):
            bv = also(basis[j])
            for i in range(m):
                HB[i, j] = float(torch.dot(basis[i], bv))
        quot = np.array([(vecs[:, k].conj() @ HB @ vecs[:, k]) /
                         (vecs[:, k].conj() @ vecs[:, k]) for k in range(m)])
    return Ritz(vals, quot, basis, vecs)


# -- the growth along the trajectory ------------------------------------------------------


CONFIRM_STEPS = 4096
"""The most steps along the trajectory :func:`confirm` follows (each costs two step
evaluations, and only where the linearisation at the start predicts instability)."""


def growth_along(step: Callable[[Any, int], Any], state: Any, tangent: Any, m: int,
                 i0: int = 0, stop: Callable[[list[float]], bool] | None = None
                 ) -> list[float]:
    """The growth per step of a perturbation ``tangent`` of ``state`` under the step's
    linearisation along its own trajectory: ``m`` steps of ``(x, d) -> (step(x, i),
    J_i(x) d)`` with ``d`` renormalised each step (it turns towards the fastest-growing
    direction, as in power iteration; ``J_i d`` by a one-sided difference from the
    trajectory's own step); the list of ``|J_i d_i|``, ending with ``inf`` where
    the trajectory or the perturbation stops being finite, or early where ``stop(list)``
    (asked every 16 steps) is true."""
    flat = Flat(state)
    x = flat.flat(state)
    d = flat.flat(tangent)
    nd = float(d.norm())
    if nd == 0 or not math.isfinite(nd):
        return []
    d = d / nd
    eps = torch.finfo(flat.dtype).eps ** 0.5
    out: list[float] = []
    for k in range(m):
        i = i0 + k
        nxt = flat.flat(step(flat.tree(x), i))
        if not bool(torch.isfinite(nxt).all()):
            out.append(math.inf)
            return out
        e = eps * _scale(x)  # one-sided: the trajectory's own step is the base point
        d = (flat.flat(step(flat.tree(x + e * d), i)) - nxt) / e
        x = nxt
        nd = float(d.norm())
        if not math.isfinite(nd):
            out.append(math.inf)
            return out
        out.append(nd)
        if nd == 0 or (stop is not None and not (k + 1) % 16 and stop(out)):
            return out
        d = d / nd
    return out


def _accumulate(growths: Sequence[float], n: int) -> float:
    """``e_n`` of ``e_{k+1} = gamma_k e_k + 1``, ``e_0 = 0``, over ``n`` steps: the measured
    ``gamma_k`` first, then their second half's geometric mean (``inf`` on overflow)."""
    e = 0.0
    for g in growths[:n]:
        e = g * e + 1.0
        if not math.isfinite(e) or e > 1e300:
            return math.inf
    left = n - len(growths)
    if left <= 0:
        return e
    tail = [g for g in growths[len(growths) // 2:] if g > 0]
    if not tail or not all(math.isfinite(g) for g in tail):
        return math.inf if tail else e + left
    g = math.exp(sum(math.log(t) for t in tail) / len(tail))
    if abs(g - 1) < 1e-12:
        return e + left
    lg = left * math.log(g)
    if lg > 690:
        return math.inf
    gl = math.exp(lg)
    return e * gl + (gl - 1) / (g - 1)


def confirm(rep: Stability, n: int, step: Callable[[Any, int], Any], state: Any,
            tangent_of: Callable[[int], Any], i0: int = 0,
            cache: dict | None = None) -> Stability:
    """A prediction of instability over ``n`` steps checked along the trajectory: the
    linearisation at ``state`` may not hold for long (a nonlinear step whose Jacobian
    changes as the state moves), so the growth of the worst mode's direction
    (``tangent_of(j)``, a tangent of the step's state, or ``None``) is measured step by
    step over the first ``min(n, CONFIRM_STEPS)`` steps (:func:`growth_along`, two step
    evaluations each), and the report's error accumulates those growths
    (:meth:`Stability.error`); the measurement stops as soon as the error is past the
    tolerance. ``rep`` itself when it predicts no instability.

    ``cache`` (a dict the stepper keeps): a trajectory measured stable for these ``n`` steps
    stands for later calls whose prediction is within 10 % of its growth (a training loop
    whose parameters move slowly pays the measurement once, not at every unroll); a
    prediction outside that is measured again."""
    err, _, where = rep.error(n)
    if err <= rep.tolerance:
        return rep
    key = (n, i0, rep.scheme)
    if cache is not None:
        seen = cache.get(key)
        if seen is not None and abs(rep.excess - seen[0]) <= 0.1 * (seen[0] - 1):
            return dataclasses.replace(seen[1], region=rep.region, fix_of=rep.fix_of)
    entry = next(e for e in rep.growing if e[2] == where)
    g, _, _, j, allowed = entry
    tangent = tangent_of(j)
    if tangent is None:
        return rep
    m = min(n, CONFIRM_STEPS)
    floor = max(allowed, 1.0)
    seed = max(e[1] for e in rep.growing)

    def past(measured: list[float]) -> bool:  # unstable already at this step
        k = len(measured)
        e = _accumulate([x / floor for x in measured], k)
        return seed * e > rep.tolerance and e > _AMPLIFIED * k

    with isolated(state):
        measured = growth_along(step, state, tangent, m, i0, past)
    if not measured:
        return rep
    ratios = tuple(x / floor for x in measured)
    finite_part = [r for r in ratios if math.isfinite(r) and r > 0]
    mean = math.exp(sum(math.log(r) for r in finite_part) / len(finite_part)) \
        if finite_part else math.inf
    if not all(math.isfinite(r) for r in ratios):
        mean = math.inf
    blowup = len(measured) if not math.isfinite(measured[-1]) else 0
    label = where if blowup else f"{where} (measured along the first {len(measured)} steps)"
    found = dataclasses.replace(rep, excess=max(mean, 1.0), worst=label,
                                growing=((mean, seed, label, j, allowed),), trajectory=ratios,
                                blowup=blowup, predicted=g)
    if cache is not None and found.stable(n):
        cache[key] = (rep.excess, found)
    return found
