"""A run directory the trainer can always continue: runs stopped before their first restart
file, one writer at a time, readers that do not block a resume, restart files that do not
fit the run, full disks, stale temporaries, 0-byte logs, settings out of range."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deepsolve.cli import main
from deepsolve.io import read_log

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = str(HERE / "data" / "tiny_problem.py")
GATED = str(HERE / "data" / "gated_problem.py")


def cli(*args) -> int:
    return main([str(a) for a in args])


def train(out, *extra) -> int:
    return cli("train", TINY, "--out", out, "--quiet", *extra)


def one_line_error(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"deepsolve {command}: error:")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0].strip(), err
    return lines[0]


def iterations(out) -> list[int]:
    return read_log(Path(out) / "log.h5").columns["iteration"].tolist()


def _wait_for(path, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"the trainer ended (rc {proc.returncode}): "
                                 f"{proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


def _gated(out, gate, gate_at, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "deepsolve", "train", GATED, "--out", str(out), "--quiet",
         "--set", f"gate={gate}", "--set", f"gate_at={gate_at}", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------- stopped before a restart file


def test_a_run_stopped_before_its_first_restart_file_resumes_from_zero(tmp_path, capsys):
    """A log but no restart.pt: --resume said "no restart file", a fresh start "already
    holds a run". Now --resume starts at iteration 0 and a fresh start starts over; both
    replace the log (no duplicate rows) and say so in one line."""
    out = tmp_path / "run"
    assert train(out, "--iterations", 5, "--set", "checkpoint_every=100") == 0
    (out / "restart.pt").unlink()            # as if killed before its first restart file
    capsys.readouterr()
    assert train(out, "--iterations", 8, "--resume") == 0
    err = capsys.readouterr().err
    assert "holds no restart file" in err and "starting from iteration 0" in err
    assert iterations(out) == list(range(8))
    (out / "restart.pt").unlink()
    assert train(out, "--iterations", 6) == 0
    assert "starting the run over" in capsys.readouterr().err
    assert iterations(out) == list(range(6))


def test_a_zero_byte_or_never_flushed_log_is_no_obstacle(tmp_path, capsys):
    """A 0-byte log.h5 ("no space" at creation) or one whose writer stopped before the
    log's first complete flush, without a restart file: both a fresh start and --resume
    work."""
    for i, resume in enumerate(((), ("--resume",))):
        out = tmp_path / f"zero{i}"
        out.mkdir()
        (out / "log.h5").write_bytes(b"")
        assert train(out, "--iterations", 3, *resume) == 0, capsys.readouterr().err
        assert iterations(out) == [0, 1, 2]
    legacy = textwrap.dedent("""
        import os, signal, sys, h5py
        f = h5py.File(sys.argv[1], "w", libver="latest")
        f.attrs["schema_version"] = 1
        f.create_dataset("iteration", shape=(0,), maxshape=(None,), dtype="i8", chunks=(1024,))
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    for i, resume in enumerate(((), ("--resume",))):
        out = tmp_path / f"legacy{i}"
        out.mkdir()
        r = subprocess.run([sys.executable, "-c", legacy, str(out / "log.h5")], timeout=120)
        assert r.returncode == -signal.SIGKILL
        assert train(out, "--iterations", 3, *resume) == 0, capsys.readouterr().err
        assert iterations(out) == [0, 1, 2]


def test_sigterm_while_the_run_is_set_up(tmp_path, capsys):
    """A SIGTERM while the problem is being built (before any iteration): the trainer
    stops before its first iteration with a restart file at iteration 0, exit 75, and
    --resume trains the whole run."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _gated(out, gate, 0, "--iterations", "5", "--set", "gate_build=true")
    try:
        _wait_for(f"{gate}.waiting", proc)
        proc.send_signal(signal.SIGTERM)
        gate.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "stopped by a signal before its first iteration" in err, err
    assert "iteration -1" not in err, err
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 0
    assert cli("train", GATED, "--out", out, "--quiet", "--iterations", 5, "--resume") == 0
    assert iterations(out) == list(range(5))


# ------------------------------------------------------------------------------ Ctrl-C


def _stop(proc, gate):
    gate.touch()
    try:
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)


def test_ctrl_c_finishes_the_iteration_and_writes_a_restart_file(tmp_path):
    """SIGINT used to end the run at once ("interrupted", rc 130) with the log's rows but no
    restart file: up to checkpoint_every - 1 iterations lost, and --resume started over.
    Now it is handled like SIGTERM: the iteration in progress finishes, the restart file
    follows the log's rows, exit code 130, and --resume continues."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _gated(out, gate, 4, "--iterations", "9", "--set", "checkpoint_every=100")
    _wait_for(f"{gate}.waiting", proc)
    proc.send_signal(signal.SIGINT)                  # inside iteration 4
    err = _stop(proc, gate)
    assert proc.returncode == 130, err
    assert "press Ctrl-C again to stop at once" in err
    assert f"interrupted after iteration 4; restart file {out / 'restart.pt'} (iteration 5)" \
        in err, err
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 5
    assert iterations(out) == list(range(5))
    assert cli("train", GATED, "--out", out, "--quiet", "--iterations", 9, "--resume") == 0
    assert iterations(out) == list(range(9))


