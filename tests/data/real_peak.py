"""Child process of tests/test_planner.py: the *real* peak of budgeted unrolls.

    python tests/data/real_peak.py KIND N_STEPS N_BUDGETS          # measure a budget sweep
    python tests/data/real_peak.py plans N_STEPS KIND:BUDGET...    # print the plans only

``KIND`` is one of three steps of different character, each with a 4 MiB float64 state:

* ``pointwise`` — ``x + 0.01 tanh(w x) sin(x + 1e-3 i)``: memory in pointwise temporaries;
* ``conv`` — Gray–Scott reaction–diffusion of a batch of 2-field 128² grids, the Laplacian as
  a depthwise convolution, plus a two-layer 3x3 convolutional closure: convolution buffers;
* ``spectral`` — a pseudo-spectral Allen–Cahn-type step, diffusion by ``rfft2``/``irfft2``
  with a learnable viscosity: complex intermediates of half the spectrum.

For each budget from just above the minimum to above store-all (``N_BUDGETS`` of them,
geometrically spaced) one unroll runs forward and backward; the row reports the plan, its
predicted peak, the process's real peak (the RSS high-water mark above the resident size just
before the unroll, reset through /proc/self/clear_refs), the bytes deepsolve tracks, and the
largest relative gradient error against plain autograd (computed after all measurements, so
its memory does not mix). The step, the profiles and the planner's policy profiles are warmed
up before the first measurement: the baseline is a warmed process. One JSON line per row.
"""

from __future__ import annotations

import gc
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import deepsolve
from deepsolve.memory import predicted_peak
from deepsolve.memory.meter import MemoryMeter, process_status, reset_high_water_mark

MiB = 2**20
DT = torch.float64


def build(kind: str):
    """``(step, x0, params)`` for one of the three steps; ``x0`` requires grad."""
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
    raise SystemExit(f"unknown step kind {kind!r}")


def plain_grads(step, x0, params, n):
    y = x0
    for i in range(n):
        y = step(y, i)
    return torch.autograd.grad((y**2).sum(), [x0, *params])


def budgets(prof, n: int, count: int) -> list[int]:
    """From 5 % above the minimum to 2 % above store-all, geometrically spaced."""
    lo = predicted_peak(prof, n, "revolve", 1) * 1.05
    hi = predicted_peak(prof, n, "store_all") * 1.02
    return [int(lo * (hi / lo) ** (k / (count - 1))) for k in range(count)]


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
    kind, n = argv[0], int(argv[1])
    step, x0, params = build(kind)
    # warm-up, as the first iteration of a training loop: the planner (which also fixes the
    # C library's heap thresholds), the profiles under each policy, one unroll
    prof = deepsolve.plan(step, x0, n, budget=2**50).profile
    sweep = budgets(prof, n, int(argv[2]))
    mid = int(math.sqrt(sweep[0] * sweep[-1]))
    deepsolve.plan(step, x0, n, budget=mid)
    y = deepsolve.unroll(step, x0, n, budget=mid)
    torch.autograd.grad((y**2).sum(), [x0, *params])
    del y
    rows, got = [], []
    for b in sweep:
        gc.collect()
        st = deepsolve.UnrollStats()
        reset_high_water_mark()
        base = process_status("VmRSS:")
        with MemoryMeter("cpu", stats=st) as meter:
            y = deepsolve.unroll(step, x0, n, budget=b, stats=st)
            g = torch.autograd.grad((y**2).sum(), [x0, *params])
            del y
        real = process_status("VmHWM:") - base
        p = st.extra["plan"]
        got.append(g)
        del g
        rows.append({"budget": b, "plan": p.describe(), "predicted": p.predicted_peak,
                     "real": real, "tracked": meter.tracked_peak, "kind": p.kind,
                     "store_all": predicted_peak(prof, n, "store_all"),
                     "minimum": predicted_peak(prof, n, "revolve", 1)})
    ref = plain_grads(step, x0, params, n)
    for row, g in zip(rows, got, strict=True):
        row["grad_error"] = max(((a - r).norm() / r.norm()).item()
                                for a, r in zip(g, ref, strict=True))
        print(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1:])
