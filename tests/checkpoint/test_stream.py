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


def _reader(image: torch.Tensor, read: list[int]):
    """read_piece for read_chunks_to_cuda over IMAGE (the data region): copies the bytes, returns their CRC."""
    def read_piece(at, view):
        view[:] = image[at:at + len(view)].numpy()
        read.append(at)
        return stream.crc32(view)

    return read_piece


def _checker(image: torch.Tensor, checked: list[int]):
    """check for read_chunks_to_cuda: the combined CRC must be the chunk's own."""
    def check(c, crc):
        assert crc == stream.crc32(image[c[1]:c[2]].numpy()), f"chunk {c[0]}"
        checked.append(c[0])

    return check


@pytest.mark.parametrize(("ring", "task"), [(2, 1024), (3, 1024), (4, 1024), (2, 300), (3, 512)])
def test_windowed_load_fills_every_tensor_across_windows_and_chunks(monkeypatch, ring, task):
    """The CUDA load's windows (stream.read_chunks_to_cuda), run with CPU tensors: tensors cut across chunks and
    windows, a window smaller than a tensor, a last window shorter than the others, rings of 2-4 windows, chunks
    read in pieces by several tasks (their CRCs combined) or whole."""
    chunk = 1024
    monkeypatch.setattr(stream, "WINDOW_BYTES", 3 * chunk)
    monkeypatch.setattr(stream, "RING_BYTES", ring * 3 * chunk)
    monkeypatch.setattr(stream, "MIN_WINDOWS", 1)
    monkeypatch.setattr(stream, "TASK_BYTES", task)
    tensors = {"a": torch.randn(1000), "b": torch.arange(37, dtype=torch.int16), "c": torch.randn(3, 300).double(),
               "d": torch.randn(5000)}
    entries, image, chunks = _image_and_chunks(tensors, chunk)
    out = {k: torch.zeros_like(t) for k, t in tensors.items()}
    flat = {e.key: stream.byte_view(out[e.key]) for e in entries}
    read: list[int] = []
    checked: list[int] = []
    stream.read_chunks_to_cuda(flat, entries, chunks, chunk, 3, _reader(image, read), _checker(image, checked))
    step = stream.task_bytes(chunk)
    assert sorted(read) == [at for _, c0, c1, _ in chunks for at in range(c0, c1, step)]  # each piece read once
    assert checked == [c[0] for c in chunks]  # every chunk checked, in order
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_a_small_load_is_cut_in_many_windows_and_a_big_one_in_the_largest():
    """The ring's shape: a load smaller than the ring in at least MIN_WINDOWS windows (all in the ring at once),
    a big one in windows of WINDOW_BYTES, as many as RING_BYTES holds."""
    chunk = 16 * 2**20
    per_window, nbuf = stream._ring(237 * 2**20, chunk)
    assert per_window * chunk <= 237 * 2**20 // stream.MIN_WINDOWS + chunk and nbuf * per_window * chunk >= 237 * 2**20
    per_window, nbuf = stream._ring(10 * 2**30, chunk)
    assert (per_window * chunk, nbuf) == (stream.WINDOW_BYTES, stream.RING_BYTES // stream.WINDOW_BYTES)


def test_the_crc_of_pieces_combines_to_the_crc_of_the_whole():
    """A chunk read in pieces by several tasks is checked against the CRC-32 of the whole chunk."""
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8).numpy()
    for step in (10_000, 4096, 1000, 333):
        if step < len(data) and stream.crc32_combine is None:
            continue
        crcs = [stream.crc32(data[at:at + step]) for at in range(0, len(data), step)]
        assert stream._combined(crcs, len(data), step) == stream.crc32(data)


