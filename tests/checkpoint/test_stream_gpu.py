"""The load engine onto CUDA (stream.read_chunks_to_cuda through read_data): many windows, chunks read in
pieces by several threads, a file truncated under a load, a damaged piece, CRCs that cannot be combined.

Run on a GPU machine: pytest -m gpu tests/checkpoint
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.checkpoint import read_header, stream
from torchplace.checkpoint.format import open_for_read

pytestmark = pytest.mark.gpu
MiB = 2**20


def _state(dev: torch.device) -> dict[str, torch.Tensor]:
    """About 70 MiB in tensors of odd sizes, so tensors cross chunks, pieces and windows."""
    torch.manual_seed(0)
    sizes = [5_000_001, 3, 7_777_777, 1, 2_500_000, 1_234_567]
    return {f"t{i}": torch.randn(n, device=dev) for i, n in enumerate(sizes)} | {
        "half": torch.randn(3_333_333, device=dev).half(), "ints": torch.arange(999_999, device=dev)}


@pytest.fixture
def small_ring(monkeypatch):
    """A ring of 4 windows of 16 MiB and pieces of an odd size: the ring wraps several times in one load."""
    monkeypatch.setattr(stream, "WINDOW_BYTES", 16 * MiB)
    monkeypatch.setattr(stream, "RING_BYTES", 64 * MiB)
    monkeypatch.setattr(stream, "MIN_WINDOWS", 1)
    monkeypatch.setattr(stream, "TASK_BYTES", 3 * MiB + 4096 + 17)


@pytest.mark.parametrize("combine", [True, False])
def test_a_load_through_many_windows_and_pieces_gives_back_every_byte(tmp_path: Path, small_ring, monkeypatch,
                                                                      combine: bool) -> None:
    dev = torch.device("cuda", 0)
    state = _state(dev)
    path = torchplace.save(tmp_path / "c.safetensors", model=state, rng_state=False)
    if not combine:  # zlib's crc32 alone (no ISA-L): one task a chunk
        monkeypatch.setattr(stream, "crc32_combine", None)
        assert stream.task_bytes(16 * MiB) == 16 * MiB
    got = torchplace.load(path, device="cuda:0", restore_rng=False)["model"]
    assert set(got) == set(state) and all(got[k].device == dev and torch.equal(got[k], state[k]) for k in state)


def test_a_file_truncated_under_a_load_raises_and_returns_nothing(tmp_path: Path, small_ring) -> None:
    dev = torch.device("cuda", 0)
    path = torchplace.save(tmp_path / "c.safetensors", model=_state(dev), rng_state=False)
    fd = open_for_read(path)
    try:
        header = read_header(path, fd)  # the header is whole: the file is cut after it was checked
        out = stream.allocate(header, {e.key: dev for e in header.entries})
        os.truncate(path, header.data_offset + header.data_bytes // 2)
        with pytest.raises(torchplace.CheckpointError, match="ended early while reading"):
            stream.read_data(fd, header, out)
    finally:
        os.close(fd)
    with pytest.raises(torchplace.CheckpointError, match="truncated"):
        torchplace.load(path, device="cuda:0")


def test_a_flipped_bit_in_one_piece_of_a_chunk_is_caught(tmp_path: Path, small_ring) -> None:
    dev = torch.device("cuda", 0)
    path = torchplace.save(tmp_path / "c.safetensors", model=_state(dev), rng_state=False)
    header = read_header(path)
    at = 16 * MiB + 7 * MiB + 5  # chunk 1, in its third piece
    with open(path, "r+b") as f:
        f.seek(header.data_offset + at)
        byte = f.read(1)[0]
        f.seek(header.data_offset + at)
        f.write(bytes([byte ^ 0x20]))
    held = sorted(e.key for e in header.entries if e.start < 32 * MiB and e.end > 16 * MiB)
    with pytest.raises(torchplace.CheckpointError, match=f"data bytes {16 * MiB}-{32 * MiB} fail their checksum.*"
                                                           f"{held[0]}"):
        torchplace.load(path, device="cuda:0")
