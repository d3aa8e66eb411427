"""README.md's commands, run in order as a new user would (with tiny settings), and its
numbers, regenerated from the demo log they come from."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TINY_NS = ["fine_n=32", "coarse_n=16", "curriculum=", "dt=0.02", "steps=20", "obs_every=10",
           "spinup=0.2",
           "n_train=2", "n_test=2", "batch=2", "width=4", "depth=2", "budget=512KiB",
           "iterations=2", "eval_every=1"]


def _section(title: str) -> str:
    text = open(README).read()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def _commands(block: str) -> list[str]:
    """Shell lines of a block, continuation lines joined and comments dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def _run(cmd: list[str], cwd, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def _tiny(args: list[str], data: str) -> list[str]:
    """A README command with the tiny Navier-Stokes settings appended (train/plan/check)."""
    if args[:1] and args[0] in ("train", "plan", "check") and any(
            a.endswith("navier_stokes.py") for a in args):
        sets = [kv for kv in TINY_NS if not (args[0] == "check" and kv.startswith("iter"))]
        return args + [x for kv in sets for x in ("--set", kv)] + ["--set", f"data_dir={data}"]
    return args


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path):
    """Quick start (make demo, then its report command) and the main job's block, in the
    README's order, in a directory laid out like a fresh clone."""
    work = tmp_path / "clone"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "Makefile"), work / "Makefile")
    os.symlink(os.path.join(ROOT, "problems"), work / "problems")
    data = str(tmp_path / "data")
    ran = 0
    for line in _commands(_blocks(_section("Quick start"), "bash")[0]) + _commands(
            "\n".join(_blocks(_section("Quick start"), "bash")[1:])):
        words = line.split()
        if words[:2] == ["make", "test"]:
            continue  # this is the test suite itself
        if words[:2] == ["make", "demo"]:
            tiny = " ".join(f"--set {kv}" for kv in TINY_NS) + f" --set data_dir={data}"
            if shutil.which("make") is None:
                pytest.skip("make is not installed")
            _run(["make", "demo", f"PY={sys.executable}", "STAMP=", f"DEMO_ARGS={tiny}"],
                 work)
            assert os.path.islink(work / "runs" / "navier_stokes-latest")
        else:
            assert words[1:3] == ["-m", "deepsolve"], line
            _run([sys.executable, *words[1:]], work)
        ran += 1
    assert ran >= 2
    for line in _commands(_blocks(_section("The main job"), "bash")[0]):
        words = line.split()
        if words[0] == "source":
            continue  # the venv: here sys.executable is its python
        assert words[:3] == ["python", "-m", "deepsolve"], line
        args = words[3:]
        if "cuda" in args and not torch.cuda.is_available():
            continue
        r = _run([sys.executable, "-m", "deepsolve", *_tiny(args, data)], work)
        if args[0] == "report":
            assert "plots" in r.stdout and (work / "runs" / "navier_stokes" / "loss.png").exists()
        ran += 1
    assert ran >= 6


@pytest.mark.slow
def test_readme_example_prints_what_its_comment_says(tmp_path):
    code = _blocks(_section("Gradients through 5000"), "python")[0]
    want = re.search(r"#\s*(\d+) \.\.\. (\d+) \.\.\. (\d+)", code).groups()
    path = tmp_path / "example.py"
    path.write_text(code)
    r = _run([sys.executable, str(path)], tmp_path)
    got = re.search(r"(\d+) recomputed steps for (\d+) steps, (\d+) snapshots held", r.stdout)
    assert got is not None, r.stdout
    assert got.groups() == want


def test_readme_numbers_are_the_scripts_output():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import demo_table
    finally:
        sys.path.pop(0)
    log = os.path.join(ROOT, "docs", "data", "navier_stokes_demo.h5")
    block = demo_table.table(log)
    text = open(README).read()
    inside = text.split(demo_table.BEGIN, 1)[1].split(demo_table.END, 1)[0]
    assert inside.strip() == block.strip(), (
        "README.md's demo table differs from benchmarks/demo_table.py's output for "
        "docs/data/navier_stokes_demo.h5; regenerate it with --readme README.md")
    # and the Quick start's demo time is the one that log measured
    minutes = re.search(r"`make demo`\s+about\s+(\S+)\s+minutes", text).group(1)
    assert minutes != "DEMO_MINUTES"
