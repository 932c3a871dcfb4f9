"""Small modules with one job each: no module of the library grows past 400 lines (issue 19)."""

from __future__ import annotations

from pathlib import Path

import torchplace

MAX_LINES = 400


def test_no_module_is_over_400_lines():
    root = Path(torchplace.__file__).parent
    long = {str(p.relative_to(root)): n for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
