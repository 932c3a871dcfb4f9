"""packed_collate's slots on a GPU: page-locked in place (nothing copied by the pin-memory step), and
never written again before the copy that reads them has run, even when copies queue behind compute."""

from __future__ import annotations

import gc

import pytest
import torch
from placement.test_slots import Numbered, _check, _rings
from torch.utils.data import DataLoader, default_convert

import torchplace as tp
from torchplace.placement import _slots

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = 2_000_000  # about a millisecond of device time: copies queue behind it


@pytest.fixture
def dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gc.collect()  # CUDA objects left in cycles by earlier tests would otherwise be freed in the forked workers
    return torch.device("cuda:0")


def test_slots_are_pinned_in_place_and_the_pin_step_copies_nothing(dev):
    fn = tp.packed_collate(default_convert)
    loader = DataLoader(Numbered(16), batch_size=None, num_workers=2, pin_memory=True, collate_fn=fn)
    for i, raw in enumerate(loader):
        assert raw.lease is not None and raw.buffer.is_pinned(), _slots.why_not_pinned()
        assert raw.buffer.data_ptr() == raw.lease.storage.data_ptr()  # the worker's bytes, where it wrote them
        assert raw.lease.slot in raw.lease.ring.pinned
        _check(tp.to_device(raw, dev), i)
    assert _slots.why_not_pinned() is None
    assert all(len(ring.pinned) <= fn.slots for ring in _rings(fn))


@pytest.mark.parametrize("pin_memory", [True, False], ids=["pin_memory", "pinned_by_the_loader_thread"])
def test_device_loader_from_slots_over_epochs_with_copies_behind_compute(dev, pin_memory):
    fn = tp.packed_collate(default_convert)
    loader = DataLoader(Numbered(24), batch_size=None, num_workers=2, pin_memory=pin_memory, collate_fn=fn,
                        persistent_workers=True)
    for _ in range(3):
        ok = []
        for i, batch in enumerate(tp.DeviceLoader(loader, dev, prefetch=3)):
            torch.cuda._sleep(_SLEEP_CYCLES)  # the step's compute: later copies wait behind it
            ok.append(torch.stack([(batch["a"] == i).all(), (batch["b"] == i).all(), (batch["c"][0] == i).all()]))
        assert bool(torch.stack(ok).all())  # no slot was written again before its copy had read it
        assert not _slots._held  # the epoch's end let every slot go
    assert all(ring.pinned for ring in _rings(fn))


def test_a_host_batch_moved_by_hand_keeps_its_slot_until_the_copy_has_read_it(dev):
    fn = tp.packed_collate(default_convert, slots=2)
    loader = DataLoader(Numbered(16), batch_size=None, num_workers=1, pin_memory=True, collate_fn=fn)
    ok = []
    for i, raw in enumerate(loader):
        torch.cuda._sleep(_SLEEP_CYCLES)  # the copy below runs only after this
        batch = tp.to_device(raw, dev)
        del raw  # the batch is gone at once; its slot must wait for the copy
        ok.append((batch["a"] == i).all() & (batch["b"] == i).all())
    assert bool(torch.stack(ok).all())


def test_recommender_batches_grow_their_slots_and_stay_exact(dev):
    from placement.test_collate import RecsysBatches, _recsys_batch, assert_same

    fn = tp.packed_collate(default_convert, slots=2)
    loader = DataLoader(RecsysBatches(), batch_size=None, num_workers=1, pin_memory=True, collate_fn=fn)
    got = list(tp.DeviceLoader(loader, dev))
    torch.cuda.synchronize()
    for i, batch in enumerate(got):
        assert_same(_recsys_batch(i), batch)


def test_one_refused_slot_falls_back_alone_and_leaves_no_cuda_error_behind(dev):
    import warnings

    from torchplace.errors import PackingWarning
    from torchplace.placement import collate

    collate._warned.clear()
    fn = tp.packed_collate(default_convert, slots=2)
    it = iter(DataLoader(Numbered(4), batch_size=None, num_workers=1, collate_fn=fn))  # nothing pinned by the loader
    first, second = next(it), next(it)  # two slots of one worker
    cudart = torch.cuda.cudart()
    taken = first.lease.storage  # registered by someone else first: cudaHostRegister refuses it as registered already
    torch.cuda.check_error(cudart.cudaHostRegister(taken.data_ptr(), taken.nbytes(), 1))
    try:
        with pytest.warns(PackingWarning, match="could not page-lock a slot") as said:
            assert collate.pin_slot(first.lease) is False
            assert collate.pin_slot(first.lease) is False  # not tried again, not said again
        assert len(said) == 1
        torch.ones(4, device=dev).add_(1)  # before: raised the refusal, left as the runtime's last error
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error", PackingWarning)
            assert collate.pin_slot(second.lease) is True  # before: every later slot went copying
        assert _slots.why_not_pinned() is None
        _check(tp.to_device(first, dev), 0)
        _check(tp.to_device(second, dev), 1)
        torch.cuda.synchronize()
    finally:
        torch.cuda.check_error(cudart.cudaHostUnregister(taken.data_ptr()))
        it._shutdown_workers()  # now, not when collected: a worker killed later fails the next test's SIGCHLD


def test_packed_batches_are_staged_on_the_loops_thread_and_follow_the_device(dev):
    """Packed batches skip the worker thread (InlineIter); others keep it. A host that enqueues slow
    steps without waiting still holds no more than a few batches on the device."""
    import threading

    from torchplace.placement import pack
    from torchplace.placement._inline import InlineIter
    from torchplace.placement.loader import _BackgroundIter

    batch_bytes = 64 * 2**16 * 4  # 64 tensors of 256 KiB: small enough to pack
    data = [pack({"t": [torch.full((2**16,), float(i)) for _ in range(64)], "i": i}).pin_memory() for i in range(30)]
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    prefetch = 2
    it = iter(tp.DeviceLoader(data, dev, prefetch=prefetch))
    # .inner: the epoch's iterator inside the one that counts batches for resuming (loader_state.Tracked)
    assert type(data[0]).__name__ == "PackedBatch" and type(it.inner) is InlineIter
    assert not [t for t in threading.enumerate() if t.name == "torchplace-DeviceLoader"]
    ok = []
    for i, batch in enumerate(it):
        torch.cuda._sleep(10 * _SLEEP_CYCLES)  # ~10 ms of device time per step, none of host time
        ok.append(torch.stack([(t == i).all() for t in batch["t"]]).all())
        assert batch["i"] == i
    assert bool(torch.stack(ok).all())
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert peak <= (prefetch + 4) * batch_bytes, f"peak {peak / 2**20:.0f} MiB for {prefetch=}"
    assert type(iter(tp.DeviceLoader([{"x": torch.ones(3)}], dev)).inner) is _BackgroundIter
    assert list(tp.DeviceLoader([], dev)) == []  # the first batch is looked at: an empty loader is an empty epoch
