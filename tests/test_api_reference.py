"""The API reference covers every public name, each docstring says what, arguments, returns,
raises and shows an example, and every example runs.

docs/reference/api.md renders the docstrings (mkdocstrings); these tests keep the source of
that page complete. Examples run like the docs' runnable blocks (tests/test_docs.py): each in a
process of its own, forked from a server that has imported torch, in a fresh directory with
tests/fixtures linked, so an example may name `h200x2` as a
reader in the repository would.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import test_docs
from test_docs import Runner, base_env, prepare

import torchplace

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = ROOT / "docs" / "reference" / "api.md"
_EXAMPLE = re.compile(r"^Examples?:\n((?:\n|    .*\n)+)", re.MULTILINE)
_CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)
# records that torchplace constructs and hands back (the caller never builds one), and two functions that never raise
_NO_RAISES = {"Facts", "Runtime", "SaveFuture", "dist.DistInfo", "dist.HealthReport", "dist.StragglerReport",
              "dist.explain", "dist.teardown"}


def _public() -> dict[str, object]:
    found: dict[str, object] = {n: getattr(torchplace, n) for n in torchplace.__all__ if n != "dist"}
    found.update({f"dist.{n}": getattr(torchplace.dist, n) for n in torchplace.dist.__all__})
    return found


PUBLIC = _public()


def _examples(obj: object) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    found = _EXAMPLE.search(doc + "\n")
    if not found:
        return []
    section = "\n".join(line[4:] for line in found.group(1).splitlines())
    return _CODE.findall(section)


def _parameters(obj: object) -> list[str]:
    try:
        params = inspect.signature(obj).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    return [p for p in params if p not in ("self", "cls")]


def test_every_public_name_is_on_the_api_page():
    text = API_PAGE.read_text()
    missing = [n for n in torchplace.__all__ if n != "dist" and f"::: torchplace.{n}\n" not in text]
    missing += [f"dist.{n}" for n in torchplace.dist.__all__ if f"torchplace.dist.{n}" not in text
                and f"- {n}\n" not in text]
    assert not missing, f"add these to {API_PAGE.relative_to(ROOT)}: {missing}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_has_every_section(name: str):
    obj = PUBLIC[name]
    doc = inspect.getdoc(obj) or ""
    lacking = []
    if len(doc.splitlines()) < 3:
        lacking.append("a description beyond one line")
    if not _examples(obj):
        lacking.append("an Example: section with a ```python block")
    is_exception = isinstance(obj, type) and issubclass(obj, (BaseException, Warning))
    if not is_exception:
        described = "Args:" in doc or (isinstance(obj, type) and "Attributes:" in doc)
        if _parameters(obj) and not described:
            lacking.append("Args:")
        ret = inspect.signature(obj).return_annotation if callable(obj) and not isinstance(obj, type) else None
        if ret not in (None, "None", inspect.Signature.empty) and "Returns:" not in doc:
            lacking.append("Returns:")
        if name not in _NO_RAISES and "Raises:" not in doc:
            lacking.append("Raises:")
    assert not lacking, f"torchplace.{name}'s docstring lacks {', '.join(lacking)}"


runner = test_docs.runner  # the docs' block server fixture, one per module


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC if _examples(PUBLIC[n])))
def test_docstring_example_runs(name: str, runner: Runner, tmp_path: Path):
    prepare(tmp_path)
    env = base_env(tmp_path)
    for n, code in enumerate(_examples(PUBLIC[name])):
        path = tmp_path / f"example_{n}.py"
        path.write_text(code)
        rc, output, timed_out = runner.python(path, tmp_path, env, 60.0)
        assert rc == 0 and not timed_out, f"torchplace.{name}'s example exited {rc}:\n{code}\n---\n{output[-3000:]}"
