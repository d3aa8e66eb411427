r"""Physics-informed network for the Allen--Cahn equation, trained with causal weighting.

Physics
-------
.. math::

    u_t - d\,u_{xx} + 5u^3 - 5u = 0,\quad x \in [-1, 1],\ t \in [0, 1],\qquad
    u(x, 0) = x^2 \cos \pi x,\quad u \text{ 2-periodic in } x,\qquad d = 10^{-4},

the benchmark of Raissi, Perdikaris & Karniadakis (J. Comput. Phys. 378, 2019) and of Wang,
Sankaran & Perdikaris, "Respecting causality is all you need for training physics-informed
neural networks" (CMAME 421, 2024, arXiv:2203.07404). The reaction drives :math:`u` to the
stable states :math:`\pm 1`; by :math:`t \approx 0.5` the solution is a set of plateaus
separated by fronts of width :math:`\sim\sqrt{2d/5} \approx 0.006` — a PINN that fits all
times at once typically converges to a wrong, smooth solution, hence causal training. The
initial condition is continuous but not smooth as a periodic function
(:math:`u_0'(\pm 1^\mp) = \mp 2`): for :math:`t > 0` diffusion rounds the kink at
:math:`x = \pm 1` within :math:`\sim\sqrt{d t}`, and the reaction (:math:`u_0(\pm1) = -1`, a
stable state) flattens it like :math:`e^{-10 t}`.

Reference solution (Fourier pseudo-spectral, ETDRK4)
----------------------------------------------------
:func:`allen_cahn_reference`: ``ref_modes`` Fourier modes in :math:`x` (real FFTs, no
dealiasing), :math:`\hat u_t = L\hat u + \widehat{N(u)}` with
:math:`L = -d(\pi k)^2 + 5` and :math:`N(u) = -5u^3`, stepped by ETDRK4 (Cox & Matthews,
J. Comput. Phys. 176, 2002) with the coefficients evaluated by contour integrals (Kassam &
Trefethen, SIAM J. Sci. Comput. 26(4), 2005: 64 points on circles of radius 1 around each
:math:`hL`), step ``ref_dt`` (shortened so that it divides every output interval), float64.
The defaults, 8192 modes and :math:`h = 10^{-3}`, take about 0.6 s. On the 512 × 201
evaluation grid they differ from 16384 modes by 5.7e-6 at most (relative L2 4.3e-8; 2048
modes: 1.2e-4 and 8.7e-7) — all of it at the kink :math:`x = \pm 1` in the first output
times, where the Fourier coefficients of :math:`u_0` decay only like :math:`k^{-2}`; from
:math:`t = 0.05` on, 8192 and 16384 modes agree to 1.1e-6. Halving :math:`h` changes the
result by 1e-11 (relative).
The tests check the PDE residual (central differences in time, spectral
:math:`u_{xx}`: 4e-6 of the largest term) and the convergence. No file is downloaded.

Model and loss
--------------
``ctx.model`` (:class:`AllenCahnNet`): a ``tanh`` :class:`~deepsolve.pinn.FNN` (``depth`` ×
``width``) on the Fourier features :math:`(\cos k\pi x, \sin k\pi x)_{k=1..K}` (``harmonics``
:math:`K`) and :math:`t`, so every network is exactly 2-periodic in :math:`x`, with all its
derivatives (the periodic boundary condition needs no loss term). ``constraints = "hard"``
(the default) imposes the initial condition exactly, :math:`u = u_0(x) + t\,N(x, t)`:
causal training fits the residual slice by slice from :math:`t = 0`, which only means
something when :math:`u(\cdot, 0)` is right, and a hard condition needs no initial-condition
weight to balance against the residual. ``constraints = "soft"`` uses :math:`u = N` and adds
the term ``initial``.

The kink ansatz (``kink``, on by default). :math:`u_0` is periodic in value
(:math:`u_0(\pm 1) = -1`) but not in slope: near :math:`x = \pm 1`,
:math:`u_0 = -1 + 2|y| + O(y^2)` at the distance :math:`|y|` from the kink. For
:math:`t > 0` diffusion rounds it into a layer of width :math:`\sim\sqrt{dt}` (7e-4 at
:math:`t = 0.005`) that a smooth network cannot follow: without the ansatz 94 % of the
squared error of a 15-minute run sat at :math:`|x| > 0.9`, 88 % before :math:`t = 0.05`
(``u_max_error`` 2.7e-3 there). Linearised about the stable state :math:`u = -1` the
equation is :math:`v_t = d v_{xx} - 10 v`, which the kink obeys as
:math:`2 e^{-10t}\,G(|y|, t)` with :math:`G(s, t) = s\,\mathrm{erf}(s/2\sqrt{dt}) +
2\sqrt{dt/\pi}\,e^{-s^2/4dt}`, the heat flow of :math:`|s|` (:func:`smoothed_kink`). The
model adds :math:`K(x, t) = 2 e^{-10t}\chi(x)\,G(1 - |x|, t)` with
:math:`\chi = \sin^4(\pi x/2)` (1 at :math:`\pm 1`, vanishing to fourth order at 0, so
:math:`K` has no other kink) — :func:`kink_layer` —: :math:`u = u_0 - K(x, 0) + t N + K(x,
t)` (hard) or :math:`N + K` (soft). What :math:`N` fits is then smooth: the second
differences of the reference minus :math:`K` near :math:`\pm 1` are 15 at
:math:`t = 0.005` against 1500 for the reference (tested). The nonlinear remainder
(:math:`15\,(u^2 - 1) K`, :math:`15 K^2`) is small and left to :math:`N`.

Loss terms:

* ``pde`` — the causally weighted residual (:class:`deepsolve.pinn.CausalWeighting`): the
  collocation set is ``n_slices`` :math:`M` time slices × ``n_per_slice`` points
  (:func:`deepsolve.pinn.sample_time_slices`, ``sampling``; redrawn every
  ``resample_every`` Adam iterations), :math:`\mathcal{L}_i` the mean square of
  :math:`r = u_t - d u_{xx} + 5u^3 - 5u` on slice :math:`i`, and
  :math:`\frac1M\sum_i w_i\mathcal{L}_i` with
  :math:`w_i = \exp(-\varepsilon\sum_{k<i}\mathcal{L}_k)` (no gradient through
  :math:`w`); the :math:`\mathcal{L}_i` are evaluated in chunks recomputed in the backward
  pass under ``residual_budget`` (or else the run's ``budget``) when one is set
  (:func:`deepsolve.pinn.slice_mse`). :math:`\varepsilon` goes through ``causal_eps``
  (default :math:`1, 10, 100`),
  advancing when :math:`\min_i w_i >` ``causal_threshold`` (0.99); within one trainer
  iteration the weights are frozen, so an L-BFGS step minimises one objective. The paper's
  list starts at :math:`10^{-2}`; here, with Adam, :math:`\varepsilon = 10^{-2}` weighted
  all times almost equally from the start and the network settled within 250 steps on a
  smooth wrong solution (relative error 0.95, residual 0.07) that later values only slowly
  undid, so the default starts at 1 (the fixed value of the authors' later JAX-PI code).
* ``initial`` (``constraints = "soft"`` only) — mean squared misfit of :math:`u(x, 0)` at
  ``n_initial`` points, weighted by ``initial_weight`` (or annealed, ``weighting``).

Derivatives: ``derivatives = "autograd"`` (default) or ``"func"``
(:func:`deepsolve.pinn.jet`). Optimiser (``optimizer``): ``"ssbroyden"`` (default) —
full-memory self-scaled Broyden in float64 (:class:`deepsolve.pinn.SelfScaledBroyden`,
``qn_iters`` iterations per trainer iteration; its inverse Hessian is carried across new point
blocks and reset when :math:`\varepsilon` advances), as Urbán, Stefanou & Pons (2025) train
this problem (3×30, one harmonic, a soft initial condition); ``"bfgs"``; ``"gauss_newton"``
(:meth:`AllenCahnPINN.least_squares_terms`: each point carries its slice's causal weight);
new points every ``lbfgs_resample_every`` steps. ``"adam+lbfgs"`` (the earlier default):
``adam_iterations`` Adam steps (``lr``, decayed by
``lr_decay`` every ``lr_decay_every`` steps, smoothly), then L-BFGS (strong Wolfe,
:class:`deepsolve.pinn.AdamLBFGS`, ``lbfgs_iters`` inner iterations per trainer iteration),
the run switching to ``switch_dtype`` at ``switch_at``. L-BFGS keeps each collocation set
for ``lbfgs_resample_every`` steps, then draws a new one; its memory is cleared then, when
:math:`\varepsilon` advances and when the precision switches. Adam alone stalls here: in
trial runs 2000 Adam steps left a relative error of 0.3–0.5 with a residual of about 5e-3,
and the first 10 L-BFGS steps brought it to 6e-2.

Metrics (``evaluate``)
----------------------
``u_rel_l2`` — :math:`\|u_\theta - u\|_2 / \|u\|_2` on the ``test_nx`` × ``test_nt`` grid
(512 × 201 as Raissi's data: :math:`x_j = -1 + 2j/512`, :math:`t` in steps of 0.005);
``u_max_error`` — the largest absolute error there; also ``causal_eps`` (the current
:math:`\varepsilon`), ``causal_min_weight`` (:math:`\min_i w_i`) and ``pde_mse`` (the
unweighted mean residual square) of the last loss evaluation. The published anchors: a
relative L2 error of 5.37e-5 with JAX-PI (Wang, Sankaran, Wang & Perdikaris 2023, arXiv
2308.08468) and 2.24e-5 with PirateNets (Wang, Li, Chen & Perdikaris 2024, arXiv
2402.00326), both after long GPU training, and 2.1e-6 with vRBA and SSBroyden (Toscano et
al. 2025, GPU). The defaults (hard initial condition, kink ansatz, SSBroyden) reached
``u_rel_l2`` below 2e-6 after 8.1 minutes and 5.0e-7 at best within 15 minutes on the
project's 2-core CPU (one thread, two runs at a time); without the kink ansatz (soft initial
condition) the error stopped at 2e-5, and the earlier Adam → L-BFGS defaults (4×64, three
harmonics) reached 2.3e-3 in 23 minutes (``u_max_error`` 3.3e-2, near :math:`x = 0` at
:math:`t = 1`, where :math:`u \approx 0` is unstable and residual errors grow like
:math:`e^{5t}`). docs/pinn.md lists the measurements.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

import deepsolve
from deepsolve.pinn import (
    FNN,
    SECOND_ORDER,
    SECOND_ORDER_SETTINGS,
    AdamLBFGSTraining,
    CausalWeighting,
    Collocation,
    LeastSquaresTerm,
    Published,
    chunk_size_for_budget,
    jet,
    make_weights,
    sample_time_slices,
    slice_mse,
    unit_samples,
)

TERMS = ("pde", "initial")
METRICS = ("u_rel_l2", "u_max_error")
D = 1e-4   # diffusion
R = 5.0    # reaction: u_t = D u_xx + R (u - u^3)


def initial_condition(x: npt.ArrayLike | torch.Tensor) -> np.ndarray | torch.Tensor:
    """:math:`u_0(x) = x^2\\cos\\pi x` for a numpy array or a tensor."""
    if isinstance(x, torch.Tensor):
        return x * x * torch.cos(math.pi * x)
    x = np.asarray(x, dtype=np.float64)
    return x * x * np.cos(np.pi * x)


def _etdrk4_coefficients(L: np.ndarray, h: float, contour: int):
    """ETDRK4 coefficients ``E, E2, Q, f1, f2, f3`` for the diagonal operator ``L`` and step
    ``h`` by contour integrals (Kassam & Trefethen 2005)."""
    r = np.exp(1j * np.pi * (np.arange(1, contour + 1) - 0.5) / contour)
    LR = h * L[:, None] + r[None, :]
    eLR = np.exp(LR)
    Q = h * np.real(np.mean((np.exp(LR / 2) - 1) / LR, axis=1))
    f1 = h * np.real(np.mean((-4 - LR + eLR * (4 - 3 * LR + LR**2)) / LR**3, axis=1))
    f2 = h * np.real(np.mean((2 + LR + eLR * (LR - 2)) / LR**3, axis=1))
    f3 = h * np.real(np.mean((-4 - 3 * LR - LR**2 + eLR * (4 - LR)) / LR**3, axis=1))
    return np.exp(h * L), np.exp(h * L / 2), Q, f1, f2, f3


def allen_cahn_reference(t: npt.ArrayLike, n_modes: int = 2048, dt: float = 1e-3,
                         d: float = D, r: float = R,
                         contour: int = 64) -> tuple[np.ndarray, np.ndarray]:
    r"""The solution on the periodic grid :math:`x_j = -1 + 2j/n` (``n = n_modes``) at the
    increasing times ``t`` (the first :math:`\ge 0`), by Fourier pseudo-spectral ETDRK4
    (module docstring). Each output interval is split into ``ceil(interval / dt)`` equal
    steps. Returns ``x (n,)`` and ``u (n, len(t))``, float64."""
    n = int(n_modes)
    if n < 8 or n % 2:
        raise ValueError(f"ref_modes must be an even number >= 8, got {n_modes}")
    if not dt > 0:
        raise ValueError(f"ref_dt must be > 0, got {dt}")
    t = np.atleast_1d(np.asarray(t, dtype=np.float64))
    if t.ndim != 1 or t[0] < 0 or (np.diff(t) < 0).any():
        raise ValueError("allen_cahn_reference needs increasing times t >= 0")
    x = -1.0 + 2.0 * np.arange(n) / n
    k = np.arange(n // 2 + 1)
    L = -d * (np.pi * k) ** 2 + r
    v = np.fft.rfft(initial_condition(x))
    out = np.empty((n, t.size))
    coeffs: dict[float, tuple] = {}

    def nonlinear(vh):
        w = np.fft.irfft(vh, n)
        return -r * np.fft.rfft(w * w * w)

    now = 0.0
    for j, tj in enumerate(t):
        gap = tj - now
        steps = int(math.ceil(gap / dt - 1e-9)) if gap > 0 else 0
        if steps:
            h = gap / steps
            key = round(h, 15)
            if key not in coeffs:
                coeffs[key] = _etdrk4_coefficients(L, h, contour)
            E, E2, Q, f1, f2, f3 = coeffs[key]
            for _ in range(steps):
                Nv = nonlinear(v)
                a = E2 * v + Q * Nv
                Na = nonlinear(a)
                b = E2 * v + Q * Na
                Nb = nonlinear(b)
                c = E2 * a + Q * (2 * Nb - Nv)
                Nc = nonlinear(c)
                v = E * v + f1 * Nv + 2 * f2 * (Na + Nb) + f3 * Nc
            now = tj
        out[:, j] = np.fft.irfft(v, n)
    return x, out


def _constraints(cfg) -> bool:
    """``True`` for ``constraints = "hard"``; a one-line error for anything but hard/soft."""
    name = str(cfg.constraints)
    if name not in ("soft", "hard"):
        raise ValueError(f"allen_cahn_pinn: constraints must be 'soft' or 'hard', got {name!r}")
    return name == "hard"


def _eps_list(cfg) -> list[float]:
    raw = cfg.causal_eps
    values = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"allen_cahn_pinn: causal_eps must be numbers such as 0.01,0.1,1, got "
                         f"{raw!r}") from None


KINK_SLOPE = 2.0   # -u0'(1): u0 = -1 + 2|y| + O(y^2) at the distance |y| from x = ±1


def smoothed_kink(s: torch.Tensor, t: torch.Tensor, d: float = D) -> torch.Tensor:
    r""":math:`G(s, t) = s\,\mathrm{erf}\big(s / 2\sqrt{dt}\big)
    + 2\sqrt{dt/\pi}\;e^{-s^2/4dt}`, the heat kernel's smoothing of :math:`|s|` over a time
    :math:`t`: :math:`G_t = d\,G_{ss}`, :math:`G(s, 0) = |s|`, smooth in :math:`s` for
    :math:`t > 0` with :math:`G_s(0, t) = 0` and :math:`G - |s|` confined to
    :math:`|s| \lesssim 10\sqrt{dt}`. Tensors of one shape; ``t >= 0`` (``t = 0`` gives
    :math:`|s|`, its ``t``-derivative there is not used)."""
    # 2 sqrt(d t) > 0: at t = 0, s / w and the powers of 1 / w in the derivatives stay
    # finite (G then differs from |s| by w / sqrt(pi): 1e-17 in float64, 1e-8 in float32)
    w = 2.0 * torch.sqrt(d * t.clamp_min(1e-30 if t.dtype == torch.float64 else 1e-12))
    return s * torch.special.erf(s / w) + w / math.sqrt(math.pi) * torch.exp(-(s / w) ** 2)


def kink_layer(x: torch.Tensor, t: torch.Tensor | None, d: float = D,
               r: float = R) -> torch.Tensor:
    r"""The kink of :math:`u_0` at :math:`x = \pm 1` and its boundary layer,
    :math:`K(x, t) = 2\,e^{-2rt}\,\chi(x)\,G(1 - |x|, t)` with
    :math:`\chi(x) = \sin^4(\pi x / 2)` (:func:`smoothed_kink`; module docstring, "The kink
    ansatz"). 2-periodic in :math:`x`, smooth for :math:`t > 0`; at :math:`t = 0` it is
    :math:`2\chi(x)(1 - |x|)`, which has the kink of :math:`u_0` (:math:`u_0 + 1 \approx
    2|y|` at the distance :math:`|y|` from :math:`\pm 1`) and no other (:math:`\chi` vanishes
    to fourth order at :math:`x = 0`); ``t = None`` gives that, exactly."""
    chi = torch.sin(0.5 * math.pi * x) ** 4
    if t is None:
        return KINK_SLOPE * chi * (1.0 - x.abs())
    return KINK_SLOPE * torch.exp(-2.0 * r * t) * chi * smoothed_kink(1.0 - x.abs(), t, d)


class AllenCahnNet(torch.nn.Module):
    r""":math:`u(x, t) = u_0(x) + t\,N(\varphi(x), t)` (``hard``) or :math:`N(\varphi(x), t)`,
    :math:`\varphi(x) = (\cos k\pi x, \sin k\pi x)_{k=1..K}`: 2-periodic in :math:`x` for any
    network :math:`N` (``net``, ``2K + 1`` inputs, scalar output). With ``kink`` the model
    adds :func:`kink_layer` :math:`K(x, t)`: :math:`N + K` (soft) or
    :math:`u_0 - K(x, 0) + t N + K(x, t)` (hard, still :math:`u_0` at :math:`t = 0`), so the
    network only fits what is smooth. Points ``(..., 2)`` of ``(x, t)`` to ``(...)``."""

    def __init__(self, net: torch.nn.Module, harmonics: int = 1, hard: bool = True,
                 kink: bool = False, d: float = D, r: float = R):
        super().__init__()
        if int(harmonics) < 1:
            raise ValueError(f"allen_cahn_pinn: harmonics must be >= 1, got {harmonics}")
        self.net = net
        self.hard = bool(hard)
        self.kink = bool(kink)
        self.d, self.r = float(d), float(r)
        # float64, so that sin(k pi x) at x = -1 and 1 agree to round-off
        self.register_buffer("freq", math.pi * torch.arange(1, int(harmonics) + 1,
                                                            dtype=torch.float64))

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        x, t = p[..., 0], p[..., 1]
        kx = x[..., None] * self.freq
        u = self.net(torch.cat((torch.cos(kx), torch.sin(kx), t[..., None]), -1))
        if self.hard:
            u = initial_condition(x) + t * u
            if self.kink:
                u = u - kink_layer(x, None)
        if self.kink:
            u = u + kink_layer(x, t, self.d, self.r)
        return u


class AllenCahnPINN(AdamLBFGSTraining, deepsolve.Problem):
    target_metric = "u_rel_l2"  # what --set target=LEVEL names
    published = (   # the best published results (benchmarks/pinn_table.py)
        Published("Wang, Sankaran, Wang & Perdikaris, JAX-PI, arXiv:2308.08468 (2023)",
                  "causal training, Fourier features, Adam", "float32", "5.37e-5", "—",
                  "GPU"),
        Published("Wang, Li, Chen & Perdikaris, PirateNets, arXiv:2402.00326 (2024)",
                  "residual adaptive networks, Adam", "float32", "2.24e-5", "—", "GPU"),
        Published("Toscano et al., arXiv:2509.14198 (2025)", "vRBA + SSBroyden, 3×30 MLP",
                  "float64", "2.1e-6", "—", "GPU"),
    )
    defaults = {
        # trainer
        "iterations": 2000,        # total trainer iterations (warm-up + second-order steps)
        "time_limit": 15.0,        # minutes: whichever of the two comes first ends the run
        "lr": 1e-3,                # Adam learning rate
        "lr_decay": 0.9,           # Adam learning rate × lr_decay every lr_decay_every steps
        "lr_decay_every": 1000,
        "eval_every": 10,
        "checkpoint_every": 50,
        "dtype": "float64",        # precision of the run (of its first phase with switch_at)
        # optimiser
        "optimizer": "ssbroyden",  # "ssbroyden", "bfgs", "gauss_newton", "adam+lbfgs",
                                   # "adam" or "lbfgs"
        **SECOND_ORDER_SETTINGS,   # warmup, qn_iters, self_scaled, gn_iters, gn_damping,
                                   # jacobian_budget (deepsolve.pinn.SECOND_ORDER_SETTINGS)
        "adam_iterations": 1000,   # "adam+lbfgs": Adam steps before L-BFGS
        "lbfgs_iters": 50,         # L-BFGS inner iterations per trainer iteration
        "lbfgs_history": 50,
        "lbfgs_resample_every": 25,  # new points every K second-order / L-BFGS steps
                                     # (L-BFGS: and a fresh memory)
        "switch_at": -1,           # iteration from which the run is in switch_dtype (-1 never)
        "switch_dtype": "float64",
        # physics
        "d": D,
        # network
        "width": 30,
        "depth": 3,
        "harmonics": 1,            # Fourier features cos(k pi x), sin(k pi x), k = 1..K
        "kink": True,              # add the kink of u0 at x = ±1 and its heat layer (K(x, t))
        "constraints": "hard",     # "hard": u = u0 + t N (+ the kink terms); "soft": an
                                   # initial loss term
        "derivatives": "autograd",  # "autograd" or "func" (torch.func)
        # causal training
        "n_slices": 32,            # M time slices
        "n_per_slice": 128,        # collocation points per slice
        "residual_budget": "",     # e.g. "16MiB": chunk the residual ("" = the run's budget)
        "causal_eps": [1.0, 10.0, 100.0],  # raised when min weight > threshold
        "causal_threshold": 0.99,
        "sampling": "uniform",     # "uniform", "sobol", "halton" or "lhs"
        "resample_every": 1,       # redraw the points every K Adam iterations (0 = never)
        # soft initial condition
        "n_initial": 256,
        "initial_weight": 100.0,
        "weighting": "fixed",      # "fixed" or "annealing" (soft constraints)
        "anneal_alpha": 0.9,
        "anneal_every": 100,
        # reference and evaluation
        "ref_modes": 8192,
        "ref_dt": 1e-3,
        "test_nx": 512,
        "test_nt": 201,
    }

    def build(self, ctx):
        cfg = ctx.cfg
        dtype, device = ctx.dtype, ctx.device
        seed = int(cfg.seed)
        hard = _constraints(cfg)
        if str(cfg.derivatives) not in ("autograd", "func"):
            raise ValueError(f"allen_cahn_pinn: derivatives must be 'autograd' or 'func', got "
                             f"{cfg.derivatives!r}")
        m, n = int(cfg.n_slices), int(cfg.n_per_slice)
        if m < 1 or n < 1:
            raise ValueError(f"allen_cahn_pinn: n_slices and n_per_slice must be >= 1, got "
                             f"{m} and {n}")
        nx, nt, modes = int(cfg.test_nx), int(cfg.test_nt), int(cfg.ref_modes)
        if nx < 2 or nt < 2 or modes % nx:
            raise ValueError(f"allen_cahn_pinn: ref_modes ({modes}) must be a multiple of "
                             f"test_nx ({nx}), and test_nx, test_nt >= 2")
        causal = CausalWeighting(_eps_list(cfg), threshold=float(cfg.causal_threshold),
                                 freeze=True)
        method = str(cfg.sampling)

        def sampler(count, s):
            return sample_time_slices(m, count // m, (-1.0,), (1.0,), 0.0, 1.0, method, s,
                                      dtype, device).reshape(-1, 2)

        coll = Collocation(sampler, m * n, resample_every=int(cfg.resample_every), seed=seed)
        tg = np.linspace(0.0, 1.0, nt)
        key = {"version": 1, "test_nt": nt, "ref_modes": modes, "ref_dt": float(cfg.ref_dt),
               "d": float(cfg.d)}   # computed once, read back by plan, check and --resume

        def reference():
            x, u = allen_cahn_reference(tg, modes, float(cfg.ref_dt), float(cfg.d))
            return {"x": x, "u": u}

        ref = ctx.cache("allen_cahn_reference", key, reference)
        xr, ur = ref["x"].numpy(), ref["u"].numpy()
        xg, exact = xr[:: modes // nx], ur[:: modes // nx]
        X, T = np.meshgrid(xg, tg, indexing="ij")
        x0 = -1.0 + 2.0 * unit_samples(int(cfg.n_initial), 1, method, seed + 1)[:, 0]

        def t_(a):
            return torch.as_tensor(a, dtype=torch.float64).to(dtype=dtype, device=device)

        k = int(cfg.harmonics)
        net = FNN(2 * k + 1, 1, int(cfg.width), int(cfg.depth), lo=(-1.0,) * (2 * k) + (0.0,),
                  hi=(1.0,) * (2 * k) + (1.0,), scalar=True)
        ctx.model = AllenCahnNet(net, k, hard, bool(cfg.kink), float(cfg.d)).to(
            device=device, dtype=dtype)
        weights = make_weights(str(cfg.weighting),
                               {"pde": 1.0, "initial": float(cfg.initial_weight)}
                               if not hard else {"pde": 1.0}, reference=("pde",),
                               alpha=float(cfg.anneal_alpha), every=int(cfg.anneal_every),
                               until=self._adapt_until(ctx))
        ctx.data = {
            "collocation": coll,
            "causal": causal,
            "x_initial": t_(np.stack([x0, np.zeros_like(x0)], 1)),
            "u_initial": t_(initial_condition(x0)),
            "test": t_(np.stack([X.ravel(), T.ravel()], 1)),
            "test_exact": t_(exact.ravel()),
            "weights": weights,
        }

    # physics ----------------------------------------------------------------------------
    def pde(self, ctx, x, backend: str | None = None):
        """Residual ``u_t - d u_xx + 5 u^3 - 5 u`` at points ``(N, 2)`` of ``(x, t)``,
        ``(N,)``."""
        j = jet(ctx.model, x, 2, backend=backend or str(ctx.cfg.derivatives),
                hessian_pairs=((0, 0),))
        u = j.value
        return j.jacobian[:, 1] - float(ctx.cfg.d) * j.d(None, 0, 0) + R * (u * u * u - u)

    def collocation_iteration(self, ctx, iteration):
        """The iteration whose collocation set is used. L-BFGS keeps the last Adam set; with
        ``lbfgs_resample_every = K > 0`` (and ``resample_every = R > 0``) block ``b`` of
        ``K`` L-BFGS steps uses the set of iteration ``last + b R``, a new one per block."""
        if self.adam_phase(ctx, iteration):
            return iteration
        start = self.lbfgs_start(ctx)
        last = max(start - 1, 0)
        every, r = int(ctx.cfg.lbfgs_resample_every), int(ctx.cfg.resample_every)
        if every <= 0 or r <= 0:
            return last
        return last + (iteration - start) // every * r

    def on_step(self, ctx, iteration):
        """Called by the optimizer before each step (:class:`deepsolve.pinn.AdamLBFGS`);
        ``True`` resets the L-BFGS memory. From ``switch_at`` on the model and data are in
        ``switch_dtype``; in the L-BFGS phase the objective also changes when the causal
        ``eps`` advances and when a new block of ``lbfgs_resample_every`` steps draws new
        points — the memory is reset then too."""
        cfg = ctx.cfg
        switched = self.switch_precision_at(ctx, iteration)
        if self.adam_phase(ctx, iteration):
            return switched
        advanced = ctx.data["causal"].advance(iteration)
        start, every = self.lbfgs_start(ctx), int(cfg.lbfgs_resample_every)
        new_set = every > 0 and iteration > start and (iteration - start) % every == 0
        if self._optimizer_name(ctx) in SECOND_ORDER:
            new_set = False   # the quasi-Newton matrix is carried across a new point set
        return switched or advanced or new_set

    def least_squares_terms(self, ctx, iteration):
        """The causal loss as one residual vector (for ``optimizer = "gauss_newton"``):
        ``(1/M) sum_i w_i L_i`` is the mean over all points of ``w_i r^2``, so each point
        carries its slice's weight :math:`w_i` as a third column and its residual is
        ``sqrt(w_i) r``. The weights are this iteration's (computed here from the current
        slice losses and frozen, so the closure's loss uses the same ones)."""
        d, cfg = ctx.data, ctx.cfg
        x = d["collocation"].points(self.collocation_iteration(ctx, iteration)).to(d["test"].dtype)
        m = int(cfg.n_slices)
        with torch.no_grad():
            sq = self.pde(ctx, x).pow(2).reshape(m, -1)
        d["causal"](sq, iteration)        # this iteration's weights, frozen
        w = d["causal"].weights.to(x).repeat_interleave(x.shape[0] // m)
        pts = torch.cat([x, w[:, None]], 1)
        weight = float(d["weights"].get("pde", 1.0))
        terms = [LeastSquaresTerm(lambda p: p[:, 2].sqrt() * self.pde(ctx, p[:, :2], "func"),
                                  pts, weight)]
        if not _constraints(cfg):
            init = torch.cat([d["x_initial"], d["u_initial"][:, None]], 1)
            terms.append(LeastSquaresTerm(lambda p: ctx.model(p[:, :2]) - p[:, 2], init,
                                          float(d["weights"].get("initial", 1.0))))
        return terms

    def residuals(self, ctx, iteration):
        d, cfg = ctx.data, ctx.cfg
        x = d["collocation"].points(self.collocation_iteration(ctx, iteration)).to(d["test"].dtype)
        m = int(cfg.n_slices)
        budget = str(cfg.residual_budget or cfg.budget) or None
        chunk = None
        if budget is not None:  # chunks recomputed in backward: memory follows the budget
            key = (budget, x.dtype, x.shape[0])
            if d.get("chunk_key") != key:
                d["chunk"] = chunk_size_for_budget(lambda xc: self.pde(ctx, xc).pow(2).mean(),
                                                   x, budget)
                d["chunk_key"] = key
            chunk = d["chunk"]
        losses = slice_mse(lambda xc: self.pde(ctx, xc), x, m, chunk,
                           params=list(ctx.model.parameters()))
        terms = {"pde": d["causal"](losses, iteration)}
        if not _constraints(cfg):
            terms["initial"] = (ctx.model(d["x_initial"]) - d["u_initial"]).pow(2).mean()
        d["weights"].update_from(terms, ctx.model.parameters(), iteration)
        return terms

    def state_dict(self, ctx):
        """The shared restart state (weights, collocation set, precision) and the causal
        schedule."""
        return {**super().state_dict(ctx), "causal": ctx.data["causal"].state_dict()}

    def load_state_dict(self, ctx, state):
        super().load_state_dict(ctx, state)
        ctx.data["causal"].load_state_dict(state["causal"])

    def scheduler(self, ctx, opt):
        """Adam's learning rate times ``lr_decay`` every ``lr_decay_every`` steps (a smooth
        exponential; the trainer steps it every iteration and saves it in restart files)."""
        decay, every = float(ctx.cfg.lr_decay), int(ctx.cfg.lr_decay_every)
        if not (0 < decay <= 1) or every < 1:
            raise ValueError(f"allen_cahn_pinn: need 0 < lr_decay <= 1 and lr_decay_every >= 1, "
                             f"got {decay} and {every}")
        if decay == 1 or self.lbfgs_start(ctx) == 0:
            return None   # (no Adam step to decay: a second-order optimizer from the start)
        return torch.optim.lr_scheduler.ExponentialLR(opt.adam, gamma=decay ** (1.0 / every))

    def evaluate(self, ctx):
        d = ctx.data
        pred = ctx.model(d["test"])
        err = pred - d["test_exact"]
        causal = d["causal"]
        out = {"u_rel_l2": float(err.norm() / d["test_exact"].norm()),
               "u_max_error": float(err.abs().max()),
               "causal_eps": causal.eps,
               "causal_min_weight": causal.min_weight,
               "pde_mse": (math.nan if causal.slice_losses is None
                           else float(causal.slice_losses.mean()))}
        if str(ctx.cfg.weighting) == "annealing" and not _constraints(ctx.cfg):
            out["weight_initial"] = float(d["weights"].get("initial", 1.0))
        return out


problem = AllenCahnPINN()
