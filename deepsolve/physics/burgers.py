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
Two 4th-order one-step methods, both written with out-of-place torch
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

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

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


@dataclasses.dataclass(frozen=True)
class Grid1D:
    r"""Uniform periodic grid of ``n`` points on ``[0, length)``.

    Physical fields have shape ``(..., n)``; wavenumbers are physical,
    :math:`k = 2\pi m / L` for integer ``m``.
    """

    n: int
    length: float = 2 * math.pi

    def __post_init__(self) -> None:
        if int(self.n) != self.n or self.n < 2:
            raise ValueError(f"grid size n must be an integer >= 2, got {self.n!r}")
        if not self.length > 0:
            raise ValueError(f"domain length must be positive, got {self.length!r}")

    @property
    def dx(self) -> float:
        """Grid spacing ``length / n``."""
        return self.length / self.n

    @property
    def k0(self) -> float:
        """Fundamental wavenumber ``2 pi / length``."""
        return 2 * math.pi / self.length

    @property
    def m_max(self) -> int:
        """Largest integer wavenumber kept by the 2/3 rule (``3 m < n``)."""
        return (self.n - 1) // 3

    @property
    def k_max(self) -> float:
        """Largest retained physical wavenumber ``m_max * k0`` (enters the CFL numbers)."""
        return self.m_max * self.k0

    @property
    def rfft_size(self) -> int:
        """Size ``n//2 + 1`` of the rfft coefficient array."""
        return self.n // 2 + 1

    def coords(self, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """Coordinates ``x_i = i * dx``, shape ``(n,)``."""
        dtype = dtype or torch.get_default_dtype()
        return torch.arange(self.n, dtype=torch.float64, device=device).to(dtype) * self.dx

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


def _real_dtype(dtype: torch.dtype | None) -> torch.dtype:
    dtype = dtype or torch.get_default_dtype()
    if dtype.is_complex:
        dtype = torch.empty((), dtype=dtype).real.dtype
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"Burgers solver supports float32 and float64, got {dtype}")
    return dtype


def _complex_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


