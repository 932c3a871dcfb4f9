"""safeio: a path that does not exist is answered with what does; one this user may not read, with its permissions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchplace as tp
from torchplace import safeio
from torchplace.errors import CheckpointError


def test_close_names_in_the_folder_are_offered(tmp_path):
    (tmp_path / "model.pt").touch()
    (tmp_path / "notes.txt").touch()
    said = safeio.missing(tmp_path / "modle.pt")
    assert said == f"{tmp_path / 'modle.pt'} does not exist. Close names in {tmp_path}: model.pt."


def test_without_a_close_name_the_folder_is_listed(tmp_path):
    for i in range(10):
        (tmp_path / f"run-{i}.tpck").touch()
    said = safeio.missing(tmp_path / "zzz")
    assert f"{tmp_path} holds: run-0.tpck, run-1.tpck," in said and "... (10 in all)." in said
    empty = tmp_path / "empty folder"
    empty.mkdir()
    assert safeio.missing(empty / "x.pt").endswith(f"{empty} holds: nothing.")


def test_a_missing_folder_names_the_nearest_that_exists(tmp_path):
    said = safeio.missing(tmp_path / "no" / "such" / "x.pt")
    assert f"its folder {tmp_path / 'no' / 'such'} does not exist (the nearest that does is {tmp_path})" in said


def test_a_quoted_tilde_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt.tpck").touch()
    said = safeio.missing("~/ckpt.tpck")
    assert "'~' is a shell's shorthand, expanded only when unquoted" in said
    assert f"{tmp_path / 'ckpt.tpck'} exists" in said


def test_load_and_the_cli_say_it(tmp_path, capsys):
    from torchplace.cli import main

    (tmp_path / "step-100.tpck").touch()
    with pytest.raises(CheckpointError, match="Close names in .*: step-100.tpck"):
        tp.load(tmp_path / "step-10.tpck", model=torch.nn.Linear(2, 2))
    assert main(["ckpt", "inspect", os.fspath(tmp_path / "step-10.tpck")]) == 2
    err = capsys.readouterr().err
    assert "step-10.tpck does not exist. Close names in" in err and "Traceback" not in err


_OPEN_AS_NOBODY = """
import sys
from torchplace import safeio
from torchplace.errors import CheckpointError
try:
    safeio.open_regular(sys.argv[1], CheckpointError, "Fix: check the path.")
except CheckpointError as exc:
    print(exc)
"""


def test_an_unreadable_file_is_named_as_a_permission_problem(tmp_path):
    """A file this user may not read gets a fix about permissions, not 'check the path' (new-user pass).
    Root reads any file, so as root the check runs in a child process of user 'nobody' (uid 65534)."""
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"x" * 16)
    if os.geteuid() != 0:
        path.chmod(0)
        with pytest.raises(CheckpointError, match=r"Permission denied: this user \(uid \d+\) may not read it\. "
                                                  r"Fix: check its permissions \(ls -l "):
            safeio.open_regular(path, CheckpointError, "Fix: check the path.")
        return
    path.chmod(0o600)
    tmp_path.chmod(0o755)
    src = Path(safeio.__file__).parents[1]
    try:
        run = subprocess.run([sys.executable, "-c", _OPEN_AS_NOBODY, str(path)], capture_output=True, text=True,
                             timeout=120, user=65534, env={**os.environ, "PYTHONPATH": str(src)})
    except PermissionError:  # e.g. this Python lives under /root, which user nobody may not enter
        pytest.skip(f"user nobody may not run {sys.executable} here")
    if run.returncode != 0:
        pytest.skip(f"a process of user nobody cannot import torchplace here: {run.stderr[-300:]}")
    assert "Permission denied: this user (uid 65534) may not read it. Fix: check its permissions (ls -l " in run.stdout
    assert "check the path" not in run.stdout
