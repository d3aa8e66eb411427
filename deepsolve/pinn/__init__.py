"""Physics-informed neural networks: residual losses built from derivatives of a network.

* :mod:`.derivatives` — gradient, partial derivatives of any order, divergence, Laplacian,
  Jacobian, Hessian and a one-pass :func:`jet`, on ``torch.func`` (``backend="func"``) or
  plain autograd (``backend="autograd"``); differentiable w.r.t. the network's parameters.
* :mod:`.networks` — :class:`FNN`, a fully connected network whose input derivatives come
  from one forward pass (Taylor mode, ``backend="taylor"``).
* :mod:`.ansatz` — hard constraints: :class:`Ansatz` :math:`u = g + b N` (Taylor mode kept by
  the product rule), :func:`transfinite`, the Coons lift of boundary values on a rectangle,
  and :class:`Symmetric`, a network made even or odd under a reflection.
* :mod:`.geometry` — :class:`Interval`, :class:`Rectangle`, :class:`Box`, :class:`SpaceTime`
  with uniform, Sobol, Halton and Latin-hypercube sampling of interior, boundary and initial
  points, boundary normals.
* :mod:`.sampling` — :class:`Collocation` sets that resample every K iterations and grow by
  residual-based adaptive refinement (RAR).
* :mod:`.weighting` — fixed weights and learning-rate annealing (:func:`make_weights`).
* :mod:`.attention` — pointwise residual weights updated from the residuals: RBA and the
  variational vRBA (:class:`ResidualAttention`), usable with every optimiser.
* :mod:`.causal` — causal residual weighting for time-dependent problems
  (:func:`causal_loss`, :class:`CausalWeighting` with its ``eps`` schedule) and time-sliced
  collocation points (:func:`sample_time_slices`).
* :mod:`.chunked` — mean squared residuals over large sets in recomputed chunks whose size
  follows a memory budget (:class:`ChunkedResidual`).
* :mod:`.optim` — :class:`AdamLBFGS`, Adam then L-BFGS; :class:`AdamWarmup`, Adam then a
  second-order optimizer; :func:`switch_precision`.
* :mod:`.quasi_newton` — :class:`SelfScaledBroyden`: full-memory SSBroyden, SSBFGS and BFGS
  with a strong-Wolfe line search (float64, networks up to ~10⁴ parameters).
* :mod:`.gauss_newton` — :class:`GaussNewton`: Levenberg–Marquardt on the residual vector
  (:class:`LeastSquaresTerm`), Jacobian by ``torch.func`` in chunks
  (:func:`residual_jacobian`), dense normal equations or matrix-free CG.
* :mod:`.problem` — :class:`PINNProblem`, a problem file's base class: the physics (points,
  residuals, conditions, reference) in, the trainer's hooks out; :class:`Published` results.
* :mod:`.training` — :class:`AdamLBFGSTraining`, the optimiser, precision-switch and
  restart-state hooks that PINN problem classes share.

See docs/pinn.md.
"""

from .ansatz import Ansatz, Symmetric, transfinite
from .attention import POTENTIALS, ResidualAttention
from .causal import (
    PAPER_EPS,
    CausalWeighting,
    causal_loss,
    causal_weights,
    sample_time_slices,
    slice_mse,
)
from .chunked import (
    ChunkedResidual,
    SavedBytes,
    bytes_per_point,
    chunk_size_for_budget,
    chunked_mse,
    chunked_sum,
)
from .derivatives import (
    Jet,
    divergence,
    gradient,
    hessian,
    jacobian,
    jet,
    laplacian,
    partial,
    pointwise,
)
from .gauss_newton import GaussNewton, LeastSquaresTerm, least_squares_loss, residual_jacobian
from .geometry import Box, Interval, Rectangle, SpaceTime, unit_samples
from .networks import ACTIVATIONS, FNN
from .optim import AdamLBFGS, AdamWarmup, switch_precision
from .problem import PINN_SETTINGS, Condition, PINNProblem, Published
from .quasi_newton import QUASI_NEWTON, SelfScaledBroyden
from .sampling import Collocation, residual_magnitude, select_largest
from .training import (
    ATTENTION_SETTINGS,
    OPTIMIZERS,
    SECOND_ORDER,
    SECOND_ORDER_SETTINGS,
    AdamLBFGSTraining,
)
from .weighting import AnnealingWeights, FixedWeights, Weights, make_weights

__all__ = [
    "PINNProblem", "Published", "PINN_SETTINGS", "Condition",
    "ResidualAttention", "POTENTIALS", "ATTENTION_SETTINGS",
    "Jet", "jet", "jacobian", "gradient", "hessian", "partial", "laplacian", "divergence",
    "pointwise", "FNN", "ACTIVATIONS", "Ansatz", "Symmetric", "transfinite",
    "Box", "Interval", "Rectangle", "SpaceTime", "unit_samples",
    "Collocation", "residual_magnitude", "select_largest",
    "Weights", "FixedWeights", "AnnealingWeights", "make_weights",
    "SavedBytes", "bytes_per_point", "chunk_size_for_budget", "chunked_sum", "chunked_mse",
    "ChunkedResidual",
    "AdamLBFGS", "AdamWarmup", "switch_precision", "AdamLBFGSTraining", "OPTIMIZERS",
    "SECOND_ORDER", "SECOND_ORDER_SETTINGS", "SelfScaledBroyden", "QUASI_NEWTON",
    "GaussNewton", "LeastSquaresTerm",
    "least_squares_loss", "residual_jacobian",
    "causal_loss", "causal_weights", "CausalWeighting", "sample_time_slices", "slice_mse",
    "PAPER_EPS",
]
