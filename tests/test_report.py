"""deepsolve.io.report: summary text, PNG plots, one-line errors for bad logs."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from deepsolve.io import H5Log, LogError, read_log, report, summarize
from deepsolve.io.report import BUDGET, REAL_PEAK

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
    # last/best total loss, first/last of each term, first and last finite metric (0 and 30)
    assert "last 0.025 (iteration 39), best 0.025 (iteration 39)" in text
    assert "0.75" in text and "0.01875" in text
    assert "metric/rel_err_u           0.5      0.016129  0..30" in text
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
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location(
    "h5log_standalone", sys.argv[2],
    submodule_search_locations=[os.path.dirname(sys.argv[2])])
H = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)
try:
    H.read_log(sys.argv[1])
except H.LogError as e:
    print(e)
"""


def test_a_fifo_named_log_h5_is_refused_at_once(tmp_path):
    """A FIFO named log.h5 hung report (> 237 s). Read in a subprocess (the log package
    loaded by path, no torch), so a hang fails the test instead of blocking the suite."""
    import subprocess
    import sys
    from pathlib import Path

    fifo = tmp_path / "log.h5"
    os.mkfifo(fifo)
    h5log = Path(__file__).resolve().parents[1] / "deepsolve" / "io" / "log" / "__init__.py"
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
    built = {}
    real = R._figures

    def keeping(log):
        figs, left_out = real(log)
        built.update(figs)
        return figs, left_out

    monkeypatch.setattr(R, "_figures", keeping)
    text = report(tmp_path)
    fig = built["metrics.png"]
    # 3000 names without a shared first token: one panel each, MAX_PANELS of them drawn
    drawn = min(R.MAX_SERIES, R.MAX_PANELS)
    assert len(fig.axes) == drawn
    assert sum(len(ax.get_lines()) for ax in fig.axes) == drawn
    assert [ax.get_title() for ax in fig.axes] == [f"m{j}" for j in range(drawn)]
    assert f"first {drawn} of {n_metrics} metrics drawn" in fig._suptitle.get_text()
    assert f"metrics.png (the first {drawn} of {n_metrics} metrics)" in text
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


# -------------------------------------------------- what the plots draw (issue: report plots)


def _figs(log_dir):
    from deepsolve.io.report import figures

    return figures(read_log(log_dir))


def _lines(ax, include_hidden=False):
    """label -> Line2D of an axes (labels starting with "_" are not in the legend)."""
    return {ln.get_label(): ln for ln in ax.get_lines()
            if include_hidden or not ln.get_label().startswith("_")}


def _baselines(ax):
    """The before-training markers of a panel: lines drawn at iteration -1 only."""
    return [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [-1.0]]


def metrics_log(path, n=20, initial=True):
    it = np.arange(n)
    cols = {
        "rel_err_closure": 0.1 * 0.7**it,           # spans 1e-1 .. 1e-4: log axis
        "rel_err_coarse": 0.2 * 0.75**it,
        "ratio_cfl": 0.5 + 0.01 * it,              # positive, within a factor 10: linear
        "time_solve": 1.0 + 0.1 * it,
        "drift": -1.0 + 0.5 * it,                   # crosses zero: linear
        "never": np.full(n, math.nan),              # never evaluated: no panel
    }
    attrs = {"device": "cpu"}
    if initial:
        attrs["initial_metrics"] = {"rel_err_closure": 0.9, "rel_err_coarse": 0.8,
                                    "ratio_cfl": 0.3}
    with H5Log(path, attrs=attrs) as log:
        for i in range(n):
            log.append({"iteration": i, "loss": 1.0 / (i + 1),
                        **{f"metric/{k}": float(v[i]) for k, v in cols.items()}})
    return cols


