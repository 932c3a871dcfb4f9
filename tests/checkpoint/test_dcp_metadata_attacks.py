"""Crafted torch.distributed.checkpoint folders whose cost was out of proportion to their size, or that
raised something other than CheckpointError: a deflated zip member inside a tensor item (1 MB unpacking
to 1 GiB), `.metadata` records sharing one chunk list or one state through the pickle memo (a
0.9 MB file walked N x M times), a NUL byte in a storage path, and classes of DCP's modules that are
not its records. Memory is measured in a child process; time bounds only catch a hang.
"""

from __future__ import annotations

import copyreg
import io
import json
import pickle
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

import torchplace
from torchplace.checkpoint.dcp_reader import compressed_budget, read_dcp_metadata

HANG = 120  # seconds: only a hang reaches it
BOUND = 2**28  # max(2 x input, 256 MiB) for inputs of at most 128 MiB

CHILD = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
    import torch, torchplace
    model = torch.nn.Module()
    model.register_buffer("w", torch.ones(4))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        torchplace.load(sys.argv[1], model=model)
        result = "loaded"
    except torchplace.TorchplaceError as exc:
        result = type(exc).__name__ + ": " + str(exc)
    except BaseException as exc:
        result = "other " + type(exc).__name__ + ": " + str(exc)[:300]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps({"result": result, "grown": grown}))