def test_a_second_ctrl_c_stops_at_once_and_the_run_still_resumes(tmp_path):
    """The second Ctrl-C ends the process at once (SIGINT's default action): what it leaves
    is what a kill leaves, a log and a restart file that belong together."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _gated(out, gate, 4, "--iterations", "9", "--set", "checkpoint_every=3")
    _wait_for(f"{gate}.waiting", proc)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:   # the handler has run once
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    err = _stop(proc, gate)
    assert proc.returncode == -signal.SIGINT
    assert err.count("press Ctrl-C again to stop at once") == 1, err   # the first one's note
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 3
    assert iterations(out)[:3] == [0, 1, 2]
    assert cli("train", GATED, "--out", out, "--quiet", "--iterations", 9, "--resume") == 0
    assert iterations(out) == list(range(9))
    assert sorted(p.name for p in out.iterdir()) == ["log.h5", "restart.pt"]


def test_ctrl_c_while_the_run_is_set_up_leaves_nothing(tmp_path):
    """Before the first iteration there is nothing to save: one line, exit code 130, and the
    run directory the start made is gone (no empty log, no restart file at iteration 0)."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _gated(out, gate, 0, "--iterations", "5", "--set", "gate_build=true")
    _wait_for(f"{gate}.waiting", proc)
    proc.send_signal(signal.SIGINT)
    err = _stop(proc, gate)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["deepsolve train: interrupted"], err
    assert not out.exists()


def test_ctrl_c_while_deepsolve_is_imported_is_one_line(tmp_path):
    """A Ctrl-C while `python -m deepsolve` imports torch printed a 15-47 line traceback.

    The signal is sent once torch's library is mapped. So that it lands inside the import
    however loaded the machine is (the rest of torch's import takes about a second, which a
    busy machine may let pass before this process looks again), the child imports torch's
    submodules slowly: a ``sitecustomize`` puts a finder in front of Python's that waits
    10 ms before each ``torch.*`` module and then lets the real finders find it."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\n"
        "class _Slow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('torch.'):\n"
        "            time.sleep(0.01)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Slow())\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    # a terminal's Ctrl-C: SIGINT not ignored in the child, even where this suite runs as a
    # background job (which the shell starts with SIGINT ignored, inherited by every child)
    proc = subprocess.Popen([sys.executable, "-m", "deepsolve", "--version"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:       # inside deepsolve/__init__: torch is loading
            try:
                if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                    break
            except OSError:
                pass
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip() == "deepsolve: interrupted", err


# ----------------------------------------------------------- nothing to resume, nothing made


def test_resume_without_a_run_is_one_line_and_makes_nothing(tmp_path, capsys):
    """--resume with a mistyped --out said "holds no restart file ... starting from iteration
    0" and trained a new run there."""
    nowhere = tmp_path / "typo"
    assert train(nowhere, "--iterations", 2, "--resume") == 2
    msg = one_line_error(capsys)
    assert f"--resume: {nowhere} does not exist" in msg and "without --resume" in msg
    assert not nowhere.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(empty, "--iterations", 2, "--resume") == 2
    msg = one_line_error(capsys)
    assert f"--resume: {empty} holds no run to resume" in msg and "without --resume" in msg
    assert not list(empty.iterdir())
    assert train(empty, "--iterations", 2) == 0            # a fresh run is asked without it
    assert iterations(empty) == [0, 1]


