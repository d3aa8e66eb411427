r"""Random initial conditions on a periodic grid: band-limited fields of a given spectrum.

:func:`filtered_noise` draws Gaussian white noise :math:`w` on a
:class:`~deepsolve.physics.grids.PeriodicGrid` and shapes it in Fourier space,

.. math::

    u = \mathcal F^{-1}\big[A(|\mathbf k|)\,P\,\chi_{|\mathbf k|\le k_{\max}}\,\hat w\big],

with an amplitude function :math:`A` of the physical wavenumber magnitude, the 2/3
dealiasing mask :math:`P` (which also removes the Nyquist modes) and an optional sharp
cut-off :math:`k_{\max}`.  The result is real, smooth, statistically homogeneous and
isotropic (for equal lengths), and exactly representable by the dealiased dynamics.
Since :math:`\hat w` has a flat expected spectrum, the expected per-mode power of
:math:`u` is :math:`\propto A^2`: in :math:`d` dimensions the shell spectrum is
:math:`E(k) \propto k^{d-1} A(k)^2` (for a velocity from a 2D vorticity, divide by
:math:`k^2`).  Normalising the amplitude (rms, energy, ...) is left to the caller.

:func:`~deepsolve.physics.navier_stokes.random_initial` uses it with
:math:`A(k) = k^{5/2} e^{-(k/k_p)^2}`.  (:func:`~deepsolve.physics.burgers.random_initial`
instead draws each retained Fourier coefficient directly, in float64 on the CPU, so that
its 1D field is the same on every device and dtype.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepsolve.physics.grids import PeriodicGrid, grid_operators

__all__ = ["filtered_noise"]


def filtered_noise(
    grid: PeriodicGrid,
    amplitude: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator | None = None,
    batch_shape: tuple[int, ...] = (),
    max_wavenumber: float | None = None,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    r"""Band-limited white noise shaped by ``amplitude(|k|)``: ``(*batch_shape, *grid.shape)``.

    The noise is standard normal, drawn with ``generator`` in ``dtype`` on the generator's
    device (CPU without one), then moved to ``device``; ``amplitude`` maps the physical
    :math:`|\mathbf k|` (shape ``grid.rfft_shape``, real dtype) to the per-mode factor.
    Modes outside the 2/3 mask and, if given, with :math:`|\mathbf k| >` ``max_wavenumber``
    are removed.  See the module docstring.
    """
    dtype = dtype or torch.get_default_dtype()
    gen_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.randn(
        *batch_shape, *grid.shape, generator=generator, dtype=dtype, device=gen_device
    )
    noise = noise.to(device) if device is not None else noise
    ops = grid_operators(grid, noise.dtype, noise.device)
    k = torch.sqrt(ops.k2)
    envelope = amplitude(k) * ops.mask
    if max_wavenumber is not None:
        envelope = envelope * (k <= max_wavenumber)
    return grid.to_physical(envelope * grid.to_spectral(noise))
