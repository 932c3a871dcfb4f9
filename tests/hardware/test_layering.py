"""hardware/ is the bottom layer: it imports nothing above it, and importing it stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torchplace

HARDWARE = Path(torchplace.__file__).parent / "hardware"
ABOVE = ("placement", "checks", "checkpoint", "distributed", "policy", "memory", "cli", "doctor", "bench",
         "runtime", "amp")
LEAVES = {"torchplace", "torchplace.errors", "torchplace.safeio", "torchplace.units", "torchplace._version"}


def _imports(path: Path) -> list[str]:
    """Absolute names of the torchplace modules a hardware module imports (relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:  # hardware/x.py: "." is torchplace.hardware, ".." is torchplace
                base = ".".join(["torchplace", "hardware"][:3 - node.level] + ([node.module] if node.module else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [name for name in out if name.startswith("torchplace")]


def test_hardware_imports_nothing_above_it():
    found = [f"{path.name} imports {name}" for path in sorted(HARDWARE.glob("*.py")) for name in _imports(path)
             if name.split(".")[1:2] and name.split(".")[1] in ABOVE]
    assert not found


def test_importing_hardware_loads_no_other_package_and_no_torch():
    names = " ".join(f"torchplace.hardware.{p.stem}" for p in sorted(HARDWARE.glob("*.py")))
    code = (f"import sys, importlib; [importlib.import_module(n) for n in {names.split()!r}]; "
            "print(sorted(m for m in sys.modules if m.startswith('torchplace') and not "
            "m.startswith('torchplace.hardware')), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, torch_loaded = out.stdout.rsplit(" ", 1)
    assert set(ast.literal_eval(loaded)) <= LEAVES, loaded
    assert torch_loaded.strip() == "False"
