"""Checkpoint folders that change under a run, and what resuming from an odd folder tells the user:
a folder replaced by a file, a per-process file size limit, symlinked and unicode paths, a newer
torchplace's checkpoint, another model's checkpoint, a torn newest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace
from torchplace.checkpoint import fileio


def test_a_folder_replaced_by_a_file_during_the_run_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    torchplace.save(run / "a.safetensors", model={"w": torch.ones(2)}, keep_last=2)
    link = tmp_path / "ckpt"
    link.symlink_to(run)
    for child in run.iterdir():
        child.unlink()
    run.rmdir()
    run.write_text("not a folder")  # it used to be reported as "latest is not a pointer (Not a directory)"
    with pytest.raises(torchplace.CheckpointError, match=r"ckpt is not a directory \(a file is there.*Fix: move that"):
        torchplace.save(link / "b.safetensors", model={"w": torch.ones(2)}, keep_last=2)
    assert run.read_text() == "not a folder"


def test_a_file_size_limit_reached_during_a_save_is_named_and_keeps_the_previous(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import resource, torch, torchplace
        torchplace.save("a.safetensors", model={"w": torch.zeros(4)}, keep_last=2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
        for save in (torchplace.save, lambda *a, **k: torchplace.save_async(*a, **k).result()):
            try:
                save("b.safetensors", model={"w": torch.zeros(1_000_000)}, keep_last=2)
            except torchplace.CheckpointError as exc:
                print(exc)
    """)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("past the largest this process may write (ulimit -f, RLIMIT_FSIZE)") == 2, out.stdout
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["a.safetensors", "latest"]
    assert torchplace.load(tmp_path).path.name == "a.safetensors"


def test_a_symlinked_unicode_folder_with_spaces_rotates_and_resumes_through_the_link(tmp_path: Path) -> None:
    real = tmp_path / "exp ü 1"
    real.mkdir()
    link = tmp_path / "current run"
    link.symlink_to(real.name)
    for step in range(3):
        torchplace.save(link / f"step {step} é.safetensors", model={"w": torch.full((2,), float(step))}, keep_last=2)
    assert sorted(os.listdir(real)) == ["latest", "step 1 é.safetensors", "step 2 é.safetensors"]
    for where in (link, link / "latest", real):
        assert torchplace.load(where)["model"]["w"][0] == 2.0


def _newer_torchplace_save(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:  # a file exactly as a torchplace writing format 2 would, checksums and all
        m.setattr(fileio, "FORMAT_VERSION", 2)
        torchplace.save(path, model={"w": torch.ones(2)}, keep_last=3)


def test_a_newer_torchplace_s_checkpoint_in_the_folder_stops_resuming(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # it used to be skipped as if damaged, and resuming silently went back to the older checkpoint
    torchplace.save(tmp_path / "step-1.safetensors", model={"w": torch.zeros(2)}, keep_last=3)
    _newer_torchplace_save(tmp_path / "step-2.safetensors", monkeypatch)
    want = (r"holds step-2.safetensors, which a newer torchplace wrote: .*format 2; this torchplace reads up to 1\."
            r".* \(step-1.safetensors is the newest it can read\).*Fix: upgrade torchplace")
    with pytest.raises(torchplace.errors.CheckpointFormatError, match=want):
        torchplace.load(tmp_path)
    with pytest.raises(torchplace.CheckpointError, match=want):  # setup(resume=) at a job's start says the same
        torchplace.setup("cpu", threads=None, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert torchplace.load(tmp_path / "step-1.safetensors")["model"]["w"].sum() == 0  # by name, on purpose
    with pytest.raises(torchplace.errors.CheckpointFormatError, match="step-2.safetensors uses torchplace checkpoint "
                                                                       "format 2.*Fix: upgrade torchplace"):
        torchplace.load(tmp_path / "step-2.safetensors")


def test_resuming_with_a_different_model_names_the_shapes_and_leaves_the_model(tmp_path: Path) -> None:
    torchplace.save(tmp_path / "step-1.safetensors", model=nn.Linear(4, 2), keep_last=2)
    rt = torchplace.setup("cpu", threads=None, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert rt.resume_from == tmp_path / "step-1.safetensors"
    other = nn.Linear(8, 2)
    before = other.weight.detach().clone()
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)step-1.safetensors: the weights do not fit Linear"
                                                         r".*left as it was.*weight saved \[2, 4\], model \[2, 8\]"):
        rt.resume(other)
    assert torch.equal(other.weight, before)


def test_resuming_from_a_folder_whose_newest_is_torn_continues_from_the_one_before(tmp_path: Path) -> None:
    for step in (1, 2):
        torchplace.save(tmp_path / f"step-{step}.safetensors", model={"w": torch.full((1000,), float(step))},
                        extra={"step": step}, keep_last=3)
    newest = tmp_path / "step-2.safetensors"
    os.truncate(newest, newest.stat().st_size - 100)  # a copy cut short by a full disk, outside torchplace
    with pytest.warns(torchplace.TorchplaceWarning, match="passed over step-2.safetensors.*picked step-1"):
        rt = torchplace.setup("cpu", threads=None, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert rt.resume_from == tmp_path / "step-1.safetensors"
    assert rt.resume() is not None
    with pytest.warns(torchplace.TorchplaceWarning, match="passed over step-2.safetensors.*loaded step-1"):
        assert torchplace.load(tmp_path).extra == {"step": 1}


@pytest.mark.parametrize("keep_last", [None, 3])
def test_saving_into_a_symlink_loop_names_the_loop(tmp_path: Path, keep_last: int | None) -> None:
    """With keep_last the series lock's open raised a bare OSError (ELOOP), then `latest` was blamed."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(torchplace.CheckpointError, match=r"loop is a symbolic link that leads back to itself.*Fix: "
                                                         r"point the link at a real directory") as info:
        torchplace.save(loop / "step-1.safetensors", model={"w": torch.zeros(2)}, keep_last=keep_last)
    assert "latest" not in str(info.value)
    with pytest.raises(torchplace.CheckpointError, match="Too many levels of symbolic links.*Fix:"):
        torchplace.load(loop)


def test_a_fifo_named_like_a_checkpoint_blocks_neither_load_nor_rotation(tmp_path: Path) -> None:
    torchplace.save(tmp_path / "step-1.safetensors", model={"w": torch.zeros(2)}, keep_last=2)
    os.mkfifo(tmp_path / "step-9.safetensors")
    assert torchplace.load(tmp_path)["model"]["w"].sum() == 0
    torchplace.save(tmp_path / "step-2.safetensors", model={"w": torch.ones(2)}, keep_last=2)
    assert torchplace.load(tmp_path)["model"]["w"].sum() == 2
    assert (tmp_path / "step-9.safetensors").exists()  # not ours: never rotated away
