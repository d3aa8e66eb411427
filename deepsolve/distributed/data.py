"""Data-parallel training: the helpers the trainer uses under ``torchrun`` (layer 5).

``python -m deepsolve train ...`` runs unchanged under ``torchrun --nproc-per-node K``: the
launcher sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` and
:func:`setup` joins the process group (``nccl`` for CUDA, ``gloo`` for CPU; ``--device cuda``
becomes ``cuda:LOCAL_RANK``). Without those variables (or with ``WORLD_SIZE=1``) every helper
here is a no-op and the run is the ordinary single-process one.

How gradients are combined. Problems call ``ctx.model`` (or its parameters directly) inside
``ctx.unroll`` steps, and the executor computes the parameters' gradients in its own reverse
sweep (``torch.autograd.grad`` per recorded step). ``DistributedDataParallel`` only
synchronises gradients when the forward pass goes through the DDP wrapper, so it would
silently skip them. The trainer therefore averages gradients explicitly after every
backward pass: all gradients of a dtype go into one flat buffer, one ``all_reduce`` sums
them, and they are divided by the world size (:func:`average_gradients`). Each rank's loss is
the mean over its shard of the batch (:meth:`DistributedContext.shard`), so with equal shard
sizes the average of the ranks' gradients is exactly the gradient of the mean over the full
batch, and batch-independent terms (priors, regularisers), which every rank computes in
full, keep their weight. The loss terms are averaged the same way, so the log and an LBFGS
closure see the full-batch loss on every rank.
"""

from __future__ import annotations

import datetime as _dt
import gc
import math
import os
import signal
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..problem import Context
from .domain import shard

__all__ = [
    "DistInfo", "DistributedContext", "rank_device", "setup", "cleanup", "shard", "barrier",
    "average_gradients", "broadcast_model", "broadcast_buffers", "any_rank", "gather_floats",
    "check_batch", "nanmax",
]


@dataclass
class DistInfo:
    """This process's place in a run: rank, world size, local rank on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    initialized_here: bool = False   # setup() created the process group (cleanup() ends it)
    data_size: int = 0               # data-parallel ranks of the mesh (0: all of them)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def rank_device(device_name: str) -> str:
    """The device this process trains on, decided from the environment alone (nothing is
    started): ``device_name`` itself outside torchrun (``WORLD_SIZE`` unset or 1); under it
    ``cuda`` becomes ``cuda:LOCAL_RANK``, and ``cuda:N`` with several processes per node is
    refused (one line)."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return device_name
    local = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    dev = torch.device(device_name)
    if dev.type != "cuda":
        return device_name
    if dev.index is None:
        return f"cuda:{local}"
    if local_world > 1:
        raise ValueError(f"--device {device_name} with {local_world} processes per node "
                         "puts them all on one GPU; use --device cuda (each process takes "
                         "cuda:LOCAL_RANK)")
    return device_name