def test_a_budget_error_at_the_first_iteration_leaves_no_run_directory(tmp_path, capsys):
    """--budget 100KiB on the demo left a run directory with an empty log.h5."""
    out = tmp_path / "run"
    assert train(out, "--iterations", 2, "--budget", "100B") == 2
    assert "below the minimum" in one_line_error(capsys)
    assert not out.exists()
    out.mkdir()                                  # the user's own directory: kept, left empty
    (out / "notes.txt").write_text("mine")
    assert train(out, "--iterations", 2, "--budget", "100B", "--tensorboard") == 2
    one_line_error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_trainer_that_loses_the_lock_does_not_remove_the_winners_directory(tmp_path,
                                                                           monkeypatch, capsys):
    """Two trainers started at the same instant on a new --out: both saw no directory, the
    one refused by the lock removed the winner's (still empty, locked) directory, and the
    winner then failed to create its log. Here another process takes the lock just before
    this trainer's flock: this trainer is refused and leaves the directory alone."""
    import fcntl

    out = tmp_path / "run"
    holder = None
    real = fcntl.flock

    def flock(fd, op):
        nonlocal holder
        if holder is None and op & fcntl.LOCK_EX:
            holder = subprocess.Popen(
                [sys.executable, "-c", "import fcntl, os, sys, time\n"
                 "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                 "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\n"
                 "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
            assert holder.stdout.readline().strip() == "locked"
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        assert train(out, "--iterations", 2) == 2
        assert "another trainer" in one_line_error(capsys)
        assert out.is_dir()                      # the winner's directory is still there
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=30)
            holder.stdout.close()
    monkeypatch.setattr(fcntl, "flock", real)
    assert train(out, "--iterations", 2) == 0
    assert iterations(out) == [0, 1]


def test_a_directory_removed_before_it_is_locked_is_made_again(tmp_path, monkeypatch):
    """A failed start removes the directory it made; a trainer that had opened it in the
    meantime must not lock the removed directory and then fail to write its log."""
    from deepsolve.training.rundir import RunLock

    out = tmp_path / "run"
    real = RunLock.__init__
    calls = []

    def init(self, run_dir, locking):
        calls.append(run_dir)
        real(self, run_dir, locking)
        if len(calls) == 1:                      # removed under the first lock taken
            os.rmdir(run_dir)

    monkeypatch.setattr(RunLock, "__init__", init)
    assert train(out, "--iterations", 2) == 0
    assert len(calls) == 2 and iterations(out) == [0, 1]


# ------------------------------------------------------------------------- one writer


def test_one_writer_per_run_directory(tmp_path, capsys):
    """A second trainer on the same --out gets a one-line error at once (with or without
    --resume); the lock dies with its holder, so a SIGKILLed run resumes at once."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = _gated(out, gate, 4, "--iterations", "9", "--set", "checkpoint_every=3")
    try:
        _wait_for(f"{gate}.waiting", proc)
        for extra in ((), ("--resume",)):
            t0 = time.monotonic()
            assert cli("train", GATED, "--out", out, "--quiet", "--iterations", 9, *extra) == 2
            msg = one_line_error(capsys)
            assert f"another trainer (pid {proc.pid}) is writing this run directory" in msg
            assert time.monotonic() - t0 < 30
        assert iterations(out) == [0, 1, 2]       # the first writer's log is untouched
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert cli("train", GATED, "--out", out, "--quiet", "--iterations", 9, "--resume") == 0
    assert iterations(out) == list(range(9))
    assert sorted(p.name for p in out.iterdir()) == ["log.h5", "restart.pt"]


HOLDER = """
import sys, time, h5py
f = h5py.File(sys.argv[1], "r")                # holds HDF5's shared lock on the log
print("open", flush=True)
time.sleep(120)
"""


def test_a_reader_does_not_make_a_resume_fail(tmp_path):
    """A reader holding the log open (HDF5's shared lock) made --resume fail with a lock
    error after 5 s."""
    out = tmp_path / "run"
    assert train(out, "--iterations", 3) == 0
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER),
                             str(out / "log.h5")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        assert train(out, "--iterations", 6, "--resume") == 0
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert iterations(out) == list(range(6))


# ------------------------------------------------------------------ restart files checked


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 6 iterations: restart.pt at 6 and a log of 6 rows."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(out, "--iterations", 6, "--set", "checkpoint_every=3") == 0
    return out


def _copy(finished, tmp_path, change=None) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    if change is not None:
        state = torch.load(out / "restart.pt", weights_only=True)
        state = change(state)
        torch.save(state, out / "restart.pt")
    return out


def _set(key, value):
    def change(state):
        state[key] = value
        return state
    return change


def _drop(key):
    def change(state):
        del state[key]
        return state
    return change


def _model(fn):
    def change(state):
        fn(state["model"])
        return state
    return change


def _rng(state):
    state["rng"]["torch"] = torch.zeros(10, dtype=torch.uint8)
    return state


def _np_rng(index, value):
    def change(state):
        state["rng"]["numpy"][index] = value
        return state
    return change


def _py_rng(index, value):
    def change(state):
        state["rng"]["python"][index] = value
        return state
    return change


def _opt_groups(state):
    state["optimizer"]["param_groups"] = []
    return state


def _group(key, value):
    def change(state):
        state["optimizer"]["param_groups"][0][key] = value
        return state
    return change


def _opt_state(key, value):
    def change(state):
        state["optimizer"]["state"][0][key] = value
        return state
    return change


def _opt_shape(state):
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    return state


BAD_RESTARTS = [
    ("missing model key", _model(lambda m: m.pop("rate")), "the model state has missing rate"),
    ("extra model key", _model(lambda m: m.update(extra=torch.zeros(1))), "unexpected extra"),
    ("model shape", _model(lambda m: m.update(rate=torch.zeros(3))),
     r"shape rate \(3,\) in the restart, \(\) in the model"),
    ("wrong rng", _rng, "'rng.torch' holds 10 bytes, not the 5056"),
    ("no model", _drop("model"), "not a complete restart file: no 'model'"),
    ("no rng", _drop("rng"), "no 'rng'"),
    ("no optimizer", _drop("optimizer"), "no 'optimizer'"),
    ("model not a dict", _set("model", 3), "'model' is a int, not a dict"),
    ("rng not a dict", _set("rng", [1, 2]), "'rng' is a list, not a dict"),
    ("optimizer groups", _opt_groups, "state for parameter 0, which no parameter group holds"),
    ("optimizer moments", _opt_shape,
     r"parameter 0 has moments of different shapes \(exp_avg \(3,\), exp_avg_sq \(\)\)"),
    ("negative iteration", _set("iteration", -5), "'iteration' is -5"),
    ("string iteration", _set("iteration", "3"), "'iteration' is str 3, not an integer"),
    ("iteration past the log", _set("iteration", 9), "is at iteration 9 but .* has 6 rows"),
    ("iteration past the run", _set("iteration", 10**9), "past iterations=12"),
    ("zero iteration with a trained optimizer", _set("iteration", 0),
     "the optimizer has taken 6 steps"),
    ("not a dict", lambda s: [1, 2, 3], "not a restart file"),
    # tampered optimizer and model states (resumed silently, or 40-line tracebacks)
    ("negative lr", _group("lr", -0.02), "the optimizer's lr in parameter group 0 is -0.02, "
                                         "negative"),
    ("string lr", _group("lr", "fast"), "lr in parameter group 0 is str 'fast', not a number"),
    ("betas out of range", _group("betas", (-1, 2)), r"betas in parameter group 0 is \(-1, 2\)"),
    ("nan eps", _group("eps", float("nan")), "eps in parameter group 0 is nan, not a finite"),
    ("negative adam step", _opt_state("step", torch.tensor(-3.0)),
     "step of parameter 0 is negative"),
    ("negative second moment", _opt_state("exp_avg_sq", torch.tensor(-1.0)),
     "exp_avg_sq of parameter 0 is negative"),
    ("nan moment", _opt_state("exp_avg", torch.tensor(float("nan"))),
     "exp_avg of parameter 0 is not finite"),
    ("unknown parameter", _group("params", [7]), "state for parameter 0, which no parameter"),
    ("unknown parameter with its state",
     lambda s: _group("params", [7])({**s, "optimizer": {**s["optimizer"], "state": {
         7: s["optimizer"]["state"][0]}}}), "parameter mapping 7 is not the optimizer's 0"),
    ("nan model", _model(lambda m: m.update(rate=torch.tensor(float("nan")))),
     "the model state's rate holds NaN"),
    # every field checked when the file is read, before anything is changed (a config of
    # '{' and a numpy RNG position of -1 were resumed from)
    ("config not JSON", _set("config", "{"), "'config' is not JSON"),
    ("config not an object", _set("config", "[1, 2]"), "'config' is a JSON list"),
    ("numpy rng pos -1", _np_rng(2, -1), r"'rng.numpy' pos is -1, not in 0..624"),
    ("numpy rng pos 625", _np_rng(2, 625), r"'rng.numpy' pos is 625, not in 0..624"),
    ("numpy rng short key", _np_rng(1, torch.zeros(5, dtype=torch.int64)),
     r"'rng.numpy' key is a torch.int64 tensor of shape \(5,\), not 624"),
    ("numpy rng key out of range", _np_rng(1, torch.full((624,), 2**32)),
     r"'rng.numpy' key has values outside \[0, 2\*\*32\)"),
    ("numpy rng name", _np_rng(0, "PCG64"), "'rng.numpy' names the generator 'PCG64'"),
    ("numpy rng gauss", _np_rng(4, float("nan")), "'rng.numpy' gauss is nan"),
    ("numpy rng not a list", lambda s: _set("rng", {**s["rng"], "numpy": 5})(s),
     "'rng.numpy' is int 5"),
    ("python rng position", _py_rng(-2, 700), r"'rng.python' position is 700, not in 0..624"),
    ("python rng version", _py_rng(-1, 2), "'rng.python' version is 2, not 3"),
    ("python rng word", _py_rng(0, -1), r"'rng.python' has state words outside \[0, 2\*\*32\)"),
    ("generator state dtype", lambda s: _set("rng", {**s["rng"], "generator": torch.zeros(
        5056)})(s), "'rng.generator' is a torch.float32 tensor"),
    ("cuda state", lambda s: _set("rng", {**s["rng"], "cuda": [3]})(s),
     r"'rng.cuda\[0\]' is a int, not a uint8 tensor"),
    ("nan elapsed", _set("elapsed", float("nan")), "'elapsed' is nan, not a finite number"),
    ("negative elapsed", _set("elapsed", -1.0), "'elapsed' is -1.0, not a finite number"),
    ("bad sha", _set("problem_sha256", "abc"), "'problem_sha256' is 'abc', not a SHA-256"),
    ("unknown stop reason", _set("stopped", "bored"), "'stopped' is 'bored', not a reason"),
    ("target without its level", lambda s: _set("stopped_by", "loss:x")(
        _set("stopped", "target loss 1e-3 <= 0.01")(s)), "'stopped_by' is 'loss:x'"),
    ("model entry not a tensor", _model(lambda m: m.update(rate="0.5")),
     "'model' entry 'rate' is a str, not a tensor"),
    ("parameter named twice", _group("params", [0, 0]), "'optimizer' names parameter 0 twice"),
    ("step of many counts", _opt_state("step", torch.zeros(3)),
     r"'optimizer' step of parameter 0 is a tensor of shape \(3,\)"),
    ("scheduler epoch", _set("scheduler", {"last_epoch": -5}),
     "'scheduler' last_epoch is -5, not an integer >= -1"),
]


@pytest.mark.parametrize("name,change,match", BAD_RESTARTS, ids=[b[0] for b in BAD_RESTARTS])
def test_restart_files_that_do_not_fit_give_one_line(finished, tmp_path, capsys, name, change,
                                                     match):
    """Loadable but wrong restart files ended in tracebacks, or deleted log rows on the
    strength of their iteration (-5: all 12 rows; 0: re-logged with the iteration-12
    model). Now: one line naming what does not fit, and the log is left as it was."""
    import re

    out = _copy(finished, tmp_path, change)
    before = (out / "log.h5").read_bytes()
    restart = (out / "restart.pt").read_bytes()
    names = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert train(out, "--iterations", 12, "--resume") == 2
    msg = one_line_error(capsys)
    assert re.search(match, msg), msg
    assert "restart.pt" in msg
    assert (out / "log.h5").read_bytes() == before
    assert (out / "restart.pt").read_bytes() == restart
    assert sorted(p.name for p in out.iterdir()) == names
    assert iterations(out) == list(range(6))


@pytest.mark.parametrize("name,change,match", [
    ("config", _set("config", "{"), "'config' is not JSON"),
    ("numpy pos", _np_rng(2, -1), r"'rng.numpy' pos is -1, not in 0..624"),
    ("elapsed", _set("elapsed", float("inf")), "'elapsed' is inf"),
    ("optimizer step", _opt_state("step", torch.tensor(-1.0)), "step of parameter 0 is negative"),
], ids=["config", "numpy pos", "elapsed", "optimizer step"])
def test_a_restart_file_is_checked_whole_when_it_is_read(finished, tmp_path, name, change,
                                                         match):
    """load_restart itself refuses a tampered field, before any run is built or file
    touched: one line naming the field and the file, saying what to do."""
    from deepsolve.training.restart import RestartError, load_restart

    out = _copy(finished, tmp_path, change)
    with pytest.raises(RestartError, match=match) as e:
        load_restart(str(out / "restart.pt"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(out / "restart.pt"))
    assert "move it away to start the run over" in msg
    assert load_restart(str(_copy(finished, tmp_path / "good") / "restart.pt"))["iteration"] == 6


def test_garbage_restart_file(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    (out / "restart.pt").write_bytes(os.urandom(300))
    assert train(out, "--iterations", 12, "--resume") == 2
    assert "cannot read the restart file" in one_line_error(capsys)
    assert iterations(out) == list(range(6))


def test_a_fifo_named_restart_pt_is_refused_before_it_is_opened(finished, tmp_path, capsys):
    """A FIFO named restart.pt hung --resume in open(), holding the directory lock."""
    out = _copy(finished, tmp_path)
    (out / "restart.pt").unlink()
    os.mkfifo(out / "restart.pt")
    assert train(out, "--iterations", 12, "--resume") == 2
    msg = one_line_error(capsys)
    assert "restart.pt: not a regular file (a FIFO)" in msg
    assert iterations(out) == list(range(6))


def _tree(d: Path) -> dict[str, tuple[bool, bytes]]:
    return {p.name: (p.is_symlink(), p.read_bytes()) for p in sorted(d.iterdir())}


@pytest.mark.parametrize("name", ["log.h5", "restart.pt"])
def test_a_linked_log_or_restart_file_is_refused_before_anything_is_written(
        finished, tmp_path, capsys, name):
    """A log.h5 or restart.pt that is a symbolic link to the run's file kept elsewhere was
    read through the link on --resume, then os.replace put a regular file where the link
    was: the link's target stayed at 6 iterations, nothing said. Now refused in one line
    naming the file and why, with or without --resume, the link and its target unchanged;
    the file copied into the run directory, the run continues."""
    out = _copy(finished, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(out / name, elsewhere / name)
    (out / name).symlink_to(elsewhere / name)
    before, kept = _tree(out), _tree(elsewhere)
    capsys.readouterr()
    for extra in (("--resume",), ()):
        assert train(out, "--iterations", 12, *extra) == 2
        msg = one_line_error(capsys)
        assert f"{out / name} is a symbolic link (to {elsewhere / name})" in msg, msg
        assert "replaces its files atomically" in msg and "would replace the link" in msg
        assert f"copy the file into {out} instead of linking it" in msg, msg
        assert _tree(out) == before and _tree(elsewhere) == kept
    if name == "log.h5":   # a fresh start would replace the log, and the link: refused too
        (out / "restart.pt").rename(tmp_path / "restart.pt")
        assert train(out, "--iterations", 12) == 2
        assert "log.h5 is a symbolic link" in one_line_error(capsys)
        assert (out / name).is_symlink() and _tree(elsewhere) == kept
        (tmp_path / "restart.pt").rename(out / "restart.pt")
    (out / name).unlink()
    shutil.copy(elsewhere / name, out / name)
    assert train(out, "--iterations", 8, "--resume") == 0
    assert iterations(out) == list(range(8)) and _tree(elsewhere) == kept


def test_a_linked_run_directory_is_written_through(finished, tmp_path):
    """A run directory that is itself a link (``runs/navier_stokes-latest`` of make demo):
    the files are replaced inside the directory it points to, the link stays."""
    real = _copy(finished, tmp_path)
    link = tmp_path / "latest"
    link.symlink_to(real.name)
    assert train(link, "--iterations", 8, "--resume") == 0
    assert link.is_symlink() and iterations(real) == list(range(8))
    assert not (real / "log.h5").is_symlink() and not (real / "restart.pt").is_symlink()


def test_a_log_with_iterations_out_of_order_is_refused_saying_which(finished, tmp_path,
                                                                     capsys):
    """A log with iterations 0,1,2,2,4,5 beside restart.pt at 6 was refused as "log.h5 has 6
    rows (iterations 0..5), not iterations 0..5". The message now names the first offending
    rows: the repeated iteration and the missing one."""
    import h5py

    out = _copy(finished, tmp_path)
    with h5py.File(out / "log.h5", "r+") as f:
        f["iteration"][3] = 2
    before = _tree(out)
    capsys.readouterr()
    assert train(out, "--iterations", 12, "--resume") == 2
    msg = one_line_error(capsys)
    assert f"{out / 'restart.pt'} is at iteration 6 but {out / 'log.h5'} has 6 rows whose " \
        "iterations are not 0..5 in order (iteration 2 appears twice, at rows 2 and 3; " \
        "iteration 3 is missing)" in msg, msg
    assert "not iterations 0..5" not in msg, msg
    assert _tree(out) == before


@pytest.mark.parametrize("rows,k,want", [
    ([0, 1, 2, 3], 6, "4 rows (iterations 0..3), not iterations 0..5"),
    ([], 3, "no rows, not iterations 0..2"),
    (None, 3, "no log, not iterations 0..2"),
    ([0, 1, 2, 3, 4, 5, 6], 6, None),
    ([0, 2, 1, 3], 4, "4 rows whose iterations are not 0..3 in order (row 1 holds iteration 2)"),
    ([0, 1, 1, 1], 4, "4 rows whose iterations are not 0..3 in order (iteration 1 appears 3 "
     "times, at rows 1, 2 and 3; iteration 2 is missing)"),
    ([0, 1, 2, 7, 8], 5, "5 rows whose iterations are not 0..4 in order (iteration 3 is "
     "missing)"),
    ([0, 1, 1], 5, "3 rows whose iterations are not 0..4 in order (iteration 1 appears "
     "twice, at rows 1 and 2; iteration 2 is missing)"),
])
def test_what_keeps_a_log_from_its_restart_file(rows, k, want):
    from deepsolve.training.rundir import _rows_mismatch

    assert _rows_mismatch(None if rows is None else np.array(rows, np.int64), k) == want


TWO_SCALARS = """
import torch
import deepsolve

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.3))
        self.b = torch.nn.Parameter(torch.tensor(-0.7))

