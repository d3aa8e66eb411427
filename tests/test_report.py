"""deepsolve.io.report: summary text, PNG plots, one-line errors for bad logs."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from deepsolve.io import H5Log, LogError, read_log, report, summarize

PNG = b"\x89PNG\r\n\x1a\n"
MiB = 2**20


def full_log(run_dir, n=40):
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"problem": "heat", "steps": 5000, "snapshots": 20, "optim": {"lr": 1e-3}}
    with H5Log(run_dir / "log.h5", attrs={"config": cfg}, block_rows=16) as log:
        for i in range(n):
            log.append({
                "iteration": i, "loss": 1.0 / (i + 1), "loss/pde": 0.75 / (i + 1),
                "loss/bc": 0.25 / (i + 1), "time": 0.5 + 0.01 * (i % 3),
                "time_forward": 0.2, "time_backward": 0.3,
                "peak_device_memory": (100 + i) * MiB, "peak_host_memory": 64 * MiB,
                "advances": 30, "recorded": 10, "snapshots": 4,
                "schedule": "revolve" if i < 30 else "store_all", "lr": np.float32(1e-3),
                "grad_norm": 1.0, "metric/rel_err_u": 0.5 / (i + 1) if i % 10 == 0 else math.nan,
            })


def test_report_text_and_plots(tmp_path):
    run = tmp_path / "runs" / "heat"
    full_log(run)
    text = report(run)
    for piece in ("loss/pde", "loss/bc", "metric/rel_err_u", "revolve (30 rows)",
                  "store_all (10 rows)", "139.0 MiB", "64.0 MiB", "1200 unrecorded",
                  "400 recorded", "problem", "optim.lr", "rows             40"):
        assert piece in text, piece
    # last/best total loss, first/last of each term, last finite metric (iteration 30)
    assert "last 0.025 (iteration 39), best 0.025 (iteration 39)" in text
    assert "0.75" in text and "0.01875" in text
    assert "0.016129" in text and " 30" in text
    assert "median 0.51 s" in text
    for name in ("loss.png", "memory.png", "time.png", "metrics.png"):
        p = run / name
        assert p.exists() and p.read_bytes()[:8] == PNG, name
        assert str(p) in text


def test_report_out_dir_and_log_path(tmp_path):
    run = tmp_path / "run"
    full_log(run, n=5)
    out = tmp_path / "plots"
    text = report(run / "log.h5", out_dir=out)
    assert (out / "loss.png").read_bytes()[:8] == PNG
    assert not (run / "loss.png").exists()
    assert str(out / "time.png") in text


def test_report_minimal_log(tmp_path):
    with H5Log(tmp_path / "log.h5") as log:
        for i in range(3):
            log.append({"iteration": i})
    text = report(tmp_path)
    assert "rows             3" in text and "no plottable columns" in text
    assert not (tmp_path / "loss.png").exists()


def test_summary_without_metrics_and_negative_loss(tmp_path):
    with H5Log(tmp_path / "log.h5") as log:
        for i in range(4):
            log.append({"iteration": i, "loss": float(1 - i), "metric/x": math.nan})
    text = report(tmp_path)
    assert "best -2 (iteration 3)" in text
    assert "metrics.png" not in text                # metric never evaluated: nothing to plot
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG
    assert "metric/x" in summarize(read_log(tmp_path))


def test_report_errors_are_one_line(tmp_path):
    with pytest.raises(LogError, match="no such log file"):
        report(tmp_path / "nope")
    run = tmp_path / "run"
    full_log(run, n=200)
    p = run / "log.h5"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(LogError) as e:
        report(run)
    assert "\n" not in str(e.value) and str(p) in str(e.value)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "log.h5").write_bytes(os.urandom(2048))
    with pytest.raises(LogError, match="not a readable HDF5 log") as e:
        report(bad)
    assert "\n" not in str(e.value)


def test_missing_int_values_are_not_plotted_or_summed(tmp_path):
    with H5Log(tmp_path / "log.h5") as log:
        log.append({"iteration": 0, "peak_device_memory": 8 * MiB, "advances": 5})
        log.append({"iteration": 1})                  # int columns get -1 (missing)
        log.append({"iteration": 2, "peak_device_memory": 4 * MiB, "advances": 7})
    assert list(read_log(tmp_path).columns["advances"]) == [5, -1, 7]
    text = report(tmp_path)
    assert "device 8.0 MiB" in text and "12 unrecorded" in text
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG


# ------------------------------------------------------------------ untrusted logs (issue 21)


def _h5(path, fill, *, schema=1):
    """A hand-made log: ``iteration`` 0..2, then whatever ``fill(f)`` adds."""
    import h5py

    with h5py.File(path, "w", libver="latest", track_order=True) as f:
        f.attrs["schema_version"] = schema
        f["iteration"] = np.arange(3)
        fill(f)
    return path


def test_report_does_not_follow_what_a_log_points_to(tmp_path):
    """External links, external-storage and virtual datasets made report read other files
    (bytes of a secret appeared as values): each is refused with one line."""
    import h5py

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"hostname-secret!" * 8)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as g:
        g["x"] = np.arange(3.0)

    def ext(f):
        f.create_dataset("loss", shape=(3,), dtype=np.float64, external=[(str(secret), 0, 24)])

    def link(f):
        f["loss"] = h5py.ExternalLink(str(other), "/x")

    def virtual(f):
        lay = h5py.VirtualLayout(shape=(3,), dtype=np.float64)
        lay[:] = h5py.VirtualSource(str(other), "x", shape=(3,))
        f.create_virtual_dataset("loss", lay)

    for name, fill, match in (("ext", ext, "external files"), ("link", link, "external link"),
                              ("virtual", virtual, "virtual dataset")):
        run = tmp_path / name
        run.mkdir()
        _h5(run / "log.h5", fill)
        with pytest.raises(LogError, match=match) as e:
            report(run)
        assert "\n" not in str(e.value) and "log.h5" in str(e.value)
        assert not (run / "loss.png").exists()


FIFO_READER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("h5log_standalone", sys.argv[2])
H = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)
try:
    H.read_log(sys.argv[1])
except H.LogError as e:
    print(e)
"""


