"""The examples in examples/ (deepsolve inside torchdiffeq, PhiFlow and neuraloperator code),
each run through its ``main`` for a few steps and iterations.

Each test needs its third-party package (the ``[examples]`` extra) and is skipped without it.
What is asserted is what the example claims: deepsolve's gradient equals plain autograd
through the same third-party step (float64, relative error <= 1e-10), the loss decreases, and
deepsolve's tracked peak (bytes saved for backward plus snapshots) stays far below the plain
loop's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
REASON = "install the [examples] extra"

pytestmark = pytest.mark.usefixtures("single_thread")


def load(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"deepsolve_example_{name}",
                                                  EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_torchdiffeq_step() -> None:
    """torchdiffeq's RK4 as the unroll step: exact gradients (a, b, x0), L-BFGS fit, memory."""
    pytest.importorskip("torchdiffeq", reason=REASON)
    ex = load("torchdiffeq_step")
    res = ex.main(["--steps", "60", "--iters", "3", "--batch", "32", "--snapshots", "4",
                   "--check-steps", "20"])
    assert set(res["grad_rel_err"]) == {"a", "b", "x0"}
    assert max(res["grad_rel_err"].values()) <= 1e-10, res["grad_rel_err"]
    losses = res["fit"]["losses"]
    assert losses[-1] < 0.5 * losses[0], losses
    mem = res["memory"]
    st = mem["deepsolve"]["stats"]
    assert st.recorded == 60 and st.snapshots_peak <= 4 and st.advances > 0
    assert mem["deepsolve"]["tracked_peak"] < 0.25 * mem["plain"]["tracked_peak"], mem


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PhiFlow's torch.jit calls
def test_phiflow_smoke() -> None:
    """PhiFlow smoke (advection + make_incompressible) as the unroll step: gradients equal plain
    autograd and a finite difference, the compiled step equals PhiFlow's eager one, the loss
    decreases, memory is below the plain loop's."""
    pytest.importorskip("phi", reason=REASON)
    ex = load("phiflow_smoke")
    res = ex.main(["--steps", "20", "--iters", "2", "--snapshots", "4", "--check-steps", "3"])
    err = res["grad_rel_err"]
    assert max(err[k] for k in ("u_x", "u_y", "rho0")) <= 1e-10, err
    assert err["finite_difference"] <= 1e-5, err
    assert err["jit_vs_eager"] <= 1e-12, err
    losses = res["fit"]["losses"]
    assert losses[-1] < losses[0], losses
    mem = res["memory"]
    assert mem["deepsolve"]["stats"].recorded == 20
    assert mem["deepsolve"]["tracked_peak"] < 0.5 * mem["plain"]["tracked_peak"], mem


def test_neuraloperator_rollout() -> None:
    """An FNO trained through rollouts under a budget: exact parameter gradients, the same
    losses as plain rollout training, the tracked peak within the budget and below plain."""
    pytest.importorskip("neuralop", reason=REASON)
    ex = load("neuraloperator_rollout")
    res = ex.main(["--steps", "30", "--iters", "2", "--batch", "4", "--budget", "3MiB",
                   "--check-steps", "6"])
    assert res["grad"]["max_rel_err"] <= 1e-10, res["grad"]
    ds, plain = res["deepsolve"], res["plain"]
    assert ds["losses"][-1] < ds["losses"][0], ds["losses"]
    assert ds["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert ds["memory"]["stats"].recorded == 30
    assert ds["memory"]["tracked_peak"] <= 3 * 2**20, ds["memory"]
    assert ds["memory"]["tracked_peak"] < 0.5 * plain["memory"]["tracked_peak"], (
        ds["memory"], plain["memory"])