class P(deepsolve.Problem):
    defaults = {"iterations": 6, "lr": 0.05, "checkpoint_every": 3}

    def build(self, ctx):
        ctx.model = M().to(ctx.dtype)

    def residuals(self, ctx, iteration):
        m = ctx.model
        return {"fit": (m.a - 1) ** 2 + 3 * (m.b + 2) ** 2}

problem = P()
"""


def test_a_permuted_parameter_mapping_is_refused(tmp_path, capsys):
    """Swapped ids in the optimizer's param_groups (two parameters of the same shape) gave
    each parameter the other's Adam moments: the run resumed with different losses."""
    prob = tmp_path / "two.py"
    prob.write_text(TWO_SCALARS)
    out = tmp_path / "run"
    assert cli("train", prob, "--out", out, "--quiet", "--iterations", 3) == 0
    state = torch.load(out / "restart.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["params"] == [0, 1]
    state["optimizer"]["param_groups"][0]["params"] = [1, 0]
    torch.save(state, out / "restart.pt")
    capsys.readouterr()
    assert cli("train", prob, "--out", out, "--quiet", "--iterations", 6, "--resume") == 2
    msg = one_line_error(capsys)
    assert "restart.pt does not match this run: the optimizer state's parameter mapping 1, 0 " \
           "is not the optimizer's 0, 1" in msg
    assert iterations(out) == [0, 1, 2]


def test_a_changed_or_different_problem_file(finished, tmp_path, capsys):
    """A modified problem file whose model still fits resumes with a one-line warning
    naming both hashes; a different problem (another model) is refused with one line that
    names what does not match and the recorded hash."""
    import hashlib

    out = _copy(finished, tmp_path)
    recorded = torch.load(out / "restart.pt", weights_only=True)["problem_sha256"]
    assert recorded == hashlib.sha256(Path(TINY).read_bytes()).hexdigest()
    changed = tmp_path / "tiny_changed.py"
    changed.write_text(Path(TINY).read_text() + "\n# a comment changes the hash\n")
    capsys.readouterr()
    assert cli("train", changed, "--out", out, "--quiet", "--iterations", 8, "--resume") == 0
    err = capsys.readouterr().err
    warning = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warning) == 1 and f"recorded sha256 {recorded}" in warning[0], err
    assert iterations(out) == list(range(8))

    out2 = _copy(finished, tmp_path / "b")
    other = tmp_path / "other.py"
    other.write_text(textwrap.dedent("""
        import torch
        import deepsolve

        class Other(deepsolve.Problem):
            defaults = {"iterations": 12}

            def build(self, ctx):
                ctx.model = torch.nn.Linear(2, 1).to(ctx.dtype)

            def residuals(self, ctx, iteration):
                return {"w": ctx.model.weight.pow(2).sum()}

        problem = Other()
    """))
    assert cli("train", other, "--out", out2, "--quiet", "--resume") == 2
    msg = one_line_error(capsys)
    assert "missing weight, bias" in msg and "unexpected rate" in msg
    assert f"written for a problem file with sha256 {recorded}" in msg
    assert iterations(out2) == list(range(6))


