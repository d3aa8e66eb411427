"""deepsolve: train through long iterative computations with exact, memory-bounded gradients."""

from . import schedules

__version__ = "0.1.0"

__all__ = ["schedules", "__version__"]
