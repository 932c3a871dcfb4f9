"""Batches a careless dataset returns: nested 10,000 deep, dicts keyed by non-strings, containers whose
__len__ lies. A batch nested deeper than Python's recursion limit raised a bare RecursionError from
torch's default_collate (or our walk) with thousands of identical frames; it now says what and how to fix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import torchplace as tp

pytestmark = pytest.mark.timeout(120)
DEEP = r"nested deeper than Python's recursion limit.*Fix: flatten it"


def _deep(levels: int) -> Any:
    x: Any = torch.zeros(1)
    for _ in range(levels):
        x = [x]
    return x


class _Items(IterableDataset):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_batch_nested_10000_deep_is_named_through_packed_collate(batch_size: int | None) -> None:
    loader = DataLoader(_Items([_deep(10_000)] * 2), batch_size=batch_size, collate_fn=tp.packed_collate())
    with pytest.raises(RecursionError, match=f"packed_collate: the batch is {DEEP}"):
        list(tp.DeviceLoader(loader, "cpu"))


def test_a_deep_batch_a_user_collate_made_is_named_by_the_walk() -> None:
    loader = DataLoader(_Items([_deep(10_000)]), batch_size=None, collate_fn=tp.packed_collate(lambda b: b))
    with pytest.raises(RecursionError, match=f"packed_collate: the batch is {DEEP}"):
        list(loader)
    with pytest.raises(RecursionError, match=f"to_device.*'meta'.*{DEEP}"):
        tp.to_device(_deep(10_000), "meta")


def test_a_deep_cycle_is_still_named_as_a_cycle() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"batch\[1\] is batch"):
        tp.packed_collate(lambda b: b)(loop)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_dicts_keyed_by_non_strings_arrive_whole(batch_size: int | None) -> None:
    sample = {1: torch.zeros(2), (2, 3): torch.ones(2), None: torch.full((2,), 2.0), "1": torch.ones(1)}
    loader = DataLoader(_Items([sample] * 2), batch_size=batch_size, collate_fn=tp.packed_collate())
    batches = list(tp.DeviceLoader(loader, "cpu"))
    assert all(set(b) == set(sample) for b in batches)
    first = batches[0]
    assert first[None].sum() == (4 if batch_size is None else 8) and first["1"].shape[-1] == 1


class _LyingList(list):
    def __len__(self) -> int:
        return 10**9


def test_a_list_whose_len_lies_costs_nothing_more() -> None:
    loader = DataLoader(_Items([_LyingList([torch.zeros(2), torch.ones(2)])] * 2), batch_size=None,
                        collate_fn=tp.packed_collate())
    batches = list(tp.DeviceLoader(loader, "cpu"))
    assert len(batches) == 2 and torch.equal(list.__getitem__(batches[0], 1), torch.ones(2))
