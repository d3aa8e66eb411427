"""Shared fixtures; plain helper functions are in helpers.py (``from helpers import rel``).

Opt-in fixtures a module requests with ``pytestmark = pytest.mark.usefixtures(NAME)``:

``single_thread``
    one intra-op torch thread for the module's tests, restored after the module.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` (``make test``) sends the tests of one ``xdist_group`` to one
    worker by a ``@group`` suffix on their node ids, which pytest-xdist 3.8 writes to
    ``item._nodeid``. From pytest 9.2 the node id is read from ``item._id`` (a
    ``NodeId``), so the suffix is lost and a group's tests are spread over the workers: its
    module fixtures built twice (the fresh-process memory measurements of test_planner.py,
    two minutes each), the wheel and sdist builds of test_packaging.py sharing build/ at
    once. Put the suffix where this pytest reads it."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)


def _global_state() -> dict:
    return {"torch threads": torch.get_num_threads(),
            "signal handlers": tuple(signal.getsignal(s) for s in _SIGNALS),
            "default dtype": torch.get_default_dtype(),
            "grad mode": torch.is_grad_enabled(),
            "anomaly detection": torch.is_anomaly_enabled(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "working directory": os.getcwd(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


@pytest.fixture(autouse=True)
def _no_leaked_global_state(request):
    """No test changes process-wide state another test would see (a module-scoped fixture
    may, for its module: ``single_thread``): a test that leaves torch's threads, default
    dtype, grad or anomaly mode, the working directory, the handlers of SIGINT, SIGTERM and
    SIGUSR1 (an ignored SIGINT is inherited by every process a later test starts) or
    ``OMP_NUM_THREADS`` changed fails, and the state is put back."""
    before = _global_state()
    yield
    after = _global_state()
    changed = [f"{k} {before[k]!r} -> {after[k]!r}" for k in before if before[k] != after[k]]
    if changed:
        torch.set_num_threads(before["torch threads"])
        torch.set_default_dtype(before["default dtype"])
        torch.set_grad_enabled(before["grad mode"])
        torch.autograd.set_detect_anomaly(before["anomaly detection"])
        torch.use_deterministic_algorithms(before["deterministic algorithms"])
        os.chdir(before["working directory"])
        for sig, handler in zip(_SIGNALS, before["signal handlers"], strict=True):
            signal.signal(sig, handler)
        if before["OMP_NUM_THREADS"] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before["OMP_NUM_THREADS"]
        pytest.fail(f"{request.node.nodeid} changed global state: {'; '.join(changed)}",
                    pytrace=False)


@pytest.fixture(scope="session")
def _session_cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def _cache_outside_the_checkout(_no_leaked_global_state, _session_cache_dir, monkeypatch):
    """Problems built by a test (in its process or in the processes it starts) keep their
    ``ctx.cache`` files in a temporary directory, not in the checkout's runs/cache: the
    ``DEEPSOLVE_CACHE_DIR`` environment variable, set for the test and removed after it.
    (It asks for the state guard first, so that ``monkeypatch`` is set up after the guard and
    undone before the guard looks.)"""
    monkeypatch.setenv("DEEPSOLVE_CACHE_DIR", _session_cache_dir)


@pytest.fixture(scope="module")
def single_thread():
    """Run the requesting module's tests with one intra-op thread; restored afterwards.

    On the 2-core CI/dev machines a busy neighbour process plus torch's OpenMP spin-waiting
    can slow tiny-grid loops (32x32 FFTs, small networks) by ~100x (0.3 s -> 30 s), and
    intra-op parallelism brings nothing at these sizes. Module-scoped, so that the module's
    own module-scoped fixtures (references, loaded problems) are built under it too.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def child_tmpdir(tmp_path, monkeypatch):
    """``TMPDIR`` for the processes the test starts: this test's own temporary directory.

    torchrun (torchelastic) makes a ``torchelastic_*`` directory under the temporary
    directory at every launch and leaves it there; with this, it lands under the test's
    ``tmp_path`` (which pytest cleans) instead of accumulating in the system's. This
    process's own ``tempfile`` directory is computed once per process and does not change.
    """
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp
