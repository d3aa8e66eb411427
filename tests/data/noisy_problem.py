"""A decay problem with stochastic forcing, for ``deepsolve check``: ``noise`` picks where the
step draws its random numbers from.

* ``"torch"`` -- the default torch generator, which ``unroll`` snapshots and replays:
  checkpointed gradients are exact, the check passes;
* ``"numpy"`` -- numpy's global generator, ``"random"`` -- Python's ``random`` module,
  ``"generator"`` -- a ``torch.Generator`` object (``ctx.generator``): randomness that
  escapes the RNG states ``unroll`` replays; recomputed steps draw other numbers and the
  checkpointed gradient is wrong. The check must fail, saying why.
"""

import random

import numpy as np
import torch

import deepsolve


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor(0.3))
        self.gain = torch.nn.Parameter(torch.tensor(1.0))


class NoisyDecay(deepsolve.Problem):
    defaults = {"iterations": 2, "lr": 0.05, "steps": 30, "dt": 0.05, "snapshots": 3,
                "dtype": "float64", "noise": "torch", "amplitude": 0.3}

    def build(self, ctx):
        ctx.model = Model().to(ctx.device, ctx.dtype)
        ctx.data = {"x0": torch.linspace(0.5, 1.5, 4, device=ctx.device, dtype=ctx.dtype)}

    def _noise(self, ctx, x):
        kind = str(ctx.cfg.noise)
        if kind == "torch":
            return torch.randn(x.shape, dtype=x.dtype, device=x.device)
        if kind == "numpy":
            return torch.as_tensor(np.random.standard_normal(x.shape), dtype=x.dtype)
        if kind == "random":
            return torch.tensor([random.gauss(0.0, 1.0) for _ in range(x.numel())],
                                dtype=x.dtype).reshape(x.shape)
        if kind == "generator":
            return torch.randn(x.shape, generator=ctx.generator, dtype=x.dtype)
        raise ValueError(f"noise must be torch, numpy, random or generator, got {kind!r}")

    def step(self, ctx, x, i):
        m, dt = ctx.model, float(ctx.cfg.dt)
        forcing = float(ctx.cfg.amplitude) * m.gain * self._noise(ctx, x)
        # nonlinear in x, so the noise enters the Jacobian and hence the gradient
        return x - dt * m.rate * x * (1 + forcing * torch.tanh(x))

    def residuals(self, ctx, iteration):
        xT = ctx.unroll(self.step, ctx.data["x0"])
        return {"misfit": (xT - 0.2).pow(2).mean()}


problem = NoisyDecay()
