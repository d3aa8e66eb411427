"""Stopping by target and by time (deepsolve/training/stopping.py): the first row at or
below the target ends the run, a time limit ends it within the limit, both are logged,
written to the restart file and honoured on --resume."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from deepsolve.cli import main
from deepsolve.io import read_log
from deepsolve.problem import ProblemError
from deepsolve.settings import ConfigError, Target, parse_target
from deepsolve.training import train
from deepsolve.training.restart import RestartError

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "data", "tiny_problem.py")


def _log(out):
    return read_log(os.path.join(out, "log.h5")).columns


@pytest.mark.parametrize("text,want", [
    ("", None), ("  ", None), ("1e-8", Target(None, 1e-8)),
    ("loss:1e-6", Target("loss", 1e-6)), ("loss/pde:2e-3", Target("loss/pde", 2e-3)),
    (" u_rel_l2 : 5e-9 ", Target("u_rel_l2", 5e-9)), (1e-4, Target(None, 1e-4)),
])
def test_parse_target_forms(text, want):
    assert parse_target(text) == want


@pytest.mark.parametrize("text,match", [
    ("u:abc", "'abc' is not a number"), (":1e-3", "name before ':' is empty"),
    ("loss:0", "finite number > 0"), ("loss:-1", "finite number > 0"),
    ("loss:inf", "finite number > 0"), ("nan", "finite number > 0"), (True, "not a level"),
])
def test_parse_target_refuses_bad_input_in_one_line(text, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_target(text)
    assert "\n" not in str(e.value) and "--set target=" in str(e.value)


def test_loss_target_stops_at_the_first_row_at_or_below_it(tmp_path):
    out = str(tmp_path / "run")
    res = train(TINY, overrides={"iterations": 500, "target": "loss:1e-4"}, out=out,
                quiet=True)
    c = _log(out)
    n = len(c["loss"])
    assert 1 < n < 500 and res.iterations == n and not res.preempted
    assert c["loss"][-1] <= 1e-4 and np.all(c["loss"][:-1] > 1e-4)
    assert res.stopped == c["stopped"][-1] and res.stopped.startswith("target loss")
    assert all(s == "" for s in c["stopped"][:-1])
    assert math.isfinite(c["metric/rate_error"][-1])   # the last row is evaluated
    state = torch.load(os.path.join(out, "restart.pt"), weights_only=True)
    assert state["iteration"] == n and state["stopped"] == res.stopped
    # elapsed: the training time at each row's end, increasing, at least the rows' times
    assert np.all(np.diff(c["elapsed"]) > 0) and c["elapsed"][-1] >= c["time"].sum()
    assert state["elapsed"] >= c["elapsed"][-1]


def test_a_loss_term_can_be_the_target(tmp_path):
    out = str(tmp_path / "run")
    res = train(TINY, overrides={"iterations": 500, "target": "loss/misfit:1e-4"}, out=out,
                quiet=True)
    c = _log(out)
    assert c["loss/misfit"][-1] <= 1e-4 and np.all(c["loss/misfit"][:-1] > 1e-4)
    assert res.stopped.startswith("target loss/misfit")


def test_metric_target_is_read_when_the_metric_is_evaluated(tmp_path):
    out = str(tmp_path / "run")
    res = train(TINY, overrides={"iterations": 500, "eval_every": 3,
                                 "target": "rate_error:0.01"}, out=out, quiet=True)
    c = _log(out)
    n = len(c["loss"])
    assert n % 3 == 0 and n < 500        # the stop is at an evaluated row
    err = c["metric/rate_error"]
    evaluated = err[np.isfinite(err)]
    assert evaluated[-1] <= 0.01 and np.all(evaluated[:-1] > 0.01)
    assert res.metrics["rate_error"] == evaluated[-1]
    assert res.stopped.startswith("target rate_error")


def test_a_level_alone_names_the_problems_target_metric(tmp_path):
    src = open(TINY).read().replace("class Decay(deepsolve.Problem):\n",
                                    "class Decay(deepsolve.Problem):\n"
                                    "    target_metric = 'rate_error'\n")
    path = tmp_path / "decay_target.py"
    path.write_text(src)
    res = train(str(path), overrides={"iterations": 500, "eval_every": 1, "target": 0.02},
                out=str(tmp_path / "run"), quiet=True)
    assert res.stopped.startswith("target rate_error") and res.metrics["rate_error"] <= 0.02
    res = train(TINY, overrides={"iterations": 500, "target": 1e-4},
                out=str(tmp_path / "run2"), quiet=True)   # no target_metric: the loss
    assert res.stopped.startswith("target loss ") and res.final_loss <= 1e-4


def test_an_unknown_target_name_fails_in_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ProblemError, match="no loss term or metric 'u_err'; name one of loss, "
                                           "loss/misfit, loss/prior, rate_error") as e:
        train(TINY, overrides={"target": "u_err:1e-3"}, out=str(out), quiet=True)
    assert "\n" not in str(e.value)
    assert not out.exists()


@pytest.mark.timeout(120)
def test_a_target_naming_a_loss_term_the_problem_lacks_fails_before_the_first_iteration(
        tmp_path, capsys):
    """``--set target=loss/<a term the problem lacks>:1e-3`` was accepted and never stopped
    the run. The terms are known from one evaluation of the residuals before training: the
    name fails there, in one line listing the names there are, before a log is written
    (a fresh run leaves no directory; a resumed one leaves its files as they were)."""
    out = tmp_path / "run"
    with pytest.raises(ProblemError) as e:
        train(TINY, overrides={"target": "loss/pde:1e-3"}, out=str(out), quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and "no loss term 'loss/pde'" in msg, msg
    assert "name one of loss, loss/misfit, loss/prior, rate_error" in msg, msg
    assert not out.exists()
    # a term's bare name, and the log's column name of a metric: said what they mean
    with pytest.raises(ProblemError, match=r"'misfit' \(did you mean loss/misfit\?\)"):
        train(TINY, overrides={"target": "misfit:1e-3"}, out=str(out), quiet=True)
    with pytest.raises(ProblemError, match=r"'metric/rate_error' \(did you mean rate_error\?\)"):
        train(TINY, overrides={"target": "metric/rate_error:1e-3"}, out=str(out), quiet=True)
    assert not out.exists()
    # the command line: exit code 2, one line
    capsys.readouterr()
    assert main(["train", TINY, "--out", str(out), "--quiet", "--set",
                 "target=loss/nope:1e-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no loss term 'loss/nope'" in err[0] and "loss/misfit" in err[0]
    assert not out.exists()
    # a resumed run: refused with its log and restart file left as they were
    train(TINY, overrides={"iterations": 3}, out=str(out), quiet=True)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ProblemError, match="no loss term 'loss/pde'"):
        train(TINY, overrides={"iterations": 6, "target": "loss/pde:1e-3"}, out=str(out),
              resume=True, quiet=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


@pytest.mark.timeout(120)
def test_a_missing_target_term_on_resume_is_one_line_before_any_warning(tmp_path, capsys):
    """``--resume --set target=loss/nope:1e-3`` printed the restart's warning ("resuming
    with settings that differ ... target '' -> 'loss/nope:1e-3'") and then the refusal: the
    target is now checked before the warnings are said, so the refusal is the one line; a
    target that exists is warned about as before, once."""
    out = tmp_path / "run"
    assert main(["train", TINY, "--out", str(out), "--quiet", "--iterations", "6"]) == 0
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["train", TINY, "--out", str(out), "--quiet", "--iterations", "12",
                 "--resume", "--set", "target=loss/nope:1e-3", "--set",
                 "true_rate=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deepsolve train: error: "), err
    assert "no loss term 'loss/nope'" in err[0] and "loss/misfit" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert main(["train", TINY, "--out", str(out), "--quiet", "--iterations", "8",
                 "--resume", "--set", "target=loss/misfit:1e-12"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resuming with settings that differ" in err[0], err
    assert "target '' -> 'loss/misfit:1e-12'" in err[0], err


RANDOM_TERMS = '''
import numpy as np
import torch
import deepsolve


class Noisy(deepsolve.Problem):
    """Residuals that draw from every generator a restart records and count their calls in
    the problem's state: an evaluation that was not put back would change the run."""

    defaults = {"iterations": 5, "lr": 0.05}

    def build(self, ctx):
        ctx.model = torch.nn.Linear(3, 1).to(ctx.dtype)
        ctx.data = {"calls": 0}

    def residuals(self, ctx, iteration):
        ctx.data["calls"] += 1
        x = torch.rand(8, 3, dtype=ctx.dtype) + torch.rand(1, generator=ctx.generator).item()
        shift = float(np.random.rand()) + ctx.data["calls"]
        return {"fit": (ctx.model(x) - shift).pow(2).mean()}

    def state_dict(self, ctx):
        return {"calls": ctx.data["calls"]}

    def load_state_dict(self, ctx, state):
        ctx.data["calls"] = int(state["calls"])


