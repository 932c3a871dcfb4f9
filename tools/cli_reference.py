"""Write docs/reference/cli.md from the `torchplace` command's argparse parsers.

    python tools/cli_reference.py            # rewrite docs/reference/cli.md
    python tools/cli_reference.py --check    # exit 1 if the committed page differs from the parsers

Walks `torchplace.cli.build_parser()`: every command and subcommand gets its usage, its
description and a table of its options (flags, value, default, help). Suppressed options are
left out, as `--help` leaves them out. The page depends on nothing but the parsers: usage lines
are built here rather than by argparse's formatter (whose output changes with the terminal
width and the Python version), and a default that names a path inside this checkout is written
relative to the repository root. tests/test_cli_reference.py runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"
sys.path.insert(0, str(ROOT / "src"))

HEADER = """# CLI reference

Every `torchplace` command and option, generated from the command's own parsers by
`tools/cli_reference.py` (do not edit by hand: run `python tools/cli_reference.py` after
changing an option; `make test` fails while this page is stale). The pages in the left column
show the commands at work: [doctor](../doctor.md), [map and pick](../choosing-gpus.md),
[run and leases](../distributed.md), [ckpt](../checkpoints.md), and every `bench` run in
[results](../results/README.md).

Exit codes: 0 success; 1 a finding of severity error (`doctor`, `map`) or stdout closed by its
reader; 2 a usage error or a failure, printed as one line with its fix; 70 a bug in torchplace
(rerun with `TORCHPLACE_DEBUG=1` for the traceback); 130 interrupted; `run` returns its command's
exit code (127 when the command is not found).
"""


def _text(value: str) -> str:
    """One line, with the checkout's own path made relative and table pipes escaped."""
    text = " ".join(value.split()).replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
    return text.replace("|", "\\|")


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)]


def _value(action: argparse.Action) -> str:
    """The value an option takes, as --help names it ('' for a flag)."""
    if action.nargs == 0:
        return ""
    name = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if isinstance(name, tuple):
        name = " ".join(name)
    if action.nargs in ("*", argparse.REMAINDER):
        return f"[{name} ...]"
    if action.nargs == "+":
        return f"{name} [...]"
    if action.nargs == "?":
        return f"[{name}]"
    return str(name)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.required:
        return ""
    return f"`{_text(str(action.default))}`"


def _help(action: argparse.Action, prog: str) -> str:
    if not action.help:
        return ""
    formatter = argparse.HelpFormatter(prog)
    return _text(formatter._expand_help(action))  # fills %(default)s the way --help does


def _usage(prog: str, parser: argparse.ArgumentParser) -> str:
    words = [prog]
    if any(a.option_strings for a in _shown(parser)):
        words.append("[options]")
    sub = _subparsers(parser)
    if sub is not None:
        words.append("COMMAND")
    for action in _shown(parser):
        if not action.option_strings:
            value = _value(action)
            words.append("-- " + value if action.nargs == argparse.REMAINDER else value)
    return " ".join(words)


def _section(prog: str, parser: argparse.ArgumentParser, summary: str, depth: int, out: list[str]) -> None:
    out.append(f"{'#' * depth} `{prog}`\n")
    for text in (summary, parser.description):
        if text and _text(text) not in out[-1]:
            out.append(_text(text).replace("\\|", "|") + "\n")
    out.append(f"```text\n{_usage(prog, parser)}\n```\n")
    rows = []
    for action in _shown(parser):
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{_value(action)}`"
        value = f"`{_value(action)}`" if action.option_strings and _value(action) else ""
        rows.append(f"| {names} | {value} | {_default(action)} | {_help(action, prog)} |")
    if rows:
        out.append("| option | value | default | what it does |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    seen: set[int] = set()
    children = []
    for name, child in sub.choices.items():
        if id(child) not in seen:
            seen.add(id(child))
            children.append((name, child))
    out.append("| command | what it does |\n|---|---|\n"
               + "\n".join(f"| [`{name}`](#{_anchor(f'{prog} {name}')}) | {_text(helps.get(name, ''))} |"
                           for name, _ in children) + "\n")
    for name, child in children:
        _section(f"{prog} {name}", child, helps.get(name, ""), depth + 1, out)


def _anchor(title: str) -> str:
    """The id that Markdown's toc extension gives a heading `title` (in backticks)."""
    return "-".join(title.lower().replace("`", "").split())


def render() -> str:
    from torchplace.cli import build_parser

    out = [HEADER]
    _section("torchplace", build_parser(), "", 2, out)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current == text:
            return 0
        diff = "".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                            str(PAGE.relative_to(ROOT)), "from the parsers", n=1))
        print(f"{PAGE.relative_to(ROOT)} is stale; run `python tools/cli_reference.py` to rewrite it.\n{diff}",
              file=sys.stderr)
        return 1
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
