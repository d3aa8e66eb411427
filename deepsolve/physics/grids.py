r"""Periodic spectral grids: one grid, any number of dimensions.

A :class:`PeriodicGrid` is the uniform grid of ``shape = (n_1, ..., n_d)`` points on the
periodic box :math:`[0, L_1) \times \dots \times [0, L_d)`, together with everything a
Fourier pseudo-spectral solver needs to know about it: coordinates, wavenumbers,
transforms, derivative and Laplacian multipliers, the 2/3 dealiasing mask, shape checks
and a per-``(dtype, device)`` cache of these tensors.  The physics modules build on it:
:class:`~deepsolve.physics.burgers.Grid1D` and :class:`~deepsolve.physics.navier_stokes.Grid`
are :class:`CubicGrid`\ s (``n`` points and one length ``L`` along every axis) with
``d = 1`` and ``d = 2``.

Layout
------
* A physical field has shape ``(..., n_1, ..., n_d)``: the grid axes are the last ``d``
  tensor dims (:attr:`PeriodicGrid.dims`), index ``[..., i_1, ..., i_d]`` is the point
  :math:`x = (i_1 L_1/n_1, \dots, i_d L_d/n_d)` (``'ij'`` indexing).  Any leading batch
  dims are allowed.
* Spectral coefficients are ``torch.fft.rfftn`` over the grid dims with
  ``norm="forward"``, shape ``(..., n_1, ..., n_{d-1}, n_d//2 + 1)``
  (:attr:`PeriodicGrid.rfft_shape`).  They are the Fourier-series coefficients

  .. math::

      \hat u_{\mathbf m} = \big\langle u\, e^{-i\mathbf k_{\mathbf m}\cdot\mathbf x}\big\rangle,
      \qquad k_{a} = \frac{2\pi}{L_a} m_a,

  independent of the resolution, so spectra compare across grids.
* Integer wavenumbers :math:`m_a` are in ``fftfreq`` order (``0, 1, ..., -1``) along the
  first ``d - 1`` axes and ``rfftfreq`` order (``0 ... n_d//2``) along the last; each
  axis' tensor is shaped to broadcast against ``rfft_shape`` (:meth:`int_wavenumbers`).

Operators (all diagonal in Fourier space)
-----------------------------------------
* :math:`\partial_a^p` multiplies by :math:`(i k_a)^p`.  For odd :math:`p` the Nyquist
  wavenumber (:math:`m_a = n_a/2`, even :math:`n_a`) is set to zero: the Nyquist mode
  of a real grid function is :math:`\cos(\pi x/\Delta x)`, whose interpolant's derivative
  vanishes at every grid point (Trefethen 2000, ch. 3).  Even orders keep it.
* :math:`\nabla^2` multiplies by :math:`-|\mathbf k|^2` (true wavenumbers); the Poisson
  solve :math:`\nabla^2\psi = -\omega` divides by :math:`|\mathbf k|^2`, with the mean mode
  set to zero (``inv_k2``).
* The 2/3 rule :math:`P` keeps the modes with :math:`3|m_a| < n_a` along every axis
  (Orszag 1971).  With this strict cut-off the aliases of a product of two retained
  fields never land on a retained mode, so a pseudo-spectral quadratic term followed by
  :math:`P` is the exact Galerkin projection.

Precision, caching
------------------
Every operator is built in float64 on the CPU (the ``int_wavenumbers`` ... ``dealias_mask``
methods) and then cast once to the fields' real (or matching complex) dtype and device,
so float32 runs see correctly rounded multipliers.  :func:`cached_operators` turns a
builder ``(grid, dtype, device) -> tensors`` into the public accessor
``(grid, dtype=None, device=None)`` with one cache entry per ``(grid, real dtype,
device)``; :func:`grid_operators` (the generic :class:`GridOperators`) and the physics
modules' own operator sets use it.

References
----------
* L. N. Trefethen, *Spectral Methods in MATLAB*, SIAM (2000) -- spectral
  differentiation, the Nyquist mode.
* S. A. Orszag, "On the elimination of aliasing in finite-difference schemes by
  filtering high-wavenumber components", J. Atmos. Sci. 28, 1074 (1971).
* C. Canuto, M. Y. Hussaini, A. Quarteroni, T. A. Zang, *Spectral Methods:
  Fundamentals in Single Domains*, Springer (2006).
* jax-cfd (S. Hoyer, D. Kochkov et al.), ``grids.py`` / ``spectral/utils.py``: one
  grid object carrying shape, domain and the rfft mesh, from whose style this module
  borrows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar
from typing import cast as typing_cast

import torch

__all__ = [
    "PeriodicGrid",
    "CubicGrid",
    "GridOperators",
    "grid_operators",
    "cached_operators",
    "rfftn",
    "irfftn",
    "real_dtype",
    "complex_dtype",
    "cast",
]

T = TypeVar("T")


# --------------------------------------------------------------------------
# dtype / device helpers
# --------------------------------------------------------------------------


def real_dtype(dtype: torch.dtype | None = None, solver: str | None = None) -> torch.dtype:
    """The real field dtype for ``dtype``: ``None`` is torch's default, complex -> its real part.

    With ``solver`` given, anything but float32/float64 raises a one-line ``TypeError``
    ``"<solver> supports float32 and float64, got <dtype>"``.
    """
    dtype = dtype or torch.get_default_dtype()
    if dtype.is_complex:
        dtype = torch.empty((), dtype=dtype).real.dtype
    if solver is not None and dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{solver} supports float32 and float64, got {dtype}")
    return dtype


def complex_dtype(dtype: torch.dtype) -> torch.dtype:
    """complex128 for float64, complex64 otherwise (the dtype of the rfft of a real field)."""
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype`` on ``device`` (operators are built in float64)."""
    return t.to(dtype=dtype, device=device).contiguous()


