"""to_device on real GPUs: values, the non-blocking policy, and copies between two GPUs."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch_calls import RecordStreamCalls  # tests/torch_calls.py (pythonpath = tests)

import torchplace as tp
from torchplace.placement import pin, pin_tensor, record_stream
from torchplace.shared.tree import map_tensors

pytestmark = pytest.mark.gpu


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    mask: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask", self.x > 0)


Pair = collections.namedtuple("Pair", "a b")


def nested(pinned: bool = False) -> dict:
    dd = collections.defaultdict(list)
    dd["k"].append(torch.randn(5))
    batch = {
        "x": torch.randn(64, 3, 8, 8).to(memory_format=torch.channels_last),
        "ids": torch.randint(0, 1000, (64, 16)),
        "od": collections.OrderedDict(a=torch.arange(10)),
        "dd": dd,
        "pair": Pair(torch.randn(3), "text"),
        "frozen": Frozen(torch.randn(6)),
        "list": [torch.ones(2, dtype=torch.bfloat16), 3, None],
    }
    return pin(batch) if pinned else batch


def flat(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


@pytest.mark.parametrize("pinned", [False, True])
def test_round_trip_is_bit_exact(pinned):
    batch = nested(pinned)
    on_gpu = tp.to_device(batch, "cuda:0")
    assert all(t.device == torch.device("cuda:0") for t in flat(on_gpu))
    assert on_gpu["x"].is_contiguous(memory_format=torch.channels_last)
    assert type(on_gpu["dd"]) is collections.defaultdict and on_gpu["dd"].default_factory is list
    back = tp.to_device(on_gpu, "cpu")  # synchronous: readable at once, no explicit synchronize
    for a, b in zip(flat(batch), flat(back)):
        assert torch.equal(a, b) and b.device.type == "cpu"


def busy_result(n: int = 1 << 22) -> torch.Tensor:
    """A GPU tensor whose value is only final after a long kernel queue (sleep, then compute)."""
    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time on the current stream
    return torch.arange(n, device="cuda:0", dtype=torch.float32) * 3


@pytest.mark.parametrize("non_blocking", [None, True, False])
def test_device_to_host_is_readable_when_to_device_returns(non_blocking):
    out = tp.to_device({"v": busy_result()}, "cpu", non_blocking=non_blocking)["v"]
    expected = torch.arange(1 << 22, dtype=torch.float32) * 3  # compared with no synchronize in between
    assert torch.equal(out, expected)


def test_explicit_non_blocking_to_host_lands_in_pinned_memory():
    out = tp.to_device([busy_result(), busy_result()], "cpu", non_blocking=True)
    assert all(t.is_pinned() for t in out)


def test_host_to_device_is_ordered_for_the_current_stream():
    src = pin_tensor(torch.randn(1 << 24))
    out = tp.to_device(src, "cuda:0")  # non-blocking by default, from pinned memory
    assert torch.equal(out.cpu(), src)


def test_pin_tensor_keeps_dense_layouts_and_pins():
    x = torch.randn(8, 3, 16, 16).to(memory_format=torch.channels_last)
    pinned = pin_tensor(x)
    assert pinned.is_pinned() and pinned.stride() == x.stride() and torch.equal(pinned, x)
    gappy = torch.randn(64, 64)[:, ::4]
    p2 = pin_tensor(gappy)
    assert p2.is_pinned() and p2.is_contiguous() and torch.equal(p2, gappy)
    assert pin_tensor(pinned) is pinned


def test_record_stream_reaches_nested_tensors():
    """Every nested tensor, dataclass fields (an init=False one too) and defaultdict items
    included, is marked once with the side stream; torch's own call runs for each."""
    side = torch.cuda.Stream()
    batch = tp.to_device(nested(), "cuda:0")
    with RecordStreamCalls() as calls:
        record_stream(batch, side)
    torch.cuda.synchronize()
    expected = flat(batch)
    assert len(expected) == 8
    assert [id(t) for t, _ in calls.marked] == [id(t) for t in expected]
    assert all(s == side for _, s in calls.marked)
    deep = [batch["dd"]["k"][0], batch["pair"].a, batch["frozen"].mask, batch["od"]["a"]]
    assert all(any(t is m for m, _ in calls.marked) for t in deep)


@pytest.mark.multigpu
def test_between_two_gpus():
    a = tp.to_device(nested(pinned=True), "cuda:0")
    b = tp.to_device(a, "cuda:1")
    assert all(t.device == torch.device("cuda:1") for t in flat(b))
    for x, y in zip(flat(a), flat(b)):
        assert torch.equal(x.cpu(), y.cpu())


@pytest.mark.multigpu
def test_a_busy_source_gpu_is_waited_for():
    torch.cuda.set_device(0)
    value = busy_result()
    out = tp.to_device(value, "cuda:1")  # torch orders the copy after the source's stream
    assert torch.equal(out.cpu(), torch.arange(1 << 22, dtype=torch.float32) * 3)


def test_a_packed_sequence_reaches_an_lstm_on_the_gpu_directly_and_through_the_loader():
    """Issue 15, item 3: moved by its own .to(), so batch_sizes stays on the host as the LSTM needs."""
    packed = torch.nn.utils.rnn.pack_sequence([torch.randn(4, 2), torch.randn(3, 2)])
    lstm = torch.nn.LSTM(2, 3).to("cuda:0")
    moved = tp.to_device({"seq": packed, "y": torch.ones(2)}, "cuda:0")
    assert moved["seq"].data.is_cuda and moved["seq"].batch_sizes.device.type == "cpu"
    expected = lstm(moved["seq"])[0].data
    for batch in tp.DeviceLoader([{"seq": packed, "y": torch.ones(2)}] * 3, "cuda:0"):
        assert batch["seq"].batch_sizes.device.type == "cpu" and batch["y"].is_cuda
        torch.testing.assert_close(lstm(batch["seq"])[0].data, expected)
