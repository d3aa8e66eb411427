"""Data-parallel training on CPU (gloo) under torchrun: the same parameters as one process
over the full batch, one log, and a signal on one rank stopping every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from deepsolve.cli import main
from deepsolve.distributed import DistInfo, DistributedContext, average_gradients, shard
from deepsolve.io import read_log

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = os.path.join(HERE, "data", "batch_problem.py")

# torchrun leaves a torchelastic_* directory in the temporary directory at every launch: the
# launched processes get the test's own (conftest.py)
pytestmark = pytest.mark.usefixtures("child_tmpdir")


def _torchrun(out, *extra, signals=False):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2"]
    if signals:
        cmd += ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    cmd += ["-m", "deepsolve", "train", BATCH, "--out", str(out), "--quiet", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _params(run_dir):
    return torch.load(os.path.join(run_dir, "restart.pt"), weights_only=True)["model"]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


# ------------------------------------------------------------------ helpers, one process


def test_shard_splits_a_batch_into_near_equal_blocks():
    for n in (0, 1, 7, 8, 13):
        for world in (1, 2, 3, 5):
            parts = [shard(n, r, world) for r in range(world)]
            idx = [i for s in parts for i in range(n)[s]]
            assert idx == list(range(n))
            sizes = [s.stop - s.start for s in parts]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        shard(4, 2, 2)


def test_context_shard_takes_this_ranks_part():
    ctx = DistributedContext({"seed": 0}, torch.device("cpu"), torch.float64, 1, 3)
    x = torch.arange(10.0)
    assert torch.equal(ctx.shard(x), torch.arange(4.0, 7.0))
    assert ctx.shard(10) == slice(4, 7) == ctx.batch_slice(10)
    assert torch.equal(ctx.shard(x.reshape(2, 5), dim=1), torch.tensor([[2.0, 3.0], [7.0, 8.0]]))
    one = DistributedContext({"seed": 0}, torch.device("cpu"), torch.float64)
    assert one.shard(x) is x
    with pytest.raises(TypeError):
        ctx.shard([1, 2])
    terms = {"a": torch.tensor(1.0)}
    loss = torch.tensor(2.0)
    assert average_gradients(DistInfo(), [], terms, loss) == (terms, loss)


# ------------------------------------------------------------------ two processes


@pytest.mark.slow
def test_a_rank_frees_its_run_and_process_group_when_train_returns(tmp_path):
    """``train`` under torchrun leaves nothing of the run behind in the rank: no context
    (its model, data and mesh, and through the mesh the gloo groups whose threads, alive at
    the interpreter's exit, abort the process), no process group."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", os.path.join(HERE, "data", "teardown_worker.py"),
                        str(tmp_path / "run")], env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: contexts alive 0, process group False" in p.stdout, p.stdout


@pytest.mark.slow
def test_two_processes_give_the_parameters_of_one_process(tmp_path):
    out2, out1 = tmp_path / "two", tmp_path / "one"
    proc = _torchrun(out2, "--iterations", "5")
    assert main(["train", BATCH, "--out", str(out1), "--iterations", "5", "--quiet"]) == 0
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    p1, p2 = _params(out1), _params(out2)
    for k in p1:
        np.testing.assert_allclose(p2[k].numpy(), p1[k].numpy(), rtol=0, atol=1e-6)
        assert not torch.equal(p1[k], torch.zeros_like(p1[k]))
    assert sorted(os.listdir(out2)) == ["log.h5", "restart.pt"]  # rank 0 alone writes
    log, ref = read_log(out2 / "log.h5"), read_log(out1 / "log.h5")
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(5))
    np.testing.assert_allclose(log.columns["loss"], ref.columns["loss"], rtol=1e-9)
    assert log.attrs["world_size"] == 2 and ref.attrs["world_size"] == 1
    for k in ("peak_host_memory_max", "peak_device_memory_max"):
        assert k in log.columns and k not in ref.columns
    assert np.all(log.columns["peak_host_memory_max"] >= log.columns["peak_host_memory"])
    # torchelastic's directory is in this test's temporary directory, not the system's
    assert list((tmp_path / "tmp").glob("torchelastic_*"))


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_both_then_resume_completes(tmp_path):
    """SIGUSR1 to rank 1 alone: both ranks stop after the same iteration (the stop flag is
    all-reduced), rank 0 writes the restart file, both exit with 75; --resume finishes the
    run with the parameters of an uninterrupted one."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    n = 24
    proc = _torchrun(out, "--iterations", str(n), "--set", "sleep=0.2")
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (out / "log.h5").exists():
            time.sleep(0.1)
        assert (out / "log.h5").exists(), "training did not start"
        time.sleep(1.5)
        workers = {_rank_of(p): p for p in _children(proc.pid)}
        assert set(workers) == {0, 1}, workers
        os.kill(workers[1], signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0  # torchrun reports its workers' 75 as a failure
    assert "exitcode  : 75" in err or "exitcode: 75" in err.replace(" ", ""), err[-8000:]
    assert err.count("stopped by a signal after iteration") == 1, err[-2000:]
    done = torch.load(out / "restart.pt", weights_only=True)["iteration"]
    assert 0 < done < n
    first = read_log(out / "log.h5")
    np.testing.assert_array_equal(first.columns["iteration"], np.arange(done))
    assert not list(out.glob("restart.pt.tmp-*"))

    proc = _torchrun(out, "--iterations", str(n), "--resume")
    assert main(["train", BATCH, "--out", str(ref), "--iterations", str(n), "--quiet"]) == 0
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    log = read_log(out / "log.h5")
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(n))
    assert np.all(np.isfinite(log.columns["peak_host_memory_max"]))
    p, r = _params(out), _params(ref)
    for k in r:
        np.testing.assert_allclose(p[k].numpy(), r[k].numpy(), rtol=0, atol=1e-6)
