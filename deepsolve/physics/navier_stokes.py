r"""Pseudo-spectral solver for 2D incompressible Navier--Stokes (vorticity form).

Equations
---------
On the doubly periodic square :math:`[0, L)^2` we solve

.. math::

    \partial_t \omega + \mathbf u\cdot\nabla\omega
        = \nu \nabla^2 \omega - \alpha\,\omega + f,
    \qquad \nabla^2\psi = -\omega,
    \qquad \mathbf u = (u, v) = (\partial_y \psi,\; -\partial_x \psi),

so that :math:`\omega = \partial_x v - \partial_y u` (counter-clockwise
rotation is positive) and :math:`\nabla\cdot\mathbf u = 0` identically.  The
advection term is written with the Jacobian
:math:`J(\psi, \omega) = \psi_x\omega_y - \psi_y\omega_x = -\mathbf u\cdot\nabla\omega`.
``nu`` is the kinematic viscosity, ``alpha`` a linear (Rayleigh / Ekman)
drag, and :math:`f = \partial_x F_y - \partial_y F_x` the curl of a
time-independent body force :math:`\mathbf F = (F_x, F_y)` acting on the
momentum equation :math:`\partial_t\mathbf u + \mathbf u\cdot\nabla\mathbf u
= -\nabla p + \nu\nabla^2\mathbf u - \alpha\mathbf u + \mathbf F`.

Kolmogorov forcing (:func:`kolmogorov_forcing`) is the body force
:math:`\mathbf F = F_0 \sin(k_f y)\,\hat{\mathbf x}`, whose vorticity forcing is
:math:`f = -\partial_y F_x = -F_0 k_f \cos(k_f y)`.  Its laminar steady state
is :math:`u = U \sin(k_f y),\ v = 0,\ \omega = -U k_f \cos(k_f y)` with
:math:`U = F_0 / (\nu k_f^2 + \alpha)`.

The kinetic-energy budget (domain means :math:`\langle\cdot\rangle`) is

.. math::

    \frac{dE}{dt} = -2\nu Z - 2\alpha E + \langle \mathbf u\cdot\mathbf F\rangle,
    \qquad E = \tfrac12\langle |\mathbf u|^2\rangle,\quad
    Z = \tfrac12\langle\omega^2\rangle,

and for :math:`\nu = \alpha = 0,\ \mathbf F = 0` both :math:`E` and :math:`Z`
are invariants; the 2/3-dealiased Galerkin truncation below conserves them
exactly in the semi-discrete (continuous-time) sense.

Discretisation
--------------
* Layout: a physical field has shape ``(..., n, n)``; index ``[..., i, j]`` is
  the point ``(x_i, y_j) = (i L/n, j L/n)`` (``'ij'`` indexing: x along dim
  ``-2``, y along dim ``-1``).  Any leading batch dimensions are allowed.
* Spectral coefficients are ``torch.fft.rfft2(omega, norm="forward")``, shape
  ``(..., n, n//2 + 1)``; with ``norm="forward"`` they are the Fourier-series
  coefficients :math:`\hat\omega_{\mathbf k} = \langle \omega
  e^{-i\mathbf k\cdot\mathbf x}\rangle`, independent of ``n``.
  :class:`Grid` is the two-dimensional :class:`~deepsolve.physics.grids.CubicGrid`
  (wavenumbers, transforms, shape checks, the 2/3 mask and the operator cache live in
  :mod:`deepsolve.physics.grids`).
* Derivatives are multiplications by :math:`i k_x, i k_y` (Nyquist
  wavenumbers set to zero for odd derivatives, as usual for real fields);
  :math:`\hat\psi = \hat\omega / |\mathbf k|^2` with :math:`\hat\psi_0 = 0`.
* The quadratic term is evaluated pseudo-spectrally (products in physical
  space) and dealiased with Orszag's 2/3 rule: only modes with
  :math:`3|k_{x,\mathrm{int}}| < n` and :math:`3|k_{y,\mathrm{int}}| < n` are
  kept.  With this (strict) cut-off, aliases of products of retained modes
  never land on retained modes, so the truncated system is an exact Galerkin
  projection.
* Time stepping: classical explicit 4th-order Runge--Kutta
  (:func:`deepsolve.physics.time_stepping.rk4`) on the full spectral right-hand side
  :math:`\hat\omega_t = -(\nu|\mathbf k|^2 + \alpha)\hat\omega
  + P_{2/3}\widehat{J(\psi,\omega)} + \hat f`.  Stability requires roughly
  :math:`\Delta t\,\max(|\mathbf u|)\,k_{\max} \lesssim 2.8` and
  :math:`\Delta t\,\nu k_{\max}^2 \lesssim 2.7`.

Everything is written with out-of-place torch operations, so it is
differentiable with autograd, runs on any device and in float32 or float64,
and has no host synchronisation inside a step.

References
----------
* C. Canuto, M. Y. Hussaini, A. Quarteroni, T. A. Zang, *Spectral Methods:
  Fundamentals in Single Domains*, Springer (2006) -- Fourier Galerkin /
  pseudo-spectral methods, dealiasing.
* S. A. Orszag, "On the elimination of aliasing in finite-difference schemes
  by filtering high-wavenumber components", J. Atmos. Sci. 28, 1074 (1971).
* L. D. Meshalkin, Ya. G. Sinai, "Investigation of the stability of a
  stationary solution of a system of equations for the plane movement of an
  incompressible viscous liquid", J. Appl. Math. Mech. 25, 1700 (1961);
  G. J. Chandler, R. R. Kerswell, "Invariant recurrent solutions embedded in a
  turbulent two-dimensional Kolmogorov flow", J. Fluid Mech. 722, 554 (2013).
* D. Kochkov, J. A. Smith, A. Alieva, Q. Wang, M. P. Brenner, S. Hoyer,
  "Machine learning-accelerated computational fluid dynamics", PNAS 118,
  e2101784118 (2021); G. Dresdner et al., "Learning to correct spectral
  methods for simulating turbulent flows", TMLR (2023) -- learned closures,
  jax-cfd, from whose functional style this module borrows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from deepsolve.physics import grids, time_stepping
from deepsolve.physics.grids import CubicGrid
from deepsolve.physics.initial import filtered_noise

__all__ = [
    "Grid",
    "SpectralOps",
    "NavierStokes2D",
    "spectral_operators",
    "to_spectral",
    "to_physical",
    "streamfunction_hat",
    "velocity_hat",
    "velocity",
    "curl",
    "vorticity_forcing_hat",
    "advection_hat",
    "rhs_hat",
    "step",
    "energy",
    "enstrophy",
    "energy_injection",
    "kolmogorov_forcing",
    "taylor_green",
    "random_initial",
    "filter_to",
]

Scalar = float | int | torch.Tensor


# --------------------------------------------------------------------------
# Grid and spectral operators
# --------------------------------------------------------------------------


class SpectralOps(NamedTuple):
    r"""Precomputed spectral tensors for one grid, device and dtype.

    All have the rfft2 layout ``(n, n//2 + 1)`` (or broadcastable to it) and
    the *real* dtype of the fields.

    Attributes:
        kx: derivative wavenumbers along x (dim ``-2``), shape ``(n, 1)``,
            Nyquist entry zeroed.
        ky: derivative wavenumbers along y (dim ``-1``), shape ``(1, n//2+1)``,
            Nyquist entry zeroed.
        k2: :math:`|\mathbf k|^2` with the true (non-zeroed) wavenumbers,
            shape ``(n, n//2+1)``; ``k2[0, 0] == 0``.
        inv_k2: :math:`1/|\mathbf k|^2` with the mean mode set to 0.
        mask: 2/3-rule dealiasing mask (1 = kept, 0 = removed).
        igrad: complex ``(i kx, i ky)`` broadcast to shape ``(2, n, n//2+1)``
            (complex dtype matching the real dtype).
    """

    kx: torch.Tensor
    ky: torch.Tensor
    k2: torch.Tensor
    inv_k2: torch.Tensor
    mask: torch.Tensor
    igrad: torch.Tensor


class Grid(CubicGrid):
    r"""Uniform periodic ``n x n`` grid on ``[0, length)^2``.

    Physical fields have shape ``(..., n, n)`` with x along dim ``-2`` and y
    along dim ``-1`` (``'ij'`` indexing).  Wavenumbers are physical,
    :math:`k = 2\pi m / L` for integer ``m``.  The two-dimensional
    :class:`~deepsolve.physics.grids.CubicGrid`: :meth:`mesh`, ``rfft_shape``,
    transforms, shape checks and the 2/3 mask come from :mod:`deepsolve.physics.grids`.
    """

    def __init__(self, n: int, length: float = 2 * math.pi) -> None:
        super().__init__(n, length, ndim=2)

    def operators(self, dtype: torch.dtype | None = None, device=None) -> SpectralOps:
        """Cached :class:`SpectralOps` for this grid on ``device`` in ``dtype``."""
        return spectral_operators(self, dtype, device)


@grids.cached_operators()
def spectral_operators(grid: Grid, dtype: torch.dtype, device: torch.device) -> SpectralOps:
    """Build (and cache per ``(grid, dtype, device)``) the spectral tensors.

    Called as ``spectral_operators(grid, dtype=None, device=None)``; ``dtype`` is the
    *real* field dtype (float32/float64); complex dtypes are mapped to their real
    counterparts.
    """
    kx, ky = grid.wavenumbers(nyquist=False)  # odd derivatives of a real field: no Nyquist
    igrad = 1j * torch.stack(torch.broadcast_tensors(kx, ky))

    def cast(t: torch.Tensor, dt: torch.dtype = dtype) -> torch.Tensor:
        return grids.cast(t, dt, device)

    return SpectralOps(
        cast(kx), cast(ky), cast(grid.k2()), cast(grid.inv_k2()), cast(grid.dealias_mask()),
        cast(igrad, grids.complex_dtype(dtype)),
    )


# --------------------------------------------------------------------------
# Transforms and diagnostics
# --------------------------------------------------------------------------


def to_spectral(field: torch.Tensor) -> torch.Tensor:
    """Fourier-series coefficients ``rfft2(field, norm="forward")``.

    ``(..., n, n)`` real -> ``(..., n, n//2+1)`` complex.
    """
    return grids.rfftn(field, 2)


def to_physical(field_hat: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`to_spectral`: ``(..., n, n//2+1)`` -> ``(..., n, n)``."""
    return grids.irfftn(field_hat, (n, n))


def streamfunction_hat(omega_hat: torch.Tensor, ops: SpectralOps) -> torch.Tensor:
    r"""Streamfunction :math:`\hat\psi = \hat\omega/|\mathbf k|^2`.

    Solves :math:`\nabla^2\psi=-\omega`; the mean mode is set to zero.
    """
    return omega_hat * ops.inv_k2


def velocity_hat(omega_hat: torch.Tensor, ops: SpectralOps) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Spectral velocity :math:`\hat u = i k_y\hat\psi,\ \hat v = -i k_x\hat\psi`."""
    psi_hat = streamfunction_hat(omega_hat, ops)
    return 1j * ops.ky * psi_hat, -1j * ops.kx * psi_hat


def velocity(omega: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Velocity ``(u, v)`` of a physical vorticity field ``(..., n, n)``.

    :math:`u = \partial_y\psi,\ v = -\partial_x\psi` with
    :math:`\nabla^2\psi = -\omega`; each output has shape ``(..., n, n)``.
    The velocity has zero mean (no mean flow is representable in this form).
    """
    grid.check_field(omega)
    u_hat, v_hat = velocity_hat(to_spectral(omega), grid.operators_for(omega))
    return to_physical(u_hat, grid.n), to_physical(v_hat, grid.n)


def curl(u: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
    r"""Spectral curl :math:`\partial_x v - \partial_y u` of ``(..., n, n)`` fields."""
    grid.check_field(u)
    ops = grid.operators_for(u)
    w_hat = 1j * ops.kx * to_spectral(v) - 1j * ops.ky * to_spectral(u)
    return to_physical(w_hat, grid.n)


def energy(omega: torch.Tensor, grid: Grid) -> torch.Tensor:
    r"""Kinetic energy :math:`E = \tfrac12\langle u^2 + v^2\rangle` (domain mean).

    ``(..., n, n)`` -> ``(...)``.
    """
    u, v = velocity(omega, grid)
    return 0.5 * (u * u + v * v).mean(dim=(-2, -1))


def enstrophy(omega: torch.Tensor) -> torch.Tensor:
    r"""Enstrophy :math:`Z = \tfrac12\langle \omega^2\rangle` (domain mean), shape ``(...)``."""
    return 0.5 * (omega * omega).mean(dim=(-2, -1))


def energy_injection(omega: torch.Tensor, grid: Grid, forcing: torch.Tensor | None) -> torch.Tensor:
    r"""Power input :math:`\langle \mathbf u\cdot\mathbf F\rangle` of the body force.

    ``forcing`` is ``(..., 2, n, n)`` holding ``(F_x, F_y)``, broadcastable
    against the batch of ``omega``; ``None`` gives zeros.
    """
    u, v = velocity(omega, grid)
    if forcing is None:
        return torch.zeros_like(u[..., 0, 0])
    forcing = forcing.to(dtype=omega.dtype, device=omega.device)
    return (u * forcing[..., 0, :, :] + v * forcing[..., 1, :, :]).mean(dim=(-2, -1))


# --------------------------------------------------------------------------
# Right-hand side and time stepping
# --------------------------------------------------------------------------


def vorticity_forcing_hat(forcing: torch.Tensor, grid: Grid) -> torch.Tensor:
    r"""Spectral curl :math:`\hat f = i k_x\hat F_y - i k_y\hat F_x` of a body force.

    ``(..., 2, n, n)`` holding ``(F_x, F_y)`` -> ``(..., n, n//2+1)``.
    """
    grid.check_field(forcing)
    ops = grid.operators_for(forcing)
    f_hat = to_spectral(forcing)
    return 1j * ops.kx * f_hat[..., 1, :, :] - 1j * ops.ky * f_hat[..., 0, :, :]


def advection_hat(omega_hat: torch.Tensor, ops: SpectralOps, n: int) -> torch.Tensor:
    r"""Dealiased advection term in spectral space.

    Returns :math:`P_{2/3}\widehat{J(\psi,\omega)}
    = -P_{2/3}\widehat{\mathbf u\cdot\nabla\omega}`, shape ``(..., n, n//2+1)``.

    One batched inverse FFT of the four gradients ``(psi_x, psi_y, omega_x,
    omega_y)`` and one forward FFT of the product.
    """
    psi_hat = omega_hat * ops.inv_k2
    pair = torch.stack((psi_hat, omega_hat), dim=-3).unsqueeze(-3)  # (..., 2, 1, n, m)
    grads = to_physical(ops.igrad * pair, n)  # (..., 2, 2, n, n): [[psi_x, psi_y], [w_x, w_y]]
    jac = (
        grads[..., 0, 0, :, :] * grads[..., 1, 1, :, :]
        - grads[..., 0, 1, :, :] * grads[..., 1, 0, :, :]
    )
    return ops.mask * to_spectral(jac)


def rhs_hat(
    omega_hat: torch.Tensor,
    ops: SpectralOps,
    n: int,
    nu: Scalar,
    alpha: Scalar = 0.0,
    forcing_hat: torch.Tensor | None = None,
    linear: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Spectral time derivative :math:`\partial_t\hat\omega`.

    :math:`-(\nu|\mathbf k|^2+\alpha)\hat\omega
    + P_{2/3}\widehat{J(\psi,\omega)} + \hat f`.
    ``linear`` may pass a precomputed ``-(nu*k2 + alpha)``.
    """
    if linear is None:
        linear = -(nu * ops.k2 + alpha)
    out = linear * omega_hat + advection_hat(omega_hat, ops, n)
    if forcing_hat is not None:
        out = out + forcing_hat
    return out


def step(
    omega_hat: torch.Tensor,
    grid: Grid,
    dt: Scalar,
    nu: Scalar,
    alpha: Scalar = 0.0,
    forcing_hat: torch.Tensor | None = None,
    ops: SpectralOps | None = None,
) -> torch.Tensor:
    """Advance the spectral vorticity ``(..., n, n//2+1)`` by one RK4 step of size ``dt``.

    Classical RK4 on :func:`rhs_hat`.  ``nu``, ``alpha`` and ``dt`` may be
    Python numbers or (broadcastable, possibly differentiable) tensors;
    ``forcing_hat`` is the spectral *vorticity* forcing (e.g. from
    :func:`vorticity_forcing_hat`).  ``ops`` defaults to the cached operators
    for ``omega_hat``'s device and real dtype.
    """
    grid.check_spectral(omega_hat)
    if ops is None:
        ops = spectral_operators(grid, omega_hat.real.dtype, omega_hat.device)
    n = grid.n
    linear = -(nu * ops.k2 + alpha)

    def f(w: torch.Tensor) -> torch.Tensor:
        return rhs_hat(w, ops, n, nu, alpha, forcing_hat, linear)

    return time_stepping.rk4(f, omega_hat, dt)


# --------------------------------------------------------------------------
# Convenience object operating on physical-space vorticity
# --------------------------------------------------------------------------


class NavierStokes2D(time_stepping.SpectralStepper):
    """RK4 pseudo-spectral 2D Navier--Stokes stepper on physical vorticity.

    The state is a real tensor ``omega`` of shape ``(..., n, n)`` (any batch
    dims); :meth:`step` returns the vorticity one ``dt`` later, with the same
    shape/dtype/device, :meth:`advance` ``n_steps`` later (both from
    :class:`~deepsolve.physics.time_stepping.SpectralStepper`).  See the module
    docstring for the equations and sign conventions.

    Args:
        grid: the :class:`Grid`.
        nu: kinematic viscosity (number or tensor, may require grad).
        dt: time step (number or tensor).
        alpha: linear drag coefficient (default 0).
        forcing: optional time-independent body force ``(F_x, F_y)`` of shape
            ``(..., 2, n, n)`` (broadcast over the batch), e.g. from
            :func:`kolmogorov_forcing`.  Its curl is the vorticity forcing.

    Spectral operators, the linear factor and the spectral forcing are built
    once per ``(device, dtype)`` and reused (they are not cached when they
    depend on tensors that require grad, so that each forward pass builds a
    fresh graph).
    """

    grid: Grid

    def __init__(
        self,
        grid: Grid,
        nu: Scalar,
        dt: Scalar,
        alpha: Scalar = 0.0,
        forcing: torch.Tensor | None = None,
    ) -> None:
        if forcing is not None and forcing.shape[-3:] != (2, grid.n, grid.n):
            raise ValueError(
                f"forcing must have shape (..., 2, {grid.n}, {grid.n}), got {tuple(forcing.shape)}"
            )
        self.grid = grid
        self.nu = nu
        self.dt = dt
        self.alpha = alpha
        self.forcing = forcing
        self._cache: dict[
            tuple[torch.dtype, torch.device], tuple[SpectralOps, torch.Tensor | None]
        ] = {}

    def __repr__(self) -> str:
        return (
            f"NavierStokes2D(grid={self.grid}, nu={self.nu}, dt={self.dt}, alpha={self.alpha}, "
            f"forcing={'None' if self.forcing is None else tuple(self.forcing.shape)})"
        )

    def _cacheable(self) -> bool:
        return not any(
            isinstance(p, torch.Tensor) and p.requires_grad
            for p in (self.nu, self.alpha, self.forcing)
        )

    def _constants(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[SpectralOps, torch.Tensor | None]:
        key = (dtype, device)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        ops = spectral_operators(self.grid, dtype, device)
        forcing_hat = None
        if self.forcing is not None:
            forcing_hat = vorticity_forcing_hat(
                self.forcing.to(dtype=dtype, device=device), self.grid
            )
        out = (ops, forcing_hat)
        if self._cacheable():
            self._cache[key] = out
        return out

    def vorticity_forcing(
        self, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor | None:
        r"""Physical vorticity forcing :math:`f = \partial_x F_y - \partial_y F_x` (or None)."""
        if self.forcing is None:
            return None
        dtype = dtype or self.forcing.dtype
        device = torch.device(device) if device is not None else self.forcing.device
        _, f_hat = self._constants(dtype, device)
        assert f_hat is not None  # there is a forcing
        return to_physical(f_hat, self.grid.n)

    def step_hat(self, omega_hat: torch.Tensor) -> torch.Tensor:
        """One RK4 step on spectral coefficients ``(..., n, n//2+1)``."""
        ops, forcing_hat = self._constants(omega_hat.real.dtype, omega_hat.device)
        return step(omega_hat, self.grid, self.dt, self.nu, self.alpha, forcing_hat, ops)

    def rhs(self, omega: torch.Tensor) -> torch.Tensor:
        r"""Physical :math:`\partial_t\omega` for the current state (same shape)."""
        self.grid.check_field(omega)
        ops, forcing_hat = self._constants(omega.dtype, omega.device)
        d_hat = rhs_hat(to_spectral(omega), ops, self.grid.n, self.nu, self.alpha, forcing_hat)
        return to_physical(d_hat, self.grid.n)

    def velocity(self, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u, v)``, see :func:`velocity`."""
        return velocity(omega, self.grid)

    def energy(self, omega: torch.Tensor) -> torch.Tensor:
        r""":math:`E=\tfrac12\langle|\mathbf u|^2\rangle`, see :func:`energy`."""
        return energy(omega, self.grid)

    def enstrophy(self, omega: torch.Tensor) -> torch.Tensor:
        r""":math:`Z=\tfrac12\langle\omega^2\rangle`, see :func:`enstrophy`."""
        return enstrophy(omega)

    def energy_injection(self, omega: torch.Tensor) -> torch.Tensor:
        r""":math:`\langle\mathbf u\cdot\mathbf F\rangle` for this object's forcing."""
        return energy_injection(omega, self.grid, self.forcing)

    def energy_rate(self, omega: torch.Tensor) -> torch.Tensor:
        r"""Right-hand side of the energy budget, :math:`dE/dt`.

        :math:`-2\nu Z - 2\alpha E + \langle\mathbf u\cdot\mathbf F\rangle`, shape ``(...)``.
        """
        return (
            -2 * self.nu * enstrophy(omega)
            - 2 * self.alpha * self.energy(omega)
            + self.energy_injection(omega)
        )


# --------------------------------------------------------------------------
# Forcing, initial conditions, filtering
# --------------------------------------------------------------------------


def kolmogorov_forcing(
    grid: Grid,
    amplitude: float = 1.0,
    wavenumber: int = 4,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    r"""Kolmogorov body force :math:`\mathbf F = F_0\sin(k_f y)\,\hat{\mathbf x}`.

    ``wavenumber`` is the integer mode number ``m`` (``k_f = 2 pi m / L``).
    Returns ``(2, n, n)`` = ``(F_x, F_y)``.  The corresponding vorticity
    forcing is :math:`f = -F_0 k_f \cos(k_f y)`.
    """
    x, y = grid.mesh(dtype, device)
    kf = grid.k0 * wavenumber
    fx = amplitude * torch.sin(kf * y)
    return torch.stack((fx, torch.zeros_like(fx)))


def taylor_green(
    grid: Grid,
    wavenumber: int = 1,
    amplitude: float = 1.0,
    nu: float = 0.0,
    alpha: float = 0.0,
    t: float = 0.0,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    r"""Taylor--Green vortex vorticity at time ``t`` (exact NS solution).

    Velocity :math:`u = A\sin(kx)\cos(ky)\,g(t),\ v = -A\cos(kx)\sin(ky)\,g(t)`,
    streamfunction :math:`\psi = (A/k)\sin(kx)\sin(ky)\,g(t)`, vorticity
    :math:`\omega = 2Ak\sin(kx)\sin(ky)\,g(t)` with
    :math:`g(t) = \exp(-(2\nu k^2 + \alpha)t)`, :math:`k = 2\pi m/L`.  Since
    :math:`\omega \propto \psi`, advection vanishes identically.
    ``t = 0`` gives the initial condition.  Shape ``(n, n)``.
    """
    x, y = grid.mesh(dtype, device)
    k = grid.k0 * wavenumber
    decay = math.exp(-(2 * nu * k * k + alpha) * t)
    return (2 * amplitude * k * decay) * torch.sin(k * x) * torch.sin(k * y)


def random_initial(
    grid: Grid,
    generator: torch.Generator | None = None,
    batch_shape: tuple[int, ...] = (),
    peak_wavenumber: float = 4.0,
    max_wavenumber: float | None = None,
    energy_level: float = 0.5,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    r"""Smooth random vorticity with a spectral peak, zero mean, shape ``(*batch_shape, n, n)``.

    White noise (drawn with ``generator``, on the generator's device, then
    moved to ``device``) is filtered so that the per-mode vorticity amplitude
    is :math:`|\mathbf k|^{5/2}\exp(-(|\mathbf k|/k_p)^2)`, i.e. the shell
    energy spectrum is :math:`E(k)\propto k^4 \exp(-2(k/k_p)^2)`, peaking at
    :math:`k_p` = ``peak_wavenumber`` (physical units).  Modes outside the 2/3
    dealiasing mask, with :math:`|\mathbf k|` > ``max_wavenumber`` (if given),
    and the Nyquist modes are removed, so the field is exactly representable
    by the dealiased dynamics.  Each member is scaled to kinetic energy
    ``energy_level``.
    """
    def amplitude(k: torch.Tensor) -> torch.Tensor:
        return k**2.5 * torch.exp(-((k / peak_wavenumber) ** 2))

    omega = filtered_noise(grid, amplitude, generator, batch_shape, max_wavenumber, dtype, device)
    e = energy(omega, grid)
    return omega * torch.sqrt(energy_level / e)[..., None, None]


def filter_to(omega: torch.Tensor, n_out: int) -> torch.Tensor:
    r"""Spectral truncation (or zero-padding) of ``(..., n, n)`` to ``(..., n_out, n_out)``.

    The domain length is unchanged.  Fourier-series coefficients with integer
    wavenumbers :math:`|m_x|, |m_y| < \min(n, n_{out})/2` are copied exactly;
    all others (including both grids' Nyquist modes) are set to zero.  For
    ``n_out < n`` this is the sharp spectral filter used to build filtered
    fine-grid references; for ``n_out > n`` it is spectral interpolation.
    """
    n = omega.shape[-1]
    if omega.shape[-2] != n:
        raise ValueError(f"expected a square field (..., n, n), got {tuple(omega.shape)}")
    h = to_spectral(omega)
    kmax = (min(n, n_out) - 1) // 2  # largest retained |m|
    rows = h[..., : kmax + 1, : kmax + 1]
    neg = h[..., n - kmax :, : kmax + 1] if kmax > 0 else h[..., :0, : kmax + 1]
    gap = n_out - (2 * kmax + 1)
    zrows = h.new_zeros(*h.shape[:-2], gap, kmax + 1)
    cols = torch.cat((rows, zrows, neg), dim=-2)
    zcols = h.new_zeros(*h.shape[:-2], n_out, n_out // 2 + 1 - (kmax + 1))
    return to_physical(torch.cat((cols, zcols), dim=-1), n_out)
