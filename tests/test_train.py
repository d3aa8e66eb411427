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
import torch

import deepsolve
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
    budget = 8000  # bytes: a 64-element float32 state, 50 steps
    assert run_cli("train", TINY, "--out", out, "--iterations", 3, "--quiet",
                   "--budget", budget, "--set", "batch=64") == 0
    log = read_log(out / "log.h5")
    peak = log.columns["peak_device_memory"]
    assert np.all(np.isfinite(peak)) and np.all(peak > 0)
    assert np.all(peak <= budget)
    tracked, real = log.columns["peak_tracked_memory"], log.columns["peak_real_memory"]
    np.testing.assert_array_equal(tracked, peak)
    assert np.all(np.isfinite(real)) and np.all(real >= 0)


def _spike_run_shows_the_spike_alone(out, *settings: str) -> None:
    """Train the tiny problem 4 iterations with a 64 MiB spike at iteration 2 (a kernel that
    refuses to reset VmHWM: skipped); its real peak shows at iteration 2 and at no other."""
    from deepsolve.memory.meter import reset_high_water_mark

    if not reset_high_water_mark():
        pytest.skip("the kernel refuses to reset VmHWM (/proc/self/clear_refs)")
    sets = [a for s in ("spike_at=2", *settings) for a in ("--set", s)]
    assert run_cli("train", TINY, "--out", out, "--iterations", 4, "--quiet", *sets) == 0
    log = read_log(out / "log.h5")
    real = log.columns["peak_real_memory"]
    assert np.all(np.isnan(log.columns["peak_tracked_memory"]))  # no budget: nothing tracked
    assert real[2] >= 60 * 2**20 and max(real[0], real[1], real[3]) < real[2] / 2, (
        real, log.columns["peak_host_memory"])


def test_real_peak_is_logged_per_iteration(tmp_path):
    """``peak_real_memory``: the resident-set high-water mark of each iteration above the
    run's baseline; an iteration that allocates 64 MiB more shows it, the others do not."""
    _spike_run_shows_the_spike_alone(tmp_path / "run")


def test_real_peak_is_the_runs_own_after_a_budgeted_call_in_the_process(tmp_path):
    """A budgeted CPU unroll earlier in the process (a notebook, another run) leaves the host
    allocator's limit set, and its cache would keep freed blocks resident: the run empties
    it, so the 64 MiB spike shows at its iteration and at no other."""
    x0 = torch.randn(2**17, dtype=torch.float64, requires_grad=True)  # 1 MiB, 200 steps
    stats = deepsolve.UnrollStats()
    deepsolve.unroll(lambda x, i: x.sin(), x0, 200, budget="100MiB", stats=stats).sum() \
        .backward()
    assert stats.extra["plan"].strategy.kind != "store_all"  # the limit stays set after it
    _spike_run_shows_the_spike_alone(tmp_path / "run")


def test_real_peak_survives_memory_freed_during_the_run(tmp_path):
    """128 MiB resident when the run starts and freed at iteration 1 (garbage of earlier work
    collected, a cache trimmed) must not hide iteration 2's 64 MiB spike below the run's
    starting resident size: the baseline follows the resident size down."""
    _spike_run_shows_the_spike_alone(tmp_path / "run", "ballast=128", "drop_at=1")


def test_resuming_a_log_without_the_real_peak_columns(tmp_path):
    """A log written before ``peak_real_memory`` existed resumes and gains the columns: NaN
    in its old rows, measured in the new ones."""
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 2, "--quiet") == 0
    with h5py.File(out / "log.h5", "a") as f:  # as an older trainer wrote it
        del f["peak_real_memory"], f["peak_tracked_memory"]
    assert run_cli("train", TINY, "--out", out, "--iterations", 4, "--quiet", "--resume") == 0
    log = read_log(out / "log.h5")
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(4))
    real = log.columns["peak_real_memory"]
    assert np.isnan(real[:2]).all() and (real[2:] >= 0).all(), real


