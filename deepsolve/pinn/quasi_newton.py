r"""Full-memory self-scaled quasi-Newton methods: SSBroyden, SSBFGS and BFGS.

For networks of up to ~10⁴ parameters the inverse-Hessian approximation :math:`H_k`
(``(P, P)``, float64) fits in memory, and the full-memory Broyden family with self-scaling
reaches far lower PINN losses than L-BFGS (Urbán, Stefanou & Pons, *Unveiling the
optimization process of physics informed neural networks: how accurate and competitive can
PINNs be?*, J. Comput. Phys. 523, 2025, 113656). Each iteration takes the direction
:math:`d_k = -H_k g_k`, a strong-Wolfe line search (``torch.optim``'s cubic-interpolation
search) gives :math:`s_k = \alpha_k d_k`, :math:`y_k = g_{k+1} - g_k`, and with

.. math::

    \rho_k = \frac{1}{y_k^\top s_k},\quad
    h_k = \rho_k\, y_k^\top H_k y_k,\quad
    b_k = \rho_k\, s_k^\top B_k s_k = -\alpha_k \rho_k\, s_k^\top g_k,\quad
    a_k = b_k h_k - 1,\quad
    v_k = \rho_k s_k - \frac{H_k y_k}{y_k^\top H_k y_k},

the update of the self-scaled Broyden family (Al-Baali 1998; Urbán et al. 2025) is

.. math::

    H_{k+1} = \frac{1}{\tau_k}\Big[H_k - \frac{H_k y_k y_k^\top H_k}{y_k^\top H_k y_k}
              + \phi_k\, (y_k^\top H_k y_k)\, v_k v_k^\top\Big] + \rho_k s_k s_k^\top .

* ``"bfgs"``: :math:`\phi_k = 1`, :math:`\tau_k = 1` (the first update scaled by
  :math:`\tau_0 = \rho_0\, y_0^\top y_0`, Nocedal & Wright eq. 6.20);
* ``"ssbfgs"``: :math:`\phi_k = 1`, :math:`\tau_k = \min(1, 1/b_k)` (Al-Baali's choice,
  Urbán et al. eq. 11);
* ``"ssbroyden"``: :math:`\theta_k = \max(\theta_k^-, \min(\theta_k^+, (1 - b_k)/b_k))`
  with :math:`\rho_k^- = \min(1, h_k(1 - \sqrt{|a_k|/(1 + a_k)}))`,
  :math:`\theta_k^- = (\rho_k^- - 1)/a_k`, :math:`\theta_k^+ = 1/\rho_k^-`;
  :math:`\phi_k = (1 - \theta_k)/(1 + a_k\theta_k)`; :math:`\sigma_k = 1 + \theta_k a_k`,
  :math:`\tau_k = \min(\min(1, 1/b_k)\,\sigma_k^{1/(1-P)}, \sigma_k)` for :math:`\theta_k
  \le 0`, else :math:`\min(1, 1/b_k) \min(\sigma_k^{1/(1-P)}, 1/\theta_k)`; the first
  update uses :math:`\tau_0 = h_0/(1 + a_0\theta_0)` (Urbán et al. eqs. 13–23, their
  "SSBroyden2").

A pair with :math:`y_k^\top s_k \le \epsilon\,\|s_k\|\|y_k\|` (no positive curvature) is
skipped.

Each update is :math:`H \leftarrow \beta H + U C U^\top` with :math:`U = [H y, v, s]`
(``(P, 3)``) and :math:`C` diagonal (:func:`broyden_terms`). :class:`SelfScaledBroyden` keeps
:math:`H = c\,H_0 + W M W^\top` and folds the pending columns :math:`W` (``(P, 3j)``) into
:math:`H_0` every ``fold_every`` updates, one rank-``3j`` product: an iteration then reads the
:math:`P^2` values of :math:`H_0` once (for :math:`H_0 g_{k+1}`; :math:`H y_k = H g_{k+1} -
H g_k` and the next direction :math:`H_{k+1} g_{k+1}` follow from it and the rank-3 terms)
where the dense update reads them three times and writes them once (:math:`H g`, :math:`H y`,
the rank-3 product). Measured on Kovasznay's 2973 parameters (docs/pinn.md) the dense
updates took a quarter of an iteration. The pending terms are folded at the end of every
``step`` as well.

Where the search starts (``step_growth``): at the unit step, the Newton step of the model
(``None``, the default), or at :math:`\min(1, \gamma\,\alpha_{k-1})`, :math:`\gamma \ge 1`
times the step the last search accepted. Late in a PINN run the unit step often fails the
Armijo condition (64 % of the searches on Kovasznay, median accepted step 0.44) and the
search needs a second evaluation; a start near the last step saves it. A search that started
below 1 and ends without progress (the loss no longer resolves a short step) is repeated from
the unit step before the curvature is given up.

Where the loss no longer resolves a step (``approximate_wolfe``): late in a run the loss
carries round-off of about :math:`10^{-7}` of its value (the residual is a sum of
:math:`O(1)` terms that cancel to :math:`10^{-8}`), while the gradient, hence
:math:`\phi'(t) = g(\theta + t d)^\top d`, stays accurate. Once the decrease a step can
make falls below that round-off, the strong-Wolfe search sees no decrease at any step,
``H`` is reset, and steepest descent cannot resolve a decrease either: the run stalls for
good (Kovasznay with 1024 points, two threads: at a loss of 1.1e-16 after 9.7 min, v at
1.02e-9). With ``approximate_wolfe`` a failed search is followed by one on
:math:`\phi'` alone (secant steps inside a bracket) for a step with Hager & Zhang's
approximate Wolfe conditions (*A new conjugate gradient method with guaranteed descent and
an efficient line search*, SIAM J. Optim. 16(1), 2005, 170–192, eq. 4.1 and §4),

.. math::

    \sigma\,\phi'(0) \le \phi'(t) \le (2\delta - 1)\,\phi'(0),\qquad
    \phi(t) \le \phi(0) + \epsilon\,|\phi(0)|,

with :math:`\delta = 0.1`, :math:`\sigma = 0.9`, :math:`\epsilon = 10^{-6}` (theirs); the
first is Armijo's condition for the quadratic model of :math:`\phi`, the second leaves the
loss a margin of its round-off. The pair :math:`(s_k, y_k)` then has
:math:`y_k^\top s_k \ge (1 - \sigma)\,t\,|\phi'(0)| > 0` and updates ``H`` as usual.

The optimizer takes ``closure`` steps (``needs_closure``), ``max_iter`` iterations
each; its state — :math:`H_k` (complete between steps), the iteration counts — is in
``state_dict``, so a restarted run continues with the same matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lbfgs import _strong_wolfe

from .optim import flat_parameters, load_flat_parameters

__all__ = ["SelfScaledBroyden", "QUASI_NEWTON", "broyden_terms", "broyden_update",
           "approximate_wolfe"]

QUASI_NEWTON = ("ssbroyden", "ssbfgs", "bfgs")
"""The update rules of :class:`SelfScaledBroyden`."""

SIGMA_MIN = 2.0**-26
r"""The smallest :math:`\sigma_k = 1 + \theta_k a_k` an SSBroyden update takes: below it
(:math:`\rho_k^- \approx 0`, :math:`a_k` near :math:`1/\epsilon`) :math:`\phi_k \propto
1/\sigma_k` amplifies the round-off of :math:`v_k^\top y_k = 0` past the secant condition, so
the pair is skipped (:math:`\sigma_k = 0` divided by zero)."""

APPROX_WOLFE = (0.1, 0.9, 1e-6)
r"""Hager & Zhang's :math:`(\delta, \sigma, \epsilon)` of the approximate Wolfe conditions
(the module docstring)."""

APPROX_EVALS = 20
"""Evaluations of one approximate-Wolfe search."""


def approximate_wolfe(obj: Callable[[torch.Tensor, float, torch.Tensor],
                                    tuple[float, torch.Tensor]],
                      theta: torch.Tensor, t0: float, d: torch.Tensor, f: float, gtd: float,
                      max_evals: int = APPROX_EVALS) -> tuple[float, torch.Tensor, float, bool]:
    r"""A search along ``d`` that reads the loss only to bound it: a step :math:`t` with
    Hager & Zhang's approximate Wolfe conditions :math:`\sigma\phi'(0) \le \phi'(t) \le
    (2\delta - 1)\phi'(0)` and :math:`\phi(t) \le \phi(0) + \epsilon|\phi(0)|`
    (:data:`APPROX_WOLFE`), found on the directional derivative
    :math:`\phi'(t) = g(\theta + t d)^\top d` alone: from ``t0``, steps grow 4× while
    :math:`\phi'(t) < \sigma\phi'(0)`; once a step is too long (:math:`\phi'` above the
    band, or the loss above its margin) secant steps on :math:`\phi'` inside the bracket,
    kept at least a tenth of the bracket from its ends.

    ``obj(theta, t, d)`` returns the loss and the flat gradient at ``theta + t d``;
    ``gtd`` = :math:`\phi'(0) < 0`. Returns ``(f_t, g_t, t, found)``; at most
    ``max_evals`` evaluations."""
    delta, sigma, eps = APPROX_WOLFE
    lo, dlo = 0.0, gtd
    hi, dhi = math.inf, math.nan
    t = float(t0)
    f_t, g_t = f, torch.zeros_like(d)
    for _ in range(max_evals):
        f_t, g_t = obj(theta, t, d)
        dt = float(g_t @ d)
        if not (math.isfinite(f_t) and math.isfinite(dt)):
            hi, dhi = t, math.nan
        elif f_t > f + eps * abs(f) or dt > (2 * delta - 1) * gtd:
            hi, dhi = t, dt          # too long
        elif dt < sigma * gtd:
            lo, dlo = t, dt          # too short: still as steep as at 0
        else:
            return f_t, g_t, t, True
        if math.isinf(hi):
            t = 4 * t
            continue
        width = hi - lo
        if width <= 1e-16 * hi:
            break
        # the zero of the secant of phi' through the bracket's ends, kept inside it
        guess = lo - dlo * width / (dhi - dlo) if math.isfinite(dhi) and dhi > dlo else math.nan
        t = min(max(guess, lo + 0.1 * width), hi - 0.1 * width) if math.isfinite(guess) \
            else lo + 0.5 * width
    return f_t, g_t, t, False


SYMMETRIZE_EVERY = 64
"""Iterations between the averagings of ``H`` with its transpose (:func:`broyden_update`):
the round-off asymmetry of the rank-3 updates grows by about one unit in the last place
per update, and the averaging costs several updates."""


def broyden_terms(Hy: torch.Tensor, s: torch.Tensor, y: torch.Tensor, g: torch.Tensor,
                  alpha: float, method: str, first: bool
                  ) -> tuple[float, torch.Tensor, torch.Tensor] | None:
    r"""The update of the rule ``method`` for the pair ``s``, ``y`` (``Hy`` = :math:`H y`,
    ``g``: the gradient where the step started, ``alpha`` the step length; see the module
    docstring) as :math:`H_{k+1} = \beta H_k + U \mathrm{diag}(c)\, U^\top`: returns
    ``(beta, U, c)`` with ``U = [H y, v, s]`` ``(P, 3)`` and ``c`` ``(3,)``, :math:`c =
    (-1/(\tau\, y^\top H y),\ \phi\, y^\top H y/\tau,\ \rho)`, or ``None`` where the
    pair has no positive curvature or, for SSBroyden, :math:`\sigma_k \le` ``SIGMA_MIN``
    (skipped). :math:`\beta = 1/\tau`, times the scaling
    :math:`1/(\rho\, y^\top y)` of :math:`H_0` at a first BFGS update."""
    ys = float(y @ s)
    if not ys > 1e-12 * float(s.norm() * y.norm()) or not math.isfinite(ys):
        return None
    rho = 1.0 / ys
    yHy = float(y @ Hy)
    if not yHy > 0:
        return None
    h = rho * yHy
    b = -alpha * rho * float(s @ g)
    kappa = 1.0
    if method in ("bfgs", "ssbfgs"):
        phi = 1.0
        if first:  # scale H0 = I before the update (Nocedal & Wright 6.20)
            kappa = 1.0 / (rho * float(y @ y))
            Hy = Hy * kappa
            yHy *= kappa
            tau = 1.0
        else:
            tau = 1.0 if method == "bfgs" else min(1.0, 1.0 / b)
    elif method == "ssbroyden":
        a = b * h - 1.0
        if not (math.isfinite(a) and a > -1 and abs(a) > 1e-300 and b > 0):
            phi, tau = 1.0, 1.0  # degenerate pair: plain BFGS
        else:
            rho_m = min(1.0, h * (1.0 - math.sqrt(abs(a) / (1.0 + a))))
            theta_m = (rho_m - 1.0) / a
            theta_p = 1.0 / rho_m if rho_m != 0 else math.inf
            theta = max(theta_m, min(theta_p, (1.0 - b) / b))
            sigma = 1.0 + theta * a
            if not sigma > SIGMA_MIN:  # rho_m ~ 0 (a ~ 1/eps): phi ~ 1/sigma, no digits left
                return None
            if first:
                tau = h / sigma
            else:
                r = min(1.0, 1.0 / b)
                n = Hy.shape[0]
                s_n = abs(sigma) ** (1.0 / (1 - n)) if n > 1 else 1.0
                tau = min(r * s_n, sigma) if theta <= 0 else r * min(s_n, 1.0 / theta)
            phi = (1.0 - theta) / sigma
        if not (math.isfinite(tau) and tau > 0 and math.isfinite(phi)):
            phi, tau = 1.0, 1.0
    else:
        raise ValueError(f"method must be one of {QUASI_NEWTON}, got {method!r}")
    v = rho * s - Hy / yHy
    u = torch.stack([Hy, v, s], 1)                                        # (P, 3)
    c = u.new_tensor([-1.0 / (yHy * tau), phi * yHy / tau, rho])
    return kappa / tau, u, c


def broyden_update(H: torch.Tensor, s: torch.Tensor, y: torch.Tensor, g: torch.Tensor,
                   alpha: float, method: str, first: bool, symmetrize: bool = True) -> bool:
    r"""Update the dense ``H`` in place by the rule ``method`` for the pair ``s``, ``y``
    (:func:`broyden_terms`); returns whether the pair was used.

    The update is one rank-3 product over ``H``, :math:`H \leftarrow \beta H + U C U^\top`
    (``addmm_``: one pass over the ``P²`` values). It is symmetric in exact arithmetic;
    ``symmetrize`` also averages ``H`` with its transpose against round-off (a transposed
    pass, several times the cost of the update: :class:`SelfScaledBroyden` does it every
    ``SYMMETRIZE_EVERY`` iterations)."""
    terms = broyden_terms(H @ y, s, y, g, alpha, method, first)
    if terms is None:
        return False
    beta, u, c = terms
    H.addmm_(u * c, u.T, beta=beta)
    if symmetrize:
        H.add_(H.T.clone()).mul_(0.5)  # keep it symmetric against round-off
    return True


class _LazyInverse:
    r""":math:`H = c\,H_0 + W \mathrm{diag}(m) W^\top` over the dense ``H0`` (updated in
    place at :meth:`fold`) with up to ``3 * fold_every`` pending columns in preallocated
    buffers."""

    def __init__(self, H0: torch.Tensor, fold_every: int):
        self.H0, self.c, self.m = H0, 1.0, 0
        self.W = H0.new_empty(H0.shape[0], 3 * fold_every)
        self.w = H0.new_empty(3 * fold_every)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.mv(self.H0, x)
        if self.c != 1.0:
            out.mul_(self.c)
        if self.m:
            W = self.W[:, :self.m]
            out.addmv_(W, self.w[:self.m] * (W.T @ x))
        return out

    @property
    def full(self) -> bool:
        return self.m == self.W.shape[1]

    def add(self, beta: float, u: torch.Tensor, c: torch.Tensor) -> None:
        r""":math:`H \leftarrow \beta H + U \mathrm{diag}(c) U^\top`."""
        self.c *= beta
        self.w[:self.m].mul_(beta)
        self.W[:, self.m:self.m + 3] = u
        self.w[self.m:self.m + 3] = c
        self.m += 3

    def update(self, Hg: torch.Tensor, Hg_new: torch.Tensor, g: torch.Tensor,
               g_new: torch.Tensor, s: torch.Tensor, alpha: float, method: str,
               first: bool) -> bool:
        r"""Add the update for the step ``s`` of length ``alpha`` from gradient ``g`` to
        ``g_new`` (:func:`broyden_terms`, with :math:`H y = H g_{new} - H g` from ``Hg`` and
        ``Hg_new``, both products with the current ``H``) and turn ``Hg_new`` in place into
        :math:`H_{k+1} g_{new}`; returns whether the pair was used (``False``: skipped,
        nothing changed). The caller folds when :attr:`full`."""
        terms = broyden_terms(Hg_new - Hg, s, g_new - g, g, alpha, method, first)
        if terms is None:
            return False
        beta, u, c = terms
        Hg_new.mul_(beta).addmv_(u, c * (u.T @ g_new))
        self.add(beta, u, c)
        return True

    def fold(self, symmetrize: bool) -> None:
        """Write the pending terms into ``H0`` (one rank-``m`` product)."""
        if self.m:
            W = self.W[:, :self.m]
            self.H0.addmm_(W * self.w[:self.m], W.T, beta=self.c)
        elif self.c != 1.0:
            self.H0.mul_(self.c)
        self.c, self.m = 1.0, 0
        if symmetrize:
            self.H0.add_(self.H0.T.clone()).mul_(0.5)  # against round-off

    def reset(self) -> None:
        """:math:`H = I`."""
        self.H0.copy_(torch.eye(self.H0.shape[0], dtype=self.H0.dtype,
                                device=self.H0.device))
        self.c, self.m = 1.0, 0


class SelfScaledBroyden(torch.optim.Optimizer):
    """Full-memory SSBroyden / SSBFGS / BFGS with a strong-Wolfe line search.

    Args:
        params: the parameters (one group); use float64 (``H`` has their dtype).
        method: ``"ssbroyden"``, ``"ssbfgs"`` or ``"bfgs"``.
        max_iter: quasi-Newton iterations per ``step``.
        max_ls: function evaluations per line search.
        c1, c2: the Wolfe constants.
        tolerance_grad: stop a step when ``max |g|`` is below this.
        max_params: refuse more parameters than this (``H`` takes ``P**2`` values).
        step_growth: where a search starts: ``None`` at the unit step (the Newton step);
            a number γ ≥ 1 at min(1, γ α_{k-1}), α_{k-1} the step the last search
            accepted (see the module docstring).
        fold_every: updates kept as pending rank-3 terms before they are written into
            ``H`` (see the module docstring); ``H`` in the state is complete between steps.
        approximate_wolfe: after a strong-Wolfe search without progress, search for a step
            with the approximate Wolfe conditions on the directional derivative before
            ``H`` is reset (:func:`approximate_wolfe`; the module docstring).
    """

    needs_closure = True

    def __init__(self, params: Iterable[torch.Tensor], method: str = "ssbroyden",
                 max_iter: int = 20, max_ls: int = 50, c1: float = 1e-4, c2: float = 0.9,
                 tolerance_grad: float = 0.0, max_params: int = 20000,
                 fold_every: int = 16, step_growth: float | None = None,
                 approximate_wolfe: bool = False):
        if method not in QUASI_NEWTON:
            raise ValueError(f"SelfScaledBroyden: method must be one of {QUASI_NEWTON}, "
                             f"got {method!r}")
        super().__init__(params, {"lr": 1.0})
        if len(self.param_groups) != 1:
            raise ValueError("SelfScaledBroyden takes one parameter group")
        self._params = self.param_groups[0]["params"]
        n = sum(p.numel() for p in self._params)
        if n > int(max_params):
            raise ValueError(f"SelfScaledBroyden: {n} parameters need a {n}x{n} inverse "
                             f"Hessian; more than max_params={max_params} — use "
                             "optimizer='lbfgs' or 'gauss_newton', or a smaller network")
        if int(max_iter) < 1:
            raise ValueError(f"SelfScaledBroyden: max_iter must be >= 1, got {max_iter}")
        if step_growth is not None and not float(step_growth) >= 1:
            raise ValueError(f"SelfScaledBroyden: step_growth must be >= 1 or None, got "
                             f"{step_growth}")
        if int(fold_every) < 1:
            raise ValueError(f"SelfScaledBroyden: fold_every must be >= 1, got {fold_every}")
        self.method = method
        self.max_iter, self.max_ls = int(max_iter), int(max_ls)
        self.c1, self.c2 = float(c1), float(c2)
        self.tolerance_grad = float(tolerance_grad)
        self.fold_every = int(fold_every)
        self.step_growth = None if step_growth is None else float(step_growth)
        self.approximate_wolfe = bool(approximate_wolfe)
        self.state[self._params[0]].update(n_iter=0, skipped=0, failed_ls=0)

    def reset(self) -> None:
        """Forget the inverse-Hessian approximation: the next step starts from the
        (scaled) identity."""
        self.state[self._params[0]].pop("H", None)

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self._params])

    def _search(self, obj, theta, t0, d, f, g, gtd):
        """The strong-Wolfe search from ``t0``: ``(f_new, g_new, t, progress)``."""
        f_new, g_new, t, _ = _strong_wolfe(obj, theta, t0, d, f, g, gtd, c1=self.c1,
                                           c2=self.c2, tolerance_change=1e-32,
                                           max_ls=self.max_ls)
        # f_new == f is progress only where the loss no longer resolves it (at a minimum
        # with a nonzero residual) but the gradient does: the curvature condition holds.
        # A search that ran out at a step of ~0 (a stale H after the points were
        # redrawn) fails it; accepting it would repeat max_iter searches of max_ls calls.
        progress = f_new < f or (f_new == f and abs(float(g_new @ d)) <= -self.c2 * gtd)
        if not (math.isfinite(f_new) and progress) and self.approximate_wolfe:
            # the loss may no longer resolve the decrease; its derivative does
            st = self.state[self._params[0]]
            f_new, g_new, t, progress = approximate_wolfe(obj, theta, t0, d, f, gtd)
            st["approximate"] = st.get("approximate", 0) + int(progress)
        return f_new, g_new, float(t), bool(math.isfinite(f_new) and progress)

    def step(self, closure: Callable[[], torch.Tensor]):  # type: ignore[override]
        if closure is None:
            raise ValueError("SelfScaledBroyden.step needs a closure that returns the loss "
                             "after calling backward()")
        st = self.state[self._params[0]]
        closure = torch.enable_grad()(closure)
        loss = closure()
        f = float(loss.detach())
        g = self._flat_grad()
        theta = flat_parameters(self._params)
        if "H" not in st or st["H"].dtype != theta.dtype:
            st["H"] = torch.eye(theta.numel(), dtype=theta.dtype, device=theta.device)
            st["first"] = True
        H = _LazyInverse(st["H"], self.fold_every)

        def obj(x, t, d):
            load_flat_parameters(self._params, x + t * d)
            v = float(closure().detach())
            return v, self._flat_grad()

        def fold() -> None:  # averaged every SYMMETRIZE_EVERY iterations
            due = st["n_iter"] - st.get("symmetrized_at", 0) >= SYMMETRIZE_EVERY
            H.fold(symmetrize=due)
            if due:
                st["symmetrized_at"] = st["n_iter"]

        Hg = H @ g
        for _ in range(self.max_iter):
            if not g.abs().max() > self.tolerance_grad or not math.isfinite(f):
                break
            d = -Hg
            gtd = float(g @ d)
            if not gtd < 0:  # H lost positive definiteness in round-off: restart it
                H.reset()
                st["first"] = True
                Hg = g.clone()
                d = -g
                gtd = float(g @ d)
            if st["first"]:
                t0 = min(1.0, 1.0 / float(g.abs().sum()))
            elif self.step_growth is None:
                t0 = 1.0
            else:
                t0 = min(1.0, self.step_growth * float(st.get("t_last", 1.0)))
            f_new, g_new, t, progress = self._search(obj, theta, t0, d, f, g, gtd)
            if not progress and t0 < 1.0 and not st["first"]:
                # a start below the unit step can end where the loss no longer resolves the
                # decrease: the unit step once more before the curvature is given up
                f_new, g_new, t, progress = self._search(obj, theta, 1.0, d, f, g, gtd)
            st["n_iter"] += 1
            if not progress:
                st["failed_ls"] += 1   # no decrease: stay, forget the curvature
                load_flat_parameters(self._params, theta)
                H.reset()
                st["first"] = True
                break
            st["t_last"] = t
            s = t * d
            Hg_new = H @ g_new          # the one pass over H0 of the iteration
            if H.update(Hg, Hg_new, g, g_new, s, t, self.method, bool(st["first"])):
                st["first"] = False
                if H.full:
                    fold()
            else:
                st["skipped"] += 1
            theta = theta + s
            f, g, Hg = f_new, g_new, Hg_new
        fold()
        load_flat_parameters(self._params, theta)
        return closure()
