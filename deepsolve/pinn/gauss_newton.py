r"""Gauss–Newton / Levenberg–Marquardt on the residual vector of a PINN loss.

A PINN loss is a weighted sum of mean squares,

.. math::

    L(\theta) = \sum_k \sum_c \frac{w_{k,c}}{M_k} \sum_{i=1}^{M_k} r_{k,c}(x_{k,i};
    \theta)^2 = \|\tilde r(\theta)\|^2,\qquad
    \tilde r = \big(\sqrt{w_{k,c} / M_k}\; r_{k,c}(x_{k,i}; \theta)\big)_{k,i,c},

term :math:`k` (:class:`LeastSquaresTerm`) having :math:`M_k` points and components
:math:`c` (one residual per point and component). Gauss–Newton replaces
the Hessian by :math:`2 J^\top J`, :math:`J = \partial\tilde r/\partial\theta` (``(M, P)``), and
Levenberg–Marquardt damps it: the step :math:`\delta` solves

.. math::

    (J^\top J + \mu I)\,\delta = -J^\top \tilde r .

It is accepted when the gain ratio :math:`\rho = (L(\theta) - L(\theta+\delta)) /
(L(\theta) - \|\tilde r + J\delta\|^2)` is positive; :math:`\mu` then shrinks by
:math:`\max(1/3, 1 - (2\rho - 1)^3)`, and on a rejected step it grows by :math:`\nu`
(:math:`\nu` doubling each time) and the system is solved again with the same Jacobian —
the damping is the line search (Nielsen 1999; Madsen, Nielsen & Tingleff, *Methods for
non-linear least squares problems*, DTU 2004, §3.2). :math:`\mu_0 = \tau\,\max_j (J^\top
J)_{jj}`.

* **Jacobian** — per point, by ``torch.func``: ``vmap`` over the points of ``jacrev`` of the
  residual of one point with respect to the parameters (the model's parameters are
  substituted by :func:`torch.func.functional_call`). The residual functions must therefore
  be ``torch.func``-traceable: the ``"func"`` and ``"taylor"`` derivative backends are,
  ``"autograd"`` (``torch.autograd.grad`` inside) is not.
* **Dense normal equations** (``P <= dense_max`` parameters): :math:`A = J^\top J` and
  :math:`g = J^\top\tilde r` are accumulated chunk by chunk of points, so the whole
  Jacobian is never held; a chunk has ``chunk_rows`` points, or as many as fit in
  ``budget`` bytes at ``3 P k`` values per point of ``k`` components (the Jacobian rows,
  the per-point gradients ``vmap`` builds, and the product). A Cholesky factorisation
  solves each damped system.
* **Matrix-free CG** (``P > dense_max``): the system is solved by conjugate gradients with
  products :math:`J v` (``torch.func.jvp``) and :math:`J^\top u` (``torch.func.vjp``) over
  the same chunks, at most ``cg_iters`` iterations to relative residual ``cg_tol``.

* **Sketched curvature** (``sketch``; dense path). The normal matrix comes from a random
  subset :math:`S` of the points (``sketch`` of them, or that fraction of each term's),
  drawn anew at every iteration and scaled so that :math:`\mathbb E[J_S^\top J_S] =
  J^\top J` (rows of term :math:`k` times :math:`\sqrt{M_k/m_k}`), while the gradient
  :math:`g = J^\top\tilde r` and the gain ratio use every point: the step solves
  :math:`(J_S^\top J_S + \mu I)\delta = -g`, and the loss it must lower is the true one.
  ``sketch_params`` also restricts the step to a random subset of the parameters
  (:math:`\delta = Q z`, :math:`(Q^\top J_S^\top J_S Q + \mu I) z = -Q^\top g`: the
  "doubly sketched" step, a randomised block of coordinates). The sketch adapts: an
  iteration whose accepted gain ratio is below 1/4, or that fails, doubles the sketch
  (up to every point / parameter); one above 3/4 halves it back toward the set size.
  The Jacobian then costs :math:`m / M` of the full one. (Sketched Gauss–Newton:
  Gower, Goldfarb & Richtárik, ICML 2019; Gauss–Newton with sketching and adaptive
  ratio for PINNs in the spirit of DSGNAR, 2026.)

The optimizer takes ``closure`` steps like ``torch.optim.LBFGS`` (``needs_closure``): after
its ``max_iter`` Gauss–Newton iterations it calls the closure once at the new parameters, so
the trainer logs the loss and gradient there. At its first step it checks that its objective
equals the closure's loss (``check_rtol``): terms that disagree with the trainer's loss would
minimise something else, and are refused.

References: Levenberg 1944; Marquardt 1963; Müller & Zeinhofer, *Achieving high accuracy with
PINNs via energy natural gradient descent*, ICML 2023 (Gauss–Newton in function space for
PINN losses); Jnini, Vella & Zeinhofer, arXiv 2402.10680 (2024).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch.func import functional_call, jacrev, jvp, vjp, vmap

from ..memory.budget import parse_budget
from .optim import flat_parameters, load_flat_parameters

__all__ = ["LeastSquaresTerm", "GaussNewton", "residual_jacobian", "least_squares_loss"]


class LeastSquaresTerm(NamedTuple):
    """Mean-square terms of a loss: ``sum_c weight_c * mean_i(fn(points)[i, c]**2)``.

    ``fn`` maps points ``(n, d)`` to residuals ``(n,)`` or ``(n, k)``, acts on each point
    separately, and reads the parameters of the optimizer's model (it may close over the
    model). ``weight`` is a number, or one per component ``c`` (a sequence of ``k``): a
    problem's loss terms ``w_c * mean(r_c**2)`` over the same points become one term, whose
    Jacobian rows come from one pass. Targets ride along as extra columns of ``points``."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    points: torch.Tensor
    weight: float | Sequence[float] = 1.0