GATED = os.path.join(HERE, "data", "gated_problem.py")


def _spawn_gated(out, gate, gate_at, *extra):
    """A trainer on the gated problem: iteration ``gate_at`` writes ``gate.waiting`` and
    waits for ``gate`` to exist."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "deepsolve", "train", GATED, "--out", str(out), "--quiet",
         "--iterations", "30", "--set", f"gate={gate}", "--set", f"gate_at={gate_at}", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc, timeout=120.0):
    """Wait until ``path`` exists (the trainer's readiness signal); fail if it ends first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the trainer ended (rc {proc.returncode}) before {path}: {err}")
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=60)


@pytest.mark.slow
def test_sigterm_then_resume_gives_a_complete_log(tmp_path):
    """SIGTERM while iteration 7 runs (the trainer waits at its gate, so its handler is
    installed and it cannot have finished): it completes iteration 7, writes the restart file
    at 8 and exits with 75; --resume completes the run with the losses of an uninterrupted
    one."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _spawn_gated(out, gate, 7, "--set", "checkpoint_every=100")
    try:
        _wait_for(f"{gate}.waiting", proc)
        proc.send_signal(signal.SIGTERM)
        gate.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 75, err
    assert "stopped by a signal after iteration 7" in err
    log_path = out / "log.h5"
    np.testing.assert_array_equal(read_log(log_path).columns["iteration"], np.arange(8))
    import torch

    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 8
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "deepsolve", "train", GATED, "--out", str(out),
                          "--quiet", "--iterations", "30", "--set", "checkpoint_every=100",
                          "--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    log = read_log(log_path)
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(30))
    assert run_cli("train", GATED, "--out", tmp_path / "ref", "--iterations", 30, "--quiet",
                   "--set", "checkpoint_every=100") == 0
    ref = read_log(tmp_path / "ref")
    np.testing.assert_allclose(log.columns["loss"], ref.columns["loss"], rtol=1e-6)


def test_resume_drops_rows_after_the_restart_file(tmp_path):
    """Rows logged after the restart file are re-run, not duplicated: a log of 10 rows with
    the restart file of iteration 6 (as after a kill between a flush and the next restart
    file) resumes to the log and losses of an uninterrupted run."""
    import shutil

    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 6, "--quiet",
                   "--set", "checkpoint_every=3") == 0
    shutil.copy(out / "restart.pt", tmp_path / "restart-6.pt")
    assert run_cli("train", TINY, "--out", out, "--iterations", 10, "--quiet", "--resume") == 0
    assert read_log(out / "log.h5").n_rows == 10
    shutil.copy(tmp_path / "restart-6.pt", out / "restart.pt")
    assert run_cli("train", TINY, "--out", out, "--iterations", 10, "--quiet", "--resume") == 0
    log = read_log(out / "log.h5")
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(10))
    assert run_cli("train", TINY, "--out", tmp_path / "ref", "--iterations", 10,
                   "--quiet") == 0
    ref = read_log(tmp_path / "ref" / "log.h5")
    np.testing.assert_allclose(log.columns["loss"], ref.columns["loss"], rtol=1e-6)


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


def test_plan_command_for_a_problem(capsys, tmp_path):
    assert run_cli("plan", TINY, "--budget", "20000", "--set", "batch=64") == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "store_all" in out
    assert run_cli("plan", TINY) == 2                      # no budget anywhere: one line
    err = capsys.readouterr().err
    assert "the problem has no default budget; give --budget" in err and err.count("\n") == 1
    # without --budget, the problem's own budget (plan PROBLEM.py said "needs --budget")
    own = tmp_path / "own_budget.py"
    own.write_text(open(TINY).read().replace('"curve": False}',
                                             '"curve": False, "budget": "20000"}'))
    head = out.split(";")[0]                            # "budget 19.53 KiB for 50 steps"
    assert head.startswith("budget 19.53 KiB")
    assert run_cli("plan", own, "--set", "batch=64") == 0
    assert capsys.readouterr().out.split(";")[0] == head
    assert run_cli("plan", TINY, "--set", "budget=20000", "--set", "batch=64") == 0
    assert capsys.readouterr().out.split(";")[0] == head


def test_log_is_readable_while_training(tmp_path):
    """SWMR: a reader opens the log while the trainer is still writing it (the trainer waits
    at its gate in iteration 5: the restart file at 4 has flushed rows 0..3)."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _spawn_gated(out, gate, 5, "--set", "checkpoint_every=2")
    log_path = out / "log.h5"
    try:
        _wait_for(f"{gate}.waiting", proc)
        with h5py.File(log_path, "r", swmr=True, libver="latest") as f:
            rows = f["iteration"].shape[0]
            assert list(f["iteration"][:4]) == [0, 1, 2, 3]
        assert rows >= 4
        log = read_log(log_path)
        assert log.n_rows >= 4 and all(len(c) == log.n_rows for c in log.columns.values())
        assert proc.poll() is None  # still training
        gate.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 0, err
    np.testing.assert_array_equal(read_log(log_path).columns["iteration"], np.arange(30))


