"""A batched unrolled problem for the distributed tests: recover per-sample-independent
parameters (a decay rate and a forcing) from a batch of trajectories. Each rank takes its
shard of the batch with ``ctx.shard``; the misfit is the mean over the shard, so with equal
shard sizes the ranks' average is the mean over the full batch."""

import time

import torch

import deepsolve


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor(0.1))
        self.forcing = torch.nn.Parameter(torch.tensor(0.0))


class BatchDecay(deepsolve.Problem):
    defaults = {"iterations": 6, "lr": 0.05, "steps": 20, "dt": 0.05, "true_rate": 0.8,
                "true_forcing": 0.3, "batch": 8, "sleep": 0.0, "checkpoint_every": 100,
                "eval_every": 0, "dtype": "float64"}

    def build(self, ctx):
        cfg = ctx.cfg
        ctx.model = Model().to(ctx.device, ctx.dtype)
        x0 = torch.linspace(0.5, 1.5, cfg.batch, device=ctx.device, dtype=ctx.dtype)
        x = x0.clone()
        for _ in range(cfg.steps):
            x = x + cfg.dt * (cfg.true_forcing - cfg.true_rate * x)
        ctx.data = {"x0": x0, "xT": x}

    def batch_size(self, ctx):
        return int(ctx.cfg.batch)

    def step(self, ctx, x, i):
        return x + ctx.cfg.dt * (ctx.model.forcing - ctx.model.rate * x)

    def residuals(self, ctx, iteration):
        if ctx.cfg.sleep:
            time.sleep(ctx.cfg.sleep)
        x0 = ctx.shard(ctx.data["x0"])          # this rank's part of the batch
        target = ctx.shard(ctx.data["xT"])
        xT = ctx.unroll(self.step, x0)
        return {"misfit": ((xT - target) ** 2 * (1 + x0)).mean(),
                "prior": 1e-3 * (ctx.model.rate ** 2 + ctx.model.forcing ** 2)}

    def evaluate(self, ctx):
        return {"rate_error": abs(ctx.model.rate.item() - ctx.cfg.true_rate)}


problem = BatchDecay()
