"""tests/conftest.py: what the suite's own machinery promises."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("probe")
@pytest.mark.parametrize("k", [0, 1])
def test_an_xdist_group_reaches_the_scheduler(request, k):
    """Under ``--dist loadgroup`` a grouped test's node id carries its ``@group`` suffix,
    which is all pytest-xdist schedules by: without it the group's tests are spread over
    the workers."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@probe"), request.node.nodeid
    assert request.node.nodeid.startswith("tests/test_conftest.py::")