# ---------------------------------------------------------------- threads, progress, baseline


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_threads_setting_applies(tmp_path, keep_threads, monkeypatch):
    from deepsolve.train import DEFAULT_THREADS, apply_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 1, "--quiet",
                   "--threads", 2) == 0            # an explicit count beats the environment
    assert read_log(out / "log.h5").attrs["threads"] == 2  # what the run used
    assert torch.get_num_threads() == 1                      # the caller's, restored
    assert apply_threads(0) == 1                     # 0: OMP_NUM_THREADS when set
    assert torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(2)
    assert apply_threads(0) == min(DEFAULT_THREADS, len(os.sched_getaffinity(0)))
    assert torch.get_num_threads() == min(DEFAULT_THREADS, len(os.sched_getaffinity(0)))
    out2 = tmp_path / "run2"
    assert run_cli("train", TINY, "--out", out2, "--iterations", 1, "--quiet",
                   "--set", "threads=2") == 0     # the setting, as in a problem's defaults
    assert read_log(out2 / "log.h5").attrs["threads"] == 2


def test_progress_lines_off_a_terminal(tmp_path, capsys):
    assert not sys.stderr.isatty()
    assert run_cli("train", TINY, "--out", tmp_path / "a", "--iterations", 5,
                   "--set", "progress_every=0") == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if " s/it " in ln]
    assert [ln.split()[3] for ln in lines] == [f"{k}/5" for k in range(1, 6)], lines
    for ln in lines:
        assert "loss " in ln and "peak " in ln and "ETA " in ln
    log = read_log(tmp_path / "a" / "log.h5")
    assert float(lines[-1].split()[5]) == pytest.approx(log.columns["loss"][-1], rel=1e-4)
    # the final evaluate() metrics are printed, not only the loss
    want = log.columns["metric/rate_error"][-1]
    assert f"final metrics: rate_error {want:.4g}" in captured.out
    # default: a line after the first iteration, then every 30 s, and after the last
    assert run_cli("train", TINY, "--out", tmp_path / "b", "--iterations", 6) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " s/it " in ln]
    assert [ln.split()[3] for ln in lines] == ["1/6", "6/6"]
    assert run_cli("train", TINY, "--out", tmp_path / "c", "--iterations", 3, "--quiet") == 0
    assert " s/it " not in capsys.readouterr().err


