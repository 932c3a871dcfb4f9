"""The chunked copy between tensors and a staging buffer that saves and loads of GPU tensors use."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from torchplace.checkpoint import stream
from torchplace.checkpoint.format import plan_layout
from torchplace.shared.staging import ThreadStaging


def test_pieces_round_trip_through_the_staging_buffer_across_chunk_boundaries():
    tensors = {"a": torch.randn(1000), "b": torch.arange(37, dtype=torch.int16), "c": torch.randn(3, 300).double()}
    entries = plan_layout(tensors)
    data_bytes, chunk = entries[-1].end, 1024  # tensors cut across several chunks
    flat = {e.key: stream.byte_view(tensors[e.key]) for e in entries}
    out = {k: torch.zeros_like(t) for k, t in tensors.items()}
    flat_out = {e.key: stream.byte_view(out[e.key]) for e in entries}
    staging = ThreadStaging(chunk, pinned=False)
    image = torch.zeros(data_bytes, dtype=torch.uint8)  # what the file would hold
    chunks = list(stream._chunks(entries, data_bytes, chunk))
    assert len(chunks) > 5
    for _, c0, c1, pieces in chunks:
        buf = staging.buffer()
        assert stream._copy_pieces(pieces, flat, buf, staging, into_buffer=True) == set()  # no CUDA streams
        image[c0:c1] = buf[:c1 - c0]
    for e in entries:  # the image is each tensor's bytes at its offset
        assert torch.equal(image[e.start:e.end], flat[e.key])
    for _, c0, c1, pieces in chunks:
        buf = staging.buffer()
        buf[:c1 - c0] = image[c0:c1]
        stream._copy_pieces(pieces, flat_out, buf, staging, into_buffer=False)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def _image_and_chunks(tensors: dict[str, torch.Tensor], chunk: int):
    entries = plan_layout(tensors)
    data_bytes = entries[-1].end
    image = torch.zeros(data_bytes, dtype=torch.uint8)
    for e in entries:
        image[e.start:e.end] = stream.byte_view(tensors[e.key])
    return entries, image, list(stream._chunks(entries, data_bytes, chunk))


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_windowed_load_fills_every_tensor_across_windows_and_chunks(monkeypatch, buffers):
    """The CUDA load's windows (stream.read_chunks_to_cuda), run with CPU tensors: tensors cut across chunks and
    windows, a window smaller than a tensor, a last window shorter than the others, rings of 2-4 windows."""
    monkeypatch.setattr(stream, "BUFFERS", buffers)
    tensors = {"a": torch.randn(1000), "b": torch.arange(37, dtype=torch.int16), "c": torch.randn(3, 300).double(),
               "d": torch.randn(5000)}
    chunk = 1024
    entries, image, chunks = _image_and_chunks(tensors, chunk)
    monkeypatch.setattr(stream, "WINDOW_BYTES", 3 * chunk)
    out = {k: torch.zeros_like(t) for k, t in tensors.items()}
    flat = {e.key: stream.byte_view(out[e.key]) for e in entries}
    read = []

    def read_chunk(c, view):
        _, c0, c1, _ = c
        view[:] = image[c0:c1].numpy()
        read.append(c0)

    stream.read_chunks_to_cuda(flat, entries, chunks, chunk, 3, read_chunk)
    assert sorted(read) == [c[1] for c in chunks]  # each chunk read once
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_windowed_load_raises_a_readers_error_and_stops(monkeypatch):
    """A damaged chunk raises its error, and the reads of the windows after it that have not started
    are never started (one reader thread, busy with the chunk after the damaged one meanwhile)."""
    import threading

    from torchplace.errors import CheckpointError

    tensors = {"a": torch.randn(4000)}
    entries, image, chunks = _image_and_chunks(tensors, 1024)
    monkeypatch.setattr(stream, "WINDOW_BYTES", 2 * 1024)  # two chunks a window
    flat = {"a": stream.byte_view(torch.zeros(4000))}
    read: list[int] = []
    caller = threading.get_ident()

    def caller_waits_for_the_readers() -> bool:
        """The calling thread has handled the failure (cancelled what had not started) and waits in the
        reader pool's shutdown for this read to end."""
        frame = sys._current_frames().get(caller)
        while frame is not None and frame.f_code.co_name != "shutdown":
            frame = frame.f_back
        return frame is not None

    def read_chunk(c, view):
        read.append(c[0])
        if c[0] == 2:
            raise CheckpointError("chunk 2 is damaged")
        if c[0] == 3:  # keeps the one reader busy while the failure is handled (the bound: a hang)
            deadline = time.monotonic() + 120
            while not caller_waits_for_the_readers() and time.monotonic() < deadline:
                time.sleep(0.01)
        view[:] = image[c[1]:c[2]].numpy()

    with pytest.raises(CheckpointError, match="chunk 2"):
        stream.read_chunks_to_cuda(flat, entries, chunks, 1024, 1, read_chunk)
    assert sorted(read) == [0, 1, 2, 3]  # window 2 (chunks 4 and 5) was queued, and cancelled
