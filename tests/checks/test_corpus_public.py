"""The public corpus (corpus_public.py: mistakes and legal patterns from other projects' reports, none in
corpus.py) on cpu vs meta: strict(), watch() and explain() name every mistake with module path, tensor and user
line; nothing cries wolf. corpus_heldout.py is not tested here: it is scored once, by hand, with
`torchplace bench diagnose --corpus tests/checks/corpus_heldout.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchplace.bench import diagnose

corpus = diagnose.load_corpus(Path(__file__).with_name("corpus_public.py"))
PAIR = "cpu-meta"


def test_the_corpus_is_big_enough_and_cites_its_sources():
    mistakes = [c for c in corpus.CASES if c.kind == "mistake"]
    assert len(mistakes) >= 25 and len([c for c in corpus.CASES if c.kind == "legal"]) >= 10
    assert all(("/" in c.source and "#" in c.source) or c.source.startswith("https://") for c in corpus.CASES)
    assert all(c.line for c in mistakes) and len({c.name for c in corpus.CASES}) == len(corpus.CASES)


@pytest.mark.parametrize("tool", diagnose.TOOLS)
@pytest.mark.parametrize("case", corpus.for_pair(PAIR, "mistake"), ids=lambda c: c.name)
def test_every_tool_names_path_tensor_and_line(case, tool):
    out = diagnose.score(case, PAIR, tool, corpus)
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("tool", diagnose.TOOLS)
@pytest.mark.parametrize("case", corpus.for_pair(PAIR, "legal"), ids=lambda c: c.name)
def test_legal_patterns_raise_no_alarm(case, tool):
    out = diagnose.score(case, PAIR, tool, corpus)
    assert not out.alarm, out.text