def test_progress_pace_is_that_since_the_previous_line(monkeypatch, capsys):
    """A curriculum's iterations get slower: the s/it and ETA of a line follow the pace
    since the previous line, not the mean since the start."""
    from deepsolve.training import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    lines = progress.Lines(total=10, start=0, every=0.0)
    for it, dt in enumerate([1.0] * 4 + [5.0] * 6):
        clock[0] += dt
        lines.update(it, 1.0, {})
    out = [ln.split() for ln in capsys.readouterr().err.splitlines()]
    assert [ln[3] for ln in out] == [f"{k}/10" for k in range(1, 11)]
    assert [float(ln[6]) for ln in out] == [1.0] * 4 + [5.0] * 6
    assert out[5][-1] == "20s" and out[3][-1] == "6s"   # 4 left at 5 s; 6 left at 1 s


def _seconds(eta: str) -> int:
    """``1h02m``, ``4m01s`` or ``17s`` as seconds."""
    import re

    m = re.fullmatch(r"(?:(\d+)h(\d+)m)|(?:(\d+)m(\d+)s)|(?:(\d+)s)", eta)
    assert m is not None, eta
    h, hm, mm, ms, s = (int(g) if g else 0 for g in m.groups())
    return 3600 * h + 60 * hm + 60 * mm + ms + s


@pytest.mark.timeout(60)
def test_progress_eta_weighs_the_iterations_left_by_their_curriculum_horizon(monkeypatch,
                                                                           capsys):
    """``make demo``'s ETA ignored the horizon curriculum (100, 300, then 1000 steps from
    iterations 0, 30 and 60): at iteration 31 of 100 it said 1m15s, then 4m01s, 2m17s,
    3m52s. With a fake clock and iterations whose cost is proportional to their horizon,
    the ETA of every line is the closed-form remaining work times the measured time per
    step, whatever the stage; without a curriculum it is the pace times the iterations
    left, as before."""
    from deepsolve.config import horizon, parse_curriculum
    from deepsolve.training import progress

    stages = parse_curriculum("0:100,30:300,60:1000", 100, 1000)
    assert stages == ((0, 100), (30, 300), (60, 1000))

    def remaining(done):   # unrolled steps left after `done` iterations, in closed form
        return (100 * max(0, 30 - done) + 300 * max(0, 60 - max(done, 30))
                + 1000 * (100 - max(done, 60)))

    per_step = 0.01   # seconds per unrolled step
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    lines = progress.Lines(total=100, start=0, every=0.0, stages=stages)
    for it in range(100):
        clock[0] += per_step * horizon(stages, it)
        lines.update(it, 1.0, {})
    out = [ln.split() for ln in capsys.readouterr().err.splitlines()]
    assert [ln[3] for ln in out] == [f"{k}/100" for k in range(1, 101)]
    etas = [_seconds(ln[-1]) for ln in out]
    assert etas == [round(per_step * remaining(done)) for done in range(1, 101)]
    assert etas[30] == 487            # at iteration 31: 29 x 300 + 40 x 1000 steps at 10 ms
    # a resumed run and a line every few iterations: the same closed form
    clock[0] = 0.0
    lines = progress.Lines(total=100, start=25, every=2.5, stages=stages)
    for it in range(25, 100):
        clock[0] += per_step * horizon(stages, it)
        lines.update(it, 1.0, {})
    out = [ln.split() for ln in capsys.readouterr().err.splitlines()]
    done = [int(ln[3].split("/")[0]) for ln in out]
    assert 5 < len(out) < 75 and done[-1] == 100
    assert [_seconds(ln[-1]) for ln in out] == [round(per_step * remaining(d)) for d in done]
    # the work of a range of iterations: the horizons summed, in closed form
    for a, b in [(0, 100), (29, 31), (31, 61), (59, 60), (70, 70), (0, 1), (99, 100)]:
        assert progress.work(stages, a, b) == sum(horizon(stages, i) for i in range(a, b))
    assert progress.work((), 3, 10) == 7.0
    late = ((5, 40), (8, 10))   # iterations before the first start take its steps
    assert progress.work(late, 0, 12) == sum(horizon(late, i) for i in range(12))