problem = Noisy()
'''


@pytest.mark.timeout(120)
def test_the_evaluation_that_finds_the_loss_terms_changes_nothing_of_the_run(tmp_path):
    """The residuals evaluated for the terms' names before training: random generators,
    the problem's state and the model are put back, so a run with a loss-term target
    trains exactly as the same run without one (fresh and resumed)."""
    path = tmp_path / "noisy.py"
    path.write_text(RANDOM_TERMS)
    runs = {}
    for name, target in (("plain", ""), ("term", "loss/fit:1e-30")):
        out = str(tmp_path / name)
        train(str(path), overrides={"iterations": 3, "target": target}, out=out, quiet=True)
        train(str(path), overrides={"iterations": 5, "target": target}, out=out, quiet=True,
              resume=True)
        runs[name] = _log(out)
    np.testing.assert_array_equal(runs["term"]["iteration"], np.arange(5))
    np.testing.assert_array_equal(runs["term"]["loss"], runs["plain"]["loss"])


def test_target_reached_then_resume(tmp_path, capsys):
    out = str(tmp_path / "run")
    first = train(TINY, overrides={"iterations": 500, "target": "loss:1e-3"}, out=out,
                  quiet=True)
    before = open(os.path.join(out, "log.h5"), "rb").read()
    with pytest.raises(RestartError, match="reached its target.*nothing to train"):
        train(TINY, overrides={"iterations": 500, "target": "loss:1e-3"}, out=out,
              resume=True, quiet=True)
    assert open(os.path.join(out, "log.h5"), "rb").read() == before   # nothing changed
    assert main(["train", TINY, "--out", out, "--resume", "--iterations", "500", "--set",
                 "target=loss:1e-3", "--quiet"]) == 2
    assert "reached its target" in capsys.readouterr().err
    # a lower target continues the same run: its rows follow on
    second = train(TINY, overrides={"iterations": 500, "target": "loss:1e-4"}, out=out,
                   resume=True, quiet=True)
    c = _log(out)
    assert second.iterations > first.iterations == np.flatnonzero(c["stopped"] != "")[0] + 1
    np.testing.assert_array_equal(c["iteration"], np.arange(second.iterations))
    assert c["loss"][-1] <= 1e-4 and np.all(c["loss"][first.iterations:-1] > 1e-4)


def test_time_limit_ends_the_run_within_it_and_resume_counts_on(tmp_path):
    out = str(tmp_path / "run")
    # minutes: 3 s of iterations that sleep 50 ms each (a first iteration slowed by a loaded
    # machine still leaves several; 1.2 s once left only two)
    limit = 0.05
    res = train(TINY, overrides={"iterations": 10_000, "sleep": 0.05, "eval_every": 0,
                                 "time_limit": limit}, out=out, quiet=True)
    c = _log(out)
    n = len(c["loss"])
    assert 5 < n < 10_000 and res.stopped == f"time_limit {limit:g} min"
    assert c["stopped"][-1] == res.stopped and math.isfinite(c["metric/rate_error"][-1])
    # the decision: the last row is the first whose step left less than one more
    # iteration of its pace before the limit: the rows before it ended in time, and the
    # run used its time (it stopped within about one iteration of the limit)
    per = np.diff(np.concatenate([[0.0], c["elapsed"]]))
    assert np.all(c["elapsed"][:-1] < 60 * limit)
    assert 60 * limit - per.max() <= c["elapsed"][-1] <= 60 * limit + 2 * per.max() + 0.5
    with pytest.raises(RestartError, match="time limit.*nothing to train.*time_limit="):
        train(TINY, overrides={"iterations": 10_000, "sleep": 0.05, "time_limit": limit},
              out=out, resume=True, quiet=True)
    more = train(TINY, overrides={"iterations": 10_000, "sleep": 0.05, "eval_every": 0,
                                  "time_limit": 2 * limit}, out=out, resume=True, quiet=True)
    c2 = _log(out)
    assert more.iterations > n and more.stopped == f"time_limit {2 * limit:g} min"
    np.testing.assert_array_equal(c2["iteration"], np.arange(more.iterations))
    # the clock went on from the restart file's: the resumed rows start past the first part
    assert c2["elapsed"][n] > c["elapsed"][-1] and np.all(np.diff(c2["elapsed"]) > 0)
    assert c2["elapsed"][-1] <= 60 * 2 * limit + 2 * per.max() + 0.5
    # no limit at all: on to the iterations
    done = train(TINY, overrides={"iterations": more.iterations + 3, "sleep": 0.0,
                                  "time_limit": 0}, out=out, resume=True, quiet=True)
    assert done.iterations == more.iterations + 3 and done.stopped == ""


def test_progress_eta_is_the_time_left_when_a_limit_comes_first(monkeypatch, capsys):
    import deepsolve.training.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    lines = progress.Lines(total=1000, start=0, every=0.0, deadline=130.0)
    now[0] = 101.0
    lines.update(0, 1.0, {})
    assert "ETA 29s" in capsys.readouterr().err   # 999 s at 1 s/it, but 29 s to the limit
    lines = progress.Lines(total=10, start=0, every=0.0, deadline=1000.0)
    now[0] = 102.0
    lines.update(0, 1.0, {})
    assert "ETA 9s" in capsys.readouterr().err    # the iterations end first


@pytest.mark.timeout(120)
def test_resuming_a_finished_run_reports_the_logs_final_loss(tmp_path, capsys):
    """``--resume`` of a run at its last iteration printed "final loss nan" (no iteration
    ran, so no loss was seen). It says the run had already finished and reports the log's
    last loss and metrics, exit 0, and changes nothing."""
    out = tmp_path / "run"
    first = train(TINY, overrides={"iterations": 6}, out=str(out), quiet=True)
    c = _log(out)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["train", TINY, "--out", str(out), "--resume", "--iterations", "6",
                 "--quiet"]) == 0
    stdout = capsys.readouterr().out
    assert f"the run had already finished: trained 6 iterations, final loss " \
           f"{c['loss'][-1]:.4e}" in stdout, stdout
    assert "nan" not in stdout and f"rate_error {c['metric/rate_error'][-1]:.4g}" in stdout
    res = train(TINY, overrides={"iterations": 6}, out=str(out), resume=True, quiet=True)
    assert res.nothing_to_train and res.iterations == 6 and not res.preempted
    assert res.final_loss == c["loss"][-1] == first.final_loss
    assert res.metrics == first.metrics
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


@pytest.mark.timeout(120)
def test_resuming_past_the_time_limit_stops_before_any_iteration(tmp_path, capsys):
    """Resuming with ``--set time_limit=X`` below the time the run has trained ran one more
    iteration (the clock was read only after a step). It stops before any, says why in one
    line and exits as a time-limited stop does (0, the reason in ``stopped``)."""
    out = tmp_path / "run"
    train(TINY, overrides={"iterations": 4, "sleep": 0.05, "eval_every": 0}, out=str(out),
          quiet=True)
    trained = torch.load(out / "restart.pt", weights_only=True)["elapsed"]
    assert trained >= 0.2
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    limit = 0.5 * trained / 60   # minutes, half the time trained
    capsys.readouterr()
    assert main(["train", TINY, "--out", str(out), "--resume", "--iterations", "10",
                 "--set", f"time_limit={limit}", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "trained 4 iterations, final loss" in cap.out and "nan" not in cap.out, cap.out
    note = [ln for ln in cap.err.splitlines() if "time limit" in ln]
    assert len(note) == 1 and "stopped before iteration 4" in note[0], cap.err
    assert "--set time_limit=" in note[0]
    assert _log(out)["iteration"].tolist() == [0, 1, 2, 3]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    res = train(TINY, overrides={"iterations": 10, "time_limit": limit}, out=str(out),
                resume=True, quiet=True)
    assert res.iterations == 4 and res.stopped == f"time_limit {limit:g} min"
    assert not res.preempted and res.nothing_to_train
    # a limit above the time trained: on it goes
    more = train(TINY, overrides={"iterations": 6, "time_limit": 10.0}, out=str(out),
                 resume=True, quiet=True)
    assert more.iterations == 6 and not more.nothing_to_train
