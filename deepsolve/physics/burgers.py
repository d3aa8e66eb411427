r"""Pseudo-spectral solver for the 1D viscous Burgers equation (periodic).

Equation
--------
On the periodic interval :math:`[0, L)` we solve

.. math::

    \partial_t u + u\,\partial_x u = \nu\,\partial_x^2 u
    \quad\Longleftrightarrow\quad
    \partial_t u = \nu\,\partial_x^2 u - \partial_x\!\left(\tfrac12 u^2\right),

with viscosity :math:`\nu \ge 0`.  Two integrals are useful checks:

* the mean (momentum) :math:`M = \int_0^L u\,dx` is invariant for every
  :math:`\nu` (both terms are exact derivatives);
* the energy :math:`E = \int_0^L \tfrac12 u^2\,dx` obeys
  :math:`dE/dt = -\nu\int u_x^2\,dx`, so it is invariant for :math:`\nu = 0`
  (as long as the solution stays smooth).

Exact solutions (Cole--Hopf)
----------------------------
If :math:`\varphi > 0` solves the heat equation :math:`\varphi_t = \nu\varphi_{xx}`
then :math:`u = -2\nu\,\varphi_x/\varphi` solves Burgers.  For

.. math::

    \varphi_0(x) = a + \sum_j b_j \cos(m_j k_0 x + \theta_j),
    \qquad a > \sum_j |b_j|,\quad k_0 = 2\pi/L,

the heat equation gives :math:`\varphi(x,t) = a + \sum_j b_j e^{-\nu m_j^2 k_0^2 t}
\cos(m_j k_0 x + \theta_j) > 0`, so :math:`u` is known in closed form for all
:math:`t` (:func:`cole_hopf`).  These :math:`u` are periodic with zero mean;
the Galilean boost :math:`u(x,t) \to c + u(x - ct, t)` gives exact solutions
with mean :math:`c`.  The Fourier coefficients of :math:`u_0` decay like
:math:`e^{-\eta |m|}` with :math:`\cosh \eta = a/b` for a single mode, so a
grid with :math:`n/3 \gtrsim 30/\eta` modes resolves them to round-off.

Discretisation
--------------
* Layout: a physical field has shape ``(..., n)``; index ``[..., i]`` is the
  point :math:`x_i = iL/n`.  Any leading batch dimensions are allowed.
  :class:`Grid1D` is the one-dimensional :class:`~deepsolve.physics.grids.CubicGrid`:
  wavenumbers, transforms, shape checks, the 2/3 mask and the operator cache are
  those of :mod:`deepsolve.physics.grids`; this module adds the Burgers operators
  (:class:`BurgersOps`).
* Spectral coefficients are ``torch.fft.rfft(u, norm="forward")``, shape
  ``(..., n//2 + 1)``: the Fourier-series coefficients
  :math:`\hat u_m = \langle u\,e^{-i k_m x}\rangle`, :math:`k_m = m k_0`,
  independent of ``n``.
* The nonlinear term is evaluated in conservative form, pseudo-spectrally
  (square in physical space) and dealiased with the strict 2/3 rule
  :math:`P`, which keeps the modes :math:`3|m| < n`:

  .. math::

      N(\hat u) = -\tfrac{i k}{2}\,P\,\widehat{(P u)^2}.

  The square of a field with modes :math:`|m| < n/3` has modes :math:`|m| < 2n/3`,
  whose aliases never land on a retained mode, so :math:`N` is the exact Galerkin
  projection onto the retained modes.  Consequently the semi-discrete system
  conserves :math:`M` exactly and, for :math:`\nu=0`, :math:`E` exactly
  (:math:`\int u\,(u^2)_x\,dx = 0`).
* The linear term :math:`L\hat u = -\nu k^2 \hat u` is diagonal.
* Every time step starts by projecting the state onto the retained modes
  (:math:`\hat u \to P\hat u`), so the stepped solution is the Galerkin
  approximation: after one step, modes with :math:`3|m| \ge n` are zero.  This
  also keeps the unresolved modes out of the RK4 diffusive limit below.

Time stepping
-------------
Two 4th-order one-step methods (the generic integrators of
:mod:`deepsolve.physics.time_stepping` applied to the Galerkin system), both written
with out-of-place torch
operations (differentiable with autograd, any device, float32/float64, no
host synchronisation inside a step):

* ``"etdrk4"`` (default): exponential time differencing RK4 of Cox & Matthews,
  with the :math:`\varphi`-function coefficients evaluated by the contour
  integral of Kassam & Trefethen (in float64, then cast).  The linear part is
  integrated exactly, so there is **no diffusive step restriction**; the
  explicit nonlinear part needs the advective CFL condition
  :math:`\Delta t\,\max|u|\,k_{\max} \lesssim 1` (:math:`k_{\max}` the largest
  retained wavenumber, :math:`\approx n k_0 / 3`).  For :math:`\nu = 0` it is
  exactly classical RK4.  ``nu`` and ``dt`` must be numbers (the coefficients
  are precomputed and cached).
* ``"rk4"``: classical explicit RK4 on the full right-hand side.  Stability
  needs both :math:`\Delta t\,\max|u|\,k_{\max} \lesssim 2.8` (the extent of the
  RK4 stability region along the imaginary axis is :math:`2\sqrt2`) and
  :math:`\Delta t\,\nu\,k_{\max}^2 \lesssim 2.78` (along the negative real axis),
  with the usual safety margin for their combination.  ``nu`` and ``dt`` may be
  (differentiable, broadcastable) tensors.

:func:`cfl_numbers` returns the two dimensionless numbers for a state.

References
----------
* J. M. Burgers, "A mathematical model illustrating the theory of turbulence",
  Adv. Appl. Mech. 1, 171 (1948); E. Hopf, Comm. Pure Appl. Math. 3, 201
  (1950); J. D. Cole, Quart. Appl. Math. 9, 225 (1951).
* S. M. Cox, P. C. Matthews, "Exponential time differencing for stiff
  systems", J. Comput. Phys. 176, 430 (2002).
* A.-K. Kassam, L. N. Trefethen, "Fourth-order time-stepping for stiff PDEs",
  SIAM J. Sci. Comput. 26, 1214 (2005).
* C. Canuto, M. Y. Hussaini, A. Quarteroni, T. A. Zang, *Spectral Methods:
  Fundamentals in Single Domains*, Springer (2006) -- dealiasing, Galerkin
  conservation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from deepsolve.physics import grids, time_stepping
from deepsolve.physics.grids import CubicGrid
from deepsolve.physics.time_stepping import ETDRK4Coefficients

__all__ = [
    "Grid1D",
    "BurgersOps",
    "ETDRK4Coefficients",
    "Burgers1D",
    "spectral_operators",
    "etdrk4_coefficients",
    "to_spectral",
    "to_physical",
    "derivative",
    "nonlinear_hat",
    "rhs_hat",
    "rk4_step",
    "etdrk4_step",
    "energy",
    "momentum",
    "cfl_numbers",
    "cole_hopf",
    "random_initial",
]

Scalar = float | int | torch.Tensor
METHODS = ("etdrk4", "rk4")


# --------------------------------------------------------------------------
# Grid and spectral operators
# --------------------------------------------------------------------------


class Grid1D(CubicGrid):
    r"""Uniform periodic grid of ``n`` points on ``[0, length)``.

    Physical fields have shape ``(..., n)``; wavenumbers are physical,
    :math:`k = 2\pi m / L` for integer ``m``.  The one-dimensional
    :class:`~deepsolve.physics.grids.CubicGrid`: coordinates, transforms, shape
    checks and the 2/3 mask come from :mod:`deepsolve.physics.grids`.
    """

    def __init__(self, n: int, length: float = 2 * math.pi) -> None:
        super().__init__(n, length, ndim=1)

    @property
    def m_max(self) -> int:
        """Largest integer wavenumber kept by the 2/3 rule (``3 m < n``)."""
        return self.cutoffs[0]

    @property
    def k_max(self) -> float:
        """Largest retained physical wavenumber ``m_max * k0`` (enters the CFL numbers)."""
        return self.m_max * self.k0

    @property
    def rfft_size(self) -> int:
        """Size ``n//2 + 1`` of the rfft coefficient array."""
        return self.rfft_shape[0]

    def operators(self, dtype: torch.dtype | None = None, device=None) -> BurgersOps:
        """Cached :class:`BurgersOps` for this grid on ``device`` in ``dtype``."""
        return spectral_operators(self, dtype, device)


