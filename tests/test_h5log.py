"""deepsolve.io.h5log: block appends, SWMR reading, resume/truncate, crash safety, errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from deepsolve.io import H5Log, LogError, read_curves, read_log, to_pandas
from deepsolve.io import h5log as H
from deepsolve.io.log import files as F  # opening log files: locks, the superblock

ROOT = Path(__file__).resolve().parents[1]


def row(i: int, **extra) -> dict:
    r = {"iteration": i, "loss": 1.0 / (i + 1), "loss/pde": 0.5 / (i + 1), "time": 0.01,
         "advances": 3 * i, "schedule": "revolve", "metric/err": math.nan}
    r.update(extra)
    return r


def write_log(path: Path, n: int, **kw) -> None:
    with H5Log(path, **kw) as log:
        for i in range(n):
            log.append(row(i))


def run_py(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=120, **kw)


# ------------------------------------------------------------------------------ writing


def test_block_appends_and_layout(tmp_path):
    p = tmp_path / "log.h5"
    log = H5Log(p, block_rows=8, flush_seconds=1e9)
    for i in range(7):
        log.append(row(i))
    assert log._n == 0 and log.n_rows == 7          # buffered, nothing written yet
    log.append(row(7))
    assert log._n == 8 and log._buf == []            # one block of 8 rows
    for i in range(8, 13):
        log.append(row(i))
    assert log._n == 8
    log.close()
    log.close()                                      # idempotent
    with h5py.File(p, "r") as f:
        names = list(f)
        assert names[:3] == ["iteration", "loss", "loss.pde"]   # creation order, '/' -> '.'
        for k in f:
            d = f[k]
            assert d.shape == (13,) and d.maxshape == (None,) and d.chunks is not None
        assert f["iteration"].dtype == np.int64 and f["advances"].dtype == np.int64
        assert f["loss"].dtype == np.float64
        assert h5py.check_string_dtype(f["schedule"].dtype).encoding == "utf-8"
        assert f["loss.pde"].attrs["column"] == "loss/pde"
        assert f["time"].attrs["units"] == "s"
        assert f.attrs["schema_version"] == H.SCHEMA_VERSION
    d = read_log(p)
    assert d.n_rows == 13
    assert list(d.columns["iteration"]) == list(range(13))
    assert d.columns["loss/pde"][3] == pytest.approx(0.125)
    assert list(d.columns["schedule"]) == ["revolve"] * 13


def test_flush_seconds_triggers_a_flush(tmp_path):
    log = H5Log(tmp_path / "log.h5", block_rows=1000, flush_seconds=0.0)
    log.append(row(0))
    assert log._n == 1
    log.close()


def test_missing_values_and_scalar_types(tmp_path):
    p = tmp_path / "log.h5"
    with H5Log(p) as log:
        log.append(row(0, lr=np.float32(0.5)))
        log.append({"iteration": np.int64(1), "loss": np.float64(2.0)})   # most columns missing
        log.append(row(2, advances=7.0, schedule=None, lr=None))
    d = read_log(p)
    assert d.columns["lr"][0] == 0.5
    assert math.isnan(d.columns["lr"][1]) and math.isnan(d.columns["lr"][2])
    assert math.isnan(d.columns["loss/pde"][1]) and math.isnan(d.columns["time"][1])
    assert list(d.columns["advances"]) == [0, H.INT_MISSING, 7]
    assert list(d.columns["schedule"]) == ["revolve", "", ""]
    assert d.columns["iteration"].dtype == np.int64


@pytest.mark.parametrize("flush_first", [False, True], ids=["buffered", "written"])
def test_a_new_column_is_missing_in_the_rows_before(tmp_path, flush_first):
    """A column that appears at iteration 2 (buffered rows, or rows already in the file,
    which is then published again) reads NaN, -1 and "" before it; the rows, the other
    columns, the units and a curve written before are kept."""
    p = tmp_path / "log.h5"
    with H5Log(p, curves=("adjoint_norms",)) as log:
        log.append(row(0))
        log.append_curve("adjoint_norms", 0, [0, 1], [2.0, 1.0])
        log.append(row(1))
        if flush_first:
            log.flush()
        log.append(row(2, **{"loss/extra": 1.5, "n_steps": 40, "tag": "x"}))
        log.append(row(3))
        assert log.columns[-3:] == ["loss/extra", "n_steps", "tag"]
    d = read_log(p)
    assert list(d.columns["iteration"]) == [0, 1, 2, 3]
    extra = d.columns["loss/extra"]
    assert np.isnan(extra[[0, 1, 3]]).all() and extra[2] == 1.5
    assert list(d.columns["n_steps"]) == [H.INT_MISSING, H.INT_MISSING, 40, H.INT_MISSING]
    assert list(d.columns["tag"]) == ["", "", "x", ""]
    assert list(d.columns["schedule"]) == ["revolve"] * 4
    assert list(d.columns["loss/pde"]) == [row(i)["loss/pde"] for i in range(4)]
    c = read_curves(p, "adjoint_norms")
    assert list(c["iteration"]) == [0] and list(c["value"][0, :2]) == [2.0, 1.0]


def test_a_new_column_may_not_take_another_columns_dataset(tmp_path):
    with H5Log(tmp_path / "log.h5") as log:
        log.append(row(0))
        with pytest.raises(LogError, match="'loss/pde' and 'loss.pde' map to the same"):
            log.append(row(1, **{"loss.pde": 1.0}))
        log.append(row(1))                       # the rejected row was not buffered
    assert read_log(tmp_path / "log.h5").n_rows == 2


def test_row_errors(tmp_path):
    with H5Log(tmp_path / "log.h5") as log:
        with pytest.raises(LogError, match="iteration"):
            log.append({"loss": 1.0})
        log.append(row(5))
        with pytest.raises(LogError, match="strictly increasing"):
            log.append(row(5))
        with pytest.raises(LogError, match="holds numbers"):
            log.append(row(6, loss="x"))
        with pytest.raises(LogError, match="holds strings"):
            log.append(row(6, schedule=3))
        with pytest.raises(LogError, match="int64"):
            log.append(row(6, advances=2.5))
        assert log.last_iteration == 5


def test_attrs_json_round_trip(tmp_path):
    p = tmp_path / "log.h5"
    cfg = {"problem": "heat", "steps": 5000, "opt": {"lr": 1e-3, "betas": [0.9, 0.99]},
           "budget": None}
    write_log(p, 3, attrs={"config": cfg, "name": "run-1", "seed": 7, "tags": ["a", "b"]})
    d = read_log(p)
    assert d.attrs["config"] == cfg
    assert d.attrs["tags"] == ["a", "b"]
    assert d.attrs["name"] == "run-1" and d.attrs["seed"] == 7
    assert d.attrs["schema_version"] == H.SCHEMA_VERSION
    assert "json_attrs" not in d.attrs
    with h5py.File(p, "r") as f:                     # config is a JSON string in the file
        assert json.loads(f.attrs["config"]) == cfg


def test_strange_column_names(tmp_path):
    with H5Log(tmp_path / "a.h5") as log:
        with pytest.raises(LogError, match="same dataset"):
            log.append({"iteration": 0, "a/b": 1.0, "a.b": 2.0})
        log.append({"iteration": 0, "a/b": 1.0, "b c": "x", "é": 2})
    assert list(read_log(tmp_path / "a.h5").columns) == ["iteration", "a/b", "b c", "é"]
    with pytest.raises(LogError, match="invalid column name"):
        H5Log(tmp_path / "b.h5").append({"iteration": 0, "/": 1.0})


# ------------------------------------------------------------------------------ reading


READER = """
import sys, h5py
with h5py.File(sys.argv[1], "r", swmr=True, libver="latest") as f:
    print(f["iteration"].shape[0], f["loss.pde"].shape[0], int(f["iteration"][-1]))
