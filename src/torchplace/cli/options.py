"""The options several commands share (--json, --snapshot) and the JSON that --json prints.

One home, so every command spells them alike and prints JSON in one layout. Imports only the
standard library: `pick` starts in under 100 ms.
"""

from __future__ import annotations

import argparse
import json
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
