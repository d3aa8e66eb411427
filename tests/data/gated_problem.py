"""The tiny decay problem with a gate, for tests that must act while a trainer is at a known
iteration: with ``--set gate=PATH --set gate_at=K``, iteration K writes ``PATH.waiting`` and
waits until ``PATH`` exists (at most 120 s) before it goes on. The trainer is then inside its
loop (its SIGTERM handler installed, the rows before K flushed when a restart file was
written) and cannot finish before the test opens the gate. With ``--set gate_build=true``
the wait is in ``build`` instead (the trainer is setting up its run)."""

import os
import time

import torch

import deepsolve


def _wait(gate):
    with open(gate + ".waiting", "w") as f:
        f.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + 120
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {gate} was never opened")
        time.sleep(0.01)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor(0.1))


class GatedDecay(deepsolve.Problem):
    defaults = {"iterations": 12, "lr": 0.05, "steps": 50, "dt": 0.02, "true_rate": 0.8,
                "checkpoint_every": 3, "eval_every": 4, "batch": 4, "gate": "", "gate_at": 0,
                "gate_build": False}

    def build(self, ctx):
        if ctx.cfg.gate and ctx.cfg.gate_build:
            _wait(ctx.cfg.gate)
        ctx.model = Model().to(ctx.device, ctx.dtype)
        x0 = torch.linspace(0.5, 1.5, ctx.cfg.batch, device=ctx.device, dtype=ctx.dtype)
        xT = x0 * (1 - ctx.cfg.dt * ctx.cfg.true_rate) ** ctx.cfg.steps
        ctx.data = {"x0": x0, "xT": xT}

    def step(self, ctx, x, i):
        return x - ctx.cfg.dt * ctx.model.rate * x

    def residuals(self, ctx, iteration):
        gate = ctx.cfg.gate
        if gate and not ctx.cfg.gate_build and iteration == ctx.cfg.gate_at:
            _wait(gate)
        xT = ctx.unroll(self.step, ctx.data["x0"])
        return {"misfit": ((xT - ctx.data["xT"]) ** 2).mean(),
                "prior": 1e-4 * ctx.model.rate ** 2}

    def evaluate(self, ctx):
        return {"rate_error": abs(ctx.model.rate.item() - ctx.cfg.true_rate)}


problem = GatedDecay()
