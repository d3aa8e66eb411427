"""SLURM batch scripts for ``python -m deepsolve submit`` (layer 5; the CLI only parses).

:func:`sbatch_script` writes a readable bash script that runs ``deepsolve train`` under
``torchrun`` on every node of the allocation (``srun``, one launcher per node, c10d
rendezvous on the first node) and survives preemption and time limits:

* ``#SBATCH --signal=B:USR1@120`` asks SLURM to send USR1 to the batch shell two minutes
  before the time limit; ``#SBATCH --requeue`` allows the job to be requeued and
  ``--open-mode=append`` keeps the first attempt's output when it is;
* a bash trap on USR1/TERM forwards the signal to ``srun`` (which passes it to its tasks;
  torchrun, started with ``--signals-to-handle ...,SIGUSR1``, passes it to the training
  processes). Every rank finishes its iteration, rank 0 writes the restart file, all exit
  with code 75. The script waits with ``wait`` so the trap runs while training does;
* when training exits with 75 — or fails in any way after the script forwarded a signal
  (torchrun reports its workers' 75 as its own failure, 1) — the script runs
  ``scontrol requeue $SLURM_JOB_ID``; the rerun finds ``RUN_DIR/restart.pt`` and adds
  ``--resume``, so the log continues without lost or duplicated rows.

:func:`submit` writes the script into the run directory and runs ``sbatch`` on it when
``sbatch`` is on ``PATH`` (otherwise, or with ``dry_run``, it only returns the text).

Hostile values cannot run commands: :meth:`SubmitSpec.create` refuses control characters
(newline, carriage return, NUL, tab, ...) in every path and name that goes into the
script (problem file, run directory, working directory, Python executable, job name,
partition, account, time); in the bash body every interpolated value is quoted with
:func:`shlex.quote`, train arguments included; in ``#SBATCH`` lines, which sbatch parses
itself (not bash), blanks, quotes, backslashes and ``#`` are escaped with a backslash, the
one quoting form every sbatch version reads.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import unicodedata
from dataclasses import dataclass, field

__all__ = ["SubmitSpec", "SubmitResult", "parse_time", "parse_count", "sbatch_script",
           "submit", "SCRIPT_NAME", "SIGNAL_SECONDS"]

#: File name of the generated script inside the run directory.
SCRIPT_NAME = "deepsolve.sbatch"
#: Seconds before the time limit at which SLURM sends USR1 to the batch shell.
SIGNAL_SECONDS = 120

_TIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d\d):(\d\d)$")
_FORBIDDEN_TRAIN_ARGS = {"--out": "give --out to submit (before --), not to train",
                         "--resume": "the script adds --resume itself when a restart file "
                                     "exists"}


def parse_time(text: str | None) -> int:
    """``HH:MM:SS`` or ``D-HH:MM:SS`` -> seconds; one-line ``ValueError`` otherwise."""
    if text is None or not str(text).strip():
        raise ValueError("--time is required: the job's time limit as HH:MM:SS "
                         "(or D-HH:MM:SS)")
    m = _TIME.match(str(text).strip())
    if not m:
        raise ValueError(f"--time {text!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 02:00:00")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    if minutes > 59 or seconds > 59:
        raise ValueError(f"--time {text!r}: minutes and seconds must be 00..59")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"--time {text!r}: the time limit must be positive")
    return total


def parse_count(name: str, value: int | str | None, minimum: int) -> int:
    """A whole number ``>= minimum`` for option ``name``; one-line ``ValueError`` otherwise."""
    if value is None:
        raise ValueError(f"{name} is required")
    try:
        v = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name} {value!r}: expected a whole number") from None
    if v < minimum:
        raise ValueError(f"{name} {v}: must be >= {minimum}")
    return v


def _slurm_word(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    v = str(value).strip()
    if not v or not re.fullmatch(r"[A-Za-z0-9_.,:+@-]+", v):
        raise ValueError(f"{name} {value!r}: expected a SLURM name (letters, digits, _ . - ,)")
    return v


def _no_control(name: str, value: str) -> str:
    """``value`` unchanged, or a one-line ``ValueError`` when it holds a control character
    (newline, carriage return, NUL, tab, escape, DEL, C1 controls): such a character would
    end an ``#SBATCH`` line or a comment of the script and start a command of its own."""
    for c in str(value):
        if unicodedata.category(c) == "Cc":
            raise ValueError(f"{name} {value!r} contains the control character {c!r}; use a "
                             "value without newlines, carriage returns, tabs or NULs")
    return str(value)


