"""Failed saves raise, leave the previous checkpoint untouched, and leave no partial files."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.checkpoint import atomic, convert, fileio
from torchplace.errors import CheckpointError


class FullDisk:
    """A file sink that writes through until BUDGET bytes, then fails like a full disk."""

    def __init__(self, fd: int, budget: int) -> None:
        self.inner = atomic.FileSink(fd)
        self.budget = budget

    def pwrite(self, data, offset: int) -> None:
        n = memoryview(data).nbytes
        if n > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= n
        self.inner.pwrite(data, offset)


def _tree(value: float, n: int = 50_000) -> dict:
    return {"model": {"w": torch.full((n,), value), "b": torch.full((7,), value)}, "extra": {"v": value}}


def _value(path: Path) -> float:
    ck = torchplace.load(path)
    w = ck["model"]["w"]
    assert torch.all(w == w[0]) and ck.extra["v"] == float(w[0])
    return float(w[0])


@pytest.mark.parametrize("budget", [0, 4096, 150_000, 200_028])
def test_a_full_disk_raises_and_keeps_the_old_checkpoint(tmp_path: Path, budget: int) -> None:
    path = fileio.write_file(tmp_path / "c.safetensors", _tree(1.0), info={})
    with pytest.raises(torchplace.CheckpointError, match=r"is full .*untouched.*Fix: free space"):
        fileio.write_file(path, _tree(2.0), info={}, sink=lambda fd: FullDisk(fd, budget))
    assert _value(path) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_a_full_tmpfs_raises_through_save(tiny_tmpfs: Path) -> None:
    small = torchplace.save(tiny_tmpfs / "c", model={"w": torch.full((1000,), 1.0)}, rng_state=False)
    with pytest.raises(torchplace.CheckpointError, match=r"could not save .*c: the file system .* is full.*ENOSPC"):
        torchplace.save(small, model={"w": torch.full((1_000_000,), 2.0)}, rng_state=False)  # 4 MB > 1 MiB
    assert float(torchplace.load(small)["model"]["w"][0]) == 1.0
    assert [p.name for p in tiny_tmpfs.iterdir()] == ["c"]


def test_a_read_only_directory_raises(readonly_dir: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match=r"(read-only file system|may not write in).*Fix:"):
        torchplace.save(readonly_dir / "c", extra={"a": 1})
    assert list(readonly_dir.iterdir()) == []


def test_temp_files_of_dead_processes_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead_proc = subprocess.Popen(["true"])
    dead_proc.wait()
    host = socket.gethostname()
    dead = tmp_path / f".c.safetensors.tmp-{host}-{dead_proc.pid}-0123abcd"
    live = tmp_path / f".c.safetensors.tmp-{host}-{os.getppid()}-0123abcd"
    other_host = tmp_path / f".c.safetensors.tmp-elsewhere-{dead_proc.pid}-0123abcd"
    for p in (dead, live, other_host):
        p.write_bytes(b"partial")
    torchplace.save(tmp_path / "c.safetensors", extra={"a": 1})
    assert not dead.exists() and live.exists() and other_host.exists()


def test_a_failing_writer_removes_its_temp_file(tmp_path: Path) -> None:
    def explode(sink) -> None:
        sink.pwrite(b"half a header", 0)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write(tmp_path / "c", explode)
    assert list(tmp_path.iterdir()) == []


def test_saving_onto_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match="is a directory. Fix: give a file path"):
        torchplace.save(tmp_path, extra={"a": 1})


def test_a_tilde_path_is_told_to_expand_not_to_make_a_folder_named_tilde(tmp_path: Path, monkeypatch) -> None:
    """save('~/ckpt/x.pt') said `Fix: os.makedirs('~/ckpt')`, which makes a folder named '~' here."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"Python does not expand it.*Fix: expand it first: os.path.expanduser"):
        torchplace.save("~/torchplace-no-such-dir/x.safetensors", extra={"a": 1})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_write_out_starts_through_the_real_sync_file_range_and_never_raises(tmp_path: Path) -> None:
    assert atomic._load_sync_file_range() is not False  # the hint is really there on Linux
    read, write = os.pipe()  # sync_file_range fails on a pipe (ESPIPE): a hint's failure is ignored
    try:
        atomic.start_writeback(write, 0, 4096)
    finally:
        os.close(read)
        os.close(write)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        atomic.FileSink(fd).pwrite(b"abc" * 1000, 10)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 10 + b"abc" * 1000


def test_a_special_file_is_never_replaced_by_a_save(tmp_path):
    """Saving onto a FIFO (or /dev/null, as root) would rename the checkpoint over it: refused, nothing written."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="FIFO.*not a regular file.*new file name"):
        torchplace.save(fifo, model=torch.nn.Linear(2, 2))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_convert_onto_its_own_input_is_refused(tmp_path):
    src = tmp_path / "a.safetensors"
    torchplace.save(src, model=torch.nn.Linear(2, 2))
    before = src.read_bytes()
    (tmp_path / "link.safetensors").symlink_to(src)
    for dst in (src, tmp_path / "link.safetensors"):
        with pytest.raises(CheckpointError, match="same file.*new name"):
            convert(src, dst)
    assert src.read_bytes() == before
