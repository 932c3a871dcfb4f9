"""DeviceLoader and packed_collate under the DataLoader set-ups users write, on cpu: every batch
bit-exact against the unwrapped DataLoader, no thread or worker process left behind, no hang."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

import torchplace as tp

pytestmark = pytest.mark.timeout(120)
BACKGROUND = [pytest.param(False, id="inline"), pytest.param(True, id="background")]


def same(a, b, path: str = "batch") -> None:
    """A and B equal bit for bit, of the same types, dtypes and shapes, B on the host."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and b.device.type == "cpu", path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous().reshape(-1).view(torch.uint8)

        assert torch.equal(raw(a), raw(b)), path
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    else:
        assert a == b, path


def alive() -> tuple[set, set]:
    return set(multiprocessing.active_children()), set(threading.enumerate())


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """The worker processes and threads a test started are gone once it is over (collected)."""
    before = alive()
    yield
    deadline = time.monotonic() + 120  # a hang detector: the loop ends as soon as they are gone
    gc.collect()
    while time.monotonic() < deadline and any(now - was for now, was in zip(alive(), before)):
        time.sleep(0.05)
        gc.collect()
    children, threads = (now - was for now, was in zip(alive(), before))
    assert (children, [t.name for t in threads]) == (set(), [])


def each(loader: DataLoader, background: bool, ref: list) -> None:
    """Iterate LOADER through DeviceLoader, each batch compared to REF's as it comes (none kept:
    a packed batch held holds its worker's slot)."""
    n = 0
    for n, got in enumerate(tp.DeviceLoader(loader, "cpu", background=background), 1):
        same(ref[n - 1], got)
    assert n == len(ref)


class Shards(IterableDataset):
    """Each worker yields its own share of range(N)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, step):
            yield {"i": torch.tensor(i), "x": torch.full((3,), float(i)), "worker": first}

    def __len__(self) -> int:
        return self.n


class Backwards(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Mixed(Dataset):
    """Samples as datasets make them: numpy arrays, Python scalars, strings, None, image-like objects."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return {"np": np.arange(i, i + 3, dtype=np.float32), "int": i, "float": i / 2, "name": f"s{i}",
                "none": None, "image": Image(i), "ids": torch.tensor([i, i], dtype=torch.int8)}


class Image:
    """Like a PIL image: neither a tensor nor something with a `.to()`."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return type(other) is Image and other.v == self.v


def mixed_collate(samples: list[dict]) -> dict:
    from torch.utils.data import default_collate

    out = default_collate([{k: s[k] for k in ("np", "int", "float", "name", "ids")} for s in samples])
    out.update(none=[s["none"] for s in samples], image=[s["image"] for s in samples], raw=[s["np"] for s in samples])
    return out


class Moves:
    """A collate's own batch class with a `.to()`."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device, non_blocking: bool = False) -> Moves:
        return Moves(self.t.to(device, non_blocking=non_blocking))

    def __eq__(self, other: object) -> bool:
        return type(other) is Moves and torch.equal(self.t, other.t)


def own_class_collate(samples: list[int]) -> list:
    return [Moves(torch.tensor(samples)), torch.tensor(samples, dtype=torch.float64)]


def ragged_collate(samples: list[int]) -> dict:
    """Variable lengths, a key that comes and goes, every dtype users send, odd memory layouts."""
    i = samples[0]
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i
    out = {"seq": [torch.arange(s % 4 + 1, dtype=torch.int32) for s in samples], "n": torch.tensor(samples),
           "bool": base > 5, "complex": torch.complex(base, -base), "bf16": base.to(torch.bfloat16),
           "int8": base.to(torch.int8), "empty": torch.empty(0, 3), "transposed": base.transpose(0, 2),
           "sliced": base[:, ::2], "nhwc": base[None].contiguous(memory_format=torch.channels_last)}
    if i % 3 == 0:
        out["sometimes"] = torch.ones(len(samples), dtype=torch.bool)
    return out


