"""packed_collate: batches packed in real DataLoader workers come back equal to the plain collate's."""

from __future__ import annotations

import pickle
import warnings
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence
from torch.utils.data import DataLoader, Dataset, default_collate, default_convert

import torchplace as tp
from torchplace.errors import PackingWarning
from torchplace.placement import PackedBatch, _pack, collate, pack, packed_collate

Pair = namedtuple("Pair", "image label")


@dataclass
class Boxes:
    xyxy: torch.Tensor
    source: str


def _sample(i: int) -> dict:
    """Every dtype family, 0-dim, empty, a large tensor, nesting, and values that are not tensors."""
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(3, 4, generator=g), "flag": torch.tensor(i % 2 == 0),
            "mask": torch.rand(7, generator=g) > 0.5,
            "half": torch.randn(5, generator=g).half(), "bf16": torch.randn(3, generator=g).bfloat16(),
            "id": torch.tensor(i), "u8": torch.randint(0, 255, (2, 3), dtype=torch.uint8, generator=g),
            "empty": torch.empty(0, 3), "empty_tail": torch.empty(2, 0), "big": torch.randn(70_000, generator=g),
            "nested": [Pair(torch.randn(2, 2, generator=g), torch.tensor(i)), {"deep": torch.arange(i, i + 3)}],
            "name": f"s{i}", "step": i}


