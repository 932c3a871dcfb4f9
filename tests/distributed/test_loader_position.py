"""DeviceLoader's position in its epoch (placement/loader_state.py): saved mid-epoch, resumed at the next
batch in the same order, the batches before skipped by index (not loaded); torchdata's StatefulDataLoader
through its own state_dict()."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import torchplace as tp
from torchplace.placement.loader_state import pick


class Counted(Dataset):
    """40 samples, each its index; counts the loads made in this process."""

    def __init__(self) -> None:
        self.loads = 0

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads += 1
        return torch.tensor(i)


def _resume_mid_epoch(make, at: int = 3) -> tuple[list, list, Counted]:
    """(the whole epoch's batches, the resumed loader's batches, the resumed loader's dataset)."""
    torch.manual_seed(0)
    first = tp.DeviceLoader(make(Counted()), "cpu")
    whole, state = [], None
    for i, batch in enumerate(first):
        whole.append(batch.tolist())
        if i == at:
            state, rng = first.state_dict(), torch.get_rng_state()
        torch.rand(3)  # the training's own draws go on after the checkpoint
    torch.set_rng_state(rng)  # what loading the checkpoint's RNG does
    data = Counted()
    again = tp.DeviceLoader(make(data), "cpu")
    again.load_state_dict(state)
    return whole, [b.tolist() for b in again], data


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True])
def test_a_shuffled_dataloader_resumes_at_the_next_batch_in_the_same_order(workers, generator):
    def make(data):
        gen = torch.Generator().manual_seed(7) if generator else None
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=workers, generator=gen)

    whole, rest, data = _resume_mid_epoch(make)
    assert rest == whole[4:]
    if workers == 0:
        assert data.loads == 4 * len(rest)  # the 4 batches before were skipped by index


def test_a_distributed_sampler_of_another_epoch_is_refused_with_the_fix():
    sampler = DistributedSampler(Counted(), num_replicas=2, rank=0, seed=0)
    sampler.set_epoch(1)
    loader = tp.DeviceLoader(DataLoader(Counted(), batch_size=4, sampler=sampler), "cpu")
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    sampler.set_epoch(2)
    again = tp.DeviceLoader(DataLoader(Counted(), batch_size=4, sampler=sampler), "cpu")
    again.load_state_dict(state)
    with pytest.raises(tp.CheckpointError, match=r"epoch 1.*has epoch 2.*set_epoch\(1\)"):
        iter(again)


def test_an_epoch_that_ended_resumes_at_the_next_epochs_start():
    loader = tp.DeviceLoader(DataLoader(Counted(), batch_size=8), "cpu")
    assert len(list(loader)) == 5
    assert loader.state_dict()["taken"] == 0


def test_an_iterable_dataset_is_read_up_to_the_position():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(20))

    loader = tp.DeviceLoader(DataLoader(Stream(), batch_size=5), "cpu")
    it = iter(loader)
    next(it), next(it)
    again = tp.DeviceLoader(DataLoader(Stream(), batch_size=5), "cpu")
    again.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in again] == [list(range(10, 15)), list(range(15, 20))]


def test_a_stateful_dataloader_gets_its_own_state_back():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    whole, rest, _ = _resume_mid_epoch(lambda data: stateful.StatefulDataLoader(data, batch_size=4, shuffle=True))
    assert rest == whole[4:]


def test_n_ranks_to_m_skip_the_same_samples_of_the_order():
    saved = {"per_rank": [{"torchplace_loader": 1, "taken": 3}] * 4}
    assert pick(saved, 1, 4)[1] == 3
    state, skip, note = pick(saved, 0, 2)
    assert skip == 6 and "(exact)" in note  # 4 ranks x 3 batches = 2 ranks x 6
    _, skip, note = pick(saved, 0, 3)
    assert skip == 4 and "0 batch" not in note and "exact" in note
    _, skip, note = pick({"per_rank": [{"torchplace_loader": 1, "taken": 1}] * 4}, 0, 3)
    assert skip == 1 and "1 batch(es) of samples before the position are seen again" in note


@pytest.mark.parametrize("stateful", [False, True])
def test_the_position_goes_through_a_checkpoint_file(tmp_path, stateful):
    """tp.save(loader=...) writes it as plain data (a StatefulDataLoader's state with its workers' too)
    and tp.load(loader=...) gives it back."""
    if stateful:
        kind = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
        make = lambda: kind(list(range(40)), batch_size=4, shuffle=True, num_workers=2)  # noqa: E731
    else:
        make = lambda: DataLoader(list(range(40)), batch_size=4, shuffle=True)  # noqa: E731
    loader = tp.DeviceLoader(make(), "cpu")
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    tp.save(tmp_path / "ck.tpck", loader=loader)
    rest = [b.tolist() for b in batches]
    again = tp.DeviceLoader(make(), "cpu")
    tp.load(tmp_path / "ck.tpck", loader=again)
    assert [b.tolist() for b in again] == rest