def setup(device_name: str, timeout_s: float = 600.0) -> tuple[DistInfo, str]:
    """Join the process group when ``WORLD_SIZE > 1`` (as set by torchrun); returns the
    :class:`DistInfo` and the device this rank trains on (``cuda`` -> ``cuda:LOCAL_RANK``)."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return DistInfo(), device_name
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in 0..{world - 1} (WORLD_SIZE={world})")
    if not torch.distributed.is_available():
        raise ValueError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
    device = rank_device(device_name)
    dev = torch.device(device_name)
    if dev.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.set_device(torch.device(device))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(f"the process group (rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}) does not match RANK={rank} "
                             f"WORLD_SIZE={world}")
        return DistInfo(rank, world, local, dist.get_backend(), False), device
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"WORLD_SIZE={world} but {name} is not set; start the run with "
                             "torchrun (see docs/hpc.md)")
    # The communication threads the process group starts inherit this thread's signal mask:
    # with the preemption signals blocked there, SIGTERM/SIGUSR1 always reach the main thread
    # (whose handler sets the stop flag) and never interrupt a system call of theirs.
    stop = {signal.SIGTERM, signal.SIGUSR1}
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world, timeout=_dt.timedelta(seconds=timeout_s))
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
    return DistInfo(rank, world, local, backend, True), device


def cleanup(info: DistInfo) -> None:
    """End the process group if :func:`setup` started it, and free its communication
    threads now.

    ``destroy_process_group`` removes the groups from torch's registry but a gloo group's
    threads end only when its last reference goes (gloo has no ``shutdown``), and the run's
    context refers to its mesh's groups through a reference cycle (the context's bound
    steps close over it). Left to the interpreter's exit, those threads may still be running
    while Python finalizes; one that then reaches for the GIL is unwound by
    ``pthread_exit`` through C++ code that cannot unwind, and the process aborts with
    "terminate called without an active exception" (SIGABRT) — or hangs. So the cycle is
    collected here, while every thread can still end normally: the trainer drops the run's
    caches first (:meth:`~deepsolve.Context.release`), and tests/test_distributed.py checks
    that no context of the run is alive in a rank when ``train`` returns."""
    if info.initialized_here and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        gc.collect()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        torch.distributed.barrier()


class DistributedContext(Context):
    """:class:`~deepsolve.Context` with the batch sharding and the domain decomposition of
    distributed runs.

    ``ctx.shard(x)`` is this rank's part of ``x`` along ``dim`` (default 0), ``ctx.shard(n)``
    and ``ctx.batch_slice(n)`` the ``slice`` of a batch of size ``n``; in a single-process run
    they return everything. Take the mean of a loss over the shard: with batch sizes
    divisible by the number of data ranks, the trainer's gradient average is then exactly
    the gradient of the mean over the full batch.

    ``ctx.slab(n, dim=-2, halo=1)`` splits a grid of ``n`` rows over the ``space`` ranks of
    the run's mesh (:class:`~deepsolve.distributed.Slab`; ``--set mesh=DATAxSPACE``, by
    default all ranks) and ``ctx.mesh`` is that mesh. Call ``ctx.slab`` in ``build`` before
    ``ctx.shard``. Under a decomposition the loss terms are shares (``slab.mean``,
    ``slab.share``): the trainer sums terms and gradients over the space ranks.

    With several processes, a budgeted ``ctx.unroll`` is planned once for all ranks (each
    profiles its own block; the plan fits the tightest rank), so communicating steps
    recompute in step.
    """

    _mesh: Any = None
    _sharded = False
    decomposed = False

    @property
    def mesh(self) -> Any:
        """The run's ``data × space`` mesh (built on first use; see
        :mod:`deepsolve.distributed.mesh`)."""
        if self._mesh is None:
            self._make_mesh(space_default=False)
        return self._mesh

    def _make_mesh(self, space_default: bool) -> None:
        from .mesh import make_mesh, parse_mesh

        shape = parse_mesh(getattr(self.cfg, "mesh", ""), self.world_size)
        if shape is None:
            shape = (1, self.world_size) if space_default else (self.world_size, 1)
        self._mesh = make_mesh(*shape, device_type=self.device.type, rank=self.rank)

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks (its batch shard)."""
        return self.mesh.data_rank if self.world_size > 1 else 0

    @property
    def data_size(self) -> int:
        """The number of data-parallel ranks (``world_size / space``)."""
        return self.mesh.data if self.world_size > 1 else 1

    def slab(self, n: int, *, dim: int = -2, halo: int = 1, periodic: bool = True) -> Any:
        """A slab decomposition of ``n`` rows along ``dim`` over this rank's ``space``
        group (the whole grid on one process)."""
        from .domain import Slab

        if self.world_size > 1:
            if self._mesh is None:
                self._make_mesh(space_default=True)
            elif self._mesh.space == 1 and not str(getattr(self.cfg, "mesh", "")).strip():
                raise ValueError("ctx.slab after ctx.shard: the batch is already split over "
                                 "every rank; call ctx.slab first in build, or give "
                                 "--set mesh=DATAxSPACE")
        self.decomposed = True
        group = self._mesh.space_group if self._mesh is not None else None
        return Slab(n, dim=dim, halo=halo, periodic=periodic, group=group)

    def batch_slice(self, n: int) -> slice:
        self._sharded = True
        return shard(n, self.data_rank, self.data_size)

    def shard(self, x: Any, dim: int = 0) -> Any:
        if isinstance(x, bool) or not isinstance(x, (int, torch.Tensor)):
            raise TypeError(f"ctx.shard takes a tensor or a batch size, got {type(x).__name__}")
        if isinstance(x, int):
            return self.batch_slice(x)
        s = self.batch_slice(x.shape[dim])
        if self.data_size == 1:
            return x
        return x.narrow(dim, s.start, s.stop - s.start)

    def unroll_request(self, step: Any, state: Any, n_steps: int | None = None,
                       **kw: Any) -> Any:
        req = super().unroll_request(step, state, n_steps, **kw)
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return req
        from ..memory.strategies import Budget

        opts = dict(req.options)
        for key in ("budget", "schedule"):   # budget="2GiB", budget=Budget(..), schedule=Budget(..)
            b = opts.get(key)
            if b is None or (key == "schedule" and not isinstance(b, Budget)):
                continue
            if not isinstance(b, Budget):
                b = Budget(b, opts.pop("offload", None), opts.pop("spill_dir", None))
            if b.group is None:
                b = Budget(b.budget, b.offload, b.spill_dir, group=torch.distributed.group.WORLD)
            opts[key] = b
        return req._replace(options=opts)


