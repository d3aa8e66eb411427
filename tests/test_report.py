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
