"""place() on real GPUs: a model split across devices runs, trains and matches one device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchplace as tp

pytestmark = pytest.mark.gpu


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.decoder = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x, *, bias=None):
        h = self.encoder(x)
        return self.decoder(h if bias is None else h + bias)


def split_and_reference(devices: dict, output=None):
    torch.manual_seed(0)
    model = EncoderDecoder().double()
    reference = copy.deepcopy(model).to("cuda:0")
    placement = tp.place(model, devices, output=output)
    return model, reference, placement


def test_gpu_and_cpu_halves_on_one_gpu():
    model, reference, placement = split_and_reference({"encoder": "cuda:0", "decoder": "cpu"})
    x = torch.randn(16, 32, dtype=torch.float64)
    out = model(x)  # the input is on the host; the encoder moves it to cuda:0
    assert out.device.type == "cpu" and placement.output_device == torch.device("cpu")
    assert torch.allclose(out, reference(x.cuda()).cpu())


def test_tied_parameters_stay_tied_on_gpu():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    tp.place(model, {"0": "cuda:0", "1": "cuda:0"})
    assert model[1].weight is model[0].weight and model[0].weight.device == torch.device("cuda:0")


@pytest.mark.multigpu
def test_model_parallel_across_two_gpus_matches_one_gpu():
    # the root on cuda:0 too: its own code (h + bias) runs there, with its keyword input moved
    model, reference, placement = split_and_reference({"": "cuda:0", "decoder": "cuda:1"})
    assert {p.device for p in model.encoder.parameters()} == {torch.device("cuda:0")}
    assert {p.device for p in model.decoder.parameters()} == {torch.device("cuda:1")}
    x = torch.randn(16, 32, dtype=torch.float64)
    bias = torch.randn(64, dtype=torch.float64)  # a keyword input, given on the host
    out = model(x, bias=bias)
    assert out.device == torch.device("cuda:1") and placement.output_device == torch.device("cuda:1")
    expected = reference(x.cuda(), bias=bias.cuda())
    assert torch.allclose(out.cpu(), expected.cpu())
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.device == p.device, name
        assert torch.allclose(p.grad.cpu(), q.grad.cpu()), name


@pytest.mark.multigpu
def test_output_sent_back_to_the_first_gpu():
    model, _, placement = split_and_reference({"encoder": "cuda:0", "decoder": "cuda:1"}, output="cuda:0")
    out = model(torch.randn(4, 32, dtype=torch.float64, device="cuda:0"))
    assert out.device == torch.device("cuda:0") and placement.output_device == torch.device("cuda:0")


@pytest.mark.multigpu
def test_a_child_placed_apart_from_its_parent():
    model, reference, _ = split_and_reference({"": "cuda:0", "decoder.2": "cuda:1"})
    assert model.decoder[0].weight.device == torch.device("cuda:0")
    assert model.decoder[2].weight.device == torch.device("cuda:1")
    x = torch.randn(8, 32, dtype=torch.float64, device="cuda:0")
    out = model(x)
    assert out.device == torch.device("cuda:1") and torch.allclose(out.cpu(), reference(x).cpu())
