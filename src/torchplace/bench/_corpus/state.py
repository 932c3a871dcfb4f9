"""Mistakes with state: recurrent state, messages torch words its own way, modules .to() does not reach."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import C, Program, Toy, W, _explain, built_on, explain_here, labels, mistake, randn, stepped

# ----------------------------------------------------------------------------- recurrent state

class CharLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)
        self.lstm = nn.LSTM(W, W)
        self.out = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.zeros(1, x.shape[1], W)
        c0 = torch.zeros(1, x.shape[1], W)
        y, _ = self.lstm(self.embed(x), (h0, c0))  # case: lstm_h0_zeros
        return self.out(y)


@mistake("Lightning-AI/pytorch-lightning#3738", "h0", "model.lstm")
def lstm_h0_zeros(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = CharLSTM()
    model.to(dev)
    x = randn(5, 2, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class GRUTagger(nn.Module):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.gru = nn.GRU(W, W)
        self.hidden = self.init_hidden(batch)

    def init_hidden(self, batch: int) -> torch.Tensor:
        return torch.zeros(1, batch, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.hidden = self.gru(x, self.hidden)  # case: gru_hidden_attribute
        return y


@mistake("TheShadow29/zsgnet-pytorch#14", "hidden", "model.gru")
def gru_hidden_attribute(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = GRUTagger(2)
    model.to(dev)
    x = randn(5, 2, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class DCRNNCell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * W, W)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        H = torch.zeros(X.shape[0], W)
        return self.gate(torch.cat([X, H], dim=1))  # case: hidden_zeros_cat


@mistake("benedekrozemberczki/pytorch_geometric_temporal#18", "H", "model")
def hidden_zeros_cat(dev: torch.device, other: torch.device) -> Program:
    model = DCRNNCell().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# ----------------------------------------------------------------------------- messages torch words its own way

class SegmentPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pooled = torch.zeros(2, W, device=h.device)
        return pooled.index_add(0, segment, h)  # case: index_add_segment


@mistake("modelscope/modelscope#220", "segment", "model")
def index_add_segment(dev: torch.device, other: torch.device) -> Program:
    model = SegmentPool().to(dev)
    x, segment = randn(4, W, device=dev), torch.tensor([0, 0, 1, 1], device=other)
    return Program(model, lambda: model(x, segment), (x, segment))


class NoisyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.gen, device=x.device)  # case: generator_on_cpu
        return self.proj(x + noise)


@mistake("pytorch/pytorch#62152", "gen", "model", pairs=("cuda-cpu",))
def generator_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = NoisyLayer().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def data_parallel_step(wrapped: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(wrapped, x)
    return wrapped(x)  # case: data_parallel_first_device


@mistake("replicate/cog#971", "layers.0.proj.weight", "model", pairs=("cuda1-cuda0",))
def data_parallel_first_device(dev: torch.device, other: torch.device) -> Program:
    wrapped = nn.DataParallel(Toy().to(other), device_ids=[dev.index, other.index])
    x = randn(4, W, device=dev)
    return stepped(wrapped, lambda: data_parallel_step(wrapped, x), (x,))


# ----------------------------------------------------------------------------- modules .to() does not reach

class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(W, W)
        self.heads = [nn.Linear(W, n) for n in (3, 2)]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.trunk(x)
        return [self.heads[0](h), self.heads[1](h)]  # case: heads_in_list


@mistake("pytorch/pytorch#15005", "heads[0]", "model.heads[0]")
def heads_in_list(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = MultiTask()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fuse = nn.Linear(W, C)
        self.branches = {"rgb": nn.Linear(W, W), "depth": nn.Linear(W, W)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.branches["rgb"](x)  # case: branches_in_dict
        return self.fuse(feats)


@mistake("marlbenchmark/off-policy#12", "branches['rgb']", "model.branches['rgb']")
def branches_in_dict(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = TwoBranch()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class TokenLearner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = (nn.Linear(W, W), nn.Linear(W, W))
        self.out = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # case: blocks_in_tuple
        return self.out(x)


@mistake("rish-16/tokenlearner-pytorch#5", "blocks[0]", "model.blocks[0]")
def blocks_in_tuple(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = TokenLearner()
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Recognizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(W, 2 * C)
        self.criterions = [nn.CrossEntropyLoss(weight=torch.ones(C)) for _ in range(2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1, 2, C)

    def validation_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self(batch["x"])
        loss0 = self.criterions[0](out[:, 0], batch["y"][:, 0])  # case: criterions_in_list
        loss1 = self.criterions[1](out[:, 1], batch["y"][:, 1])
        return loss0 + loss1


@mistake("Lightning-AI/pytorch-lightning#2984", ("criterions[0]", "weight"), "model.criterions[0]")
def criterions_in_list(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = Recognizer()
    model.to(dev)
    batch = {"x": randn(4, W, device=dev), "y": torch.randint(0, C, (4, 2), device=dev)}
    return Program(model, lambda: model.validation_step(batch), (batch,),
                   explain=lambda: _explain(model, batch, step=model.validation_step))


class Classifier(nn.Module):
    """A classifier whose loss lives inside it, so explain(model) sees it."""

    def __init__(self, criterion: nn.Module) -> None:
        super().__init__()
        self.body = Toy()
        self.extra = {"criterion": criterion}  # kept aside, as trainers do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def weighted_loss_step(model: nn.Module, criterion: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    explain_here(model, batch["x"], criterion)
    loss = criterion(model(batch["x"]), batch["y"])  # case: loss_weight_not_moved
    return loss


@mistake("pytorch/pytorch#122757", "criterion.weight", "criterion")
def loss_weight_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    with built_on(other):
        criterion = nn.CrossEntropyLoss(weight=torch.rand(C))
    batch = {"x": randn(4, W, device=dev), "y": labels(4, dev)}
    return stepped(model, lambda: weighted_loss_step(model, criterion, batch), (batch["x"],))


def multilabel_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return criterion(model(x), y)  # case: pos_weight_not_moved


@mistake("open-mmlab/mmaction2#1456", "criterion.pos_weight", "criterion")
def pos_weight_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    with built_on(other):
        criterion = nn.BCEWithLogitsLoss(pos_weight=torch.full((C,), 2.0))
    x, y = randn(4, W, device=dev), torch.rand(4, C, device=dev)
    return stepped(model, lambda: multilabel_step(model, criterion, x, y), (x,))


class WeightedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Toy()
        self.class_weights = torch.tensor([1.0, 2.0, 0.5])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(x), y, weight=self.class_weights)  # case: class_weights_attribute


@mistake("sacdallago/biotrainer#67", "class_weights", "model")
def class_weights_attribute(dev: torch.device, other: torch.device) -> Program:
    with built_on(other):
        model = WeightedHead()
    model.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return Program(model, lambda: model(x, y), (x, y))


def metric_step(model: nn.Module, metric: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    explain_here(model, batch["x"], metric)
    preds = model(batch["x"])
    return metric(preds, batch["t"])  # case: metric_not_moved


class MeanAbsError(nn.Module):
    """A metric that keeps its running sums as buffers, as torchmetrics metrics do."""

    total: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(C))

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.total = self.total + (preds - target).abs().sum(0)
        return self.total


@mistake("Lightning-AI/torchmetrics#1047", "metric.total", "metric")
def metric_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    with built_on(other):
        metric = MeanAbsError()
    batch = {"x": randn(4, W, device=dev), "t": randn(4, C, device=dev)}
    return stepped(model, lambda: metric_step(model, metric, batch), (batch["x"],))


def head_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return model(x)  # case: head_replaced_after_to


@mistake("huggingface/pytorch-image-models#2743", "head.weight", "model.head")
def head_replaced_after_to(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    with built_on(other):
        model.head = nn.Linear(W, C)  # a new classifier for fine-tuning, made after the move
    x = randn(4, W, device=dev)
    return stepped(model, lambda: head_step(model, x), (x,))


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(nn.Linear(W, W), nn.ReLU())
        self.stage2 = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage1(x)
        return self.stage2(h)  # case: pipeline_stage_without_to


@mistake("facebookresearch/metaseq#15", "stage2", "model.stage2")
def pipeline_stage_without_to(dev: torch.device, other: torch.device) -> Program:
    model = TwoStage()
    model.stage1.to(dev)
    model.stage2.to(other)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))
