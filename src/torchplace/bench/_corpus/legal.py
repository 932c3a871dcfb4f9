"""Legal patterns: code that mixes devices on purpose, where no tool may cry wolf."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import Block, C, Program, Toy, W, built_on, explain_here, labels, legal, randn, stepped
from .state import MeanAbsError

# ============================================================================= legal patterns

class PackedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths)  # lengths must be on the CPU
        out, _ = self.lstm(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out)
        return padded


@legal("pytorch/pytorch#43227")
def pack_padded_lengths_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = PackedEncoder().to(dev)
    x, lengths = randn(5, 2, W, device=dev), torch.tensor([5, 3])
    return stepped(model, lambda: forward_step(model, x, lengths), (x, lengths))


class LastStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))
        padded, lens = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)  # lens: always on the CPU
        return padded[torch.arange(padded.shape[0]), lens - 1]


@legal("pytorch/pytorch#7466")
def pad_packed_lengths_index(dev: torch.device, other: torch.device) -> Program:
    model = LastStep().to(dev)
    x, lengths = randn(2, 5, W, device=dev), torch.tensor([5, 3])
    return stepped(model, lambda: forward_step(model, x, lengths), (x, lengths))


class KeepColumns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.proj(y)[:, keep]


@legal("pytorch/xla#3188")
def cpu_index_tensor(dev: torch.device, other: torch.device) -> Program:
    model = KeepColumns().to(dev)
    y, keep = randn(4, W, device=dev), torch.tensor([0, 2, 5])
    return stepped(model, lambda: forward_step(model, y, keep), (y, keep))


class SplitHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.sizes = torch.tensor([3, 5])  # read on the host only

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(self.proj(x), self.sizes.tolist(), dim=1)


@legal("pytorch/vision#1745")
def host_only_attribute(dev: torch.device, other: torch.device) -> Program:
    model = SplitHeads().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class PipelineSplit(nn.Module):
    def __init__(self, second: torch.device) -> None:
        super().__init__()
        self.stage1 = Block()
        self.stage2 = Block()
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage2(self.stage1(x).to(self.second))


@legal("facebookresearch/fairseq#5189")
def two_stage_explicit_to(dev: torch.device, other: torch.device) -> Program:
    model = PipelineSplit(dev)
    model.stage1.to(other)
    model.stage2.to(dev)
    x = randn(4, W, device=other)
    return stepped(model, lambda: forward_step(model, x), (x,))


class MaskedScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)
        return torch.where(scores > 0, scores, torch.tensor(-1e4))


@legal("huggingface/transformers#23538")
def cpu_scalar_fill(dev: torch.device, other: torch.device) -> Program:
    model = MaskedScores().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class SeededNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.gen).to(x.device)
        return self.proj(x + noise)


@legal("pytorch/pytorch#62152")
def cpu_generator_then_to(dev: torch.device, other: torch.device) -> Program:
    model = SeededNoise().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class HalfScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * torch.tensor(0.5)


@legal("pytorch/pytorch#119609")
def cpu_scalar_operand(dev: torch.device, other: torch.device) -> Program:
    model = HalfScale().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.register_buffer("scale", torch.ones(W), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(W, dtype=x.dtype, device=x.device)
        return self.proj(x) * self.scale + offsets


@legal("Lightning-AI/torchmetrics#167")
def registered_buffer(dev: torch.device, other: torch.device) -> Program:
    model = WithBuffer().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class CausalWithDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2)
        mask = torch.ones(x.shape[1], x.shape[1], device=x.device, dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, -1e4)


@legal("huggingface/transformers#39981")
def mask_made_on_input_device(dev: torch.device, other: torch.device) -> Program:
    model = CausalWithDevice().to(dev)
    x = randn(2, 5, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class MultiTaskFixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(W, W)
        self.heads = nn.ModuleList([nn.Linear(W, n) for n in (3, 2)])
        self.branches = nn.ModuleDict({"rgb": nn.Linear(W, W)})

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.branches["rgb"](self.trunk(x))
        return [head(h) for head in self.heads]


@legal("pytorch/pytorch#21905")
def module_list_and_dict(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = MultiTaskFixed()
    model.to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class WithCriterion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Toy()
        self.criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))
        self.metric = MeanAbsError()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        self.metric(logits.detach(), F.one_hot(y, C).float())
        return self.criterion(logits, y)


@legal("Lightning-AI/pytorch-lightning#2984")
def criterion_and_metric_registered(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = WithCriterion()
    model.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: forward_step(model, x, y), (x, y))


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int = 2) -> None:
    explain_here(model, x)  # explain() finds the optimizer that steps here
    for _ in range(steps):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@legal("Lightning-AI/pytorch-lightning#19955")
def adam_built_after_move(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # its 'step' counters stay on the CPU
    x = randn(4, W, device=dev)
    train_steps(model, optimizer, x)
    return stepped(model, lambda: train_steps(model, optimizer, x, 1), (x,), optimizer)


@legal("pytorch/tutorials#577")
def optimizer_state_loaded_after_move(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        old = Toy()
    old_opt = torch.optim.AdamW(old.parameters(), lr=1e-3)
    train_steps(old, old_opt, randn(4, W, device=other))
    model = Toy()
    model.load_state_dict(old.state_dict())
    model.to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(old_opt.state_dict())  # moves each state tensor to its parameter's device
    x = randn(4, W, device=dev)
    return stepped(model, lambda: train_steps(model, optimizer, x, 1), (x,), optimizer)


def moved_batch_loss(model: nn.Module, batch: dict[str, torch.Tensor], dev: torch.device) -> torch.Tensor:
    import torchplace

    explain_here(model)  # before the move: explain() must see that the batch is moved before its use
    batch = torchplace.to_device(batch, dev)
    return F.cross_entropy(model(batch["x"]), batch["y"])


@legal("SamLynnEvans/Transformer#30")
def batch_moved_before_use(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    batch = {"x": randn(4, W, device=other), "y": labels(4, other)}
    return stepped(model, lambda: moved_batch_loss(model, batch, dev))


class TagEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(W, W)
        self.tag = nn.Linear(4, W)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tag = batch["image_tag"].to(batch["image"].device).float()
        return self.image(batch["image"]) + self.tag(tag)


@legal("huggingface/transformers#31975")
def batch_key_moved_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = TagEmbedding().to(dev)
    batch = {"image": randn(2, W, device=dev), "image_tag": torch.randint(0, 2, (2, 4), device=other)}
    return stepped(model, lambda: forward_step(model, batch), (batch,))


# ----------------------------------------------------------------------------- legal in the step around the model

def forward_step(model: nn.Module, *inputs: Any) -> Any:
    explain_here(model, *inputs)
    return model(*inputs)


def scaled_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    scale = torch.tensor(0.5)  # a 0-dim CPU tensor: elementwise ops take it with tensors on any device
    return F.cross_entropy(model(x), y) * scale


@legal("pytorch/pytorch#42161")
def cpu_scalar_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: scaled_loss(model, x, y), (x,))


def metric_on_copies(model: nn.Module, metric: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    preds = model(x)
    return metric(preds.detach().to(t.device), t)  # the metric and its targets live elsewhere, fed a copy


@legal("open-edge-platform/anomalib#202")
def metric_fed_moved_copies(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(other)
    metric = MeanAbsError().to(dev)
    x, t = randn(4, W, device=other), randn(4, C, device=dev)
    return stepped(model, lambda: metric_on_copies(model, metric, x, t), (x,))


def criterion_moved_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    criterion.to(x.device)  # moved where the batch is, before its first use
    return criterion(model(x), y)


@legal("pytorch/pytorch#122757")
def criterion_moved_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    with built_on(other):
        criterion = nn.CrossEntropyLoss(weight=torch.rand(C))
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: criterion_moved_step(model, criterion, x, y), (x,))


def kept_columns_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return F.mse_loss(model(x)[:, keep], y[:, keep])  # keep: a CPU index tensor, which indexing accepts


@legal("pytorch/xla#3188")
def cpu_index_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y, keep = randn(4, W, device=dev), randn(4, C, device=dev), torch.tensor([0, 2])
    return stepped(model, lambda: kept_columns_loss(model, x, y, keep), (x,))


def labels_moved_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    y = y.to(x.device)
    return F.cross_entropy(model(x), y)


@legal("JieyuZ2/wrench#4")
def labels_moved_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, other)
    return stepped(model, lambda: labels_moved_step(model, x, y), (x,))


class LastHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W)

    def forward(self, packed: Any) -> torch.Tensor:
        return self.lstm(packed)[1][0]


def packed_step(model: nn.Module, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)  # lengths stay on the CPU
    return model(packed)


@legal("pytorch/pytorch#43227")
def pack_lengths_in_step(dev: torch.device, other: torch.device) -> Program:
    model = LastHidden().to(dev)
    x, lengths = randn(5, 2, W, device=dev), torch.tensor([3, 5])
    return stepped(model, lambda: packed_step(model, x, lengths), (x,))