def test_windowed_load_raises_a_readers_error_and_stops(monkeypatch):
    """A damaged chunk raises its error, and the reads of the windows after it that have not started
    are never started (one reader thread, busy with the chunk after the damaged one meanwhile)."""
    import threading

    from torchplace.errors import CheckpointError

    tensors = {"a": torch.randn(4000)}
    entries, image, chunks = _image_and_chunks(tensors, 1024)
    monkeypatch.setattr(stream, "WINDOW_BYTES", 2 * 1024)  # two chunks a window, two windows in the ring
    monkeypatch.setattr(stream, "RING_BYTES", 4 * 1024)
    monkeypatch.setattr(stream, "MIN_WINDOWS", 1)
    monkeypatch.setattr(stream, "TASK_BYTES", 1024)  # one task a chunk
    flat = {"a": stream.byte_view(torch.zeros(4000))}
    read: list[int] = []
    caller = threading.get_ident()

    def caller_waits_for_the_readers() -> bool:
        """The calling thread has handled the failure (cancelled what had not started) and waits
        (concurrent.futures.wait) for this read to end."""
        frame = sys._current_frames().get(caller)
        while frame is not None and not (frame.f_code.co_name == "wait" and "futures" in frame.f_code.co_filename):
            frame = frame.f_back
        return frame is not None

    def read_piece(at, view):
        k = at // 1024
        read.append(k)
        if k == 2:
            raise CheckpointError("chunk 2 is damaged")
        if k == 3:  # keeps the one reader busy while the failure is handled (the bound: a hang)
            deadline = time.monotonic() + 120
            while not caller_waits_for_the_readers() and time.monotonic() < deadline:
                time.sleep(0.01)
        view[:] = image[at:at + len(view)].numpy()
        return stream.crc32(view)

    with pytest.raises(CheckpointError, match="chunk 2"):
        stream.read_chunks_to_cuda(flat, entries, chunks, 1024, 1, read_piece, lambda c, crc: None)
    assert sorted(read) == [0, 1, 2, 3]  # window 2 (chunks 4 and 5) was queued, and cancelled


def test_windowed_load_refuses_a_flipped_bit_in_a_chunk_read_in_pieces(monkeypatch):
    """A chunk read by several tasks whose combined CRC is not the recorded one raises, naming the chunk."""
    from torchplace.errors import CheckpointError

    monkeypatch.setattr(stream, "TASK_BYTES", 300)
    tensors = {"a": torch.randn(3000)}
    entries, image, chunks = _image_and_chunks(tensors, 1024)
    recorded = [stream.crc32(image[c0:c1].numpy()) for _, c0, c1, _ in chunks]
    image[5 * 1024 + 700] ^= 0x10  # one bit of chunk 5, in its third piece

    def check(c, crc):
        if crc != recorded[c[0]]:
            raise CheckpointError(f"chunk {c[0]} fails its checksum")

    flat = {"a": stream.byte_view(torch.zeros(3000))}
    with pytest.raises(CheckpointError, match="chunk 5"):
        stream.read_chunks_to_cuda(flat, entries, chunks, 1024, 2, _reader(image, []), check)


@pytest.mark.parametrize("step", ["every other column", "every third element"])
def test_a_strided_slice_saves_and_loads(tmp_path, step):
    """`extra={"x": t[:, ::2]}` raised torch's 'self.stride(-1) must be 1 to view Float as Byte': reshape(-1) of
    a slice whose last stride is not 1 stays a view, which cannot be seen as bytes."""
    import torchplace

    t = torch.randn(4, 4)[:, ::2] if step == "every other column" else torch.randn(9, dtype=torch.bfloat16)[::3]
    for name in ("s.safetensors", "a.safetensors"):
        if name.startswith("a"):
            torchplace.save_async(tmp_path / name, model={"w": t}, extra={"x": t}).result()
        else:
            torchplace.save(tmp_path / name, model={"w": t}, extra={"x": t})
        ck = torchplace.load(tmp_path / name)
        assert torch.equal(ck["model"]["w"], t) and torch.equal(ck.extra["x"], t)
