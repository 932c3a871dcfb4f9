"""Every report of the corpus reads at 120 columns: what and where first, the one fix on the line under it
(at most two lines of 120), its alternatives after it, a `More:` link that lands on a section of the docs;
explain()'s problems table has no cell taller than three lines, the details following the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from torchplace.bench import _corpus as corpus
from torchplace.bench import diagnose

PAIR = "cpu-meta"
MISTAKES = corpus.for_pair(PAIR, "mistake")
WIDTH = 120
DOCS = Path(__file__).resolve().parents[2] / "docs"
_HEADLINES = ("Device mismatch in ", "Meta tensor used for its data in ")


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs (and GitHub) give the headings of PAGE: lower case, punctuation dropped, spaces to '-'."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in heads}


def _row_heights(rendered: str) -> list[int]:
    """Lines per row of the 'problems' table, as rich drew it: a row starts where its first cell has text."""
    lines = rendered.splitlines()
    title = next(i for i, line in enumerate(lines) if line.strip() == "problems")
    body = next(i for i in range(title, len(lines)) if lines[i].startswith("┡")) + 1
    end = next(i for i in range(body, len(lines)) if lines[i].startswith("└"))
    starts = [i for i in range(body, end) if lines[i][1:].split("│")[0].strip()]
    return [b - a for a, b in zip(starts, [*starts[1:], end])]


def _check_report(text: str, fixed_above: bool = False) -> None:
    """FIXED_ABOVE: a problem of explain(), whose first line holds the fix: its report goes on from `Or:`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(_HEADLINES):  # a report: its fix right under what and where
            assert lines[i + 1].startswith(("Fix: ", "Or: ", "Also: ", "  ") if fixed_above else "Fix: "), text
    for line in lines:
        if line.startswith(("Fix: ", "Or: ", "Also: ")):
            assert len(line) <= 2 * WIDTH, line
        if line.startswith("More: "):
            for link in line.removeprefix("More: ").split(", "):
                page, _, anchor = link.partition("#")
                assert anchor in _anchors(DOCS.parent / page), f"{link} does not land on a heading"


@pytest.mark.parametrize("tool", ["strict", "watch"])
@pytest.mark.parametrize("case", MISTAKES, ids=lambda c: c.name)
def test_strict_and_watch_give_the_fix_first_and_short(case, tool):
    out = diagnose.score(case, PAIR, tool, corpus)
    assert "Fix: " in out.text
    _check_report(out.text)


@pytest.mark.parametrize("case", MISTAKES, ids=lambda c: c.name)
def test_explain_cells_fit_three_lines_at_120_columns(case):
    main, other = (torch.device(d) for d in corpus.PAIRS[PAIR])
    torch.manual_seed(0)
    # `_program`: a name reports do not start from (they name a module from the variable the user's code holds it
    # by, `program.model.lstm` here), so the cells read as bench diagnose shows them, from `model`
    _program = case.build(main, other)
    result = _program.explain() if _program.explain else diagnose._explain(_program)
    rendered = str(result)  # rich at 120 columns, no colour
    assert max(len(line) for line in rendered.splitlines()) <= WIDTH
    heights = _row_heights(rendered)
    assert len(heights) == len(result.problems) and max(heights) <= 3, rendered
    for p in result.problems:
        first = p["message"].splitlines()[0]
        assert "Fix: " in first or p["severity"] == "note", p  # what and how to fix, in the cell
        _check_report(p["message"], fixed_above=True)
        if "\n" in p["message"]:  # the rest follows the table
            assert f"{p['kind']} at {p['where']}, in full:" in rendered


def test_a_more_link_that_lands_nowhere_is_caught():
    with pytest.raises(AssertionError, match="does not land"):
        _check_report("Device mismatch in x\nFix: y.\nMore: docs/strict-mode.md#no-such-section")
    assert "weights-on-meta" in _anchors(DOCS / "strict-mode.md")
