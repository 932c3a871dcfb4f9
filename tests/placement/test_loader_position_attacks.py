"""`tp.load(loader=dl)` with a position that does not belong to the loader given: saved over another dataset
length or batch size, or edited in the file (a negative or fractional count, RNG states that are no generator's).
Each is a CheckpointError naming what is wrong before a batch is drawn, never a silent resume at another
sample, an empty epoch or a RuntimeError from deep in torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp
from torchplace.errors import CheckpointError


def loader(n: int = 40, batch_size: int = 4) -> DataLoader:
    gen = torch.Generator()
    gen.manual_seed(0)
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=True, generator=gen)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint with a loader 3 batches into an epoch of 10."""
    dl = tp.DeviceLoader(loader(), "cpu")
    it = iter(dl)
    for _ in range(3):
        next(it)
    return tp.save(tmp_path / "ck.pt", loader=dl)


def test_the_same_loader_resumes_at_the_next_batch(saved):
    dl = tp.DeviceLoader(loader(), "cpu")
    tp.load(saved, loader=dl)
    assert len(list(dl)) == 7


@pytest.mark.parametrize("n, batch_size", [(8, 4), (400, 4), (40, 2)])
def test_a_loader_of_another_length_is_refused(saved, n, batch_size):
    dl = tp.DeviceLoader(loader(n, batch_size), "cpu")
    with pytest.raises(CheckpointError, match=r"epoch of 10 batches.*has \d+ batches"):
        tp.load(saved, loader=dl)


class Edited:
    """An object whose state_dict is a hand-edited loader position: what a damaged file holds."""

    def __init__(self, **change):
        self.state = {"torchplace_loader": 1, "taken": 3, "length": 10, "sampler": {"type": "RandomSampler"},
                      "rng": {}, **change}

    def state_dict(self):
        return self.state


@pytest.mark.parametrize("change", [{"taken": -5}, {"taken": 2.5}, {"taken": 11}, {"length": "ten"},
                                    {"rng": {"torch": "x"}}, {"rng": [1, 2]}, {"sampler": [1]},
                                    {"rng": {"torch": torch.zeros(3, dtype=torch.uint8)}}])
def test_a_damaged_position_is_refused_by_name(tmp_path, change):
    path = tp.save(tmp_path / "edited.pt", loader=Edited(**change))
    dl = tp.DeviceLoader(loader(), "cpu")
    with pytest.raises(CheckpointError, match="loader position is damaged"):
        tp.load(path, loader=dl)
        next(iter(dl))


def test_a_position_past_an_iterable_loaders_end_is_refused_not_read_for_ever(tmp_path):
    """An IterableDataset has no length to check a position against: the skip reads batches, and a count past the
    data's end (an edited file: 10**12) stops there with a CheckpointError instead of calling next() 10**12 times."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(12).split(3))

    path = tp.save(tmp_path / "edited.pt", loader=Edited(taken=10**12, length=None, sampler={}))
    dl = tp.DeviceLoader(DataLoader(Stream(), batch_size=None), "cpu")
    tp.load(path, loader=dl)
    with pytest.raises(CheckpointError, match=r"batch 1000000000000 of an epoch.*ended after 4 batch"):
        next(iter(dl))
