"""Child process of tests/test_planner.py: the *real* peak of budgeted unrolls, cold and warm.

    python tests/data/real_peak.py call KIND N_STEPS BUDGET     # one budget, cold then warm
    python tests/data/real_peak.py profile KIND N_STEPS BUDGET  # the first plan alone
    python tests/data/real_peak.py plain KIND N_STEPS           # plain autograd alone
    python tests/data/real_peak.py plans N_STEPS KIND:BUDGET... # print the plans only

``KIND`` is one of the steps of :func:`build`: three with 4 MiB float64 states of different
character, and two small states:

* ``pointwise`` — ``x + 0.01 tanh(w x) sin(x + 1e-3 i)``: memory in pointwise temporaries;
* ``conv`` / ``conv32`` — Gray–Scott reaction–diffusion of a batch of 2-field 128² grids, the
  Laplacian as a depthwise convolution, plus a two-layer 3x3 convolutional closure:
  convolution buffers (``conv32`` in float32: oneDNN's kernels);
* ``spectral`` — a pseudo-spectral Allen–Cahn-type step, diffusion by ``rfft2``/``irfft2``
  with a learnable viscosity: complex intermediates of half the spectrum (``spectral-small``:
  a 0.5 MiB state);
* ``ks`` / ``ks64`` — an explicit finite-difference Kuramoto–Sivashinsky step with a learnable
  coefficient of the fourth-order term, on 128 points (a 1 KiB state) or 8192 (64 KiB):
  small tensors, where the objects around them are most of the memory.

``call``: what a batch job's first iteration does. The step is warmed by one plain forward
and backward of one step (the user's code, not deepsolve's), then — in a process that has
imported deepsolve but called nothing of it — the *cold* call: ``unroll(..., budget=BUDGET)``
and its backward, its real peak the RSS high-water mark above the resident size just before
it (reset through /proc/self/clear_refs). Then the *warm* call with the same budget, after the
host allocator's cache of the first is emptied (``hostalloc.set_limit(None)``: its blocks are
resident but reserved for the budget, as CUDA's caching allocator reserves), measured the same
way. Then plain autograd over the same steps for the reference gradients (largest relative
error over the initial state and the parameters); its real peak (``real_plain``) is measured
in a fresh process of its own (``plain``): after the calls, the C library's heap holds memory
they freed, and plain autograd would reuse it unseen. One JSON line.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import deepsolve
from deepsolve.memory.meter import process_status, reset_high_water_mark

MiB = 2**20
DT = torch.float64


def build(kind: str):
    """``(step, x0, params)``; ``x0`` requires grad."""
    torch.manual_seed(0)
    if kind == "pointwise":
        w = nn.Parameter(torch.tensor(1.3, dtype=DT))
        x0 = torch.randn(4 * MiB // 8, dtype=DT)

        def step(x, i):
            return x + 0.01 * torch.tanh(w * x) * torch.sin(x + 1e-3 * i)

        return step, x0.requires_grad_(), [w]
    if kind in ("conv", "conv32"):
        dt = DT if kind == "conv" else torch.float32  # float32: oneDNN's kernels, no im2col
        side, batch = 128, 4 * MiB // (2 * 128 * 128 * dt.itemsize)
        lap = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]], dtype=dt)
        lap = lap.expand(2, 1, 3, 3).clone()
        diff = torch.tensor([0.16, 0.08], dtype=dt).view(1, 2, 1, 1)
        net = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                            nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular")).to(dt)
        x0 = torch.rand(batch, 2, side, side, dtype=dt)

        def step(x, i):
            u, v = x[:, :1], x[:, 1:]
            uvv = u * v * v
            react = torch.cat([-uvv + 0.035 * (1 - u), uvv - 0.095 * v], dim=1)
            lx = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), lap, groups=2)
            return x + 0.5 * (diff * lx + react) + 0.01 * net(x)

        return step, x0.requires_grad_(), list(net.parameters())
    if kind in ("spectral", "spectral-small"):
        side = 256
        batch = 4 * MiB // (side * side * 8) if kind == "spectral" else 1  # 4 or 0.5 MiB
        k = torch.fft.fftfreq(side, 1 / side, dtype=DT)
        kr = torch.fft.rfftfreq(side, 1 / side, dtype=DT)
        k2 = k[:, None] ** 2 + kr[None, :] ** 2
        nu = nn.Parameter(torch.tensor(0.02, dtype=DT))
        x0 = torch.randn(batch, side, side, dtype=DT)

        def step(x, i):
            lin = torch.fft.irfft2(-nu * k2 * torch.fft.rfft2(x), s=x.shape[-2:])
            return x + 1e-3 * (lin - x * x * x + x)

        return step, x0.requires_grad_(), [nu]
    if kind in ("ks", "ks64"):
        n = 128 if kind == "ks" else 8192
        length = 22.0
        dx = length / n
        dt = dx**4 / 16  # explicit: stable for dt below about dx^4 / 8
        xs = torch.arange(n, dtype=DT) * dx
        u0 = torch.cos(2 * torch.pi * xs / length) * (1 + torch.sin(2 * torch.pi * xs / length))
        nu = nn.Parameter(torch.tensor(1.0, dtype=DT))

        def step(u, i):
            up, um = torch.roll(u, -1), torch.roll(u, 1)
            upp, umm = torch.roll(u, -2), torch.roll(u, 2)
            ux = (up - um) / (2 * dx)
            uxx = (up - 2 * u + um) / dx**2
            uxxxx = (upp - 4 * up + 6 * u - 4 * um + umm) / dx**4
            return u + dt * (-u * ux - uxx - nu * uxxxx)

        return step, u0.requires_grad_(), [nu]
    raise SystemExit(f"unknown step kind {kind!r}")


def loss(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum()


def measured(fn) -> tuple[int, object]:
    """``fn()``'s real peak: the RSS high-water mark above the resident size before it."""
    gc.collect()
    reset_high_water_mark()
    base = process_status("VmRSS:")
    out = fn()
    return process_status("VmHWM:") - base, out