# ------------------------------------------------------------------ full disks, temporaries


def test_a_full_disk_leaves_no_restart_temporary(tmp_path, monkeypatch, capsys):
    """ENOSPC while writing restart.pt: the temporary file is removed, the previous restart
    file stays, the error is one line; the run then resumes from that restart file."""
    out = tmp_path / "run"
    real = torch.save
    calls = {"n": 0}

    def full(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:                   # the second restart file
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    assert train(out, "--iterations", 6, "--set", "checkpoint_every=3") == 2
    msg = one_line_error(capsys)
    assert "cannot write the restart file at iteration 6 (No space left on device)" in msg
    assert "the previous restart file is intact" in msg
    assert sorted(p.name for p in out.iterdir()) == ["log.h5", "restart.pt"]
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 3
    monkeypatch.setattr(torch, "save", real)
    assert train(out, "--iterations", 6, "--resume") == 0
    assert iterations(out) == list(range(6))


def test_stale_temporaries_are_removed_at_the_next_start(tmp_path):
    from deepsolve.train import remove_stale_temporaries

    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        d = tmp_path / "d"
        d.mkdir()
        for name in (f"restart.pt.tmp-{dead.pid}", f"log.h5.tmp-{dead.pid}",
                     f"restart.pt.tmp-{live.pid}", "notes.txt"):
            (d / name).write_bytes(b"x")
        removed = remove_stale_temporaries(str(d))
        assert sorted(removed) == sorted([f"restart.pt.tmp-{dead.pid}", f"log.h5.tmp-{dead.pid}"])
        assert sorted(p.name for p in d.iterdir()) == ["notes.txt", f"restart.pt.tmp-{live.pid}"]
    finally:
        live.kill()
        live.wait()
    out = tmp_path / "run"
    assert train(out, "--iterations", 3) == 0
    for name in (f"restart.pt.tmp-{dead.pid}", f"restart.pt.tmp-{live.pid}", "log.h5.tmp-1"):
        (out / name).write_bytes(b"stale")
    assert train(out, "--iterations", 4, "--resume") == 0   # holds the lock: all are stale
    assert sorted(p.name for p in out.iterdir()) == ["log.h5", "restart.pt"]


# ------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("setting,match", [
    ("grad_clip=-1", "grad_clip=-1.0 is out of range: grad_clip must be >= 0"),
    ("grad_clip=nan", "grad_clip=nan is not a finite number"),
    ("lr=-0.1", "lr=-0.1 is out of range"),
    ("checkpoint_every=0", "checkpoint_every=0 is out of range: checkpoint_every must be >= 1"),
    ("memory_every=-2", "memory_every=-2 is out of range"),
    ("eval_every=-1", "eval_every=-1 is out of range"),
    ("steps=-3", "steps=-3 is out of range"),
])
def test_settings_out_of_range_are_refused(tmp_path, capsys, setting, match):
    """--set grad_clip=-1 was accepted and flipped the gradient."""
    out = tmp_path / "run"
    assert train(out, "--iterations", 2, "--set", setting) == 2
    assert match in one_line_error(capsys)
    assert not out.exists()                  # nothing was made for an invalid run


