"""Mixed precision: steps under torch.autocast give the gradients of plain autograd, and the
opt-in bf16 snapshots cost a measured, bounded gradient error (and half the snapshot memory)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rel
from torch import nn

import deepsolve
from deepsolve import schedules as S
from deepsolve.memory import predicted_peak, profile_step
from deepsolve.physics import Grid, NavierStokes2D, kolmogorov_forcing, random_initial

DT = torch.float64
BF16 = torch.bfloat16


def rel_all(grads, ref) -> float:
    num = sum(((a - b).double() ** 2).sum() for a, b in zip(grads, ref, strict=True))
    return math.sqrt(num / sum((b.double() ** 2).sum() for b in ref))


def mlp_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def step(x, i):  # float32 state; the MLP runs in the autocast dtype
        return x + 0.1 * net(x).float()

    x0 = torch.randn(4, 8, requires_grad=True)
    return step, x0, [x0, *net.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_steps_equal_plain_autograd(dtype):
    """Under autocast the state and adjoints stay float32; gradients equal plain autograd
    run with autocast's weight-cast cache off (each step casts its weights, as deepsolve's
    recorded steps do; with the cache, plain autograd sums all steps' weight gradients in
    the low precision)."""
    step, x0, leaves = mlp_step()
    n = 30
    with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        y = x0
        for i in range(n):
            y = step(y, i)
        ref = torch.autograd.grad(y.pow(2).sum(), leaves)
    for kw in (dict(snapshots=3), dict(schedule=S.revolve_tail(n, 3, 6), policy="save_expensive"),
               dict(schedule="store_all", policy="recompute_all")):
        with torch.autocast("cpu", dtype=dtype):
            y = deepsolve.unroll(step, x0, n, **kw)
            assert y.dtype == torch.float32
            grads = torch.autograd.grad(y.pow(2).sum(), leaves)
        for g, r in zip(grads, ref, strict=True):
            assert g.dtype == torch.float32 and rel(g, r) <= 1e-6


def test_fp16_with_a_grad_scaler():
    """fp16 autocast with loss scaling: the scaled adjoints pass through the checkpointed
    unroll like any other; the unscaled gradients equal plain autograd's."""
    step, x0, leaves = mlp_step()
    n = 20
    grads = []
    for kw in (None, dict(snapshots=3)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for t in leaves:
            t.grad = None
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            y = x0
            if kw is None:
                for i in range(n):
                    y = step(y, i)
            else:
                y = deepsolve.unroll(step, x0, n, **kw)
            loss = y.pow(2).sum()
        scaler.scale(loss).backward()
        opt = torch.optim.SGD(leaves, lr=0.0)
        scaler.unscale_(opt)
        grads.append([t.grad.clone() for t in leaves])
    for g, r in zip(*grads, strict=True):
        assert rel(g, r) <= 1e-6


def linear_ode():
    """x' = A x, explicit Euler, float64, A learnable."""
    g = torch.Generator().manual_seed(0)
    A = nn.Parameter(-0.5 * torch.eye(8, dtype=DT) + 0.3 * torch.randn(8, 8, generator=g,
                                                                         dtype=DT))
    x0 = torch.randn(4, 8, generator=g, dtype=DT, requires_grad=True)

    def step(x, i):
        return x + 0.01 * x @ A.T

    return step, x0, A


def test_bf16_snapshots_linear_ode_error_is_small_and_bounded():
    step, x0, A = linear_ode()
    n, s = 200, 5
    y_ref = deepsolve.unroll(step, x0, n)
    ref = torch.autograd.grad(y_ref.pow(2).sum(), [x0, A])
    st = deepsolve.UnrollStats()
    y = deepsolve.unroll(step, x0, n, snapshots=s, snapshot_dtype=BF16, stats=st)
    assert torch.equal(y, y_ref)  # the forward sweep never reads a snapshot
    gx, gA = torch.autograd.grad(y.pow(2).sum(), [x0, A])
    # the adjoint of a linear step does not depend on the state: exact
    assert rel(gx, ref[0]) <= 1e-12
    # dL/dA = sum_i lambda_{i+1} x_i^T uses states recomputed from rounded snapshots:
    # measured 6.7e-4 (bf16 keeps 8 significant bits, 2^-9 = 2.0e-3)
    err = rel(gA, ref[1])
    assert 1e-5 < err < 5e-3
    assert st.snapshot_bytes_peak == (s - 1) * x0.numel() * 2  # bf16: 2 bytes per number
    assert st.extra["snapshot_dtype"] == "torch.bfloat16"


def small_navier_stokes(n: int = 32):
    torch.manual_seed(0)
    grid = Grid(n)
    forcing = kolmogorov_forcing(grid, amplitude=1.0, wavenumber=4, dtype=DT)
    dt = 0.5 * (2 * math.pi / n) / 3.0
    ns = NavierStokes2D(grid, nu=1e-3, dt=dt, alpha=0.1, forcing=forcing)
    conv = nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular").to(DT)
    w0 = random_initial(grid, torch.Generator().manual_seed(0), batch_shape=(1,), dtype=DT)
    w0.requires_grad_()

    def step(w, i):
        return ns.step(w) + dt * conv(w.unsqueeze(1)).squeeze(1)

    return step, w0, [w0, *conv.parameters()]


def test_bf16_snapshots_navier_stokes_error_is_bounded():
    step, w0, leaves = small_navier_stokes()
    n, s = 60, 4
    ref = torch.autograd.grad(deepsolve.unroll(step, w0, n).pow(2).mean(), leaves)
    y = deepsolve.unroll(step, w0, n, snapshots=s, snapshot_dtype=BF16)
    grads = torch.autograd.grad(y.pow(2).mean(), leaves)
    err = rel_all(grads, ref)
    assert 1e-5 < err < 1e-2  # measured 1.1e-3 (the initial-condition gradient: 9.9e-3)
    exact = torch.autograd.grad(deepsolve.unroll(step, w0, n, snapshots=s).pow(2).mean(),
                                leaves)
    assert rel_all(exact, ref) <= 1e-10  # without the opt-in, exact


def test_bf16_snapshots_online_and_two_level():
    step, x0, A = linear_ode()
    n = 120
    ref = torch.autograd.grad(deepsolve.unroll(step, x0, n).pow(2).sum(), A)[0]
    y = deepsolve.unroll(step, x0, until=lambda x, i: i >= n, snapshots=4, snapshot_dtype=BF16)
    assert rel(torch.autograd.grad(y.pow(2).sum(), A)[0], ref) < 5e-3
    y = deepsolve.engine.execute(step, x0, S.two_level(n, 3, 4, write_cost=1.0, read_cost=1.0),
                                   snapshot_dtype=BF16)
    assert rel(torch.autograd.grad(y.pow(2).sum(), A)[0], ref) < 5e-3


def test_planner_counts_smaller_snapshots():
    _, _, A = linear_ode()

    def step(x, i):  # saves several state-sized tensors (no mixed checkpointing)
        return x + 0.01 * torch.sin(torch.tanh(torch.exp(-(x @ A.T) ** 2)))

    x0 = torch.randn(4096, 8, dtype=DT)  # 256 KiB float64 state; bf16 snapshots are 1/4
    n = 500
    p = profile_step(step, x0)
    budget = predicted_peak(p, n, "revolve", 40)
    full = deepsolve.plan(step, x0, n, budget=budget, policy="none")
    small = deepsolve.plan(step, x0, n, budget=budget, policy="none", snapshot_dtype=BF16)
    assert full.kind == "revolve" and full.snapshots == 40
    # a bf16 slot holds a quarter of the state plus the same measured objects beside it:
    # about 4x the slots (the objects are measured again by each plan, so not exactly 4x),
    # as many as fit (one more would not)
    assert small.snapshots >= 3 * full.snapshots and small.predicted_peak <= budget
    assert predicted_peak(small.profile, n, "revolve", small.snapshots + 1) > budget
    assert small.profile.slot_bytes == p.state_bytes // 4 + small.profile.slot_extra
    assert "snapshots stored as torch.bfloat16" in small.explain()
    slots = deepsolve.memory.planner.online_snapshots(step, x0, budget)
    assert deepsolve.memory.planner.online_snapshots(step, x0, budget,
                                                     snapshot_dtype=BF16) >= 3 * slots


def test_bad_snapshot_dtype():
    step, x0, _ = linear_ode()
    with pytest.raises(ValueError, match="snapshot_dtype must be a floating-point"):
        deepsolve.unroll(step, x0, 4, snapshots=2, snapshot_dtype=torch.int8)
    with pytest.raises(ValueError, match="snapshot_dtype must be a floating-point"):
        deepsolve.unroll(step, x0, 4, snapshots=2, snapshot_dtype="bf16")


@pytest.mark.slow
def test_autocast_with_a_compiled_policy():
    """Kept steps recorded by a CompiledPolicy under bf16 autocast: float32 state and
    gradients, close to plain autograd's (the compiled kernels round differently)."""
    step, x0, leaves = mlp_step()
    n = 12
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        y = x0
        for i in range(n):
            y = step(y, i)
        ref = torch.autograd.grad(y.pow(2).sum(), leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = deepsolve.unroll(step, x0, n, schedule=S.revolve_tail(n, 3, 6),
                             policy=deepsolve.CompiledPolicy("save_expensive"))
        assert y.dtype == torch.float32
        grads = torch.autograd.grad(y.pow(2).sum(), leaves)
    assert all(g.dtype == torch.float32 for g in grads)
    assert rel_all(grads, ref) <= 3e-3  # measured 4e-4: bf16 rounding, compiled vs eager