class BurgersOps(NamedTuple):
    r"""Precomputed spectral tensors for one grid, device and dtype (shape ``(n//2+1,)``).

    Attributes:
        k: derivative wavenumbers :math:`k_m` (real dtype), Nyquist entry zeroed.
        k2: :math:`k_m^2` with the true (non-zeroed) wavenumbers (real dtype).
        mask: 2/3-rule dealiasing mask, 1 for :math:`3|m| < n`, else 0 (real dtype).
        nl: complex multiplier :math:`-\tfrac{i k}{2} P` of the nonlinear term.
    """

    k: torch.Tensor
    k2: torch.Tensor
    mask: torch.Tensor
    nl: torch.Tensor


@grids.cached_operators(solver="Burgers solver")
def spectral_operators(grid: Grid1D, dtype: torch.dtype, device: torch.device) -> BurgersOps:
    """Build (and cache per ``(grid, dtype, device)``) the spectral tensors.

    Called as ``spectral_operators(grid, dtype=None, device=None)``; ``dtype`` is the
    *real* field dtype (float32 or float64); complex dtypes map to their real part's.
    """
    (k,) = grid.wavenumbers(nyquist=False)  # odd derivatives of a real field: no Nyquist
    mask = grid.dealias_mask()
    nl = -0.5j * k * mask
    return BurgersOps(
        grids.cast(k, dtype, device),
        grids.cast(grid.k2(), dtype, device),
        grids.cast(mask, dtype, device),
        grids.cast(nl, grids.complex_dtype(dtype), device),
    )


