"""The horizon curriculum (``--set curriculum=0:50,200:400``): parsed and checked with the
run's settings, applied per iteration, logged as ``n_steps``, and its longest stage planned
before the first iteration."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepsolve.config import ConfigError, horizon, parse_curriculum
from deepsolve.io import INT_MISSING, read_log
from deepsolve.memory import BudgetError
from deepsolve.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = os.path.join(ROOT, "problems", "navier_stokes.py")
NS_TINY = ["fine_n=32", "coarse_n=16", "curriculum=", "dt=0.02", "steps=8", "obs_every=4",
           "spinup=0.02",
           "n_train=1", "n_test=1", "batch=1", "width=4", "depth=2"]


def test_stages_parse_and_give_the_horizon_of_each_iteration():
    stages = parse_curriculum("0:50, 200:400,600:2000")
    assert stages == ((0, 50), (200, 400), (600, 2000))
    assert [horizon(stages, i) for i in (0, 199, 200, 599, 600, 10**6)] == \
        [50, 50, 400, 400, 2000, 2000]
    assert parse_curriculum("") == ()


def test_percent_stages_scale_with_iterations_and_steps():
    text = "0:10%,30%:30%,60%:100%"
    assert parse_curriculum(text, 100, 1000) == ((0, 100), (30, 300), (60, 1000))
    assert parse_curriculum(text, 10, 200) == ((0, 20), (3, 60), (6, 200))
    # 1 iteration: 30% rounds to iteration 0 and replaces the first stage; 60% to 1
    assert parse_curriculum(text, 1, 5) == ((0, 2), (1, 5))
    assert parse_curriculum("0:1%", 7, 10) == ((0, 1),)      # a length is at least one step
    assert parse_curriculum("0:50,50%:400", 300, 400) == ((0, 50), (150, 400))
    with pytest.raises(ConfigError, match="percentage of steps needs"):
        parse_curriculum("0:10%", 100, None)
    with pytest.raises(ConfigError, match="not increasing with 10 iterations"):
        parse_curriculum("0:5,8:10,50%:20", 10, 100)


@pytest.mark.parametrize("text, message", [
    ("0:5,0:101%", "percentages up to 100%"),
    ("0:5,10%:0%", "percentages up to 100%"),
    ("0:5,20%:6,10%:7", "a start after the previous"),
    ("10:50", "must start at iteration 0"),
    ("0:50,0:60", "a start after the previous"),
    ("0:50,100:0", "steps >= 1"),
    ("0-50", "is not start:steps"),
    ("0:fifty", "is not start:steps"),
])
def test_bad_curricula_are_one_line_errors(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_curriculum(text)
    assert "\n" not in str(err.value)


def _sets(tmp_path, *extra):
    return [*NS_TINY, f"data_dir={tmp_path / 'data'}", f"cache_dir={tmp_path / 'cache'}",
            *extra]


def test_a_stage_longer_than_steps_is_refused_before_any_work(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="exceeds steps=8"):
        train(NS, sets=_sets(tmp_path, "curriculum=0:4,2:16", "iterations=3"), out=str(out),
              quiet=True)
    assert not out.exists() and not (tmp_path / "data").exists()


def test_a_percent_curriculum_follows_iterations_and_steps(tmp_path):
    out = tmp_path / "run"
    res = train(NS, sets=_sets(tmp_path, "curriculum=0:50%,50%:100%", "iterations=4",
                               "eval_every=0"), out=str(out), quiet=True)
    assert res.iterations == 4
    assert list(read_log(out / "log.h5").columns["n_steps"]) == [4, 4, 8, 8]


def test_a_curriculum_run_logs_its_stages_and_one_plan_each(tmp_path):
    out = tmp_path / "run"
    res = train(NS, sets=_sets(tmp_path, "curriculum=0:4,2:8", "iterations=4", "budget=512KiB",
                               "eval_every=0"), out=str(out), quiet=True)
    assert res.iterations == 4
    log = read_log(out / "log.h5")
    assert list(log.columns["n_steps"]) == [4, 4, 8, 8]
    sched = [str(s) for s in log.columns["schedule"]]
    assert sched[0] == sched[1] and sched[2] == sched[3]
    assert "n_steps=4" in sched[0] and "n_steps=8" in sched[2]
    assert list(log.columns["recorded"]) == [4, 4, 8, 8]   # every step reversed once, each stage


def test_a_longest_stage_that_does_not_fit_fails_before_the_first_iteration(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(BudgetError, match="longest stage \\(8 steps\\)") as err:
        train(NS, sets=_sets(tmp_path, "curriculum=0:4,2:8", "iterations=4", "budget=2KiB"),
              out=str(out), quiet=True)
    assert "minimum" in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()   # no log, no restart file: the same command can run again


def test_adjoint_every_logs_the_adjoint_norms_of_one_unroll(tmp_path):
    from deepsolve.io import read_curves

    out = tmp_path / "run"
    train(NS, sets=_sets(tmp_path, "iterations=5", "adjoint_every=2", "snapshots=3",
                         "eval_every=0", "grad_clip=0.01"), out=str(out), quiet=True)
    c = read_curves(out, "adjoint_norms")
    assert list(c["iteration"]) == [0, 2, 4]
    assert (c["step"][:, :9] == list(range(9))).all() and (c["step"][:, 9:] == -1).all()
    v = c["value"][:, :9]
    assert np.isfinite(v).all() and (v > 0).all()
    log = read_log(out / "log.h5")
    assert (log.columns["grad_norm"] > 0.01).all()   # the pre-clip norm is what is logged


def test_the_logged_curve_is_downsampled_to_at_most_curve_width_points():
    import torch

    from deepsolve import UnrollStats
    from deepsolve.io import CURVE_WIDTH
    from deepsolve.training.rows import log_adjoint_norms as _log_adjoint_norms

    got = {}

    class Log:
        def append_curve(self, name, it, steps, values):
            got.update(name=name, it=it, steps=steps, values=values)

    st = UnrollStats()
    st.adjoint_norms = torch.arange(2001, dtype=torch.float64) * 0.5
    _log_adjoint_norms(Log(), 7, [UnrollStats(), st])
    assert got["name"] == "adjoint_norms" and got["it"] == 7
    assert len(got["steps"]) <= CURVE_WIDTH and got["steps"][0] == 0 and got["steps"][-1] == 2000
    assert (np.diff(got["steps"]) > 0).all()
    assert np.allclose(got["values"], got["steps"] * 0.5)


def test_a_run_resumed_with_a_curriculum_gains_the_n_steps_column(tmp_path):
    """A log made without a curriculum has no n_steps column; resuming it with one trains
    the later stages and adds the column (missing, -1, in the rows before)."""
    out = tmp_path / "run"
    train(NS, sets=_sets(tmp_path, "iterations=2", "eval_every=0"), out=str(out), quiet=True)
    res = train(NS, sets=_sets(tmp_path, "iterations=4", "eval_every=0", "curriculum=0:4,3:8"),
                out=str(out), quiet=True, resume=True)
    assert res.iterations == 4
    log = read_log(out / "log.h5")
    assert log.n_rows == 4
    assert list(log.columns["n_steps"]) == [INT_MISSING, INT_MISSING, 4, 8]
    assert list(log.columns["recorded"]) == [8, 8, 4, 8]   # steps=8, then the stages
