"""A corpus of device mistakes users reported in public issues, and legal patterns that must stay silent.

Each case is a small program built for two devices: `main`, where the model is meant to run, and
`other`, where the mistake leaves a tensor (a factory without a device always lands on the CPU).
On the CPU the pair is meta vs cpu (a meta tensor mixed with a cpu one raises the same device
mismatch as cuda vs cpu, for the ops chosen here); on the GPU machine it is cuda:0 vs cpu and
cuda:1 vs cuda:0. Cases whose error only a real accelerator raises (a generator on the wrong
device, DataParallel, optimizer state: torch's meta kernels let those through) list only the
GPU pairs.

A case names the public issue it comes from (`source`: owner/repo#number), what a report must
name (`culprit`: strings that all appear in it), the module path it must show (`module`), and
the user's line (the line ending in `# case: NAME`). `torchplace bench diagnose` scores strict(),
watch() and explain() on it; tests/checks/test_corpus.py asserts each outcome.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FILE = Path(__file__).name
W, C = 8, 3
PAIRS = {"cpu-meta": ("meta", "cpu"), "cuda-cpu": ("cuda:0", "cpu"), "cuda1-cuda0": ("cuda:1", "cuda:0")}
ALL = tuple(PAIRS)
GPU = ("cuda-cpu", "cuda1-cuda0")


@dataclass
class Program:
    """One built case: the model, the step that runs it, and what explain() is given."""

    model: nn.Module
    run: Callable[[], Any]
    inputs: tuple[Any, ...] = ()
    optimizer: Any = None
    explain: Callable[[], Any] | None = None  # how the user would call explain(), when it takes more than the model


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "mistake" or "legal"
    source: str  # the public issue: owner/repo#number
    build: Callable[[torch.device, torch.device], Program]
    culprit: tuple[str, ...] = ()
    module: str | None = None
    pairs: tuple[str, ...] = ALL

    @property
    def line(self) -> int | None:
        """The user's line: the one marked `# case: NAME` in this file."""
        for number, text in enumerate(Path(__file__).read_text().splitlines(), 1):
            if re.search(rf"# case: {re.escape(self.name)}$", text):
                return number
        return None

    @property
    def at(self) -> str | None:
        return f"{FILE}:{self.line}" if self.line else None


CASES: list[Case] = []


def case(kind: str, source: str, culprit: tuple[str, ...] = (), module: str | None = None,
         pairs: tuple[str, ...] = ALL) -> Callable[[Callable[..., Program]], Callable[..., Program]]:
    def register(build: Callable[..., Program]) -> Callable[..., Program]:
        CASES.append(Case(build.__name__, kind, source, build, culprit, module, pairs))
        return build
    return register


def mistake(source: str, culprit: str | tuple[str, ...], module: str | None = None,
            pairs: tuple[str, ...] = ALL) -> Callable[[Callable[..., Program]], Callable[..., Program]]:
    return case("mistake", source, (culprit,) if isinstance(culprit, str) else culprit, module, pairs)


def legal(source: str, pairs: tuple[str, ...] = ALL) -> Callable[[Callable[..., Program]], Callable[..., Program]]:
    return case("legal", source, pairs=pairs)


def _explain(model: nn.Module, *inputs: Any) -> Any:
    """explain() as a user calls it, with the loss, metric or scheduler that lives beside the model."""
    from torchplace.checks.explain import explain

    return explain(model, *inputs)


_REPORTS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("corpus_reports", default=None)


def explain_here(model: nn.Module, *inputs: Any, optimizer: Any = None) -> None:
    """The line a user adds at the top of the step that fails, while debugging: explain() with what the step
    has at hand. Only the bench's explain() scoring reaches explain(); strict() and watch() run the step as is."""
    reports = _REPORTS.get()
    if reports is not None:
        from torchplace.checks.explain import explain

        reports.append(explain(model, *inputs, optimizer=optimizer))


def explained(step: Callable[[], Any]) -> Any:
    """Run a step that calls explain_here(), as the user does: the report comes first, then the step runs on
    (and fails where the mistake is: that failure is what explain() had to foresee)."""
    reports: list[Any] = []
    token = _REPORTS.set(reports)
    try:
        step()
    except RuntimeError:
        pass
    finally:
        _REPORTS.reset(token)
    return reports[0]


def stepped(model: nn.Module, step: Callable[[], Any], inputs: tuple[Any, ...] = (), optimizer: Any = None) -> Program:
    """A case whose user explains inside the step (explain_here): explain() reads that step's code too."""
    return Program(model, step, inputs, optimizer, explain=lambda: explained(step))


@contextlib.contextmanager
def built_on(device: torch.device) -> Iterator[None]:
    """Build where the user's code builds: factories without a device land on `device`."""
    with torch.device(device):
        yield


def randn(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device)


def labels(n: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, C, (n,), device=device)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.norm = nn.LayerNorm(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)).relu()


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


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
    return Program(model, lambda: model.validation_step(batch), (batch["x"],))


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
    return Program(model, lambda: scheduler.step(model(x), 3), (x,), explain=lambda: _explain(model, x, scheduler))


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


def for_pair(pair: str, kind: str | None = None) -> list[Case]:
    """The cases that run on this device pair (all, or only mistakes / legal ones)."""
    return [c for c in CASES if pair in c.pairs and (kind is None or c.kind == kind)]
