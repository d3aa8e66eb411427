"""One rank of the domain-decomposition tests (tests/test_domain.py), run under torchrun.

``python -m torch.distributed.run --nproc-per-node K domain_worker.py SCENARIO OUT``: every
rank computes the single-process reference itself (the whole grid, no communication) and
the decomposed run, and writes what it measured to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import deepsolve
from deepsolve.distributed import HaloTimeout, Slab, halo_exchange, make_mesh
from deepsolve.memory.meter import MemoryMeter

torch.set_default_dtype(torch.float64)


def circular(x, w):
    return torch.cat([x[..., -w:, :], x, x[..., :w, :]], dim=-2)


def zero_pad(x, w):
    z = x.new_zeros(*x.shape[:-2], w, x.shape[-1])
    return torch.cat([z, x, z], dim=-2)


class Model(torch.nn.Module):
    """A diffusion coefficient, an advection speed and a reaction rate: replicated."""

    def __init__(self):
        super().__init__()
        self.kappa = torch.nn.Parameter(torch.tensor(0.07))
        self.speed = torch.nn.Parameter(torch.tensor(0.3))
        self.rate = torch.nn.Parameter(torch.tensor(0.5))


def make_step(model, pad, dt=0.1):
    """x (..., rows, nx) -> the next state: diffusion, advection along y (the decomposed
    dimension, a 2-row-wide stencil), a nonlinear reaction."""

    def step(x, i):
        e = pad(x, 2)
        c = e[..., 2:-2, :]
        lap = (e[..., 1:-3, :] + e[..., 3:-1, :] - 2 * c
               + torch.roll(c, 1, -1) + torch.roll(c, -1, -1) - 2 * c)
        dy = (-e[..., 4:, :] + 8 * e[..., 3:-1, :] - 8 * e[..., 1:-3, :] + e[..., :-4, :]) / 12
        return x + dt * (model.kappa * lap - model.speed * dy + model.rate * torch.tanh(c))

    return step


def _problem(n, nx, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, n, nx, generator=g)
    target = torch.randn(2, n, nx, generator=g)
    return x0, target


def _loss_full(model, x0, target, steps):
    xT = deepsolve.unroll(make_step(model, circular), x0, steps)
    prior = 1e-2 * (model.kappa ** 2 + model.rate ** 2)
    return ((xT - target) ** 2).mean() + prior


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def scenario_halo(out):
    """halo_exchange against the single-process pads: values, a vector-Jacobian product,
    and torch.autograd.gradcheck of gather(halo(local(x))) on every rank."""
    res = {}
    n, nx = 13, 3
    X = torch.randn(2, n, nx, generator=torch.Generator().manual_seed(1))
    for periodic in (True, False):
        for w in (1, 2):
            slab = Slab(n, dim=-2, halo=w, periodic=periodic)
            pad = circular if periodic else zero_pad
            key = f"{'periodic' if periodic else 'walls'}_w{w}"
            x = slab.local(X).clone().requires_grad_(True)
            y = slab.halo(x)
            Xr = X.clone().requires_grad_(True)
            Y = pad(Xr, w)
            ref = Y[..., slab.start:slab.stop + 2 * w, :]
            res[f"{key}_value"] = float((y - ref).detach().abs().max())
            G = torch.randn(Y.shape, generator=torch.Generator().manual_seed(2))
            (y * G[..., slab.start:slab.stop + 2 * w, :]).sum().backward()
            sizes = slab.sizes
            starts = [sum(sizes[:r]) for r in range(len(sizes))]
            total = sum((Y[..., s:s + k + 2 * w, :] * G[..., s:s + k + 2 * w, :]).sum()
                        for s, k in zip(starts, sizes, strict=True))
            total.backward()
            res[f"{key}_vjp"] = float((x.grad - Xr.grad[..., slab.start:slab.stop, :]).abs().max())

            def f(z, slab=slab, w=w):  # reads both halos: rows i - w and i + w
                h = slab.halo(slab.local(z))
                return slab.gather(h[..., :-2 * w, :] * h[..., 2 * w:, :])

            small = torch.randn(1, n, 2, generator=torch.Generator().manual_seed(3),
                                requires_grad=True)
            res[f"{key}_gradcheck"] = bool(torch.autograd.gradcheck(f, (small,), eps=1e-6,
                                                                    atol=1e-8))
    return res


def scenario_unroll(out, steps=12, snapshots=3):
    """A checkpointed unroll of a communicating step: the parameters' gradients (summed over
    the ranks) and the initial field's equal the single-process autograd ones; tracked
    memory is the block's share; a budgeted plan is the same on every rank."""
    res = {}
    n, nx = 18, 10
    x0, target = _problem(n, nx)
    ref_model = Model()
    X0 = x0.clone().requires_grad_(True)
    with MemoryMeter("cpu", stats=(s1 := deepsolve.UnrollStats())) as m1:
        xT = deepsolve.unroll(make_step(ref_model, circular), X0, steps, snapshots=snapshots,
                              stats=s1)
        loss = ((xT - target) ** 2).mean() + 1e-2 * (ref_model.kappa ** 2 + ref_model.rate ** 2)
        loss.backward()
    res["tracked_single"] = m1.tracked_peak
    ref = _grads(ref_model)
    mesh = make_mesh(*json.loads(os.environ.get("MESH", "[1, 0]"))) \
        if os.environ.get("MESH") else None
    group = mesh.space_group if mesh is not None else None
    slab = Slab(n, dim=-2, halo=2, group=group)
    res["rows"], res["n"] = slab.rows, n
    for how in ("snapshots", "budget"):
        model = Model()
        Xd = x0.clone().requires_grad_(True)
        kw = {"snapshots": snapshots} if how == "snapshots" else {
            "budget": deepsolve.Budget(40_000, group=dist.group.WORLD)}
        stats = deepsolve.UnrollStats()
        with MemoryMeter("cpu", stats=stats) as m:
            xT = deepsolve.unroll(make_step(model, slab.halo), slab.local(Xd), steps,
                                  stats=stats, **kw)
            loss = slab.mean((xT - slab.local(target)) ** 2) + slab.share(
                1e-2 * (model.kappa ** 2 + model.rate ** 2))
            loss.backward()
        grads = _grads(model)
        for g in grads:
            dist.all_reduce(g, group=group)  # the sum over the space ranks
        res[f"{how}_param_err"] = max(float((a - b).abs().max() / b.abs().max())
                                      for a, b in zip(grads, ref, strict=True))
        res[f"{how}_x0_err"] = float((Xd.grad - X0.grad).abs().max() / X0.grad.abs().max())
        res[f"{how}_schedule"] = stats.schedule
        res[f"{how}_tracked"] = m.tracked_peak
        res[f"{how}_counts"] = [stats.advances, stats.recorded]
    res["single_counts"] = [s1.advances, s1.recorded]
    return res


