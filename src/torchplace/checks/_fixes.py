"""How a report words its fixes: the first one right under what went wrong, its alternatives after it, one line
each, and the docs section that tells the other ways (so a message stays short at 120 columns)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DOCS", "Fix", "failed", "fix_lines", "more_line"]

DOCS = "docs/strict-mode.md"  # its section "The fixes, and other ways" holds the anchors named here


@dataclass(frozen=True)
class Fix:
    """One fix: a short imperative line, alternatives to it (or None), the docs section that explains them."""

    fix: str
    alternatives: str | None = None
    anchor: str | None = None


def fix_lines(fixes: list[Fix]) -> list[str]:
    """`Fix:` with the first fix, `Or:` with its alternatives, `Also:` for each further cause."""
    if not fixes:
        return []
    lines = [f"Fix: {fixes[0].fix}."] + ([f"Or: {fixes[0].alternatives}."] if fixes[0].alternatives else [])
    return lines + [f"Also: {f.fix}." for f in fixes[1:]]


def more_line(fixes: list[Fix]) -> list[str]:
    """`More:` with the docs sections of the fixes, when they have one."""
    anchors = list(dict.fromkeys(f.anchor for f in fixes if f.anchor))
    return [f"More: {', '.join(f'{DOCS}#{a}' for a in anchors)}"] if anchors else []


def failed(what: str, exc: BaseException) -> str:
    """A problem's message for an error watch() named: one line with the culprits and the fix, then its report
    (less its `Fix:` line, which the first line holds)."""
    brief_of = getattr(getattr(exc, "report", None), "brief", None)
    if brief_of is None:
        return f"{what}: {exc}"
    brief = str(brief_of())
    said = brief[brief.index("Fix: "):] if "Fix: " in brief else None
    return f"{what}: {brief}\n" + "\n".join(line for line in str(exc).splitlines() if line != said)
