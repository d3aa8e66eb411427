"""Every Python block of README.md, docs/*.md and examples/README.md runs, or says why not.

A block is run unless the line just above its fence is an HTML comment (invisible in the
rendered page) that names where else it runs or why it cannot:

* ``<!-- not-run: REASON -->`` — e.g. a signature listing, a loop that polls forever;
* ``<!-- run by tests/test_X.py ... -->`` or ``<!-- snippet: NAME (run by tests/test_X.py ...) -->``
  — another test executes it (the named file must exist and mention the doc).

The blocks of one Markdown file run in order in one namespace, as a reader would paste them,
from a scratch directory, after the file's *prelude* below: the few names the guide's text
takes as given (``step``, ``x0``, a network). A stale example fails here.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "examples").glob("*.md")])

_STEP = """
import torch
import deepsolve
torch.manual_seed(0)
w = torch.nn.Parameter(0.5 * torch.randn(16, 16) / 4)
def step(x, i):
    return torch.tanh(x @ w)
x0 = torch.randn(8, 16)
"""

# names the guides' text introduces in prose before a block uses them
PRELUDES: dict[str, str] = {
    "docs/budget.md": _STEP + """
def residual(x):
    return float(x.abs().max())
""",
    "docs/check.md": _STEP,
    "docs/h5-log.md": """
import os
os.makedirs("runs/heat", exist_ok=True)
cfg, n_iterations = {"lr": 1e-3}, 3
loss, l_pde, l_bc, dt = 1.0, 0.75, 0.25, 0.1
""",
    "docs/inside-step.md": _STEP + """
n, s = 50, 5
criterion = lambda x: x.square().mean()
""",
    "docs/pinn.md": """
import torch
from deepsolve.pinn import FNN, Collocation, Rectangle, slice_mse
from deepsolve.pinn import AdamLBFGSTraining
torch.manual_seed(0)
net = FNN(2, 3, width=8, depth=2)
model = net
x = torch.rand(16, 2)
xt = torch.rand(16, 2)
iteration = 0
def residual_fn(x):
    return net(x)[:, 0]
def residual(x):
    return net(x)[:, 0]
def my_objective_changed(k):
    return False
""",
    "docs/schedules.md": """
import torch
x = torch.zeros(())
def step(x, i):
    return x + 1
def stop(x, i):
    return i >= 25
""",
    "docs/unroll.md": _STEP,
}

# names a later block of a guide takes from its own paragraph: run just before the first block
# containing the key
BEFORE: dict[str, dict[str, str]] = {
    "docs/inside-step.md": {"torch.autocast": """
def step(x, i):                      # x + dt f(x): float32 + bf16 promotes back to float32
    return x + 0.1 * torch.tanh(x @ w)
"""},
    "docs/unroll.md": {"adjoint_hook=": """
def step(x, i):                      # a step with a per-step output: (next_state, output)
    y = torch.tanh(x @ w)
    return y, y.sum()
n = 60
def loss(final, outs):
    return final.square().mean() + outs.sum()
"""},
}


def _blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, marker comment or "", code) for each ```python block."""
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            prev = lines[i - 1].strip() if i else ""
            marker = prev if prev.startswith("<!--") else ""
            out.append((i + 1, marker, textwrap.dedent("\n".join(lines[i + 1:j]))))
            i = j
        i += 1
    return out


def _skip_reason(path: Path, marker: str) -> str | None:
    """Why a block is not run here (None: run it); raises on a marker without a reason."""
    if not marker:
        return None
    m = re.match(r"<!-- not-run: (.+?) -->$", marker)
    if m:
        return m.group(1)
    m = re.search(r"run by (tests/\w+\.py)", marker)
    if m:
        test = ROOT / m.group(1)
        assert test.exists(), f"{path.name}: marker names {m.group(1)}, which does not exist"
        assert path.name in test.read_text(), f"{m.group(1)} does not mention {path.name}"
        return f"run by {m.group(1)}"
    raise AssertionError(f"{path.name}: comment above a python block is neither "
                         f"'<!-- not-run: REASON -->' nor '<!-- run by tests/... -->': {marker}")


def test_the_docs_have_python_blocks():
    n = sum(len(_blocks(p)) for p in DOCS)
    assert n >= 40, n


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_python_blocks_run(path: Path, tmp_path, monkeypatch):
    blocks = _blocks(path)
    if not blocks:
        pytest.skip("no python blocks")
    rel = str(path.relative_to(ROOT))
    monkeypatch.chdir(tmp_path)
    import matplotlib
    matplotlib.use("Agg")
    # a real module: torch.compile looks the block's globals up in sys.modules by __name__
    block = types.ModuleType("deepsolve_docs_block")
    monkeypatch.setitem(sys.modules, block.__name__, block)
    ns: dict = block.__dict__
    exec(compile(PRELUDES.get(rel, ""), f"{rel}:prelude", "exec"), ns)
    ran = 0
    for line, marker, code in blocks:
        if _skip_reason(path, marker) is not None:
            continue
        for key, setup in BEFORE.get(rel, {}).items():
            if key in code:
                exec(compile(setup, f"{rel}:before {line}", "exec"), ns)
        try:
            with warnings.catch_warnings():  # a doc example that silently falls back is wrong
                warnings.filterwarnings("error", message=".*running it eagerly")
                exec(compile(code, f"{rel}:{line}", "exec"), ns)
        except Exception as e:
            raise AssertionError(f"{rel}:{line}: the block fails: {type(e).__name__}: {e}") from e
        ran += 1
    assert ran or all(m for _, m, _ in blocks)
