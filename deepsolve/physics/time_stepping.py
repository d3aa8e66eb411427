r"""One-step time integrators for semi-discrete systems :math:`\dot u = F(u)`.

The spectral solvers (:mod:`~deepsolve.physics.burgers`,
:mod:`~deepsolve.physics.navier_stokes`) reduce a PDE to a system of ODEs for the
Fourier coefficients; this module advances such a system by one step ``dt``.  Every
integrator takes the right-hand side as a plain function, is written with out-of-place
torch operations (differentiable with autograd, any device and dtype, no host
synchronisation) and treats ``u`` as an opaque tensor (any shape, real or complex).

Classical RK4 (:func:`rk4`)
---------------------------
For :math:`\dot u = F(u)`,

.. math::

    k_1 = F(u),\quad k_2 = F(u + \tfrac{\Delta t}{2}k_1),\quad
    k_3 = F(u + \tfrac{\Delta t}{2}k_2),\quad k_4 = F(u + \Delta t\,k_3),\\
    u' = u + \tfrac{\Delta t}{6}\,(k_1 + 2(k_2 + k_3) + k_4),

4th order.  On :math:`\dot u = \lambda u` one step multiplies by
:math:`R(z) = 1 + z + z^2/2 + z^3/6 + z^4/24`, :math:`z = \lambda\Delta t`, whose
stability region reaches :math:`2\sqrt2` along the imaginary axis (advection) and
:math:`\approx 2.785` along the negative real axis (diffusion).  ``dt`` may be a number
or a (broadcastable, differentiable) tensor.

Exponential time differencing RK4 (:func:`etdrk4`)
--------------------------------------------------
For :math:`\dot u = L u + N(u)` with a *diagonal* (per-mode) linear operator :math:`L`,
Cox & Matthews' ETDRK4 integrates the linear part exactly: with :math:`z = \Delta t\,L`,

.. math::

    a &= e^{z/2}u + q\,N(u),\quad b = e^{z/2}u + q\,N(a),\quad
    c = e^{z/2}a + q\,(2N(b) - N(u)),\\
    u' &= e^{z}u + f_1 N(u) + 2f_2\,(N(a) + N(b)) + f_3 N(c),

with the :math:`\varphi`-function coefficients :math:`q, f_1, f_2, f_3` of
:class:`ETDRK4Coefficients`.  Their closed forms cancel catastrophically for small
:math:`|z|`; :func:`etdrk4_phi` evaluates them by Kassam & Trefethen's contour integral
(the mean over points on a circle of radius 1 around each :math:`z`), in float64, which
is accurate to round-off for every :math:`z \le 0`.  For :math:`L = 0` the scheme is
classical RK4.

Solver objects (:class:`SpectralStepper`)
-----------------------------------------
A spectral solver advances Fourier coefficients (``step_hat``); :class:`SpectralStepper`
adds the physical-field interface shared by :class:`~deepsolve.physics.burgers.Burgers1D`
and :class:`~deepsolve.physics.navier_stokes.NavierStokes2D`: ``step``/``__call__`` (one
step, transform in and out) and ``advance`` (many steps, spectral state in between).

References
----------
* W. Kutta, "Beitrag zur naeherungsweisen Integration totaler
  Differentialgleichungen", Z. Math. Phys. 46, 435 (1901); E. Hairer, S. P. Norsett,
  G. Wanner, *Solving Ordinary Differential Equations I*, Springer (1993).
* S. M. Cox, P. C. Matthews, "Exponential time differencing for stiff systems",
  J. Comput. Phys. 176, 430 (2002).
* A.-K. Kassam, L. N. Trefethen, "Fourth-order time-stepping for stiff PDEs", SIAM J.
  Sci. Comput. 26, 1214 (2005).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from deepsolve.physics.grids import PeriodicGrid

__all__ = ["rk4", "ETDRK4Coefficients", "etdrk4_phi", "etdrk4", "SpectralStepper"]

Scalar = float | int | torch.Tensor
RHS = Callable[[torch.Tensor], torch.Tensor]


def rk4(rhs: RHS, u: torch.Tensor, dt: Scalar) -> torch.Tensor:
    r"""One classical RK4 step of size ``dt`` for :math:`\dot u = ` ``rhs(u)``.

    Four evaluations of ``rhs``; the result has the shape of ``u`` (broadcast with ``dt``).
    """
    k1 = rhs(u)
    k2 = rhs(u + (0.5 * dt) * k1)
    k3 = rhs(u + (0.5 * dt) * k2)
    k4 = rhs(u + dt * k3)
    return u + (dt / 6.0) * (k1 + 2.0 * (k2 + k3) + k4)


class ETDRK4Coefficients(NamedTuple):
    r"""Per-mode ETDRK4 coefficients (real) for one step ``dt`` and a diagonal operator :math:`L`.

    Shaped like :math:`L` (for the Burgers solver ``(n//2+1,)``).  With
    :math:`z = \Delta t\,L`:
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


def etdrk4_phi(z: torch.Tensor, dt: float, contour_points: int = 64) -> ETDRK4Coefficients:
    r""":class:`ETDRK4Coefficients` for :math:`z = \Delta t\,L` (real, :math:`\le 0`), in float64.

    Kassam & Trefethen: each :math:`\varphi`-function is the mean of its closed form over
    ``contour_points`` points on the circle of radius 1 around :math:`z`; the functions
    are real on the real axis, so the upper half circle and the real part suffice.
    ``z`` is any float tensor (computed in float64 on its device); cast the result to the
    fields' dtype and device.
    """
    z = z.to(torch.float64)
    zc = z.to(torch.complex128)
    j = torch.arange(1, contour_points + 1, dtype=torch.float64, device=z.device)
    r = torch.exp(1j * math.pi * (j - 0.5) / contour_points)
    lr = zc[..., None] + r
    elr = torch.exp(lr)
    lr3 = lr**3

    def avg(t: torch.Tensor) -> torch.Tensor:
        return dt * t.mean(dim=-1).real

    q = avg((torch.exp(lr / 2) - 1) / lr)
    f1 = avg((-4 - lr + elr * (4 - 3 * lr + lr**2)) / lr3)
    f2 = avg((2 + lr + elr * (lr - 2)) / lr3)
    f3 = avg((-4 - 3 * lr - lr**2 + elr * (4 - lr)) / lr3)
    return ETDRK4Coefficients(torch.exp(z), torch.exp(z / 2), q, f1, f2, f3, 2 * f2)


def etdrk4(nonlinear: RHS, u: torch.Tensor, coeffs: ETDRK4Coefficients) -> torch.Tensor:
    r"""One ETDRK4 (Cox--Matthews) step for :math:`\dot u = L u + N(u)`, ``N = nonlinear``.

    ``coeffs`` from :func:`etdrk4_phi` for this :math:`L` and ``dt`` (cast to ``u``'s real
    dtype and device); four evaluations of ``nonlinear``.  See the module docstring.
    """
    nv = nonlinear(u)
    e2u = coeffs.e2 * u
    a = e2u + coeffs.q * nv
    na = nonlinear(a)
    b = e2u + coeffs.q * na
    nb = nonlinear(b)
    c = coeffs.e2 * a + coeffs.q * (2.0 * nb - nv)
    nc = nonlinear(c)
    return coeffs.e * u + coeffs.f1 * nv + coeffs.f2x2 * (na + nb) + coeffs.f3 * nc


class SpectralStepper:
    """Mixin: the physical-field interface of a solver that steps Fourier coefficients.

    A subclass sets ``self.grid`` (a :class:`~deepsolve.physics.grids.PeriodicGrid`) and
    defines ``step_hat(u_hat) -> u_hat`` on coefficients ``(..., *grid.rfft_shape)``.
    Fields have shape ``(..., *grid.shape)``; outputs keep shape, dtype and device.
    """

    grid: PeriodicGrid

    def step_hat(self, u_hat: torch.Tensor) -> torch.Tensor:
        """One step on spectral coefficients ``(..., *grid.rfft_shape)``."""
        raise NotImplementedError

    def step(self, u: torch.Tensor) -> torch.Tensor:
        """One step on a physical field ``(..., *grid.shape)`` -> same shape."""
        self.grid.check_field(u)
        return self.grid.to_physical(self.step_hat(self.grid.to_spectral(u)))

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        """:meth:`step`."""
        return self.step(u)

    def advance(self, u: torch.Tensor, n_steps: int) -> torch.Tensor:
        """Apply :meth:`step` ``n_steps`` times (spectral state in between)."""
        self.grid.check_field(u)
        u_hat = self.grid.to_spectral(u)
        for _ in range(int(n_steps)):
            u_hat = self.step_hat(u_hat)
        return self.grid.to_physical(u_hat)