def check_batch(info: DistInfo, problem: Any, ctx: Context) -> None:
    """With ``problem.batch_size(ctx)`` defined: refuse fewer samples than ranks, warn (rank
    0) when the batch does not split evenly (the average of shard means then differs from
    the full-batch mean)."""
    fn = getattr(problem, "batch_size", None)
    if not info.enabled or not callable(fn):
        return
    b = int(fn(ctx))
    if b <= 0:
        return
    k = info.data_size or info.world_size
    if b < k:
        raise ValueError(f"batch size {b} is smaller than the number of data-parallel "
                         f"processes {k}: some ranks would get no samples")
    if b % k and info.is_main:
        warnings.warn(f"batch size {b} is not divisible by {k} processes; shards "
                      "differ in size and the averaged gradient is not exactly the full-batch "
                      "one", RuntimeWarning, stacklevel=2)


def average_gradients(info: DistInfo, params: Sequence[torch.Tensor],
                      terms: Mapping[str, torch.Tensor], loss: torch.Tensor
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Average the parameters' gradients, the loss terms and the loss over the ranks
    (all_reduce, sum / world size); returns the averaged ``(terms, loss)`` (detached).

    Under a ``data × space`` mesh (``info.data_size``) the sum is divided by the number of
    data ranks only: the sum over the space ranks (each holds its block's share) averaged
    over the data ranks.

    A parameter without a gradient on every rank keeps ``grad = None`` (optimisers skip it,
    as in a single-process run); one with a gradient on some ranks gets the others' zeros.
    """
    if not info.enabled:
        return dict(terms), loss
    dist = torch.distributed
    world = info.data_size or info.world_size
    dev = loss.device
    has = [p.grad is not None for p in params]
    small = torch.tensor([float(h) for h in has], dtype=torch.float64, device=dev)
    vals = [v.detach().reshape(()).to(dev, torch.float64) for v in terms.values()]
    vals.append(loss.detach().reshape(()).to(dev, torch.float64))
    small = torch.cat([small, torch.stack(vals)])
    dist.all_reduce(small)
    present = small[: len(params)].tolist()
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(params):
        if present[i] > 0:
            groups.setdefault((p.dtype, p.device), []).append(i)
    for idx in groups.values():
        parts = []
        for i in idx:
            g = params[i].grad
            if g is not None and g.is_sparse:
                raise ValueError("distributed training does not support sparse gradients")
            parts.append(torch.zeros_like(params[i]).reshape(-1) if g is None
                         else g.reshape(-1))
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        flat.div_(world)
        off = 0
        for i in idx:
            p = params[i]
            k = p.numel()
            p.grad = flat[off:off + k].view_as(p).clone()
            off += k
    for i, p in enumerate(params):
        if present[i] == 0:
            p.grad = None
    avg = (small[len(params):] / world).tolist()
    out = {k: torch.tensor(v, dtype=torch.float64) for k, v in zip(terms, avg[:-1], strict=True)}
    return out, torch.tensor(avg[-1], dtype=torch.float64)


def broadcast_model(info: DistInfo, model: torch.nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers."""
    if not info.enabled:
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            torch.distributed.broadcast(t.data, src=0)


def broadcast_buffers(info: DistInfo, model: torch.nn.Module) -> None:
    """Rank 0's floating-point buffers (running statistics...) to every rank, before each
    iteration, as DistributedDataParallel does."""
    if not info.enabled:
        return
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point():
                torch.distributed.broadcast(b, src=0)


def _sync_device(info: DistInfo, device: torch.device) -> torch.device:
    return device if info.backend == "nccl" else torch.device("cpu")


def any_rank(info: DistInfo, flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (the stop flag of a signal)."""
    if not info.enabled:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64,
                     device=_sync_device(info, device or torch.device("cpu")))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def gather_floats(info: DistInfo, values: Sequence[float],
                  device: torch.device | None = None) -> list[list[float]] | None:
    """Every rank's ``values`` (per-rank peak memory...) on rank 0, indexed by rank;
    ``None`` on the other ranks. Single process: ``[values]``."""
    vals = [float(v) for v in values]
    if not info.enabled:
        return [vals]
    dev = _sync_device(info, device or torch.device("cpu"))
    t = torch.tensor(vals, dtype=torch.float64, device=dev)
    out = [torch.empty_like(t) for _ in range(info.world_size)]
    torch.distributed.all_gather(out, t)
    if not info.is_main:
        return None
    return [o.tolist() for o in out]


def nanmax(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan
