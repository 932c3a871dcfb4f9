"""The file format: exact round trips, safetensors compatibility, and damage that must raise."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

import torchplace
from torchplace.checkpoint import fileio
from torchplace.checkpoint import format as fmt
from torchplace.checkpoint.options import ReadOptions


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(),
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "i64": torch.arange(-5, 6),
        "u8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "c128": torch.randn(3, generator=g, dtype=torch.complex128),  # no safetensors code: raw bytes
        "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-safe, works for float8 and complex)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_every_dtype_and_shape_round_trips_exactly(tmp_path: Path) -> None:
    src = _tensors()
    path = torchplace.save(tmp_path / "c.safetensors", extra=src, rng_state=False)
    got = torchplace.load(path).extra
    assert set(got) == set(src)
    for key, t in src.items():
        assert _equal(t, got[key]), key
    assert got["strided"].is_contiguous()


def test_files_are_valid_safetensors(tmp_path: Path) -> None:
    src = {k: v for k, v in _tensors().items() if k not in ("c128", "strided")}
    path = torchplace.save(tmp_path / "c.safetensors", model=src, rng_state=False)
    other = safetensors.torch.load_file(str(path))
    for key, t in src.items():
        assert _equal(t, other[f"model/{key}"]), key
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8:].startswith(fmt.HEADER_PREFIX)


def test_pieces_spanning_chunks_and_threads(tmp_path: Path) -> None:
    """Tiny chunks make tensors straddle chunk boundaries and chunks hold many tensors."""
    g = torch.Generator().manual_seed(1)
    tree = {"model": {f"t{i}": torch.randn(i * 37 + 1, generator=g) for i in range(40)}}
    path = fileio.write_file(tmp_path / "c", tree, info={}, chunk_bytes=1000, workers=4)
    header = fmt.read_header(path)
    assert len(header.meta["crc32"]) == -(-header.data_bytes // 1000) > 40
    got = fileio.read_file(path, lambda _: torch.device("cpu"), ReadOptions(workers=4)).tree
    for key, t in tree["model"].items():
        assert torch.equal(got["model"][key], t)


def test_tied_tensors_are_stored_once_and_come_back_shared(tmp_path: Path) -> None:
    w = torch.randn(100, 10)
    path = torchplace.save(tmp_path / "c", model={"embed.weight": w, "head.weight": w}, rng_state=False)
    assert len(fmt.read_header(path).entries) == 1
    sd = torchplace.load(path)["model"]
    assert sd["embed.weight"] is sd["head.weight"] and torch.equal(sd["head.weight"], w)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(2)
    tree = {"model": {"a": torch.randn(300, generator=g), "b": torch.randn(50, 3, generator=g)},
            "extra": {"lr": 0.125, "name": "run-1"}}
    return fileio.write_file(tmp_path / "c.safetensors", tree, info={}, chunk_bytes=512)


def test_truncation_at_any_offset_raises(saved: Path) -> None:
    data = saved.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    offsets = [0, 3, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, 8 + n + 700, len(data) - 1]
    for cut in offsets:
        saved.write_bytes(data[:cut])
        with pytest.raises(torchplace.CheckpointError,
                           match=rf"{saved} (is damaged: .*(truncated|too short)|is {cut} bytes long: too short to be "
                                 "a checkpoint of any kind .*cut short)"):
            torchplace.load(saved)
    saved.write_bytes(data + b"\0")
    with pytest.raises(torchplace.CheckpointError, match="unexpected bytes"):
        torchplace.load(saved)


def test_every_single_bit_flip_in_the_header_raises(saved: Path) -> None:
    data = saved.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    fd = os.open(saved, os.O_WRONLY)
    try:
        for pos in range(8 + n):
            for bit in range(8):
                os.pwrite(fd, bytes([data[pos] ^ (1 << bit)]), pos)
                try:
                    torchplace.load(saved)
                except torchplace.CheckpointError as exc:
                    assert str(saved) in str(exc)
                else:
                    pytest.fail(f"a flip of bit {bit} at byte {pos} ({chr(data[pos])!r}) went unnoticed")
            os.pwrite(fd, data[pos:pos + 1], pos)
    finally:
        os.close(fd)
    assert torchplace.load(saved).extra["name"] == "run-1"


def test_bit_flips_in_the_data_raise_and_name_the_tensor(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    header = fmt.read_header(saved)
    by_key = header.by_key
    for key in ("a", "b"):
        entry = by_key[f"model/{key}"]
        for rel in (0, entry.nbytes // 2, entry.nbytes - 1):
            pos = header.data_offset + entry.start + rel
            data[pos] ^= 0x10
            saved.write_bytes(bytes(data))
            with pytest.raises(torchplace.CheckpointError, match=f"fail their checksum.*model/{key}"):
                torchplace.load(saved)
            data[pos] ^= 0x10
    saved.write_bytes(bytes(data))
    restored = fileio.read_file(saved, lambda _: torch.device("cpu")).tree["model"]["a"]
    assert torch.equal(torchplace.load(saved)["model"]["a"], restored)


def test_a_plain_safetensors_file_loads_as_model_weights(tmp_path: Path) -> None:
    sd = {"w": torch.randn(4, 4), "b": torch.zeros(4)}
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(sd, str(path))
    ck = torchplace.load(path)
    assert ck.tool == "safetensors"
    assert torch.equal(ck["model"]["w"], sd["w"])
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(torchplace.CheckpointError, match="truncated"):
        torchplace.load(path)


def test_small_tensors_are_laid_out_together_after_the_large_ones_of_their_width() -> None:
    big = fmt.SMALL_TENSOR_BYTES // 4  # float32 elements of exactly the threshold: a large one
    tensors = {"bias": torch.ones(3), "weight": torch.ones(big), "half_bias": torch.ones(5, dtype=torch.half),
               "norm": torch.ones(4), "head": torch.ones(big + 1), "step": torch.tensor(2, dtype=torch.int64),
               "meta_small": torch.ones(2, device="meta"), "half": torch.ones(2 * big, dtype=torch.half)}
    entries = fmt.plan_layout(tensors)
    assert [e.key for e in entries] == ["step", "weight", "head", "bias", "norm", "meta_small", "half", "half_bias"]
    assert entries[0].start == 0 and all(a.end == b.start for a, b in zip(entries, entries[1:]))  # no holes
    assert all(e.start % e.dtype.itemsize == 0 for e in entries)  # widest first: every offset aligned