# --------------------------------------------------------------------------
# Transforms and diagnostics
# --------------------------------------------------------------------------


def to_spectral(u: torch.Tensor) -> torch.Tensor:
    """Fourier-series coefficients ``rfft(u, norm="forward")``.

    ``(..., n)`` real -> ``(..., n//2+1)`` complex.
    """
    return grids.rfftn(u, 1)


def to_physical(u_hat: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`to_spectral`: ``(..., n//2+1)`` -> ``(..., n)``."""
    return grids.irfftn(u_hat, (n,))


def derivative(u: torch.Tensor, grid: Grid1D, order: int = 1) -> torch.Tensor:
    r"""Spectral derivative :math:`\partial_x^{order} u` of a ``(..., n)`` field.

    For odd orders the Nyquist mode is dropped (it has no real derivative).
    :meth:`PeriodicGrid.derivative <deepsolve.physics.grids.PeriodicGrid.derivative>`
    along the grid's one axis.
    """
    return grid.derivative(u, -1, order)


def energy(u: torch.Tensor, grid: Grid1D) -> torch.Tensor:
    r"""Energy :math:`E = \int_0^L \tfrac12 u^2\,dx` (trapezoid rule), ``(..., n)`` -> ``(...)``.

    Exact (Parseval) for the grid's trigonometric interpolant.
    """
    grid.check_field(u)
    return 0.5 * grid.dx * (u * u).sum(dim=-1)


def momentum(u: torch.Tensor, grid: Grid1D) -> torch.Tensor:
    r"""Mean/momentum :math:`M = \int_0^L u\,dx` (trapezoid rule), ``(..., n)`` -> ``(...)``."""
    grid.check_field(u)
    return grid.dx * u.sum(dim=-1)


def cfl_numbers(u: torch.Tensor, grid: Grid1D, dt: float, nu: float) -> tuple[float, float]:
    r"""``(advective, diffusive)`` = :math:`(\Delta t\max|u|\,k_{\max},\ \Delta t\,\nu k_{\max}^2)`.

    ``k_max`` is the largest retained wavenumber (:attr:`Grid1D.k_max`).  See
    the module docstring for the limits of each method (ETDRK4: advective
    :math:`\lesssim 1`, no diffusive limit; RK4: :math:`\lesssim 2.8` and
    :math:`\lesssim 2.78`).
    """
    umax = float(u.detach().abs().max())
    return dt * umax * grid.k_max, dt * float(nu) * grid.k_max**2


# --------------------------------------------------------------------------
# Right-hand side and time stepping
# --------------------------------------------------------------------------


def nonlinear_hat(u_hat: torch.Tensor, ops: BurgersOps, n: int) -> torch.Tensor:
    r"""Dealiased nonlinear term :math:`N(\hat u) = -\tfrac{ik}{2} P\,\widehat{(Pu)^2}`.

    ``(..., n//2+1)`` complex -> same.  One inverse and one forward FFT.
    """
    return _nonlinear_banded(ops.mask * u_hat, ops, n)


def _nonlinear_banded(u_hat: torch.Tensor, ops: BurgersOps, n: int) -> torch.Tensor:
    """:func:`nonlinear_hat` for ``u_hat`` already in the retained band (``P u = u``)."""
    u = to_physical(u_hat, n)
    return ops.nl * to_spectral(u * u)


def rhs_hat(u_hat: torch.Tensor, ops: BurgersOps, n: int, nu: Scalar) -> torch.Tensor:
    r"""Spectral time derivative :math:`-\nu k^2\hat u + N(\hat u)`.

    ``nu`` may be a number or a tensor broadcastable to ``(..., 1)``.
    """
    return -(nu * ops.k2) * u_hat + nonlinear_hat(u_hat, ops, n)


def _galerkin_state(
    u_hat: torch.Tensor, grid: Grid1D, ops: BurgersOps | None
) -> tuple[torch.Tensor, BurgersOps]:
    """Check ``u_hat``, default ``ops``, and project onto the retained modes (``P u``)."""
    grid.check_spectral(u_hat)
    if ops is None:
        ops = spectral_operators(grid, u_hat.real.dtype, u_hat.device)
    return ops.mask * u_hat, ops


def rk4_step(
    u_hat: torch.Tensor,
    grid: Grid1D,
    dt: Scalar,
    nu: Scalar,
    ops: BurgersOps | None = None,
) -> torch.Tensor:
    """One classical RK4 step of size ``dt`` on spectral coefficients ``(..., n//2+1)``.

    ``nu`` and ``dt`` may be numbers or (broadcastable, differentiable) tensors,
    e.g. of shape ``(..., 1)`` for a per-member viscosity.  See the module
    docstring for the stability limits.  :func:`deepsolve.physics.time_stepping.rk4`
    on the Galerkin right-hand side.
    """
    u_hat, ops = _galerkin_state(u_hat, grid, ops)
    n = grid.n
    lin = -(nu * ops.k2)

    def f(v: torch.Tensor) -> torch.Tensor:  # the stages stay in the band
        return lin * v + _nonlinear_banded(v, ops, n)

    return time_stepping.rk4(f, u_hat, dt)


@functools.lru_cache(maxsize=64)
def _etdrk4_coefficients(
    grid: Grid1D, dt: float, nu: float, dtype: torch.dtype, device: torch.device,
    contour_points: int,
) -> ETDRK4Coefficients:
    coeffs = time_stepping.etdrk4_phi(-nu * dt * grid.k2(), dt, contour_points)
    return ETDRK4Coefficients(*(grids.cast(c, dtype, device) for c in coeffs))


def _as_number(x: Scalar, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            raise TypeError(f"ETDRK4 needs a number for {name} (its coefficients are "
                            "precomputed); use method='rk4' to differentiate with respect "
                            f"to {name}")
        if x.numel() != 1:
            raise TypeError(f"ETDRK4 needs a single {name}, got a tensor of shape "
                            f"{tuple(x.shape)}; use method='rk4' for per-member values")
        return float(x)
    return float(x)


def etdrk4_coefficients(
    grid: Grid1D,
    dt: Scalar,
    nu: Scalar,
    dtype: torch.dtype | None = None,
    device=None,
    contour_points: int = 64,
) -> ETDRK4Coefficients:
    """Cached :class:`ETDRK4Coefficients` for ``grid``, step ``dt`` and viscosity ``nu``.

    :math:`L = -\\nu k^2`, shape ``(n//2+1,)``.  Computed in float64/complex128 with a
    ``contour_points``-point contour integral (accurate to round-off for any
    :math:`z \\le 0`, :func:`deepsolve.physics.time_stepping.etdrk4_phi`), then cast.
    """
    dt_f = _as_number(dt, "dt")
    nu_f = _as_number(nu, "nu")
    if nu_f < 0:
        raise ValueError(f"viscosity must be >= 0, got {nu_f}")
    dtype = grids.real_dtype(dtype, "Burgers solver")
    device = torch.device(device) if device is not None else torch.device("cpu")
    return _etdrk4_coefficients(grid, dt_f, nu_f, dtype, device, int(contour_points))


def etdrk4_step(
    u_hat: torch.Tensor,
    grid: Grid1D,
    coeffs: ETDRK4Coefficients,
    ops: BurgersOps | None = None,
) -> torch.Tensor:
    r"""One ETDRK4 (Cox--Matthews) step on spectral coefficients ``(..., n//2+1)``.

    .. math::

        a &= e_2 \hat u + q N(\hat u),\quad b = e_2\hat u + q N(a),\quad
        c = e_2 a + q\,(2N(b) - N(\hat u)),\\
        \hat u' &= e\,\hat u + f_1 N(\hat u) + 2 f_2 (N(a) + N(b)) + f_3 N(c).

    ``coeffs`` from :func:`etdrk4_coefficients` (same grid, dtype and device);
    :func:`deepsolve.physics.time_stepping.etdrk4` on the Galerkin nonlinear term.
    """
    u_hat, ops = _galerkin_state(u_hat, grid, ops)
    n = grid.n
    return time_stepping.etdrk4(lambda v: _nonlinear_banded(v, ops, n), u_hat, coeffs)


# --------------------------------------------------------------------------
# Convenience object operating on physical fields
# --------------------------------------------------------------------------


class Burgers1D(time_stepping.SpectralStepper):
    """Pseudo-spectral 1D Burgers stepper on physical fields ``(..., n)``.

    Args:
        grid: the :class:`Grid1D`.
        nu: viscosity (>= 0). A number for ``"etdrk4"``; number or tensor for ``"rk4"``.
        dt: time step.
        method: ``"etdrk4"`` (default, exact linear part, only the advective CFL limit)
            or ``"rk4"`` (classical RK4; advective and diffusive limits).

    :meth:`step` maps ``u`` to ``u`` one ``dt`` later (same shape, dtype, device);
    :meth:`step_hat` does the same on rfft coefficients (cheaper inside long loops);
    :meth:`advance` takes ``n_steps`` (``step``, ``__call__`` and ``advance`` from
    :class:`~deepsolve.physics.time_stepping.SpectralStepper`).
    """

    grid: Grid1D

    def __init__(self, grid: Grid1D, nu: Scalar, dt: Scalar, method: str = "etdrk4") -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "etdrk4":
            _as_number(nu, "nu")
            _as_number(dt, "dt")
        if not isinstance(nu, torch.Tensor) and nu < 0:
            raise ValueError(f"viscosity must be >= 0, got {nu}")
        self.grid = grid
        self.nu = nu
        self.dt = dt
        self.method = method

    def __repr__(self) -> str:
        return f"Burgers1D(grid={self.grid}, nu={self.nu}, dt={self.dt}, method={self.method!r})"

    def step_hat(self, u_hat: torch.Tensor) -> torch.Tensor:
        """One step on spectral coefficients ``(..., n//2+1)``."""
        dtype, device = u_hat.real.dtype, u_hat.device
        ops = spectral_operators(self.grid, dtype, device)
        if self.method == "rk4":
            return rk4_step(u_hat, self.grid, self.dt, self.nu, ops)
        coeffs = etdrk4_coefficients(self.grid, self.dt, self.nu, dtype, device)
        return etdrk4_step(u_hat, self.grid, coeffs, ops)

    def rhs(self, u: torch.Tensor) -> torch.Tensor:
        r"""Semi-discrete :math:`\partial_t u` of a physical field (same shape)."""
        self.grid.check_field(u)
        ops = self.grid.operators_for(u)
        return to_physical(rhs_hat(to_spectral(u), ops, self.grid.n, self.nu), self.grid.n)

    def energy(self, u: torch.Tensor) -> torch.Tensor:
        r""":math:`\int \tfrac12 u^2\,dx`, see :func:`energy`."""
        return energy(u, self.grid)

    def momentum(self, u: torch.Tensor) -> torch.Tensor:
        r""":math:`\int u\,dx`, see :func:`momentum`."""
        return momentum(u, self.grid)

    def cfl_numbers(self, u: torch.Tensor) -> tuple[float, float]:
        """``(advective, diffusive)`` CFL numbers, see :func:`cfl_numbers`."""
        return cfl_numbers(u, self.grid, float(self.dt), float(self.nu))


# --------------------------------------------------------------------------
# Exact solutions and initial conditions
# --------------------------------------------------------------------------


def cole_hopf(
    grid: Grid1D,
    t: float,
    nu: float,
    a: float = 1.0,
    amplitudes: Sequence[float] = (0.5,),
    wavenumbers: Sequence[int] = (1,),
    phases: Sequence[float] | None = None,
    drift: float = 0.0,
    x: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    r"""Exact Burgers solution :math:`u = c - 2\nu\,\varphi_x/\varphi` at time ``t``.

    :math:`\varphi(\xi, t) = a + \sum_j b_j e^{-\nu (m_j k_0)^2 t}\cos(m_j k_0 \xi +
    \theta_j)` evaluated at :math:`\xi = x - c t` (Galilean boost with velocity
    :math:`c` = ``drift``, which is then the mean of :math:`u`), so that

    .. math::

        u(x, t) = c + \frac{2\nu\sum_j b_j m_j k_0\, e^{-\nu (m_j k_0)^2 t}
                  \sin(m_j k_0\xi + \theta_j)}{\varphi(\xi, t)}.

    Requires ``nu > 0``, ``a > sum |b_j|`` (so :math:`\varphi > 0`) and integer
    ``wavenumbers`` ``m_j`` (periodicity).  ``x`` defaults to the grid
    coordinates; the result has the shape of ``x``.
    """
    if not nu > 0:
        raise ValueError(f"Cole-Hopf needs nu > 0, got {nu}")
    amplitudes = list(amplitudes)
    wavenumbers = list(wavenumbers)
    phases = [0.0] * len(amplitudes) if phases is None else list(phases)
    if not len(amplitudes) == len(wavenumbers) == len(phases):
        raise ValueError("amplitudes, wavenumbers and phases must have the same length")
    if not a > sum(abs(b) for b in amplitudes):
        raise ValueError(f"need a > sum |b_j| for a positive phi, got a={a}, b={amplitudes}")
    if any(int(m) != m for m in wavenumbers):
        raise ValueError(f"wavenumbers must be integers, got {wavenumbers}")
    dtype = grids.real_dtype(dtype if x is None else x.dtype, "Burgers solver")
    if x is None:
        x = grid.coords(torch.float64, device)
    xi = x.to(torch.float64) - drift * t
    phi = torch.full_like(xi, float(a))
    dphi = torch.zeros_like(xi)
    for b, m, th in zip(amplitudes, wavenumbers, phases, strict=True):
        k = m * grid.k0
        g = b * math.exp(-nu * k * k * t)
        arg = k * xi + th
        phi = phi + g * torch.cos(arg)
        dphi = dphi - g * k * torch.sin(arg)
    return (drift - 2.0 * nu * dphi / phi).to(dtype)


def random_initial(
    grid: Grid1D,
    generator: torch.Generator | None = None,
    batch_shape: tuple[int, ...] = (),
    peak_wavenumber: float = 3.0,
    max_wavenumber: int | None = None,
    rms: float = 0.5,
    mean: float = 0.0,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    r"""Smooth random field of shape ``(*batch_shape, n)`` with the given ``rms`` and ``mean``.

    Fourier coefficients :math:`\hat u_m = (\xi_m + i\eta_m)\,e^{-(m/m_p)^2}` for
    integer :math:`1 \le m \le` ``max_wavenumber`` (default and upper limit: the
    2/3-rule cut-off :attr:`Grid1D.m_max`), with standard normal
    :math:`\xi, \eta` drawn from ``generator`` (in float64 on the CPU, so the
    field is the same on every device and dtype) and :math:`m_p` =
    ``peak_wavenumber``.  The fluctuation is scaled to root-mean-square ``rms``
    per member, then ``mean`` is added.
    """
    dtype = grids.real_dtype(dtype, "Burgers solver")
    m_top = grid.m_max if max_wavenumber is None else min(int(max_wavenumber), grid.m_max)
    if m_top < 1:
        raise ValueError(f"no mode to fill: max_wavenumber={max_wavenumber}, grid n={grid.n}")
    noise = torch.randn(*batch_shape, 2, m_top, generator=generator, dtype=torch.float64)
    m = torch.arange(1, m_top + 1, dtype=torch.float64)
    envelope = torch.exp(-((m / peak_wavenumber) ** 2))
    coeffs = torch.complex(noise[..., 0, :], noise[..., 1, :]) * envelope
    u_hat = torch.zeros(*batch_shape, grid.rfft_size, dtype=torch.complex128)
    u_hat = torch.cat((u_hat[..., :1], coeffs, u_hat[..., m_top + 1:]), dim=-1)
    u = to_physical(u_hat, grid.n)
    u = u * (rms / u.pow(2).mean(dim=-1, keepdim=True).sqrt())
    return (u + mean).to(dtype=dtype, device=device)
