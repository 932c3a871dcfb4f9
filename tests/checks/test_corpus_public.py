"""The public corpora on cpu vs meta: corpus_public.py (the diagnosis was developed against it) and
corpus_outside.py (reports from other projects added in issue 31, the development part). strict(), watch() and
explain() name every mistake with module path, tensor and user line; nothing cries wolf. Cases of
corpus_outside.py that no tool names fully yet are xfail(strict=True) in OUTSIDE_XFAIL, with what is missing, so
the suite stays green while the diagnosis catches up and turns red when one starts to pass.
corpus_outside2.py (a second development part) is scored the same way, its misses of today xfail(strict=False) in
OUTSIDE2_XFAIL. The held-out parts (corpus_heldout*.py) are never scored here: each is scored once, by hand, with
`torchplace bench diagnose --corpus tests/checks/FILE`; only their size, sources and overlap are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchplace.bench import diagnose

HERE = Path(__file__).parent
CORPORA = {name: diagnose.load_corpus(HERE / f"{name}.py")
           for name in ("corpus_public", "corpus_outside", "corpus_outside2")}
PAIR = "cpu-meta"

# (case, tool): what the report lacks today (2026-12-02, cpu vs meta); every tool when the tool is None
OUTSIDE_XFAIL: dict[tuple[str, str | None], str] = {
}


# (case, tool): what corpus_outside2.py's reports lack when it was written (2026-12-02, cpu vs meta)
OUTSIDE2_XFAIL: dict[tuple[str, str | None], str] = {
}


def _xfail(file: str, case: str, tool: str) -> list:
    if file == "corpus_outside2":
        reason = OUTSIDE2_XFAIL.get((case, tool)) or OUTSIDE2_XFAIL.get((case, None))
        return [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
    if file != "corpus_outside":
        return []
    reason = OUTSIDE_XFAIL.get((case, tool)) or OUTSIDE_XFAIL.get((case, None))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _params(kind: str) -> list:
    return [pytest.param(name, case, tool, id=f"{name}-{case.name}-{tool}", marks=_xfail(name, case.name, tool))
            for name, corpus in CORPORA.items() for case in corpus.for_pair(PAIR, kind) for tool in diagnose.TOOLS]


@pytest.mark.parametrize("name, mistakes, legal", [("corpus_public", 25, 10), ("corpus_outside", 12, 6),
                                                   ("corpus_outside2", 10, 5), ("corpus_heldout", 12, 6),
                                                   ("corpus_heldout2", 15, 8), ("corpus_heldout3", 34, 16),
                                                   ("corpus_heldout4", 29, 14),
                                                   ("corpus_heldout5", 31, 16),
                                                   ("corpus_heldout6", 30, 15)])
def test_the_corpus_is_big_enough_and_cites_its_sources(name, mistakes, legal):
    """Held-out parts are loaded for their size and sources only, never scored here."""
    path = HERE / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{path.name} is not in this checkout")
    cases = (CORPORA.get(name) or diagnose.load_corpus(path)).CASES
    assert len([c for c in cases if c.kind == "mistake"]) >= mistakes
    assert len([c for c in cases if c.kind == "legal"]) >= legal
    assert all(("/" in c.source and "#" in c.source) or c.source.startswith("https://") for c in cases)
    assert all(c.line for c in cases if c.kind == "mistake") and len({c.name for c in cases}) == len(cases)


def test_the_outside_corpus_cites_reports_no_other_corpus_here_cites():
    """Different reports from the ones the diagnosis was developed against (corpus_public.py and the corpus shipped
    with torchplace; documentation pages may repeat)."""
    public = {c.source for c in CORPORA["corpus_public"].CASES + diagnose.load_corpus().CASES}
    outside = [c.source for c in CORPORA["corpus_outside"].CASES if not c.source.startswith("https://")]
    assert not public & set(outside) and len(set(outside)) == len(outside)


@pytest.mark.parametrize("name", ["corpus_outside2", "corpus_heldout3", "corpus_heldout4", "corpus_heldout5",
                                  "corpus_heldout6"])
def test_the_newer_parts_cite_reports_no_other_corpus_cites(name):
    """corpus_outside2.py and corpus_heldout3-6.py (issue 31) cite reports, forum threads and pages that no other
    corpus here cites, nor each other, and no source twice."""
    path = HERE / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{path.name} is not in this checkout")
    others = [diagnose.load_corpus()] + [diagnose.load_corpus(p) for p in sorted(HERE.glob("corpus_*.py"))
                                         if p.stem not in (name, "corpus_kit")]
    seen = {c.source for corpus in others for c in corpus.CASES}
    mine = [c.source for c in diagnose.load_corpus(path).CASES]
    assert not seen & set(mine), seen & set(mine)
    assert len(set(mine)) == len(mine)


def test_every_xfail_names_a_case_of_the_outside_corpus():
    names = {c.name for c in CORPORA["corpus_outside"].for_pair(PAIR, "mistake")}
    assert {case for case, _ in OUTSIDE_XFAIL} <= names


@pytest.mark.parametrize("name, case, tool", _params("mistake"))
def test_every_tool_names_path_tensor_and_line(name, case, tool):
    out = diagnose.score(case, PAIR, tool, CORPORA[name])
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("name, case, tool", _params("legal"))
def test_legal_patterns_raise_no_alarm(name, case, tool):
    out = diagnose.score(case, PAIR, tool, CORPORA[name])
    assert not out.alarm, out.text
