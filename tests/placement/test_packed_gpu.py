"""packed_collate on a GPU: batches packed in DataLoader workers, pinned, copied once, equal to the source."""

from __future__ import annotations

import gc

import pytest
import torch
from placement.test_collate import RecsysBatches, Samples, _recsys_batch, _sample, assert_same
from torch.utils.data import DataLoader, default_collate
from torch.utils.data._utils.pin_memory import pin_memory

import torchplace as tp
from torchplace.placement import PackedBatch, pack

pytestmark = pytest.mark.gpu


@pytest.fixture
def dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda:0")


@pytest.mark.parametrize("pinned", [True, False], ids=["pin_memory", "pageable"])
def test_rebuilt_batches_on_cuda_equal_the_source(dev, pinned):
    loader = DataLoader(Samples(), batch_size=4, num_workers=2, collate_fn=tp.packed_collate(), pin_memory=pinned)
    gc.collect()  # CUDA objects left in cycles by earlier tests would otherwise be freed in the forked workers
    got = list(tp.DeviceLoader(loader, dev))
    torch.cuda.synchronize()
    for i, batch in enumerate(got):
        want = default_collate([_sample(j) for j in range(4 * i, min(4 * i + 4, 10))])
        assert batch["x"].device == dev and batch["big"].device == dev
        assert_same(want, batch)
        packed = [batch[k] for k in ("x", "flag", "half", "bf16", "id", "u8")]
        assert len({t.untyped_storage().data_ptr() for t in packed}) == 1  # views of one device buffer


def test_dataloaders_pin_memory_pins_the_one_buffer(dev):
    raw = pack(default_collate([_sample(i) for i in range(4)]))
    pinned = pin_memory(raw)  # what the DataLoader's pin-memory thread calls
    assert isinstance(pinned, PackedBatch) and pinned.buffer.is_pinned() and pinned.skeleton["big"].is_pinned()
    assert_same(raw.unpack(), tp.to_device(pinned, dev))


def test_recommender_batches_and_to_device_and_the_sync_loader(dev):
    loader = DataLoader(RecsysBatches(), batch_size=None, num_workers=2, pin_memory=True,
                        collate_fn=tp.packed_collate(torch.utils.data.default_convert))
    for i, batch in enumerate(tp.DeviceLoader(loader, dev, prefetch=3)):
        assert_same(_recsys_batch(i), batch)
    for i, batch in enumerate(tp.DeviceLoader(loader, dev, background=False)):
        assert_same(_recsys_batch(i), batch)
    big = pack(_recsys_batch(0, batch_size=4096))  # values above the size limit keep their own copy
    assert_same(_recsys_batch(0, batch_size=4096), tp.to_device(big, dev))


@pytest.mark.parametrize("under", ["default stream", "own stream"])
def test_staging_on_the_loops_thread_leaves_its_stream_current(dev, under):
    """Packed batches are staged on the loop's thread, switching to the side stream through
    torch.accelerator's calls: after every next() the loop's stream (and device) is current again,
    and the batches read right under it are the source's bytes."""
    batches = [pack(_recsys_batch(i)) for i in range(6)]
    user = torch.cuda.Stream(dev) if under == "own stream" else torch.cuda.current_stream(dev)
    with torch.cuda.stream(user):
        loader = tp.DeviceLoader([b.pin_memory() for b in batches], dev)
        for i, batch in enumerate(loader):
            assert torch.cuda.current_stream(dev) == user and torch.cuda.current_device() == dev.index
            assert loader.stream != user
            doubled = {k: v * 2 for k, v in batch["sparse"]["cat_0"].items()}  # queued on the loop's stream
            want = _recsys_batch(i)["sparse"]["cat_0"]
            assert all(torch.equal(doubled[k].cpu(), want[k] * 2) for k in want)
