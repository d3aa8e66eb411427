"""Compiled artefacts that outlive the process (deepsolve/artefacts.py): a file another process
loads instead of compiling again, checked before it is trusted — a foreign or damaged file is
ignored with one warning line, never loaded."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from deepsolve import artefacts

pytestmark = pytest.mark.timeout(600)


def write(path: Path, data: bytes, **changes) -> None:
    head = artefacts.header(len(data), hashlib.sha256(data).hexdigest())
    head.update(changes)
    path.write_bytes(json.dumps(head).encode() + b"\n" + data)


@pytest.fixture
def fresh(monkeypatch):
    """Each file is loaded once per process: forget what this process saw."""
    monkeypatch.setattr(artefacts, "_loaded", set())
    calls = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: calls.append(b))
    return calls


@pytest.mark.parametrize("changes, why", [
    ({"torch": "2.0.0"}, "made by torch '2.0.0'"),
    ({"python": "3.7"}, "made by python '3.7'"),
    ({"machine": "riscv"}, "made by machine 'riscv'"),
    ({"format": "other/9"}, "made by format 'other/9'"),
    ({"bytes": 3}, "holds 5 bytes where its header says 3"),
    ({"sha256": "0" * 64}, "checksum does not match"),
])
def test_a_foreign_or_damaged_file_is_ignored_in_one_line(tmp_path, fresh, changes, why):
    path = tmp_path / "a.bin"
    write(path, b"12345", **changes)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert artefacts.load(path) is False
    assert fresh == []  # nothing handed to PyTorch
    lines = [str(x.message) for x in w if issubclass(x.category, artefacts.StaleArtefacts)]
    assert len(lines) == 1 and why in lines[0] and "\n" not in lines[0]


def test_a_good_file_is_loaded_once_and_a_missing_one_says_nothing(tmp_path, fresh):
    path = tmp_path / "a.bin"
    write(path, b"payload")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert artefacts.load(tmp_path / "none.bin") is False
        assert artefacts.load(path) is True
        assert artefacts.load(path) is False  # once per process
    assert fresh == [b"payload"]
    path.write_bytes(b"no header at all")
    artefacts._loaded.clear()
    with pytest.warns(artefacts.StaleArtefacts, match="no deepsolve header"):
        assert artefacts.load(path) is False


def test_the_cache_directory_is_documented_and_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPSOLVE_COMPILE_CACHE", str(tmp_path / "c"))
    assert artefacts.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("DEEPSOLVE_COMPILE_CACHE", "0")
    assert artefacts.cache_dir() is None and artefacts.path_for(len) is None
    monkeypatch.delenv("DEEPSOLVE_COMPILE_CACHE")
    monkeypatch.setenv("DEEPSOLVE_CACHE_DIR", str(tmp_path / "d"))
    assert artefacts.cache_dir() == tmp_path / "d" / "compiled"

    def f(x, i):
        return x

    def g(x, i):
        return x
    assert artefacts.path_for(f) != artefacts.path_for(g)  # named by the step's code


CHILD = textwrap.dedent("""
    import json, sys, torch
    import deepsolve
    from torch._dynamo.utils import counters
    torch.set_default_dtype(torch.float64)

    def step(y, i):
        return y + 1e-3 * (torch.roll(y, 1) - 2 * y + torch.roll(y, -1)) * 50 - 1e-3 * y ** 3

    y0 = torch.linspace(0, 1, 64).requires_grad_()
    y = deepsolve.unroll(step, y0, 128, snapshots=4, compile=32)
    (g,) = torch.autograd.grad((y ** 2).sum(), y0)
    print(json.dumps({"grad": float(g.sum()),
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def test_a_second_process_loads_the_first_ones_compiled_loop(tmp_path):
    """Two processes with separate Inductor caches (as two nodes of a cluster) and one
    deepsolve cache directory: the first compiles the loop segment and writes its
    artefacts, the second loads them — every graph a cache hit, none compiled — and gets
    the same gradient."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = []
    for name in ("first", "second"):
        env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSOLVE_CACHE_DIR=str(tmp_path / "ds"),
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"))
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env, timeout=500)
        assert p.returncode == 0, p.stderr[-2000:]
        out.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert out[0]["misses"] >= 2 and out[1]["misses"] == 0 and out[1]["hits"] >= 2
    assert out[0]["grad"] == pytest.approx(out[1]["grad"], rel=1e-12)
    files = list((tmp_path / "ds" / "compiled").iterdir())
    assert len(files) == 1 and json.loads(files[0].read_bytes().split(b"\n", 1)[0])[
        "format"] == artefacts.FORMAT