def test_metrics_one_panel_per_group_with_the_baseline(tmp_path):
    """metrics.png drew relative errors, a ratio and times on one log axis labelled "value":
    now one panel per group of names sharing their first token, each scaled for itself, and
    the metric before training as a marker at iteration -1."""
    cols = metrics_log(tmp_path / "log.h5")
    fig = _figs(tmp_path)["metrics.png"]
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == ["rel_err", "ratio_cfl", "time_solve", "drift"]
    assert all(ax.get_ylabel() != "value" for ax in fig.axes)
    rel = _lines(axes["rel_err"])
    assert set(rel) == {"rel_err_closure", "rel_err_coarse", "before training"}
    np.testing.assert_allclose(rel["rel_err_closure"].get_ydata(), cols["rel_err_closure"])
    np.testing.assert_allclose(rel["rel_err_coarse"].get_xdata(), np.arange(20))
    assert {ax.get_title(): ax.get_yscale() for ax in fig.axes} == {
        "rel_err": "log", "ratio_cfl": "linear", "time_solve": "linear", "drift": "linear"}
    # one marker per metric that has a baseline, in its curve's colour, one legend entry
    marks = _baselines(axes["rel_err"])
    assert sorted(float(m.get_ydata()[0]) for m in marks) == [0.8, 0.9]
    for m in marks:
        curve = [ln for ln in axes["rel_err"].get_lines() if ln not in marks
                 and ln.get_color() == m.get_markeredgecolor()]
        assert len(curve) == 1
    legend = [t.get_text() for t in axes["rel_err"].get_legend().get_texts()]
    assert legend.count("before training") == 1
    assert [float(m.get_ydata()[0]) for m in _baselines(axes["ratio_cfl"])] == [0.3]
    assert _baselines(axes["time_solve"]) == [] and _baselines(axes["drift"]) == []
    assert "before training" in fig._suptitle.get_text()
    assert (tmp_path / "metrics.png").exists() is False      # figures() writes nothing
    text = report(tmp_path)
    assert (tmp_path / "metrics.png").read_bytes()[:8] == PNG and "the first" not in text


def test_metrics_without_a_baseline_have_no_marker(tmp_path):
    metrics_log(tmp_path / "log.h5", initial=False)
    fig = _figs(tmp_path)["metrics.png"]
    assert len(fig.axes) == 4
    assert all(_baselines(ax) == [] for ax in fig.axes)
    assert "before training" not in fig._suptitle.get_text()


def test_metric_panels_and_series_are_bounded(tmp_path):
    """At most MAX_PANELS panels and MAX_SERIES curves, and the figure says what it left out."""
    from deepsolve.io.report import MAX_PANELS, MAX_SERIES

    with H5Log(tmp_path / "a.h5") as log:        # 30 unrelated metrics: 30 panels wanted
        for i in range(3):
            log.append({"iteration": i, **{f"metric/m{j}": 1.0 + j for j in range(30)}})
    fig = _figs(tmp_path / "a.h5")["metrics.png"]
    assert len(fig.axes) == MAX_PANELS
    assert "first 12 of 30 metrics drawn" in fig._suptitle.get_text()
    with H5Log(tmp_path / "b.h5") as log:        # one group of 25: one panel, 20 curves
        for i in range(3):
            log.append({"iteration": i, **{f"metric/err_{j}": 1.0 + j for j in range(25)}})
    fig = _figs(tmp_path / "b.h5")["metrics.png"]
    (ax,) = fig.axes
    assert len(ax.get_lines()) == MAX_SERIES
    assert ax.get_title() == f"err (first {MAX_SERIES} of 25)"
    assert f"first {MAX_SERIES} of 25 metrics drawn" in fig._suptitle.get_text()


def memory_log(path, device, *, new_columns=True, budget=64 * MiB, n=6):
    attrs = {"device": device}
    if budget is not None:
        attrs["budget_bytes"] = budget
    with H5Log(path, attrs=attrs) as log:
        for i in range(n):
            row = {"iteration": i, "peak_device_memory": float(2 * MiB),
                   "peak_host_memory": float((300 - 10 * (i % 2)) * MiB)}  # goes down and up
            if new_columns:
                row.update(peak_real_memory=float((20 + i) * MiB),
                           peak_tracked_memory=float(2 * MiB),
                           budget_bytes=float(budget) if budget else math.nan)
            log.append(row)


