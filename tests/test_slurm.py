"""`deepsolve submit`: the generated sbatch script, and a real single-node SLURM run with a
signal, a requeue and a resumed rerun (see ../shared/notes/slurm-local.md).

The end-to-end test starts munged (if it is not running), slurmctld and slurmd itself, with a
configuration in a temporary directory and free ports, and stops what it started by PID. It
skips, saying why, where SLURM is not installed, the test does not run as root, or the
daemons do not come up.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from deepsolve.cli import main
from deepsolve.io import read_log
from deepsolve.slurm import SCRIPT_NAME, SubmitSpec, parse_time, sbatch_script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = os.path.join(HERE, "data", "batch_problem.py")
CRED_EXPIRE = 5  # seconds; SLURM's default (120) would delay a requeued job by minutes


def _script(tmp_path, **kw):
    args = dict(nodes=2, gpus_per_node=4, time="01:30:00", out=str(tmp_path / "run"))
    args.update(kw)
    return sbatch_script(SubmitSpec.create(BATCH, **args))


# ------------------------------------------------------------------ the script, no SLURM


def test_script_is_valid_bash_with_the_slurm_settings(tmp_path):
    text = _script(tmp_path, partition="gpu", account="proj1", cpus_per_task=16,
                   train_args=["--iterations", "50", "--set", "note=a b"])
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --time=01:30:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj1",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --ntasks-per-node=1"):
        assert line in text.splitlines(), line
    assert "srun " in text and "torchrun" in text
    assert '--nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC"' in text and "NPROC=4" in text
    assert '--rdzv-backend c10d --rdzv-endpoint "$MASTER_NODE:$PORT"' in text
    assert "PORT=29500" in text and "--device cuda" in text
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text  # torch 2.13
    assert "trap 'forward USR1' USR1" in text and "trap 'forward TERM' TERM" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "--resume" in text
    assert "wait \"$TRAIN_PID\"" in text
    assert "--iterations 50 --set 'note=a b'" in text
    # every #SBATCH line comes before the first command
    lines = text.splitlines()
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))


def test_cpu_nodes_use_tasks_per_node_and_cpu_device(tmp_path):
    text = _script(tmp_path, nodes=1, gpus_per_node=0, tasks_per_node=3)
    assert "NPROC=3" in text and "--device cpu" in text
    assert "--gpus-per-node" not in text.split("set -uo")[0]
    assert "#SBATCH --cpus-per-task=3" in text


def test_older_torchrun_gets_sigterm_instead_of_sigusr1(tmp_path, monkeypatch):
    import deepsolve.slurm as slurm

    monkeypatch.setattr(slurm, "_torchrun_forwards_usr1", lambda: False)
    text = _script(tmp_path)
    assert "--signals-to-handle" not in text and "trap 'forward TERM' USR1" in text
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


@pytest.mark.parametrize("args,match", [
    (["--time", "1:00"], "expected HH:MM:SS"),
    (["--time", "01:61:00"], "00..59"),
    (["--time", "00:00:00"], "must be positive"),
    (["--time", "00:02:59"], "at least 3 minutes"),
    ([], "--time is required"),
    (["--time", "01:00:00", "--nodes", "0"], "--nodes 0: must be >= 1"),
    (["--time", "01:00:00", "--gpus-per-node", "two"], "expected a whole number"),
    (["--time", "01:00:00", "--gpus-per-node", "-1"], "must be >= 0"),
    (["--time", "01:00:00", "--cpus-per-task", "0"], "--cpus-per-task 0"),
    (["--time", "01:00:00", "--partition", "a b"], "--partition"),
    (["--time", "01:00:00", "--", "--resume"], "adds --resume itself"),
])
def test_submit_rejects_bad_options_in_one_line(tmp_path, capsys, args, match):
    argv = ["submit", BATCH, "--dry-run", "--out", str(tmp_path / "r")]
    if "--gpus-per-node" not in args:
        argv += ["--gpus-per-node", "0"]
    if "--" in args:
        i = args.index("--")
        argv = argv + args[:i] + args[i:]
    else:
        argv += args
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepsolve submit: error:") and err.count("\n") == 1, err
    assert match in err


# ------------------------------------------------------------------ hostile values

#: Shell metacharacters that are legal in paths and arguments: command substitution,
#: backticks, separators, both quotes, a comment sign, a backslash, globs, variables.
HOSTILE = "a'$(touch PWNED)\"`touch PWNED`\";touch PWNED;#b\\ c*${IFS}|&>x<y"


def _stubs(tmp_path) -> tuple[str, str]:
    """A directory of stub ``srun``, ``scontrol``, ``sbatch``, ``torchrun`` and
    ``hostname`` commands; ``srun`` writes each of its arguments, NUL-terminated, to
    ``$SRUN_ARGS``. Returns ``(PATH, the srun record file)``."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    record = tmp_path / "srun-args"
    scripts = {
        "srun": '#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done > "$SRUN_ARGS"\n',
        "scontrol": "#!/bin/sh\necho node001\n",
        "sbatch": "#!/bin/sh\necho 1\n",
        "torchrun": "#!/bin/sh\nexit 0\n",
        "hostname": "#!/bin/sh\necho node001\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin", str(record)


def _run_script(tmp_path, text: str,
                extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the batch script under bash with the stubs on PATH, from an empty directory;
    returns the result and the arguments ``srun`` received."""
    path_env, record = _stubs(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": path_env, "SRUN_ARGS": record, "SLURM_JOB_ID": "7", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "node001", "HOME": str(tmp_path), **(extra_env or {})}
    res = subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=60)
    args = open(record, "rb").read().decode().split("\0")[:-1] if os.path.exists(record) \
        else []
    return res, args


def _pwned(tmp_path) -> list[str]:
    return [str(p) for p in tmp_path.rglob("PWNED")] + \
        [p for p in ("/tmp/PWNED", os.path.join(os.getcwd(), "PWNED")) if os.path.exists(p)]


def test_hostile_values_in_every_field_run_nothing(tmp_path):
    """Every path and name of the script holds shell metacharacters; the script, run with
    bash and stub SLURM commands, creates no file and hands every value to ``srun``
    verbatim, as one argument each."""
    hostile_dir = tmp_path / f"dir {HOSTILE}"
    hostile_dir.mkdir()
    problem = hostile_dir / f"prob {HOSTILE}.py"
    shutil.copy(BATCH, problem)
    workdir = hostile_dir / f"work {HOSTILE}"
    workdir.mkdir()
    out = hostile_dir / f"out {HOSTILE}"
    python = str(hostile_dir / f"py {HOSTILE}" / "python")
    train_args = ["--set", f"note={HOSTILE}", HOSTILE, "--iterations", "3"]
    spec = SubmitSpec.create(str(problem), gpus_per_node=0, time="01:00:00", out=str(out),
                             workdir=str(workdir), python=python, partition="p.1,x:y+z@w-",
                             account="acc_1", train_args=train_args)
    text = sbatch_script(spec)
    res, args = _run_script(tmp_path, text)
    assert _pwned(tmp_path) == [], res.stdout + res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert python in args  # `python -m torch.distributed.run` (no torchrun next to it)
    i = args.index("train")
    assert args[i + 1] == str(problem)
    assert args[args.index("--out") + 1] == str(out)
    assert args[-len(train_args):] == train_args
    assert os.path.isdir(out)  # mkdir -p "$RUN_DIR" got the literal name
    # the #SBATCH values, read back the way sbatch reads them: backslash escapes
    sb = {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in text.splitlines()
          if ln.startswith("#SBATCH --") and "=" in ln}
    unescape = lambda v: re.sub(r"\\(.)", r"\1", v)  # noqa: E731
    assert unescape(sb["#SBATCH --chdir"]) == str(workdir)
    assert unescape(sb["#SBATCH --output"]) == str(out / "slurm-%j.out")
    assert all(not re.search(r"(?<!\\)[\s'\"#]", v) for v in sb.values()), sb
    # the default job name comes from the file name, with unsafe characters replaced
    assert re.fullmatch(r"deepsolve-prob_a_[A-Za-z0-9_.+-]*_x_y", sb["#SBATCH --job-name"])


@pytest.mark.parametrize("field", ["out", "problem", "workdir", "python", "job_name",
                                   "partition", "account", "time", "train_args"])
@pytest.mark.parametrize("char", ["\n", "\r", "\x00", "\t", "\x1b", "\x85"])
def test_control_characters_are_refused_in_every_field(tmp_path, field, char):
    """A newline (or CR, NUL, tab, ESC, NEL) in any value is a one-line ValueError naming
    the option, before any file is written: with today's script a newline in --out, the
    problem path or the working directory became a command line of its own."""
    payload = f"x{char}touch {tmp_path}/PWNED{char}"
    kw = dict(gpus_per_node=0, time="01:00:00", out=str(tmp_path / "run"))
    problem = BATCH
    if field == "problem":
        problem = str(tmp_path / f"p{payload}.py")
        try:
            shutil.copy(BATCH, problem)
        except (OSError, ValueError):  # NUL: no such file can exist
            pass
    elif field == "train_args":
        kw["train_args"] = ["--set", f"note={payload}"]
    elif field == "time":
        kw["time"] = f"01:00:00{payload}"
    else:
        kw[field] = payload if field != "out" else str(tmp_path / payload)
    with pytest.raises(ValueError) as err:
        sbatch_script(SubmitSpec.create(problem, **kw))
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    label = {"out": "--out", "problem": "problem file", "workdir": "working directory",
             "python": "python", "job_name": "--job-name", "partition": "--partition",
             "account": "--account", "time": "--time", "train_args": "train argument"}[field]
    assert label in msg, msg
    assert not (tmp_path / "run").exists() and _pwned(tmp_path) == []


def test_issue_repro_newline_in_out_is_a_one_line_error(tmp_path, capsys):
    """The reported vector: ``--out $'/tmp/o\\ntouch /tmp/PWNED\\n'``."""
    out = f"{tmp_path}/o\ntouch {tmp_path}/PWNED\n"
    assert main(["submit", BATCH, "--gpus-per-node", "0", "--time", "01:00:00", "--dry-run",
                 "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepsolve submit: error: --out") and err.count("\n") == 1, err
    assert "control character" in err
    assert not os.path.exists(f"{tmp_path}/o") and _pwned(tmp_path) == []


def test_a_hand_built_spec_is_checked_too(tmp_path):
    spec = SubmitSpec.create(BATCH, gpus_per_node=0, time="01:00:00", out=str(tmp_path / "r"))
    spec.run_dir = f"{tmp_path}/r\ntouch {tmp_path}/PWNED"
    with pytest.raises(ValueError, match="--out"):
        sbatch_script(spec)
    spec.run_dir = str(tmp_path / "r")
    spec.nodes = "1\ntouch PWNED"  # type: ignore[assignment]
    with pytest.raises(ValueError):
        sbatch_script(spec)


def test_parse_time():
    assert parse_time("00:02:30") == 150
    assert parse_time("1-00:00:01") == 86401
    assert parse_time("36:00:00") == 36 * 3600


def test_dry_run_writes_and_prints_the_script(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["submit", BATCH, "--gpus-per-node", "0", "--time", "00:10:00", "--out",
                 str(out), "--dry-run", "--", "--iterations", "7"]) == 0
    captured = capsys.readouterr()
    text = (out / SCRIPT_NAME).read_text()
    assert captured.out.strip() == text.strip()
    assert "--iterations 7" in text and "dry run" in captured.err


def test_without_sbatch_the_script_is_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "run"
    assert main(["submit", BATCH, "--gpus-per-node", "0", "--time", "00:10:00", "--out",
                 str(out)]) == 0
    captured = capsys.readouterr()
    assert "#SBATCH --requeue" in captured.out
    assert "sbatch not found" in captured.err and str(out / SCRIPT_NAME) in captured.err


# ------------------------------------------------------------------ a real SLURM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _munge_ok() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10)
        return dec.returncode == 0 and b"STATUS:          Success" in dec.stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


class LocalSlurm:
    """munged (when not already running), slurmctld and slurmd on this machine, configured
    in ``root``; :meth:`stop` ends the processes it started, by PID."""

    def __init__(self, root):
        self.root = str(root)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def _start(self, name, argv, **kw):
        log = open(os.path.join(self.root, f"{name}.out"), "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True, **kw)
        log.close()
        self.procs.append((name, proc))
        return proc

    def _log_tail(self, name) -> str:
        for fn in (f"{name}.log", f"{name}.out"):
            p = os.path.join(self.root, fn)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    lines = [ln.strip() for ln in f if ln.strip()]
                if lines:
                    return " | ".join(lines[-3:])
        return "(no log)"

    def start(self) -> None:
        missing = [b for b in ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo",
                               "munge", "unmunge", "munged") if shutil.which(b) is None
                   and not os.path.exists(f"/usr/sbin/{b}")]
        if missing:
            pytest.skip(f"SLURM unavailable: {', '.join(missing)} not installed (apt-get "
                        "install slurmctld slurmd slurm-client munge)")
        if os.geteuid() != 0:
            pytest.skip("SLURM unavailable: the local SLURM test must run as root")
        self._start_munge()
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable"))
        mem_mb = max(avail // 1024 // 2, 256)
        for d in ("state", "spool"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        r = self.root
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=dstest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire={CRED_EXPIRE}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=1,sched_interval=1
ReturnToService=2
MailProg=/bin/true
MpiDefault=none
KillWait=5
NodeName={host} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        self._start("slurmctld", [self._sbin("slurmctld"), "-D", "-f", self.conf])
        self._start("slurmd", [self._sbin("slurmd"), "-D", "-f", self.conf])
        deadline = time.time() + 30
        while time.time() < deadline:
            for name, p in self.procs:
                if p.poll() is not None and name != "munged":
                    self.stop()
                    pytest.skip(f"SLURM unavailable: {name} exited with {p.returncode}: "
                                f"{self._log_tail(name)}")
            ping = self.run(["scontrol", "ping"], check=False)
            state = self.run(["sinfo", "-h", "-o", "%T"], check=False)
            if "UP" in ping.stdout and state.stdout.strip().startswith("idle"):
                return
            time.sleep(0.5)
        self.stop()
        pytest.skip(f"SLURM unavailable: the node did not become idle in 30 s "
                    f"(slurmctld: {self._log_tail('slurmctld')}; slurmd: "
                    f"{self._log_tail('slurmd')})")

    @staticmethod
    def _sbin(name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def _start_munge(self) -> None:
        if _munge_ok():
            return
        if not os.path.exists("/etc/munge/munge.key"):
            pytest.skip("SLURM unavailable: /etc/munge/munge.key is missing")
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        self._start("munged", [self._sbin("munged"), "--foreground"], user="munge",
                    group="munge")
        deadline = time.time() + 10
        while time.time() < deadline:
            if _munge_ok():
                return
            time.sleep(0.2)
        self.stop()
        pytest.skip(f"SLURM unavailable: munged did not start ({self._log_tail('munged')})")

    def run(self, argv, check=True, **kw) -> subprocess.CompletedProcess:
        res = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=30,
                             **kw)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed: {res.stderr.strip()}")
        return res

    def job(self, job_id: str) -> dict[str, str]:
        res = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout))

    def stop(self) -> None:
        for _name, p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        self.procs = []


@pytest.fixture
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _wait(what, cond, timeout, cluster=None, job_id=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.25)
    info = cluster.job(job_id) if cluster is not None else {}
    raise AssertionError(f"timed out waiting for {what}; job: {info.get('JobState')} "
                         f"{info.get('Reason')}")


def test_signal_requeue_and_resume_on_a_real_slurm(slurm, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("SLURM_CONF", slurm.conf)
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    n_iter = 16
    assert main(["submit", BATCH, "--nodes", "1", "--gpus-per-node", "0",
                 "--tasks-per-node", "2", "--cpus-per-task", str(min(os.cpu_count() or 1, 2)),
                 "--time", "00:10:00", "--out", str(out), "--port", str(_free_port()),
                 "--", "--iterations", str(n_iter), "--set", "sleep=0.25"]) == 0
    printed = capsys.readouterr().out
    m = re.search(r"submitted batch job (\d+)", printed)
    assert m, printed
    job = m.group(1)
    output = out / f"slurm-{job}.out"

    def text():
        return output.read_text(errors="replace") if output.exists() else ""

    try:
        # first attempt: wait until it trains, then USR1 to the batch script only
        _wait("the first attempt to start training", lambda: (out / "log.h5").exists(), 90,
              slurm, job)
        time.sleep(2.0)
        slurm.run(["scancel", "--signal=USR1", "--batch", job])
        _wait("the requeue", lambda: "requeueing job" in text(), 60, slurm, job)
        first = torch.load(out / "restart.pt", weights_only=True)["iteration"]
        assert 0 < first < n_iter, text()

        requeued_at = []

        def rerun_started():
            info = slurm.job(job)
            if info.get("Restarts") != "1":  # the script's `scontrol requeue` not done yet
                return False
            if info.get("JobState") != "PENDING":
                return True
            if not requeued_at:
                requeued_at.append(time.time())
            # Start it now rather than after SLURM's requeue delay -- but only once the old
            # attempt's job credential (revoked by the requeue, AuthInfo=cred_expire=5) has
            # expired: a start before that is killed ("Job credential revoked") and FAILS.
            if time.time() - requeued_at[0] > CRED_EXPIRE + 1:
                slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                          check=False)
            return False

        _wait("the requeued job to start again", rerun_started, 60, slurm, job)
        _wait("the rerun to end", lambda: slurm.job(job).get("JobState") in
              ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
              90, slurm, job)
        assert slurm.job(job).get("JobState") == "COMPLETED", "the rerun failed"
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- job output ---\n{text()}") from None
    finally:
        slurm.run(["scancel", job], check=False)
    log_text = text()
    assert slurm.job(job).get("Restarts") == "1", log_text
    assert "attempt 1" in log_text and "attempt 2" in log_text
    assert f"stopped by a signal after iteration {first - 1}" in log_text
    assert f"trained {n_iter} iterations" in log_text
    log = read_log(out / "log.h5")
    np.testing.assert_array_equal(log.columns["iteration"], np.arange(n_iter))
    assert log.attrs["world_size"] == 2
    assert torch.load(out / "restart.pt", weights_only=True)["iteration"] == n_iter
    assert not list(out.glob("restart.pt.tmp-*"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.parametrize("cpus,tasks,want", [("8", 4, "2"), ("3", 4, "1"), (None, 2, "1")])
def test_each_process_gets_its_share_of_the_cpus_as_threads(tmp_path, cpus, tasks, want):
    """--threads = the node's --cpus-per-task over its training processes (at least 1)."""
    spec = SubmitSpec.create(BATCH, gpus_per_node=0, tasks_per_node=tasks, time="01:00:00",
                             out=str(tmp_path / "out"))
    text = sbatch_script(spec)
    if cpus is None:
        assert f"#SBATCH --cpus-per-task={tasks}" in text  # the CPU-node default
    res, args = _run_script(tmp_path, text,
                            {"SLURM_CPUS_PER_TASK": cpus} if cpus is not None else None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert args[args.index("--threads") + 1] == want
