"""--tensorboard: the trainer mirrors the HDF5 log's scalars to TensorBoard event files,
read back here with TensorBoard's own reader and compared with the log, row by row."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

from deepsolve.cli import main
from deepsolve.io import read_log
from deepsolve.io.tracking import MirroredLog, TensorBoardMirror, TrackingError

pytest.importorskip("tensorboard", reason="install the [tensorboard] extra")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "data", "tiny_problem.py")


def _events(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc: EventAccumulator, tag: str) -> tuple[np.ndarray, np.ndarray]:
    ev = acc.Scalars(tag)
    return np.array([e.step for e in ev]), np.array([e.value for e in ev])


def _check_mirror(run_dir, logdir, n: int) -> None:
    """Every numeric column of the log is a scalar tag with the log's values (float32)."""
    log = read_log(run_dir / "log.h5")
    acc = _events(logdir)
    tags = set(acc.Tags()["scalars"])
    it = log.columns["iteration"]
    assert list(it) == list(range(n))
    checked = 0
    for name, col in log.columns.items():
        if name == "iteration" or col.dtype.kind not in "fiu":
            continue
        keep = ~np.isnan(col) if col.dtype.kind == "f" else np.ones(len(col), bool)
        if not keep.any():
            assert name not in tags
            continue
        assert name in tags, f"{name} not mirrored"
        steps, values = _scalars(acc, name)
        np.testing.assert_array_equal(steps, it[keep], err_msg=name)
        np.testing.assert_allclose(values, col[keep].astype(np.float32), rtol=1e-6,
                                   err_msg=name)
        checked += 1
    for need in ("loss", "loss/misfit", "loss/prior", "time", "peak_real_memory", "advances",
                 "metric/rate_error"):
        assert need in tags, need
    assert checked >= 10


def test_train_mirrors_every_scalar_of_the_log(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", TINY, "--out", str(out), "--iterations", "6", "--quiet",
                 "--set", "eval_every=2", "--set", "budget=1MiB", "--tensorboard"]) == 0
    _check_mirror(out, out / "tensorboard", 6)
    # a metric evaluated every 2nd iteration (and at the end) is mirrored only where it is
    steps, _ = _scalars(_events(out / "tensorboard"), "metric/rate_error")
    assert list(steps) == [1, 3, 5]
    assert "schedule/text_summary" in _events(out / "tensorboard").Tags()["tensors"]   # text


def test_resume_hides_the_events_after_the_restart_file(tmp_path, capsys):
    """A run stopped at 4 (restart file at 4) and resumed to 8 shows one value per step."""
    out = tmp_path / "run"
    assert main(["train", TINY, "--out", str(out), "--iterations", "4", "--quiet",
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    # events a killed run wrote beyond its restart file: steps 4 and 5 with wrong values
    extra = TensorBoardMirror(str(tmp_path / "tb"))
    for k in (4, 5):
        extra.append({"iteration": k, "loss": 1e9})
    extra.close()
    assert main(["train", TINY, "--out", str(out), "--iterations", "8", "--quiet", "--resume",
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    _check_mirror(out, tmp_path / "tb", 8)


def test_mirror_skips_missing_values_and_writes_text_once(tmp_path):
    m = TensorBoardMirror(str(tmp_path))
    m.append({"iteration": 0, "loss": np.float64(2.0), "metric/e": math.nan, "n": None,
              "schedule": "revolve"})
    m.append({"iteration": 1, "loss": 1.5, "metric/e": 0.25, "schedule": "revolve"})
    m.close()
    acc = _events(tmp_path)
    assert _scalars(acc, "loss")[1].tolist() == [2.0, 1.5]
    assert _scalars(acc, "metric/e")[0].tolist() == [1]
    assert "n" not in acc.Tags()["scalars"]
    assert len(acc.Tensors("schedule/text_summary")) == 1   # written once: unchanged


def test_mirrored_log_writes_the_record_first(tmp_path):
    class Record:
        def __init__(self):
            self.rows, self.columns = [], ["loss"]

        def append(self, row):
            self.rows.append(dict(row))

        def close(self):
            self.closed = True

    class Broken:
        def append(self, row):
            raise OSError("disk full")

        def close(self):
            pass

    rec = Record()
    log = MirroredLog(rec, Broken())
    with pytest.raises(OSError):
        log.append({"iteration": 0, "loss": 1.0})
    assert rec.rows == [{"iteration": 0, "loss": 1.0}]   # the HDF5 record got the row
    assert log.columns == ["loss"]                         # the rest is the log's
    log.close()
    assert rec.closed


def test_without_tensorboard_the_cli_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # import fails
    with pytest.raises(TrackingError, match=r"pip install 'deepsolve\[tensorboard\]'"):
        TensorBoardMirror(str(tmp_path))
    assert main(["train", TINY, "--out", str(tmp_path / "run"), "--iterations", "2",
                 "--quiet", "--tensorboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deepsolve[tensorboard]" in err[0], err