@pytest.mark.parametrize("background", BACKGROUND)
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_real_dataloader_set_ups_give_the_unwrapped_batches(background, packed):
    wrap = tp.packed_collate if packed else (lambda f=None: f)
    data = list(range(23))
    set_ups = [  # (what the DataLoader is given, besides workers and collate)
        lambda **k: DataLoader(Shards(10), batch_size=3, **k),
        lambda **k: DataLoader(data, batch_sampler=BatchSampler(Backwards(23), 5, drop_last=False), **k),
        lambda **k: DataLoader(data, batch_size=5, drop_last=True, **k),
        lambda **k: DataLoader(data, batch_size=4, sampler=Backwards(23), **k),
    ]
    for make in set_ups:
        for workers in (0, 2):  # with 2, each worker's shard: its own batches, taken in turn
            ref = list(make(num_workers=workers))
            each(make(num_workers=workers, collate_fn=wrap()), background, ref)
    for collate in (mixed_collate, own_class_collate, ragged_collate):
        ref = list(DataLoader(Mixed() if collate is mixed_collate else data, batch_size=4, collate_fn=collate))
        for workers in (0, 2):
            each(DataLoader(Mixed() if collate is mixed_collate else data, batch_size=4, num_workers=workers,
                            collate_fn=wrap(collate)), background, ref)


def test_len_of_a_loader_over_an_iterable_dataset_is_the_dataloaders():
    loader = DataLoader(Shards(10), batch_size=3, num_workers=2)
    assert len(tp.DeviceLoader(loader, "cpu")) == len(loader) == 4


class Batches(IterableDataset):
    """A dataset that yields whole batches (a generator of batches), for batch_size=None."""

    def __iter__(self):
        for i in range(5):
            yield {"a": torch.arange(i + 2), "b": torch.ones(i + 1, 2, dtype=torch.bfloat16)}


@pytest.mark.parametrize("background", BACKGROUND)
@pytest.mark.parametrize("workers", [0, 2])
def test_packed_collate_with_batch_size_none_converts_each_batch_as_the_dataloader_does(background, workers):
    """batch_size=None: the DataLoader hands each dataset item over alone, and its own default is
    default_convert; packed_collate() with no collate_fn did default_collate of one dict (KeyError: 0)."""
    ref = list(DataLoader(Batches(), batch_size=None, num_workers=workers))  # with 2, each worker's copy in turn
    loader = DataLoader(Batches(), batch_size=None, num_workers=workers, collate_fn=tp.packed_collate())
    each(loader, background, ref)
    # iterated without DeviceLoader: still a batch, not a KeyError
    for want, got in zip(Batches(), DataLoader(Batches(), batch_size=None, collate_fn=tp.packed_collate())):
        same(want, tp.to_device(got, "cpu"))


@pytest.mark.parametrize("background", BACKGROUND)
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_persistent_workers_over_epochs_broken_off_mid_way(background, packed):
    """Breaking out of an epoch, then starting the next: each epoch starts at the first batch, none
    of the old epoch's batches leak in, and two DeviceLoaders (train and eval) take turns."""
    data = [torch.full((i % 5 + 1,), float(i)) for i in range(30)]
    pad = torch.nn.utils.rnn.pad_sequence
    ref = list(DataLoader(data, batch_size=4, collate_fn=pad))
    loader = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True,
                        collate_fn=tp.packed_collate(pad) if packed else pad)
    train, evaluate = tp.DeviceLoader(loader, "cpu", background=background), tp.DeviceLoader(loader, "cpu")
    for _ in range(3):
        for k, got in enumerate(train):
            same(ref[k], got)
            if k == 2:
                break
        each(loader, not background, ref)  # a full epoch in between, the other way
        for k, got in enumerate(evaluate):
            same(ref[k], got)
    del train, evaluate, loader


@pytest.mark.parametrize("background", BACKGROUND)
def test_a_second_loop_over_a_persistent_dataloader_ends_the_first_and_says_so(background):
    """A persistent DataLoader has one iterator, which iter() restarts: the plain DataLoader splits
    its batches between two loops; with a worker thread still pulling, the restart raced it (KeyError
    in the DataLoader, or a hang). Now the newer loop ends the older, whose next batch says why."""
    loader = DataLoader(list(range(40)), batch_size=6, num_workers=2, persistent_workers=True)
    outer, inner = tp.DeviceLoader(loader, "cpu", background=background), tp.DeviceLoader(loader, "cpu",
                                                                                           background=True)
    with pytest.raises(RuntimeError, match="ended by a newer epoch over the same DataLoader"):
        for _ in outer:
            assert len(list(inner)) == 7
    assert [len(b) for b in outer] == [6] * 6 + [4]  # the loop after works as before
    it = iter(outer)
    next(it)
    del it  # an epoch left behind, never touched again: nothing to say
    assert len(list(inner)) == 7
    del outer, inner, loader


@pytest.mark.parametrize("background", BACKGROUND)
def test_iterated_from_another_thread(background):
    loader = DataLoader(list(range(20)), batch_size=3, num_workers=2)
    ref = list(DataLoader(list(range(20)), batch_size=3))
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(tp.DeviceLoader(loader, "cpu", background=background)))
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    same(ref, out)