def test_an_invalid_problem_leaves_no_run_directory(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import deepsolve\nclass P(deepsolve.Problem):\n"
                   "    def build(self, ctx):\n        ctx.model = 3\n"
                   "    def residuals(self, ctx, it):\n        return {}\nproblem = P()\n")
    out = tmp_path / "run"
    assert cli("train", bad, "--out", out, "--quiet") == 2
    assert "must set ctx.model" in one_line_error(capsys)
    assert not out.exists()


GOOD_BUILD = "        ctx.model = torch.nn.Linear(1, 1)\n"
CRASHING_BUILD = "        raise RuntimeError('the mesh file is missing')\n"


def _problem(path: Path, build_body: str = GOOD_BUILD, head: str = "") -> Path:
    path.write_text(head + "import torch\nimport deepsolve\n"
                    "class P(deepsolve.Problem):\n"
                    "    defaults = {'iterations': 2}\n"
                    "    def build(self, ctx):\n" + build_body +
                    "    def residuals(self, ctx, it):\n"
                    "        return {'w': (ctx.model.weight ** 2).sum()}\n"
                    "problem = P()\n")
    return path


@pytest.mark.slow
def test_a_crash_inside_build_leaves_no_run_directory(tmp_path):
    """A problem whose build raises (a bug, a missing file): the trainer's error, and the
    run directory it had made is gone, so the same command runs once the file is fixed."""
    path = _problem(tmp_path / "p.py", CRASHING_BUILD)
    out = tmp_path / "D"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "deepsolve", "train", str(path), "--out", str(out), "--quiet"]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "the mesh file is missing" in res.stderr
    assert not out.exists()
    _problem(path)                                          # fixed
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert iterations(out) == [0, 1]


