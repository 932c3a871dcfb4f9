"""Mistakes with origins: optimizer state, 0-dim CPU tensors, lost origins, factories without a device, inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import GPU, Program, Toy, W, _explain, built_on, explain_here, labels, mistake, randn, stepped

# ----------------------------------------------------------------------------- optimizer state

def _stepped_before_move(dev: torch.device, other: torch.device, make: Callable[..., Any], name: str) -> Program:
    with built_on(other):
        model = Toy()
    optimizer = make(model.parameters())
    if name != "adagrad_built_before_move":  # Adagrad makes its state in its constructor
        model(randn(4, W, device=other)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: _OPTIMIZER_STEPS[name](model, optimizer, x), (x,), optimizer)


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()  # case: sgd_stepped_before_move


def _adam_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()  # case: adam_stepped_before_move


def _adagrad_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x)
    model(x).square().mean().backward()
    optimizer.step()  # case: adagrad_built_before_move


_OPTIMIZER_STEPS = {"sgd_stepped_before_move": _sgd_step, "adam_stepped_before_move": _adam_step,
                    "adagrad_built_before_move": _adagrad_step}


@mistake("microsoft/Cream#2", ("layers.0.proj.weight", "momentum_buffer"), "optimizer", pairs=GPU)
def sgd_stepped_before_move(dev: torch.device, other: torch.device) -> Program:
    return _stepped_before_move(dev, other, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                "sgd_stepped_before_move")


@mistake("pytorch/pytorch#2830", ("layers.0.proj.weight", "exp_avg"), "optimizer", pairs=GPU)
def adam_stepped_before_move(dev: torch.device, other: torch.device) -> Program:
    return _stepped_before_move(dev, other, lambda p: torch.optim.Adam(p, lr=1e-3), "adam_stepped_before_move")


@mistake("pytorch/pytorch#3463", ("layers.0.proj.weight", "'sum'"), "optimizer", pairs=GPU)
def adagrad_built_before_move(dev: torch.device, other: torch.device) -> Program:
    return _stepped_before_move(dev, other, lambda p: torch.optim.Adagrad(p, lr=0.1), "adagrad_built_before_move")


# ----------------------------------------------------------------------------- 0-dim CPU tensors where they are refused

def detection_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    explain_here(model, batch["x"])
    cls_loss = F.cross_entropy(model(batch["x"]), batch["y"])
    box_loss = torch.tensor(0.0)  # no boxes in this batch
    return torch.stack([cls_loss, box_loss]).sum()  # case: stack_zero_dim_loss


@mistake("pytorch/pytorch#119609", "box_loss")
def stack_zero_dim_loss(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    batch = {"x": randn(4, W, device=dev), "y": labels(4, dev)}
    return stepped(model, lambda: detection_loss(model, batch), (batch["x"],))


class HitRate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Toy()
        self.count = torch.tensor(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hits = self.body(x).amax(1).sum()
        return torch.stack([hits, self.count])  # case: stack_zero_dim_attribute


@mistake("huggingface/diffusers#13450", "count", "model")
def stack_zero_dim_attribute(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = HitRate()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# ----------------------------------------------------------------------------- origins that get lost

class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(W, W)
        self.tag = nn.Linear(4, W)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tag = batch["image_tag"].float()
        return self.image(batch["image"]) + self.tag(tag)  # case: batch_key_float


@mistake("huggingface/transformers#31975", "image_tag", "model.tag")
def batch_key_float(dev: torch.device, other: torch.device) -> Program:
    model = Tagger().to(dev)
    batch = {"image": randn(2, W, device=dev), "image_tag": torch.randint(0, 2, (2, 4), device=other)}
    return Program(model, lambda: model(batch), (batch,))


class DefaultBoxes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(W, 2)
        self._wh_pairs = [torch.rand(4, 2), torch.rand(4, 2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifts = self.head(x)
        return torch.cat((shifts, self._wh_pairs[0]), dim=1)  # case: private_wh_pairs


@mistake("pytorch/vision#9414", "_wh_pairs", "model")
def private_wh_pairs(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = DefaultBoxes()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.scale = torch.ones(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale  # case: plain_attribute_scale


@mistake("Lightning-AI/torchmetrics#167", "scale", "model")
def plain_attribute_scale(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = Scaled()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class PositionalEncoding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.pe = torch.randn(16, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.pe[: x.shape[0]]  # case: positional_table_attribute


@mistake("SamLynnEvans/Transformer#30", "pe", "model")
def positional_table_attribute(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = PositionalEncoding()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class ScaledNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.gamma = torch.ones(W)  # meant as a parameter, never registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(self.proj(x), (W,), self.gamma)  # case: unregistered_gamma


@mistake("rish-16/tokenlearner-pytorch#5", "gamma", "model")
def unregistered_gamma(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = ScaledNorm()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Scheduler:
    """A plain object holding tensors, as diffusion schedulers do (not an nn.Module)."""

    def __init__(self) -> None:
        self.sigmas = torch.linspace(1.0, 0.0, 10)

    def step(self, sample: torch.Tensor, i: int) -> torch.Tensor:
        return sample * self.sigmas[i : i + 1]  # case: scheduler_sigmas


@mistake("huggingface/diffusers#9485", "sigmas")
def scheduler_sigmas(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    with built_on(other):
        scheduler = Scheduler()
    x = randn(4, W, device=dev)
    def step(x: torch.Tensor, scheduler: Scheduler) -> torch.Tensor:
        return scheduler.step(model(x), 3)

    return Program(model, lambda: step(x, scheduler), (x,), explain=lambda: _explain(model, x, scheduler, step=step))


# ----------------------------------------------------------------------------- tensors made in forward without a device

class WithConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(W, dtype=x.dtype)
        return self.proj(x) + offsets  # case: arange_in_forward


@mistake("facebookresearch/sam3#188", ("offsets", "torch.arange"), "model")
def arange_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = WithConstant().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class CausalScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(W, W)
        self.k = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1]), diagonal=1).bool()
        return scores.masked_fill(mask, -1e4)  # case: causal_mask_no_device


@mistake("SamLynnEvans/Transformer#27", ("mask", "torch.ones"), "model")
def causal_mask_no_device(dev: torch.device, other: torch.device) -> Program:
    model = CausalScores().to(dev)
    x = randn(2, 5, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class NumpyPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        table = torch.from_numpy(np.ones((x.shape[0], W), dtype=np.float32))
        return self.proj(x) + table  # case: from_numpy_in_forward


@mistake("wingedsheep/transformer#4", ("table", "torch.from_numpy"), "model")
def from_numpy_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = NumpyPositions().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Rotation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.eye(W).sum(0)
        return self.proj(x) * scale  # case: eye_in_forward


@mistake("decargroup/pymlg#24", ("scale", "torch.eye"), "model")
def eye_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = Rotation().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class IndexlessBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(W, device=torch.device("cuda"))  # whichever GPU is current
        return self.proj(x) + bias  # case: indexless_cuda_factory


@mistake("huggingface/transformers#23538", ("bias", "torch.zeros"), "model", pairs=("cuda1-cuda0",))
def indexless_cuda_factory(dev: torch.device, other: torch.device) -> Program:
    model = IndexlessBias().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# ----------------------------------------------------------------------------- inputs left behind

class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(W, W)
        self.k = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return scores + (1.0 - attention_mask[:, None, :]) * -1e4  # case: attention_mask_input


@mistake("huggingface/transformers#31975", "attention_mask", "model")
def attention_mask_input(dev: torch.device, other: torch.device) -> Program:
    model = Attention().to(dev)
    x, mask = randn(2, 5, W, device=dev), torch.ones(2, 5, device=other)
    return Program(model, lambda: model(x, attention_mask=mask), (x, mask))


def supervised_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    explain_here(model, batch["x"])
    return F.cross_entropy(model(batch["x"]), batch["y"])  # case: labels_not_moved


@mistake("JieyuZ2/wrench#4", "batch['y']")
def labels_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    batch = {"x": randn(4, W, device=dev), "y": labels(4, other)}
    return stepped(model, lambda: supervised_loss(model, batch), (batch["x"],))


def accuracy(model: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    preds = model(x).argmax(1)
    return (preds == targets).float().mean()  # case: targets_not_moved


@mistake("opendataval/opendataval#37", "targets")
def targets_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, targets = randn(4, W, device=dev), labels(4, other)
    return stepped(model, lambda: accuracy(model, x, targets), (x,))


def first_layer_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return model(x)  # case: input_not_moved


@mistake("SamLynnEvans/Transformer#30", "x", "model.layers.0.proj")
def input_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x = randn(4, W, device=other)
    return stepped(model, lambda: first_layer_input(model, x), (x,))
