"""What a case corpus is made of, for corpora beside tests/checks/corpus.py (corpus_public.py, corpus_heldout.py).

The same shape as corpus.py, so `torchplace bench diagnose --corpus FILE` and the tests score them alike: a
`Registry` per file holds its cases (CASES, for_pair, PAIRS); each case names its public source (an issue as
owner/repo#number, or a forum thread's URL), what a report must name, the module path and the user's line (the
line ending in `# case: NAME` in the corpus file).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    explain: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "mistake" or "legal"
    source: str  # owner/repo#number or a URL
    build: Callable[[torch.device, torch.device], Program]
    file: str
    culprit: tuple[str, ...] = ()
    module: str | None = None
    pairs: tuple[str, ...] = ALL

    @property
    def line(self) -> int | None:
        for number, text in enumerate(Path(self.file).read_text().splitlines(), 1):
            if re.search(rf"# case: {re.escape(self.name)}$", text):
                return number
        return None

    @property
    def at(self) -> str | None:
        return f"{Path(self.file).name}:{self.line}" if self.line else None


class Registry:
    """The cases of one corpus file."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.CASES: list[Case] = []

    def mistake(self, source: str, culprit: str | tuple[str, ...], module: str | None = None,
                pairs: tuple[str, ...] = ALL) -> Callable[[Callable[..., Program]], Callable[..., Program]]:
        names = (culprit,) if isinstance(culprit, str) else culprit
        return self._add("mistake", source, names, module, pairs)

    def legal(self, source: str,
              pairs: tuple[str, ...] = ALL) -> Callable[[Callable[..., Program]], Callable[..., Program]]:
        return self._add("legal", source, (), None, pairs)

    def _add(self, kind: str, source: str, culprit: tuple[str, ...], module: str | None,
             pairs: tuple[str, ...]) -> Callable[[Callable[..., Program]], Callable[..., Program]]:
        def register(build: Callable[..., Program]) -> Callable[..., Program]:
            self.CASES.append(Case(build.__name__, kind, source, build, self.file, culprit, module, pairs))
            return build
        return register

    def for_pair(self, pair: str, kind: str | None = None) -> list[Case]:
        return [c for c in self.CASES if pair in c.pairs and (kind is None or c.kind == kind)]


_REPORTS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("corpus_kit_reports", default=None)


def explain_here(model: nn.Module, *inputs: Any, optimizer: Any = None) -> None:
    """The line a user adds at the top of the failing step while debugging (only the explain scoring reaches it)."""
    reports = _REPORTS.get()
    if reports is not None:
        from torchplace.checks.explain import explain

        reports.append(explain(model, *inputs, optimizer=optimizer))


def explained(step: Callable[[], Any]) -> Any:
    """Run a step that calls explain_here(): the report comes first, then the step runs on (and fails)."""
    reports: list[Any] = []
    token = _REPORTS.set(reports)
    try:
        step()
    except RuntimeError:
        pass
    finally:
        _REPORTS.reset(token)
    return reports[-1]  # the last: explain() run again inside its own dry run of the step appends first


def stepped(model: nn.Module, step: Callable[[], Any], inputs: tuple[Any, ...] = (), optimizer: Any = None) -> Program:
    return Program(model, step, inputs, optimizer, explain=lambda: explained(step))


def forward_step(model: nn.Module, *inputs: Any) -> Any:
    explain_here(model, *inputs)
    return model(*inputs)


def randn(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device)


def labels(n: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, C, (n,), device=device)


def _explain(model: nn.Module, *inputs: Any) -> Any:
    """explain() as a user calls it, with the object that lives beside the model."""
    from torchplace.checks.explain import explain

    return explain(model, *inputs)


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
