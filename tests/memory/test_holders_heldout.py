"""Memory growth from other projects' public reports (issue 31), written as a held-out set and scored once, on
2026-12-02 (session 9): 1 of 4 named as written. Now a development set like test_holders_outside.py; what the
tracker does not name as written yet is xfail(strict=True), with what it says instead. Each test reproduces its
report's loop (cited in its docstring) on the CPU, with tensors large enough that the growth clears the CPU's
tolerance (16 MiB) well, and says what the tracker must name: the holder as the user wrote it, or for memory kept
only by an autograd graph, the tensor at the graph's root. Checked with plain torch when written (no tracker: the
process's resident memory, glibc's mmap threshold pinned so that freed blocks go back): each loop grew 67-135 MiB
over its 16 steps, the same loop with the report's fix under 8 MiB."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from torchplace import track_memory
from torchplace.memory import MemoryLeakWarning


def line_of(text: str) -> str:
    """'FILE.py:N' of the first line of this file containing TEXT."""
    lines = Path(__file__).read_text().splitlines()
    return f"{Path(__file__).name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1))


class AUROC(nn.Module):
    """A torchmetrics-style AUROC: every update's predictions and targets kept in list states until compute()."""

    def __init__(self) -> None:
        super().__init__()
        self.preds: list[torch.Tensor] = []
        self.target: list[torch.Tensor] = []

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.preds.append(preds)
        self.target.append(target)


class MetricCollection:
    def __init__(self) -> None:
        self.MetricsDict = {"AUC": AUROC()}

    def __call__(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        for metric in self.MetricsDict.values():
            metric(preds, target)


def test_metric_list_states_updated_with_undetached_predictions():
    """Lightning-AI/torchmetrics#1461: AUROC stores every update's inputs; updated in the training loop with
    `met(predictions, labels)` (no `.detach()`), each stored prediction also holds its graph."""
    model = mlp()
    met = MetricCollection()
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                predictions = model(torch.randn(1024, 1024))
                labels = torch.randint(0, 2, (1024, 1))
                met(predictions, labels)  # the leak: met(predictions.detach(), labels)
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew][:1] == [("list `met.MetricsDict['AUC'].preds`",
                                                      line_of("self.preds.append(preds)"))]


class MemReporter:
    """pytorch_memlab's reporter before its fix: names of tensors kept in dicts keyed by the tensors themselves."""

    def __init__(self, model: nn.Module) -> None:
        self.tensor_name: dict[torch.Tensor, str] = {}
        self.tensor_device: dict[torch.Tensor, torch.device] = {}
        self.name_map = {param: name for name, param in model.named_parameters()}

    def collect_tensor(self, tensors: list[torch.Tensor]) -> None:
        for index, tensor in enumerate(tensors):
            self.tensor_name[tensor] = self.name_map.get(tensor, f"Tensor{index}")
            self.tensor_device[tensor] = tensor.device


def test_reporter_dicts_keyed_by_tensors_keep_them_alive():
    """Stonesjtu/pytorch_memlab#17: the reporter's `tensor_name` and `tensor_device` mappings keep a reference to
    every tensor they have seen, so no tensor reported once is ever freed."""
    model = nn.Linear(1024, 1024)
    reporter = MemReporter(model)
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                with torch.no_grad():
                    activations = [model(torch.randn(1024, 1024))]
                reporter.collect_tensor(activations)
                tracker.step()
    names = [g.name for g in tracker.report.grew]
    assert {"dict `reporter.tensor_name`", "dict `reporter.tensor_device`"} & set(names), names


class FinetuneDataset(torch.utils.data.Dataset):
    """Kimi-Audio's fine-tuning dataset: __getitem__ behind @lru_cache(maxsize=None), so each sample stays cached."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @functools.lru_cache(maxsize=None)  # noqa: B019, UP033 (as the report wrote it: the leak)
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, 100, (1024,)), "whisper_feature": torch.randn(1024, 1024)}


def test_dataset_getitem_behind_an_unbounded_lru_cache():
    """MoonshotAI/Kimi-Audio#117: `@lru_cache(maxsize=None)` on the dataset's __getitem__ keeps every sample it
    returned; memory grows with the data seen."""
    dataset = FinetuneDataset(64)
    model = nn.Linear(1024, 1)
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for i in range(16):
                with torch.no_grad():
                    model(dataset[i]["whisper_feature"])
                tracker.step()
    name = tracker.report.grew[0].name
    assert name == "dict `@lru_cache of FinetuneDataset.__getitem__`", name


class LineSearchGD(torch.optim.Optimizer):
    """The Lyapunov project's line-search descent, shortened: step() tries step sizes, each by calling the closure,
    and returns the last loss the closure computed."""

    def __init__(self, params, lr: float = 0.1, step_size_reduction: float = 0.2) -> None:
        super().__init__(params, dict(lr=lr, step_size_reduction=step_size_reduction))

    def step(self, closure, loss0: float) -> torch.Tensor:
        group = self.param_groups[0]
        p_all = [p for p in group["params"] if p.grad is not None]
        d_p = [-p.grad.clone() for p in p_all]
        alpha_prev, alpha = 0.0, 1.0
        while True:
            with torch.no_grad():
                for p, d in zip(p_all, d_p):
                    p.add_(d, alpha=(alpha - alpha_prev) * group["lr"])
            loss = closure()
            if loss.item() <= loss0 or alpha < 1e-3:
                return loss
            alpha_prev, alpha = alpha, alpha * group["step_size_reduction"]


def test_line_search_losses_kept_as_tensors_in_a_list():
    """StanfordASL/neural-network-lyapunov#140: the training loop kept each line-search step's returned loss in
    `losses`, the tensor with its graph (the closure's forward is never backpropagated); the fix stores floats."""
    model = mlp()
    optimizer = LineSearchGD(model.parameters(), lr=1e-3)
    x = torch.randn(1024, 1024)

    def closure() -> torch.Tensor:
        return model(x).pow(2).mean()

    losses = []
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                optimizer.zero_grad()
                loss0 = closure()
                loss0.backward()
                loss = optimizer.step(closure, loss0.item())
                losses.append(loss)  # the leak: losses.append(loss.item())
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew][:1] == [("list `losses`", line_of("losses.append(loss)  #"))]