def _sbatch_value(text: str) -> str:
    """``text`` for an ``#SBATCH --opt=VALUE`` line: blanks, quotes, backslashes and ``#``
    escaped with a backslash (sbatch reads the line with its own parser, not bash; every
    version of it honours backslash escapes, older ones no single quotes)."""
    return re.sub(r"""([\s"'\\#])""", r"\\\1", text)


def _default_job_name(problem: str) -> str:
    """``deepsolve-<problem file name>`` with characters outside ``[A-Za-z0-9_.+-]``
    replaced by ``_``."""
    name = os.path.splitext(os.path.basename(problem))[0]
    return "deepsolve-" + (re.sub(r"[^A-Za-z0-9_.+-]", "_", name) or "problem")


@dataclass
class SubmitSpec:
    """What to run and on what; build with :meth:`create` (validates, one-line errors)."""

    problem: str                 # absolute path of the problem file
    run_dir: str                 # absolute path of the run directory
    nodes: int
    gpus_per_node: int
    time: str
    time_seconds: int
    tasks_per_node: int = 1      # CPU-only nodes: training processes per node
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = "deepsolve"
    port: int = 29500
    python: str = sys.executable
    workdir: str = field(default_factory=os.getcwd)
    train_args: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, problem: str, *, nodes=1, gpus_per_node=None, time=None,
               tasks_per_node=1, cpus_per_task=None, partition=None, account=None,
               out=None, job_name=None, port=29500, train_args=None,
               python=None, workdir=None) -> SubmitSpec:
        problem = _no_control("problem file", problem)
        if out is not None:
            out = _no_control("--out", out)
        if workdir is not None:
            workdir = _no_control("working directory", workdir)
        if python is not None:
            python = _no_control("python", python)
        if not os.path.isfile(problem):
            raise ValueError(f"problem file {problem!r} does not exist")
        secs = parse_time(time)
        if secs < SIGNAL_SECONDS + 60:
            raise ValueError(f"--time {time}: at least {(SIGNAL_SECONDS + 60) // 60} minutes; "
                             f"the job is told to stop {SIGNAL_SECONDS} s before its limit "
                             "(SLURM may signal up to 60 s early)")
        n = parse_count("--nodes", nodes, 1)
        g = parse_count("--gpus-per-node", gpus_per_node, 0)
        t = parse_count("--tasks-per-node", tasks_per_node, 1)
        if g and t != 1:
            raise ValueError("--tasks-per-node is for CPU-only nodes (--gpus-per-node 0); "
                             "GPU nodes run one training process per GPU")
        c = None if cpus_per_task is None else parse_count("--cpus-per-task", cpus_per_task, 1)
        p = parse_count("--port", port, 1)
        if p > 65535:
            raise ValueError(f"--port {p}: must be <= 65535")
        args = [_no_control("train argument", str(a)) for a in (train_args or [])]
        for a in args:
            key = a.split("=", 1)[0]
            if key in _FORBIDDEN_TRAIN_ARGS:
                raise ValueError(f"{key} after --: {_FORBIDDEN_TRAIN_ARGS[key]}")
        name = os.path.splitext(os.path.basename(problem))[0]
        run_dir = out or os.path.join("runs", name)
        return cls(problem=os.path.abspath(problem), run_dir=os.path.abspath(run_dir),
                   nodes=n, gpus_per_node=g, time=str(time).strip(), time_seconds=secs,
                   tasks_per_node=t, cpus_per_task=c,
                   partition=_slurm_word("--partition", partition),
                   account=_slurm_word("--account", account),
                   job_name=_slurm_word("--job-name", job_name) or _default_job_name(problem),
                   port=p, python=_no_control("python", python or sys.executable),
                   workdir=_no_control("working directory",
                                       os.path.abspath(workdir or os.getcwd())),
                   train_args=args)

    @property
    def procs_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node else self.tasks_per_node

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_node else "cpu"


def _torchrun(python: str) -> str:
    """``torchrun`` next to ``python`` (same environment), else ``python -m torch...run``."""
    exe = os.path.join(os.path.dirname(python), "torchrun")
    if os.path.isfile(exe) and os.access(exe, os.X_OK):
        return shlex.quote(exe)
    return f"{shlex.quote(python)} -m torch.distributed.run"


def _torchrun_forwards_usr1() -> bool:
    """Whether this environment's torchrun has ``--signals-to-handle`` and
    ``--shutdown-timeout`` (recent PyTorch); older ones handle only SIGTERM/SIGINT/SIGHUP/
    SIGQUIT and kill their workers 30 s after passing one on."""
    try:
        from torch.distributed.run import get_args_parser

        opts = get_args_parser()._option_string_actions
    except Exception:
        return False
    return "--signals-to-handle" in opts and "--shutdown-timeout" in opts


