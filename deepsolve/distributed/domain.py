r"""Slab decomposition: one field split into blocks of rows over the ranks of a group.

A grid of ``n`` rows along one dimension (``dim``) is split into ``K`` contiguous blocks, one
per rank of the process group in rank order, of sizes differing by at most one (the first
``n mod K`` ranks own one row more; :func:`~deepsolve.distributed.shard`). A rank holds its
block, computes on it with the halo rows of its neighbours (:func:`.halo_exchange`), and
never the whole field: the state, the snapshots and the tapes of a checkpointed unroll are
``1/K`` of the single-process ones plus the halos.

:class:`Slab` carries the layout and the helpers a problem needs:

* ``slab.local(x)``: this rank's block of a field every rank holds in full (an initial
  condition built from the same seed, observations, coordinates). Differentiable: the
  gradient of the full field is the sum of the ranks' block gradients (one ``all_reduce``).
* ``slab.gather(x)``: the full field from the blocks, on every rank (diagnostics, metrics,
  plots). Differentiable: a rank's block gets its own part of the gradient.
* ``slab.halo(x)``: :func:`.halo_exchange` with the slab's dimension, width and group.
* ``slab.mean(x)`` and ``slab.share(t)``: loss terms as *shares*. The trainer sums loss terms
  and gradients over the ranks of the decomposition (and averages them over data-parallel
  ranks), so a term must be this rank's part of the global value: ``slab.mean(e)`` is
  ``sum(e) / N_global`` (the shares add up to the global mean) and ``slab.share(t)`` is
  ``t / K`` for a term every rank computes in full (a prior on the parameters).

On one process (no process group, or a group of one) a slab is the whole grid and every
helper is the identity, so the same problem file runs on 1 and on ``K`` processes.
"""

from __future__ import annotations

from typing import Any

import torch

from .halo import group_of, halo_exchange

__all__ = ["Slab", "shard"]