"""


def test_swmr_reader_sees_flushed_rows_while_writing(tmp_path):
    p = tmp_path / "log.h5"
    log = H5Log(p, block_rows=5, flush_seconds=1e9)
    for i in range(7):
        log.append(row(i))                        # 5 flushed, 2 buffered
    r = run_py(READER, str(p))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["5", "5", "4"]
    log.flush()
    r = run_py(READER, str(p))
    assert r.stdout.split() == ["7", "7", "6"]
    assert read_log(p).n_rows == 7                 # read_log too, writer still open
    log.close()


def test_resume_and_truncate_after(tmp_path):
    p = tmp_path / "log.h5"
    write_log(p, 30, attrs={"config": {"a": 1}})
    # restart file at iteration 19: rows 20..29 were logged but will be re-run
    with H5Log(p, resume=True, attrs={"resumed_from": 19}) as log:
        assert log.last_iteration == 29 and log.n_rows == 30
        assert log.truncate_after(19) == 10
        assert log.last_iteration == 19
        for i in range(20, 40):
            log.append(row(i))
    d = read_log(p)
    assert list(d.columns["iteration"]) == list(range(40))
    assert d.attrs["config"] == {"a": 1} and d.attrs["resumed_from"] == 19
    # truncation also drops buffered rows, and a restart before any row empties the log
    with H5Log(p, resume=True, block_rows=100) as log:
        for i in range(40, 45):
            log.append(row(i))
        assert log.truncate_after(41) == 3 and log.last_iteration == 41
        assert log.truncate_after(-1) == 42 and log.last_iteration == -1
        log.append(row(0))
    assert list(read_log(p).columns["iteration"]) == [0]


def test_resume_of_log_without_rows(tmp_path):
    p = tmp_path / "log.h5"
    H5Log(p, attrs={"x": 1}).close()
    with pytest.raises(LogError, match="no columns"):
        read_log(p)
    with H5Log(p, resume=True) as log:
        assert log.last_iteration == -1
        log.append(row(0))
    assert read_log(p).n_rows == 1
    with pytest.raises(LogError, match="no log to resume"):
        H5Log(tmp_path / "nothing.h5", resume=True)


def test_resuming_a_log_through_a_symbolic_link_is_refused(tmp_path):
    """A resume reads the rows through a linked log, then publishes the new file with
    os.replace over the link: the link became a regular file and its target stayed behind,
    stale, in silence. Now refused in one line naming the link; nothing is changed."""
    kept = tmp_path / "elsewhere" / "log.h5"
    kept.parent.mkdir()
    write_log(kept, 4)
    link = tmp_path / "log.h5"
    link.symlink_to(kept)
    before = kept.read_bytes()
    with pytest.raises(LogError, match="is a symbolic link") as e:
        H5Log(link, resume=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{link} is a symbolic link (to {kept})"), msg
    assert "would replace the link" in msg and f"copy the file into {tmp_path}" in msg, msg
    assert link.is_symlink() and kept.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "log.h5"]   # no temporary left


def test_missing_truncated_and_garbage_files(tmp_path):
    with pytest.raises(LogError, match="no such log file") as e:
        read_log(tmp_path / "missing.h5")
    assert "missing.h5" in str(e.value)
    p = tmp_path / "log.h5"
    write_log(p, 200)
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(LogError) as e:
        read_log(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    g = tmp_path / "garbage.h5"
    g.write_bytes(os.urandom(4096))
    with pytest.raises(LogError, match="not a readable HDF5 log") as e:
        read_log(g)
    assert "\n" not in str(e.value)
    with pytest.raises(LogError):
        H5Log(g, resume=True)


def test_missing_iteration_and_unequal_lengths(tmp_path):
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f["loss"] = np.ones(3)
    with pytest.raises(LogError, match="no 'iteration' column"):
        read_log(p)
    with h5py.File(p, "a") as f:
        f["iteration"] = np.arange(4)
    with pytest.raises(LogError, match="different lengths"):
        read_log(p)


def test_to_pandas(tmp_path):
    p = tmp_path / "log.h5"
    write_log(p, 4, attrs={"config": {"a": 1}})
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pandas"):
            to_pandas(p)
        return
    df = to_pandas(p)
    assert list(df["iteration"]) == [0, 1, 2, 3] and "loss/pde" in df.columns
    assert df.attrs["config"] == {"a": 1}


# ------------------------------------------------------------------------------ locking


def test_locking_flag_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    assert F._locking_kw(None) == {}
    assert F._locking_kw(False) == {"locking": False}
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "FALSE")
    assert F._locking_kw(None) == {"locking": False}
    assert F._locking_kw(True) == {"locking": True}
    p = tmp_path / "log.h5"
    write_log(p, 3, locking=False)
    assert read_log(p, locking=False).n_rows == 3


def test_lock_errors_say_how_to_retry(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(38, "Unable to synchronously open file (unable to lock file, errno = 38, "
                          "error message = 'Function not implemented')")

    p = tmp_path / "log.h5"
    write_log(p, 2)
    monkeypatch.setattr(F.h5py, "File", refuse)
    for call in (lambda: H5Log(tmp_path / "new.h5"), lambda: read_log(p),
                 lambda: H5Log(p, resume=True)):
        with pytest.raises(LogError, match="--no-file-locking or HDF5_USE_FILE_LOCKING=FALSE"):
            call()


HOLDER = """
import sys, time, h5py
f = h5py.File(sys.argv[1], "r")                # a reader holds HDF5's shared lock
print("open", flush=True)
time.sleep(60)
"""


def test_a_reader_holding_the_log_does_not_stop_a_resume(tmp_path, monkeypatch):
    """A reader that holds HDF5's shared lock on a finished log (a notebook's h5py.File)
    made a resume fail with a lock error; now the resume writes a fresh file that replaces
    the log, and the reader keeps its view of the old one."""
    p = tmp_path / "log.h5"
    write_log(p, 3)
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    monkeypatch.setattr(F, "_LOCK_WAIT", 0.3)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(p)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        with H5Log(p, resume=True) as log:
            assert log.last_iteration == 2
            log.append(row(3))
        assert read_log(p).n_rows == 4
        assert proc.poll() is None                  # the reader is still there
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert not list(tmp_path.glob("*.tmp-*"))


# ------------------------------------------------------------------------------ crashes


CRASHER = """
import sys, time
from deepsolve.io import H5Log
log = H5Log(sys.argv[1], block_rows=1000, flush_seconds=1e9, attrs={"config": {"k": 1}})
for i in range(10):
    log.append({"iteration": i, "loss": 1.0 / (i + 1), "schedule": "revolve"})