def _weights(term: LeastSquaresTerm, like: torch.Tensor) -> torch.Tensor:
    w = torch.as_tensor(term.weight, dtype=like.dtype, device=like.device)
    if w.dim() > 1 or (w.dim() == 1 and (like.dim() != 2 or w.numel() != like.shape[1])):
        raise ValueError(f"LeastSquaresTerm: {w.numel()} weights for residuals of shape "
                         f"{tuple(like.shape)}; give one weight, or one per component")
    if not bool((w >= 0).all()):
        raise ValueError(f"LeastSquaresTerm: weights must be >= 0, got {term.weight}")
    return w


def least_squares_loss(terms: Sequence[LeastSquaresTerm]) -> torch.Tensor:
    """``sum_k sum_c weight_kc * mean_i(fn_k(points_k)[i, c]**2)``: the loss the terms
    define."""
    total = None
    for t in terms:
        r = t.fn(t.points)
        v = (r.pow(2).mean(0) * _weights(t, r)).sum()
        total = v if total is None else total + v
    if total is None:
        raise ValueError("least_squares_loss needs at least one term")
    return total


@contextlib.contextmanager
def _no_saved_tensor_hooks() -> Iterator[None]:
    """Suspend the active saved-tensor hooks (``torch.func``'s reverse transforms refuse to
    run under them; deepsolve's CPU memory meter installs some): popped here, pushed back in
    order afterwards. What the Jacobian holds is then not in the meter's count, but in the
    process's real peak (RSS), which the trainer logs as well."""
    stack = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
        stack.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