def test_memory_plot_says_what_each_curve_measured_on_cpu(tmp_path):
    """memory.png called CPU memory "peak device" and drew a decreasing "peak host" curve."""
    memory_log(tmp_path / "log.h5", "cpu")
    (ax,) = _figs(tmp_path)["memory.png"].axes
    lines = _lines(ax)
    assert set(lines) == {f"{REAL_PEAK} (RSS above the run's baseline)",
                          "tracked by deepsolve (saved tensors + snapshots)",
                          "process RSS peak in the iteration (absolute)", BUDGET}
    np.testing.assert_allclose(lines[f"{REAL_PEAK} (RSS above the run's baseline)"].get_ydata(),
                               20 + np.arange(6))
    np.testing.assert_allclose(
        lines["tracked by deepsolve (saved tensors + snapshots)"].get_ydata(), 2.0)
    budget = lines[BUDGET]
    assert budget.get_linestyle() == "--" and list(budget.get_ydata()) == [64.0, 64.0]
    assert ax.get_ylabel() == "MiB" and "cpu" in ax.get_title()
    assert ax.get_yscale() == "log"          # 2 .. 300 MiB: more than a factor of 10
    mem = next(ln for ln in summarize(read_log(tmp_path)).splitlines()
               if ln.startswith("peak memory"))
    assert mem.split(None, 2)[2] == ("real, whole iteration (RSS above baseline) 25.0 MiB, "
                                     "tracked 2.0 MiB, process RSS 300.0 MiB, budget of the "
                                     "unroll 64.0 MiB")


def test_memory_plot_on_cuda_has_no_host_curve(tmp_path):
    memory_log(tmp_path / "log.h5", "cuda:0")
    (ax,) = _figs(tmp_path)["memory.png"].axes
    labels = set(_lines(ax))
    assert labels == {f"{REAL_PEAK} (max_memory_allocated)",
                      "tracked by deepsolve (saved tensors + snapshots)", BUDGET}
    assert not any("host" in lb or "RSS" in lb or "device" in lb for lb in labels)
    mem = next(ln for ln in summarize(read_log(tmp_path)).splitlines()
               if ln.startswith("peak memory"))
    assert "real, whole iteration (max_memory_allocated) 25.0 MiB" in mem and "RSS" not in mem


def test_memory_plot_of_an_older_log_and_a_budget_far_above(tmp_path):
    """A log without peak_real_memory/peak_tracked_memory/budget_bytes still plots, its old
    columns labelled for what they held; a budget 10x above every curve on a linear axis is
    drawn as a line and the axis kept to the curves."""
    memory_log(tmp_path / "cpu.h5", "cpu", new_columns=False, budget=None)
    (ax,) = _figs(tmp_path / "cpu.h5")["memory.png"].axes
    assert set(_lines(ax)) == {"tracked by deepsolve (saved tensors + snapshots)",
                               "process RSS high-water mark (absolute)"}
    memory_log(tmp_path / "cuda.h5", "cuda:1", new_columns=False, budget=None)
    (ax,) = _figs(tmp_path / "cuda.h5")["memory.png"].axes
    assert set(_lines(ax)) == {f"{REAL_PEAK} (max_memory_allocated)"}
    with H5Log(tmp_path / "far.h5", attrs={"device": "cpu", "budget_bytes": 4 * 2**30}) as log:
        for i in range(4):         # a real peak of 0 (nothing above the baseline): linear axis
            log.append({"iteration": i, "peak_real_memory": float(i * MiB)})
    (ax,) = _figs(tmp_path / "far.h5")["memory.png"].axes
    (budget,) = [ln for lb, ln in _lines(ax).items() if lb.startswith("budget")]
    assert budget.get_label() == f"{BUDGET} (4096 MiB, above the plot)"
    assert budget.get_ydata()[0] == 4096.0 and budget.get_linestyle() == "--"
    assert ax.get_yscale() == "linear" and ax.get_ylim()[1] < 4.0


def test_loss_plot_draws_weighted_terms_that_add_up(tmp_path):
    """loss.png drew unweighted terms beside the weighted total: now w * loss/<term>."""
    closure, data = np.linspace(50.0, 5.0, 8), np.linspace(0.2, 0.01, 8)
    with H5Log(tmp_path / "log.h5", attrs={"weights": {"closure": 1e-4}}) as log:
        for i in range(8):
            log.append({"iteration": i, "loss": 1e-4 * closure[i] + data[i],
                        "loss/closure": closure[i], "loss/data": data[i]})
    (ax,) = _figs(tmp_path)["loss.png"].axes
    lines = _lines(ax)
    assert set(lines) == {"loss (total)", "0.0001 × closure", "1 × data"}
    np.testing.assert_allclose(lines["0.0001 × closure"].get_ydata(), 1e-4 * closure)
    np.testing.assert_allclose(lines["0.0001 × closure"].get_ydata()
                               + lines["1 × data"].get_ydata(),
                               lines["loss (total)"].get_ydata())
    assert "weighted" in ax.get_title()
    text = summarize(read_log(tmp_path))
    assert "weight" in text and "1.0000e-04" in text and "terms unweighted" in text