def sbatch_script(spec: SubmitSpec) -> str:
    """The text of the batch script for ``spec`` (see the module docstring). Every value
    is checked for control characters again here, so a :class:`SubmitSpec` built by hand
    cannot inject a line either."""
    q = shlex.quote
    s = spec
    for label, value in (("problem file", s.problem), ("--out", s.run_dir),
                         ("working directory", s.workdir), ("python", s.python),
                         ("--job-name", s.job_name), ("--partition", s.partition or ""),
                         ("--account", s.account or ""), ("--time", s.time),
                         *(("train argument", a) for a in s.train_args)):
        _no_control(label, value)
    cpus = s.cpus_per_task if s.cpus_per_task is not None else \
        (None if s.gpus_per_node else s.tasks_per_node)
    what = (f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s)" if s.gpus_per_node
            else f"{s.nodes} CPU node(s) x {s.tasks_per_node} process(es)")
    shutdown = max(SIGNAL_SECONDS - 20, 10)
    if _torchrun_forwards_usr1():
        launcher_opts = ["--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                         f"--shutdown-timeout {shutdown}"]
        fwd_usr1 = "USR1"
        note = ("torchrun starts $NPROC training processes and passes\n# SIGUSR1/SIGTERM on "
                "to them (--signals-to-handle), waiting up to --shutdown-timeout s.")
    else:
        launcher_opts = []
        fwd_usr1 = "TERM"
        note = ("this torchrun passes SIGTERM (not SIGUSR1) on to its\n# training processes, "
                "so the trap forwards USR1 as TERM; it kills them 30 s later.")
    head = [
        "#!/bin/bash",
        f"# Written by `deepsolve submit` on {time.strftime('%Y-%m-%d %H:%M:%S')}: train",
        f"#   {s.problem}",
        f"# on {what} with torchrun; see docs/hpc.md. Submit again with: sbatch "
        f"{q(os.path.join(s.run_dir, SCRIPT_NAME))}",
        f"#SBATCH --job-name={_sbatch_value(s.job_name)}",
        f"#SBATCH --nodes={int(s.nodes)}",
        "# one torchrun launcher per node; it starts the training processes",
        "#SBATCH --ntasks-per-node=1",
    ]
    if s.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={int(s.gpus_per_node)}")
    if cpus is not None:
        head.append(f"#SBATCH --cpus-per-task={int(cpus)}")
    head.append(f"#SBATCH --time={_sbatch_value(s.time)}")
    if s.partition:
        head.append(f"#SBATCH --partition={_sbatch_value(s.partition)}")
    if s.account:
        head.append(f"#SBATCH --account={_sbatch_value(s.account)}")
    head += [
        f"#SBATCH --chdir={_sbatch_value(s.workdir)}",
        f"#SBATCH --output={_sbatch_value(os.path.join(s.run_dir, 'slurm-%j.out'))}",
        "# a requeued attempt appends to the same output file",
        "#SBATCH --open-mode=append",
        f"# USR1 to this script {SIGNAL_SECONDS} s before the time limit; the script then "
        "requeues itself",
        f"#SBATCH --signal=B:USR1@{SIGNAL_SECONDS}",
        "#SBATCH --requeue",
    ]
    train = " ".join(q(a) for a in s.train_args)
    launch = [_torchrun(s.python),
              '    --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC"',
              '    --rdzv-backend c10d --rdzv-endpoint "$MASTER_NODE:$PORT"',
              '    --rdzv-id "deepsolve-$SLURM_JOB_ID"']
    launch += ["    " + o for o in launcher_opts]
    launch.append(f'-m deepsolve train "$PROBLEM" --out "$RUN_DIR" --device {s.device}'
                  ' --threads "$THREADS"')
    launch.append('    ${RESUME[@]+"${RESUME[@]}"}' + (f" {train}" if train else "") + " &")
    srun = " \\\n    ".join(["srun --ntasks-per-node=1 --kill-on-bad-exit=1", *launch])
    body = f'''
set -uo pipefail

RUN_DIR={q(s.run_dir)}
PROBLEM={q(s.problem)}
PYTHON={q(s.python)}
PORT={int(s.port)}
NPROC={int(s.procs_per_node)}
PREEMPTED=75      # deepsolve's exit code after a signal: restart file written, try again
# torch CPU threads per training process: the node's --cpus-per-task shared among them
THREADS=$(( ${{SLURM_CPUS_PER_TASK:-$NPROC}} / NPROC ))
if [ "$THREADS" -lt 1 ]; then THREADS=1; fi

mkdir -p "$RUN_DIR"
echo "[deepsolve] job ${{SLURM_JOB_ID:-?}} attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) on \\
${{SLURM_JOB_NODELIST:-$(hostname)}} at $(date '+%F %T')"

# Continue from the restart file when there is one (a requeued or resubmitted run).
RESUME=()
if [ -f "$RUN_DIR/restart.pt" ]; then
    RESUME=(--resume)
elif [ -f "$RUN_DIR/log.h5" ] && [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then
    # stopped before its first restart file: nothing to resume, keep the rows aside
    mv "$RUN_DIR/log.h5" "$RUN_DIR/log.h5.attempt-${{SLURM_RESTART_COUNT}}"
fi

# The c10d rendezvous runs on the first node of the allocation.
MASTER_NODE=$(scontrol show hostnames "${{SLURM_JOB_NODELIST:-$(hostname)}}" | head -n 1)

# USR1 (time limit near) or TERM (preemption, scancel): pass it on to the training
# processes; they finish the current iteration, rank 0 writes the restart file and all exit
# with 75. `wait` below returns when a trapped signal arrives, so the trap runs at once.
SIGNALLED=0
TRAIN_PID=
forward() {{
    SIGNALLED=1
    echo "[deepsolve] SIG$1 at $(date '+%F %T'): stopping training after this iteration"
    if [ -n "$TRAIN_PID" ]; then kill -s "$1" "$TRAIN_PID" 2>/dev/null || true; fi
}}
trap 'forward {fwd_usr1}' USR1
trap 'forward TERM' TERM

# srun starts one torchrun per node; {note}
{srun}
TRAIN_PID=$!
while true; do
    wait "$TRAIN_PID"
    rc=$?
    kill -0 "$TRAIN_PID" 2>/dev/null || break   # still running: wait was cut by a signal
done
echo "[deepsolve] training exited with $rc at $(date '+%F %T')"

if [ "$rc" -eq 0 ]; then
    exit 0
fi
# torchrun reports its workers' exit code 75 as a failure of its own (1): after a
# forwarded signal any failure counts as "stopped with a restart file".
if [ "$rc" -eq "$PREEMPTED" ] || [ "$SIGNALLED" -eq 1 ]; then
    if [ -f "$RUN_DIR/restart.pt" ]; then
        echo "[deepsolve] preempted: requeueing job $SLURM_JOB_ID (it resumes from \\
$RUN_DIR/restart.pt)"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    echo "[deepsolve] stopped by a signal before the first restart file; not requeueing"
fi
exit "$rc"
'''
    return "\n".join(head) + "\n" + body


@dataclass
class SubmitResult:
    script_path: str
    script: str
    submitted: bool
    job_id: str | None = None
    message: str = ""


def submit(spec: SubmitSpec, *, dry_run: bool = False, sbatch: str | None = None
           ) -> SubmitResult:
    """Write ``RUN_DIR/deepsolve.sbatch`` and submit it with ``sbatch`` (unless ``dry_run``
    or ``sbatch`` is not on PATH). Raises ``ValueError`` (one line) when sbatch fails."""
    text = sbatch_script(spec)
    try:
        os.makedirs(spec.run_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {spec.run_dir}: cannot make the run directory "
                         f"({e.strerror or e})") from None
    path = os.path.join(spec.run_dir, SCRIPT_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ValueError(f"--out {spec.run_dir}: cannot write {SCRIPT_NAME} there "
                         f"({e.strerror or e})") from None
    if dry_run:
        return SubmitResult(path, text, False, None, f"dry run: script written to {path}")
    exe = sbatch or shutil.which("sbatch")
    if exe is None:
        return SubmitResult(path, text, False, None,
                            f"sbatch not found: script written to {path}; submit it on a "
                            f"SLURM login node with: sbatch {path}")
    res = subprocess.run([exe, "--parsable", path], capture_output=True, text=True)
    if res.returncode != 0:
        err = " ".join((res.stderr or res.stdout).split()) or f"exit code {res.returncode}"
        raise ValueError(f"sbatch {path} failed: {err}")
    job = res.stdout.strip().split(";")[0]
    return SubmitResult(path, text, True, job, f"submitted batch job {job} ({path}); "
                        f"output: {spec.run_dir}/slurm-{job}.out")
