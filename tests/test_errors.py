"""errors.py holds every error and warning torchplace defines, in two trees, and old import paths still work."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torchplace
from torchplace import errors

SRC = Path(torchplace.__file__).parent


def _classes() -> list[type]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]


def test_every_class_is_under_one_root():
    for cls in _classes():
        root = errors.TorchplaceWarning if issubclass(cls, Warning) else errors.TorchplaceError
        assert issubclass(cls, root), cls
        assert cls.__name__ in errors.__doc__, f"{cls.__name__} is missing from the tree in errors.py's docstring"


def test_no_error_or_warning_class_is_defined_elsewhere():
    """Internal control-flow exceptions that never leave their package (UsageError, StateError) are the exceptions."""
    allowed = {"UsageError", "StateError"}
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "errors.py" or "_corpus" in path.parts:  # the corpus: user programs, with their own classes
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Warning")) and node.name not in allowed:
                found.append(f"{path.relative_to(SRC)}: {node.name}")
    assert not found


def test_old_import_paths_still_work():
    from torchplace.checks import StrictWarning
    from torchplace.memory import MemoryLeakError, MemoryLeakWarning
    from torchplace.placement.scope import DeviceLeakWarning
    from torchplace.policy.precision import PrecisionError, PrecisionWarning

    assert {StrictWarning, MemoryLeakError, MemoryLeakWarning, DeviceLeakWarning, PrecisionError,
            PrecisionWarning} <= set(_classes())
    assert torchplace.TorchplaceWarning is errors.TorchplaceWarning