def shard(n: int, rank: int, world: int) -> slice:
    """This rank's contiguous part of a batch dimension of size ``n``: ``world`` blocks whose
    sizes differ by at most one (the first ``n % world`` ranks get one more)."""
    n, rank, world = int(n), int(rank), int(world)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    if n < 0:
        raise ValueError(f"batch size must be >= 0, got {n}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class _Local(torch.autograd.Function):
    """Forward: this rank's block of a replicated tensor. Backward: the full gradient (the
    blocks' gradients summed over the group)."""

    @staticmethod
    def forward(ctx, x, slab: _Bound):
        ctx.slab, ctx.shape = slab, x.shape
        return x.narrow(slab.dim, slab.start, slab.rows).clone()

    @staticmethod
    def backward(ctx, g):
        s = ctx.slab
        full = g.new_zeros(ctx.shape)
        full.narrow(s.dim, s.start, s.rows).copy_(g)
        torch.distributed.all_reduce(full, group=s.group)
        return full, None


class _Gather(torch.autograd.Function):
    """Forward: the full tensor from the blocks, on every rank. Backward: this rank's part."""

    @staticmethod
    def forward(ctx, x, slab: _Bound):
        ctx.slab = slab
        return slab._all_gather(x)

    @staticmethod
    def backward(ctx, g):
        s = ctx.slab
        return g.narrow(s.dim, s.start, s.rows).contiguous(), None


class Slab:
    """A slab decomposition of ``n`` rows along ``dim`` over a process group.

    Args:
        n: the global number of rows along the decomposed dimension.
        dim: that dimension of the fields (negative: from the end, e.g. ``-2`` for the
            ``y`` rows of ``(..., ny, nx)`` fields); the other dimensions are whole on every
            rank.
        halo: the halo width of :meth:`halo` (the stencil's half-width).
        periodic: the domain wraps around along ``dim``.
        group: the process group (``None``: the default group when one runs, else one
            process); the trainer gives the ``space`` group of its mesh (``ctx.slab``).

    Attributes:
        size, rank: the group's size ``K`` and this rank's place in it.
        sizes: the rows of every rank's block; ``start``, ``stop``, ``rows``: this rank's.
    """

    def __init__(self, n: int, *, dim: int = -2, halo: int = 1, periodic: bool = True,
                 group: Any = None):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Slab: n must be an integer >= 1 (the global rows), got {n!r}")
        if isinstance(halo, bool) or not isinstance(halo, int) or halo < 0:
            raise ValueError(f"Slab: halo must be an integer >= 0, got {halo!r}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"Slab: dim must be an integer, got {dim!r}")
        self.n, self.dim, self.width, self.periodic = n, dim, halo, bool(periodic)
        self.group, self.size, self.rank = group_of(group)
        if n < self.size:
            raise ValueError(f"Slab: {n} rows cannot be split over {self.size} ranks; use fewer "
                             "processes (or --set mesh=DATAxSPACE with a smaller SPACE)")
        blocks = [shard(n, r, self.size) for r in range(self.size)]
        self.sizes = [b.stop - b.start for b in blocks]
        if self.size > 1 and min(self.sizes) < halo:
            raise ValueError(f"Slab: {n} rows over {self.size} ranks give blocks of "
                             f"{min(self.sizes)} rows, fewer than the halo width {halo}; use "
                             "fewer ranks or a finer grid")
        own = blocks[self.rank]
        self.start, self.stop, self.rows = own.start, own.stop, own.stop - own.start

    def __repr__(self) -> str:
        return (f"Slab(n={self.n}, dim={self.dim}, halo={self.width}, rank {self.rank} of "
                f"{self.size}: rows {self.start}..{self.stop - 1})")

    @property
    def slice(self) -> slice:
        """This rank's rows of the global grid."""
        return slice(self.start, self.stop)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def _dim(self, x: torch.Tensor) -> int:
        d = self.dim % x.dim() if -x.dim() <= self.dim < x.dim() else None
        if d is None:
            raise ValueError(f"Slab: dim={self.dim} is not a dimension of a {x.dim()}-d tensor")
        return d

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``x`` (the full field, the same on every rank), shape
        ``(..., rows, ...)``; the full field itself on one process."""
        d = self._dim(x)
        if x.shape[d] != self.n:
            raise ValueError(f"Slab.local: x has {x.shape[d]} rows along dim {self.dim}, the "
                             f"slab {self.n}; give the full field")
        if not self.distributed:
            return x
        view = _Bound(self, d)
        return _Local.apply(x, view) if x.requires_grad else \
            x.narrow(d, self.start, self.rows)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full field from every rank's block ``x`` (``rows`` rows along ``dim``), on
        every rank; ``x`` itself on one process. A collective: every rank calls it."""
        d = self._dim(x)
        if x.shape[d] != self.rows:
            raise ValueError(f"Slab.gather: x has {x.shape[d]} rows along dim {self.dim}, "
                             f"this rank's block {self.rows}")
        if not self.distributed:
            return x
        view = _Bound(self, d)
        if x.requires_grad and torch.is_grad_enabled():
            return _Gather.apply(x, view)
        return view._all_gather(x)

    def halo(self, x: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """``x`` extended by ``width`` (default: the slab's) rows of each neighbour
        (:func:`~deepsolve.distributed.halo_exchange`)."""
        return halo_exchange(x, self._dim(x), self.width if width is None else width,
                             periodic=self.periodic, group=self.group)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean of a decomposed field ``x`` (its block):
        ``x.sum() / N``, ``N`` the global number of elements. The shares of the ranks add up
        to the mean over the whole field."""
        d = self._dim(x)
        if x.shape[d] != self.rows:
            raise ValueError(f"Slab.mean: x has {x.shape[d]} rows along dim {self.dim}, "
                             f"this rank's block {self.rows}")
        return x.sum() / (x.numel() // max(self.rows, 1) * self.n)

    def share(self, t: torch.Tensor) -> torch.Tensor:
        """``t / K``: this rank's share of a term every rank computes in full."""
        return t / self.size


class _Bound:
    """A slab with its dimension resolved for one tensor's rank (what the autograd
    functions need)."""

    def __init__(self, slab: Slab, dim: int):
        self.dim, self.start, self.rows = dim, slab.start, slab.rows
        self.group, self.size, self.sizes = slab.group, slab.size, slab.sizes

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        d, m = self.dim, max(self.sizes)
        x = x.contiguous()
        if x.shape[d] < m:   # all_gather takes equal shapes: pad the short blocks
            z = x.new_zeros(*x.shape[:d], m - x.shape[d], *x.shape[d + 1:])
            x = torch.cat([x, z], d)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return torch.cat([p.narrow(d, 0, k) for p, k in zip(parts, self.sizes, strict=True)], d)
