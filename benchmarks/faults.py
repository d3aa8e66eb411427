"""Fault injection: kill and resume, concurrent trainers, hostile files, bad API input.

    .venv/bin/python benchmarks/faults.py                  # 50 cases, ~7.5 minutes
    .venv/bin/python benchmarks/faults.py --quick          # 14 of them, under 2 minutes
    .venv/bin/python benchmarks/faults.py --only hostile   # one class: kill, concurrent,
                                                           # hostile, api; or case keys
    .venv/bin/python benchmarks/faults.py --out faults.md  # also write the table
    .venv/bin/python benchmarks/faults.py --list            # the cases, without running them

Four classes of faults, crossed with the surfaces they reach (stopping targets and time
limits, reversible steps, the host allocator's cache, compiled steps):

* **kill and resume** — a small CLI training run SIGKILLed at chosen moments of its own (the
  k-th log append, a torn log flush, right after a restart file is published, a restart file
  half-written; armed by the problem file from an environment variable, so the run is a real
  ``python -m deepsolve train``), then ``--resume``d to completion; SIGTERM (exit 75) and
  Ctrl-C (SIGINT, exit 130) in the middle of an iteration; SIGKILL while the allocator is
  compiled;
* **concurrent trainers** — two trainers released on the same ``--out`` at the same instant
  (a barrier in the problem file, right before the run directory is locked); processes
  building the allocator into one empty cache;
* **hostile files** — restart files and logs damaged, edited, truncated, replaced by random
  bytes or by a symlink; a damaged cached allocator library;
* **bad API input** — unstable reversible steps, NaN states, random steps where a reversible
  or compiled unroll cannot take them, targets naming nothing, unknown or out-of-range
  settings, no C++ compiler.

Each case runs in its own subprocess (``--case KEY``) under a timeout, so a hang or a crash
is a row of the table, not the end of the script; every child gets ``OMP_NUM_THREADS=1`` and
temporary directories for its run directories and for ``DEEPSOLVE_CACHE_DIR`` (the user's
own cache is never touched). The table has one row per case: class, surface, case, what is
expected, what was observed (an exit code and the start of the error line, or the rows
checked) and whether the expectation held. The exit code is 1 when a row fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CLASSES = {"kill": "kill and resume", "concurrent": "concurrent trainers",
           "hostile": "hostile files", "api": "bad API input"}
RESULT = "FAULTS-RESULT "

# -------------------------------------------------------------------------- the problem file

PROBLEM = '''
"""A tiny decay problem for benchmarks/faults.py (written there at run time): recover a rate
through ``steps`` explicit steps. Environment variables arm the faults of the harness:
FAULTS_KILL=EVENT:K SIGKILLs the process at the K-th EVENT (append: before a log row is
appended; resize: after a log dataset is extended, a torn flush; restart: after restart.pt is
published; fsync: before an fsync, a file half-written); FAULTS_BARRIER=DIR holds the process
at import until FAULTS_PARTIES processes are there (trainers released at the same instant,
right before the run directory is locked); FAULTS_GATE=PATH with FAULTS_GATE_AT=K holds
iteration K (PATH.waiting written) until PATH exists."""

import os
import signal
import time

import torch

import deepsolve


def _arm_kill(spec):
    import h5py

    from deepsolve.io import h5log

    event, k = spec.split(":")
    k = int(k)
    counts = {}

    def hit(name):
        counts[name] = counts.get(name, 0) + 1
        if name == event and counts[name] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    append, resize, replace, fsync = (h5log.H5Log.append, h5py.Dataset.resize, os.replace,
                                      os.fsync)

    def append_(self, *a, **kw):
        hit("append")
        return append(self, *a, **kw)

    def resize_(self, *a, **kw):
        r = resize(self, *a, **kw)
        hit("resize")
        return r

    def replace_(src, dst, *a, **kw):
        r = replace(src, dst, *a, **kw)
        if str(dst).endswith("restart.pt"):
            hit("restart")
        return r

    def fsync_(fd):
        hit("fsync")
        return fsync(fd)

    h5log.H5Log.append, h5py.Dataset.resize, os.replace, os.fsync = (append_, resize_,
                                                                     replace_, fsync_)


def _barrier(where, parties):
    os.makedirs(where, exist_ok=True)
    open(os.path.join(where, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(where)) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {where}: the other processes never came")
        time.sleep(0.0005)


if not getattr(deepsolve, "_faults_armed", False):   # once, though the file is imported twice
    deepsolve._faults_armed = True
    if os.environ.get("FAULTS_KILL"):
        _arm_kill(os.environ["FAULTS_KILL"])
    if os.environ.get("FAULTS_BARRIER"):
        _barrier(os.environ["FAULTS_BARRIER"], int(os.environ.get("FAULTS_PARTIES", "2")))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor(0.1))


class Decay(deepsolve.Problem):
    defaults = {"iterations": 12, "lr": 0.05, "steps": 50, "dt": 0.02, "true_rate": 0.8,
                "sleep": 0.0, "checkpoint_every": 3, "eval_every": 4, "batch": 4,
                "noise": 0.0}

    def build(self, ctx):
        ctx.model = Model().to(ctx.device, ctx.dtype)
        x0 = torch.linspace(0.5, 1.5, ctx.cfg.batch, device=ctx.device, dtype=ctx.dtype)
        xT = x0 * (1 - ctx.cfg.dt * ctx.cfg.true_rate) ** ctx.cfg.steps
        ctx.data = {"x0": x0, "xT": xT}

    def step(self, ctx, x, i):
        y = x - ctx.cfg.dt * ctx.model.rate * x
        if ctx.cfg.noise:
            y = y + ctx.cfg.noise * torch.randn_like(x)
        return y

    def step_inverse(self, ctx, x, i):  # INVERSE
        return x / (1 - ctx.cfg.dt * ctx.model.rate)  # INVERSE

    def residuals(self, ctx, iteration):
        gate = os.environ.get("FAULTS_GATE")
        if gate and iteration == int(os.environ.get("FAULTS_GATE_AT", "-1")):
            with open(gate + ".waiting", "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        if ctx.cfg.sleep:
            time.sleep(ctx.cfg.sleep)
        xT = ctx.unroll(self.step, ctx.data["x0"])
        return {"misfit": ((xT - ctx.data["xT"]) ** 2).mean(),
                "prior": 1e-4 * ctx.model.rate ** 2}

    def evaluate(self, ctx):
        return {"rate_error": abs(ctx.model.rate.item() - ctx.cfg.true_rate)}


problem = Decay()
'''

# the settings of the runs compared row by row (float64: losses equal to the last bit)
F64 = ["--dtype", "float64", "--quiet"]
PLAIN = [*F64, "--iterations", "12", "--set", "checkpoint_every=3"]
TARGET = [*F64, "--iterations", "300", "--set", "checkpoint_every=3",
          "--set", "target=loss/misfit:1e-6"]
TARGET_STOP = "target loss/misfit"
LIMIT_MIN = 0.05        # minutes: 3 s of 20 ms iterations
TIMED = [*F64, "--iterations", "1000", "--set", "checkpoint_every=10", "--set", "eval_every=0",
         "--set", "sleep=0.02", "--set", f"time_limit={LIMIT_MIN}"]
PLAIN6 = [*F64, "--iterations", "6", "--set", "checkpoint_every=3"]
LONG = [*F64, "--iterations", "400", "--set", "checkpoint_every=400", "--set", "eval_every=0"]
EXACT = ("iteration", "loss", "loss/misfit", "loss/prior", "grad_norm", "lr",
         "metric/rate_error", "stopped")
NUMERIC = ("loss", "loss/misfit", "loss/prior", "grad_norm", "lr")


# ----------------------------------------------------------------------------- the harness


class Fail(Exception):
    """A case's expectation does not hold: the message is the row's "observed"."""


@dataclass
class Env:
    tmp: Path       # this case's own temporary directory
    shared: Path    # the battery's: problem files, reference runs, the allocator's build
    quick: bool


@dataclass
class Case:
    key: str
    cls: str
    surface: str
    name: str
    expected: str
    fn: Callable[[Env], str]
    quick: bool
    timeout: int


CASES: list[Case] = []


def case(key: str, cls: str, surface: str, name: str, expected: str, *, quick: bool = False,
         timeout: int = 240):
    def register(fn):
        CASES.append(Case(key, CLASSES[cls], surface, name, expected, fn, quick, timeout))
        return fn
    return register


@dataclass
class Proc:
    rc: int
    out: str
    err: str
    pid: int = 0


_SHORT: list[tuple[str, str]] = []


def short(text: str) -> str:
    """``text`` with the temporary directories written short."""
    for long, s in _SHORT:
        text = text.replace(long, s)
    return " ".join(text.split())


def problem_file(env: Env, inverse: bool = True) -> Path:
    """The decay problem, written into the battery's directory (once)."""
    name = "decay.py" if inverse else "decay_noinv.py"
    path = env.shared / name
    if not path.exists():
        text = PROBLEM if inverse else "\n".join(
            ln for ln in PROBLEM.splitlines() if "# INVERSE" not in ln)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text.lstrip())
        os.replace(tmp, path)
    return path


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULTS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