def test_a_fifo_named_log_h5_is_refused_at_once(tmp_path):
    """A FIFO named log.h5 hung report (> 237 s). Read in a subprocess (h5log.py loaded by
    path, no torch), so a hang fails the test instead of blocking the suite."""
    import subprocess
    import sys
    from pathlib import Path

    fifo = tmp_path / "log.h5"
    os.mkfifo(fifo)
    h5log = Path(__file__).resolve().parents[1] / "deepsolve" / "io" / "h5log.py"
    try:
        r = subprocess.run([sys.executable, "-c", FIFO_READER, str(tmp_path), str(h5log)],
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO named log.h5 hung")
    assert r.returncode == 0, r.stderr
    assert "not a regular file (a FIFO)" in r.stdout
    with pytest.raises(LogError, match="not a regular file"):    # and in this process
        report(tmp_path)


def test_schema_version_and_declared_sizes_are_checked(tmp_path):
    with pytest.raises(LogError, match="schema_version 999 is not a layout") as e:
        read_log(_h5(tmp_path / "a.h5", lambda f: None, schema=999))
    assert "\n" not in str(e.value)

    def huge(f):      # a sparse dataset: 10^12 rows declared in a file of a few KiB
        f.create_dataset("loss", shape=(10**12,), maxshape=(None,), chunks=(1024,),
                         dtype=np.float64)

    with pytest.raises(LogError, match=r"'loss' declares 1000000000000 rows .* more than the "
                                       r"file's \d+ bytes"):
        report(_h5(tmp_path / "b.h5", huge))

    def huge_iteration(f):
        del f["iteration"]
        f.create_dataset("iteration", shape=(10**12,), maxshape=(None,), chunks=(1024,),
                         dtype=np.int64)

    with pytest.raises(LogError, match="'iteration' declares"):
        read_log(_h5(tmp_path / "c.h5", huge_iteration))


def test_report_work_is_bounded_for_thousands_of_metrics(tmp_path, monkeypatch):
    """3000 metric columns took 593 s: now at most MAX_SERIES are drawn, MAX_TABLE_ROWS
    listed, and the report says how many were left out."""
    import importlib

    import h5py

    R = importlib.import_module("deepsolve.io.report")   # the module, not the function
    n_metrics = 3000
    with h5py.File(tmp_path / "log.h5", "w", libver="latest", track_order=True) as f:
        f.attrs["schema_version"] = 1
        f["iteration"] = np.arange(4)
        f["loss"] = np.array([4.0, 3.0, 2.0, 1.0])
        for j in range(n_metrics):
            d = f.create_dataset(f"metric.m{j}", data=np.full(4, 1.0 + j))
            d.attrs["column"] = f"metric/m{j}"
    drawn = []
    real = R._plot

    def counting(path, it, series, *a):
        drawn.append((path.name, len(series)))
        return real(path, it, series, *a)

    monkeypatch.setattr(R, "_plot", counting)
    text = report(tmp_path)
    assert dict(drawn)["metrics.png"] == R.MAX_SERIES
    assert f"metrics.png (the first {R.MAX_SERIES} of {n_metrics} metrics)" in text
    assert f"... ({n_metrics - R.MAX_TABLE_ROWS} more metrics)" in text
    assert sum(line.startswith("metric/") for line in text.splitlines()) == R.MAX_TABLE_ROWS


def test_report_out_at_a_file_or_proc_is_one_line(tmp_path, capsys):
    from deepsolve.cli import main
    from deepsolve.io import ReportError

    run = tmp_path / "run"
    full_log(run, n=5)
    a_file = tmp_path / "plots.txt"
    a_file.write_text("not a directory")
    with pytest.raises(ReportError, match="not a directory"):
        report(run, out_dir=a_file)
    assert a_file.read_text() == "not a directory"
    for out in (a_file, "/proc", "/proc/self/plots"):
        assert main(["report", str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("deepsolve report: error: --out") and err.count("\n") == 1, err
