"""DeviceLoader on real GPUs: bit-exact under stress, reused sources, memory, two GPUs."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchplace as tp
from torchplace.placement import image_transform

pytestmark = pytest.mark.gpu

N_BATCHES = 1000
BIG = 1 << 18  # int64 elements (2 MiB): copied on its own
SMALL = [1000 + 37 * j for j in range(8)]  # int64 tensors of ~8 KiB: packed into one copy


class ReusingSource:
    """Writes every batch in place into ONE set of host buffers, as a loader recycling its memory does.

    A copy that read a buffer after the next batch was written into it would see the wrong `i`.
    """

    def __init__(self, n: int, pinned: bool) -> None:
        self.n = n
        keep = (lambda t: t.pin_memory()) if pinned else (lambda t: t)
        self.big = keep(torch.empty(BIG, dtype=torch.int64))
        self.small = [keep(torch.empty(k, dtype=torch.int64)) for k in SMALL]

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        base_big = torch.arange(BIG, dtype=torch.int64) * 7
        base_small = [torch.arange(k, dtype=torch.int64) * 3 for k in SMALL]
        for i in range(self.n):
            torch.add(base_big, i, out=self.big)
            for j, buf in enumerate(self.small):
                torch.add(base_small[j], i * 10 + j, out=buf)
            yield {"big": self.big, "small": list(self.small), "i": i, "name": "batch"}


def check_stream(loader: tp.DeviceLoader, dev: torch.device, it=None) -> None:
    """Consume LOADER (or IT, an iterator of it) under stress and compare every batch with its exact values.

    Phases rotate: the consumer's stream kept busy (so memory freed early would be reused under
    it), the loader's own side stream kept busy (so a consumer that did not wait would read
    before the copy), batches dropped unread, and batches overwritten in place after use.
    """
    base_big = torch.arange(BIG, dtype=torch.int64, device=dev) * 7
    base_small = [torch.arange(k, dtype=torch.int64, device=dev) * 3 for k in SMALL]
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    seen = []
    for k, batch in enumerate(loader if it is None else it):
        i = batch["i"]
        seen.append(i)
        assert batch["name"] == "batch" and batch["big"].device == dev
        phase = k % 4
        if phase == 0:
            with torch.cuda.device(dev):
                torch.cuda._sleep(200_000)  # the consumer's stream behind
        elif phase == 2 and loader.stream is not None:
            with torch.cuda.stream(loader.stream):
                torch.cuda._sleep(200_000)  # copies of later batches behind
        if k % 7 == 3:
            del batch  # dropped unread
            continue
        bad += (batch["big"] != base_big + i).sum()
        for j, t in enumerate(batch["small"]):
            bad += (t != base_small[j] + (i * 10 + j)).sum()
        if k % 5 == 0:  # the consumer overwrites its batch: no later batch may see this
            batch["big"].fill_(-1)
            for t in batch["small"]:
                t.fill_(-1)
        del batch
    torch.cuda.synchronize(dev)
    assert seen == list(range(len(loader)))
    assert bad.item() == 0


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-source", "pageable-source"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_bit_exact_over_1000_batches_under_stress(pinned, pack):
    dev = torch.device("cuda:0")
    loader = tp.DeviceLoader(ReusingSource(N_BATCHES, pinned), dev, prefetch=2, pack=pack)
    check_stream(loader, dev)


def test_prefetch_one_and_deep_prefetch_are_exact_too():
    dev = torch.device("cuda:0")
    for prefetch in (1, 6):
        check_stream(tp.DeviceLoader(ReusingSource(200, pinned=True), dev, prefetch=prefetch), dev)


def test_one_side_stream_per_loader_made_once():
    loader = tp.DeviceLoader(ReusingSource(3, pinned=True), "cuda:0")
    list(loader)
    first = loader.stream
    list(loader)
    assert loader.stream is first and first.device == torch.device("cuda:0")
    assert first != torch.cuda.current_stream(0)


class Numbers(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((256, 256), float(i)), "y": torch.tensor(i), "meta": [i, "s"]}


@pytest.mark.parametrize("pin_memory", [True, False])
def test_wrapping_a_real_dataloader(pin_memory):
    loader = DataLoader(Numbers(), batch_size=8, num_workers=2, pin_memory=pin_memory)
    wrapped = tp.DeviceLoader(loader, "cuda:0")
    assert len(wrapped) == 8
    for _epoch in range(2):
        labels = []
        for batch in wrapped:
            assert batch["x"].device == torch.device("cuda:0")
            assert torch.equal(batch["x"][:, 0, 0].cpu(), batch["y"].float().cpu())
            labels.append(batch["y"].cpu())
        assert torch.equal(torch.cat(labels), torch.arange(64))


def test_memory_reserved_does_not_grow_over_20_epochs():
    dev = torch.device("cuda:0")
    data = [{"x": torch.randn(1 << 22), "small": [torch.randn(300) for _ in range(16)], "y": torch.arange(8)}
            for _ in range(6)]
    loader = tp.DeviceLoader(data, dev)
    w = torch.randn(1024, 1024, device=dev)
    reserved = []
    for _ in range(20):
        for batch in loader:
            h = batch["x"].view(-1, 1024) @ w  # some work on the consumer's stream
            loss = h.sum() + sum(t.sum() for t in batch["small"])
            loss.item()  # a training loop logging its loss
        torch.cuda.synchronize(dev)
        reserved.append(torch.cuda.memory_reserved(dev))
    assert reserved[-1] <= reserved[1], f"memory_reserved per epoch: {reserved}"


def test_a_host_running_far_ahead_does_not_pile_up_batches():
    """The host enqueues 30 slow steps without ever waiting; the worker must follow the device."""
    dev = torch.device("cuda:0")
    batch_bytes = 64 << 20
    data = [{"x": torch.ones(batch_bytes // 4)} for _ in range(30)]
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    prefetch = 2
    for batch in tp.DeviceLoader(data, dev, prefetch=prefetch):
        with torch.cuda.device(dev):
            torch.cuda._sleep(10_000_000)  # ~5 ms of device time per step, none of host time
        batch["x"][:1].sum()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert peak <= (prefetch + 3) * batch_bytes, f"peak {peak / 2**20:.0f} MiB for {prefetch=}"


def test_memory_reserved_does_not_grow_when_the_host_runs_ahead():
    """No sync in the loop: the host enqueues steps as fast as batches come, the device is behind."""
    dev = torch.device("cuda:0")
    data = [{"x": torch.randn(1 << 22), "small": [torch.randn(300) for _ in range(16)]} for _ in range(6)]
    loader = tp.DeviceLoader(data, dev)
    w = torch.randn(1024, 1024, device=dev)
    reserved = []
    for _ in range(20):
        for batch in loader:
            with torch.cuda.device(dev):
                torch.cuda._sleep(2_000_000)  # ~1 ms of device time, no host time
            h = batch["x"].view(-1, 1024) @ w
            del h
        torch.cuda.synchronize(dev)
        reserved.append(torch.cuda.memory_reserved(dev))
    assert reserved[-1] <= reserved[1], f"memory_reserved per epoch: {reserved}"


def test_break_mid_epoch_frees_the_batches_copied_ahead():
    dev = torch.device("cuda:0")
    batch_bytes = 4 << 20
    data = [{"x": torch.randn(batch_bytes // 4)} for _ in range(10)]
    gc.collect()  # garbage of earlier tests would otherwise be freed in between and blur the count
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    ahead = 0
    for i, batch in enumerate(tp.DeviceLoader(data, dev, prefetch=3)):  # noqa: B007  (held, then deleted below)
        if i == 2:
            deadline = time.monotonic() + 120  # the device is idle: the worker copies ahead at once (bound: a hang)
            while ahead < 3 * batch_bytes and time.monotonic() < deadline:
                time.sleep(0.01)
                ahead = torch.cuda.memory_allocated(dev) - before
            break
    del batch  # no gc.collect(): dropping the last reference must be enough
    deadline = time.monotonic() + 120
    while [t for t in threading.enumerate() if t.name == "torchplace-DeviceLoader"] and time.monotonic() < deadline:
        time.sleep(0.02)
    torch.cuda.synchronize(dev)
    after = torch.cuda.memory_allocated(dev)
    assert ahead >= 3 * batch_bytes, f"only {ahead} bytes in use at the break: the worker did not copy ahead"
    assert after <= before, f"{after - before} bytes still allocated after the break"


def test_packed_tensors_are_aligned_views_of_one_buffer():
    dev = torch.device("cuda:0")
    small = [torch.randn(3, 5), torch.arange(7), torch.randn(3, 5), torch.ones(1, dtype=torch.bool), torch.randn(3, 5)]
    out = next(iter(tp.DeviceLoader([{"small": small}], dev)))["small"]
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    assert all(t.data_ptr() % 64 == 0 for t in out)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(small, out))


@pytest.mark.parametrize("when", ["iter-and-next", "next-only"])
def test_bit_exact_under_the_consumers_own_stream(when):
    """The consumer runs on its own stream: under it for the whole loop, or switching after iter()."""
    dev = torch.device("cuda:0")
    user = torch.cuda.Stream(dev)
    loader = tp.DeviceLoader(ReusingSource(300, pinned=True), dev)
    if when == "iter-and-next":
        with torch.cuda.stream(user):
            check_stream(loader, dev)
    else:
        it = iter(loader)
        with torch.cuda.stream(user):
            check_stream(loader, dev, it)


def test_upstream_exception_on_gpu():
    def broken():
        yield {"x": torch.ones(4)}
        raise KeyError("missing sample 17")

    it = iter(tp.DeviceLoader(broken(), "cuda:0"))
    assert next(it)["x"].device.type == "cuda"
    with pytest.raises(KeyError, match="missing sample 17"):
        next(it)


def test_image_transform_runs_on_the_device():
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    loader = tp.DeviceLoader([(images, torch.arange(4))], "cuda:0",
                             transform=image_transform(mean, std, channels_last=True))
    x, y = next(iter(loader))
    expected = (images.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    assert x.device.type == "cuda" and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(x.cpu(), expected, atol=1e-5) and torch.equal(y.cpu(), torch.arange(4))


def test_a_transform_that_makes_sparse_and_nested_tensors_on_the_device():
    # record_stream refuses them: the tensors that hold their memory are recorded instead
    def transform(batch):
        x = batch["x"]
        return {"s": x.to_sparse(), "n": torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.jagged),
                "i": batch["i"]}

    data = [{"x": torch.full((2, 3), float(i)), "i": torch.tensor(i)} for i in range(20)]
    for background in (None, True):
        for batch in tp.DeviceLoader(data, "cuda:0", transform=transform, background=background):
            i = float(batch["i"])
            assert batch["s"].is_sparse and batch["s"].device.type == "cuda"
            assert torch.equal(batch["s"].to_dense().cpu(), torch.full((2, 3), i))
            assert torch.equal(batch["n"].values().cpu(), torch.full((5,), i))


class Moves:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device, non_blocking=False):
        return Moves(self.t.to(device, non_blocking=non_blocking))


def test_objects_with_their_own_to_on_gpu():
    data = [{"obj": Moves(torch.full((1000,), float(i))), "i": i} for i in range(50)]
    for batch in tp.DeviceLoader(data, "cuda:0"):
        assert batch["obj"].t.device.type == "cuda"
        assert torch.equal(batch["obj"].t.cpu(), torch.full((1000,), float(batch["i"])))


@pytest.mark.multigpu
def test_lands_on_cuda1_with_its_stream_made_there():
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    loader = tp.DeviceLoader(ReusingSource(300, pinned=True), dev)
    check_stream(loader, dev)
    assert loader.stream.device == dev
    assert torch.cuda.current_device() == 0  # the consumer's current device was left alone
