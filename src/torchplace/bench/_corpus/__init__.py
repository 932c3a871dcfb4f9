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

from . import legal, origins, state
from .base import ALL, CASES, GPU, PAIRS, C, Case, Program, Toy, W

__all__ = ["ALL", "CASES", "GPU", "PAIRS", "C", "Case", "Program", "Toy", "W", "for_pair"]
_GROUPS = (state, origins, legal)  # imported for the cases they register, in this order


def for_pair(pair: str, kind: str | None = None) -> list[Case]:
    """The cases that run on this device pair (all, or only mistakes / legal ones)."""
    return [c for c in CASES if pair in c.pairs and (kind is None or c.kind == kind)]