@pytest.mark.timeout(120)
def test_the_trainer_gives_its_curriculum_to_the_progress_output(tmp_path, monkeypatch):
    """The run hands its parsed curriculum to the progress bar or lines, which weigh the
    iterations left by it."""
    from deepsolve.training import run as run_module

    seen = []
    real = run_module.progress

    def spy(*args, **kw):
        seen.append(args[5] if len(args) > 5 else kw.get("stages"))
        return real(*args, **kw)

    monkeypatch.setattr(run_module, "progress", spy)
    assert run_cli("train", TINY, "--out", tmp_path / "a", "--iterations", 4, "--set",
                   "curriculum=0:10,2:50", "--set", "progress_every=0") == 0
    assert seen == [((0, 10), (2, 50))]
    assert run_cli("train", TINY, "--out", tmp_path / "b", "--iterations", 2) == 0
    assert seen[1] == ()


def test_the_progress_bar_counts_unrolled_steps_under_a_curriculum(capsys):
    """On a terminal, tqdm's rate and time left follow the bar's count: under a curriculum
    the bar counts unrolled steps, the iteration in its postfix."""
    from deepsolve.training import progress

    stages = ((0, 100), (30, 300), (60, 1000))
    bar = progress.Bar(total=100, start=30, stages=stages)
    try:
        assert bar.bar.total == progress.work(stages, 0, 100) == 52000
        assert bar.bar.n == 3000
        bar.update(30, 1.0, {})
        assert bar.bar.n == 3300 and "it=31/100" in str(bar.bar.postfix)
    finally:
        bar.close()
    plain = progress.Bar(total=10, start=2)
    try:
        plain.update(2, 1.0, {})
        assert plain.bar.total == 10 and plain.bar.n == 3
    finally:
        plain.close()


def test_baseline_metrics_before_training_are_logged(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 4, "--quiet") == 0
    log = read_log(out / "log.h5")
    # the model as built: rate 0.1 against the true 0.8
    assert log.attrs["initial_metrics"] == {"rate_error": pytest.approx(0.7, abs=1e-6)}
    assert np.isnan(log.columns["metric/rate_error"][0])  # row 0 is not evaluated
    assert log.attrs["weights"] == {}
    # a resumed log keeps the first run's baseline
    assert run_cli("train", TINY, "--out", out, "--iterations", 8, "--quiet", "--resume") == 0
    log = read_log(out / "log.h5")
    assert log.n_rows == 8
    assert log.attrs["initial_metrics"] == {"rate_error": pytest.approx(0.7, abs=1e-6)}


def test_percent_budget_is_resolved_once_and_logged_in_bytes(tmp_path, monkeypatch):
    import deepsolve.memory.budget as B

    calls = []

    def capacity(device=None):  # the available memory changes every time it is asked
        calls.append(1)
        return (64 + 16 * len(calls)) << 20

    monkeypatch.setattr(B, "device_capacity", capacity)
    out = tmp_path / "once"
    assert run_cli("train", TINY, "--out", out, "--iterations", 4, "--quiet",
                   "--budget", "1%") == 0
    log = read_log(out / "log.h5")
    want = int(0.01 * (80 << 20))                    # the first resolution, at the start
    assert log.attrs["budget_bytes"] == want
    np.testing.assert_array_equal(log.columns["budget_bytes"], np.full(4, float(want)))
    assert len(set(log.columns["schedule"])) == 1
    calls.clear()
    out = tmp_path / "each"
    assert run_cli("train", TINY, "--out", out, "--iterations", 3, "--quiet",
                   "--budget", "1%", "--set", "budget_once=false") == 0
    got = read_log(out / "log.h5").columns["budget_bytes"]
    assert len(set(got.tolist())) == 3 and np.all(np.diff(got) > 0)


def _no_build(monkeypatch):
    """Make the problem's build a test failure: the settings must fail before it."""
    import deepsolve.training.run as R

    def build(*a, **k):
        raise AssertionError("build was called for an invalid configuration")

    monkeypatch.setattr(R, "build", build)


