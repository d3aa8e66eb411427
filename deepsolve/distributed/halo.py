r"""Halo exchange: the neighbours' boundary rows of a decomposed field, differentiable.

A field decomposed along one dimension (a *slab* decomposition, :mod:`.domain`) lives as
``K`` blocks, one per rank of a process group, in rank order: rank ``r`` owns rows
``start_r .. stop_r - 1`` of the global grid. A stencil of half-width ``w`` on the block
needs ``w`` rows of each neighbour. :func:`halo_exchange` returns the block extended by those
rows,

.. math::

    \tilde x_r = [\,x_{r-1}[-w:],\; x_r,\; x_{r+1}[:w]\,] \quad\text{along ``dim``},

with indices ``r \pm 1`` taken modulo ``K`` when the domain is periodic, and zero rows past
the domain's edges when it is not. On one rank (no process group, or a group of one) it is
the circular pad ``torch.cat([x[-w:], x, x[:w]], dim)`` (or a zero pad) it replaces, so a
solver written with it runs unchanged on one process and on ``K``.

Its adjoint is the transpose: the gradient of the halo rows goes back to the rank that owns
them and is added there,

.. math::

    \bar x_r = \bar{\tilde x}_r[w:-w] + \text{(first } w \text{ rows)}\;
    \bar{\tilde x}_{r-1}[-w:] + \text{(last } w \text{ rows)}\; \bar{\tilde x}_{r+1}[:w],

so gradients through a decomposed unroll equal those of the single-process one (up to the
order of floating-point sums, which is the same here: each element receives at most one
halo term per side).

Communication: point-to-point ``isend``/``irecv`` of contiguous ``w``-row slices on the
group (gloo on CPU, NCCL on CUDA), four messages per exchange and four per adjoint, posted
in an order that matches pairwise even when both neighbours are the same rank (``K = 2``)
and tagged for gloo. Every receive waits at most the process group's timeout (the trainer's
``dist_timeout``; or ``timeout=`` seconds, which costs a little more per wait with gloo); a
neighbour that failed (its connection closes: at once) or stopped answering (at the
timeout) makes this rank raise :class:`HaloTimeout`, one line, instead of hanging.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import torch

__all__ = ["halo_exchange", "HaloTimeout", "group_of"]

# message tags: forward (to the next rank, to the previous one), adjoint (same)
_TO_NEXT, _TO_PREV, _ADJ_TO_PREV, _ADJ_TO_NEXT = 11, 12, 13, 14


class HaloTimeout(RuntimeError):
    """A neighbour did not answer a halo exchange in time (it failed, stopped, or runs a
    different schedule)."""


def group_of(group: Any = None) -> tuple[Any, int, int]:
    """``(group, size, rank in group)`` of ``group`` (``None``: the default group when a
    process group is running, else a single process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("halo_exchange: group= given but no process group is running; "
                             "start the run with torchrun (see docs/hpc.md)")
        return None, 1, 0
    g = group if group is not None else dist.group.WORLD
    return g, dist.get_world_size(g), dist.get_rank(g)


def _pad_local(x: torch.Tensor, dim: int, w: int, periodic: bool) -> torch.Tensor:
    if periodic:
        n = x.shape[dim]
        return torch.cat([x.narrow(dim, n - w, w), x, x.narrow(dim, 0, w)], dim)
    z = x.new_zeros(*x.shape[:dim], w, *x.shape[dim + 1:])
    return torch.cat([z, x, z], dim)


class _Comm:
    """One exchange's peers and timeout on a group of ``size > 1``."""

    def __init__(self, group, size: int, rank: int, periodic: bool, timeout: float | None):
        self.group = group
        self.size = size
        self.rank = rank
        self.prev = (rank - 1) % size if (periodic or rank > 0) else None
        self.next = (rank + 1) % size if (periodic or rank < size - 1) else None
        self.timeout = timeout

    def _swap(self, sends: list, recvs: list, what: str) -> None:
        """Post ``sends`` then ``recvs`` (``(tensor, peer, tag)``, peers as group ranks) and
        wait for all of them, at most ``timeout`` seconds each."""
        dist = torch.distributed
        works = []
        for t, peer, tag in sends:
            works.append(("send to", peer, dist.isend(t, group=self.group, tag=tag,
                                                      group_dst=peer)))
        for t, peer, tag in recvs:
            works.append(("receive from", peer, dist.irecv(t, group=self.group, tag=tag,
                                                           group_src=peer)))
        limit = None if self.timeout is None else _dt.timedelta(seconds=self.timeout)
        for verb, peer, work in works:
            assert work is not None  # isend/irecv give None only to ranks outside the group
            try:
                if limit is None:
                    work.wait()   # the process group's timeout
                else:
                    work.wait(limit)
            except RuntimeError as e:
                first = " ".join(str(e).split())[:160]
                waited = "the group's timeout" if limit is None else f"{self.timeout:g} s"
                raise HaloTimeout(
                    f"halo exchange ({what}): rank {self.rank} of the decomposition could not "
                    f"{verb} rank {peer}: that rank failed or stopped (see its message; waited "
                    f"at most {waited}) [{first}]") from None

    def forward(self, x: torch.Tensor, dim: int, w: int) -> torch.Tensor:
        n = x.shape[dim]
        first = x.narrow(dim, 0, w).contiguous()
        last = x.narrow(dim, n - w, w).contiguous()
        shape = (*x.shape[:dim], w, *x.shape[dim + 1:])
        left = x.new_zeros(shape)
        right = x.new_zeros(shape)
        sends, recvs = [], []
        if self.next is not None:
            sends.append((last, self.next, _TO_NEXT))
        if self.prev is not None:
            sends.append((first, self.prev, _TO_PREV))
        if self.prev is not None:
            recvs.append((left, self.prev, _TO_NEXT))
        if self.next is not None:
            recvs.append((right, self.next, _TO_PREV))
        self._swap(sends, recvs, "forward")
        return torch.cat([left, x, right], dim)

    def backward(self, g: torch.Tensor, dim: int, w: int, n: int) -> torch.Tensor:
        g_left = g.narrow(dim, 0, w).contiguous()
        g_right = g.narrow(dim, n + w, w).contiguous()
        core = g.narrow(dim, w, n)
        shape = g_left.shape
        from_next = g.new_zeros(shape)   # adjoint of the next rank's left halo: my last rows
        from_prev = g.new_zeros(shape)   # adjoint of the previous rank's right halo: my first
        sends, recvs = [], []
        if self.prev is not None:
            sends.append((g_left, self.prev, _ADJ_TO_PREV))
        if self.next is not None:
            sends.append((g_right, self.next, _ADJ_TO_NEXT))
        if self.next is not None:
            recvs.append((from_next, self.next, _ADJ_TO_PREV))
        if self.prev is not None:
            recvs.append((from_prev, self.prev, _ADJ_TO_NEXT))
        self._swap(sends, recvs, "adjoint")
        zeros = core.new_zeros(*core.shape[:dim], n - w, *core.shape[dim + 1:])
        return core + torch.cat([from_prev, zeros], dim) + torch.cat([zeros, from_next], dim)


class _HaloFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, w: int, comm: _Comm):
        ctx.dim, ctx.w, ctx.n, ctx.comm = dim, w, x.shape[dim], comm
        return comm.forward(x, dim, w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.comm.backward(g.contiguous(), ctx.dim, ctx.w, ctx.n), None, None, None


def halo_exchange(x: torch.Tensor, dim: int, width: int, *, periodic: bool = True,
                  group: Any = None, timeout: float | None = None) -> torch.Tensor:
    """This rank's block ``x`` extended by ``width`` rows of each neighbour along ``dim``.

    Args:
        x: the block, shape ``(..., n, ...)`` with ``n >= width`` rows along ``dim``
            (the blocks of the ranks, in rank order, tile the global grid).
        dim: the decomposed dimension.
        width: the halo width ``w >= 1`` (the stencil's half-width).
        periodic: the first rank's left neighbour is the last rank (and vice versa);
            otherwise the rows past the domain's edges are zeros.
        group: the process group the field is decomposed over (``None``: the default group;
            without a process group, a single block).
        timeout: seconds to wait for a neighbour (default: the process group's timeout,
            which the trainer sets from ``--set dist_timeout=...``).

    Returns:
        shape ``(..., n + 2 w, ...)``: ``[left halo, x, right halo]``. Differentiable; its
        backward sends the halo gradients to their owners and adds theirs.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"halo_exchange: x must be a tensor, got {type(x).__name__}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"halo_exchange: width must be an integer >= 1, got {width!r}")
    nd = x.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"halo_exchange: dim={dim} is not a dimension of a {nd}-d tensor")
    dim %= nd
    n = x.shape[dim]
    g, size, rank = group_of(group)
    if n < width:
        raise ValueError(f"halo_exchange: the block of rank {rank} has {n} rows along dim {dim}, "
                         f"fewer than the halo width {width}; use fewer ranks or a finer grid")
    if size == 1:
        return _pad_local(x, dim, width, periodic)
    comm = _Comm(g, size, rank, periodic, None if timeout is None else float(timeout))
    return _HaloFunction.apply(x, dim, width, comm)