def _as_device(device) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def cached_operators(
    solver: str | None = None, maxsize: int = 64
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: cache a builder ``(grid, dtype, device) -> T`` per ``(grid, dtype, device)``.

    The decorated function is called as ``f(grid, dtype=None, device=None)``: ``dtype`` is
    normalised with :func:`real_dtype` (``solver`` as there), ``device`` to a
    ``torch.device`` (default CPU), and the builder runs once per distinct triple (an LRU
    cache of ``maxsize`` entries; the grid must be hashable, as every :class:`PeriodicGrid`
    is).  The builder sees the normalised real dtype.
    """

    def decorate(build: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(build)

        @functools.wraps(build)
        def get(grid, dtype: torch.dtype | None = None, device=None) -> T:
            return cached(grid, real_dtype(dtype, solver), _as_device(device))

        get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        get.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return get

    return decorate


# --------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------


@functools.cache
def _last_dims(ndim: int) -> tuple[int, ...]:
    return tuple(range(-ndim, 0))


def rfftn(field: torch.Tensor, ndim: int) -> torch.Tensor:
    """Fourier-series coefficients ``rfftn(field, norm="forward")`` over the last ``ndim`` dims.

    ``(..., n_1, ..., n_d)`` real -> ``(..., n_1, ..., n_d//2+1)`` complex.
    """
    # rfft / rfft2 run the same kernel as rfftn (bit-identical) with less argument handling
    if ndim == 1:
        return torch.fft.rfft(field, norm="forward")
    if ndim == 2:
        return torch.fft.rfft2(field, norm="forward")
    return torch.fft.rfftn(field, dim=_last_dims(ndim), norm="forward")


def irfftn(field_hat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`rfftn`: ``(..., n_1, ..., n_d//2+1)`` -> real ``(..., *shape)``."""
    shape = tuple(shape)
    if len(shape) == 1:
        return torch.fft.irfft(field_hat, n=shape[0], norm="forward")
    if len(shape) == 2:
        return torch.fft.irfft2(field_hat, s=shape, norm="forward")
    return torch.fft.irfftn(field_hat, s=shape, dim=_last_dims(len(shape)), norm="forward")


# --------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------


class GridOperators(NamedTuple):
    r"""Generic spectral tensors of a :class:`PeriodicGrid` on one device, in one real dtype.

    Each broadcasts against the rfft layout :attr:`PeriodicGrid.rfft_shape`.

    Attributes:
        k: per-axis physical wavenumbers :math:`k_a = 2\pi m_a/L_a` (tuple of ``d``
            tensors, axis ``a`` of length ``rfft_shape[a]``, size 1 elsewhere).
        k_odd: the same with the Nyquist entries zeroed, for odd-order derivatives.
        k2: :math:`|\mathbf k|^2` (true wavenumbers), shape ``rfft_shape``.
        inv_k2: :math:`1/|\mathbf k|^2` with the mean mode set to 0.
        mask: 2/3-rule dealiasing mask (1 kept, 0 removed), shape ``rfft_shape``.
    """

    k: tuple[torch.Tensor, ...]
    k_odd: tuple[torch.Tensor, ...]
    k2: torch.Tensor
    inv_k2: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PeriodicGrid:
    r"""Uniform periodic grid of ``shape`` points on :math:`\prod_a [0, L_a)`.

    Args:
        shape: points per axis, ``(n,)``, ``(n_1, n_2)``, ... (an int means one axis);
            each an integer >= 2.
        lengths: domain length per axis (a number means the same for every axis);
            default :math:`2\pi`.

    Fields have shape ``(..., *shape)``, spectral coefficients ``(..., *rfft_shape)``
    (see the module docstring for the layout and the operators).  Frozen and hashable:
    equal grids share their cached operators (the derived sizes are cached properties).
    """

    shape: tuple[int, ...]
    lengths: tuple[float, ...] | float | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape) if isinstance(self.shape, Sequence) else (self.shape,)
        if not shape:
            raise ValueError("a grid needs at least one axis, got shape ()")
        for n in shape:
            if int(n) != n or n < 2:
                raise ValueError(f"grid size n must be an integer >= 2, got {n!r}")
        lengths = 2 * math.pi if self.lengths is None else self.lengths
        lengths = tuple(lengths) if isinstance(lengths, Sequence) else (lengths,) * len(shape)
        if len(lengths) != len(shape):
            raise ValueError(f"need one length per axis, got shape {shape} and lengths {lengths}")
        for length in lengths:
            if not length > 0:
                raise ValueError(f"domain length must be positive, got {length!r}")
        object.__setattr__(self, "shape", tuple(int(n) for n in shape))
        object.__setattr__(self, "lengths", lengths)

    # -- geometry ----------------------------------------------------------

    @functools.cached_property
    def ndim(self) -> int:
        """Number of grid axes ``d``."""
        return len(self.shape)

    @functools.cached_property
    def dims(self) -> tuple[int, ...]:
        """The tensor dims of the grid axes, ``(-d, ..., -1)``."""
        return tuple(range(-self.ndim, 0))

    @functools.cached_property
    def spacing(self) -> tuple[float, ...]:
        """Grid spacing ``L_a / n_a`` per axis."""
        lengths = typing_cast("tuple[float, ...]", self.lengths)  # __post_init__ made it a tuple
        return tuple(length / n for length, n in zip(lengths, self.shape, strict=True))

    @functools.cached_property
    def fundamental(self) -> tuple[float, ...]:
        """Fundamental wavenumber ``2 pi / L_a`` per axis."""
        lengths = typing_cast("tuple[float, ...]", self.lengths)  # __post_init__ made it a tuple
        return tuple(2 * math.pi / length for length in lengths)

    @functools.cached_property
    def rfft_shape(self) -> tuple[int, ...]:
        """Shape ``(n_1, ..., n_{d-1}, n_d//2 + 1)`` of the rfftn coefficient array."""
        return (*self.shape[:-1], self.shape[-1] // 2 + 1)

    @functools.cached_property
    def cutoffs(self) -> tuple[int, ...]:
        """Largest integer wavenumber ``(n_a - 1) // 3`` kept by the 2/3 rule, per axis."""
        return tuple((n - 1) // 3 for n in self.shape)

    def axes(self, dtype: torch.dtype | None = None, device=None) -> tuple[torch.Tensor, ...]:
        """1D coordinates ``x_{a,i} = i * L_a / n_a`` per axis, shapes ``(n_a,)``."""
        dtype = dtype or torch.get_default_dtype()
        return tuple(
            torch.arange(n, dtype=dtype, device=device) * h
            for n, h in zip(self.shape, self.spacing, strict=True)
        )

    def mesh(self, dtype: torch.dtype | None = None, device=None) -> tuple[torch.Tensor, ...]:
        """Coordinate arrays ``(X_1, ..., X_d)``, each of shape ``shape`` (``'ij'`` indexing)."""
        return tuple(torch.meshgrid(*self.axes(dtype, device), indexing="ij"))

    # -- spectral tensors in float64 on the CPU ------------------------------

    def _axis_view(self, a: int, t: torch.Tensor) -> torch.Tensor:
        """1D tensor for axis ``a`` reshaped to broadcast against ``rfft_shape``."""
        shape = [1] * self.ndim
        shape[a] = t.numel()
        return t.reshape(shape)

    def _int_1d(self) -> list[torch.Tensor]:
        last = self.ndim - 1
        return [
            (torch.fft.rfftfreq if a == last else torch.fft.fftfreq)(
                n, d=1.0 / n, dtype=torch.float64
            )
            for a, n in enumerate(self.shape)
        ]

    def int_wavenumbers(self) -> tuple[torch.Tensor, ...]:
        """Integer wavenumbers ``m_a`` (float64, CPU), each broadcastable to ``rfft_shape``."""
        return tuple(self._axis_view(a, m) for a, m in enumerate(self._int_1d()))

    def wavenumbers(self, nyquist: bool = True) -> tuple[torch.Tensor, ...]:
        r"""Physical wavenumbers :math:`k_a = 2\pi m_a / L_a` (float64, CPU), broadcastable.

        ``nyquist=False`` zeroes the Nyquist entry (index ``n_a // 2``) of every even axis:
        the multipliers for odd-order derivatives of real fields.
        """
        out = []
        for a, (n, k0, m) in enumerate(zip(self.shape, self.fundamental, self._int_1d(),
                                           strict=True)):
            k = k0 * m
            if not nyquist and n % 2 == 0:
                k[n // 2] = 0.0
            out.append(self._axis_view(a, k))
        return tuple(out)

    def k2(self) -> torch.Tensor:
        r""":math:`|\mathbf k|^2 = \sum_a k_a^2` (float64, CPU), shape ``rfft_shape``."""
        return functools.reduce(operator.add, (k**2 for k in self.wavenumbers()))

    def inv_k2(self) -> torch.Tensor:
        r""":math:`1/|\mathbf k|^2` with the mean mode set to 0 (float64, CPU)."""
        k2 = self.k2()
        return torch.where(k2 > 0, 1.0 / torch.where(k2 > 0, k2, 1.0), 0.0)

    def dealias_mask(self) -> torch.Tensor:
        """2/3-rule mask, 1 where ``3|m_a| < n_a`` on every axis, else 0 (float64, CPU)."""
        keep = [
            self._axis_view(a, (3 * m.abs() < n).to(torch.float64))
            for a, (n, m) in enumerate(zip(self.shape, self._int_1d(), strict=True))
        ]
        return functools.reduce(operator.mul, keep)

    def operators(self, dtype: torch.dtype | None = None, device=None):
        """Cached :class:`GridOperators` on ``device`` in the real ``dtype``.

        Subclasses return their solver's own operator set (same caching).
        """
        return grid_operators(self, dtype, device)

    def operators_for(self, x: torch.Tensor):
        """:meth:`operators` for the real dtype and the device of ``x`` (field or coefficients)."""
        return self.operators(x.dtype, x.device)

    # -- checks and transforms -----------------------------------------------

    def _shape_text(self, shape: tuple[int, ...]) -> str:
        return "(..., " + ", ".join(str(n) for n in shape) + ")"

    def check_field(self, u: torch.Tensor) -> None:
        """Raise a one-line ``ValueError`` unless ``u`` has shape ``(..., *shape)``."""
        if u.dim() < self.ndim or tuple(u.shape[-self.ndim:]) != self.shape:
            raise ValueError(
                f"expected a field of shape {self._shape_text(self.shape)}, got {tuple(u.shape)}"
            )

    def check_spectral(self, u_hat: torch.Tensor) -> None:
        """Raise a one-line ``ValueError`` unless ``u_hat`` has shape ``(..., *rfft_shape)``."""
        if u_hat.dim() < self.ndim or tuple(u_hat.shape[-self.ndim:]) != self.rfft_shape:
            name = {1: "rfft", 2: "rfft2"}.get(self.ndim, "rfftn")
            raise ValueError(
                f"expected {name} coefficients of shape {self._shape_text(self.rfft_shape)}, "
                f"got {tuple(u_hat.shape)}"
            )

    def to_spectral(self, u: torch.Tensor) -> torch.Tensor:
        """Fourier coefficients (:func:`rfftn`), ``(..., *shape)`` -> ``(..., *rfft_shape)``."""
        return rfftn(u, self.ndim)

    def to_physical(self, u_hat: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_spectral`: ``(..., *rfft_shape)`` -> real ``(..., *shape)``."""
        return irfftn(u_hat, self.shape)

    # -- differential operators on physical fields ------------------------------

    def derivative(self, u: torch.Tensor, axis: int = -1, order: int = 1) -> torch.Tensor:
        r"""Spectral derivative :math:`\partial_a^{p} u` along grid axis ``axis`` (``p = order``).

        ``axis`` counts grid axes (``0 .. d-1``, or negative from the last); ``(..., *shape)``
        -> same.  Multiplier :math:`i^p k_a^p`, with the Nyquist wavenumber zeroed for odd
        ``p`` (see the module docstring).
        """
        self.check_field(u)
        if order < 0:
            raise ValueError(f"order must be >= 0, got {order}")
        if not -self.ndim <= axis < self.ndim:
            raise ValueError(f"axis must be in [-{self.ndim}, {self.ndim}), got {axis}")
        ops = grid_operators(self, u.dtype, u.device)
        k = (ops.k_odd if order % 2 else ops.k)[axis]
        return self.to_physical((1j**order) * k**order * self.to_spectral(u))

    def laplacian(self, u: torch.Tensor) -> torch.Tensor:
        r"""Spectral Laplacian :math:`\mathcal F^{-1}[-|\mathbf k|^2\hat u]`, ``(..., *shape)``."""
        self.check_field(u)
        ops = grid_operators(self, u.dtype, u.device)
        return self.to_physical(-ops.k2 * self.to_spectral(u))

    def dealias(self, u_hat: torch.Tensor) -> torch.Tensor:
        """:math:`P\\hat u`: the coefficients with the modes outside the 2/3 band zeroed."""
        self.check_spectral(u_hat)
        return grid_operators(self, u_hat.real.dtype, u_hat.device).mask * u_hat


@cached_operators()
def grid_operators(grid: PeriodicGrid, dtype: torch.dtype, device: torch.device) -> GridOperators:
    """Cached :class:`GridOperators` of ``grid`` on ``device`` in ``dtype``.

    Called as ``grid_operators(grid, dtype=None, device=None)``; ``dtype`` is the *real*
    field dtype; complex dtypes map to their real part's.
    """

    def c(t: torch.Tensor) -> torch.Tensor:
        return cast(t, dtype, device)

    return GridOperators(
        tuple(c(k) for k in grid.wavenumbers()),
        tuple(c(k) for k in grid.wavenumbers(nyquist=False)),
        c(grid.k2()),
        c(grid.inv_k2()),
        c(grid.dealias_mask()),
    )


class CubicGrid(PeriodicGrid):
    r"""``n`` points and length ``L`` along each of ``ndim`` axes: :math:`[0, L)^d`.

    The common base of :class:`~deepsolve.physics.burgers.Grid1D` (``d = 1``) and
    :class:`~deepsolve.physics.navier_stokes.Grid` (``d = 2``), which fix ``ndim`` and keep
    the constructor ``(n, length=2 pi)``.  Scalar attributes ``n``, ``length``, ``dx``,
    ``k0``; :meth:`coords` gives the (common) 1D coordinates.
    """

    def __init__(self, n: int, length: float = 2 * math.pi, ndim: int = 1) -> None:
        if int(ndim) != ndim or ndim < 1:
            raise ValueError(f"ndim must be an integer >= 1, got {ndim!r}")
        super().__init__((n,) * int(ndim), (length,) * int(ndim))

    def __repr__(self) -> str:
        extra = f", ndim={self.ndim}" if type(self) is CubicGrid else ""
        return f"{type(self).__name__}(n={self.n!r}, length={self.length!r}{extra})"

    @property
    def n(self) -> int:
        """Points per axis."""
        return self.shape[0]

    @property
    def length(self) -> float:
        """Domain length of every axis."""
        return typing_cast("tuple[float, ...]", self.lengths)[0]  # a tuple after __post_init__

    @property
    def dx(self) -> float:
        """Grid spacing ``length / n``."""
        return self.spacing[0]

    @property
    def k0(self) -> float:
        """Fundamental wavenumber ``2 pi / length``."""
        return self.fundamental[0]

    def coords(self, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """1D coordinates ``x_i = i * dx``, shape ``(n,)`` (the same on every axis)."""
        return self.axes(dtype, device)[0]