def test_loss_plot_of_a_log_without_weights_says_so(tmp_path):
    full_log(tmp_path, n=5)
    (ax,) = _figs(tmp_path)["loss.png"].axes
    assert set(_lines(ax)) == {"loss (total)", "pde", "bc"}
    assert "no weights" in ax.get_title()
    assert "weight" not in summarize(read_log(tmp_path))


def test_summary_bounds_the_schedules_it_lists(tmp_path):
    """The schedule column holds full descriptions, which can differ in every row."""
    with H5Log(tmp_path / "log.h5") as log:
        for i in range(15):
            log.append({"iteration": i, "schedule": f"revolve(s={100 + i}) + {i} recorded steps"})
    line = next(ln for ln in summarize(read_log(tmp_path)).splitlines()
                if ln.startswith("schedules"))
    assert line.count("(1 rows)") == 10 and line.endswith("... (5 more schedules)")
    assert "revolve(s=100) + 0 recorded steps (1 rows)" in line


def test_summary_lists_metrics_before_training(tmp_path):
    metrics_log(tmp_path / "log.h5")
    text = summarize(read_log(tmp_path))
    head = next(ln for ln in text.splitlines() if ln.startswith("metric "))
    assert head.split() == ["metric", "before", "training", "first", "last", "iterations"]
    row = next(ln for ln in text.splitlines() if ln.startswith("metric/rel_err_closure"))
    assert row.split() == ["metric/rel_err_closure", "0.9", "0.1", f"{0.1 * 0.7**19:.4e}",
                           "0..19"]
    row = next(ln for ln in text.splitlines() if ln.startswith("metric/time_solve"))
    assert row.split()[1] == "-"                      # no value before training
    metrics_log(tmp_path / "old.h5", initial=False)   # an older log: no such column
    assert "before training" not in summarize(read_log(tmp_path / "old.h5"))


