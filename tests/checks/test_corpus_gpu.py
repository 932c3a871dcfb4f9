"""The corpus on real GPUs: cuda:0 vs cpu, and cuda:1 vs cuda:0 (multigpu)."""

from __future__ import annotations

import pytest
import torch

from torchplace.bench import _corpus as corpus
from torchplace.bench import diagnose

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _device_zero():
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


def _params(pair: str, kind: str) -> list:
    marks = [pytest.mark.multigpu] if pair == "cuda1-cuda0" else []
    return [pytest.param(pair, c, id=f"{pair}-{c.name}", marks=marks) for c in corpus.for_pair(pair, kind)]


MISTAKES = _params("cuda-cpu", "mistake") + _params("cuda1-cuda0", "mistake")
LEGAL = _params("cuda-cpu", "legal") + _params("cuda1-cuda0", "legal")


@pytest.mark.parametrize("tool", ["strict", "watch"])
@pytest.mark.parametrize("pair, case", MISTAKES)
def test_strict_and_watch_name_path_tensor_and_line(pair, case, tool):
    out = diagnose.score(case, pair, tool, corpus)
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("pair, case", MISTAKES)
def test_explain_names_path_tensor_and_line(pair, case):
    """explain() called in the step as a user does (explain_here): the forward, the model's layout, the optimizer
    and the step's own code around the model name every mistake with its line."""
    out = diagnose.score(case, pair, "explain", corpus)
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("tool", diagnose.TOOLS)
@pytest.mark.parametrize("pair, case", LEGAL)
def test_legal_patterns_raise_no_alarm(pair, case, tool):
    out = diagnose.score(case, pair, tool, corpus)
    assert not out.alarm, out.text