def test_failures_before_training_leave_no_run_directory(tmp_path, capsys):
    """build raising, the problem file failing to import, an invalid configuration: no run
    directory afterwards (in-process); a directory that was there before is kept."""
    out = tmp_path / "D"
    crash = _problem(tmp_path / "crash.py", CRASHING_BUILD)
    with pytest.raises(RuntimeError, match="the mesh file is missing"):
        cli("train", crash, "--out", out, "--quiet")
    assert not out.exists()
    broken = _problem(tmp_path / "broken.py", head="import no_such_module_here\n")
    assert cli("train", broken, "--out", out, "--quiet") == 2
    assert "No module named 'no_such_module_here'" in one_line_error(capsys)
    assert not out.exists()
    good = _problem(tmp_path / "good.py")
    assert cli("train", good, "--out", out, "--quiet", "--set", "iterations=two") == 2
    assert "iterations=two" in one_line_error(capsys)
    assert not out.exists()
    out.mkdir()                                             # the user's own directory
    with pytest.raises(RuntimeError, match="the mesh file is missing"):
        cli("train", crash, "--out", out, "--quiet")
    assert out.is_dir() and not list(out.iterdir())         # kept, and left as it was
    assert cli("train", good, "--out", out, "--quiet") == 0
    assert iterations(out) == [0, 1]


