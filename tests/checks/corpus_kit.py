"""What a case corpus beside the shipped one is made of (corpus_public.py, corpus_heldout.py).

The cases, programs and helpers are those of the corpus shipped with torchplace (torchplace/bench/_corpus), so
`torchplace bench diagnose --corpus FILE` and the tests score them alike; what this adds is a `Registry` per
file, which holds that file's cases (CASES, for_pair). Each case names its public source (an issue as
owner/repo#number, or a forum thread's URL), what a report must name, the module path and the user's line (the
line ending in `# case: NAME` in the corpus file).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from torchplace.bench._corpus.base import (  # noqa: F401 (what the corpus files take from here)
    ALL,
    GPU,
    PAIRS,
    C,
    Case,
    Program,
    Toy,
    W,
    _explain,
    explain_here,
    labels,
    randn,
    stepped,
)


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
            self.CASES.append(Case(build.__name__, kind, source, build, culprit, module, pairs))
            return build
        return register

    def for_pair(self, pair: str, kind: str | None = None) -> list[Case]:
        return [c for c in self.CASES if pair in c.pairs and (kind is None or c.kind == kind)]


def forward_step(model: nn.Module, *inputs: Any) -> Any:
    """A step that explains itself, then calls the model."""
    explain_here(model, *inputs)
    return model(*inputs)