log.flush()
for i in range(10, 13):                    # buffered only: lost on SIGKILL
    log.append({"iteration": i, "loss": 0.0, "schedule": "revolve"})
print("flushed", flush=True)
time.sleep(60)
"""


def test_flushed_rows_survive_sigkill_and_resume_recovers(tmp_path):
    p = tmp_path / "log.h5"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CRASHER), str(p)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "flushed", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    d = read_log(p)                                # the file is left marked "open for SWMR"
    assert list(d.columns["iteration"]) == list(range(10))
    assert d.attrs["config"] == {"k": 1}
    with pytest.warns(RuntimeWarning, match="not closed cleanly.*10 flushed rows"):
        log = H5Log(p, resume=True)
    with log:
        assert log.recovered and log.last_iteration == 9
        log.truncate_after(7)
        for i in range(8, 15):
            log.append({"iteration": i, "loss": 0.5, "schedule": "periodic"})
    d = read_log(p)
    assert list(d.columns["iteration"]) == list(range(15))
    assert list(d.columns["schedule"][7:9]) == ["revolve", "periodic"]
    assert d.attrs["config"] == {"k": 1}
    assert not p.with_name(p.name + ".recover.tmp").exists()


# ------------------------------------------------------------------------------ consistency


H5LOG = str(ROOT / "deepsolve" / "io" / "log" / "__init__.py")

# a writer that loads the log package (deepsolve/io/log) by path (no torch import: a fraction
# of a second)
STANDALONE = """
import importlib.util, os, signal, sys
import h5py
spec = importlib.util.spec_from_file_location(
    "h5log_standalone", sys.argv[2],
    submodule_search_locations=[os.path.dirname(sys.argv[2])])
H = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)
"""

STREAMER = STANDALONE + """
log = H.H5Log(sys.argv[1], block_rows=1, flush_seconds=1e9, attrs={"config": {"k": 1}})
n = int(sys.argv[3])
for i in range(n):
    log.append({"iteration": i, "loss": 1.0 / (i + 1), "loss/pde": float(i), "time": 0.1,
                "advances": 3 * i, "schedule": "revolve" if i % 2 else "periodic"})
    if i == 0:
        print("go", flush=True)
log.close()
"""


HELD_READER = """
import json, sys, time
import h5py
import numpy as np
path, done = sys.argv[1], sys.argv[2]
reads = errors = torn = 0
f = h5py.File(path, "r", swmr=True, libver="latest", locking=False)
print("reading", flush=True)
while True:
    last = __import__("os").path.exists(done)
    try:   # the documented protocol: refresh iteration first and trust its length
        it = f["iteration"]
        it.refresh()
        its = it[:]
        neg = np.flatnonzero(its < 0)
        m = int(neg[0]) if len(neg) else len(its)
        for k in f:
            f[k].refresh()
            if f[k].shape[0] < m:
                torn += 1
        pde = f["loss.pde"][:m]
        if not np.array_equal(its[:m], np.arange(m)) or not np.array_equal(pde, np.arange(m)):
            torn += 1
        reads += 1
    except OSError:          # HDF5 2.0: a held handle fails once the file grew; reopen it
        errors += 1
        f.close()
        f = h5py.File(path, "r", swmr=True, libver="latest", locking=False)
    if last:
        break