def call(kind: str, n: int, budget: int) -> dict:
    from deepsolve.memory import hostalloc

    step, x0, params = build(kind)
    torch.autograd.grad(loss(step(x0, 0)), [x0, *params])  # the user's own warm-up

    def budgeted(stats):
        def run():
            y = deepsolve.unroll(step, x0, n, budget=budget, stats=stats)
            return torch.autograd.grad(loss(y), [x0, *params])
        return run

    cold_stats = deepsolve.UnrollStats()
    real_cold, grads = measured(budgeted(cold_stats))
    hostalloc.set_limit(None)  # empty the cache the first call reserved
    warm_stats = deepsolve.UnrollStats()
    real_warm, _ = measured(budgeted(warm_stats))
    hostalloc.set_limit(None)

    real_plain, ref = measured(lambda: plain_grads(step, x0, params, n))
    p, q = cold_stats.extra["plan"], warm_stats.extra["plan"]
    error = max(((a - r).norm() / r.norm()).item() for a, r in zip(grads, ref, strict=True))
    return {"kind": kind, "n": n, "budget": budget, "plan": p.describe(),
            "warm_plan": q.describe(), "plan_kind": p.kind, "predicted": p.predicted_peak,
            "real_cold": real_cold, "real_warm": real_warm, "real_plain": real_plain,
            "grad_error": error, "host": hostalloc.active()}


def plain_grads(step, x0, params, n: int):
    """Plain autograd through ``n`` steps: the gradients of the loss of ``x_n``."""
    y = x0
    for i in range(n):
        y = step(y, i)
    return torch.autograd.grad(loss(y), [x0, *params])


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv[0] == "plans":
        n, steps = int(argv[1]), {}
        for item in argv[2:]:
            kind, b = item.split(":")
            if kind not in steps:
                steps[kind] = build(kind)
            step, x0, _ = steps[kind]
            print(json.dumps({"kind": kind, "budget": int(b),
                              "plan": deepsolve.plan(step, x0, n, budget=int(b)).describe()}))
        return
    if argv[0] == "call":
        print(json.dumps(call(argv[1], int(argv[2]), int(argv[3]))))
        return
    if argv[0] == "plain":  # plain autograd alone in a fresh process: its real peak
        kind, n = argv[1], int(argv[2])
        step, x0, params = build(kind)
        torch.autograd.grad(loss(step(x0, 0)), [x0, *params])
        real, _ = measured(lambda: plain_grads(step, x0, params, n))
        print(json.dumps({"kind": kind, "n": n, "real_plain": real}))
        return
    if argv[0] == "profile":  # the first plan alone: profile and planning, cold
        kind, n, budget = argv[1], int(argv[2]), int(argv[3])
        step, x0, params = build(kind)
        torch.autograd.grad(loss(step(x0, 0)), [x0, *params])
        real, p = measured(lambda: deepsolve.plan(step, x0, n, budget=budget))
        print(json.dumps({"kind": kind, "budget": budget, "real": real,
                          "plan": p.describe()}))
        return
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
