r"""Boxes and space-time cylinders: interior, boundary and initial collocation points.

* :class:`Box` — :math:`[lo_0, hi_0] \times \dots \times [lo_{d-1}, hi_{d-1}]`;
  :class:`Interval` (``d = 1``) and :class:`Rectangle` (``d = 2``) are the usual names.
* :class:`SpaceTime` — a box in space times a time interval; points are ``(x..., t)``
  (time last). Its *boundary* is the lateral surface (space boundary × time interval), its
  *initial* set the space box at ``t0``.

Sampling methods (``method=``): ``"uniform"`` (i.i.d. uniform), ``"sobol"`` and ``"halton"``
(scrambled low-discrepancy sequences of :mod:`scipy.stats.qmc`), ``"lhs"`` (Latin hypercube).
All are deterministic given ``seed``; points are generated in float64 and cast to ``dtype``.
Boundary points are spread over the faces in proportion to their areas (a deterministic,
stratified allocation; the points *within* a face follow ``method``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import qmc

__all__ = ["METHODS", "unit_samples", "Box", "Interval", "Rectangle", "SpaceTime"]

METHODS = ("uniform", "sobol", "halton", "lhs")


def unit_samples(n: int, d: int, method: str = "uniform", seed: int | None = 0) -> np.ndarray:
    """``n`` points in the unit cube ``[0, 1)^d`` as a float64 array ``(n, d)``."""
    n, d = int(n), int(d)
    if n < 0 or d < 0:
        raise ValueError(f"need n >= 0 and d >= 0, got n={n}, d={d}")
    if n == 0 or d == 0:
        return np.zeros((n, d))
    if method == "uniform":
        return np.random.default_rng(seed).random((n, d))
    engines = {"sobol": qmc.Sobol, "halton": qmc.Halton, "lhs": qmc.LatinHypercube}
    if method not in engines:
        raise ValueError(f"sampling method must be one of {METHODS}, got {method!r}")
    try:  # scipy >= 1.15 names the seed `rng`
        engine = engines[method](d, scramble=True, rng=seed)
    except TypeError:  # pragma: no cover - older scipy
        engine = engines[method](d, scramble=True, seed=seed)
    with warnings.catch_warnings():  # Sobol prefers powers of two; any n is fine here
        warnings.simplefilter("ignore", UserWarning)
        return engine.random(n)


def _allocate(n: int, weights: Sequence[float]) -> list[int]:
    """Split ``n`` into integers proportional to ``weights`` (largest remainders)."""
    w = np.asarray(weights, dtype=float)
    if w.sum() <= 0:
        w = np.ones_like(w)
    share = n * w / w.sum()
    counts = np.floor(share).astype(int)
    for i in np.argsort(-(share - counts), kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


class Box:
    """An axis-aligned box ``lo <= x <= hi`` in ``d`` dimensions."""

    def __init__(self, lo: Sequence[float], hi: Sequence[float]):
        lo_t = tuple(float(v) for v in lo)
        hi_t = tuple(float(v) for v in hi)
        if len(lo_t) != len(hi_t) or not lo_t:
            raise ValueError(f"lo and hi must have the same positive length, got {lo} and {hi}")
        if any(not h > l for l, h in zip(lo_t, hi_t, strict=True)):
            raise ValueError(f"need lo < hi on every axis, got lo={lo_t}, hi={hi_t}")
        self.lo, self.hi = lo_t, hi_t

    # shape --------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return len(self.lo)

    @property
    def lengths(self) -> tuple[float, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi, strict=True))

    @property
    def volume(self) -> float:
        return math.prod(self.lengths)

    def face_area(self, axis: int) -> float:
        """Area (``d-1``-volume) of one of the two faces normal to ``axis`` (1 for d = 1)."""
        return math.prod(v for j, v in enumerate(self.lengths) if j != axis)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lo={self.lo}, hi={self.hi})"

    # tests --------------------------------------------------------------------------------
    def _t(self, values, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=x.dtype, device=x.device)

    def contains(self, x: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
        """``(N,)`` bool: the points lie in the closed box (widened by ``tol``)."""
        lo, hi = self._t(self.lo, x), self._t(self.hi, x)
        return ((x >= lo - tol) & (x <= hi + tol)).all(-1)

    def on_boundary(self, x: torch.Tensor, tol: float = 1e-6,
                    axes: Sequence[int] | None = None) -> torch.Tensor:
        """``(N,)`` bool: in the box and within ``tol`` of a face normal to one of ``axes``
        (default: all)."""
        axes = range(self.dim) if axes is None else axes
        lo, hi = self._t(self.lo, x), self._t(self.hi, x)
        near = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        for j in axes:
            near |= ((x[:, j] - lo[j]).abs() <= tol) | ((x[:, j] - hi[j]).abs() <= tol)
        return near & self.contains(x, tol)

    def normals(self, x: torch.Tensor, tol: float = 1e-6,
                axes: Sequence[int] | None = None) -> torch.Tensor:
        """Outward unit normals ``(N, d)`` at boundary points (faces normal to ``axes``). At
        an edge or corner the normalised sum of the faces' normals; zero off the boundary."""
        axes = range(self.dim) if axes is None else axes
        lo, hi = self._t(self.lo, x), self._t(self.hi, x)
        n = torch.zeros_like(x)
        for j in axes:
            n[:, j] = ((x[:, j] - hi[j]).abs() <= tol).to(x.dtype) \
                - ((x[:, j] - lo[j]).abs() <= tol).to(x.dtype)
        norm = n.norm(dim=-1, keepdim=True)
        return torch.where(norm > 0, n / norm.clamp_min(1e-300), n)

    # sampling -----------------------------------------------------------------------------
    def _scale(self, u: np.ndarray, dtype, device) -> torch.Tensor:
        lo, lengths = np.asarray(self.lo), np.asarray(self.lengths)
        return torch.as_tensor(lo + u * lengths, dtype=torch.float64).to(
            dtype=dtype or torch.get_default_dtype(), device=device)

    def sample_interior(self, n: int, method: str = "uniform", seed: int | None = 0,
                        dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """``n`` points ``(n, d)`` in the box."""
        return self._scale(unit_samples(n, self.dim, method, seed), dtype, device)

    def sample_face(self, n: int, axis: int, side: int, method: str = "uniform",
                    seed: int | None = 0, dtype: torch.dtype | None = None,
                    device=None) -> torch.Tensor:
        """``n`` points on the face ``x[axis] = lo[axis]`` (``side=0``) or ``hi[axis]``
        (``side=1``)."""
        if side not in (0, 1):
            raise ValueError(f"side must be 0 (lo) or 1 (hi), got {side}")
        u = unit_samples(n, self.dim - 1, method, seed)
        u = np.insert(u, axis, float(side), axis=1)
        x = self._scale(u, dtype, device)
        x[:, axis] = (self.lo, self.hi)[side][axis]  # exactly on the face
        return x

    def sample_boundary(self, n: int, method: str = "uniform", seed: int | None = 0,
                        dtype: torch.dtype | None = None, device=None,
                        axes: Sequence[int] | None = None) -> torch.Tensor:
        """``n`` points on the faces normal to ``axes`` (default all), allotted to the faces
        in proportion to their areas; each face's points follow ``method`` with its own seed
        derived from ``seed``."""
        axes = list(range(self.dim)) if axes is None else [int(a) for a in axes]
        faces = [(a, s) for a in axes for s in (0, 1)]
        counts = _allocate(int(n), [self.face_area(a) for a, _ in faces])
        seeds = _child_seeds(seed, len(faces))
        parts = [self.sample_face(c, a, s, method, fs, dtype, device)
                 for (a, s), c, fs in zip(faces, counts, seeds, strict=True)]
        return torch.cat(parts, 0)

    def grid(self, shape: int | Sequence[int], dtype: torch.dtype | None = None,
             device=None) -> torch.Tensor:
        """The tensor-product grid with ``shape`` points per axis (ends included), flattened
        to ``(prod(shape), d)`` in C order (the last axis fastest)."""
        shape = [int(shape)] * self.dim if isinstance(shape, int) else [int(s) for s in shape]
        if len(shape) != self.dim:
            raise ValueError(f"grid shape {shape} does not match dimension {self.dim}")
        axes = [torch.linspace(l, h, s, dtype=torch.float64)
                for l, h, s in zip(self.lo, self.hi, shape, strict=True)]
        mesh = torch.meshgrid(*axes, indexing="ij")
        pts = torch.stack([m.reshape(-1) for m in mesh], -1)
        return pts.to(dtype=dtype or torch.get_default_dtype(), device=device)


def _child_seeds(seed: int | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    return [int(s) for s in np.random.SeedSequence(int(seed)).generate_state(n)]


class Interval(Box):
    """``[a, b]``; its boundary is the two end points."""

    def __init__(self, a: float, b: float):
        super().__init__((a,), (b,))

    def __repr__(self) -> str:
        return f"Interval({self.lo[0]}, {self.hi[0]})"


class Rectangle(Box):
    """``[x0, x1] × [y0, y1]`` given as ``Rectangle((x0, y0), (x1, y1))``."""

    def __init__(self, lo: Sequence[float], hi: Sequence[float]):
        super().__init__(lo, hi)
        if self.dim != 2:
            raise ValueError(f"a Rectangle has two dimensions, got lo={lo}")


class SpaceTime:
    """``space × [t0, t1]`` with points ``(x..., t)``; see the module docstring."""

    def __init__(self, space: Box, t0: float, t1: float):
        if not t1 > t0:
            raise ValueError(f"need t0 < t1, got {t0}, {t1}")
        self.space = space
        self.t0, self.t1 = float(t0), float(t1)
        self.box = Box(space.lo + (self.t0,), space.hi + (self.t1,))

    @property
    def dim(self) -> int:
        """Space dimension plus one."""
        return self.box.dim

    @property
    def spatial_axes(self) -> list[int]:
        return list(range(self.space.dim))

    def __repr__(self) -> str:
        return f"SpaceTime({self.space!r}, {self.t0}, {self.t1})"

    def contains(self, x: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
        return self.box.contains(x, tol)

    def on_boundary(self, x: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
        """On the lateral surface (the space boundary, at any time)."""
        return self.box.on_boundary(x, tol, axes=self.spatial_axes)

    def on_initial(self, x: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
        return self.box.contains(x, tol) & ((x[:, -1] - self.t0).abs() <= tol)

    def normals(self, x: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
        """Outward spatial normals ``(N, d+1)`` on the lateral surface (time component 0)."""
        return self.box.normals(x, tol, axes=self.spatial_axes)

    def sample_interior(self, n: int, method: str = "uniform", seed: int | None = 0,
                        dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        return self.box.sample_interior(n, method, seed, dtype, device)

    def sample_boundary(self, n: int, method: str = "uniform", seed: int | None = 0,
                        dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        return self.box.sample_boundary(n, method, seed, dtype, device, axes=self.spatial_axes)

    def sample_initial(self, n: int, method: str = "uniform", seed: int | None = 0,
                       dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        return self.box.sample_face(n, self.box.dim - 1, 0, method, seed, dtype, device)

    def grid(self, shape: int | Sequence[int], dtype: torch.dtype | None = None,
             device=None) -> torch.Tensor:
        return self.box.grid(shape, dtype, device)
