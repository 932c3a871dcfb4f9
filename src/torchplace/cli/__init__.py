"""The `torchplace` command: parse, call the library, render. Nothing else lives here.

Each subcommand is a module in this package with `register(subparsers)`; heavy imports
(torch above all) happen inside the command, not at parse time, so `doctor` and `map` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# subcommand -> module; each module defines register(subparsers) -> None
COMMANDS: dict[str, str] = {
    "doctor": "torchplace.cli.doctor",
    "map": "torchplace.cli.map",
    "pick": "torchplace.cli.pick",
    "leases": "torchplace.cli.leases",
    "run": "torchplace.cli.run",
    "ckpt": "torchplace.cli.ckpt",
    "bench": "torchplace.cli.bench",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand is imported (keeps `pick` under 100 ms)."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="torchplace", description="Know where every tensor lives.")
    parser.add_argument("--version", action="version", version=f"torchplace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module in wanted:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from ..errors import TorchplaceError

    try:
        return int(args.func(args) or 0)
    except TorchplaceError as exc:
        print(f"torchplace: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
