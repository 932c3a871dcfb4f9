"""MkDocs hook: show the docs' runnable code blocks as ordinary code blocks on the site.

tests/test_docs.py runs every fenced block whose info string says `runnable`
(```` ```python runnable timeout=120 ````). Markdown's fence parsers take only a language there,
so without this hook those blocks would render as paragraphs. The hook keeps the language and
turns the rest into a title over the block: "runs as a test", or the file name a block is
written to (`file=demo.py`).
"""

from __future__ import annotations

import re
from typing import Any

_RUNNABLE = re.compile(r"^(?P<fence>`{3,})(?P<lang>\w+) runnable\b(?P<options>[^\n]*)$", re.MULTILINE)


def _plain(found: re.Match[str]) -> str:
    options = dict(w.split("=", 1) for w in found["options"].split() if "=" in w)
    title = options["file"] if "file" in options else "runs as a test (tests/test_docs.py)"
    return f'{found["fence"]}{found["lang"]} title="{title}"'


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _RUNNABLE.sub(_plain, markdown)
