"""Budget strings: units, percentages, clear errors."""

from __future__ import annotations

import pytest

from deepsolve.memory import BudgetError, device_capacity, format_bytes, parse_budget


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("12 GiB", 12 * 2**30), ("1.5kB", 1500),
    ("100", 100), ("4096 B", 4096), ("1e3 KiB", 1000 * 1024), ("3 TiB", 3 * 2**40),
    (123456, 123456), (2.5e6, 2_500_000),
])
def test_units(text, expected):
    assert parse_budget(text) == expected


def test_percentage_of_available_memory():
    cap = device_capacity("cpu")
    assert cap > 0
    assert abs(parse_budget("50%") - cap // 2) <= cap * 0.05  # MemAvailable moves a little


@pytest.mark.parametrize("bad,match", [
    ("12 parsecs", "unknown unit"), ("GiB", "cannot read"), ("-5MiB", "cannot read"),
    ("0MiB", "positive"), ("150%", "percentage"), (0, "positive"), (-3, "positive"),
    (True, "bytes or a string"), ([1], "bytes or a string"), ("", "cannot read"),
    (float("inf"), "finite"), ("1e400", "finite"), ("1e400 GiB", "finite"),
    (float("nan"), "positive"),
])
def test_malformed(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_budget(bad)


def test_budget_error_is_value_error():
    assert issubclass(BudgetError, ValueError)


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
