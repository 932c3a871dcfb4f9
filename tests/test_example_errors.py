"""examples/train.py given a wrong device or nothing to resume: one line that says why, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"


def _train(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), "--quick", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("why, args, says", [
    ("an unknown device", ["--device", "gpu"], "'gpu' names no device type PyTorch knows"),
    ("nothing saved yet", ["--device", "cpu", "--resume"], "holds no complete torchplace checkpoint"),
])
def test_a_user_mistake_is_one_line(why, args, says, tmp_path, child_env):
    empty = tmp_path / "ck"
    empty.mkdir()
    out = _train(*args, "--ckpt-dir", str(empty), env=child_env())
    assert out.returncode == 1, why
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and says in lines[0], out.stderr