""")


def load_in_child(folder: Path) -> dict:
    """torchplace.load(folder, model=) in a child: what it raised and how much its peak memory grew."""
    run = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=HANG)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


def dcp_save(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(folder))


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


# ------------------------------------------------------------------ a zip bomb in a tensor item


def tensor_item_bomb(folder: Path, unpacked: int = 2**30) -> Path:
    """A real DCP folder whose tensor `w` is a torch.save zip with its storage deflated: ~1 MB in the
    file, `unpacked` bytes once torch.load inflates it, and a pickle that claims that many bytes of
    storage, so torch's size check passes and the load succeeds."""
    dcp_save({"w": torch.zeros(4)}, folder)
    metadata = read_dcp_metadata(folder)
    info = metadata.storage_data[MetadataIndex("w", torch.Size([0]))]
    blob = (folder / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    original = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for member in original.infolist():
            if member.filename.endswith("/data/0"):
                deflated = zipfile.ZipInfo(member.filename)
                deflated.compress_type = zipfile.ZIP_DEFLATED
                with zf.open(deflated, "w", force_zip64=True) as fh:
                    for _ in range(unpacked // 2**24):
                        fh.write(bytes(2**24))
                continue
            body = original.read(member.filename)
            if member.filename.endswith("data.pkl"):  # the storage's element count: 4 -> unpacked / 4
                numel = (unpacked // 4).to_bytes(4, "little")
                assert b"cpuq\x04K\x04t" in body
                body = body.replace(b"cpuq\x04K\x04t", b"cpuq\x04J" + numel + b"t")
            zf.writestr(member, body)
    (folder / info.relative_path).write_bytes(out.getvalue())
    info.offset, info.length = 0, len(out.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


def test_a_zip_bomb_in_a_tensor_item_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    folder = tensor_item_bomb(tmp_path / "ck")
    assert size_of(folder) < 2 * 2**20
    got = load_in_child(folder)
    assert got["result"] != "loaded", f"the 1 MB folder loaded, its peak grew by {got['grown'] >> 20} MiB"
    assert got["result"].startswith("CheckpointError: ") and "the item 'w'" in got["result"], got["result"]
    assert "declare 1073742028 bytes unpacked" in got["result"] and "Fix:" in got["result"]
    assert got["grown"] < BOUND, f"{got['grown'] >> 20} MiB"


def test_a_plain_tensor_item_still_loads(tmp_path: Path) -> None:
    dcp_save({"w": torch.arange(4.0)}, tmp_path / "ck")
    model = torch.nn.Module()
    model.register_buffer("w", torch.ones(4))
    torchplace.load(tmp_path / "ck", model=model)
    assert torch.equal(model.w, torch.arange(4.0))


# ------------------------------------------------------------------ records shared through the memo


def write_metadata(folder: Path, metadata: object) -> Path:
    folder.mkdir()
    data = pickle.dumps(metadata, protocol=2)
    (folder / ".metadata").write_bytes(data)
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    return folder


def shared_chunk_list(folder: Path, entries: int = 20_000, chunks: int = 40_000) -> Path:
    """ENTRIES tensor records sharing one list of CHUNKS chunk records: the memo writes the list once."""
    props, size = TensorProperties(dtype=torch.float32), torch.Size([1])
    shared = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)] * chunks
    table = {f"t{i}": TensorStorageMetadata(props, size, shared) for i in range(entries)}
    storage = {MetadataIndex("t0", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 4)}
    return write_metadata(folder, Metadata(state_dict_metadata=table, storage_data=storage))


class _SharedState:
    """Pickles as a ChunkStorageMetadata record whose state is one dict shared by every such record."""

    __class__ = ChunkStorageMetadata  # type: ignore[assignment]  # what the pickler writes as its class

    def __init__(self, state: dict) -> None:
        self.state = state

    def __reduce_ex__(self, protocol: object) -> tuple:
        return copyreg.__newobj__, (ChunkStorageMetadata,), self.state


def shared_state(folder: Path, records: int = 20_000, keys: int = 20_000) -> Path:
    """RECORDS chunk records built from one state dict of KEYS fields (the C unpickler copies it into each)."""
    state = {f"k{i}": 0 for i in range(keys)}
    many = [_SharedState(state) for _ in range(records)]
    props, size = TensorProperties(dtype=torch.float32), torch.Size([1])
    table = {"w": TensorStorageMetadata(props, size, many)}  # type: ignore[arg-type]
    return write_metadata(folder, Metadata(state_dict_metadata=table, storage_data={}))


def many_dimensions(folder: Path, entries: int = 10_000, rank: int = 20_000) -> Path:
    """ENTRIES sizes each built from one shared tuple of RANK dimensions (torch.Size copies it per call)."""
    dims = tuple([1] * rank)

    class _Size:
        def __reduce__(self) -> tuple:
            return torch.Size, (dims,)

    props = TensorProperties(dtype=torch.float32)
    table = {f"t{i}": TensorStorageMetadata(props, _Size(), []) for i in range(entries)}  # type: ignore[arg-type]
    return write_metadata(folder, Metadata(state_dict_metadata=table, storage_data={}))


@pytest.mark.parametrize("craft", [shared_chunk_list, shared_state, many_dimensions],
                         ids=["one-chunk-list-in-every-entry", "one-state-in-every-record", "sizes-of-20000-dims"])
def test_metadata_sharing_records_through_the_memo_costs_its_size(tmp_path: Path, craft, run_cli) -> None:
    folder = craft(tmp_path / "ck")
    assert size_of(folder) < 2**20  # under 1 MiB
    got = load_in_child(folder)
    assert got["result"].startswith("CheckpointError: "), got["result"]
    assert str(folder / ".metadata") in got["result"] and "Fix:" in got["result"]
    assert got["grown"] < BOUND, f"{got['grown'] >> 20} MiB"
    out = run_cli(["ckpt", "inspect", str(folder)], timeout=HANG)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "torchplace: error:" in out.stderr, out.stderr


def test_the_records_of_a_real_folder_still_read(tmp_path: Path) -> None:
    """The checked record classes end up as DCP's own: they compare equal and pickle again."""
    dcp_save({"w": torch.zeros(3, 2), "extra": {"step": 3}}, tmp_path / "ck")
    metadata = read_dcp_metadata(tmp_path / "ck")
    assert type(metadata) is Metadata
    assert pickle.loads(pickle.dumps(metadata)).state_dict_metadata == metadata.state_dict_metadata
    assert MetadataIndex("w", torch.Size([0, 0])) in metadata.storage_data


# ------------------------------------------------------------------ wrong types, wider classes


def test_a_nul_byte_in_a_storage_path_is_a_checkpoint_error(tmp_path: Path) -> None:
    dcp_save({"w": torch.zeros(4)}, tmp_path / "ck")
    metadata = read_dcp_metadata(tmp_path / "ck")
    for info in metadata.storage_data.values():
        info.relative_path = "__0_0\0.distcp"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    model = torch.nn.Module()
    model.register_buffer("w", torch.ones(4))
    with pytest.raises(torchplace.CheckpointError, match=r"names '__0_0\\x00\.distcp', which cannot be opened.*Fix"):
        torchplace.load(tmp_path / "ck", model=model)


def test_only_dcp_record_classes_are_built_not_any_class_of_its_modules(tmp_path: Path) -> None:
    """An enum of torch.distributed.checkpoint.planner (a loaded DCP module, not a record of .metadata)."""
    dcp_save({"w": torch.zeros(4)}, tmp_path / "ck")
    metadata = read_dcp_metadata(tmp_path / "ck")
    metadata.version = LoadItemType.TENSOR  # type: ignore[assignment]
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(torchplace.CheckpointError, match=r"planner\.LoadItemType is not a DCP metadata class"):
        read_dcp_metadata(tmp_path / "ck")


def test_compressed_folders_unpack_to_at_most_twice_their_size_or_256_mib() -> None:
    """docs/security.md: max(2 x input, 256 MiB); compressed folders had 64 x or 1 GiB."""
    assert compressed_budget(2**20) == 2**28
    assert compressed_budget(2**30) == 2**31
