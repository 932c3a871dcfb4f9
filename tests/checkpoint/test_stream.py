"""The chunked copy between tensors and a staging buffer that saves and loads of GPU tensors use."""

from __future__ import annotations

import torch

from torchplace.checkpoint import stream
from torchplace.checkpoint.format import plan_layout


def test_pieces_round_trip_through_the_staging_buffer_across_chunk_boundaries():
    tensors = {"a": torch.randn(1000), "b": torch.arange(37, dtype=torch.int16), "c": torch.randn(3, 300).double()}
    entries = plan_layout(tensors)
    data_bytes, chunk = entries[-1].end, 1024  # tensors cut across several chunks
    flat = {e.key: stream.byte_view(tensors[e.key]) for e in entries}
    out = {k: torch.zeros_like(t) for k, t in tensors.items()}
    flat_out = {e.key: stream.byte_view(out[e.key]) for e in entries}
    staging = stream._Staging(chunk, pinned=False)
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
