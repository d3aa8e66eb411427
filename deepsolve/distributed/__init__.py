"""Distributed runs on ``torch.distributed``: data parallelism and domain decomposition.

* :mod:`.data` -- data-parallel training under torchrun: the process group, batch shards,
  gradient averaging, stop flags and per-rank peaks (what the trainer uses).
* :mod:`.halo` -- :func:`halo_exchange`, the differentiable exchange of boundary rows.
* :mod:`.domain` -- :class:`Slab`, one field split into blocks of rows over a group, with
  scatter/gather helpers and loss shares.
* :mod:`.mesh` -- the ``data × space`` process mesh (``torch.distributed.device_mesh``).

See docs/hpc.md.
"""

from .data import (
    DistInfo,
    DistributedContext,
    any_rank,
    average_gradients,
    barrier,
    broadcast_buffers,
    broadcast_model,
    check_batch,
    cleanup,
    gather_floats,
    nanmax,
    rank_device,
    setup,
    shard,
)
from .domain import Slab
from .halo import HaloTimeout, halo_exchange
from .mesh import Mesh, make_mesh, parse_mesh

__all__ = [
    "DistInfo", "DistributedContext", "rank_device", "setup", "cleanup", "shard", "barrier",
    "average_gradients", "broadcast_model", "broadcast_buffers", "any_rank", "gather_floats",
    "check_batch", "nanmax", "halo_exchange", "HaloTimeout", "Slab",
    "Mesh", "make_mesh", "parse_mesh",
]
