"""Kill test: SIGKILL a small training run at seeded random moments (before its first restart
file too, mid-flush, between the log flush and the restart file, right after the restart
file is published), then ``--resume`` it to completion: every log must end with iterations
0..N-1, no gap, no duplicate, and float64 losses equal to those of an uninterrupted run (a
run killed before it wrote anything has nothing to resume: it is started again).

The runs are forked from one "zygote" process that has imported torch and deepsolve once
(a fresh interpreter costs seconds of CPU on a loaded machine), with one thread each. A kill
moment is an event of the run, counted in the child: the k-th ``H5Log.append`` (before it),
``h5py.Dataset.resize`` (after it: a flush torn between columns), ``os.replace`` (after it:
a log or restart file just published), ``os.replace`` of ``restart.pt`` (after it),
``os.fsync`` or ``torch.save`` (before it: a restart file half-written), or ``build`` (before
the problem is built). The moments are drawn with a seeded RNG from all the events of an
uninterrupted run, so every run of the test kills at the same moments.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from deepsolve.io import EmptyLogError, read_log

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = str(HERE / "data" / "tiny_problem.py")
N = 12                     # iterations; restart files after iterations 2, 5, 8, 11
SEED = 20261201
EXACT = ("loss", "loss/misfit", "loss/prior", "grad_norm", "lr", "metric/rate_error")

ZYGOTE = r"""
import json, os, signal, sys
import h5py, torch
import torch._dynamo  # what torch.optim imports on first use: seconds, so once, here
import deepsolve.cli, deepsolve.distributed, deepsolve.memory.meter, deepsolve.training.run
from deepsolve.io import h5log


def arm(kill):
    counts = {}

    def hit(name):
        counts[name] = counts.get(name, 0) + 1
        return kill is not None and kill[0] == name and counts[name] == kill[1]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def before(name, fn):
        def wrapped(*a, **k):
            if hit(name):
                die()
            return fn(*a, **k)
        return wrapped

    def after(name, fn, also=None):
        def wrapped(*a, **k):
            r = fn(*a, **k)
            if hit(name) or (also is not None and also(*a) and hit(also.__name__)):
                die()
            return r
        return wrapped

    def replace_restart(src, dst, *rest):
        return str(dst).endswith("restart.pt")

    h5log.H5Log.append = before("append", h5log.H5Log.append)
    h5py.Dataset.resize = after("resize", h5py.Dataset.resize)
    os.replace = after("replace", os.replace, replace_restart)
    os.fsync = before("fsync", os.fsync)
    torch.save = before("save", torch.save)
    deepsolve.training.run.build = before("build", deepsolve.training.run.build)
    return counts


for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        rc = 99
        try:
            fd = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            torch.set_num_threads(1)
            counts = arm(job["kill"])
            rc = deepsolve.cli.main(job["argv"])
            with open(job["output"] + ".counts", "w") as f:
                json.dump(counts, f)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    """A process that forks one training run per request (see the module docstring)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(ZYGOTE)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, out: Path, *, resume: bool = False, kill: tuple[str, int] | None = None,
            tag: str = "run") -> int:
        argv = ["train", TINY, "--out", str(out), "--quiet", "--dtype", "float64",
                "--iterations", str(N), "--set", "checkpoint_every=3"]
        if resume:
            argv.append("--resume")
        output = out.parent / f"{out.name}.{tag}.txt"
        job = {"argv": argv, "kill": list(kill) if kill else None, "output": str(output)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the zygote died"
        return json.loads(line)["rc"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def output(out: Path, tag: str) -> str:
    p = out.parent / f"{out.name}.{tag}.txt"
    return p.read_text(errors="replace") if p.exists() else ""


def check_after_kill(out: Path) -> None:
    """What a kill leaves is valid: the log (if any) reads as a consistent prefix of whole
    rows 0..n-1, the restart file (if any) loads and is not ahead of the log."""
    rows = None
    if (out / "log.h5").exists():
        try:
            log = read_log(out / "log.h5")
        except EmptyLogError:
            rows = 0
        else:
            rows = log.n_rows
            np.testing.assert_array_equal(log.columns["iteration"], np.arange(rows))
            assert all(len(c) == rows for c in log.columns.values())
    if (out / "restart.pt").exists():
        k = torch.load(out / "restart.pt", weights_only=True)["iteration"]
        assert rows is not None and k <= rows, (k, rows)


def check_complete(out: Path, ref) -> None:
    log = read_log(out / "log.h5")
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(N))
    for c in EXACT:
        np.testing.assert_array_equal(log.columns[c], ref.columns[c], err_msg=c)
    assert log.columns["loss"].dtype == np.float64
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == N
    left = [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert not left, left


def kill_moments(counts: dict[str, int]) -> list[tuple[str, int]]:
    """Forced moments (before the first restart file; right after a restart file is
    published; a half-written restart file) and seeded random ones from all events."""
    forced = [("build", 1), ("append", 1), ("append", 2), ("resize", 1), ("replace", 1),
              ("replace_restart", 1), ("replace_restart", 3), ("fsync", 2)]
    universe = [(e, k) for e in ("append", "resize", "replace", "fsync", "save")
                for k in range(1, counts.get(e, 0) + 1)]
    rng = random.Random(SEED)
    drawn = rng.sample([m for m in universe if m not in forced], 8)
    return forced + drawn


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(zygote, tmp_path):
    ref_dir = tmp_path / "ref"
    assert zygote.run(ref_dir) == 0, output(ref_dir, "run")
    ref = read_log(ref_dir / "log.h5")
    counts = json.loads((tmp_path / "ref.run.txt.counts").read_text())
    assert counts["append"] == N and counts["replace_restart"] == 4
    moments = kill_moments(counts)
    assert len(moments) >= 10
    before_first_restart = 0
    for i, kill in enumerate(moments):
        out = tmp_path / f"k{i}"
        rc = zygote.run(out, kill=kill, tag="killed")
        assert rc == -9, (kill, rc, output(out, "killed"))
        check_after_kill(out)
        before_first_restart += not (out / "restart.pt").exists()
        if not (out / "log.h5").exists() and not (out / "restart.pt").exists():
            # killed before it wrote anything: nothing to resume, which --resume says in one
            # line; the run is started again without it (as the SLURM script does)
            assert zygote.run(out, resume=True, tag="nothing") == 2, kill
            assert "holds no run to resume" in output(out, "nothing")
            rc = zygote.run(out, tag="resumed")
        else:
            rc = zygote.run(out, resume=True, tag="resumed")
        assert rc == 0, (kill, output(out, "resumed"))
        check_complete(out, ref)
    assert before_first_restart >= 5


def test_repeated_kills_of_resumed_runs(zygote, tmp_path):
    """Kill, then kill the resumes too (while they publish the truncated log, mid-flush,
    while they write a restart file), then resume to completion."""
    ref_dir = tmp_path / "ref"
    assert zygote.run(ref_dir) == 0, output(ref_dir, "run")
    ref = read_log(ref_dir / "log.h5")
    out = tmp_path / "run"
    assert zygote.run(out, kill=("append", 5), tag="k0") == -9
    for j, kill in enumerate([("replace", 1), ("resize", 3), ("fsync", 2), ("append", 2)]):
        rc = zygote.run(out, resume=True, kill=kill, tag=f"k{j + 1}")
        assert rc == -9, (kill, rc, output(out, f"k{j + 1}"))
        check_after_kill(out)
    assert zygote.run(out, resume=True, tag="done") == 0, output(out, "done")
    check_complete(out, ref)
