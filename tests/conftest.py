"""Shared fixtures; plain helper functions are in helpers.py (``from helpers import rel``).

Opt-in fixtures a module requests with ``pytestmark = pytest.mark.usefixtures(NAME)``:

``single_thread``
    one intra-op torch thread for the module's tests, restored after the module.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _cache_outside_the_checkout(tmp_path_factory):
    """Problems built in-process keep their ``ctx.cache`` files in a temporary directory,
    not in the checkout's runs/cache."""
    from deepsolve.problem import TRAINER_DEFAULTS

    old = TRAINER_DEFAULTS["cache_dir"]
    TRAINER_DEFAULTS["cache_dir"] = str(tmp_path_factory.mktemp("cache"))
    yield
    TRAINER_DEFAULTS["cache_dir"] = old


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
