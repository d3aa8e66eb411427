"""deepsolve.settings: one table of settings (defaults, ranges, --set coercion, help) that the
trainer and problems share; the budget read once into a MemoryBudget; the one RngState record."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

import deepsolve
from deepsolve.cli import main
from deepsolve.config import ConfigError, run_config
from deepsolve.engine import RngState
from deepsolve.memory.budget import MemoryBudget, device_capacity, parse_budget, read_budget
from deepsolve.settings import (
    TRAINER_DEFAULTS,
    TRAINER_SETTINGS,
    Setting,
    apply_overrides,
    describe,
    settings_table,
)

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "data", "tiny_problem.py")
BURGERS = os.path.join(HERE, "..", "problems", "burgers_pinn.py")


class Tiny(deepsolve.Problem):
    defaults = {
        "iterations": 7,                                            # a trainer default, replaced
        "nu": Setting(0.01, "viscosity", low=0.0, allowed="> 0"),   # the problem's own, with range
        "width": 16,                                                # typed by its value
    }

    def build(self, ctx):
        ctx.model = torch.nn.Linear(1, 1)

    def residuals(self, ctx, iteration):
        return {"l": ctx.model.weight.sum() ** 2}


def test_the_trainer_defaults_are_the_table_and_read_only():
    assert dict(TRAINER_DEFAULTS) == {k: s.default for k, s in TRAINER_SETTINGS.items()}
    with pytest.raises(TypeError):
        TRAINER_DEFAULTS["cache_dir"] = "elsewhere"  # type: ignore[index]


def test_a_problem_declares_settings_as_values_or_setting_objects():
    table = Tiny().settings()
    assert table["iterations"].default == 7
    assert table["iterations"].low == TRAINER_SETTINGS["iterations"].low   # range kept
    assert table["nu"].help == "viscosity" and table["width"] == Setting(16)
    assert Tiny().config()["nu"] == 0.01 and Tiny().config()["lr"] == TRAINER_DEFAULTS["lr"]
    assert settings_table({}) == dict(TRAINER_SETTINGS)


@pytest.mark.parametrize("pairs, key, value", [
    (["nu=0.5"], "nu", 0.5), (["width=32"], "width", 32), (["iterations=3"], "iterations", 3),
    (["budget_once=off"], "budget_once", False), (["compile=4"], "compile", "4"),
])
def test_set_strings_are_typed_by_their_setting(pairs, key, value):
    cfg = run_config(Tiny(), sets=pairs)
    assert cfg[key] == value and type(cfg[key]) is type(value)


@pytest.mark.parametrize("pairs, message", [
    (["nu=-1"], "nu=-1.0 is out of range: nu must be > 0"),
    (["nu=inf"], "nu=inf is not a finite number"),
    (["width=2.5"], "--set width=2.5: expected an integer"),
    (["iterations=-1"], "iterations=-1 is out of range: iterations must be >= 0"),
    (["grad_clip=nan"], "grad_clip=nan is not a finite number"),
    (["compile=sometimes"], "compile='sometimes': use auto, on, off"),
    (["curriculum=5:10"], "the first stage must start at iteration 0"),
    (["budget=12 parsecs"], "unknown unit"),
    (["dtype=float8"], "not a dtype the trainer knows"),
    (["seed=x"], "expected an integer"),
    (["nuu=1"], "did you mean nu?"),
])
def test_bad_settings_are_one_line_config_errors(pairs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        run_config(Tiny(), sets=pairs)
    assert "\n" not in str(e.value)


def test_grad_clip_takes_infinity_and_an_override_is_validated_by_its_setting():
    assert run_config(Tiny(), sets=["grad_clip=inf"])["grad_clip"] == math.inf
    with pytest.raises(ConfigError, match="setting nu='x' is a str, not a number"):
        run_config(Tiny(), {"nu": "x"})


def test_apply_overrides_without_a_table_types_by_the_values():
    assert apply_overrides({"a": 1, "b": [1, 2]}, ["a=4", "b=[3, 4]"]) == {"a": 4, "b": [3, 4]}
    assert apply_overrides({"b": ["x"]}, ["b=u,v"]) == {"b": ["u", "v"]}
    with pytest.raises(ConfigError, match="unknown setting"):
        apply_overrides({"a": 1}, ["c=1"])


def test_describe_lists_every_setting_with_default_and_range():
    text = describe(Tiny().settings())
    lines = text.splitlines()
    assert len(lines) == len(Tiny().settings())
    nu = next(line for line in lines if line.startswith("nu "))
    assert "viscosity" in nu and "default 0.01" in nu and "> 0" in nu
    it = next(line for line in lines if line.startswith("iterations "))
    assert "default 7" in it and ">= 0" in it


def test_the_settings_command_prints_the_table(capsys):
    assert main(["settings", BURGERS]) == 0
    out = capsys.readouterr().out
    assert "memory budget" in out and "\nnu " in out and "\noptimizer " in out


# ---------------------------------------------------------------- the budget, read once


def test_a_budget_is_read_once_into_one_type():
    b = read_budget("3MiB")
    assert b == MemoryBudget("3MiB", 3 * 2**20) and b.fraction is None
    assert parse_budget(b) == 3 * 2**20 and str(b) == "3MiB"
    assert read_budget(b) is b and read_budget(4096).nbytes == 4096


def test_a_percentage_budget_resolves_again_unless_fixed(monkeypatch):
    from deepsolve.memory import budget as B

    monkeypatch.setattr(B, "device_capacity", lambda device=None: 1000)
    b = read_budget("10%")
    assert (b.nbytes, b.fraction) == (100, 0.1)
    monkeypatch.setattr(B, "device_capacity", lambda device=None: 2000)
    assert b.resolve() == 200 and parse_budget(b) == 200   # memory freed meanwhile
    assert b.fixed().resolve() == 100 and b.fixed().fraction is None


def test_the_run_configuration_and_the_context_carry_the_same_budget():
    from deepsolve.problem import load_problem
    from deepsolve.training import build

    cfg = run_config(Tiny(), {"budget": "1%"})
    assert isinstance(cfg.budget, MemoryBudget) and cfg.budget_bytes == cfg.budget.nbytes
    assert 0 < cfg.budget.nbytes <= device_capacity() // 50 and cfg.budget.fraction == 0.01
    tiny, _ = load_problem(TINY)
    _, ctx, _ = build(TINY, run_config(tiny, {"budget": "2%"}))
    assert ctx.budget is not None and ctx.budget.fraction is None   # budget_once: held
    _, ctx, _ = build(TINY, run_config(tiny, {"budget": "2%"}, ["budget_once=false"]))
    assert ctx.budget is not None and ctx.budget.fraction == 0.02   # resolved at each unroll
    assert run_config(Tiny()).budget is None


# ---------------------------------------------------------------- one RNG record


def test_rng_state_restores_every_generator_it_captured():
    s = RngState.everything()
    a = (torch.rand(3), np.random.rand(2), random.random())
    s.restore()
    b = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_rng_state_names_the_host_generators_that_moved():
    s = RngState.everything()
    assert s.moved_host(RngState.everything()) == []
    np.random.rand()
    assert s.moved_host(RngState.everything()) == ["numpy's global generator (np.random.*)"]
    random.random()
    assert len(s.moved_host(RngState.everything())) == 2
    assert s.same_torch(RngState.capture())
    torch.rand(1)
    assert not s.same_torch(RngState.capture())
    s.restore()


def test_the_restart_file_form_round_trips_through_the_record():
    from deepsolve.problem import Context
    from deepsolve.training.rng import check_rng_state, rng_state, set_rng_state

    ctx = Context({"seed": 3}, torch.device("cpu"), torch.float32)
    state = rng_state(ctx)
    check_rng_state(state)
    draws = (torch.rand(2), np.random.rand(), random.random(),
             torch.rand(2, generator=ctx.generator))
    set_rng_state(ctx, state)
    again = (torch.rand(2), np.random.rand(), random.random(),
             torch.rand(2, generator=ctx.generator))
    assert torch.equal(draws[0], again[0]) and draws[1] == again[1] and draws[2] == again[2]
    assert torch.equal(draws[3], again[3])
