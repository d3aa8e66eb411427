"""Mutated schedules through the executor: refused with a one-line error, or exact.

Valid revolve, two-level, online-derived and revolve-tail schedules (n <= 12) are mutated at
random (drop, swap, duplicate or retarget one action) and fed to ``unroll`` as a user's own
``Schedule``. Whatever the mutation, the executor either refuses the schedule with a one-line
:class:`~deepsolve.schedules.ScheduleError`, or the gradients equal plain autograd's (1e-10,
float64); a schedule that ``deepsolve.schedules.check`` accepts always runs. Seeded.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepsolve import schedules as S
from deepsolve.schedules import Schedule
from deepsolve.schedules.check import ScheduleError
from deepsolve.unroll import unroll

DT = torch.float64


class Listed(Schedule):
    kind = "listed"

    def __init__(self, n_steps: int, actions: list):
        self.n_steps = n_steps
        self.actions = actions
        self.slots = {0: 64, 1: 64}

    def __iter__(self):
        return iter(self.actions)


def bases(rng: random.Random) -> list[tuple[str, int, list]]:
    out = []
    for _ in range(3):
        n = rng.randint(2, 12)
        out.append(("revolve", n, list(S.revolve(n, rng.randint(1, 4)))))
        n = rng.randint(3, 12)
        out.append(("two_level", n, list(S.two_level(n, rng.randint(1, 2), rng.randint(1, 3),
                                                     write_cost=0.5, read_cost=0.5))))
        n = rng.randint(2, 12)
        out.append(("online", n, list(S.online(rng.randint(1, 4)).for_length(n))))
        n = rng.randint(3, 12)
        out.append(("revolve_tail", n, list(S.revolve_tail(n, rng.randint(1, 3),
                                                           rng.randint(1, n - 1)))))
    return out


def mutate(actions: list, n: int, rng: random.Random) -> tuple[str, list]:
    acts = list(actions)
    kind = rng.choice(["drop", "swap", "duplicate", "retarget", "retarget"])
    k = rng.randrange(len(acts))
    if kind == "drop":
        del acts[k]
    elif kind == "swap":
        j = min(len(acts) - 1, k + rng.choice([1, 1, 2, 3]))
        acts[k], acts[j] = acts[j], acts[k]
    elif kind == "duplicate":
        acts.insert(k, acts[k])
    else:
        a = acts[k]
        name = rng.choice([f.name for f in dataclasses.fields(a)])
        old = getattr(a, name)
        new = old + rng.choice([-2, -1, 1, 2]) if rng.random() < 0.7 else rng.randint(0, n)
        if name == "level":
            new = rng.randint(0, 1)
        if new == old:
            new = old + 1
        acts[k] = dataclasses.replace(a, **{name: new})
    return kind, acts


def make_step(with_output: bool):
    w = torch.tensor(0.9, dtype=DT, requires_grad=True)

    def step(x, i):
        y = torch.sin(w * x) + 0.1 * i
        return (y, (y * y).sum() * (i + 1)) if with_output else y

    return step, w


def loss_of(res, with_output: bool):
    if with_output:
        y, outs = res
        return (y * torch.arange(1, 4, dtype=DT)).sum() + (outs * torch.linspace(
            1, 2, outs.numel(), dtype=DT)).sum()
    return (res * torch.arange(1, 4, dtype=DT)).sum()


def reference(n: int, with_output: bool, x0: torch.Tensor):
    step, w = make_step(with_output)
    x, outs = x0, []
    for i in range(n):
        r = step(x, i)
        if with_output:
            x, o = r
            outs.append(o)
        else:
            x = r
    res = (x, torch.stack(outs)) if with_output else x
    return torch.autograd.grad(loss_of(res, with_output), [x0, w])


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_schedules_are_refused_or_exact(seed):
    rng = random.Random(seed)
    x0 = torch.tensor([0.3, -0.7, 1.1], dtype=DT, requires_grad=True)
    refs: dict = {}
    outcome = {"refused": 0, "exact": 0, "valid": 0}
    for name, n, actions in bases(rng):
        for _ in range(25):
            kind, acts = mutate(actions, n, rng)
            with_output = rng.random() < 0.5
            try:
                S.check(Listed(n, acts))
                valid = True
            except ScheduleError:
                valid = False
            step, w = make_step(with_output)
            try:
                res = unroll(step, x0, n, schedule=Listed(n, acts))
                got = torch.autograd.grad(loss_of(res, with_output), [x0, w])
            except ScheduleError as e:
                msg = str(e)
                assert not valid, (name, kind, acts, msg)  # check() accepted it: must run
                assert "\n" not in msg and msg.startswith("unroll: "), msg
                outcome["refused"] += 1
                continue
            key = (n, with_output)
            if key not in refs:
                refs[key] = reference(n, with_output, x0)
            for a, b in zip(got, refs[key], strict=True):
                err = ((a - b).norm() / b.norm()).item()
                assert err <= 1e-10, (name, kind, acts, err)
            outcome["valid" if valid else "exact"] += 1
    # the mutations exercise both outcomes (a leaked slot, a swapped Store/Free pair and a
    # dropped no-op stay exact though check() rejects some of them)
    assert outcome["refused"] >= 100 and outcome["valid"] + outcome["exact"] >= 10, outcome