print(json.dumps({"reads": reads, "errors": errors, "torn": torn}), flush=True)
"""


def test_readers_during_writing_always_get_whole_rows(tmp_path):
    """A writer flushing every row while readers read: read_log (here), and a reader holding
    one SWMR handle that follows the documented protocol (refresh ``iteration`` first, trust
    its length; another process), always see a consistent prefix of complete rows (seen
    torn: 58 of 2175 held-handle reads; 42 of 1184 read_log calls refused)."""
    p, done = tmp_path / "log.h5", tmp_path / "done"
    n = 1500
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STREAMER), str(p), H5LOG,
                               str(n)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    held = None
    reads, seen = 0, set()
    try:
        assert writer.stdout.readline().strip() == "go", writer.stderr.read()
        held = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HELD_READER), str(p),
                                 str(done)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        assert held.stdout.readline().strip() == "reading", held.stderr.read()
        while writer.poll() is None or reads == 0:
            d = read_log(p)
            its = d.columns["iteration"]
            np.testing.assert_array_equal(its, np.arange(d.n_rows))
            assert all(len(c) == d.n_rows for c in d.columns.values())
            np.testing.assert_array_equal(d.columns["advances"], 3 * its)
            reads += 1
            seen.add(d.n_rows)
        done.touch()
        out, err = held.communicate(timeout=120)
        assert held.returncode == 0, err
        counts = json.loads(out)
    finally:
        done.touch()
        for proc in (writer, held):
            if proc is not None and proc.poll() is None:
                proc.kill()
        _, err = writer.communicate(timeout=60)
        if held is not None:
            held.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert counts["torn"] == 0 and counts["reads"] >= 5, counts
    assert reads >= 5 and len(seen) >= 2, (reads, seen)
    assert read_log(p).n_rows == n


def test_a_torn_flush_reads_as_its_complete_rows(tmp_path):
    """What a writer killed (or out of disk space) mid-flush leaves: the other columns
    extended, ``iteration`` not yet (or extended but its values not yet written, -1): the
    log reads as its complete rows, and resumes from them."""
    p = tmp_path / "log.h5"
    write_log(p, 10)
    with h5py.File(p, "r+", libver="latest") as f:       # others ahead of iteration
        for k in f:
            if k != "iteration":
                f[k].resize((13,))
    d = read_log(p)
    assert d.n_rows == 10 and all(len(c) == 10 for c in d.columns.values())
    with h5py.File(p, "r+", libver="latest") as f:       # iteration extended, unwritten
        f["iteration"].resize((12,))
    d = read_log(p)
    assert d.n_rows == 10 and list(d.columns["iteration"]) == list(range(10))
    with H5Log(p, resume=True) as log:
        assert log.last_iteration == 9
        log.append(row(10))
    assert list(read_log(p).columns["iteration"]) == list(range(11))


KILL_MID_FLUSH = STANDALONE + """
log = H.H5Log(sys.argv[1], block_rows=1000, flush_seconds=1e9)
for i in range(10):
    log.append({"iteration": i, "loss": 1.0 / (i + 1), "loss/pde": 0.5, "advances": i,
                "schedule": "revolve"})