def popen(argv: list, env: Env, extra: dict[str, str] | None = None, *,
          ctrl_c: bool = False) -> subprocess.Popen:
    """``python ARGV`` in the case's directory; ``ctrl_c``: SIGINT not ignored in the child
    (a terminal's Ctrl-C, even where this script runs as a background job)."""
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if ctrl_c else None
    return subprocess.Popen([PY, *map(str, argv)], cwd=env.tmp, env=child_env(extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pre)


def finish(p: subprocess.Popen, timeout: float = 180) -> Proc:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=60)
        raise Fail(f"a child hung: killed after {timeout:.0f} s: {short(err)[-120:]}") from None
    return Proc(p.returncode, out, err, p.pid)


def cli(env: Env, *args, extra: dict[str, str] | None = None, timeout: float = 180) -> Proc:
    """``python -m deepsolve ARGS`` in the case's directory."""
    return finish(popen(["-m", "deepsolve", *args], env, extra), timeout)


def train(env: Env, out: Path, args: list[str], *more: str, inverse: bool = True,
          extra: dict[str, str] | None = None, timeout: float = 180) -> Proc:
    return cli(env, "train", problem_file(env, inverse), "--out", out, *args, *more,
               extra=extra, timeout=timeout)


def err_line(p: Proc) -> str:
    """The error line of a child: the last line of a traceback, else the first line."""
    lines = [ln for ln in p.err.splitlines() if ln.strip()]
    if not lines:
        return ""
    if any(ln.startswith("Traceback") for ln in lines):
        return lines[-1]
    return lines[0]


def brief(p: Proc, n: int = 80) -> str:
    lines = [ln for ln in p.err.splitlines() if ln.strip()]
    msg = short(err_line(p)).removeprefix("deepsolve train: error: ")
    tb = ", traceback" if "Traceback" in p.err else ""
    if not lines:
        return f"rc {p.rc}, nothing on stderr"
    return f"rc {p.rc}, {len(lines)} line{'s' * (len(lines) != 1)}{tb}: {msg[:n]}"


