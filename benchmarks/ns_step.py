"""The benchmark step: coarse 2D Navier–Stokes (pseudo-spectral RK4) plus a small periodic CNN
closure, as in the solver-in-the-loop setting of problems/navier_stokes.py.

``omega_{i+1} = NS_dt(omega_i) + dt * CNN(omega_i)``; state ``(B, N, N)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepsolve.physics import Grid, NavierStokes2D, kolmogorov_forcing, random_initial


class Closure(nn.Module):
    """Three periodic 3x3 convolutions, ``width`` channels: a learned vorticity tendency."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, padding_mode="circular"), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1, padding_mode="circular"), nn.GELU(),
            nn.Conv2d(width, 1, 3, padding=1, padding_mode="circular"),
        )

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.net(w.unsqueeze(-3)).squeeze(-3)


def make(n: int = 64, batch: int = 1, dtype=torch.float32, device="cpu", seed: int = 0,
         width: int = 16):
    """Returns ``(step, omega0, closure)``."""
    torch.manual_seed(seed)
    grid = Grid(n)
    forcing = kolmogorov_forcing(grid, amplitude=1.0, wavenumber=4, dtype=dtype, device=device)
    dt = 0.5 * (2 * math.pi / n) / 3.0  # CFL ~0.5 for |u| ~ 3
    ns = NavierStokes2D(grid, nu=1e-3, dt=dt, alpha=0.1, forcing=forcing)
    closure = Closure(width).to(dtype=dtype, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    omega0 = random_initial(grid, g, batch_shape=(batch,), dtype=dtype).to(device)

    def step(w: torch.Tensor, i: int) -> torch.Tensor:
        return ns.step(w) + dt * closure(w)

    return step, omega0, closure
