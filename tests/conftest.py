"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _cache_outside_the_checkout(tmp_path_factory):
    """Problems built in-process keep their ``ctx.cache`` files in a temporary directory,
    not in the checkout's runs/cache."""
    from deepsolve.problem import TRAINER_DEFAULTS

    old = TRAINER_DEFAULTS["cache_dir"]
    TRAINER_DEFAULTS["cache_dir"] = str(tmp_path_factory.mktemp("cache"))
    yield
    TRAINER_DEFAULTS["cache_dir"] = old