def test_plots_of_a_real_training_log(tmp_path):
    """A log the trainer wrote: memory labelled for the CPU, the budget line at the run's
    budget, the metric's baseline at iteration -1, the terms weighted."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "deepsolve", "train",
                        str(root / "tests" / "data" / "tiny_problem.py"), "--out", str(out),
                        "--iterations", "5", "--set", "budget=20%", "--quiet"],
                       env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    log = read_log(out)
    figs = _figs(out)
    (mem,) = figs["memory.png"].axes
    lines = _lines(mem)
    assert f"{REAL_PEAK} (RSS above the run's baseline)" in lines
    assert not any("device" in lb or "host" in lb for lb in lines)
    budget = log.attrs["budget_bytes"]
    assert lines[BUDGET].get_ydata()[0] == pytest.approx(budget / MiB)
    assert "the real peak is the whole iteration's" in mem.get_title()
    summary = summarize(log)                    # the config shows the threads the run used
    assert "threads" in log.attrs and log.attrs["config"]["threads"] == 0
    (line,) = [ln.split() for ln in summary.splitlines() if ln.strip().startswith("threads ")]
    assert " ".join(line).startswith(f"threads = {log.attrs['threads']} (used; the setting is "
                                     "0: the default"), line
    (ax,) = figs["metrics.png"].axes
    (mark,) = _baselines(ax)
    assert mark.get_ydata()[0] == pytest.approx(log.attrs["initial_metrics"]["rate_error"])
    (loss,) = figs["loss.png"].axes
    assert {"1 × misfit", "1 × prior"} <= set(_lines(loss)) and "weighted" in loss.get_title()
    assert "before training" in summarize(log)


def test_gradients_plot_of_a_run_with_adjoint_norms(tmp_path):
    """gradients.png: one adjoint-norm curve per logged iteration (log scale, the logged
    values), and the pre-clip gradient norm against iteration."""
    from pathlib import Path

    from deepsolve.io import read_curves
    from deepsolve.train import train

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    train(str(root / "tests" / "data" / "tiny_problem.py"), out=str(out), quiet=True,
          sets=["iterations=6", "adjoint_every=2", "snapshots=4"])
    figs = _figs(out)
    adj, grad = figs["gradients.png"].axes
    assert adj.get_yscale() == "log" and adj.get_xlabel() == "step i"
    curves = read_curves(out, "adjoint_norms")
    lines = _lines(adj)
    assert set(lines) == {f"iteration {i}" for i in (0, 2, 4)}
    ln = lines["iteration 2"]
    s, v = curves["step"][1], curves["value"][1]
    ok = s >= 0
    assert np.array_equal(ln.get_xdata(), s[ok]) and np.allclose(ln.get_ydata(), v[ok])
    (g,) = grad.get_lines()
    assert np.allclose(g.get_ydata(), read_log(out).columns["grad_norm"])
    assert "before clipping" in grad.get_title()


def test_evaluation_curves_are_logged_and_drawn(tmp_path):
    """An evaluate() that returns a deepsolve.Curve: the log's group eval_<name> holds it for
    the model as built (iteration -1) and every evaluated iteration, with the values the
    problem computed; evaluation.png draws the last one beside the one as built."""
    from pathlib import Path

    from deepsolve.io import curve_names, read_curves
    from deepsolve.train import train

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    train(str(root / "tests" / "data" / "tiny_problem.py"), out=str(out), quiet=True,
          sets=["iterations=8", "eval_every=4", "curve=true"])
    assert "eval_x_error" in curve_names(out / "log.h5")
    c = read_curves(out / "log.h5", "eval_x_error")
    assert list(c["iteration"]) == [-1, 3, 7]
    steps = np.arange(0, 51, 10)
    assert np.array_equal(c["step"][0][:6], steps) and (c["step"][0][6:] == -1).all()
    x0 = np.linspace(0.5, 1.5, 4)          # the model as built: rate 0.1 against 0.8
    want = [np.abs((1 - 0.02 * 0.1) ** i * x0 - (1 - 0.02 * 0.8) ** i * x0).mean()
            for i in steps]
    assert np.allclose(c["value"][0][:6], want, rtol=1e-5)
    assert c["value"][2][5] < 0.5 * c["value"][0][5]       # training brought it down
    (ax,) = _figs(out)["evaluation.png"].axes
    lines = _lines(ax)
    assert set(lines) == {"x_error", "x_error (as built)"}
    assert np.array_equal(lines["x_error"].get_xdata(), steps)
    assert np.allclose(lines["x_error"].get_ydata(), c["value"][2][:6])
    assert lines["x_error (as built)"].get_linestyle() == "--"
    assert "after iteration 8" in ax.get_title()


def test_no_evaluation_plot_without_curves(tmp_path):
    p = tmp_path / "log.h5"
    with H5Log(p, attrs={"initial_metrics": {"e": 1.0}}) as log:
        log.append({"iteration": 0, "loss": 1.0, "metric/e": 0.5})
    assert "evaluation.png" not in _figs(p)


def test_no_gradients_plot_without_gradient_data(tmp_path):
    from deepsolve.io import H5Log

    p = tmp_path / "log.h5"
    with H5Log(p) as log:
        log.append({"iteration": 0, "loss": 1.0})
    assert "gradients.png" not in _figs(p)


def test_report_never_writes_through_a_planted_link(tmp_path):
    """With RUN/loss.png a symbolic link to a file elsewhere, report wrote a PNG into that
    file. Now each plot is a new file renamed over the name: the link is replaced and its
    target left as it was; a link at the temporary name is not followed either."""
    run = tmp_path / "run"
    run.mkdir()
    full_log(run, n=5)
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("precious")
    (run / "loss.png").symlink_to(victim)
    (run / f".memory.png.tmp-{os.getpid()}").symlink_to(victim)
    text = report(run)
    assert victim.read_text() == "precious"
    for name in ("loss.png", "memory.png"):
        p = run / name
        assert not p.is_symlink() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(p) in text
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name]
