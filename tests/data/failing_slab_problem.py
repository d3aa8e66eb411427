"""A decomposed diffusion whose step raises on rank 1 in iteration 1 (tests/test_domain.py):
every other rank must stop with a one-line error, not hang."""

import torch

import deepsolve


class FailingSlab(deepsolve.Problem):
    defaults = {"iterations": 3, "lr": 0.01, "steps": 10, "snapshots": 3, "dtype": "float64",
                "ny": 16, "fail_iteration": 1}

    def build(self, ctx):
        ctx.data = {"slab": ctx.slab(int(ctx.cfg.ny), dim=-2, halo=1), "iteration": 0}
        ctx.model = torch.nn.Linear(1, 1, dtype=torch.float64)

    def step(self, ctx, x, i):
        d = ctx.data
        if ctx.rank == 1 and d["iteration"] == int(ctx.cfg.fail_iteration) and i == 3:
            raise ValueError("rank 1 fails inside step 3")
        e = d["slab"].halo(x)
        lap = e[..., 2:, :] + e[..., :-2, :] - 2 * x
        return x + 0.1 * ctx.model.weight[0, 0] * lap

    def residuals(self, ctx, iteration):
        d = ctx.data
        d["iteration"] = iteration
        x0 = d["slab"].local(torch.linspace(0, 1, int(ctx.cfg.ny), dtype=torch.float64)
                             [:, None].expand(-1, 4).sin())
        return {"misfit": d["slab"].mean(ctx.unroll(self.step, x0) ** 2)}


problem = FailingSlab()