def one_line(p: Proc, *needles: str, rc: int = 2, prefix: str = "deepsolve train: error: ") \
        -> None:
    """The child refused in exactly one line (``prefix``, every needle in it), no traceback,
    exit code ``rc``; else :class:`Fail` with what it did."""
    lines = [ln for ln in p.err.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if (p.rc != rc or len(lines) != 1 or not line.startswith(prefix) or "Traceback" in p.err
            or not all(n in line for n in needles)):
        missing = [n for n in needles if n not in line]
        raise Fail(brief(p) + (f" (missing {missing})" if missing and len(lines) == 1 else ""))


def snapshot(d: Path) -> dict[str, tuple]:
    """Every entry under ``d`` (links not followed): its kind and its bytes' sha256."""
    out: dict[str, tuple] = {}
    if not d.exists():
        return out
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            st = os.lstat(p)
            rel = str(p.relative_to(d))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("dir" if stat.S_ISDIR(st.st_mode) else "other",)
    return out


def changed(before: dict, after: dict) -> str:
    names = sorted(set(before) | set(after))
    diff = [n for n in names if before.get(n) != after.get(n)]
    def how(n: str) -> str:
        if n not in before or n not in after:
            return "made" if n not in before else "removed"
        a, b = before[n][0], after[n][0]
        return "changed" if a == b else f"{a} -> {b}"

    return ", ".join(f"{n} {how(n)}" for n in diff)


def read_cols(run_dir: Path) -> dict:
    """The log's columns, read with h5py alone (not with the library under test): the
    consistent prefix counted by ``iteration``."""
    import h5py
    import numpy as np

    path = run_dir / "log.h5"
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError:
        f = h5py.File(path, "r", locking=False, swmr=True)
    with f:
        cols = {}
        for key in f:
            d = f[key]
            if not isinstance(d, h5py.Dataset) or d.ndim != 1:
                continue
            name = d.attrs.get("column", key)
            name = name.decode() if isinstance(name, bytes) else str(name)
            cols[name] = d.asstr()[:] if h5py.check_string_dtype(d.dtype) else d[:]
    its = cols["iteration"]
    neg = np.flatnonzero(its < 0)
    n = int(neg[0]) if len(neg) else len(its)
    return {k: np.asarray(v[:n]) for k, v in cols.items()}


def restart_of(run_dir: Path) -> dict:
    import torch

    s = torch.load(run_dir / "restart.pt", weights_only=True)
    return {"iteration": int(s["iteration"]), "stopped": s.get("stopped", ""),
            "elapsed": s.get("elapsed")}


def rows_differ(cols: dict, ref: dict, names=EXACT, n: int | None = None) -> str | None:
    """How ``cols`` differs from the reference's first ``n`` rows (all of them by default),
    or ``None``: iterations 0..n-1 without gap or duplicate, every column equal (NaN where
    the reference has NaN)."""
    import numpy as np

    n = len(ref["iteration"]) if n is None else n
    its = cols["iteration"]
    if len(its) != n:
        return f"{len(its)} rows, not {n}"
    if not np.array_equal(its, np.arange(n)):
        bad = int(np.flatnonzero(its != np.arange(n))[0])
        return f"iteration column broken at row {bad} ({its[max(bad - 1, 0):bad + 2]})"
    for c in names:
        if c not in ref:
            continue
        if c not in cols:
            return f"no column {c}"
        a, b = cols[c][:n], ref[c][:n]
        same = np.array_equal(a, b, equal_nan=True) if a.dtype.kind == "f" else \
            np.array_equal(a, b)
        if not same:
            i = int(np.flatnonzero(~((a == b) | (a != a) & (b != b)))[0])
            return f"{c} differs at row {i}: {a[i]!r} vs {b[i]!r}"
    return None


def reference(env: Env, tag: str, args: list[str], inverse: bool = True) -> tuple[Path, dict]:
    """An uninterrupted run (once per battery, in its shared directory): its directory and
    its log's columns. Cases copy it before they change it."""
    d = env.shared / "refs" / tag
    done = d.with_name(tag + ".done")
    if not done.exists():
        shutil.rmtree(d, ignore_errors=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        p = train(env, d, args, inverse=inverse)
        if p.rc != 0:
            raise Fail(f"the uninterrupted run {tag} failed: {brief(p)}")
        done.touch()
    return d, read_cols(d)


def tidy(run_dir: Path) -> str | None:
    names = sorted(n for n in os.listdir(run_dir) if n != "compiled.bin")  # a compiled run's
    return None if names == ["log.h5", "restart.pt"] else f"left {names}"   # artefacts


def kill_resume(env: Env, args: list[str], moments: list[str], *, inverse: bool = True,
                extra: dict[str, str] | None = None, timeout: float = 180) -> list[Path]:
    """SIGKILL a run at each moment, then ``--resume`` it to its end; the resumed run
    directories. A run killed before it wrote anything has nothing to resume: ``--resume``
    must say so in one line, and the run is started again."""
    outs = []
    for i, moment in enumerate(moments):
        out = env.tmp / f"killed{i}"
        p = train(env, out, args, inverse=inverse, timeout=timeout,
                  extra={**(extra or {}), "FAULTS_KILL": moment})
        if p.rc != -signal.SIGKILL:
            raise Fail(f"killed at {moment}: {brief(p)} (the moment never came?)")
        if out.exists() and ({"log.h5", "restart.pt"} & set(os.listdir(out))):
            p = train(env, out, args, "--resume", inverse=inverse, extra=extra,
                      timeout=timeout)
        else:
            p = train(env, out, args, "--resume", inverse=inverse, extra=extra)
            one_line(p, "--resume")
            p = train(env, out, args, inverse=inverse, extra=extra, timeout=timeout)
        if p.rc != 0:
            raise Fail(f"resumed after a kill at {moment}: {brief(p)}")
        why = tidy(out)
        if why:
            raise Fail(f"after a kill at {moment} and --resume: {why}")
        outs.append(out)
    return outs


def gated(env: Env, out: Path, args: list[str], sig: int, at: int) -> Proc:
    """A run held inside iteration ``at``; ``sig`` sent there, then the gate opened."""
    gate = env.tmp / f"gate-{out.name}"
    p = popen(["-m", "deepsolve", "train", problem_file(env), "--out", out, *args], env,
              {"FAULTS_GATE": str(gate), "FAULTS_GATE_AT": str(at)}, ctrl_c=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{gate}.waiting"):
        if p.poll() is not None or time.monotonic() > deadline:
            res = finish(p, 30)
            raise Fail(f"the run never reached iteration {at}: {brief(res)}")
        time.sleep(0.01)
    p.send_signal(sig)
    gate.touch()
    return finish(p)


# ------------------------------------------------------------------------------- kill class


@case("kill-target", "kill", "target", "SIGKILL at 4 moments (1 in --quick), --resume",
      "rc -9; resume rc 0; rows 0..N-1 = uninterrupted, same target stop", quick=True)
def _kill_target(env: Env) -> str:
    ref_dir, ref = reference(env, "target", TARGET)
    n = len(ref["iteration"])
    stop = str(ref["stopped"][-1])
    if not (stop.startswith(TARGET_STOP) and 12 < n < 300):
        raise Fail(f"the uninterrupted run stopped at {n} rows: {stop!r}")
    moments = ["restart:2"] if env.quick else \
        ["append:5", "restart:2", "fsync:3", "resize:4"]
    for out in kill_resume(env, TARGET, moments):
        why = rows_differ(read_cols(out), ref)
        r = restart_of(out)
        if why is None and (r["iteration"], r["stopped"]) != (n, stop):
            why = f"restart file at {r['iteration']}, stopped {r['stopped']!r}"
        if why:
            raise Fail(f"{out.name}: {why}")
    # the finished run resumed again with its target: nothing to train, nothing changed
    before = snapshot(out)
    p = train(env, out, TARGET, "--resume")
    one_line(p, "reached its target")
    if snapshot(out) != before:
        raise Fail(f"a resume past the target changed {changed(before, snapshot(out))}")
    kills = f"{len(moments)} kill{'s' * (len(moments) > 1)}"
    return f"ok, {kills}; {n} rows = uninterrupted, stop at {n}"


@case("kill-time-limit", "kill", "time_limit", "SIGKILL at 2 moments, --resume",
      "rows 0..N-1 = losses of an uninterrupted run; time_limit stop within the limit")
def _kill_time_limit(env: Env) -> str:
    import numpy as np

    _, ref = reference(env, "long", LONG)
    runs = [env.tmp / "uninterrupted"]
    p = train(env, runs[0], TIMED)
    if p.rc != 0:
        raise Fail(f"uninterrupted: {brief(p)}")
    runs += kill_resume(env, TIMED, ["append:30", "restart:3"])
    want = f"time_limit {LIMIT_MIN:g} min"
    lengths = []
    for out in runs:
        c = read_cols(out)
        n = len(c["iteration"])
        lengths.append(n)
        why = rows_differ(c, ref, names=NUMERIC, n=n) if n <= len(ref["iteration"]) else \
            f"{n} rows"
        el = c["elapsed"]
        per = np.diff(np.concatenate([[0.0], el])).max()
        if why is None and (str(c["stopped"][-1]) != want or any(c["stopped"][:-1])):
            why = f"stopped {c['stopped'][-1]!r}"
        if why is None and not (np.all(np.diff(el) > 0) and
                                el[-1] <= 60 * LIMIT_MIN + 2 * per + 0.5):
            why = f"elapsed {el[-1]:.2f} s against a limit of {60 * LIMIT_MIN:.0f} s"
        r = restart_of(out)
        if why is None and (r["iteration"], r["stopped"]) != (n, want):
            why = f"restart file at {r['iteration']}, stopped {r['stopped']!r}"
        if why:
            raise Fail(f"{out.name}: {why}")
    return f"ok, rows {'/'.join(map(str, lengths))}, each stopped by {want}"


@case("kill-sigterm", "kill", "target", "SIGTERM inside iteration 4, --resume",
      "rc 75, restart at 5, rows 0..4; resume rc 0, rows = uninterrupted", quick=True)
def _kill_sigterm(env: Env) -> str:
    _, ref = reference(env, "target", TARGET)
    out = env.tmp / "run"
    p = gated(env, out, TARGET, signal.SIGTERM, 4)
    lines = [ln for ln in p.err.splitlines() if ln.strip()]
    if (p.rc != 75 or len(lines) != 1 or "stopped by a signal after iteration 4" not in lines[0]
            or "(iteration 5)" not in lines[0]):
        raise Fail(brief(p))
    c = read_cols(out)
    if list(c["iteration"]) != list(range(5)) or restart_of(out)["iteration"] != 5:
        raise Fail(f"rc 75 but rows {list(c['iteration'])}, restart at "
                   f"{restart_of(out)['iteration']}")
    p = train(env, out, TARGET, "--resume")
    why = (brief(p) if p.rc != 0 else None) or rows_differ(read_cols(out), ref) or tidy(out)
    if why:
        raise Fail(f"resumed: {why}")
    return f"rc 75 at 5, resumed: ok, {len(ref['iteration'])} rows"


@case("kill-sigint", "kill", "target", "Ctrl-C (SIGINT) inside iteration 4, --resume",
      "rc 130, restart at 5, no traceback; resume rc 0, rows = uninterrupted")
def _kill_sigint(env: Env) -> str:
    _, ref = reference(env, "target", TARGET)
    out = env.tmp / "run"
    p = gated(env, out, TARGET, signal.SIGINT, 4)
    if (p.rc != 130 or "Traceback" in p.err or
            "interrupted after iteration 4; restart file" not in p.err or
            "(iteration 5)" not in p.err):
        raise Fail(brief(p))
    if restart_of(out)["iteration"] != 5 or list(read_cols(out)["iteration"]) != list(range(5)):
        raise Fail("rc 130 but the restart file or the log is not at iteration 5")
    p = train(env, out, TARGET, "--resume")
    why = (brief(p) if p.rc != 0 else None) or rows_differ(read_cols(out), ref) or tidy(out)
    if why:
        raise Fail(f"resumed: {why}")
    return f"rc 130 at 5, resumed: ok, {len(ref['iteration'])} rows"


@case("kill-reversible", "kill", "reversible steps",
      "SIGKILL at 2 moments of a --set reversible=4 run, --resume",
      "resume rc 0; rows = uninterrupted (float64, bit for bit)")
def _kill_reversible(env: Env) -> str:
    args = [*PLAIN, "--set", "reversible=4"]
    _, ref = reference(env, "reversible", args)
    if not str(ref["schedule"][0]).startswith("reversible"):
        raise Fail(f"the run's schedule is {ref['schedule'][0]!r}, not reversible")
    for out in kill_resume(env, args, ["append:5", "restart:2"]):
        why = rows_differ(read_cols(out), ref)
        if why:
            raise Fail(f"{out.name}: {why}")
    return f"ok, 2 kills; 12 rows = uninterrupted ({ref['schedule'][0]})"


@case("kill-compiled", "kill", "compiled steps",
      "SIGKILL at a row of a --set compile=on run, --resume",
      "resume rc 0; rows = uninterrupted compiled run", timeout=540)
def _kill_compiled(env: Env) -> str:
    args = [*PLAIN, "--set", "compile=on"]
    _, ref = reference(env, "compiled", args)
    if not ref["compile_time"][0] > 0:
        raise Fail("the run compiled nothing (compile_time 0)")
    for out in kill_resume(env, args, ["append:5"], timeout=300):
        why = rows_differ(read_cols(out), ref)
        if why:
            raise Fail(f"{out.name}: {why}")
    return f"ok, 12 rows = uninterrupted (compiled in {ref['compile_time'][0]:.0f} s)"


@case("kill-budget", "kill", "allocator cache",
      "SIGKILL at 2 moments of a --budget 2MiB run (revolve, host allocator), --resume",
      "resume rc 0; rows = uninterrupted budgeted run")
def _kill_budget(env: Env) -> str:
    args = [*PLAIN, "--budget", "2MiB", "--set", "batch=16384"]   # 128 KiB states, 50 steps
    _, ref = reference(env, "budget", args)
    if str(ref["schedule"][0]).startswith("store_all"):
        raise Fail(f"the budget did not checkpoint: {ref['schedule'][0]}")
    for out in kill_resume(env, args, ["append:5", "restart:2"]):
        why = rows_differ(read_cols(out), ref)
        if why:
            raise Fail(f"{out.name}: {why}")
    return f"ok, 2 kills; 12 rows = uninterrupted ({ref['schedule'][0]})"


ALLOC_CHILD = r"""
import json, torch, deepsolve
from deepsolve.memory import hostalloc
torch.manual_seed(0)
w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
x0 = torch.randn(1 << 15, dtype=torch.float64, requires_grad=True)
step = lambda x, i: x + 0.01 * torch.tanh(w * x)
for _ in range(2):  # two budgeted calls: a fallback is announced once
    y = deepsolve.unroll(step, x0, 30, budget="12MiB")
    g = torch.autograd.grad(y.sum(), [x0, w])
y = x0
for i in range(30):
    y = step(y, i)
r = torch.autograd.grad(y.sum(), [x0, w])
print(json.dumps(dict(active=hostalloc.active(), why=hostalloc.why_inactive(),
                      err=max(((a - b).norm() / b.norm()).item() for a, b in zip(g, r)))))
"""


def alloc_child(env: Env, cache: Path | str, extra: dict[str, str] | None = None) \
        -> tuple[Proc, dict]:
    """Two budgeted CPU unrolls in a fresh process with ``cache`` as DEEPSOLVE_CACHE_DIR."""
    p = finish(popen(["-c", ALLOC_CHILD], env,
                     {"DEEPSOLVE_CACHE_DIR": str(cache), **(extra or {})}), 240)
    try:
        return p, json.loads(p.out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise Fail(brief(p)) from None


def library_name(env: Env) -> str:
    p = finish(popen(["-c", "from deepsolve.memory import hostalloc; "
                      "print(hostalloc.library_path().name)"], env), 120)
    if p.rc != 0:
        raise Fail(brief(p))
    return p.out.strip()


def verified(lib: Path) -> bool:
    rec = lib.with_name(lib.name + ".sha256")
    if not lib.is_file() or not rec.is_file():
        return False
    return rec.read_text().split()[0] == hashlib.sha256(lib.read_bytes()).hexdigest()


@case("kill-alloc-build", "kill", "allocator cache",
      "SIGKILL (the process group) while the allocator compiles into an empty cache",
      "next budgeted unroll: rc 0, allocator active, library rebuilt and verified")
def _kill_alloc_build(env: Env) -> str:
    cache = env.tmp / "cache"
    started = env.tmp / "compiler-started"
    cxx = env.tmp / "slow-c++"
    cxx.write_text(f"#!/bin/sh\ntouch {started}\nsleep 3\nexec c++ \"$@\"\n")
    cxx.chmod(0o755)
    code = "from deepsolve.memory import hostalloc; print(hostalloc.install())"
    p = subprocess.Popen([PY, "-c", code], cwd=env.tmp, start_new_session=True,
                         env=child_env({"DEEPSOLVE_CACHE_DIR": str(cache), "CXX": str(cxx)}),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise Fail(f"the build never started: {brief(finish(p, 30))}")
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)   # the process group this case started
    finish(p, 60)
    left = sorted(os.listdir(cache))
    r_p, r = alloc_child(env, cache)
    lib = cache / library_name(env)
    stale = [n for n in os.listdir(cache) if n not in (lib.name, lib.name + ".sha256")]
    if r_p.rc != 0 or not r["active"] or r["err"] > 1e-10 or not verified(lib):
        raise Fail(f"{brief(r_p)}; active {r['active']}, verified {verified(lib)}")
    return (f"ok: active, rebuilt and verified; the kill left {len(left)} file(s), "
            f"{len(stale)} stale temporary")


# ------------------------------------------------------------------------- concurrent class


def race(env: Env, outs: list[Path], argvs: list[list[str]]) -> list[Proc]:
    """Trainers released at the same instant (a barrier right before the lock)."""
    barrier = env.tmp / f"barrier-{outs[0].name}"
    procs = [popen(["-m", "deepsolve", "train", problem_file(env), "--out", out, *argv], env,
                   {"FAULTS_BARRIER": str(barrier), "FAULTS_PARTIES": str(len(argvs))})
             for out, argv in zip(outs, argvs, strict=True)]
    return [finish(p) for p in procs]


def one_winner(procs: list[Proc]) -> Proc:
    """Exactly one trainer ran (rc 0), every other was refused in one line naming it."""
    wins = [p for p in procs if p.rc == 0]
    if len(wins) != 1:
        raise Fail("; ".join(brief(p, 50) for p in procs))
    for p in procs:
        if p is not wins[0]:
            one_line(p, f"another trainer (pid {wins[0].pid}) is writing this run directory")
    return wins[0]


@case("race-fresh", "concurrent", "target",
      "2 trainers on one new --out at the same instant (x5; x2 in --quick)",
      "one rc 0, one rc 2 in one line naming its pid; survivor's rows = uninterrupted",
      quick=True)
def _race_fresh(env: Env) -> str:
    _, ref = reference(env, "target", TARGET)
    reps = 2 if env.quick else 5
    args = [*TARGET, "--set", "sleep=0.02"]
    for r in range(reps):
        out = env.tmp / f"run{r}"
        one_winner(race(env, [out, out], [args, args]))
        why = rows_differ(read_cols(out), ref) or tidy(out)
        if why:
            raise Fail(f"repetition {r}: {why}")
    return f"ok x{reps}: 1 ran, 1 refused; {len(ref['iteration'])} rows = uninterrupted"


@case("race-resume", "concurrent", "resume", "2 trainers --resume one run at the same instant (x3)",
      "one rc 0, one rc 2 in one line; rows 0..11 = uninterrupted")
def _race_resume(env: Env) -> str:
    base, _ = reference(env, "plain6", PLAIN6)
    _, ref = reference(env, "plain12", PLAIN)
    for r in range(3):
        out = env.tmp / f"run{r}"
        shutil.copytree(base, out)
        args = [*PLAIN, "--resume"]
        one_winner(race(env, [out, out], [args, args]))
        # (row 5 keeps the metric the 6-iteration run evaluated at its end)
        why = rows_differ(read_cols(out), ref, names=NUMERIC) or tidy(out)
        if why:
            raise Fail(f"repetition {r}: {why}")
    return "ok x3: 1 resumed, 1 refused; 12 rows = uninterrupted"


@case("race-alloc", "concurrent", "allocator cache",
      "3 processes install the allocator into one empty cache at once",
      "all active; the cache holds the library and its checksum, verified")
def _race_alloc(env: Env) -> str:
    cache = env.tmp / "cache"
    code = "from deepsolve.memory import hostalloc; print(hostalloc.install())"
    procs = [popen(["-c", code], env, {"DEEPSOLVE_CACHE_DIR": str(cache)}) for _ in range(3)]
    res = [finish(p) for p in procs]
    lib = cache / library_name(env)
    names = sorted(os.listdir(cache))
    if [(p.rc, p.out.strip()) for p in res] != [(0, "True")] * 3 or \
            names != [lib.name, lib.name + ".sha256"] or not verified(lib):
        raise Fail(f"{[(p.rc, p.out.strip()) for p in res]}, cache {names}")
    return "ok: 3 active, one verified library"


# ---------------------------------------------------------------------------- hostile class


def hostile_resume(env: Env, damage: Callable[[Path], None], *needles: str,
                   fresh: bool = False) -> str:
    """A copy of a finished 6-iteration run, damaged, then ``--resume``d (``fresh``: started
    without it): refused in one line naming what, the run directory as it was."""
    base, _ = reference(env, "plain6", PLAIN6)
    out = env.tmp / "run"
    shutil.copytree(base, out, symlinks=True)
    damage(out)
    before = snapshot(out)
    outside = snapshot(env.tmp / "elsewhere")
    p = train(env, out, PLAIN, *(() if fresh else ("--resume",)))
    moved = changed(before, snapshot(out))
    if snapshot(env.tmp / "elsewhere") != outside:
        moved += (", " if moved else "") + "the link's target changed"
    try:
        one_line(p, *needles)
    except Fail as e:
        raise Fail(f"{e}{'; ' + moved if moved else ''}") from None
    if moved:
        raise Fail(f"{brief(p, 40)}; {moved}")
    return brief(p)


def edit_restart(**fields):
    def damage(out: Path) -> None:
        import torch

        s = torch.load(out / "restart.pt", weights_only=True)
        for k, v in fields.items():
            if k == "numpy_pos":
                s["rng"]["numpy"][2] = v
            else:
                s[k] = v
        torch.save(s, out / "restart.pt")
    return damage


def truncate(name: str, keep: float):
    def damage(out: Path) -> None:
        p = out / name
        with open(p, "r+b") as f:
            f.truncate(int(p.stat().st_size * keep))
    return damage


def random_bytes(name: str):
    def damage(out: Path) -> None:
        p = out / name
        p.write_bytes(os.urandom(p.stat().st_size))
    return damage


def h5_edit(fn):
    def damage(out: Path) -> None:
        import h5py

        with h5py.File(out / "log.h5", "r+") as f:
            fn(f)
    return damage


HOSTILE = [
    # key, surface, case, needles, damage, quick
    ("restart-config", "restart file", "restart.pt with config '{'",
     ("restart.pt", "'config' is not JSON"), edit_restart(config="{"), True),
    ("restart-numpy", "restart file", "restart.pt with numpy RNG pos=-1",
     ("restart.pt", "'rng.numpy' pos is -1"), edit_restart(numpy_pos=-1), False),
    ("restart-truncated", "restart file", "restart.pt truncated to half",
     ("restart.pt", "cannot read the restart file"), truncate("restart.pt", 0.5), False),
    ("restart-random", "restart file", "restart.pt replaced by random bytes",
     ("restart.pt", "cannot read the restart file"), random_bytes("restart.pt"), False),
    ("restart-empty", "restart file", "restart.pt of 0 bytes",
     ("restart.pt",), truncate("restart.pt", 0.0), False),
    ("restart-stopped", "target", "restart.pt with stopped='bored'",
     ("restart.pt", "'stopped' is 'bored'"), edit_restart(stopped="bored"), False),
    ("restart-elapsed", "time_limit", "restart.pt with elapsed=nan",
     ("restart.pt", "'elapsed' is nan"), edit_restart(elapsed=float("nan")), False),
    ("log-truncated", "log", "log.h5 truncated to half",
     ("log.h5", "truncated"), truncate("log.h5", 0.5), True),
    ("log-random", "log", "log.h5 replaced by random bytes",
     ("log.h5", "not a readable HDF5 log"), random_bytes("log.h5"), False),
    ("log-empty", "log", "log.h5 of 0 bytes beside restart.pt at 6",
     ("log.h5", "restart.pt is at iteration 6"), truncate("log.h5", 0.0), False),
    ("log-short-column", "log", "log.h5 with a column of 4 rows (iteration: 6)",
     ("log.h5", "columns of different lengths"),
     h5_edit(lambda f: f["loss"].resize((4,))), False),
    ("log-fewer-rows", "log", "log.h5 of 4 rows beside restart.pt at 6",
     ("log.h5", "4 rows"), h5_edit(lambda f: f["iteration"].resize((4,))), False),
    ("log-duplicate", "log", "log.h5 with iterations 0,1,2,2,4,5",
     ("log.h5", "restart.pt is at iteration 6"),
     h5_edit(lambda f: f["iteration"].__setitem__(3, 2)), False),
]


def _hostile_case(key, surface, name, needles, damage, quick):
    @case(f"hostile-{key}", "hostile", surface, name,
          "rc 2, one line naming the file and field; run dir unchanged", quick=quick)
    def run(env: Env) -> str:
        return hostile_resume(env, damage, *needles)
    return run


for _h in HOSTILE:
    _hostile_case(*_h)


@case("hostile-log-fresh", "hostile", "log", "log.h5 truncated, no restart.pt, a fresh start",
      "rc 2, one line naming log.h5 (not replaced in silence); unchanged")
def _hostile_log_fresh(env: Env) -> str:
    def damage(out: Path) -> None:
        (out / "restart.pt").unlink()
        truncate("log.h5", 0.5)(out)
    return hostile_resume(env, damage, "log.h5", "move log.h5 away", fresh=True)


def symlinked(env: Env, name: str) -> str:
    """``name`` of a finished 6-iteration run moved elsewhere, a symlink in its place, then
    ``--resume`` to 12: refused in one line, or the run continued through the link."""
    base, _ = reference(env, "plain6", PLAIN6)
    out, where = env.tmp / "run", env.tmp / "elsewhere"
    shutil.copytree(base, out)
    where.mkdir()
    shutil.move(out / name, where / name)
    (out / name).symlink_to(where / name)
    before, target = snapshot(out), snapshot(where)
    p = train(env, out, PLAIN, "--resume")
    if p.rc == 2:
        one_line(p, name)
        if snapshot(out) != before or snapshot(where) != target:
            raise Fail(f"{brief(p, 40)}; changed {changed(before, snapshot(out))}")
        return brief(p)
    link = (out / name).is_symlink()
    at = len(read_cols(where)["iteration"]) if name == "log.h5" else \
        restart_of(where)["iteration"]
    if p.rc == 0 and link and at == 12:
        return "rc 0, the run continued through the link (12)"
    now = "still a link" if link else "now a regular file"
    what = "rows" if name == "log.h5" else "(its iteration)"
    raise Fail(f"{brief(p, 40)}; {name} {now}, the link's target left at {at} {what}")


@case("hostile-log-symlink", "hostile", "log",
      "log.h5 a symlink to the run's log kept elsewhere, --resume",
      "rc 2 in one line naming log.h5, or the rows written through the link; never the link "
      "replaced in silence", quick=True)
def _hostile_log_symlink(env: Env) -> str:
    return symlinked(env, "log.h5")


@case("hostile-restart-symlink", "hostile", "restart file",
      "restart.pt a symlink to the run's restart file kept elsewhere, --resume",
      "rc 2 in one line naming restart.pt, or the restart files written through the link")
def _hostile_restart_symlink(env: Env) -> str:
    return symlinked(env, "restart.pt")


def damaged_library(env: Env, damage: Callable[[Path], None]) -> str:
    """The allocator's library built once (the battery's), copied into a fresh cache with
    its checksum and damaged; two budgeted unrolls must rebuild it and run with it."""
    name = library_name(env)
    built = env.shared / "alloc-built"
    lib0 = built / name
    if not verified(lib0):
        p = finish(popen(["-c", "import sys; from deepsolve.memory import hostalloc; "
                          "hostalloc.build(sys.argv[1])", lib0], env), 240)
        if p.rc != 0:
            raise Fail(f"building the library: {brief(p)}")
    cache = env.tmp / "cache"
    cache.mkdir()
    for f in built.iterdir():
        shutil.copy(f, cache / f.name)
    damage(cache / name)
    p, r = alloc_child(env, cache)
    lines = [ln for ln in p.err.splitlines() if ln.strip()]
    names = sorted(os.listdir(cache))
    if (p.rc != 0 or not r["active"] or r["err"] > 1e-10 or not verified(cache / name)
            or names != [name, name + ".sha256"] or lines):
        raise Fail(f"{brief(p)}; active {r['active']} ({short(r['why'])[:60]}), "
                   f"verified {verified(cache / name)}")
    same = (cache / name).read_bytes() == lib0.read_bytes()
    return f"ok: rc 0, active, rebuilt{' (the same bytes)' if same else ''}"


def _flip(lib: Path) -> None:
    b = bytearray(lib.read_bytes())
    b[len(b) // 2] ^= 0xFF
    lib.write_bytes(bytes(b))


LIBRARIES = [
    ("truncated", "the cached library truncated to half",
     lambda lib: lib.write_bytes(lib.read_bytes()[:lib.stat().st_size // 2]), True),
    ("empty", "the cached library of 0 bytes", lambda lib: lib.write_bytes(b""), False),
    ("flipped", "the cached library with a byte flipped", _flip, False),
]


def _library_case(key, name, damage, quick):
    @case(f"hostile-alloc-{key}", "hostile", "allocator cache", name,
          "budgeted unroll rc 0, allocator active, library rebuilt, no warning", quick=quick)
    def run(env: Env) -> str:
        return damaged_library(env, damage)
    return run


for _lib in LIBRARIES:
    _library_case(*_lib)


@case("hostile-alloc-foreign", "hostile", "allocator cache",
      "another shared object (libm) in the library's place, its checksum recorded",
      "rebuilt, or the fallback in one warning line; rc 0, no traceback")
def _hostile_alloc_foreign(env: Env) -> str:
    def damage(lib: Path) -> None:
        import ctypes.util

        libm = ctypes.util.find_library("m") or "libm.so.6"
        for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
            if (Path(d) / libm).exists():
                shutil.copy(Path(d) / libm, lib)
                break
        else:
            raise Fail(f"no {libm} found to copy")
        digest = hashlib.sha256(lib.read_bytes()).hexdigest()
        lib.with_name(lib.name + ".sha256").write_text(f"{digest}  {lib.name}\n")
    return damaged_library(env, damage)


# -------------------------------------------------------------------------------- api class


def outcome(fn: Callable[[], object]) -> tuple[BaseException | None, object]:
    try:
        return None, fn()
    except Exception as e:  # what the API raised is the observation
        return e, None


def raised(e: BaseException | None, kind: str, *needles: str) -> str:
    """``kind: message`` when ``e`` is a one-line ``kind`` (by class name in its MRO) with
    every needle in it; else :class:`Fail`."""
    if e is None:
        raise Fail("returned, no error")
    msg = str(e)
    head = f"{type(e).__name__}: {short(msg)}"
    kinds = [c.__name__ for c in type(e).__mro__]
    missing = [n for n in needles if n not in msg]
    if kind not in kinds or "\n" in msg or missing:
        raise Fail(head[:100] + (f" (missing {missing})" if missing else "") +
                   (" (several lines)" if "\n" in msg else ""))
    return head[:80 + len(type(e).__name__)]


def heat(dt: float, lam: float):
    import math

    import torch

    from deepsolve import reversible as rv

    n, dx = 64, 1 / 64
    Dc = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def laplacian(u):
        return (u.roll(1) - 2 * u + u.roll(-1)) / dx**2

    step = rv.explicit(lambda t, u: Dc * laplacian(u), dt, lam=lam)
    u0 = torch.sin(2 * math.pi * torch.arange(n, dtype=torch.float64) * dx)
    return step, step.init(u0), Dc


@case("api-heat", "api", "reversible steps",
      "rv.explicit heat, 64 points, lam=0.999, dt=2e-6, 2000 steps, budget='100KiB'",
      "StabilityError, one line naming lam <= and dt <=, before the forward", quick=True)
def _api_heat(env: Env) -> str:
    import deepsolve as ds

    step, x0, _ = heat(2e-6, 0.999)
    calls = []
    inner = step.increment
    step.increment = lambda y, t, h: calls.append(t) or inner(y, t, h)
    e, _ = outcome(lambda: ds.unroll(step, x0, 2000, budget="100KiB"))
    head = raised(e, "StabilityError", "lam <=", "dt <=")
    if len(calls) >= 2 * 2000 * 4:
        raise Fail(f"{len(calls)} increments: the forward sweep ran")
    return head


@case("api-stiff", "api", "reversible steps",
      "coupled RK4 on a stiff reaction-diffusion step (k=2000, dt=1e-3)",
      "StabilityError, one line (the step where it stops being finite)")
def _api_stiff(env: Env) -> str:
    import math

    import torch

    import deepsolve as ds
    from deepsolve import reversible as rv

    n, dx = 64, 1 / 64
    k = torch.tensor(2000.0, dtype=torch.float64)
    x = torch.arange(n, dtype=torch.float64) * dx
    u0 = 0.5 + 0.4 * torch.sin(2 * math.pi * x)

    def f(t, u):
        lap = (u.roll(1) - 2 * u + u.roll(-1)) / dx**2
        return 1e-3 * lap + k * u * (1 - u) * (u - 0.3)

    step = rv.explicit(f, 1e-3)
    e, _ = outcome(lambda: ds.unroll(step, step.init(u0), 2000, budget="100KiB"))
    return raised(e, "StabilityError", "stops being finite")


@case("api-drift", "api", "reversible steps",
      "heat at lam=0.5 under Reversible(every=200) (the inverse amplifies rounding)",
      "ReconstructionError, one line naming the window and lam")
def _api_drift(env: Env) -> str:
    import torch

    import deepsolve as ds

    step, x0, Dc = heat(2e-5, 0.5)

    def grad():
        x = ds.unroll(step, x0, 2000, schedule=ds.Reversible(every=200))
        return torch.autograd.grad((step.solution(x) ** 2).sum(), Dc)

    e, _ = outcome(grad)
    return raised(e, "ReconstructionError", "lam closer to 1 (now 0.5)")


def nan_step(bad: float, a: float = 1.0):
    """A step whose state crosses zero at step ``bad`` and goes through a square root there
    (``sqrt(y) * sqrt(y)``: a NaN no compiler folds away)."""
    import torch

    p = torch.nn.Parameter(torch.tensor(a, dtype=torch.float64))
    x0 = torch.linspace(1.0, 2.0, 32, dtype=torch.float64) * (bad + 0.5) * 0.01

    def step(x, i):
        y = x - 0.01 * p
        return torch.sqrt(y) * torch.sqrt(y)

    return step, x0, p


@case("api-nan", "api", "NaN watch", "a step that goes NaN at step 37, snapshots=4, 400 steps",
      "NonFiniteError, one line naming step 37", quick=True)
def _api_nan(env: Env) -> str:
    import deepsolve as ds

    step, x0, _ = nan_step(37)
    e, _ = outcome(lambda: ds.unroll(step, x0, 400, snapshots=4))
    return raised(e, "NonFiniteError", "at step 37: x_38 = step(x_37, 37)")


def plain_grad(step, x0, n, p, **kw) -> float:
    import torch

    import deepsolve as ds

    x = ds.unroll(step, x0, n, **kw)
    (g,) = torch.autograd.grad(x.sum(), p)
    return float(g)


@case("api-nan-past-n", "api", "NaN watch",
      "budget='1MiB', 4 steps of a step that would go NaN at step 5 (finite here)",
      "runs; gradient = plain autograd's")
def _api_nan_past_n(env: Env) -> str:
    step, x0, p = nan_step(5)
    want = plain_grad(step, x0, 4, p)
    e, got = outcome(lambda: plain_grad(step, x0, 4, p, budget="1MiB"))
    if e is not None:
        raise Fail(f"{type(e).__name__}: {short(str(e))}"[:100])
    if abs(got - want) > 1e-12 * abs(want):
        raise Fail(f"gradient {got} against {want}")
    return f"ok, gradient {got:.6g} = plain"


@case("api-rev-torch-random", "api", "reversible steps",
      "Reversible() on an invertible step drawing from torch's generator",
      "ValueError, one line naming torch's generator", quick=True)
def _api_rev_torch(env: Env) -> str:
    import torch

    import deepsolve as ds
    from deepsolve import reversible as rv

    a = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    step = rv.invertible(lambda x, i: x + 1e-3 * (a * x + 1e-2 * torch.randn_like(x)),
                         lambda x, i: x)
    x0 = torch.randn(4096, dtype=torch.float64)
    e, _ = outcome(lambda: ds.unroll(step, x0, 100, schedule=ds.Reversible()))
    return raised(e, "ValueError", "draws no random numbers", "torch's generator")


@case("api-rev-numpy-random", "api", "reversible steps",
      "Reversible() on an invertible step drawing from numpy's global generator",
      "ValueError, one line naming numpy's generator")
def _api_rev_numpy(env: Env) -> str:
    import numpy as np
    import torch

    import deepsolve as ds
    from deepsolve import reversible as rv

    a = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    step = rv.invertible(lambda x, i: x + 1e-3 * (a * x + 1e-2 * float(np.random.rand())),
                         lambda x, i: x - 1e-3 * a * x)
    x0 = torch.randn(4096, dtype=torch.float64)
    e, _ = outcome(lambda: ds.unroll(step, x0, 100, schedule=ds.Reversible()))
    return raised(e, "ValueError", "draws no random numbers", "numpy's global generator")


@case("api-budget-random", "api", "reversible steps",
      "budget='1MiB' on a random step that claims an inverse",
      "runs; plan not reversible (says why); gradient = store_all's, same seed")
def _api_budget_random(env: Env) -> str:
    import torch

    import deepsolve as ds

    a = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

    def noisy(x, i):
        return x + 1e-3 * (a * x + 1e-2 * torch.randn_like(x))

    noisy.inverse = lambda x, i: x
    x0 = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plan = ds.plan(noisy, x0, 400, budget="1MiB")
    if plan.kind == "reversible" or not any("draws random numbers" in alt.note
                                            for alt in plan.alternatives):
        raise Fail(f"plan {plan.kind}")
    torch.manual_seed(5)
    got = plain_grad(noisy, x0, 400, a, budget="1MiB")
    torch.manual_seed(5)
    want = plain_grad(noisy, x0, 400, a)
    if abs(got - want) > 1e-12 * abs(want):
        raise Fail(f"gradient {got} against {want}")
    return f"ok, plan {plan.kind}, gradient = store_all's"


@case("api-compile-random", "api", "compiled steps",
      "compile=True, snapshots=4 on a step drawing from torch's generator",
      "CompileError, one line", timeout=300)
def _api_compile_random(env: Env) -> str:
    import torch

    import deepsolve as ds

    a = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    x0 = torch.randn(64, dtype=torch.float64)

    def noisy(x, i):
        return x + 1e-3 * (a * x + torch.randn_like(x))

    e, _ = outcome(lambda: ds.unroll(noisy, x0, 40, compile=True, snapshots=4))
    return raised(e, "CompileError", "draws random numbers")


@case("api-compile-nan", "api", "compiled steps",
      "compile=True, snapshots=4, 100 steps of a step that goes NaN at step 37",
      "NonFiniteError, one line naming step 37 (or its segment)", timeout=420)
def _api_compile_nan(env: Env) -> str:
    import re

    import deepsolve as ds

    step, x0, _ = nan_step(37)
    e, _ = outcome(lambda: ds.unroll(step, x0, 100, compile=True, snapshots=4))
    head = raised(e, "NonFiniteError")
    m = re.search(r"segment \d+ \(steps (\d+)\.\.(\d+)\)", str(e))
    if not ("at step 37:" in str(e) or (m and int(m[1]) <= 37 <= int(m[2]))):
        raise Fail(head[:100])
    return head


@case("api-compile-finite", "api", "compiled steps",
      "compile=2, snapshots=4, 30 steps of a step that would go NaN at step 37 (finite here)",
      "runs; gradient = eager's", timeout=420)
def _api_compile_finite(env: Env) -> str:
    step, x0, p = nan_step(37)
    want = plain_grad(step, x0, 30, p)
    e, got = outcome(lambda: plain_grad(step, x0, 30, p, compile=2, snapshots=4))
    if e is not None:
        raise Fail(f"{type(e).__name__}: {short(str(e))}"[:100])
    if abs(got - want) > 1e-10 * abs(want):
        raise Fail(f"gradient {got} against {want}")
    return f"ok, gradient {got:.6g} = eager"


@case("api-target-missing", "api", "target", "--set target=loss/nope:1e-3, a fresh run",
      "rc 2, one line listing the names, before iteration 0; nothing made", quick=True)
def _api_target_missing(env: Env) -> str:
    out = env.tmp / "run"
    p = train(env, out, [*PLAIN, "--set", "target=loss/nope:1e-3"])
    one_line(p, "no loss term 'loss/nope'", "loss/misfit")
    if out.exists():
        raise Fail(f"{brief(p, 40)}; but made {out.name}")
    return brief(p)


@case("api-target-missing-resume", "api", "target",
      "--set target=loss/nope:1e-3 on --resume of a 6-iteration run",
      "rc 2, one line listing the names; log and restart file unchanged")
def _api_target_missing_resume(env: Env) -> str:
    base, _ = reference(env, "plain6", PLAIN6)
    out = env.tmp / "run"
    shutil.copytree(base, out)
    before = snapshot(out)
    p = train(env, out, [*PLAIN, "--set", "target=loss/nope:1e-3"], "--resume")
    if snapshot(out) != before:
        raise Fail(f"{brief(p, 40)}; changed {changed(before, snapshot(out))}")
    one_line(p, "no loss term 'loss/nope'")
    return brief(p)


@case("api-unknown-setting", "api", "settings", "--set targte=loss:1e-3 (a typo)",
      "rc 2, one line (did you mean target?); nothing made", quick=True)
def _api_unknown_setting(env: Env) -> str:
    out = env.tmp / "run"
    p = train(env, out, [*PLAIN, "--set", "targte=loss:1e-3"])
    one_line(p, "unknown setting", "did you mean target?")
    if out.exists():
        raise Fail(f"{brief(p, 40)}; but made {out.name}")
    return brief(p)


BAD_VALUES = [("target=loss:abc", "'abc' is not a number"),
              ("time_limit=-1", "time_limit must be >= 0"),
              ("compile=maybe", "use auto, on, off"),
              ("reversible=-2", "reversible must be >= 0"),
              ("checkpoint_every=0", "checkpoint_every must be >= 1"),
              ("lr=nan", "not a finite number")]


@case("api-bad-values", "api", "settings",
      f"{len(BAD_VALUES)} bad values: " + ", ".join(s for s, _ in BAD_VALUES),
      "each rc 2, one line naming the setting; nothing made")
def _api_bad_values(env: Env) -> str:
    for i, (setting, needle) in enumerate(BAD_VALUES):
        out = env.tmp / f"run{i}"
        p = train(env, out, [*PLAIN, "--set", setting])
        one_line(p, needle, setting.split("=")[0])
        if out.exists():
            raise Fail(f"{setting}: {brief(p, 40)}; but made {out.name}")
    return f"ok, {len(BAD_VALUES)} refused in one line each"


@case("api-reversible-no-inverse", "api", "reversible steps",
      "--set reversible=4 on a problem without step_inverse",
      "rc 2, one line naming the missing inverse; nothing made", quick=True)
def _api_reversible_no_inverse(env: Env) -> str:
    out = env.tmp / "run"
    p = train(env, out, [*PLAIN, "--set", "reversible=4"], inverse=False)
    one_line(p, "inverse")
    if out.exists():
        raise Fail(f"{brief(p, 40)}; but made {out.name}")
    return brief(p)


@case("api-reversible-random", "api", "reversible steps",
      "--set reversible=4 --set noise=1e-6 (a step drawing from torch's generator)",
      "rc 2, one line naming the random draw; nothing made")
def _api_reversible_random(env: Env) -> str:
    out = env.tmp / "run"
    p = train(env, out, [*PLAIN, "--set", "reversible=4", "--set", "noise=1e-6"])
    one_line(p, "draws no random numbers")
    if out.exists():
        raise Fail(f"{brief(p, 40)}; but made {out.name}")
    return brief(p)


@case("api-no-compiler", "api", "allocator cache", "CXX=/bin/false, an empty cache",
      "rc 0, exactly one warning line with the reason; exact gradient", quick=True)
def _api_no_compiler(env: Env) -> str:
    cache = env.tmp / "cache"
    p, r = alloc_child(env, cache, {"CXX": "/bin/false"})
    warned = [ln for ln in p.err.splitlines() if "HostAllocatorWarning" in ln]
    if (p.rc != 0 or r["active"] or len(warned) != 1 or "/bin/false exited" not in warned[0]
            or r["err"] > 1e-10 or "Traceback" in p.err or (cache.exists() and
                                                              os.listdir(cache))):
        raise Fail(f"{brief(p)}; {len(warned)} warning line(s)")
    return f"rc 0, 1 warning: {short(r['why'])[:60]}"


@case("api-cache-under-file", "api", "allocator cache",
      "DEEPSOLVE_CACHE_DIR under a regular file",
      "rc 0, exactly one warning line naming the directory; exact gradient")
def _api_cache_under_file(env: Env) -> str:
    (env.tmp / "file").write_text("")
    p, r = alloc_child(env, env.tmp / "file" / "cache")
    warned = [ln for ln in p.err.splitlines() if "HostAllocatorWarning" in ln]
    if (p.rc != 0 or r["active"] or len(warned) != 1 or "cache directory" not in warned[0]
            or r["err"] > 1e-10 or "Traceback" in p.err):
        raise Fail(f"{brief(p)}; {len(warned)} warning line(s)")
    return f"rc 0, 1 warning: {short(r['why'])[:60]}"


# ------------------------------------------------------------------------------ the driver


def run_case(key: str, tmp: Path, shared: Path, quick: bool) -> None:
    """``--case KEY``: one case, in this process; its result as one JSON line."""
    c = next(c for c in CASES if c.key == key)
    tmp.mkdir(parents=True, exist_ok=True)
    _SHORT[:] = [(f"{tmp}/run/", ""), (str(tmp), "$CASE"), (str(shared), "$SHARED"),
                 (str(ROOT), "$ROOT")]
    try:
        ok, observed = True, c.fn(Env(tmp, shared, quick))
    except Fail as e:
        ok, observed = False, str(e)
    print(RESULT + json.dumps({"ok": ok, "observed": short(observed)}), flush=True)


def drive(cases: list[Case], quick: bool, keep: bool) -> list[tuple[Case, bool, str, float]]:
    root = Path(tempfile.mkdtemp(prefix="deepsolve-faults-"))
    shared = root / "shared"
    shared.mkdir()
    rows = []
    # the allocator (and anything else) caches into the battery's directory, never ~/.cache
    env = child_env({"DEEPSOLVE_CACHE_DIR": str(shared / "cache")})
    try:
        for c in cases:
            t0 = time.monotonic()
            argv = [PY, __file__, "--case", c.key, "--tmp", str(root / c.key),
                    "--shared", str(shared)] + (["--quick"] if quick else [])
            p = subprocess.Popen(argv, env=env, cwd=root, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                out, err = p.communicate(timeout=c.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)   # the case and every child it started
                out, err = p.communicate(timeout=60)
                ok, observed = False, f"hung: killed after {c.timeout} s"
            else:
                lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
                if lines:
                    res = json.loads(lines[-1][len(RESULT):])
                    ok, observed = res["ok"], res["observed"]
                else:
                    last = [ln for ln in err.splitlines() if ln.strip()][-1:] or [""]
                    ok, observed = False, f"the case crashed (rc {p.returncode}): " \
                                          f"{' '.join(last[0].split())[:100]}"
            dt = time.monotonic() - t0
            rows.append((c, ok, observed, dt))
            print(f"{'ok  ' if ok else 'FAIL'} {dt:5.1f} s  {c.key}: {observed}",
                  file=sys.stderr, flush=True)
    finally:
        if keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def table(rows) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    out = ["| class | surface | case | expected | observed | ok |",
           "|---|---|---|---|---|---|"]
    for c, ok, observed, _ in rows:
        out.append(f"| {c.cls} | {c.surface} | {cell(c.name)} | {cell(c.expected)} | "
                   f"{cell(observed)} | {'yes' if ok else '**FAIL**'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset (under 2 minutes)")
    ap.add_argument("--only", metavar="CLASS", help="one class (" + ", ".join(CLASSES) +
                    ") or cases by key (--list), comma-separated")
    ap.add_argument("--out", metavar="FILE", help="also write the table to FILE")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--shared", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        run_case(args.case, Path(args.tmp), Path(args.shared), args.quick)
        return 0
    cases = CASES
    if args.only:
        names = [w.strip() for w in args.only.split(",") if w.strip()]
        for w in names:
            if not any(w in (c.key, c.cls) or CLASSES.get(w) == c.cls for c in CASES):
                ap.error(f"--only {w}: neither a class ({', '.join(CLASSES)}) nor a case "
                         "(--list)")
        cases = [c for c in cases if any(w in (c.key, c.cls) or CLASSES.get(w) == c.cls
                                         for w in names)]
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.list:
        for c in cases:
            print(f"{c.key:28s} {c.cls} / {c.surface}: {c.name}{'  [quick]' * c.quick}")
        return 0
    t0 = time.monotonic()
    rows = drive(cases, args.quick, args.keep)
    took = time.monotonic() - t0
    text = table(rows)
    failed = sum(not ok for _, ok, _, _ in rows)
    mode = " --quick" if args.quick else ""
    summary = (f"{len(rows)} cases, {failed} failed, {took:.0f} s "
               f"({datetime.date.today().isoformat()}, faults.py{mode})")
    print(text)
    print()
    print(summary)
    if args.out:
        Path(args.out).write_text(text + "\n\n" + summary + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
