"""`packed_collate` inside a real DataLoader with two worker processes, on the batches other
frameworks' collate functions make: what DeviceLoader(..., "cpu") or `to_device` gives back must
equal the plain collate's batch bit for bit, tensor subclasses and their metadata included.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import torchplace as tp
from torchplace.errors import PackingWarning
from torchplace.placement import collate as collate_module

from .boxes import Boxes
from .helpers import on_host


class Samples(Dataset):
    def __init__(self, kind: str, n: int = 8) -> None:
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        if self.kind == "features":  # many small tensors of several dtypes, 0-dim and empty ones
            return {"ids": torch.randint(0, 100, (5,), generator=g), "mask": torch.rand(5, generator=g) > 0.5,
                    "score": torch.tensor(float(i)), "empty": torch.zeros(0, 2),
                    "f16": torch.randn(3, generator=g).half(),
                    "c64": torch.randn(2, dtype=torch.complex64, generator=g), "name": f"s{i}"}
        if self.kind == "detection":  # torchvision's reference detection recipe: image, target dict
            n = i % 3
            boxes = Boxes(torch.rand(n, 4, generator=g), format="XYXY", canvas_size=(8, 8 + i))
            return torch.rand(3, 8, 8, generator=g), {"boxes": boxes, "labels": torch.arange(n), "image_id": i}
        if self.kind == "hf":  # a tokenizer's output per sample
            return {"input_ids": torch.arange(i, i + 4), "attention_mask": torch.ones(4, dtype=torch.long)}
        if self.kind == "odd":
            return {"sparse": torch.eye(3).mul(i).to_sparse(), "t": torch.randn(4, 3, generator=g).t(),
                    "x": torch.randn(2, generator=g)}
        raise AssertionError(self.kind)


def detection_collate(samples: list) -> tuple:
    """torchvision's detection references: tuple(zip(*batch)), so targets keep their classes."""
    return tuple(zip(*samples))


def hf_collate(samples: list) -> Any:
    """What transformers' DataCollatorWithPadding returns: a BatchEncoding."""
    from transformers import BatchEncoding

    return BatchEncoding(default_collate(samples))


def tensordict_collate(samples: list) -> Any:
    from tensordict import TensorDict

    return {"td": TensorDict(default_collate(samples), batch_size=[len(samples)]), "n": len(samples)}


def odd_collate(samples: list) -> dict:
    """Tensors packing cannot view back from bytes (sparse, non-contiguous): they must travel loose."""
    return {"sparse": [s["sparse"] for s in samples], "t": [s["t"] for s in samples],
            "x": default_collate([s["x"] for s in samples])}


CASES = [("features", None), ("detection", detection_collate), ("hf", hf_collate), ("hf", tensordict_collate),
         ("odd", odd_collate)]


def batches(kind: str, collate: Any, packed: bool) -> list:
    fn = tp.packed_collate(collate) if packed else (collate or default_collate)
    loader = DataLoader(Samples(kind), batch_size=4, num_workers=2 if packed else 0, collate_fn=fn)
    if packed:
        return list(tp.DeviceLoader(loader, "cpu"))
    return list(loader)


@pytest.mark.parametrize(("kind", "collate"), CASES, ids=[f"{k}-{getattr(c, '__name__', 'default')}" for k, c in CASES])
def test_packed_batches_equal_the_plain_collate(kind: str, collate: Any) -> None:
    """pytorch/pytorch, test/test_dataloader.py (custom collate functions and workers give the same
    batches as in-process loading) and torchvision's detection references' collate, with packing."""
    plain = batches(kind, collate, packed=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed = batches(kind, collate, packed=True)
    assert [on_host(b) for b in packed] == [on_host(b) for b in plain]
    notes = [str(w.message) for w in caught if issubclass(w.category, PackingWarning)]
    assert len(notes) <= 1, notes  # at most one note, said once
    if kind == "detection":
        boxes = packed[0][1][1]["boxes"]
        assert type(boxes) is Boxes and boxes.canvas_size == (8, 9) and boxes.format == "XYXY"
        assert notes and "Boxes (a tensor subclass)" in notes[0]
    if kind == "odd":
        assert notes and "sparse_coo" in notes[0] and "non-contiguous" in notes[0]


def test_a_packed_batch_moved_by_to_device_and_the_input_left_alone() -> None:
    """The PackedBatch a worker sent, moved by to_device twice: the same batch each time (its
    buffer is not consumed), on "meta" too."""
    loader = DataLoader(Samples("detection"), batch_size=4, num_workers=2,
                        collate_fn=tp.packed_collate(detection_collate))
    plain = list(DataLoader(Samples("detection"), batch_size=4, collate_fn=detection_collate))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        for got, want in zip(loader, plain):
            assert on_host(tp.to_device(got, "cpu")) == on_host(want)
            assert on_host(tp.to_device(got, "cpu")) == on_host(want)
            meta = tp.to_device(got, "meta")
            assert meta[0][0].is_meta and type(meta[1][0]["boxes"]) is Boxes and meta[1][0]["boxes"].is_meta


def packed_equals_plain(collate: Any, batch_size: int) -> tuple[list, list[str]]:
    """The "odd" samples through a packed 2-worker DataLoader and DeviceLoader(..., "cpu"), checked
    equal to the plain collate's batches; returns them and the PackingWarnings said meanwhile."""
    collate_module._warned.clear()  # said once per process: forget what earlier tests said
    loader = DataLoader(Samples("odd"), batch_size=batch_size, num_workers=2, collate_fn=tp.packed_collate(collate))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(tp.DeviceLoader(loader, "cpu"))
    plain = list(DataLoader(Samples("odd"), batch_size=batch_size, collate_fn=collate))
    assert [on_host(b) for b in got] == [on_host(b) for b in plain]
    return got, [str(w.message) for w in caught if issubclass(w.category, PackingWarning)]


def only_loose_collate(samples: list) -> dict:
    return {"sparse": [s["sparse"] for s in samples], "t": [s["t"] for s in samples]}


@pytest.mark.parametrize("collate", [odd_collate, only_loose_collate])
def test_why_tensors_were_left_out_is_said_once_in_the_training_process(collate: Any) -> None:
    """A batch with fewer than two packable tensors went back unpacked and its note was warned in
    each worker (printed once per worker on stderr, out of reach of the training process's
    warning filters). Now the note travels with the batch and is warned once, here."""
    _, notes = packed_equals_plain(collate, batch_size=2)
    assert len(notes) == 1 and "sparse_coo" in notes[0]


def nested_collate(samples: list) -> dict:
    """Variable-length sequences as one strided nested tensor, beside small plain tensors."""
    return {"seqs": torch.nested.nested_tensor([s["x"][: 1 + i % 2] for i, s in enumerate(samples)]),
            "x": default_collate([s["x"] for s in samples]),
            "t": default_collate([s["t"].contiguous() for s in samples])}


def test_a_strided_nested_tensor_travels_loose() -> None:
    """A strided nested tensor passed packing's test (strided, contiguous, a byte count) and packing
    then failed inside the worker ("NestedTensorImpl doesn't support sizes"), killing the epoch.
    It now travels loose, with a note, and arrives equal to the plain collate's."""
    got, notes = packed_equals_plain(nested_collate, batch_size=4)
    assert got[0]["seqs"].is_nested and any("1 nested" in note for note in notes)
