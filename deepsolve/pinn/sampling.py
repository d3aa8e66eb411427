r"""Collocation sets: periodic resampling and residual-based adaptive refinement (RAR).

A :class:`Collocation` holds the points a residual is evaluated at. ``points(iteration)``
returns the set for that iteration and is *idempotent* — the trainer calls ``residuals`` once
per Adam step but several times per L-BFGS step (line search), and the set must not change
between those calls:

* with ``resample_every = K > 0`` the base set is redrawn at iterations ``0, K, 2K, ...``
  from ``sampler(n, seed)`` with a seed derived from ``(seed, iteration // K)`` — the run is
  reproducible and a resumed run draws the same sets;
* :meth:`refine` (RAR, Lu et al. 2021, *SIAM Rev.* 63(1) "DeepXDE") evaluates the residual on
  a large candidate pool and adds the ``m`` candidates with the largest residual; the added
  points are kept across resampling (up to ``max_added``);
* :meth:`redistribute` (RAD, Wu et al. 2023, *CMAME* 403, 115671) replaces the base set by
  ``n`` points drawn without replacement from a candidate pool with probability
  :math:`p(x) \propto |r(x)|^k / \overline{|r|^k} + c`: most points where the residual is
  large, a share ``c/(1+c)`` spread uniformly.

Keep ``resample_every = 0`` (a fixed set) while training with L-BFGS: its curvature pairs
assume one objective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import numpy as np
import torch

__all__ = ["Collocation", "residual_magnitude", "select_largest"]

Sampler = Callable[[int, int], torch.Tensor]


def _epoch_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1)[0])


def residual_magnitude(res) -> torch.Tensor:
    """Per-point size ``(N,)`` of a residual: ``|r|`` for ``(N,)``, the Euclidean norm over
    the last axis for ``(N, c)``, and the root of the summed squares over the entries of a
    dict/tuple of such tensors (several equations)."""
    if isinstance(res, Mapping):
        res = list(res.values())
    if isinstance(res, (list, tuple)):
        sq = cast(torch.Tensor, sum(_sq(r) for r in res))  # sum() adds `| Literal[0]`
    else:
        sq = _sq(res)
    return sq.sqrt()


def _sq(r: torch.Tensor) -> torch.Tensor:
    r = r.detach()
    return r.pow(2) if r.dim() == 1 else r.pow(2).reshape(r.shape[0], -1).sum(-1)


def _magnitudes(residual_fn: Callable, candidates: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`residual_magnitude` at every candidate ``(N,)``, in chunks of ``chunk`` points
    with gradients enabled (autograd-based derivatives need them), detached."""
    mags = []
    for xc in candidates.split(int(chunk)):
        with torch.enable_grad():
            mags.append(residual_magnitude(residual_fn(xc)))
    return torch.cat(mags)


