"""`to_device` on the batches other frameworks hand out: HF, tensordict, tv_tensors-like subclasses,
torch's own odd tensors and every kind of Python container.

After each move: the input is unchanged (values, devices, the identity of every container and
tensor), the result on the host equals the input bit for bit, and on "meta" every tensor is there
with its class, dtype, shape and metadata.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch

import torchplace as tp
from torchplace.placement.transfer import pin_tensor
from torchplace.shared.tree import map_tensors

from .boxes import Boxes
from .helpers import fingerprint, on_host

DEVICES = ["cpu", "meta"]


def tensors(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(x, lambda t: out.append(t) or t)
    return out


def moved_and_untouched(batch: Any, device: str) -> Any:
    """to_device(BATCH, DEVICE), checking BATCH is unchanged and the result is BATCH on DEVICE."""
    before = fingerprint(batch)
    out = tp.to_device(batch, device)
    assert fingerprint(batch) == before, "to_device changed its input"
    assert type(out) is type(batch)
    if device == "cpu":
        assert on_host(out) == on_host(batch)
    else:
        got, want = tensors(out), tensors(batch)
        assert len(got) == len(want) and all(t.device.type == "meta" for t in got)
        assert [(type(t), t.dtype, t.shape, t.layout) for t in got] == [
            (type(t), t.dtype, t.shape, t.layout) for t in want]
    return out


# -- Hugging Face -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_batch_encoding_is_moved_as_a_copy(device: str) -> None:
    """BatchEncoding.to() moves in place; accelerate's send_to_device calls it (huggingface/accelerate,
    tests/test_utils.py, test_send_to_device: a BatchEncoding-like object with its own .to). Ours must
    leave the tokenizer's output where it was and give back a BatchEncoding with attribute access."""
    from transformers import BatchEncoding

    data = {"input_ids": torch.arange(6).view(2, 3), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    batch = BatchEncoding(data, n_sequences=1)
    out = moved_and_untouched(batch, device)
    assert out.input_ids.device.type == device and list(out.keys()) == ["input_ids", "attention_mask"]
    assert out.n_sequences == 1 and batch["input_ids"].device.type == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_model_output_keeps_its_class_keys_and_attributes(device: str) -> None:
    """HF ModelOutput is an OrderedDict whose items are also attributes (transformers,
    tests/utils/test_model_output.py: indexing by key, attribute and position agree)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    batch = CausalLMOutputWithPast(loss=torch.tensor(0.5), logits=torch.randn(2, 3, 5))
    out = moved_and_untouched(batch, device)
    assert list(out.keys()) == ["loss", "logits"] and out.past_key_values is None
    assert out.logits is out["logits"] is out[1] and out.logits.device.type == device


# -- tensordict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_tensordict_and_tensorclass(device: str) -> None:
    """pytorch/tensordict, test/test_tensordict.py (`to` to another device keeps the batch size, the
    nested structure and the class; the original stays where it was), in a batch of ours."""
    from tensordict import TensorDict, tensorclass

    @tensorclass
    class Sample:
        image: torch.Tensor
        name: str

    td = TensorDict({"a": torch.randn(2, 3), "nested": {"b": torch.ones(2, dtype=torch.bool)}}, batch_size=[2])
    sample = Sample(image=torch.randn(2, 4), name="x", batch_size=[2])
    batch = {"td": td, "sample": sample}
    a_before = td["a"]
    out = tp.to_device(batch, device)
    assert td["a"] is a_before and td["a"].device.type == "cpu" and sample.image.device.type == "cpu"
    assert isinstance(out["td"], TensorDict) and out["td"].batch_size == torch.Size([2])
    assert out["td"]["nested", "b"].device.type == device and out["td"]["nested", "b"].dtype == torch.bool
    assert type(out["sample"]) is Sample and out["sample"].name == "x" and out["sample"].image.device.type == device
    if device == "cpu":
        assert torch.equal(out["td"]["a"], td["a"]) and torch.equal(out["sample"].image, sample.image)


# -- tensor subclasses with metadata (torchvision tv_tensors) -------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_tensor_subclass_keeps_class_and_metadata(device: str) -> None:
    """torchvision's detection targets: a list of dicts holding BoundingBoxes (format, canvas_size)
    and masks (pytorch/vision, test/test_tv_tensors.py: `.to()` keeps the subclass and metadata)."""
    targets = [{"boxes": Boxes([[0.0, 1, 2, 3]], format="XYXY", canvas_size=(8, 8)), "labels": torch.tensor([1])},
               {"boxes": Boxes(torch.zeros(0, 4), format="CXCYWH", canvas_size=(4, 6)), "labels": torch.zeros(0)}]
    out = moved_and_untouched(targets, device)
    assert type(out[1]["boxes"]) is Boxes and out[1]["boxes"].canvas_size == (4, 6)
    assert out[0]["boxes"].format == "XYXY" and out[0]["boxes"].device.type == device


def test_pinning_a_tensor_subclass_sparse_or_nested_keeps_what_it_is() -> None:
    """DeviceLoader pins host tensors before copying them to a GPU (`pin_tensor`); an empty pinned
    strided block filled by copy_ turned a subclass into a plain tensor (metadata lost) and raised
    on sparse and nested tensors ("do not have strides"). Without pinned memory (this CPU-only
    torch) each kind says so and stays as it was; the GPU twin checks the pinned results."""
    for t in (Boxes([[0.0, 1, 2, 3]], format="XYXY", canvas_size=(8, 8)), torch.eye(3).to_sparse(),
              torch.eye(3).to_sparse_csr(), torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])):
        try:
            out = pin_tensor(t)
        except RuntimeError as exc:  # torch without an accelerator: no pinned memory at all
            assert "accelerator" in str(exc) or "pin" in str(exc), exc
            assert "strides" not in str(exc), exc
            continue
        assert type(out) is type(t) and out.layout is t.layout and on_host(out) == on_host(t)


# -- torch's own tensors ------------------------------------------------------------------------

def odd_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
        "bool": torch.tensor([True, False]),
        "float8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "bf16": torch.randn(4, generator=g).bfloat16(),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "transposed": torch.randn(4, 3, generator=g).t(),
        "expanded": torch.randn(1, 3, generator=g).expand(4, 3),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7.0),
        "coo": torch.eye(3).to_sparse(),
        "csr": torch.eye(3).to_sparse_csr(),
        "jagged": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_odd_tensors_arrive_as_they_were(device: str) -> None:
    """accelerate's send_to_device and Lightning's move_data_to_device only call `.to()`; the layouts,
    dtypes and strides torch itself makes must arrive unchanged (torch's own `Tensor.to` contract)."""
    batch = odd_tensors()
    out = moved_and_untouched(batch, device)
    assert out["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert out["transposed"].stride() == batch["transposed"].stride()


def test_strided_nested_and_quantized_tensors_on_the_host() -> None:
    """Tensors torch cannot send to "meta" (strided nested, quantized) still move to the host unchanged."""
    batch = {"nested": torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)]),
             "q": torch.quantize_per_tensor(torch.linspace(-1, 1, 5), 0.1, 0, torch.qint8)}
    moved_and_untouched(batch, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_flows_through_a_move(device: str) -> None:
    """Lightning-AI/utilities, tests/unittests/core/test_apply_func.py applies a function to tensors
    needing grad; a move must stay on the graph (torch's `to` is differentiable)."""
    w = torch.randn(3, requires_grad=True)
    out = tp.to_device({"y": w * 2}, device)
    assert out["y"].requires_grad
    if device == "cpu":
        out["y"].sum().backward()
        assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_packed_sequence_keeps_batch_sizes_on_the_host() -> None:
    """huggingface/accelerate, tests/test_utils.py sends objects with their own `.to()` through it;
    a PackedSequence's batch_sizes must stay on the CPU (torch.nn.utils.rnn's contract)."""
    seq = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    out = tp.to_device({"seq": seq}, "meta")
    assert out["seq"].data.is_meta and out["seq"].batch_sizes.device.type == "cpu"
    assert seq.data.device.type == "cpu"


# -- Python containers ---------------------------------------------------------------------------

class Pair(NamedTuple):
    a: torch.Tensor
    b: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    label: str = "f"


def containers() -> dict[str, Any]:
    t = torch.arange(4.0)
    return {
        "namedtuple": Pair(t, [t + 1]),
        "frozen_dataclass": Frozen(t),
        "non_str_keys": {1: t, (2, "b"): t + 1, torch.float32: t + 2, None: t + 3},
        "defaultdict": collections.defaultdict(list, {"a": t}),
        "ordered": collections.OrderedDict([("z", t), ("a", t + 1)]),
        "deque": collections.deque([t, t + 1], maxlen=3),
        "set": {t},
        "frozenset": frozenset({t + 1}),
        "atoms": ["s", b"b", None, ..., 1.5, 2j, torch.float16, torch.device("cpu")],
    }


@pytest.mark.parametrize("device", DEVICES)
def test_every_container_kind(device: str) -> None:
    """Lightning-AI/utilities, tests/unittests/core/test_apply_func.py
    (test_recursive_application_to_collection: namedtuples, dataclasses, OrderedDict, defaultdict,
    non-string keys) and huggingface/accelerate, tests/test_utils.py (test_send_to_device: tuples,
    namedtuples, dicts), plus the kinds neither covers: deque with maxlen, set and frozenset (which
    were returned unmoved), MappingProxy."""
    batch = containers()
    out = moved_and_untouched(batch, device)
    assert out["deque"].maxlen == 3 and out["defaultdict"].default_factory is list
    assert list(out["ordered"]) == ["z", "a"]
    proxy = types.MappingProxyType({"t": torch.ones(2)})
    assert tp.to_device(proxy, device)["t"].device.type == device and proxy["t"].device.type == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_attrs_classes_are_moved(device: str) -> None:
    """attrs classes, mutable and frozen, slotted or not, were returned with their tensors unmoved
    (a silent wrong device). Lightning-AI/utilities, tests/unittests/core/test_apply_func.py moves
    dataclasses field by field; attrs fields are moved the same way."""
    attrs = pytest.importorskip("attrs")

    @attrs.define
    class Mutable:
        x: torch.Tensor
        n: int = 1

    @attrs.frozen
    class Fixed:
        x: torch.Tensor
        inner: Any = None

    @attrs.define(slots=False)
    class Dicty:
        x: torch.Tensor

    batch = [Mutable(torch.ones(2)), Fixed(torch.zeros(3), inner=Mutable(torch.ones(1), n=5)), Dicty(torch.ones(1))]
    out = moved_and_untouched(batch, device)
    assert out[1].inner.n == 5 and out[1].inner.x.device.type == device and out[0].x.device.type == device


def test_generators_and_objects_with_their_own_to_pass_through_as_their_to_says() -> None:
    """A generator cannot be walked without being consumed: it passes through untouched. An object
    whose `.to()` returns something else is replaced by that (accelerate's send_to_device rule)."""
    gen = (t for t in [torch.ones(1)])

    class Handle:
        def to(self, device: Any, non_blocking: bool = False) -> str:
            return f"handle on {device}"

    out = tp.to_device({"gen": gen, "h": Handle()}, "meta")
    assert out["gen"] is gen and out["h"] == "handle on meta"
    assert next(gen).device.type == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_that_holds_itself_is_named_not_recursed_forever(device: str) -> None:
    """A cyclic batch ran into RecursionError deep inside the walk; now the error names the cycle.
    (Lightning's apply_to_collection recurses the same way; no peer suite covers cycles.)"""
    cyclic: dict[str, Any] = {"t": torch.ones(1), "meta": {}}
    cyclic["meta"]["parent"] = cyclic
    with pytest.raises(ValueError, match=r"batch\['meta'\]\['parent'\] is batch"):
        tp.to_device(cyclic, device)
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"batch\[1\] is batch"):
        map_tensors(loop, lambda t: t)


def test_a_deep_batch_without_a_cycle_keeps_its_recursion_error() -> None:
    deep: Any = torch.ones(1)
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(RecursionError):
        tp.to_device(deep, "meta")


def test_tensors_torch_cannot_send_to_meta_are_named() -> None:
    """A strided nested tensor or a quantized one sent to "meta" failed with torch's bare
    "Could not run 'aten::_to_copy' ... NestedTensorMeta backend"; now the error says which tensor
    kind it is and what to do."""
    with pytest.raises(tp.DeviceError, match="nested tensor of the strided layout.*layout=torch.jagged"):
        tp.to_device({"n": torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])}, "meta")
    q = torch.quantize_per_tensor(torch.linspace(-1, 1, 5), 0.1, 0, torch.qint8)
    with pytest.raises(tp.DeviceError, match=r"quantized tensor \(torch.qint8\).*dequantize"):
        tp.to_device([q], "meta")
