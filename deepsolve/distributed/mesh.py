"""The process mesh of a run: ``data × space`` ranks (``torch.distributed.device_mesh``).

``world_size = data * space`` processes are laid out as a 2-D device mesh, row-major:
rank ``= d * space + s``. The ``space`` ranks of one row split one field (a slab
decomposition, :class:`~deepsolve.distributed.Slab`), so consecutive ranks (one node's GPUs)
share a domain and talk through halos; the ``data`` ranks of one column hold different
members of the batch (``ctx.shard``). ``--set mesh=2x2`` asks for 2 × 2; the default
(``mesh=""``) is ``1 × K`` for a problem that decomposes its domain (``ctx.slab``) and
``K × 1`` for one that does not.

Gradients and loss terms: the trainer all-reduces them over the whole world and divides by
``data``: the sum over the space ranks (each holds its block's share) and the mean over the
data ranks (each holds its shard's mean).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Mesh", "parse_mesh", "make_mesh"]


def parse_mesh(text: str, world: int) -> tuple[int, int] | None:
    """``"DxS"`` (data × space, ``D * S = world``; ``*`` for one of them: the rest) to
    ``(D, S)``; ``""`` to ``None`` (decided by the problem). One-line ``ValueError``."""
    t = str(text).strip().lower()
    if not t:
        return None
    m = re.fullmatch(r"(\d+|\*)\s*[x×]\s*(\d+|\*)", t)
    if m is None:
        raise ValueError(f"setting mesh={text!r} is not DATAxSPACE (e.g. 2x2, 1x4, *x2); "
                         "use --set mesh=DxS with D*S processes")
    a, b = m.groups()
    if a == "*" and b == "*":
        raise ValueError(f"setting mesh={text!r}: give at least one of DATA and SPACE")
    if a == "*" or b == "*":
        k = int(b if a == "*" else a)
        if k < 1 or world % k:
            raise ValueError(f"setting mesh={text!r}: {k} does not divide the {world} "
                             "processes of this run")
        d, s = (world // k, k) if a == "*" else (k, world // k)
    else:
        d, s = int(a), int(b)
    if d < 1 or s < 1 or d * s != world:
        raise ValueError(f"setting mesh={text!r} asks for {d}x{s} = {d * s} processes but "
                         f"this run has {world}; start it with torchrun --nproc-per-node "
                         f"{d * s} or change the mesh")
    return d, s


@dataclass
class Mesh:
    """A run's ``data × space`` layout and this rank's coordinates and groups (``None`` on a
    single process)."""

    data: int = 1
    space: int = 1
    data_rank: int = 0
    space_rank: int = 0
    data_group: Any = None
    space_group: Any = None
    device_mesh: Any = None

    @property
    def world(self) -> int:
        return self.data * self.space


def make_mesh(data: int, space: int, device_type: str = "cpu", rank: int = 0) -> Mesh:
    """Build the mesh on the running process group (every rank calls it, in the same
    order). Without a process group: the coordinates of ``rank`` alone, no groups (a
    context made outside torchrun, as in tests)."""
    dist = torch.distributed
    if data < 1 or space < 1:
        raise ValueError(f"a mesh needs DATA, SPACE >= 1, got {data}x{space}")
    if data * space == 1 or not (dist.is_available() and dist.is_initialized()):
        if not 0 <= rank < data * space:
            raise ValueError(f"rank {rank} is not in a {data}x{space} mesh")
        return Mesh(data, space, rank // space, rank % space)
    world, rank = dist.get_world_size(), dist.get_rank()
    if data * space != world:
        raise ValueError(f"a {data}x{space} mesh needs {data * space} processes, not {world}")
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh(device_type, (data, space), mesh_dim_names=("data", "space"))
    return Mesh(data, space, rank // space, rank % space, dm.get_group("data"),
                dm.get_group("space"), dm)