class Samples(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return _sample(i)


def _recsys_batch(i: int, batch_size: int = 32) -> dict:
    """A recommender batch (DLRM-like): 26 sparse features as values + offsets, 13 dense features, labels."""
    g = torch.Generator().manual_seed(i)
    sparse = {}
    for f in range(26):
        lengths = torch.randint(0, 4, (batch_size,), generator=g)
        offsets = torch.zeros(batch_size + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        sparse[f"cat_{f}"] = {"values": torch.randint(0, 10_000, (int(lengths.sum()),), generator=g),
                              "offsets": offsets}
    return {"dense": torch.randn(batch_size, 13, generator=g), "sparse": sparse,
            "labels": torch.randint(0, 2, (batch_size,), generator=g).float()}


class RecsysBatches(Dataset):
    """Whole batches from the dataset (batch_size=None), as recommender pipelines make them."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        return _recsys_batch(i)


def assert_same(a, b) -> None:
    """Same structure and types; tensors of the same dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        if b.device.type != "meta":
            assert torch.equal(a.cpu(), b.cpu())
        return
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, Boxes):
        assert_same(a.xyxy, b.xyxy)
        assert a.source == b.source
    else:
        assert a == b


def test_workers_pack_and_device_loader_gives_the_plain_collates_batches_on_cpu():
    plain = list(DataLoader(Samples(), batch_size=4, num_workers=2))
    loader = DataLoader(Samples(), batch_size=4, num_workers=2, collate_fn=packed_collate())
    packed = list(tp.DeviceLoader(loader, "cpu"))
    assert len(packed) == len(plain) == 3
    for a, b in zip(plain, packed):
        assert_same(a, b)


@pytest.mark.parametrize("slots", [None, 0], ids=["in_a_slot", "fresh_buffer"])
def test_the_batch_crosses_processes_as_one_shared_buffer_plus_its_large_tensor(slots):
    loader = DataLoader(Samples(), batch_size=4, num_workers=2, collate_fn=packed_collate(slots=slots))
    raw = next(iter(loader))
    assert isinstance(raw, PackedBatch) and raw.buffer.dtype == torch.uint8
    assert (raw.lease is not None) if slots is None else (raw.lease is None and raw.buffer.is_shared())
    assert raw.count == 13  # every tensor ("step" too, collated into one) but "big" (above the size limit)
    assert isinstance(raw.skeleton["big"], torch.Tensor) and raw.skeleton["big"].shape == (4, 70_000)
    batch = tp.to_device(raw, "cpu")
    storages = {t.untyped_storage().data_ptr() for k, t in batch.items() if isinstance(t, torch.Tensor) and k != "big"}
    assert storages == {raw.buffer.untyped_storage().data_ptr()}


def test_meta_gives_the_shapes_and_dtypes():
    plain = default_collate([_sample(i) for i in range(3)])
    moved = tp.to_device(pack(plain), "meta")
    assert moved["x"].device.type == "meta"
    assert_same(plain, moved)


def test_device_loader_with_its_worker_thread_on_cpu_rebuilds_the_batch():
    batches = [pack(default_collate([_sample(i + j) for j in range(3)])) for i in range(4)]
    out = list(tp.DeviceLoader(batches, "cpu", background=True))
    for i, b in enumerate(out):
        assert_same(default_collate([_sample(i + j) for j in range(3)]), b)


def test_recommender_batches_from_workers_with_variable_lengths():
    plain = [_recsys_batch(i) for i in range(6)]
    loader = DataLoader(RecsysBatches(), batch_size=None, num_workers=2, collate_fn=packed_collate(default_convert))
    got = list(tp.DeviceLoader(loader, "cpu"))
    for a, b in zip(plain, got):
        assert_same(a, b)
    # 26 values (int64, variable lengths) and 26 offsets (int64, 33 each) are one group: one split
    raw = pack(_recsys_batch(0))
    assert raw.count == 26 * 2 + 2
    assert len(raw.layout[2]) == 3  # int64 1-D, fp32 (32, 13), fp32 1-D


def test_layout_aligns_each_group_and_each_tensor_to_its_dtype_and_is_cached():
    batch = default_collate([_sample(i) for i in range(3)])
    raw = pack(batch)
    total, _, groups = raw.layout
    assert total % _pack.ALIGN == 0
    for _dtype, _rows, offset, nbytes, _sizes, _ in groups:
        assert offset % _pack.ALIGN == 0 and offset + nbytes <= total
    for t in _pack.group_views(raw.buffer, raw.layout, raw.count):
        assert (t.data_ptr() - raw.buffer.data_ptr()) % t.element_size() == 0
    assert pack(default_collate([_sample(i) for i in range(3, 6)])).layout is raw.layout


def test_nested_containers_and_objects_with_their_own_to_keep_their_types():
    seq = pack_sequence([torch.arange(3.0), torch.arange(2.0)])
    batch = {"pairs": [Pair(torch.ones(2), torch.tensor(1)), Pair(torch.zeros(2), torch.tensor(0))],
             "boxes": Boxes(torch.rand(4, 4), "coco"), "seq": seq, "t": (torch.ones(1), torch.zeros(3, 1))}
    raw = pack(batch)
    assert raw.skeleton["seq"] is seq  # moved whole by its .to(), its batch_sizes stay on the host
    moved = tp.to_device(raw, "cpu")
    assert_same({k: v for k, v in batch.items() if k != "seq"}, {k: v for k, v in moved.items() if k != "seq"})
    assert torch.equal(moved["seq"].data, seq.data)


def test_a_pickle_keeps_every_slot_one_object():
    raw = pack(default_collate([_sample(i) for i in range(2)]))
    back = pickle.loads(pickle.dumps(raw))
    assert back.slot is back.skeleton["x"] is back.skeleton["nested"][0].label
    assert_same(raw.unpack(), back.unpack())


def test_unpackable_tensors_travel_alone_and_the_reason_is_said_once():
    collate._warned.clear()
    batch = {"a": torch.ones(3), "b": torch.ones(4), "t": torch.ones(4, 3).t(), "g": torch.ones(2, requires_grad=True)}
    with pytest.warns(PackingWarning, match=r"1 non-contiguous; 1 requiring grad"):
        moved = tp.to_device(pack(batch), "cpu")
    assert moved["t"] is batch["t"] and moved["g"] is batch["g"]
    assert_same(batch["a"], moved["a"])
    with warnings.catch_warnings():  # the second batch says nothing
        warnings.simplefilter("error", PackingWarning)
        tp.to_device(pack(batch), "cpu")


def test_a_batch_with_fewer_than_two_small_tensors_is_not_packed():
    batch = {"one": torch.ones(3), "big": torch.ones(100_000), "n": 3}
    assert pack(batch) is batch
    assert pack("no tensors") == "no tensors"
    two = {"a": torch.ones(2), "b": torch.ones(2)}
    assert pack(two, max_tensor_bytes=4) is two


def test_the_size_limit_takes_a_size_and_bad_arguments_say_what_to_give():
    assert packed_collate(max_tensor_bytes="1KiB").max_tensor_bytes == 1024
    with pytest.raises(ValueError, match="max_tensor_bytes"):
        packed_collate(max_tensor_bytes=-1)
    with pytest.raises(TypeError, match="collate_fn must be a function"):
        packed_collate("default")  # type: ignore[arg-type]
    assert "default_collate" in repr(packed_collate())


def test_sets_deques_and_attrs_classes_in_a_packed_batch_have_every_tensor_moved():
    # the rebuild kept them whole as plain values: a loose tensor in one stayed on the host
    attrs = pytest.importorskip("attrs")
    from collections import deque

    Holder = attrs.make_class("Holder", ["x"])
    large = torch.arange(1 << 18, dtype=torch.float32)  # above the packing limit: moved on its own
    for extra in (deque([large], maxlen=3), {large}, frozenset([large]), Holder(large)):
        raw = pack({"a": torch.ones(2), "b": torch.zeros(3), "e": extra})
        assert type(raw) is PackedBatch
        for _ in range(2):  # the walk, then the builder the first rebuild made
            out = raw.rebuild(raw.buffer, lambda t: t.to("meta"), lambda x: x)
            held = out["e"].x if type(out["e"]) is Holder else next(iter(out["e"]))
            assert type(out["e"]) is type(extra) and held.is_meta, extra
            assert torch.equal(out["b"], torch.zeros(3))


def test_a_set_of_small_tensors_goes_unpacked_rather_than_mixing_up_slots():
    # one placeholder object stands for every slot, and a set keeps it once
    a, b, c = torch.arange(4.0), torch.arange(4.0) + 10, torch.arange(3) + 100
    batch = {"s": {a, b}, "c": c}
    assert pack(batch) is batch
    moved = tp.to_device(pack(batch), "meta")
    assert moved["c"].dtype == torch.int64 and moved["c"].shape == (3,) and len(moved["s"]) == 2
