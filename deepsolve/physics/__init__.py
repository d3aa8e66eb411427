"""Differentiable physics solvers (torch).

One spectral kit shared by the solvers:

* :mod:`~deepsolve.physics.grids` -- the n-d periodic grid (:class:`PeriodicGrid`,
  :class:`CubicGrid`): wavenumbers, rfftn transforms, derivative/Laplacian multipliers,
  the 2/3 mask, shape checks, dtype helpers and the per-(dtype, device) operator cache;
* :mod:`~deepsolve.physics.time_stepping` -- RK4 and ETDRK4 over a right-hand side;
* :mod:`~deepsolve.physics.initial` -- random band-limited fields of a given spectrum;

and the solvers built on it: :mod:`~deepsolve.physics.navier_stokes` (2D vorticity form,
whose names are re-exported here) and :mod:`~deepsolve.physics.burgers` (1D).
"""

from deepsolve.physics.grids import (
    CubicGrid,
    GridOperators,
    PeriodicGrid,
    cached_operators,
    complex_dtype,
    grid_operators,
    irfftn,
    real_dtype,
    rfftn,
)
from deepsolve.physics.initial import filtered_noise
from deepsolve.physics.navier_stokes import (
    Grid,
    NavierStokes2D,
    SpectralOps,
    advection_hat,
    curl,
    energy,
    energy_injection,
    enstrophy,
    filter_to,
    kolmogorov_forcing,
    random_initial,
    rhs_hat,
    spectral_operators,
    step,
    streamfunction_hat,
    taylor_green,
    to_physical,
    to_spectral,
    velocity,
    velocity_hat,
    vorticity_forcing_hat,
)
from deepsolve.physics.shallow_water import (  # re-exported (not in __all__)
    ShallowWater2D,  # noqa: F401
    circular_pad,  # noqa: F401
    gaussian_bump,  # noqa: F401
    geostrophic_state,  # noqa: F401
    inertia_gravity_exact,  # noqa: F401
    inertia_gravity_frequency,  # noqa: F401
)
from deepsolve.physics.shallow_water import energy as shallow_water_energy  # noqa: F401
from deepsolve.physics.shallow_water import mass as shallow_water_mass  # noqa: F401
from deepsolve.physics.time_stepping import (
    ETDRK4Coefficients,
    SpectralStepper,
    etdrk4,
    etdrk4_phi,
    rk4,
)

__all__ = [
    # grids, time stepping, initial conditions
    "cached_operators",
    "complex_dtype",
    "CubicGrid",
    "etdrk4",
    "etdrk4_phi",
    "ETDRK4Coefficients",
    "filtered_noise",
    "grid_operators",
    "GridOperators",
    "irfftn",
    "PeriodicGrid",
    "real_dtype",
    "rfftn",
    "rk4",
    "SpectralStepper",
    # 2D Navier-Stokes
    "Grid",
    "NavierStokes2D",
    "SpectralOps",
    "advection_hat",
    "curl",
    "energy",
    "energy_injection",
    "enstrophy",
    "filter_to",
    "kolmogorov_forcing",
    "random_initial",
    "rhs_hat",
    "spectral_operators",
    "step",
    "streamfunction_hat",
    "taylor_green",
    "to_physical",
    "to_spectral",
    "velocity",
    "velocity_hat",
    "vorticity_forcing_hat",
]