def test_out_at_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert train(f, "--iterations", 1) == 2
    assert f"--out {f}: cannot make the run directory" in one_line_error(capsys)
    assert np.array_equal(f.read_text(), "x")


def test_two_ctrl_c_in_a_program_raise_keyboard_interrupt_and_keep_the_run(tmp_path):
    """Called from a program (a notebook), the second Ctrl-C raises KeyboardInterrupt rather
    than ending the process; the log and the restart file still belong together and the
    caller's SIGINT handler is back."""
    import threading

    from deepsolve.train import train as train_fn

    out, gate = tmp_path / "run", tmp_path / "gate"

    def press_twice():
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{gate}.waiting") and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
        gate.touch()

    before = signal.getsignal(signal.SIGINT)
    presser = threading.Thread(target=press_twice)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            train_fn(GATED, overrides={"iterations": 9}, out=str(out), quiet=True,
                     sets=[f"gate={gate}", "gate_at=4", "checkpoint_every=3"])
    finally:
        presser.join(timeout=120)
    assert signal.getsignal(signal.SIGINT) is before
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 3
    assert iterations(out)[:3] == [0, 1, 2]
    assert cli("train", GATED, "--out", out, "--quiet", "--iterations", 9, "--resume") == 0
    assert iterations(out) == list(range(9))


# ------------------------------------------------------------ signals while the process ends


SLOW_TEARDOWN = '''

# a slow teardown, for the tests of signals that arrive while the process ends
import atexit as _atexit
import time as _time

import deepsolve.distributed as _dist

_cleanup = _dist.cleanup


def _slow(where):
    mark = os.environ.get("SLOW_TEARDOWN_MARK", "")
    if os.environ.get("SLOW_TEARDOWN") == where and mark:
        with open(mark, "w") as f:
            f.write(where)
        end = _time.monotonic() + float(os.environ.get("SLOW_TEARDOWN_SECONDS", "3"))
        while _time.monotonic() < end:   # short sleeps: a signal's handler runs at once
            _time.sleep(0.05)


def _slow_cleanup(dist):   # after the run: its files closed, its signal handlers gone
    _slow("cleanup")
    _cleanup(dist)


if not getattr(_dist, "_slow_teardown", False):   # once, though the file is imported twice
    _dist._slow_teardown = True
    _dist.cleanup = _slow_cleanup
    _atexit.register(_slow, "atexit")   # the interpreter's exit
'''


def _slow_teardown(tmp_path, where, seconds, *args):
    prob = tmp_path / "slow_teardown.py"
    prob.write_text(Path(GATED).read_text() + SLOW_TEARDOWN)
    mark = tmp_path / "teardown"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SLOW_TEARDOWN=where,
               SLOW_TEARDOWN_MARK=str(mark), SLOW_TEARDOWN_SECONDS=str(seconds))
    # a terminal's Ctrl-C: SIGINT not ignored in the child (see the import test above)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepsolve", "train", str(prob), "--quiet", *map(str, args)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, mark


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["cleanup", "atexit"])
def test_sigterm_while_the_process_ends_leaves_the_runs_exit_code(tmp_path, where):
    """A SIGTERM after the last iteration, while the trainer tears down (``cleanup``: the
    run's files closed and its handlers given back; ``atexit``: the interpreter's exit),
    ended the process with -15. The run is complete: exit 0, no traceback."""
    out = tmp_path / "run"
    proc, mark = _slow_teardown(tmp_path, where, 3, "--out", out, "--iterations", 3)
    try:
        _wait_for(mark, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "trained 3 iterations" in stdout, (stdout, err)
    if where == "cleanup":
        assert "SIGTERM after the run ended" in err, err
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 3
    assert iterations(out) == [0, 1, 2]


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_while_the_process_ends_prints_no_traceback(tmp_path):
    """Two Ctrl-C 50 ms apart: the first stops the run after its iteration; the second,
    landing in an ``atexit`` callback while the process exited, printed "Exception ignored
    in atexit callback" and a KeyboardInterrupt traceback. It now ends the process at once
    with the run's exit code, 130, and prints nothing more."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc, mark = _slow_teardown(tmp_path, "atexit", 60, "--out", out, "--iterations", 4,
                                "--set", f"gate={gate}", "--set", "gate_at=1")
    try:
        _wait_for(f"{gate}.waiting", proc)
        proc.send_signal(signal.SIGINT)
        gate.touch()
        _wait_for(mark, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)   # at once, not after the 60 s of the callback
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "interrupted after iteration 1" in err, err
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == 2
    assert iterations(out) == [0, 1]
