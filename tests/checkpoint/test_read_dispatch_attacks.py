"""`tp.load` on paths the read dispatcher (`reading.kind_of`) meets on a shared machine: a folder this user
may not enter, a series beside such a folder, a dangling symbolic link. Each is a CheckpointError that says
what is wrong with that path (never a PermissionError from deep in pathlib), and an unreadable folder does not
stop the series beside it from loading. Run as another uid through setpriv when the tests run as root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import torchplace as tp
from torchplace.errors import CheckpointError

AS_OTHER = os.geteuid() == 0 and shutil.which("setpriv") is not None
HANG_S = 150

LOADER = """
import json, sys, torch, torchplace as tp
try:
    tp.load(sys.argv[1], model=torch.nn.Linear(2, 2))
    print(json.dumps({"ok": True}))
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
"""


@pytest.fixture
def shared():
    base = Path(tempfile.mkdtemp(prefix="torchplace-dispatch-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def load_as_other(path: Path) -> dict:
    argv = [sys.executable, "-c", LOADER, str(path)]
    if AS_OTHER:
        argv = ["setpriv", "--reuid=65531", "--regid=65531", "--clear-groups", *argv]
    elif os.geteuid() == 0:
        pytest.skip("root reads every folder, and setpriv is missing")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def closed(shared):
    """A series folder beside a checkpoint folder no one but its owner may enter."""
    (shared / "closed").mkdir()
    tp.save(shared / "closed" / "ck.safetensors", model=torch.nn.Linear(2, 2))
    os.chmod(shared / "closed", 0o700)
    for path in shared.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() and path.name != "closed" else 0o644 if path.is_file() else 0o700)
    return shared


def test_a_folder_this_user_may_not_enter_is_named(closed):
    for path in (closed / "closed", closed / "closed" / "ck.safetensors"):
        said = load_as_other(path)
        assert said["type"] == "CheckpointError", said
        assert str(path) in said["message"] and "Fix:" in said["message"]


def test_an_unreadable_folder_does_not_stop_the_series_beside_it(closed):
    tp.save(closed / "step1.safetensors", model=torch.nn.Linear(2, 2))
    os.chmod(closed / "step1.safetensors", 0o644)
    assert load_as_other(closed) == {"ok": True}


def test_a_dangling_link_says_it_is_a_link_to_nothing(tmp_path):
    (tmp_path / "ck.pt").symlink_to(tmp_path / "gone.pt")
    with pytest.raises(CheckpointError, match=r"symbolic link to .*gone\.pt, which does not exist"):
        tp.load(tmp_path / "ck.pt")