def select_largest(residual_fn: Callable, candidates: torch.Tensor, m: int,
                   chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``m`` candidates with the largest :func:`residual_magnitude` and those
    magnitudes (descending). The residual is evaluated in chunks of ``chunk`` points with
    gradients enabled (autograd-based derivatives need them) and detached."""
    m = min(int(m), candidates.shape[0])
    mag = _magnitudes(residual_fn, candidates, chunk)
    top = torch.topk(mag, m).indices
    return candidates[top].detach(), mag[top]


class Collocation:
    """A set of ``n`` points from ``sampler(n, seed) -> (n, d)``; see the module docstring.

    Args:
        sampler: draws ``n`` points given an integer seed (e.g.
            ``lambda n, s: geom.sample_interior(n, "sobol", s)``).
        n: size of the base set.
        resample_every: redraw the base set every this many iterations (0 = never).
        seed: base seed.
        max_added: cap on the points added by :meth:`refine` (the oldest go first).
    """

    def __init__(self, sampler: Sampler, n: int, *, resample_every: int = 0, seed: int = 0,
                 max_added: int | None = None):
        if int(n) < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.sampler = sampler
        self.n = int(n)
        self.resample_every = int(resample_every)
        self.seed = int(seed)
        self.max_added = max_added
        self.epoch = 0
        self.base = sampler(self.n, _epoch_seed(self.seed, 0))
        self.added = self.base[:0]
        self.last_refined: int | None = None
        self.last_redistributed: int | None = None

    def __len__(self) -> int:
        return self.base.shape[0] + self.added.shape[0]

    def points(self, iteration: int = 0) -> torch.Tensor:
        """The set for ``iteration``: the base set of its resampling epoch plus the points
        added by refinement (idempotent for a given iteration)."""
        if self.resample_every > 0:
            epoch = int(iteration) // self.resample_every
            if epoch != self.epoch:
                self.epoch = epoch
                self.base = self.sampler(self.n, _epoch_seed(self.seed, epoch))
        if self.added.shape[0] == 0:
            return self.base
        return torch.cat((self.base, self.added), 0)

    def add(self, pts: torch.Tensor) -> None:
        """Append points to the refined set (kept across resampling)."""
        self.added = torch.cat((self.added, pts.to(self.base)), 0)
        if self.max_added is not None and self.added.shape[0] > self.max_added:
            self.added = self.added[self.added.shape[0] - int(self.max_added):]

    def refine(self, residual_fn: Callable, pool: int | torch.Tensor, m: int,
               iteration: int | None = None, seed: int | None = None,
               chunk: int = 8192) -> torch.Tensor:
        """RAR: evaluate ``residual_fn`` on a candidate pool (a tensor, or an int: that many
        points from the sampler) and add the ``m`` points with the largest residual. With
        ``iteration`` given, a second call for the same iteration does nothing (returns an
        empty tensor), so it is safe inside an L-BFGS closure. Returns the added points."""
        if iteration is not None:
            if self.last_refined == iteration:
                return self.base[:0]
            self.last_refined = iteration
        if isinstance(pool, torch.Tensor):
            cand = pool.to(self.base)
        else:
            s = seed if seed is not None else _epoch_seed(self.seed + 1,
                                                          0 if iteration is None else iteration)
            cand = self.sampler(int(pool), s)
        new, _ = select_largest(residual_fn, cand, m, chunk)
        self.add(new)
        return new

    def redistribute(self, residual_fn: Callable, pool: int | torch.Tensor, iteration: int,
                     k: float = 1.0, c: float = 1.0, chunk: int = 8192) -> torch.Tensor:
        """RAD: replace the base set by ``n`` points drawn from a candidate pool (a tensor,
        or an int: that many points from the sampler, seeded by ``iteration``) with
        probability proportional to ``|r|**k / mean(|r|**k) + c``. A second call for the same
        ``iteration`` does nothing (safe inside a closure). Returns the new base set."""
        if self.last_redistributed == iteration:
            return self.base
        if not (float(k) >= 0 and float(c) >= 0):
            raise ValueError(f"redistribute needs k >= 0 and c >= 0, got k={k}, c={c}")
        self.last_redistributed = iteration
        if isinstance(pool, torch.Tensor):
            cand = pool.to(self.base)
        else:
            cand = self.sampler(int(pool), _epoch_seed(self.seed + 2, iteration))
        if cand.shape[0] < self.n:
            raise ValueError(f"redistribute: the pool has {cand.shape[0]} points, fewer than "
                             f"the set's {self.n}")
        err = _magnitudes(residual_fn, cand, chunk).double().pow(float(k))
        mean = err.mean()
        p = (err / mean if mean > 0 else torch.zeros_like(err)) + float(c)
        if not bool(torch.isfinite(p).all()) or not float(p.sum()) > 0:
            raise FloatingPointError("redistribute: the residual on the pool is not finite")
        gen = torch.Generator().manual_seed(_epoch_seed(self.seed + 3, iteration))
        idx = torch.multinomial(p.cpu(), self.n, replacement=False, generator=gen)
        self.base = cand[idx.to(cand.device)].detach()
        return self.base

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "base": self.base, "added": self.added,
                "last_refined": -1 if self.last_refined is None else self.last_refined,
                "last_redistributed": (-1 if self.last_redistributed is None
                                       else self.last_redistributed)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.base = state["base"].to(self.base)
        self.added = state["added"].to(self.base)
        lr = int(state["last_refined"])
        self.last_refined = None if lr < 0 else lr
        lr = int(state.get("last_redistributed", -1))
        self.last_redistributed = None if lr < 0 else lr