def test_bad_budget_fails_before_any_work_and_leaves_no_directory(tmp_path, capsys,
                                                                  monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _no_build(m)
        t0 = time.perf_counter()
        rc = run_cli("train", TINY, "--out", out, "--budget", "12 parsecs")
        took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "12 parsecs" in err
    assert "--budget" in err and "MiB" in err     # names the setting and what to give
    assert took < 1.0, took
    assert not out.exists()
    assert run_cli("train", TINY, "--out", out, "--budget", "1MiB", "--iterations", 2,
                   "--quiet") == 0                 # fixed: the same --out works


# ------------------------------------------------- the run configuration, checked before work

NS = os.path.join(ROOT, "problems", "navier_stokes.py")
#: The smallest Navier-Stokes run worth a test: one trajectory of 4 coarse steps (16^2) against
#: a 32^2 reference, a 4-channel CNN; a few seconds with the reference generated.
NS_TINY = ["fine_n=32", "coarse_n=16", "curriculum=", "dt=0.02", "steps=4", "obs_every=4",
           "spinup=0.02",
           "n_train=1", "n_test=1", "batch=1", "width=4", "depth=2", "iterations=1"]


def _deepsolve(cwd, *args, timeout=120) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "deepsolve", *map(str, args)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=timeout)
    return res, time.perf_counter() - t0


def _ns_sets(tmp_path) -> list[str]:
    sets = NS_TINY + [f"data_dir={tmp_path / 'data'}", f"cache_dir={tmp_path / 'cache'}"]
    return [a for kv in sets for a in ("--set", kv)]


def _fails_at_once(res, took: float, *named: str) -> str:
    """Exit code 2 within 5 s (the interpreter and torch starting included), one line on
    stderr naming ``named``, no traceback."""
    err = res.stderr.strip()
    assert res.returncode == 2, res.stderr
    assert took < 5, f"{took:.1f} s"
    assert len(err.splitlines()) == 1 and err.startswith("deepsolve train: error:"), err
    for text in named:
        assert text in err, (text, err)
    return err


@pytest.mark.slow
def test_a_bad_budget_fails_in_seconds_and_the_same_command_fixed_runs(tmp_path):
    """``deepsolve train problems/navier_stokes.py --budget "12 parsecs" --out D``: one line
    naming the budget, no D; the same command with a budget that parses trains into D."""
    out = tmp_path / "D"
    sets = _ns_sets(tmp_path)
    res, took = _deepsolve(tmp_path, "train", NS, "--budget", "12 parsecs", "--out", out, *sets)
    _fails_at_once(res, took, "--budget", "12 parsecs", "'parsecs'", "MiB")
    assert not out.exists() and not (tmp_path / "data").exists()   # nothing made
    res, _ = _deepsolve(tmp_path, "train", NS, "--budget", "512KiB", "--out", out, "--quiet",
                        *sets)
    assert res.returncode == 0, res.stderr
    log = read_log(out / "log.h5")
    assert log.n_rows == 1 and log.attrs["budget_bytes"] == 512 * 1024
    assert log.attrs["config"]["budget"] == "512KiB"   # the settings, as given, recorded


BAD_SETTINGS = [
    (["--device", "tpu"], ["--device tpu", "cpu, cuda or cuda:N"]),
    (["--device", "cpu:3"], ["--device cpu:3", "--device cpu"]),
    (["--set", "stepz=3"], ["--set stepz", "unknown setting", "did you mean steps?"]),
    (["--set", "lr=fast"], ["--set lr=fast", "expected a number"]),
    (["--set", "dtype=float8"], ["--dtype float8", "float32"]),
    (["--set", "budget_once=sometimes"], ["budget_once=sometimes", "true or false"]),
]
if not torch.cuda.is_available():
    BAD_SETTINGS.append((["--device", "cuda"], ["--device cuda", "not available", "cpu"]))