@functools.lru_cache(maxsize=64)
def _spectral_operators(grid: Grid1D, dtype: torch.dtype, device: torch.device) -> BurgersOps:
    n = grid.n
    m = torch.fft.rfftfreq(n, d=1.0 / n, dtype=torch.float64)
    k_true = grid.k0 * m
    k = k_true.clone()
    if n % 2 == 0:  # odd derivatives of a real field vanish at the Nyquist mode
        k[n // 2] = 0.0
    mask = (3 * m.abs() < n).to(torch.float64)
    nl = -0.5j * k * mask

    def cast(t: torch.Tensor, dt: torch.dtype = dtype) -> torch.Tensor:
        return t.to(dtype=dt, device=device).contiguous()

    return BurgersOps(cast(k), cast(k_true**2), cast(mask), cast(nl, _complex_dtype(dtype)))


def spectral_operators(grid: Grid1D, dtype: torch.dtype | None = None, device=None) -> BurgersOps:
    """Build (and cache per ``(grid, dtype, device)``) the spectral tensors.

    ``dtype`` is the *real* field dtype; complex dtypes map to their real part's.
    """
    dtype = _real_dtype(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    return _spectral_operators(grid, dtype, device)


def _ops_for(grid: Grid1D, x: torch.Tensor) -> BurgersOps:
    return spectral_operators(grid, x.dtype, x.device)


def _check_shape(grid: Grid1D, u: torch.Tensor) -> None:
    if u.dim() < 1 or u.shape[-1] != grid.n:
        raise ValueError(f"expected a field of shape (..., {grid.n}), got {tuple(u.shape)}")


def _check_hat_shape(grid: Grid1D, u_hat: torch.Tensor) -> None:
    if u_hat.dim() < 1 or u_hat.shape[-1] != grid.rfft_size:
        raise ValueError(
            f"expected rfft coefficients of shape (..., {grid.rfft_size}), "
            f"got {tuple(u_hat.shape)}"
        )


# --------------------------------------------------------------------------
# Transforms and diagnostics
# --------------------------------------------------------------------------


def to_spectral(u: torch.Tensor) -> torch.Tensor:
    """Fourier-series coefficients ``rfft(u, norm="forward")``.

    ``(..., n)`` real -> ``(..., n//2+1)`` complex.
    """
    return torch.fft.rfft(u, norm="forward")


def to_physical(u_hat: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`to_spectral`: ``(..., n//2+1)`` -> ``(..., n)``."""
    return torch.fft.irfft(u_hat, n=n, norm="forward")


def derivative(u: torch.Tensor, grid: Grid1D, order: int = 1) -> torch.Tensor:
    r"""Spectral derivative :math:`\partial_x^{order} u` of a ``(..., n)`` field.

    For odd orders the Nyquist mode is dropped (it has no real derivative).
    """
    _check_shape(grid, u)
    if order < 0:
        raise ValueError(f"order must be >= 0, got {order}")
    ops = _ops_for(grid, u)
    k = ops.k if order % 2 else torch.sqrt(ops.k2)
    return to_physical(((1j * k) ** order) * to_spectral(u), grid.n)


def energy(u: torch.Tensor, grid: Grid1D) -> torch.Tensor:
    r"""Energy :math:`E = \int_0^L \tfrac12 u^2\,dx` (trapezoid rule), ``(..., n)`` -> ``(...)``.

    Exact (Parseval) for the grid's trigonometric interpolant.
    """
    _check_shape(grid, u)
    return 0.5 * grid.dx * (u * u).sum(dim=-1)


def momentum(u: torch.Tensor, grid: Grid1D) -> torch.Tensor:
    r"""Mean/momentum :math:`M = \int_0^L u\,dx` (trapezoid rule), ``(..., n)`` -> ``(...)``."""
    _check_shape(grid, u)
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
    docstring for the stability limits.
    """
    _check_hat_shape(grid, u_hat)
    if ops is None:
        ops = spectral_operators(grid, u_hat.real.dtype, u_hat.device)
    n = grid.n
    u_hat = ops.mask * u_hat  # the Galerkin state: retained modes only
    lin = -(nu * ops.k2)

    def f(v: torch.Tensor) -> torch.Tensor:  # the stages stay in the band
        return lin * v + _nonlinear_banded(v, ops, n)

    k1 = f(u_hat)
    k2 = f(u_hat + (0.5 * dt) * k1)
    k3 = f(u_hat + (0.5 * dt) * k2)
    k4 = f(u_hat + dt * k3)
    return u_hat + (dt / 6.0) * (k1 + 2.0 * (k2 + k3) + k4)


class ETDRK4Coefficients(NamedTuple):
    r"""Per-mode ETDRK4 coefficients (real dtype, shape ``(n//2+1,)``) for one ``dt, nu``.

    With :math:`z = \Delta t\,L`, :math:`L = -\nu k^2`:
    ``e`` :math:`= e^{z}`, ``e2`` :math:`= e^{z/2}`,
    ``q`` :math:`= \Delta t\,(e^{z/2}-1)/z`,
    ``f1`` :math:`= \Delta t\,(-4 - z + e^z(4 - 3z + z^2))/z^3`,
    ``f2`` :math:`= \Delta t\,(2 + z + e^z(z - 2))/z^3`,
    ``f3`` :math:`= \Delta t\,(-4 - 3z - z^2 + e^z(4 - z))/z^3`
    (their :math:`z\to0` limits are :math:`\Delta t/2, \Delta t/6, \Delta t/6,
    \Delta t/6` for ``q, f1, f2, f3``); ``f2x2`` is ``2 * f2``.
    """

    e: torch.Tensor
    e2: torch.Tensor
    q: torch.Tensor
    f1: torch.Tensor
    f2: torch.Tensor
    f3: torch.Tensor
    f2x2: torch.Tensor  # 2 * f2, precomputed


@functools.lru_cache(maxsize=64)
def _etdrk4_coefficients(
    grid: Grid1D, dt: float, nu: float, dtype: torch.dtype, device: torch.device,
    contour_points: int,
) -> ETDRK4Coefficients:
    n = grid.n
    m = torch.fft.rfftfreq(n, d=1.0 / n, dtype=torch.float64)
    z = (-nu * dt * (grid.k0 * m) ** 2).to(torch.complex128)
    # Kassam & Trefethen: average over points on a circle of radius 1 around each z; the
    # functions are real on the real axis, so the upper half circle and the real part suffice.
    j = torch.arange(1, contour_points + 1, dtype=torch.float64)
    r = torch.exp(1j * math.pi * (j - 0.5) / contour_points)
    lr = z[:, None] + r[None, :]
    elr = torch.exp(lr)
    lr3 = lr**3

    def avg(t: torch.Tensor) -> torch.Tensor:
        return dt * t.mean(dim=-1).real

    q = avg((torch.exp(lr / 2) - 1) / lr)
    f1 = avg((-4 - lr + elr * (4 - 3 * lr + lr**2)) / lr3)
    f2 = avg((2 + lr + elr * (lr - 2)) / lr3)
    f3 = avg((-4 - 3 * lr - lr**2 + elr * (4 - lr)) / lr3)
    zr = z.real

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=dtype, device=device).contiguous()

    return ETDRK4Coefficients(
        cast(torch.exp(zr)), cast(torch.exp(zr / 2)), cast(q), cast(f1), cast(f2), cast(f3),
        cast(2 * f2),
    )


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

    Computed in float64/complex128 with a ``contour_points``-point contour
    integral (accurate to round-off for any :math:`z \\le 0`), then cast.
    """
    dt_f = _as_number(dt, "dt")
    nu_f = _as_number(nu, "nu")
    if nu_f < 0:
        raise ValueError(f"viscosity must be >= 0, got {nu_f}")
    dtype = _real_dtype(dtype)
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

    ``coeffs`` from :func:`etdrk4_coefficients` (same grid, dtype and device).
    """
    _check_hat_shape(grid, u_hat)
    if ops is None:
        ops = spectral_operators(grid, u_hat.real.dtype, u_hat.device)
    n = grid.n
    u_hat = ops.mask * u_hat  # the Galerkin state: retained modes only
    nv = _nonlinear_banded(u_hat, ops, n)  # the stages stay in the band
    e2u = coeffs.e2 * u_hat
    a = e2u + coeffs.q * nv
    na = _nonlinear_banded(a, ops, n)
    b = e2u + coeffs.q * na
    nb = _nonlinear_banded(b, ops, n)
    c = coeffs.e2 * a + coeffs.q * (2.0 * nb - nv)
    nc = _nonlinear_banded(c, ops, n)
    return coeffs.e * u_hat + coeffs.f1 * nv + coeffs.f2x2 * (na + nb) + coeffs.f3 * nc


# --------------------------------------------------------------------------
# Convenience object operating on physical fields
# --------------------------------------------------------------------------


class Burgers1D:
    """Pseudo-spectral 1D Burgers stepper on physical fields ``(..., n)``.

    Args:
        grid: the :class:`Grid1D`.
        nu: viscosity (>= 0). A number for ``"etdrk4"``; number or tensor for ``"rk4"``.
        dt: time step.
        method: ``"etdrk4"`` (default, exact linear part, only the advective CFL limit)
            or ``"rk4"`` (classical RK4; advective and diffusive limits).

    :meth:`step` maps ``u`` to ``u`` one ``dt`` later (same shape, dtype, device);
    :meth:`step_hat` does the same on rfft coefficients (cheaper inside long loops).
    """

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

    def step(self, u: torch.Tensor) -> torch.Tensor:
        """One step on a physical field ``(..., n)`` -> ``(..., n)``."""
        _check_shape(self.grid, u)
        return to_physical(self.step_hat(to_spectral(u)), self.grid.n)

    __call__ = step

    def advance(self, u: torch.Tensor, n_steps: int) -> torch.Tensor:
        """Apply :meth:`step` ``n_steps`` times (spectral state in between)."""
        _check_shape(self.grid, u)
        u_hat = to_spectral(u)
        for _ in range(int(n_steps)):
            u_hat = self.step_hat(u_hat)
        return to_physical(u_hat, self.grid.n)

    def rhs(self, u: torch.Tensor) -> torch.Tensor:
        r"""Semi-discrete :math:`\partial_t u` of a physical field (same shape)."""
        _check_shape(self.grid, u)
        ops = _ops_for(self.grid, u)
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
    dtype = _real_dtype(dtype if x is None else x.dtype)
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
    dtype = _real_dtype(dtype)
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
