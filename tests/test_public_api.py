"""The public namespace: one sorted __all__, every name resolves, importing it stays cheap."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import torchplace


def test_all_is_sorted_and_every_name_resolves():
    assert torchplace.__all__ == sorted(torchplace.__all__)
    for name in torchplace.__all__:
        assert getattr(torchplace, name) is not None, name


def test_errors_form_one_tree():
    for name in [n for n in torchplace.__all__ if n.endswith("Error")]:
        assert issubclass(getattr(torchplace, name), torchplace.TorchplaceError), name


def test_import_does_not_import_torch():
    code = "import sys, torchplace; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_unknown_attribute_is_an_attribute_error():
    try:
        torchplace.nope  # noqa: B018
    except AttributeError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def _static_names() -> dict[str, str]:
    """name -> module, from the imports under `if _typing.TYPE_CHECKING:` in torchplace/__init__.py."""
    tree = ast.parse(Path(torchplace.__file__).read_text())
    blocks = [node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
              and not isinstance(node.test, ast.UnaryOp)]
    assert len(blocks) == 1, "one TYPE_CHECKING block of imports"
    names = {}
    for stmt in blocks[0].body:
        assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1, ast.unparse(stmt)
        for alias in stmt.names:
            names[alias.asname or alias.name] = f"torchplace.{stmt.module}" + (
                f".{alias.name}" if alias.asname else "")
    return names


def test_static_names_match_the_run_time_table():
    static = _static_names()
    table = {**torchplace._EXPORTS, **torchplace._SUBMODULES}
    assert sorted(static) == sorted(table) == torchplace.__all__
    for name, where in static.items():
        if name in torchplace._SUBMODULES:
            assert where == table[name], name  # `from .distributed import group as dist`
        else:
            obj = getattr(importlib.import_module(where), name)
            assert obj is getattr(torchplace, name), f"{name}: the checker sees {where}.{name}"


def test_dir_lists_each_public_name_once_and_no_helpers():
    torchplace.device  # noqa: B018  (a loaded name must not appear twice)
    listed = dir(torchplace)
    assert len(listed) == len(set(listed))
    public = [n for n in listed if not n.startswith("_")]
    assert public == torchplace.__all__
    assert "__version__" in listed


def test_type_checkers_do_not_see_getattr():
    """A module-level __getattr__ visible to mypy makes every misspelt name type-check as Any."""
    tree = ast.parse(Path(torchplace.__file__).read_text())
    top_level = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert "__getattr__" not in top_level
