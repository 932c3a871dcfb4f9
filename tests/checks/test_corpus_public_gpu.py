"""The public corpus (corpus_public.py) on real GPUs: cuda:0 vs cpu, and cuda:1 vs cuda:0 (multigpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchplace.bench import diagnose

pytestmark = pytest.mark.gpu
corpus = diagnose.load_corpus(Path(__file__).with_name("corpus_public.py"))


@pytest.fixture(autouse=True)
def _device_zero():
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


def _params(kind: str) -> list:
    out = []
    for pair in ("cuda-cpu", "cuda1-cuda0"):
        marks = [pytest.mark.multigpu] if pair == "cuda1-cuda0" else []
        out += [pytest.param(pair, c, id=f"{pair}-{c.name}", marks=marks) for c in corpus.for_pair(pair, kind)]
    return out


@pytest.mark.parametrize("tool", diagnose.TOOLS)
@pytest.mark.parametrize("pair, case", _params("mistake"))
def test_every_tool_names_path_tensor_and_line(pair, case, tool):
    out = diagnose.score(case, pair, tool, corpus)
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("tool", diagnose.TOOLS)
@pytest.mark.parametrize("pair, case", _params("legal"))
def test_legal_patterns_raise_no_alarm(pair, case, tool):
    out = diagnose.score(case, pair, tool, corpus)
    assert not out.alarm, out.text
