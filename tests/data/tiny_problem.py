"""A tiny unrolled problem for the trainer's tests: recover a decay rate through 50 steps."""

import mmap
import time

import numpy as np
import torch

import deepsolve


class Model(torch.nn.Module):
    def __init__(self, extra: int = 0):
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor(0.1))
        if extra:  # a parameter whose shape a setting decides (resume with another: refused)
            self.extra = torch.nn.Parameter(torch.zeros(extra))


class Decay(deepsolve.Problem):
    defaults = {"iterations": 12, "lr": 0.05, "steps": 50, "dt": 0.02, "true_rate": 0.8,
                "sleep": 0.0, "checkpoint_every": 3, "eval_every": 4, "batch": 4,
                "spike_at": -1, "ballast": 0, "drop_at": -1, "extra": 0, "curve": False}

    def build(self, ctx):
        ctx.model = Model(int(ctx.cfg.extra)).to(ctx.device, ctx.dtype)
        x0 = torch.linspace(0.5, 1.5, ctx.cfg.batch, device=ctx.device, dtype=ctx.dtype)
        xT = x0 * (1 - ctx.cfg.dt * ctx.cfg.true_rate) ** ctx.cfg.steps
        ctx.data = {"x0": x0, "xT": xT}
        if ctx.cfg.ballast:  # MiB held from here until iteration drop_at
            ctx.data["ballast"] = torch.ones(int(ctx.cfg.ballast) * 2**18)

    def step(self, ctx, x, i):
        return x - ctx.cfg.dt * ctx.model.rate * x

    def residuals(self, ctx, iteration):
        if ctx.cfg.sleep:
            time.sleep(ctx.cfg.sleep)
        if iteration == ctx.cfg.drop_at:  # the resident size falls below the run's start
            ctx.data.pop("ballast", None)
        if iteration == ctx.cfg.spike_at:  # 64 MiB touched and freed: a real-peak spike
            # a mapping of its own, every page written: resident whatever free memory the
            # allocators hold from earlier work in the process (a tensor could reuse it)
            spike = mmap.mmap(-1, 2**26)
            pages = np.frombuffer(spike, dtype=np.uint8)
            pages[::mmap.PAGESIZE] = 1
            del pages
            spike.close()
        xT = ctx.unroll(self.step, ctx.data["x0"])
        return {"misfit": ((xT - ctx.data["xT"]) ** 2).mean(),
                "prior": 1e-4 * ctx.model.rate ** 2}

    def evaluate(self, ctx):
        out = {"rate_error": abs(ctx.model.rate.item() - ctx.cfg.true_rate)}
        if ctx.cfg.curve:  # the mean state error of the learned rollout, every 10 steps
            steps = list(range(0, int(ctx.cfg.steps) + 1, 10))
            x0, dt = ctx.data["x0"], ctx.cfg.dt
            err = [float(((1 - dt * ctx.model.rate) ** i * x0
                          - (1 - dt * ctx.cfg.true_rate) ** i * x0).abs().mean())
                   for i in steps]
            out["x_error"] = deepsolve.Curve(steps, err)
        return out


problem = Decay()
