"""docs/reference/cli.md is what tools/cli_reference.py makes from the parsers, and names every option."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from torchplace.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= _options(child)
        elif action.help != argparse.SUPPRESS:
            found.update(action.option_strings)
    return found


def test_cli_page_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "cli_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_cli_page_names_every_documented_option():
    text = PAGE.read_text()
    missing = sorted(o for o in _options(build_parser()) if f"`{o}`" not in text)
    assert not missing, missing
    for option in ("--trust-pickle", "--plot", "--no-gpu-names", "--prefetch"):  # issue 18: on no page before
        assert f"`{option}`" in text


def test_stale_page_is_reported(tmp_path: Path, capsys):
    """The check fails, names the fix and shows the difference when the page and the parsers disagree."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import cli_reference
    finally:
        sys.path.remove(str(ROOT / "tools"))
    page = tmp_path / "cli.md"
    page.write_text(cli_reference.render().replace("`--trust-pickle`", "`--trust-pickles`", 1))
    old = cli_reference.PAGE
    cli_reference.PAGE, cli_reference.ROOT = page, tmp_path
    try:
        assert cli_reference.main(["--check"]) == 1
    finally:
        cli_reference.PAGE, cli_reference.ROOT = old, ROOT
    said = capsys.readouterr().err
    assert "run `python tools/cli_reference.py`" in said and "+| `--trust-pickle`" in said
