"""safeio: a path that does not exist is answered with what does; one this user may not read, with its permissions."""

from __future__ import annotations

import os

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


def test_a_name_with_spaces_around_it_is_quoted(tmp_path):
    """`torchplace ckpt inspect ' model.pt'` said 'model.pt does not exist. Close names: model.pt'."""
    (tmp_path / "model.pt").touch()
    (tmp_path / "model.pt\n").touch()
    said = safeio.missing(tmp_path / " model.pt")
    assert said.startswith(repr(str(tmp_path / " model.pt")) + " does not exist.") and "'model.pt\\n'" in said


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


def test_an_unreadable_file_is_named_as_a_permission_problem(tmp_path):
    """A file this user may not read gets a fix about permissions, not 'check the path' (new-user pass).
    Root reads any file, so as root the open runs with the effective uid of user nobody (65534)."""
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"x" * 16)
    path.chmod(0)
    as_root = os.geteuid() == 0
    if as_root:
        os.seteuid(65534)
    try:
        with pytest.raises(CheckpointError, match=r"Permission denied: this user \(uid \d+\) may not read it\. "
                                                  r"Fix: check its permissions \(ls -l ") as info:
            safeio.open_regular(path, CheckpointError, "Fix: check the path.")
    finally:
        if as_root:
            os.seteuid(0)
    assert "check the path" not in str(info.value)


def test_a_huge_folder_is_read_only_so_far(tmp_path, monkeypatch):
    """A missing file in a dataset folder of millions of names is answered without reading them all:
    at most MISSING_SCAN names are read and compared."""
    monkeypatch.setattr(safeio, "MISSING_SCAN", 50)
    for i in range(120):
        (tmp_path / f"img{i:05d}.png").touch()
    said = safeio.missing(tmp_path / "zzz.ckpt")
    assert said.endswith("(more than 50 in all).") and said.count(", ") == 8
    assert "of the first 50 names read" in safeio.missing(tmp_path / "img00007.pn")