class Corrupt(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 7 and get_worker_info() is not None:
            raise ValueError(f"corrupt record {i}")
        return torch.tensor([i, i])


@pytest.mark.parametrize(("background", "persistent"), [(False, True), (True, False)],
                         ids=["inline-persistent", "background-fresh"])
def test_a_workers_exception_reaches_the_loop_with_its_traceback_and_the_next_epoch_runs(background, persistent):
    # One worker: torch keeps a failed epoch's DataLoader iterator in a reference cycle (its reraise
    # frame), and shutting it down at collection waits 5 s per worker, as without DeviceLoader.
    loader = DataLoader(Corrupt(), batch_size=2, num_workers=1, persistent_workers=persistent,
                        collate_fn=tp.packed_collate())
    dev = tp.DeviceLoader(loader, "cpu", background=background)
    for _ in range(2):
        seen = []
        with pytest.raises(ValueError, match="corrupt record 7") as info:
            for batch in dev:
                seen.append(batch[:, 0].tolist())
        assert "__getitem__" in str(info.value) and "worker process" in str(info.value)
        assert seen == [[0, 1], [2, 3], [4, 5]]
    del info, dev, loader


@pytest.mark.parametrize("background", BACKGROUND)
def test_ctrl_c_in_the_loop_leaves_nothing_running(background):
    loader = DataLoader(list(range(2000)), batch_size=2, num_workers=2, persistent_workers=True)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(tp.DeviceLoader(loader, "cpu", background=background)):
            if i == 5:  # Ctrl-C in the loop's body, raised here: interrupt_main()'s signal was lost on a
                raise KeyboardInterrupt  # loaded machine (taken by a finalizer, 2 of 2933 under busy_test.sh)
            time.sleep(0.005)
    assert len(list(tp.DeviceLoader(loader, "cpu", background=background))) == 1000
    del loader


@pytest.mark.parametrize("background", BACKGROUND)
def test_ten_thousand_tiny_tensors_a_batch_from_workers(background):
    """Sent one by one, 10,000 tensors a batch from workers run out of file descriptors in torch
    ("Too many open files" under a common 1024 limit); packed, they cross as one buffer."""
    def collate(samples):
        return {"many": [torch.tensor([i], dtype=torch.float16) for i in range(10_000)], "i": torch.tensor(samples)}

    ref = list(DataLoader(list(range(4)), batch_size=2, collate_fn=collate))
    each(DataLoader(list(range(4)), batch_size=2, num_workers=2, collate_fn=tp.packed_collate(collate)),
         background, ref)


@pytest.mark.parametrize("background", BACKGROUND)
def test_views_sharing_a_tensor_arrive_equal_but_no_longer_shared_once_packed(background):
    """What users get for the same tensor twice in a batch, or views of one tensor: equal values
    always; shared memory only where nothing was copied (cpu, unpacked). Packed (and on an
    accelerator, where each tensor is copied, as `tensor.to()` does) each is a tensor of its own."""
    def collate(samples):
        t = torch.arange(6, dtype=torch.float32) + samples[0]
        return {"a": t, "again": t, "tail": t[2:], "grid": t.view(2, 3)}

    for packed in (False, True):
        loader = DataLoader([0, 1], batch_size=1, collate_fn=tp.packed_collate(collate) if packed else collate)
        for want, got in zip(DataLoader([0, 1], batch_size=1, collate_fn=collate),
                             tp.DeviceLoader(loader, "cpu", background=background)):
            same(want, got)
            got["a"][3] = 100.0
            shown = [got["again"][3] == 100, got["tail"][1] == 100, got["grid"][1, 0] == 100]
            assert shown == [not packed] * 3


@pytest.mark.parametrize("background", BACKGROUND)
def test_lightning_combined_loader_of_a_packed_and_a_plain_dataloader(background, monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    combined_loader = pytest.importorskip("lightning.pytorch.utilities.combined_loader")

    def pair(s):
        return {"v": torch.stack(s), "w": torch.stack(s) * 2}

    def make(collate):
        return combined_loader.CombinedLoader({
            "a": DataLoader(torch.arange(10.0), batch_size=3, num_workers=2, collate_fn=collate),
            "b": DataLoader(torch.arange(4), batch_size=2)}, "max_size_cycle")

    ref = list(make(pair))
    n = 0
    for n, (got, _, _) in enumerate(tp.DeviceLoader(make(tp.packed_collate(pair)), "cpu", background=background), 1):
        same(ref[n - 1][0], got)
    assert n == len(ref) == 4
