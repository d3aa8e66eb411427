"""Every shipped unrolled problem trains through the CLI for a few iterations and writes a
log with one row per iteration and the documented column names."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepsolve.cli import main
from deepsolve.io import read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = {
    "navier_stokes.py": ["fine_n=32", "coarse_n=16", "curriculum=", "dt=0.02", "steps=20",
                         "obs_every=10",
                         "spinup=0.2", "n_train=2", "n_test=2", "batch=2", "width=4",
                         "depth=2", "budget=512KiB"],  # about twice the minimum,
    "burgers_assimilation.py": ["steps=60", "n=32"],
    "implicit_heat.py": [],
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_cli_trains_problem_file(name, tmp_path):
    path = os.path.join(ROOT, "problems", name)
    sets = [a for kv in TINY[name] for a in ("--set", kv)]
    if name == "navier_stokes.py":
        sets += ["--set", f"data_dir={tmp_path / 'data'}"]
    out = tmp_path / "run"
    rc = main(["train", path, "--out", str(out), "--iterations", "3", "--quiet", *sets])
    assert rc == 0
    log = read_log(out / "log.h5")
    assert log.n_rows == 3
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(3))
    terms = [c for c in log.columns if c.startswith("loss/")]
    assert terms, "no loss terms logged"
    for c in ["loss", *terms]:
        assert np.all(np.isfinite(log.columns[c])), c
    assert np.all(log.columns["recorded"] > 0)  # the problem unrolled through ctx.unroll
    metrics = [c for c in log.columns if c.startswith("metric/")]
    assert metrics and np.isfinite(log.columns[metrics[0]][-1])  # evaluated at the end


@pytest.mark.parametrize("argv,match", [
    (["plan", "--steps", "10", "--snapshots", "3", "--png", "{tmp}/no/such/dir/x.png"],
     "does not exist"),
    (["plan", "--steps", "10", "--snapshots", "3", "--png", "{tmp}"], "is a directory"),
    (["plan", "--steps", "10", "--snapshots", "3", "--png", "/proc/deepsolve-x.png"],
     "cannot write it"),
    (["plan", "--steps", "10"], "revolve needs --snapshots"),
    (["submit", os.path.join(ROOT, "tests", "data", "tiny_problem.py"), "--gpus-per-node",
      "0", "--time", "01:00:00", "--dry-run", "--out", "/proc/deepsolve-run"],
     "cannot make the run directory"),
    (["submit", os.path.join(ROOT, "tests", "data", "tiny_problem.py"), "--gpus-per-node",
      "0", "--time", "01:00:00", "--dry-run", "--out", "{tmp}/file/run"],
     "cannot make the run directory"),
    (["report", "{tmp}/no-run"], ""),
])
def test_bad_paths_and_arguments_are_one_line_errors(argv, match, tmp_path, capsys):
    """A bad --png path, a run directory that cannot be made, a missing run: exit code 2 and
    one line on stderr naming what is wrong (a traceback before)."""
    (tmp_path / "file").write_text("not a directory")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deepsolve {argv[0]}: error: ") and err.count("\n") == 1, err
    assert match in err
    assert not os.path.exists(f"{tmp_path}.png")  # matplotlib appends .png to a directory


def test_an_oserror_anywhere_is_one_line(monkeypatch, capsys, tmp_path):
    """main() turns an OSError from any command into one line with the file name."""
    import deepsolve.cli as cli

    def boom(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(cli, "_cmd_report", boom)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"deepsolve report: error: {tmp_path / 'x'}: Permission denied\n"
