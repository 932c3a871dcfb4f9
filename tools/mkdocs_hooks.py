"""MkDocs hook: show the docs' runnable code blocks as ordinary code blocks on the site.

tests/test_docs.py runs every fenced block whose info string says `runnable`
(```` ```python runnable timeout=120 ````). Markdown's fence parsers take only a language there,
so without this hook those blocks would render as paragraphs. The hook keeps the language and
drops the rest, except the file name a block is written to (`file=demo.py`), shown as the block's
title: on the site a runnable block reads like any other (that it runs is said once, on the home page).
A recorded output (```` ```text output ````, compared with what its block prints) becomes a plain text block.
"""

from __future__ import annotations

import re
from typing import Any

_RUNNABLE = re.compile(r"^(?P<fence>`{3,})(?P<lang>\w+) runnable\b(?P<options>[^\n]*)$", re.MULTILINE)
_RECORDED = re.compile(r"^(?P<fence>`{3,})text output$", re.MULTILINE)  # a runnable block's recorded output


def _plain(found: re.Match[str]) -> str:
    options = dict(w.split("=", 1) for w in found["options"].split() if "=" in w)
    title = f' title="{options["file"]}"' if "file" in options else ""
    return f'{found["fence"]}{found["lang"]}{title}'


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _RECORDED.sub(r"\g<fence>text", _RUNNABLE.sub(_plain, markdown))