if torch.cuda.device_count() <= 7:
    BAD_SETTINGS.append((["--device", "cuda:7"], ["--device cuda:7", "--device"]))


@pytest.mark.slow
@pytest.mark.parametrize("bad,named", BAD_SETTINGS, ids=[" ".join(b) for b, _ in BAD_SETTINGS])
def test_a_bad_device_or_set_fails_in_seconds_and_leaves_no_directory(tmp_path, bad, named):
    out = tmp_path / "D"
    res, took = _deepsolve(tmp_path, "train", NS, "--out", out, *_ns_sets(tmp_path), *bad)
    _fails_at_once(res, took, *named)
    assert not out.exists() and not (tmp_path / "data").exists()
    assert run_cli("train", TINY, "--out", out, "--iterations", 1, "--quiet") == 0  # free


def test_the_run_configuration_is_frozen_and_parsed():
    import dataclasses
    from types import MappingProxyType

    from deepsolve.config import ConfigError, RunConfig, run_config

    problem, _ = load_problem(TINY)
    cfg = run_config(problem, {"budget": "2KiB", "iterations": 5, "device": None},
                     ["dtype=float64", "threads=2"])
    assert isinstance(cfg, RunConfig)
    assert cfg["iterations"] == 5 and cfg["dt"] == 0.02 and cfg.get("nothing") is None
    assert cfg.budget_bytes == 2048 and cfg.device == torch.device("cpu")
    assert cfg.dtype is torch.float64 and cfg.threads == 2
    with pytest.raises(TypeError):
        cfg["iterations"] = 6                              # read-only
    with pytest.raises(TypeError):
        del cfg["iterations"]
    with pytest.raises(TypeError):
        cfg.settings["iterations"] = 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget_bytes = 1
    assert isinstance(cfg.settings, MappingProxyType)
    d = cfg.as_dict()                                      # what is persisted: a plain dict
    assert type(d) is dict and d == dict(cfg) and d["budget"] == "2KiB"
    d["iterations"] = 99
    assert cfg["iterations"] == 5                          # a copy
    more = cfg.replace(iterations=7)                       # a change is a new, checked one
    assert more["iterations"] == 7 and cfg["iterations"] == 5
    with pytest.raises(ConfigError, match="12 parsecs"):
        cfg.replace(budget="12 parsecs")
    with pytest.raises(ConfigError, match=r"setting iterations='5' is a str, not an integer"):
        run_config(problem, {"iterations": "5"})
    with pytest.raises(ConfigError, match="did you mean steps"):
        run_config(problem, {"stepz": 3})
    assert run_config(problem).budget_bytes is None        # no budget


def test_plan_and_check_check_the_settings_before_building(tmp_path, capsys, monkeypatch):
    _no_build(monkeypatch)
    assert run_cli("plan", TINY, "--budget", "12 parsecs") == 2
    err = capsys.readouterr().err
    assert err.startswith("deepsolve plan: error: --budget") and "12 parsecs" in err
    assert err.count("\n") == 1
    assert run_cli("check", TINY, "--device", "tpu") == 2
    err = capsys.readouterr().err
    assert err.startswith("deepsolve check: error: --device tpu") and err.count("\n") == 1
    assert run_cli("check", TINY, "--set", "stepz=4") == 2
    assert "did you mean steps?" in capsys.readouterr().err


