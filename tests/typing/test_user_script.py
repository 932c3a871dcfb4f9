"""Types reach users: a newcomer's script passes `mypy --strict` with no Any from torchplace.

One mypy run reads two files: tests/typing/user_script.py (a training script written against the
public names, with `reveal_type` notes on what torchplace hands back) and a file written here that
reveals every name in `torchplace.__all__` and misspells one. Imports are followed silently, so
only these two files are judged; torchplace's own modules are checked by `make test`'s mypy run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchplace

pytest.importorskip("mypy")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "user_script.py"


@pytest.fixture(scope="module")
def mypy_notes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str, str]]]:
    names = tmp_path_factory.mktemp("typing") / "every_name.py"
    lines = ["import torchplace as tp", *(f"reveal_type(tp.{n})" for n in torchplace.__all__),
             "tp.not_a_real_name(1)"]
    names.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                          "--no-error-summary", "--cache-dir", str(ROOT / ".mypy_cache"),
                          str(SCRIPT), str(names)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    found: dict[str, list[tuple[int, str, str]]] = {"script": [], "names": []}
    for line in out.stdout.splitlines():
        m = re.match(r"(.+?):(\d+): (error|note): (.*)", line)
        assert m, f"unexpected mypy output: {line}\n{out.stderr}"
        key = "script" if Path(m[1]).name == SCRIPT.name else "names"
        found[key].append((int(m[2]), m[3], m[4]))
    return found


def test_user_script_passes_mypy_strict(mypy_notes):
    errors = [n for n in mypy_notes["script"] if n[1] == "error"]
    assert not errors, errors


def test_nothing_the_script_gets_from_torchplace_is_any(mypy_notes):
    revealed = [text for _, kind, text in mypy_notes["script"] if text.startswith("Revealed type")]
    assert len(revealed) >= 12
    assert not [t for t in revealed if re.search(r"\bAny\b", t)], revealed


def test_every_public_name_returns_a_real_type(mypy_notes):
    revealed = [text for _, kind, text in mypy_notes["names"] if text.startswith("Revealed type")]
    assert len(revealed) == len(torchplace.__all__)
    returns = [t.rsplit("->", 1)[-1] for t in revealed]  # arguments may take anything; results may not
    assert not [t for t in returns if re.search(r"\bAny\b", t)], revealed


def test_a_misspelt_name_fails_type_checking(mypy_notes):
    errors = [text for _, kind, text in mypy_notes["names"] if kind == "error"]
    assert errors == ['Module has no attribute "not_a_real_name"  [attr-defined]'], errors


def test_user_script_runs_on_the_cpu(child_env):
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300,
                         env=child_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cpu "), out.stdout