class _Bound(torch.nn.Module):
    """``fn`` as the forward of a module holding ``model``, so ``functional_call`` substitutes
    the model's parameters while ``fn`` runs."""

    def __init__(self, model: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _scale(term: LeastSquaresTerm) -> tuple[torch.Tensor, int]:
    """``sqrt(weight_c / n)`` (a scalar or ``(k,)``) and the components ``k`` per point."""
    if term.points.dim() != 2 or term.points.shape[0] == 0:
        raise ValueError(f"LeastSquaresTerm: points must be (n, d) with n > 0, got shape "
                         f"{tuple(term.points.shape)}")
    with torch.no_grad():
        one = term.fn(term.points[:1])
    w = _weights(term, one)
    return (w / term.points.shape[0]).sqrt(), max(int(one.numel()), 1)


class _Residuals:
    """The scaled residual vector of a list of terms as a function of a flat parameter
    vector, by chunks of points."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                 terms: Sequence[LeastSquaresTerm]):
        # in the order of ``params``: the flat vector's layout (flat_parameters(params))
        name_of = {id(p): n for n, p in model.named_parameters()}
        if any(id(p) not in name_of for p in params):
            raise ValueError("GaussNewton: the parameters must be parameters of the model "
                             "(model.named_parameters())")
        self.names = [name_of[id(p)] for p in params]
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.terms = list(terms)
        if not self.terms:
            raise ValueError("GaussNewton: the problem gave no least-squares terms")
        scales = [_scale(t) for t in self.terms]
        self.scales = [s for s, _ in scales]
        self.components = [k for _, k in scales]
        self.bound = [_Bound(model, t.fn) for t in self.terms]

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape, part in zip(self.names, self.shapes,
                                     torch.split(theta, self.sizes), strict=True):
            out["model." + name] = part.view(shape)
        return out

    def chunks(self, rows: int):
        """``(term index, points chunk)`` over all terms."""
        for k, t in enumerate(self.terms):
            n = int(t.points.shape[0])
            for a in range(0, n, rows):
                yield k, t.points[a:a + rows]

    def values(self, k: int, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Scaled residuals of term ``k`` at points ``x``, flattened."""
        r = functional_call(self.bound[k], self.unflatten(theta), (x,))
        return (r * self.scales[k]).reshape(-1)

    def jacobian(self, k: int, theta: torch.Tensor, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled residuals ``(m,)`` and their Jacobian ``(m, P)`` at points ``x``: ``vmap``
        over the points of ``jacrev`` of one point's residual."""

        def one(th, xi):
            r = self.values(k, th, xi.unsqueeze(0))
            return r, r

        jac, r = vmap(jacrev(one, has_aux=True), in_dims=(None, 0))(theta, x)
        return r.reshape(-1), jac.reshape(-1, theta.numel())


def residual_jacobian(model: torch.nn.Module, terms: Sequence[LeastSquaresTerm],
                      params: Sequence[torch.nn.Parameter] | None = None,
                      chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The scaled residual vector :math:`\tilde r` ``(M,)`` of ``terms`` and its Jacobian
    ``(M, P)`` with respect to ``params`` (default: all of ``model``'s parameters, in
    ``named_parameters`` order, flattened and concatenated), computed ``chunk_rows`` points
    at a time (``None``: all at once). :math:`\|\tilde r\|^2` is
    :func:`least_squares_loss` of the terms."""
    params = list(model.parameters()) if params is None else list(params)
    res = _Residuals(model, params, terms)
    theta = flat_parameters(params)
    rows = chunk_rows or max(int(t.points.shape[0]) for t in terms)
    rs, js = [], []
    with _no_saved_tensor_hooks():
        for k, x in res.chunks(rows):
            r, j = res.jacobian(k, theta, x)
            rs.append(r)
            js.append(j)
    return torch.cat(rs), torch.cat(js)


def _sketch_size(name: str, value: int | float | None) -> float | None:
    """A sketch size: ``None``, a fraction in (0, 1) or a count >= 1."""
    if value is None or value == 0:
        return None
    v = float(value)
    if not (math.isfinite(v) and v > 0) or (v >= 1 and v != int(v)):
        raise ValueError(f"GaussNewton: {name} must be a fraction in (0, 1) or a whole count "
                         f">= 1, got {value!r}")
    return v


class GaussNewton(torch.optim.Optimizer):
    """Levenberg–Marquardt on the residual vector of ``terms()`` (see the module docstring).

    Args:
        params: the trainable parameters, all of them parameters of ``model``.
        model: the module the residual functions read.
        terms: returns the current :class:`LeastSquaresTerm` list (called at every step, so
            the points may change between steps).
        max_iter: Gauss–Newton iterations per ``step``.
        damping: initial :math:`\\tau` (:math:`\\mu_0 = \\tau \\max_j (J^\\top J)_{jj}`).
        max_tries: damped solves per iteration before it gives up (parameters unchanged).
        min_damping, max_damping: bounds on :math:`\\mu`.
        dense_max: largest parameter count for the dense normal equations; beyond, CG.
        cg_iters, cg_tol: conjugate-gradient iterations and relative tolerance.
        chunk_rows: points per Jacobian chunk; ``None``: from ``budget``.
        budget: bytes (or a budget string) one chunk's Jacobian may take; ``None``: the
            chunk holds at most ``2**25`` values (256 MiB in float64).
        check_rtol: relative tolerance of the first-step check that the terms' loss equals
            the closure's (``None``: no check).
        sketch: points whose Jacobian rows form the curvature at each iteration: a count,
            or a fraction in (0, 1) of each term's points; ``None`` (or >= all): every point.
        sketch_params: parameters a step may move (a count or a fraction); ``None``: all.
        seed: seed of the sketches (iteration ``n`` draws with ``(seed, n)``).
    """

    needs_closure = True

    def __init__(self, params: Iterable[torch.nn.Parameter], model: torch.nn.Module,
                 terms: Callable[[], Sequence[LeastSquaresTerm]], max_iter: int = 1,
                 damping: float = 1e-3, max_tries: int = 30, min_damping: float = 1e-14,
                 max_damping: float = 1e14, dense_max: int = 8000, cg_iters: int = 200,
                 cg_tol: float = 1e-10, chunk_rows: int | None = None,
                 budget: int | float | str | None = None,
                 check_rtol: float | None = 1e-8,
                 sketch: int | float | None = None,
                 sketch_params: int | float | None = None, seed: int = 0):
        params = list(params)
        super().__init__(params, {"lr": 1.0})
        if int(max_iter) < 1:
            raise ValueError(f"GaussNewton: max_iter must be >= 1, got {max_iter}")
        if not float(damping) > 0:
            raise ValueError(f"GaussNewton: damping must be > 0, got {damping}")
        self.model = model
        self.terms = terms
        self.max_iter = int(max_iter)
        self.tau = float(damping)
        self.max_tries = int(max_tries)
        self.min_damping, self.max_damping = float(min_damping), float(max_damping)
        self.dense_max = int(dense_max)
        self.cg_iters, self.cg_tol = int(cg_iters), float(cg_tol)
        self.chunk_rows = None if chunk_rows is None else int(chunk_rows)
        self.budget = None if budget in (None, "") else parse_budget(budget)
        self.check_rtol = check_rtol
        self.sketch = _sketch_size("sketch", sketch)
        self.sketch_params = _sketch_size("sketch_params", sketch_params)
        self.seed = int(seed)
        self._params = params
        st = self.state[params[0]]
        st.update(mu=0.0, nu=2.0, n_iter=0, rejected=0, failed=0, checked=False, ratio=1.0)

    # ---- helpers -----------------------------------------------------------------------

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self._params)

    def rows(self, res: _Residuals) -> int:
        """Points per chunk: ``chunk_rows``, or from the budget at ``3 P k`` values a point."""
        if self.chunk_rows is not None:
            return max(self.chunk_rows, 1)
        item = self._params[0].element_size()
        cap = self.budget if self.budget is not None else 2**25 * item
        per_row = 3 * self.n_params * item * max(res.components)
        return max(int(cap // per_row), 1)

    def _loss(self, res: _Residuals, theta: torch.Tensor, rows: int) -> float:
        with torch.no_grad():
            total = theta.new_zeros(())
            for k, x in res.chunks(rows):
                total += res.values(k, theta, x).pow(2).sum()
        return float(total)

    def _normal(self, res: _Residuals, theta: torch.Tensor, rows: int):
        """``A = J^T J``, ``g = J^T r`` and ``L = |r|^2``, accumulated over chunks."""
        P = theta.numel()
        A = theta.new_zeros(P, P)
        g = theta.new_zeros(P)
        L = theta.new_zeros(())
        for k, x in res.chunks(rows):
            r, j = res.jacobian(k, theta, x)
            A.addmm_(j.T, j)
            g.addmv_(j.T, r)
            L += r.pow(2).sum()
        return A, g, float(L)

    @property
    def sketching(self) -> bool:
        return self.sketch is not None or self.sketch_params is not None

    def _generator(self, st: dict) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + int(st["n_iter"]))

    @staticmethod
    def _count(size: float, n: int, ratio: float) -> int:
        """Of ``n``, how many a sketch of ``size`` (a count, or a fraction below 1) takes,
        ``ratio`` times that, at least 1 and at most ``n``."""
        base = size * n if size < 1 else size
        return min(max(int(math.ceil(base * ratio)), 1), n)

    def _sketched_normal(self, res: _Residuals, theta: torch.Tensor, rows: int, st: dict,
                         gen: torch.Generator, cols: torch.Tensor | None):
        """The sketched curvature ``J_S^T J_S`` (rows scaled by ``sqrt(M_k / m_k)``), on
        the parameters ``cols`` only when given; the full ``g = J^T r`` and ``L = |r|^2``."""
        r0 = torch.cat([res.values(k, theta, x).detach() for k, x in res.chunks(rows)])
        g = self._jtu(res, theta, r0, rows)
        P = theta.numel() if cols is None else cols.numel()
        A = theta.new_zeros(P, P)
        for k, t in enumerate(res.terms):
            n = int(t.points.shape[0])
            m = n if self.sketch is None else self._count(self.sketch, n, st["ratio"])
            pick = (torch.arange(n) if m == n
                    else torch.randperm(n, generator=gen)[:m]).to(t.points.device)
            x_all = t.points[pick]
            for a in range(0, m, rows):
                _, j = res.jacobian(k, theta, x_all[a:a + rows])
                if cols is not None:
                    j = j[:, cols]
                A.addmm_(j.T, j, alpha=n / m)
        return A, g, float(r0 @ r0)

    def _jv(self, res, theta, v, rows):
        out = []
        for k, x in res.chunks(rows):
            out.append(jvp(lambda th, k=k, x=x: res.values(k, theta=th, x=x), (theta,),
                           (v,))[1])
        return torch.cat(out)

    def _jtu(self, res, theta, u, rows):
        g = torch.zeros_like(theta)
        a = 0
        for k, x in res.chunks(rows):
            r, pull = vjp(lambda th, k=k, x=x: res.values(k, th, x), theta)[:2]
            g += pull(u[a:a + r.numel()])[0]
            a += r.numel()
        return g

    def _cg(self, op: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor) -> torch.Tensor:
        x = torch.zeros_like(b)
        r = b.clone()
        p = r.clone()
        rr = float(r @ r)
        stop = self.cg_tol ** 2 * rr
        for _ in range(self.cg_iters):
            if rr <= stop:
                break
            Ap = op(p)
            alpha = rr / float(p @ Ap)
            x.add_(p, alpha=alpha)
            r.sub_(Ap, alpha=alpha)
            new = float(r @ r)
            p.mul_(new / rr).add_(r)
            rr = new
        return x

    # ---- the step ----------------------------------------------------------------------

    def step(self, closure: Callable[[], torch.Tensor]):  # type: ignore[override]
        if closure is None:
            raise ValueError("GaussNewton.step needs a closure that returns the loss after "
                             "calling backward()")
        st = self.state[self._params[0]]
        res = _Residuals(self.model, self._params, self.terms())
        rows = self.rows(res)
        theta = flat_parameters(self._params)
        if self.check_rtol is not None and not st["checked"]:
            with torch.enable_grad():
                want = float(closure().detach())
            got = self._loss(res, theta, rows)
            if not abs(got - want) <= self.check_rtol * max(abs(want), 1e-300):
                raise ValueError(f"GaussNewton: the least-squares terms give the loss {got!r} "
                                 f"but the problem's loss is {want!r}: the terms must be the "
                                 "problem's loss terms (weight * mean(residual**2))")
            st["checked"] = True
        with _no_saved_tensor_hooks():
            theta = self._iterate(res, rows, theta, st)
        load_flat_parameters(self._params, theta)
        with torch.enable_grad():
            return closure()

    def _iterate(self, res: _Residuals, rows: int, theta: torch.Tensor,
                 st: dict) -> torch.Tensor:
        """``max_iter`` damped Gauss–Newton iterations from ``theta``; the new ``theta``."""
        dense = theta.numel() <= self.dense_max
        st.setdefault("ratio", 1.0)   # restart files from before sketching
        if self.sketching and not dense:
            raise ValueError(f"GaussNewton: sketch and sketch_params need the dense normal "
                             f"equations ({theta.numel()} parameters > dense_max="
                             f"{self.dense_max}); raise dense_max or drop the sketch")
        for _ in range(self.max_iter):
            cols = None
            if self.sketching:
                gen = self._generator(st)
                if self.sketch_params is not None:
                    q = self._count(self.sketch_params, theta.numel(), st["ratio"])
                    cols = torch.randperm(theta.numel(), generator=gen)[:q].to(theta.device)
                A, g_full, L = self._sketched_normal(res, theta, rows, st, gen, cols)
                g = g_full if cols is None else g_full[cols]
                diag = A.diagonal()
            elif dense:
                A, g, L = self._normal(res, theta, rows)
                diag = A.diagonal()
            else:
                r0 = torch.cat([res.values(k, theta, x).detach() for k, x in res.chunks(rows)])
                g = self._jtu(res, theta, r0, rows)
                L = float(r0 @ r0)
                diag = None
            if not math.isfinite(L):
                raise FloatingPointError(f"GaussNewton: the loss is {L} at the start of an "
                                         "iteration")
            if st["mu"] <= 0:
                scale = float(diag.max()) if diag is not None else float(g.abs().max())
                st["mu"] = min(max(self.tau * scale, self.min_damping), self.max_damping)
            accepted = False
            for _ in range(self.max_tries):
                mu = st["mu"]
                if dense:
                    assert diag is not None
                    chol, info = torch.linalg.cholesky_ex(
                        A + mu * torch.eye(A.shape[0], dtype=A.dtype, device=A.device))
                    if int(info) != 0:
                        st["mu"], st["nu"] = min(mu * st["nu"], self.max_damping), st["nu"] * 2
                        continue
                    delta = torch.cholesky_solve(-g.unsqueeze(1), chol).squeeze(1)
                    pred = -float(2 * (delta @ g) + delta @ (A @ delta))
                    if cols is not None:
                        delta = theta.new_zeros(theta.numel()).index_copy_(0, cols, delta)
                else:
                    def op(v, mu=mu, th=theta):
                        return self._jtu(res, th, self._jv(res, th, v, rows), rows) + mu * v

                    delta = self._cg(op, -g)
                    jd = self._jv(res, theta, delta, rows)
                    pred = -float(2 * (delta @ g) + jd @ jd)
                new = self._loss(res, theta + delta, rows)
                rho = (L - new) / pred if pred > 0 else -1.0
                if math.isfinite(new) and rho > 0:
                    theta = theta + delta
                    st["mu"] = max(mu * max(1 / 3, 1 - (2 * rho - 1) ** 3), self.min_damping)
                    st["nu"] = 2.0
                    accepted = True
                    if self.sketching:   # the sketch's share of a poor model: adapt its size
                        st["ratio"] = (min(st["ratio"] * 2, 2.0**20) if rho < 0.25
                                       else max(st["ratio"] / 2, 1.0) if rho > 0.75
                                       else st["ratio"])
                    break
                st["rejected"] += 1
                st["mu"], st["nu"] = min(mu * st["nu"], self.max_damping), st["nu"] * 2
                if st["mu"] >= self.max_damping:
                    break
            st["n_iter"] += 1
            if not accepted:
                st["failed"] += 1
                st["mu"] = min(st["mu"], self.max_damping)
                if self.sketching:
                    st["ratio"] = min(st["ratio"] * 2, 2.0**20)
                    st["mu"] = 0.0   # a new sketch: damping from its own scale
                    continue
                break
        return theta

    # mu, nu and the counters live in ``self.state`` of the first parameter, so the standard
    # ``state_dict`` / ``load_state_dict`` carry them into and out of restart files.
