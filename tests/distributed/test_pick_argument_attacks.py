"""`tp.pick(memory=, wait=, min_free_memory=)` given numbers a program computed (20e9, NaN, -1.0) or
values of another type: each is refused with a LeaseError that names it, never an AttributeError, and
a NaN or negative wait is never taken as some wait (on the h200x1 snapshot, nothing leased)."""

from __future__ import annotations

import math

import pytest

import torchplace as tp
from torchplace.errors import LeaseError


def test_a_float_number_of_bytes_reserves_that_many():
    picked = tp.pick(1, snapshot="h200x1", memory=20e9, lease=False)
    assert picked.memory_bytes == 20_000_000_000


@pytest.mark.parametrize("memory", [1e30, math.nan, math.inf, -1.5, [20], True])
def test_a_number_that_is_no_size_is_refused_by_name(memory):
    with pytest.raises(LeaseError, match="size"):
        tp.pick(1, snapshot="h200x1", memory=memory, lease=False)
    with pytest.raises(LeaseError, match="size"):
        tp.pick(1, snapshot="h200x1", min_free_memory=memory, lease=False)


@pytest.mark.parametrize("wait", [math.nan, -1, -0.5, "ten", True])
def test_a_wait_that_is_no_duration_is_refused_by_name(wait):
    with pytest.raises(LeaseError, match="duration"):
        tp.pick(1, snapshot="h200x1", wait=wait, lease=False)
