"""The options several commands share (--json, --snapshot), the JSON that --json prints, and the
escaping of control characters in anything a command prints (`visible`).

One home, so every command spells them alike and prints JSON in one layout. Imports only the
standard library: `pick` starts in under 100 ms.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any


def add_json(parser: argparse.ArgumentParser, text: str = "print JSON") -> None:
    """--json: print the command's result as JSON (`print_json`) instead of tables."""
    parser.add_argument("--json", action="store_true", help=text)


def add_snapshot(parser: argparse.ArgumentParser, text: str) -> None:
    """--snapshot FILE|NAME: a captured snapshot (`torchplace doctor --json`), or a reference one shipped
    with torchplace by name (h200x1, h200x2, h200x2-nvlink), instead of this machine."""
    parser.add_argument("--snapshot", metavar="FILE|NAME",
                        help=f"{text}: a file from `torchplace doctor --json`, or a reference machine shipped with "
                             f"torchplace by name (h200x2; an unknown name lists them)")


def print_json(data: Any, *, default: Callable[[Any], Any] | None = None) -> None:
    """Print `data` as the commands' JSON: indented by one space; `default` as in json.dumps."""
    print(json.dumps(data, indent=1, default=default))


# C0 and C1 control characters but newline and tab, and the bidirectional overrides and isolates
# (text that reads backwards): shown as escapes, never sent to a terminal as they are
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def has_controls(text: str) -> bool:
    """True when TEXT holds a character `visible` escapes."""
    return _CONTROLS.search(text) is not None


def visible(text: str) -> str:
    """TEXT with every control character written as an escape (ESC as \\x1b): text from files made
    elsewhere (GPU names, tensor keys) is printed, never obeyed by the terminal."""
    return _CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