def scenario_raise(out, hang=False):
    """Rank 1 raises inside step 3 (exits), or with ``hang`` stops answering (sleeps); every
    other rank must stop with HaloTimeout, at once or within the group's timeout."""
    slab = Slab(8 * dist.get_world_size(), dim=-2, halo=1)
    model = Model()

    def step(x, i):
        if i == 3 and dist.get_rank() == 1:
            time.sleep(8 if hang else 0.5)
            raise RuntimeError("rank 1 fails inside step 3")
        return x + 0.1 * model.kappa * halo_exchange(x, -2, 1)[..., 2:, :]

    t0 = time.perf_counter()
    try:
        deepsolve.unroll(step, torch.randn(2, slab.rows, 4), 10, snapshots=3).sum().backward()
        return {"error": None}
    except HaloTimeout as e:
        return {"error": "HaloTimeout", "message": str(e), "seconds": time.perf_counter() - t0}
    except RuntimeError as e:
        return {"error": "RuntimeError", "message": str(e), "seconds": time.perf_counter() - t0}


def scenario_hang(out):
    if dist.get_rank() == 1:   # it would answer after 8 s: the others must not wait that long
        res = {"error": "hung"}
        with open(os.path.join(out, "rank1.json"), "w") as f:
            json.dump(res, f)
    return scenario_raise(out, hang=True)


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    timeout = float(os.environ.get("GROUP_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    if scenario == "hang" and rank == 1:
        scenario_hang(out)
        os._exit(0)
    try:
        res = globals()[f"scenario_{scenario}"](out)
    except Exception as e:  # recorded, so that the test shows it
        res = {"exception": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if scenario not in ("raise", "hang"):
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