log.flush()
for i in range(10, 15):
    log.append({"iteration": i, "loss": 0.0, "loss/pde": 0.0, "advances": i, "schedule": "x"})
real, calls = h5py.Dataset.resize, [0]
def resize(self, *a, **k):
    real(self, *a, **k)
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
h5py.Dataset.resize = resize
log.flush()
"""


@pytest.mark.parametrize("at", [1, 3, 4, 5])
def test_writer_killed_mid_flush(tmp_path, at):
    """SIGKILL after the ``at``-th column of a 5-column flush was extended (4, 5: the other
    columns are written and flushed, ``iteration`` not yet / extended but not written)."""
    p = tmp_path / "log.h5"
    r = run_py(KILL_MID_FLUSH, str(p), H5LOG, str(at))
    assert r.returncode == -signal.SIGKILL, r.stderr
    d = read_log(p)
    assert list(d.columns["iteration"]) == list(range(10))
    assert all(len(c) == 10 for c in d.columns.values())
    with pytest.warns(RuntimeWarning, match="not closed cleanly.*10 flushed rows"):
        log = H5Log(p, resume=True)
    with log:
        log.append({"iteration": 10, "loss": 0.1, "schedule": "revolve"})
    assert list(read_log(p).columns["iteration"]) == list(range(11))


def test_no_half_made_log_when_the_disk_is_full(tmp_path, monkeypatch):
    """Creating a log on a full disk leaves no log.h5 (not even 0 bytes) and no temporary
    file: the log is made under a temporary name and renamed once complete."""
    p = tmp_path / "log.h5"
    real = F.h5py.File

    def full(name, mode="r", *a, **k):
        f = real(name, mode, *a, **k)
        if mode == "w":
            f.close()
            raise OSError(28, "No space left on device")
        return f

    monkeypatch.setattr(F.h5py, "File", full)
    with pytest.raises(LogError, match="No space left on device"):
        H5Log(p)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(F.h5py, "File", real)
    write_log(p, 3)
    monkeypatch.setattr(F.h5py, "File", full)
    with pytest.raises(LogError, match="No space left"):
        H5Log(p, resume=True, keep_through=1)
    monkeypatch.setattr(F.h5py, "File", real)
    assert read_log(p).n_rows == 3                  # the old log is untouched
    assert sorted(os.listdir(tmp_path)) == ["log.h5"]


def test_empty_and_never_flushed_logs_are_empty_not_broken(tmp_path):
    """A 0-byte log.h5 (left by "no space" at creation) and a log whose writer (an earlier
    deepsolve) stopped in its first flush read as EmptyLogError and resume as new logs."""
    p = tmp_path / "log.h5"
    p.write_bytes(b"")
    with pytest.raises(H.EmptyLogError, match="0 bytes"):
        read_log(p)
    with H5Log(p, resume=True) as log:
        log.append(row(0))
    assert read_log(p).n_rows == 1
    q = tmp_path / "legacy.h5"
    r = run_py("""
        import os, signal, sys, h5py
        f = h5py.File(sys.argv[1], "w", libver="latest")
        f.attrs["schema_version"] = 1
        f.create_dataset("iteration", shape=(0,), maxshape=(None,), dtype="i8", chunks=(1024,))
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)      # before swmr_mode = True
    """, str(q))
    assert r.returncode == -signal.SIGKILL
    with pytest.raises(H.EmptyLogError, match="before the log's first complete flush"):
        read_log(q)
    assert H.log_iterations(q).tolist() == []
    with H5Log(q, resume=True) as log:
        log.append(row(0))
    assert read_log(q).n_rows == 1


# ---------------------------------------------- the reading recipes of docs/h5-log.md, live

DOC = ROOT / "docs" / "h5-log.md"
DOC_LOG = "runs/heat/log.h5"          # the path the recipes read

WEIGHTED = '''


class Weighted(GatedDecay):
    def weights(self, ctx):
        return {"prior": 10.0}


problem = Weighted()
'''


def doc_snippets() -> dict[str, str]:
    """The recipes marked ``<!-- snippet: NAME ... -->`` in docs/h5-log.md, by name."""
    import re

    text = DOC.read_text()
    found = re.findall(r"<!-- snippet: (\S+)[^\n]*-->\n```python\n(.*?)```", text, re.S)
    return dict(found)


@pytest.fixture(scope="module")
def live_trainer(tmp_path_factory):
    """A trainer (the gated decay problem with a loss weight) that has flushed rows 0..5 and
    waits inside iteration 7 until the test is done: its log is open for SWMR writing."""
    import time

    d = tmp_path_factory.mktemp("live")
    problem = d / "weighted.py"
    problem.write_text((ROOT / "tests" / "data" / "gated_problem.py").read_text() + WEIGHTED)
    out, gate = d / "run", d / "gate"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepsolve", "train", str(problem), "--out", str(out), "--quiet",
         "--iterations", "12", "--set", f"gate={gate}", "--set", "gate_at=7"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{gate}.waiting"):
            if proc.poll() is not None:
                pytest.fail(f"the trainer ended (rc {proc.returncode}): {proc.stderr.read()}")
            assert time.monotonic() < deadline, "the trainer never reached its gate"
            time.sleep(0.02)
        yield proc, out / "log.h5"
    finally:
        gate.touch()
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=60)


def _run_snippet(name: str, path: Path) -> dict:
    code = doc_snippets()[name]
    assert DOC_LOG in code, f"the {name} recipe no longer reads {DOC_LOG}"
    ns: dict = {}
    exec(compile(code.replace(DOC_LOG, str(path)), f"docs/h5-log.md ({name})", "exec"), ns)
    return ns


def _check_snippet(name: str, ns: dict, weights: dict) -> int:
    """What each recipe read: whole rows, the weighted terms adding up to the loss."""
    if name == "read_log":
        log = ns["log"]
        n = log.n_rows
        np.testing.assert_array_equal(ns["it"], np.arange(n))
        assert ns["w"] == weights
        np.testing.assert_allclose(sum(ns["weighted"].values()), ns["loss"], rtol=1e-6,
                                   atol=1e-7)
        return n
    if name == "h5py":
        n = ns["n"]
        np.testing.assert_array_equal(ns["it"], np.arange(n))
        assert ns["weights"] == weights and len(ns["schedule"]) == n
        assert all(isinstance(s, str) for s in ns["schedule"])
        total = sum(weights.get(c[len("loss/"):], 1.0) * v for c, v in ns["terms"].items())
        np.testing.assert_allclose(total, ns["loss"], rtol=1e-6, atol=1e-7)
        assert ns["names"]["iteration"] == "iteration"
        return n
    df = ns["df"]
    n = len(df)
    np.testing.assert_array_equal(df["iteration"].to_numpy(), np.arange(n))
    assert isinstance(df["schedule"].iloc[0], str) and not df["loss"].isna().any()
    return n


@pytest.mark.parametrize("name", ["read_log", "h5py", "pandas"])
def test_doc_recipes_read_a_log_that_a_trainer_is_writing(live_trainer, name):
    """The h5py and pandas recipes of docs/h5-log.md used a plain h5py.File(path, "r"),
    which refuses a live log ("file is already open for write"): they now open it with
    swmr=True. Each recipe runs, as the doc has it, on the log of a trainer that is still
    running (waiting inside iteration 7, rows 0..5 flushed)."""
    if name == "pandas":
        try:
            import pandas  # noqa: F401
        except ImportError:
            pytest.skip("pandas is not installed (deepsolve does not depend on it): the "
                        "pandas recipe cannot run here; the read_log and h5py ones do")
    proc, path = live_trainer
    assert proc.poll() is None and F._superblock(path)[1] & 0x4   # being written, SWMR
    ns = _run_snippet(name, path)
    assert proc.poll() is None and F._superblock(path)[1] & 0x4   # and still is
    assert _check_snippet(name, ns, {"prior": 10.0}) >= 6


@pytest.mark.parametrize("name", ["read_log", "h5py", "pandas"])
def test_doc_recipes_read_a_closed_log(tmp_path, name):
    if name == "pandas":
        try:
            import pandas  # noqa: F401
        except ImportError:
            pytest.skip("pandas is not installed (deepsolve does not depend on it)")
    p = tmp_path / "log.h5"
    with H5Log(p, attrs={"config": {"k": 1}, "weights": {"pde": 2.0}}) as log:
        for i in range(5):
            log.append(row(i, loss=2.0 * 0.5 / (i + 1)))
    assert F._superblock(p)[1] & 0x5 == 0                         # closed cleanly
    assert _check_snippet(name, _run_snippet(name, p), {"pde": 2.0}) == 5


def test_a_curve_of_iteration_minus_one_and_unwritten_entries(tmp_path):
    """Iteration -1 (the model as built) is a curve of its own; an entry whose iteration is
    not yet written (the writer appends the iteration last) is not read, whether the file
    marks it with CURVE_UNWRITTEN or, as logs did before, with -1."""
    from deepsolve.io import read_curves
    from deepsolve.io.log import CURVE_UNWRITTEN

    path = tmp_path / "log.h5"
    with H5Log(path, curves=("eval_e",)) as log:
        log.append_curve("eval_e", -1, [0, 10], [0.0, 1.0])
        log.append_curve("eval_e", 0, [0, 10], [0.0, 0.5])
        log.append({"iteration": 0, "loss": 1.0})
    assert list(read_curves(path, "eval_e")["iteration"]) == [-1, 0]
    for fill in (CURVE_UNWRITTEN, -1):
        p = tmp_path / f"fill{fill}.h5"
        with h5py.File(p, "w") as f:
            g = f.create_group("eval_e")
            g.attrs["kind"] = "curve"
            g.create_dataset("iteration", data=np.array([3, 4, fill, fill]), maxshape=(None,),
                             fillvalue=fill)
            g.create_dataset("step", data=np.zeros((4, 2), np.int64))
            g.create_dataset("value", data=np.ones((4, 2)))
        assert list(read_curves(p, "eval_e")["iteration"]) == [3, 4]


def test_curves_are_written_with_the_rows_truncated_and_kept_on_resume(tmp_path):
    """2-D curve groups (adjoint norms): written before the rows' iteration, read back by
    read_curves, dropped with the rows by truncate_after and kept by a resume."""
    from deepsolve.io import CURVE_WIDTH, read_curves

    path = tmp_path / "log.h5"
    log = H5Log(path, curves=("adjoint_norms",))
    for it in range(5):
        log.append_curve("adjoint_norms", it, np.arange(it + 2), np.linspace(1, 2, it + 2) * it)
        log.append({"iteration": it, "loss": float(it)})
    log.flush()
    c = read_curves(path, "adjoint_norms")
    assert list(c["iteration"]) == [0, 1, 2, 3, 4]
    assert c["step"].shape == (5, CURVE_WIDTH) and c["value"].shape == (5, CURVE_WIDTH)
    assert list(c["step"][3, :6]) == [0, 1, 2, 3, 4, -1]
    assert np.allclose(c["value"][3, :5], np.linspace(1, 2, 5) * 3)
    assert np.isnan(c["value"][3, 5:]).all()
    assert log.truncate_after(2) == 2
    assert list(read_curves(path, "adjoint_norms")["iteration"]) == [0, 1, 2]
    log.close()
    assert read_log(path).n_rows == 3            # the rows' reader skips the curve group
    log = H5Log(path, resume=True, keep_through=1, curves=("adjoint_norms",))
    assert list(read_curves(path, "adjoint_norms")["iteration"]) == [0, 1]
    log.append_curve("adjoint_norms", 2, [0, 5], [1.0, 2.0])
    log.append({"iteration": 2, "loss": 2.0})
    log.close()
    c = read_curves(path, "adjoint_norms")
    assert list(c["iteration"]) == [0, 1, 2] and list(c["step"][2, :3]) == [0, 5, -1]
    with pytest.raises(LogError, match="not declared"):
        H5Log(tmp_path / "b.h5").append_curve("adjoint_norms", 0, [0], [1.0])
    with pytest.raises(LogError, match="at most"):
        H5Log(tmp_path / "c.h5", curves=("x",)).append_curve("x", 0, np.arange(600),
                                                             np.ones(600))
