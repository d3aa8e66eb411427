"""The trainer and the CLI: problem files, HDF5 logs, restart files, resume, report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from deepsolve.cli import main
from deepsolve.io import read_log
from deepsolve.problem import ProblemError, load_problem

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(HERE, "data", "tiny_problem.py")


def run_cli(*args) -> int:
    return main([str(a) for a in args])


def test_train_writes_one_row_per_iteration(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 8, "--quiet") == 0
    printed = capsys.readouterr().out
    assert f"log: {out / 'log.h5'}" in printed
    log = read_log(out / "log.h5")
    assert log.n_rows == 8
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(8))
    for name in ("loss", "loss/misfit", "loss/prior", "time", "time_forward", "time_backward",
                 "peak_device_memory", "peak_host_memory", "advances", "recorded",
                 "snapshots", "schedule", "lr", "grad_norm", "metric/rate_error"):
        assert name in log.columns, name
    loss = log.columns["loss"]
    np.testing.assert_allclose(loss, log.columns["loss/misfit"] + log.columns["loss/prior"],
                               rtol=1e-6)
    assert loss[-1] < loss[0]
    assert np.all(log.columns["recorded"] == 50)  # one unroll of 50 steps per iteration
    assert log.attrs["config"]["iterations"] == 8
    assert len(log.attrs["problem_sha256"]) == 64
    assert (out / "restart.pt").exists()


def test_set_typing_and_unknown_keys(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 2, "--quiet",
                   "--set", "steps=20", "--set", "dt=0.05", "--snapshots", 4) == 0
    log = read_log(out / "log.h5")
    assert log.attrs["config"]["steps"] == 20 and log.attrs["config"]["dt"] == 0.05
    assert np.all(log.columns["recorded"] == 20)
    assert "revolve" in str(log.columns["schedule"][0])
    capsys.readouterr()
    assert run_cli("train", TINY, "--out", tmp_path / "b", "--set", "stepz=3") == 2
    err = capsys.readouterr().err
    assert "unknown setting" in err and "steps" in err and err.count("\n") == 1
    assert run_cli("train", TINY, "--out", tmp_path / "c", "--set", "steps=many") == 2
    assert "expected an integer" in capsys.readouterr().err


def test_refuses_to_overwrite_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 1, "--quiet") == 0
    assert run_cli("train", TINY, "--out", out, "--iterations", 1, "--quiet") == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("content,match", [
    (None, "does not exist"),
    ("x = 1\n", "does not define `problem`"),
    ("problem = 3\n", "not an instance of deepsolve.Problem"),
    ("import deepsolve\nclass P(deepsolve.Problem):\n    pass\nproblem = P\n", "make it an"),
    ("raise RuntimeError('boom')\n", "importing .* failed: RuntimeError: boom"),
])
def test_bad_problem_files(tmp_path, content, match, capsys):
    path = tmp_path / "p.py"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProblemError, match=match):
        load_problem(path)
    assert run_cli("train", path, "--out", tmp_path / "r") == 2
    err = capsys.readouterr().err
    assert err.startswith("deepsolve train: error:") and err.count("\n") == 1


def test_budget_run_keeps_its_memory_in_the_log(tmp_path):
    out = tmp_path / "run"
    budget = 3000  # bytes: a 4-element float32 state, 50 steps
    assert run_cli("train", TINY, "--out", out, "--iterations", 3, "--quiet",
                   "--budget", budget, "--set", "batch=64") == 0
    log = read_log(out / "log.h5")
    peak = log.columns["peak_device_memory"]
    assert np.all(np.isfinite(peak)) and np.all(peak > 0)
    assert np.all(peak <= budget)


def _spawn(out, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "deepsolve", "train", TINY, "--out", str(out), "--quiet",
         "--iterations", "30", "--set", "sleep=0.15", "--set", "checkpoint_every=100", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_then_resume_gives_a_complete_log(tmp_path):
    out = tmp_path / "run"
    proc = _spawn(out)
    log_path = out / "log.h5"
    deadline = time.time() + 60
    while time.time() < deadline and not log_path.exists():
        time.sleep(0.1)
    time.sleep(1.0)  # a few iterations in
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "continue with --resume" in err
    first = read_log(log_path)
    done = first.n_rows
    assert 0 < done < 30
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "deepsolve", "train", TINY, "--out", str(out),
                          "--quiet", "--iterations", "30", "--set", "checkpoint_every=100",
                          "--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    log = read_log(log_path)
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(30))


def test_resume_drops_rows_after_the_restart_file(tmp_path):
    """Rows logged after the last restart file are re-run, not duplicated."""
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 7, "--quiet",
                   "--set", "checkpoint_every=3") == 0
    # pretend the run died after iteration 6 was logged but the restart was from iteration 6
    import torch

    state = torch.load(out / "restart.pt", weights_only=True)
    state["iteration"] = 6
    torch.save(state, out / "restart.pt")
    assert run_cli("train", TINY, "--out", out, "--iterations", 10, "--quiet", "--resume") == 0
    np.testing.assert_array_equal(read_log(out / "log.h5").columns["iteration"], np.arange(10))


def test_report_writes_pngs_and_rejects_corrupt_logs(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 5, "--quiet") == 0
    capsys.readouterr()
    assert run_cli("report", out) == 0
    text = capsys.readouterr().out
    assert "misfit" in text
    for png in ("loss.png", "memory.png", "time.png"):
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad"
    bad.mkdir()
    data = (out / "log.h5").read_bytes()
    (bad / "log.h5").write_bytes(data[: len(data) // 2])
    assert run_cli("report", bad) == 2
    err = capsys.readouterr().err
    assert "log.h5" in err and err.count("\n") == 1
    assert run_cli("report", tmp_path / "nothing") == 2


def test_plan_command_for_a_problem(capsys):
    assert run_cli("plan", TINY, "--budget", "3000", "--set", "batch=64") == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "store_all" in out
    assert run_cli("plan", TINY) == 2
    assert "--budget" in capsys.readouterr().err


def test_log_is_readable_while_training(tmp_path):
    """SWMR: a reader opens the log while the trainer is still writing it."""
    out = tmp_path / "run"
    proc = _spawn(out, "--set", "checkpoint_every=2")
    log_path = out / "log.h5"
    try:
        deadline = time.time() + 60
        rows = 0
        while time.time() < deadline and rows < 2:
            time.sleep(0.3)
            if log_path.exists():
                try:
                    with h5py.File(log_path, "r", swmr=True, libver="latest") as f:
                        rows = f["iteration"].shape[0]
                except (OSError, KeyError):
                    rows = 0
        assert rows >= 2
        assert proc.poll() is None  # still training
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
