"""Domain decomposition (deepsolve.distributed: halo_exchange, Slab, the mesh, the agreed
plan) on CPU with gloo: 2 and 4 processes against the single-process computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import deepsolve
from deepsolve.distributed import Slab, halo_exchange, parse_mesh
from deepsolve.io import read_log
from deepsolve.memory import agree

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "data", "domain_worker.py")
SW = os.path.join(ROOT, "problems", "shallow_water.py")

# torchrun leaves a torchelastic_* directory in the temporary directory at every launch: the
# launched processes get the test's own (conftest.py)
pytestmark = pytest.mark.usefixtures("child_tmpdir")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _torchrun(nproc: int, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), *args]
    return subprocess.run(cmd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)


def _worker(tmp_path, nproc: int, scenario: str, **env) -> list[dict]:
    out = tmp_path / f"{scenario}{nproc}"
    out.mkdir()
    _torchrun(nproc, WORKER, scenario, str(out), env=_env(**env))
    res = []
    for r in range(nproc):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing"
        res.append(json.loads(path.read_text()))
        assert "exception" not in res[-1], res[-1]["exception"]
    return res


# --- one process: the pads it replaces, the layout, the settings --------------------------

def test_halo_exchange_on_one_process_is_the_circular_or_zero_pad():
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    y = halo_exchange(x, -2, 2)
    assert torch.equal(y, torch.cat([x[:, -2:], x, x[:, :2]], dim=1))
    z = halo_exchange(x, 1, 1, periodic=False)
    assert torch.equal(z[:, 1:-1], x) and not z[:, 0].any() and not z[:, -1].any()
    with pytest.raises(ValueError, match="fewer than the halo width"):
        halo_exchange(x, -2, 6)
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        halo_exchange(x, -2, 0)
    with pytest.raises(ValueError, match="no process group"):
        halo_exchange(x, -2, 1, group=object())


def test_slab_on_one_process_is_the_whole_grid_and_its_shares_add_up():
    s = Slab(10, dim=-2, halo=1)
    assert (s.size, s.rank, s.start, s.stop, s.sizes) == (1, 0, 0, 10, [10])
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    assert s.local(x) is x and s.gather(x) is x
    assert torch.allclose(s.mean(x), x.mean())
    assert torch.equal(s.share(torch.tensor(3.0)), torch.tensor(3.0))
    with pytest.raises(ValueError, match="give the full field"):
        s.local(x[:, :5])
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        Slab(0)


def test_parse_mesh_reads_data_by_space_and_refuses_a_wrong_count():
    assert parse_mesh("", 4) is None
    assert parse_mesh("2x2", 4) == (2, 2)
    assert parse_mesh("*x4", 8) == (2, 4) and parse_mesh("1x*", 4) == (1, 4)
    with pytest.raises(ValueError, match="asks for 2x3 = 6 processes but this run has 4"):
        parse_mesh("2x3", 4)
    with pytest.raises(ValueError, match="is not DATAxSPACE"):
        parse_mesh("two", 4)
    with pytest.raises(ValueError, match="3 does not divide"):
        parse_mesh("*x3", 4)


def test_agreement_is_the_identity_without_a_group():
    prof = deepsolve.memory.profiling.profile_step(lambda x, i: x * 2, torch.ones(3))
    assert agree.agree_profile(prof, None) is prof
    assert agree.agree_min(7, None) == 7
    b = deepsolve.Budget("1MiB", group=None)
    p = deepsolve.plan(lambda x, i: torch.sin(x), torch.ones(10, requires_grad=True), 20,
                       budget="1MiB", group=b.group)
    assert p.schedule.n_steps == 20


# --- 2 and 4 processes ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_halo_exchange_equals_the_pad_it_replaces_and_passes_gradcheck(tmp_path, nproc):
    for rank, res in enumerate(_worker(tmp_path, nproc, "halo")):
        for key, v in res.items():
            if key.endswith("_gradcheck"):
                assert v is True, (rank, key)
            else:  # values and vector-Jacobian products: the same sums, exactly
                assert v <= 1e-15, (rank, key, v)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_decomposed_checkpointed_unroll_has_the_single_process_gradients(tmp_path, nproc):
    res = _worker(tmp_path, nproc, "unroll")
    schedules = {r["budget_schedule"] for r in res}
    assert len(schedules) == 1, f"the ranks planned differently: {schedules}"
    for r in res:
        for how in ("snapshots", "budget"):
            assert r[f"{how}_param_err"] < 1e-10 and r[f"{how}_x0_err"] < 1e-10, r
        assert r["snapshots_counts"] == r["single_counts"]   # the same schedule per rank
        # tracked memory at the same schedule: the block's share of the single-process peak
        share = r["snapshots_tracked"] / r["tracked_single"]
        rows, n = r["rows"], r["n"]
        assert rows / n * 0.9 <= share <= (rows + 4) / n, (share, rows, n)
    assert sum(r["rows"] for r in res) == res[0]["n"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [4])   # rank 1's neighbours (0, 2) and a rank beyond (3)
def test_a_rank_that_raises_inside_a_step_stops_every_rank_with_one_line(tmp_path, nproc):
    t0 = time.perf_counter()
    res = _worker(tmp_path, nproc, "raise", GROUP_TIMEOUT="30")
    assert time.perf_counter() - t0 < 60
    assert res[1]["error"] == "RuntimeError" and "fails inside step 3" in res[1]["message"]
    for r, out in enumerate(res):
        if r != 1:
            assert out["error"] == "HaloTimeout", out
            assert "\n" not in out["message"] and "failed or stopped" in out["message"]
            assert out["seconds"] < 10   # a closed connection is seen at once


@pytest.mark.slow
def test_a_rank_that_stops_answering_stops_the_others_within_the_group_timeout(tmp_path):
    t0 = time.perf_counter()
    res = _worker(tmp_path, 2, "hang", GROUP_TIMEOUT="3")
    assert res[1]["error"] == "hung"
    assert res[0]["error"] == "HaloTimeout" and "\n" not in res[0]["message"], res[0]
    assert 2 < res[0]["seconds"] < 3 + 4   # the timeout, not rank 1's 8 s
    assert time.perf_counter() - t0 < 60


# --- the trainer: problems/shallow_water.py on 1, 2 and 4 processes -------------------------

TINY = ["nx=16", "ny=16", "steps=20", "obs_every=5", "iterations=3", "lbfgs_iters=2",
        "members=2", "budget=", "snapshots=4", "checkpoint_every=1", "eval_every=0"]


def _sets(*extra):
    return [a for s in (*TINY, *extra) for a in ("--set", s)]


def _train_torchrun(nproc, out, *extra, timeout=300):
    r = _torchrun(nproc, "-m", "deepsolve", "train", SW, "--out", str(out), "--quiet",
                  *_sets(*extra), timeout=timeout)
    return r


def _coef(run_dir):
    return torch.load(os.path.join(run_dir, "restart.pt"), weights_only=True)["model"]["coef"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    from deepsolve.train import train

    out = tmp_path_factory.mktemp("sw1")
    sets = [s for s in TINY]
    res = train(SW, sets=sets, out=str(out), quiet=True)
    return out, res


@pytest.mark.slow
# 4-way space alone is covered by the decomposed-unroll and halo tests on 4 processes
@pytest.mark.parametrize("nproc,mesh", [(2, ""), (4, "2x2")])
def test_shallow_water_trains_the_same_on_one_and_on_several_processes(tmp_path, single_run,
                                                                       nproc, mesh):
    out1, res1 = single_run
    extra = [f"mesh={mesh}"] if mesh else []
    r = _train_torchrun(nproc, tmp_path / "run", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    c1, ck = _coef(out1), _coef(tmp_path / "run")
    assert float(c1.abs().max()) > 1e-4   # it trained
    assert float((ck - c1).abs().max() / c1.abs().max()) < 1e-10
    log1 = read_log(os.path.join(out1, "log.h5"))
    logk = read_log(os.path.join(tmp_path / "run", "log.h5"))
    for term in ("loss", "loss/misfit", "grad_norm"):
        a, b = log1.columns[term], logk.columns[term]
        assert abs(a - b).max() <= 1e-10 * abs(a).max(), term


@pytest.mark.slow
def test_a_mesh_over_a_problem_that_does_not_decompose_is_refused(tmp_path):
    r = _torchrun(2, "-m", "deepsolve", "train", os.path.join(HERE, "data", "batch_problem.py"),
                  "--out", str(tmp_path / "b"), "--quiet", "--set", "mesh=1x2")
    assert r.returncode != 0
    assert "does not decompose its domain (ctx.slab)" in r.stderr


@pytest.mark.slow
def test_a_budget_only_two_ranks_can_meet_is_refused_on_one_and_met_on_two(tmp_path):
    from helpers import make_ctx

    from deepsolve.memory.profiling import profile_step
    from deepsolve.memory.strategies import Revolve
    from deepsolve.problem import load_problem

    problem, _ = load_problem(SW)
    grid = ["nx=16", "ny=32", "steps=20", "obs_every=5", "members=2", "budget="]
    ctx = make_ctx(problem, grid, dtype=torch.float64)
    req = ctx.first_unroll(lambda: problem.residuals(ctx, 0))
    minimum = Revolve(1).predicted_peak(profile_step(req.step, req.state), req.n_steps)
    budget = int(0.75 * minimum)       # a block of 16 rows (+2 halo rows) needs about 56 %
    sets = [a for s in (*grid, f"budget={budget}", "iterations=1", "lbfgs_iters=1")
            for a in ("--set", s)]
    one = subprocess.run([sys.executable, "-m", "deepsolve", "train", SW, "--out",
                          str(tmp_path / "one"), "--quiet", *sets], env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert one.returncode != 0 and "below the minimum" in one.stderr, one.stderr[-2000:]
    two = _torchrun(2, "-m", "deepsolve", "train", SW, "--out", str(tmp_path / "two"),
                    "--quiet", *sets, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    log = read_log(os.path.join(tmp_path / "two", "log.h5"))
    assert float(log.columns["peak_tracked_memory_max"][0]) <= budget


@pytest.mark.slow
def test_a_rank_that_raises_in_training_makes_every_rank_exit_with_one_line(tmp_path):
    t0 = time.perf_counter()
    r = _torchrun(2, "-m", "deepsolve", "train", os.path.join(HERE, "data",
                                                              "failing_slab_problem.py"),
                  "--out", str(tmp_path / "f"), "--quiet", "--set", "dist_timeout=10")
    assert time.perf_counter() - t0 < 90
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if "deepsolve train: error:" in ln]
    assert any("rank 1 fails inside step 3" in ln for ln in errors), r.stderr[-3000:]
    assert any("halo exchange" in ln and "failed or stopped" in ln for ln in errors), \
        r.stderr[-3000:]
    # the iteration before the failure is kept: the log and the restart file are valid
    log = read_log(os.path.join(tmp_path / "f", "log.h5"))
    assert log.n_rows >= 1


def test_submit_writes_a_batch_script_for_a_decomposed_run(tmp_path, capsys):
    from deepsolve.cli import main

    out = tmp_path / "sw"
    assert main(["submit", SW, "--nodes", "2", "--gpus-per-node", "4", "--time", "02:00:00",
                 "--out", str(out), "--dry-run", "--", "--set", "mesh=2x4"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    assert "NPROC=4" in text and "shallow_water.py" in text and "mesh=2x4" in text
    assert "--device cuda" in text