def test_resume_with_changed_settings(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", TINY, "--out", out, "--iterations", 3, "--quiet",
                   "--set", "extra=2") == 0
    capsys.readouterr()
    # a shape setting that cannot work: one line naming the change, no traceback
    rc = run_cli("train", TINY, "--out", out, "--iterations", 6, "--quiet", "--resume",
                 "--set", "extra=3")
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "extra 2 -> 3" in err
    # a change that still loads: a warning listing it, and the run goes on
    rc = run_cli("train", TINY, "--out", out, "--iterations", 6, "--quiet", "--resume",
                 "--set", "extra=2", "--set", "true_rate=0.5")
    err = capsys.readouterr().err
    assert rc == 0
    warned = [ln for ln in err.splitlines() if "differ" in ln]
    assert len(warned) == 1 and "true_rate 0.8 -> 0.5" in warned[0]
    assert read_log(out / "log.h5").n_rows == 6
    # more iterations alone is no change worth a warning
    rc = run_cli("train", TINY, "--out", out, "--iterations", 7, "--quiet", "--resume",
                 "--set", "extra=2", "--set", "true_rate=0.5")
    assert rc == 0 and "differ" not in capsys.readouterr().err


def test_version(capsys):
    import deepsolve

    with pytest.raises(SystemExit) as e:
        run_cli("--version")
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"deepsolve {deepsolve.__version__}"


def test_an_lbfgs_iteration_tracks_one_loss_evaluation_at_a_time(tmp_path):
    """L-BFGS evaluates the loss several times per iteration, one after the other: the
    tracked peak is the largest of them (each under the budget), not their sum."""
    out = tmp_path / "run"
    budget = 48 * 1024
    problem = os.path.join(ROOT, "problems", "burgers_assimilation.py")
    assert run_cli("train", problem, "--out", out, "--iterations", 2, "--quiet", "--budget",
                   budget, "--set", "steps=60", "--set", "n=32", "--set", "lbfgs_iters=5") == 0
    log = read_log(out / "log.h5")
    assert np.all(log.columns["recorded"] >= 3 * 60)   # several evaluations per iteration
    tracked = log.columns["peak_tracked_memory"]
    assert np.all(tracked > 0) and np.all(tracked <= budget), tracked


def test_a_finished_run_is_freed(tmp_path):
    """A run's context (its model, data and bound steps) is freed when ``train`` returns:
    nothing deepsolve caches per step (the dispatch cost, what ``compile="auto"`` has seen, a
    parked measuring thread of the budget's profile) keeps it, so a process that trains many
    times holds one run's memory, not all of them."""
    import gc

    from deepsolve.problem import Context

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, Context) for o in gc.get_objects())

    before = alive()
    for k in range(2):
        assert run_cli("train", TINY, "--out", tmp_path / f"run{k}", "--iterations", 3,
                       "--quiet", "--budget", "1MiB") == 0
    assert alive() <= before


def test_an_evaluation_splits_into_numbers_and_curves():
    """evaluate()'s values: numbers become metric columns, deepsolve.Curve values curves
    (integer steps, as many values, thinned evenly to CURVE_WIDTH with both ends kept);
    anything else is a one-line ProblemError naming the metric."""
    from deepsolve.io import CURVE_WIDTH
    from deepsolve.training.rows import log_evaluation_curves, split_evaluation

    numbers, curves = split_evaluation({"e": torch.tensor(0.25), "n": 3,
                                        "c": deepsolve.Curve(range(2000), np.arange(2000.0))})
    assert numbers == {"e": 0.25, "n": 3.0} and list(curves) == ["c"]

    class Log:
        got = {}

        def append_curve(self, name, it, steps, values):
            self.got[name] = (it, steps, values)

    log = Log()
    log_evaluation_curves(log, 7, curves)
    it, steps, values = log.got["eval_c"]
    assert it == 7 and len(steps) == CURVE_WIDTH and steps[0] == 0 and steps[-1] == 1999
    assert np.array_equal(values, steps.astype(float))
    for bad, match in (({"c": deepsolve.Curve([0, 1], [1.0])}, "'c' needs integer steps"),
                       ({"c": deepsolve.Curve([0.5], [1.0])}, "'c' needs integer steps"),
                       ({"m": "high"}, "metric 'm' must be a number or a deepsolve.Curve")):
        with pytest.raises(ProblemError, match=match):
            split_evaluation(bad)
