"""What a case is, how one registers, and the helpers and toy models the cases share."""


from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
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
    def file(self) -> str:
        """The file of the case's program (its user's code)."""
        return self.build.__code__.co_filename

    @property
    def line(self) -> int | None:
        """The user's line: the one marked `# case: NAME` in the case's file."""
        for number, text in enumerate(Path(self.file).read_text().splitlines(), 1):
            if re.search(rf"# case: {re.escape(self.name)}$", text):
                return number
        return None

    @property
    def at(self) -> str | None:
        return f"{Path(self.file).name}:{self.line}" if self.line else None


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


def _explain(model: nn.Module, *inputs: Any, step: Callable[..., Any] | None = None) -> Any:
    """explain() as a user calls it, with the loss, metric or scheduler that lives beside the model, and the
    step (run as step(*inputs)) where the mistake is outside the model's forward."""
    from torchplace.checks.explain import explain

    return explain(model, *inputs, step=step)


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
    if not reports:
        raise LookupError("the step failed before it reached explain_here(): explain() was not called")
    return reports[-1]  # the last: explain() run again inside its own dry run of the step appends first


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
