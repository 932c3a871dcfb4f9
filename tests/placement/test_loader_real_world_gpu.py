"""The real-world DataLoader set-ups of test_loader_real_world.py where streams change the path:
a packed batch staged on the loop's thread (InlineIter), the worker thread copying on a side stream."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import torchplace as tp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
WAYS = [pytest.param(None, id="default"), pytest.param(True, id="background")]


def pad(samples: list[torch.Tensor]) -> dict:
    lengths = torch.tensor([len(s) for s in samples])
    return {"x": torch.nn.utils.rnn.pad_sequence(samples, batch_first=True), "n": lengths}


DATA = [torch.full((i % 5 + 1,), float(i)) for i in range(30)]


@pytest.mark.parametrize("background", WAYS)
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_persistent_workers_epochs_broken_off_and_an_eval_loader_between_on_cuda(background, packed):
    ref = list(DataLoader(DATA, batch_size=4, collate_fn=pad))
    loader = DataLoader(DATA, batch_size=4, num_workers=2, persistent_workers=True, pin_memory=True,
                        collate_fn=tp.packed_collate(pad) if packed else pad)
    train, evaluate = tp.DeviceLoader(loader, "cuda", background=background), tp.DeviceLoader(loader, "cuda")
    for _ in range(3):
        for k, got in enumerate(train):
            assert got["x"].is_cuda and torch.equal(got["x"].cpu(), ref[k]["x"])
            assert torch.equal(got["n"].cpu(), ref[k]["n"])
            if k == 2:
                break
        n = 0
        for n, got in enumerate(evaluate, 1):
            assert torch.equal(got["x"].cpu(), ref[n - 1]["x"])
        assert n == len(ref)
    torch.cuda.synchronize()


@pytest.mark.parametrize("background", WAYS)
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_a_second_loop_over_a_persistent_dataloader_ends_the_first_on_cuda(background, packed):
    loader = DataLoader(DATA, batch_size=4, num_workers=2, persistent_workers=True, pin_memory=True,
                        collate_fn=tp.packed_collate(pad) if packed else pad)
    outer, inner = tp.DeviceLoader(loader, "cuda", background=background), tp.DeviceLoader(loader, "cuda")
    with pytest.raises(RuntimeError, match="ended by a newer epoch over the same DataLoader"):
        for _ in outer:
            assert len(list(inner)) == 8
    assert len(list(outer)) == 8
    torch.cuda.synchronize()


@pytest.mark.parametrize("background", WAYS)
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_views_sharing_a_tensor_arrive_equal_and_each_its_own_on_cuda(background, packed):
    def collate(samples):
        t = torch.arange(6, dtype=torch.float32) + samples[0]
        return {"a": t, "again": t, "tail": t[2:], "grid": t.view(2, 3)}

    loader = DataLoader([0, 1], batch_size=1, collate_fn=tp.packed_collate(collate) if packed else collate)
    for want, got in zip(DataLoader([0, 1], batch_size=1, collate_fn=collate),
                         tp.DeviceLoader(loader, "cuda", background=background)):
        assert all(got[k].is_cuda and torch.equal(got[k].cpu(), want[k]) for k in want)
        got["a"][3] = 100.0
        assert [got["again"][3].item(), got["tail"][1].item(), got["grid"][1, 0].item()] == [want["a"][3].item()] * 3


@pytest.mark.parametrize("background", WAYS)
def test_batch_size_none_and_ten_thousand_tiny_tensors_packed_on_cuda(background):
    def collate(samples):
        return {"many": [torch.tensor([i], dtype=torch.float16) for i in range(10_000)], "i": torch.tensor(samples)}

    loader = DataLoader(list(range(4)), batch_size=2, num_workers=2, pin_memory=True,
                        collate_fn=tp.packed_collate(collate))
    for want, got in zip(DataLoader(list(range(4)), batch_size=2, collate_fn=collate),
                         tp.DeviceLoader(loader, "cuda", background=background)):
        assert torch.equal(torch.cat(got["many"]).cpu(), torch.cat(want["many"])) and got["many"][0].is_cuda
    whole = [{"a": torch.arange(i + 2), "b": torch.ones(i + 1, 2, dtype=torch.bfloat16)} for i in range(5)]
    loader = DataLoader(whole, batch_size=None, num_workers=2, pin_memory=True, collate_fn=tp.packed_collate())
    for want, got in zip(whole, tp.DeviceLoader(loader, "cuda", background=background)):
        assert torch.equal(got["a"].cpu(), want["a"]) and torch.equal(got["b"].cpu(), want["b"])
