"""place(): submodules on named devices, inputs moved on the way in, on cpu and meta."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.errors import DeviceError


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.decoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x, *, shift=None):
        h = self.encoder(x)
        if shift is not None:
            h = h + shift
        return {"logits": self.decoder(h), "hidden": h}


class Gate(nn.Module):
    """Takes a keyword tensor input, to check keywords are moved too."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, *, mask):
        return self.proj(x) * mask


def devices_of(module: nn.Module) -> set[str]:
    return {str(t.device) for t in [*module.parameters(), *module.buffers()]}


def test_submodules_move_and_inputs_follow_them():
    model = EncoderDecoder()
    placement = tp.place(model, {"encoder": "cpu", "decoder": "meta"})
    assert devices_of(model.encoder) == {"cpu"} and devices_of(model.decoder) == {"meta"}
    assert model.scale.device.type == "cpu"  # unnamed parts stay where they were
    out = model(torch.randn(3, 4))  # no .to() anywhere: the decoder's input moves to meta
    assert out["logits"].device.type == "meta" and out["hidden"].device.type == "cpu"
    assert placement.devices == {"encoder": torch.device("cpu"), "decoder": torch.device("meta")}


def test_the_placement_says_where_the_output_lands():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    placement = tp.place(model, {"0": "cpu", "1": "meta"})
    assert placement.output_device is None  # nothing has run yet
    model(torch.randn(2, 4))
    assert placement.output_device == torch.device("meta")
    assert "output on meta" in str(placement) and "0 -> cpu" in str(placement)


def test_mixed_output_devices_are_listed():
    model = EncoderDecoder()
    placement = tp.place(model, {"encoder": "cpu", "decoder": "meta"})
    model(torch.randn(1, 4))
    assert placement.output_device is None
    assert set(placement.last_output_devices) == {torch.device("cpu"), torch.device("meta")}


def test_output_can_be_sent_to_a_chosen_device():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    placement = tp.place(model, {"0": "meta", "1": "meta"}, output="meta")
    assert placement.output_device == torch.device("meta")
    assert model(torch.randn(2, 4)).device.type == "meta"


def test_keyword_inputs_are_moved_too():
    model = nn.ModuleDict({"gate": Gate()})
    tp.place(model, {"gate": "meta"})
    out = model["gate"](torch.randn(2, 4), mask=torch.ones(2, 4))
    assert out.device.type == "meta"


def test_the_deepest_name_wins():
    model = EncoderDecoder()
    tp.place(model, {"": "meta", "decoder.2": "cpu"})
    assert devices_of(model.encoder) == {"meta"} and model.scale.device.type == "meta"
    assert devices_of(model.decoder[0]) == {"meta"} and devices_of(model.decoder[2]) == {"cpu"}


def test_an_unknown_name_is_refused_with_the_names_that_exist():
    model = EncoderDecoder()
    with pytest.raises(DeviceError, match=r"'decodr' is not a submodule.*'decoder', 'encoder'.*Did you mean 'decoder'"):
        tp.place(model, {"decodr": "cpu"})
    with pytest.raises(DeviceError, match=r"'decoder.7' is not a submodule.*Names in submodule 'decoder': "
                                          r"'decoder.0', 'decoder.1', 'decoder.2'"):
        tp.place(model, {"decoder.7": "cpu"})
    assert devices_of(model) == {"cpu"}


def test_a_bad_device_is_refused_before_anything_moves():
    model = EncoderDecoder()
    with pytest.raises(DeviceError, match="cuda:5 requested"):
        tp.place(model, {"encoder": "meta", "decoder": "cuda:5"})
    with pytest.raises(DeviceError, match="cuda:6 requested"):
        tp.place(model, {"encoder": "meta"}, output="cuda:6")
    assert devices_of(model) == {"cpu"}


def test_tied_weights_cannot_be_split_across_devices():
    model = EncoderDecoder()
    model.decoder[0].weight = model.encoder[2].weight  # tied, as embeddings and LM heads often are
    with pytest.raises(DeviceError, match=r"shared \(tied\).*'encoder.2.weight' -> meta.*'decoder.0.weight' -> cpu"):
        tp.place(model, {"encoder": "meta", "decoder": "cpu"})
    assert devices_of(model) == {"cpu"}  # refused before anything moved
    tp.place(model, {"encoder": "meta", "decoder": "meta"})  # one device: accepted
    assert model.decoder[0].weight.device.type == "meta" and model.encoder[2].weight.device.type == "meta"


def test_a_tied_weight_with_an_unplaced_owner_is_refused():
    model = EncoderDecoder()
    model.decoder[2].weight = nn.Parameter(torch.ones(2, 8))
    model.head = nn.Linear(8, 2)
    model.head.weight = model.decoder[2].weight
    with pytest.raises(DeviceError, match=r"'head.weight' -> cpu"):
        tp.place(model, {"decoder": "meta"})


def test_a_submodule_shared_under_two_names_must_get_one_device():
    shared = nn.ReLU()
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    with pytest.raises(DeviceError, match="one submodule is shared"):
        tp.place(model, {"a": "cpu", "b": "meta"})


def test_gradients_and_grads_follow_the_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model(torch.randn(2, 4)).sum().backward()
    tp.place(model, {"1": "meta"})
    assert model[1].weight.grad is not None and model[1].weight.grad.device.type == "meta"
    assert model[0].weight.grad.device.type == "cpu"


def test_remove_takes_the_hooks_away():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    placement = tp.place(model, {"1": "meta"})
    placement.remove()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 4))  # no hook moves the input any more: torch's own device error
    assert model[1].weight.device.type == "meta"
