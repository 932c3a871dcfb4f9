"""Crafted DCP folders, sharded-model indexes, .bin files and run folders: each is refused with one
CheckpointError naming the file (or loads), never another exception, a hang or a code path the file chose.

Each case states the attack in its id or docstring. DCP metadata is crafted from a real folder's
record (read safely, changed, pickled again), so everything but the changed field is genuine.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from adversarial import crafting  # tests/ is on the path
from safetensors.torch import save_file

import torchplace
from torchplace.checkpoint import convert, inspect, read_dcp_metadata

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _dcp_folder(folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(torch.nn.Linear(4, 3).state_dict(), checkpoint_id=str(folder))
    return folder


def _weight(md: Any) -> Any:
    return md.state_dict_metadata["weight"]


# (case id, change to the metadata record): every one a field of the wrong shape, where the restricted
# unpickler builds DCP's own classes but fills them with whatever the file holds
DCP_RECORDS: dict[str, Callable[[Any], None]] = {
    "chunks-an-int": lambda md: setattr(_weight(md), "chunks", 5),
    "properties-an-int": lambda md: setattr(_weight(md), "properties", 5),
    "size-negative": lambda md: setattr(_weight(md), "size", torch.Size([-3, 4])),
    "entries-a-list": lambda md: setattr(md, "state_dict_metadata", [1]),
    "entries-none": lambda md: setattr(md, "state_dict_metadata", None),
    "chunk-sizes-an-int": lambda md: setattr(_weight(md).chunks[0], "sizes", 5),
    "chunk-beyond-the-tensor": lambda md: setattr(_weight(md).chunks[0], "offsets", torch.Size([2, 0])),
    "chunk-of-another-rank": lambda md: setattr(_weight(md).chunks[0], "sizes", torch.Size([3])),
    "entry-name-an-int": lambda md: md.state_dict_metadata.__setitem__(5, md.state_dict_metadata.pop("weight")),
    "entry-a-storage-record": lambda md: md.state_dict_metadata.__setitem__("weight", next(iter(md.storage_data))),
    "storage-a-list": lambda md: setattr(md, "storage_data", [1]),
}


@pytest.fixture(scope="module")
def genuine_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dcp_folder(tmp_path_factory.mktemp("dcp") / "ck")


@pytest.mark.parametrize("case", list(DCP_RECORDS))
def test_a_dcp_record_of_the_wrong_shape_is_refused_by_every_reader(tmp_path: Path, genuine_dcp: Path,
                                                                    case: str) -> None:
    """Once a TypeError or AttributeError escaped load and inspect for these."""
    folder = tmp_path / "ck"
    folder.mkdir()
    for item in genuine_dcp.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    metadata = read_dcp_metadata(genuine_dcp)
    DCP_RECORDS[case](metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    for read in (lambda: torchplace.load(folder, model=torch.nn.Linear(4, 3)), lambda: inspect(folder),
                 lambda: torchplace.load(folder, model=torch.nn.Linear(4, 3), trust_pickle=True)):
        with pytest.raises(torchplace.CheckpointError, match=r"\.metadata"):
            read()


def test_the_metadata_record_itself_of_another_class_is_refused(tmp_path: Path, genuine_dcp: Path) -> None:
    """A .metadata holding a DCP dataclass other than Metadata (a MetadataIndex) is no metadata."""
    folder = tmp_path / "ck"
    folder.mkdir()
    for item in genuine_dcp.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    (folder / ".metadata").write_bytes(pickle.dumps(next(iter(read_dcp_metadata(genuine_dcp).storage_data))))
    with pytest.raises(torchplace.CheckpointError, match="holds a MetadataIndex, not DCP's Metadata record"):
        inspect(folder)


@pytest.mark.parametrize("claimed", [2**33, 2**36, 2**62])
def test_a_dcp_metadata_length_field_claiming_gigabytes_fails_as_truncated(tmp_path: Path, genuine_dcp: Path,
                                                                          claimed: int) -> None:
    """A BINBYTES8 opcode claiming 8 GiB in a 100-byte file: refused without allocating what it claims."""
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", claimed) + b"x" * 100)
    with pytest.raises(torchplace.CheckpointError, match=r"\.metadata cannot be read as DCP metadata"):
        read_dcp_metadata(folder)


LAZY_IMPORTS = textwrap.dedent('''
    import io, json, sys
    from pathlib import Path
    import torch, torchplace
    import torch.distributed.checkpoint  # what DCP itself imports is no finding
    from torchplace.checkpoint import codec
    from torchplace.checkpoint.dcp_reader import _SafeUnpickler
    from torchplace.checkpoint.format import dtype_from_name
    before = set(sys.modules)
    tries = [lambda: dtype_from_name("_dynamo", "x"),
             lambda: codec.decode({"t": "dtype", "v": "_inductor"}, lambda key: None),
             lambda: _SafeUnpickler(io.BytesIO(b"ctorch\\n_dynamo\\n.")).load(),
             lambda: _SafeUnpickler(io.BytesIO(
                 b"ctorch.distributed.checkpoint._experimental.checkpointer\\nCheckpointer\\n.")).load()]
    refused = 0
    for attempt in tries:
        try:
            attempt()
        except Exception:
            refused += 1
    new = sorted(m for m in set(sys.modules) - before if "_dynamo" in m or "_inductor" in m or "_experimental" in m)
    print(json.dumps({"refused": refused, "imported": new[:5]}))
''')


def test_a_name_from_a_file_imports_no_torch_submodule() -> None:
    """A dtype named '_dynamo' (raw_dtypes, a state tag, a DCP global) once made torch import ~850 modules."""
    run = subprocess.run([sys.executable, "-c", LAZY_IMPORTS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report == {"refused": 4, "imported": []}


# --------------------------------------------------------------------------- sharded-model indexes

def _sharded(folder: Path, weight_map: dict[str, str]) -> Path:
    folder.mkdir()
    save_file({"weight": torch.ones(3, 4)}, str(folder / "model-00001.safetensors"))
    save_file({"bias": torch.ones(3)}, str(folder / "model-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_an_index_naming_itself_as_a_shard_is_refused(tmp_path: Path) -> None:
    """The index as its own shard was read as a pickle and reported as 'needs code: pass trust_pickle'."""
    folder = _sharded(tmp_path / "m", {"weight": "model.safetensors.index.json"})
    for trust in (False, True):
        with pytest.raises(torchplace.CheckpointError, match="which is the index itself"):
            torchplace.load(folder, trust_pickle=trust)


def test_an_index_naming_a_missing_shard_names_it(tmp_path: Path) -> None:
    """A shard that is not there: the message names the file, and convert writes nothing."""
    folder = _sharded(tmp_path / "m", {"weight": "model-00009.safetensors"})
    with pytest.raises(torchplace.CheckpointError, match=r"model-00009\.safetensors does not exist"):
        convert(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_inspect_reads_the_shards_an_index_lists_as_load_does(tmp_path: Path) -> None:
    """`torchplace ckpt inspect folder/model.safetensors.index.json`, which load and convert read, was refused as
    'not a checkpoint torchplace recognises'; a shard not there is named in its contents."""
    folder = _sharded(tmp_path / "m", {"weight": "model-00001.safetensors", "bias": "model-00009.safetensors"})
    info = inspect(folder / "model.safetensors.index.json")
    assert [t.key for t in info.tensors] == ["model-00001.safetensors/weight"]
    assert "model-00009.safetensors" in info.contents and "missing" in info.contents["model-00009.safetensors"]
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 16}))
    whole = inspect(folder)  # the folder: each shard once, the index and config.json named, not opened
    assert sorted(t.key for t in whole.tensors) == ["model-00001.safetensors/weight", "model-00002.safetensors/bias"]
    assert whole.contents["config.json"] == "not a checkpoint file" and "index" in whole.contents[
        "model.safetensors.index.json"]


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                                  "optimizer.bin"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "dangling"])
def test_a_special_file_under_an_accelerate_name_is_refused_not_passed_over(tmp_path: Path, name: str,
                                                                           kind: str) -> None:
    """A FIFO model.safetensors once gave 'no model.safetensors'; a FIFO optimizer.bin was silently left out."""
    folder = tmp_path / "acc"
    folder.mkdir()
    if name == "optimizer.bin":
        torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    if kind == "fifo":
        os.mkfifo(folder / name)
    else:
        os.symlink("/dev/zero" if kind == "dev-zero" else folder / "gone", folder / name)
    with pytest.raises(torchplace.CheckpointError, match=name.replace(".", r"\.")):
        torchplace.load(folder)


def test_a_shard_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    """torch.load of a directory once surfaced as IsADirectoryError inside a 'torch.save file' message."""
    folder = _sharded(tmp_path / "m", {"weight": "sub"})
    (folder / "sub").mkdir()
    with pytest.raises(torchplace.CheckpointError, match="is a directory, not a torch.save file"):
        torchplace.load(folder)


# --------------------------------------------------------------------------- .bin / torch.save files

@pytest.mark.parametrize("content", [b'{"weight": [1, 2]}', b"hello, I am text\n", bytes(range(200, 256)) * 4])
def test_a_bin_file_that_is_no_pickle_is_called_damaged_not_untrusted(tmp_path: Path, content: bytes) -> None:
    """Bytes that are no pickle opcode were reported as 'needs code: pass trust_pickle=True', which cannot help."""
    folder = tmp_path / "acc"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(content)
    for trust in (False, True):
        with pytest.raises(torchplace.CheckpointError, match="cannot be read as a torch.save file") as err:
            torchplace.load(folder, trust_pickle=trust)
        assert "trust_pickle" not in str(err.value)


def test_a_pickle_that_needs_code_still_says_how_to_trust_it(tmp_path: Path, marker: Path) -> None:
    """The refusal of a real payload keeps its advice (the split above must not swallow it)."""
    path = tmp_path / "evil.bin"
    torch.save({"x": crafting.Payload(marker)}, path)
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)needs code.*trust_pickle=True"):
        torchplace.load(path)
    assert not marker.exists()


# --------------------------------------------------------------------------- run folders

def test_a_planted_sequence_number_cannot_stop_later_saves(tmp_path: Path) -> None:
    """A file whose sequence has 4300 digits made every later keep_last save raise ValueError (an int too long)."""
    model = torch.nn.Linear(2, 2)
    first = torchplace.save(tmp_path / "step-1.tpck", model=model, keep_last=5)
    index, meta, data = crafting.parts(first)
    meta["sequence"] = int("9" * 4300)
    crafting.write(tmp_path / "planted.tpck", index, meta, data)
    torchplace.save(tmp_path / "step-2.tpck", model=model, keep_last=5)
    assert torchplace.load(tmp_path).path.name == "step-2.tpck"


@pytest.mark.parametrize("name", ["latest", "LATEST"])
def test_convert_refuses_to_write_a_checkpoint_named_latest(tmp_path: Path, name: str) -> None:
    """save reserves `latest` for the rotation pointer; convert wrote a checkpoint under that name."""
    src = torchplace.save(tmp_path / "src.pt", model=torch.nn.Linear(2, 2))
    with pytest.raises(torchplace.CheckpointError, match="reserved"):
        convert(src, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_truncated_at_every_byte_of_the_header(tmp_path: Path) -> None:
    """Every prefix of a genuine file up to the end of its header is refused by load and inspect."""
    raw = crafting.genuine(tmp_path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path = tmp_path / "cut.pt"
    for cut in [*range(0, 8 + n + 1), len(raw) - 1]:
        path.write_bytes(raw[:cut])
        for read in (lambda: torchplace.load(path), lambda: inspect(path)):
            with pytest.raises(torchplace.CheckpointError, match="cut.pt"):
                read()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "deep-json", "a-list"])
def test_a_planted_job_file_is_no_restart_and_never_blocks(tmp_path: Path, kind: str) -> None:
    """setup() reads checkpoint_dir/.torchplace-job: a FIFO there blocked it, deep JSON raised RecursionError."""
    from torchplace.checkpoint.rotation import mark_started
    from torchplace.policy.resume import JOB_FILE, started_here

    job = tmp_path / JOB_FILE
    if kind == "fifo":
        os.mkfifo(job)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", job)
    else:
        job.write_text("[" * 100_000 + "]" * 100_000 if kind == "deep-json" else '["run-1"]')
    assert started_here(tmp_path, "run-1") is False
    job.unlink()
    mark_started(tmp_path, "run-1")
    assert started_here(tmp_path, "run-1") and not started_here(tmp_path, "run-2")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_flight_recorder_dump_that_is_no_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """load_dump read a FIFO (size 0 passed its size check) and blocked for good."""
    from torchplace.distributed.flight_recorder import load_dump
    from torchplace.errors import DistributedError

    dump = tmp_path / "fr_rank_0"
    if kind == "fifo":
        os.mkfifo(dump)
    else:
        os.symlink("/dev/zero", dump)
    with pytest.raises(DistributedError, match="not a regular file"):
        load_dump(dump)


def _compressed_claim(folder: Path) -> Path:
    """A real model+optimizer DCP folder whose exp_avg claims 256 GiB, every record marked compressed."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(folder))
    metadata = read_dcp_metadata(folder)
    md = metadata.state_dict_metadata["optimizer.state.0.exp_avg"]
    md.size = torch.Size([1 << 18, 1 << 18])
    md.chunks[0].sizes = md.size
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


def test_records_marked_compressed_cannot_claim_unbounded_memory(tmp_path: Path) -> None:
    """'Compressed' skipped every size check: a 27 KiB folder made load allocate 256 GiB for one optimizer state."""
    folder = _compressed_claim(tmp_path / "ck")
    model = torch.nn.Linear(4, 3)
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)stored compressed.*trust_pickle=True"):
        torchplace.load(folder, model=model, optimizer=torch.optim.Adam(model.parameters()))


TRUSTED_CLAIM = textwrap.dedent('''
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))  # 256 GiB cannot be had here
    import torch, torchplace
    model = torch.nn.Linear(4, 3)
    try:
        torchplace.load(sys.argv[1], model=model, optimizer=torch.optim.Adam(model.parameters()), trust_pickle=True)
        print("loaded")
    except torchplace.CheckpointError as exc:
        print("CheckpointError", "cannot be allocated" in str(exc))
''')


def test_a_trusted_claim_that_cannot_be_allocated_is_a_checkpoint_error(tmp_path: Path) -> None:
    """With trust the budget is lifted; torch's allocator refusal was a raw RuntimeError."""
    folder = _compressed_claim(tmp_path / "ck")
    run = subprocess.run([sys.executable, "-c", TRUSTED_CLAIM, str(folder)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["CheckpointError", "True"], run.stdout


def test_a_deflated_zip_as_a_dcp_item_is_refused_before_it_unpacks(tmp_path: Path) -> None:
    """A 160 MiB deflate bomb (700 KiB) as a BYTE_IO item: the .pt budget did not apply, load took 161 MiB."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = tmp_path / "ck"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(folder))
    (tmp_path / "bomb").mkdir()
    bomb = crafting.CASES["torch_zip_deflated_bomb"](tmp_path / "bomb").read_bytes()
    metadata = read_dcp_metadata(folder)
    target = next(k for k, v in metadata.state_dict_metadata.items()
                  if isinstance(v, BytesStorageMetadata) and k.startswith("optimizer.param_groups"))
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == target)
    data = folder / info.relative_path
    info.offset, info.length = data.stat().st_size, len(bomb)
    with open(data, "ab") as fh:
        fh.write(bomb)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    fresh = torch.nn.Linear(4, 3)
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)the item 'optimizer\.param_groups.*compressed"):
        torchplace.load(folder, model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))


def test_small_deflated_bin_shards_share_one_unpacking_budget(tmp_path: Path) -> None:
    """Each .bin shard alone may unpack to the 128 MiB floor: three 60 MiB deflated shards (~200 KiB) passed."""
    import zipfile

    folder = tmp_path / "m"
    folder.mkdir()
    plain = tmp_path / "plain.bin"
    torch.save({"weight": torch.zeros(60 * 2**20 // 4)}, plain)
    names = [f"pytorch_model-0000{i}.bin" for i in range(3)]
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(folder / names[0], "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    plain.unlink()
    for name in names[1:]:
        (folder / name).write_bytes((folder / names[0]).read_bytes())
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {f"w{i}": n for i, n in
                                                                                    enumerate(names)}}))
    with pytest.raises(torchplace.CheckpointError, match=r"lists 3 torch.save shards.*declare"):
        torchplace.load(folder)


def test_keep_last_in_a_folder_of_foreign_files_deletes_only_its_own(tmp_path: Path) -> None:
    """Notes, another tool's file, a plain save, a FIFO, /dev/zero, a dangling link, a folder: all are kept."""
    model = torch.nn.Linear(2, 2)
    (tmp_path / "notes.txt").write_text("mine")
    torch.save({"w": torch.ones(2)}, tmp_path / "other.pt")
    torchplace.save(tmp_path / "plain.safetensors", model=model)  # no keep_last: not in the series
    os.mkfifo(tmp_path / "pipe.pt")
    os.symlink("/dev/zero", tmp_path / "zero.pt")
    os.symlink(tmp_path / "gone", tmp_path / "dangling.pt")
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").write_text("x")
    foreign = sorted(p.name for p in tmp_path.iterdir())
    for step in range(3):
        torchplace.save(tmp_path / f"step-{step}.tpck", model=model, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*foreign, "step-2.tpck", "latest"])
    assert torchplace.load(tmp_path).path.name == "step-2.tpck"


def _patch_central_sizes(data: bytes, member: str, extra: int) -> bytes:
    """DATA (a zip) with MEMBER's sizes in its central directory entry grown by EXTRA bytes."""
    name = member.encode()
    at = data.find(b"PK\x01\x02")
    while at >= 0 and data[at + 46:at + 46 + len(name)] != name:
        at = data.find(b"PK\x01\x02", at + 4)
    assert at >= 0
    compressed, size = struct.unpack_from("<LL", data, at + 20)
    out = bytearray(data)
    struct.pack_into("<LL", out, at + 20, compressed + extra, size + extra)
    return bytes(out)


def test_a_torch_save_zip_whose_member_runs_past_its_end_or_fails_its_crc_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, path)
    good = path.read_bytes()
    import zipfile

    member = next(m.filename for m in zipfile.ZipFile(path).infolist() if m.filename.endswith("/data/0"))
    (tmp_path / "long.pt").write_bytes(_patch_central_sizes(good, member, 10_000))
    with pytest.raises(torchplace.CheckpointError, match=r"long.pt is damaged: member .* runs past the end"):
        torchplace.load(tmp_path / "long.pt")
    flipped = bytearray(good)
    at = good.find(torch.arange(64, dtype=torch.float32).numpy().tobytes())
    flipped[at + 5] ^= 1
    (tmp_path / "flip.pt").write_bytes(bytes(flipped))
    with pytest.raises(torchplace.CheckpointError, match=r"flip.pt is damaged: member .* fails its CRC-32"):
        torchplace.load(tmp_path / "flip.pt")
    assert inspect(tmp_path / "flip.pt").tensors  # inspect without --verify reads no data
    with pytest.raises(torchplace.CheckpointError, match="fails its CRC-32"):
        inspect(tmp_path / "flip.pt", verify=True)
    assert inspect(path, verify=True).verified


def test_a_namespace_is_read_without_trust_but_other_classes_are_still_refused(tmp_path: Path) -> None:
    import argparse
    import fractions

    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, tmp_path / "ns.pt")
    assert torchplace.load(tmp_path / "ns.pt")["args"].lr == 0.1
    torch.save({"model": {"w": torch.ones(2)}, "c": fractions.Fraction(1, 3)}, tmp_path / "counter.pt")
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)Fraction.*trust_pickle=True"):
        torchplace.load(tmp_path / "counter.pt")


@pytest.mark.parametrize("packing", ["gzip", "tar"])
def test_a_packed_checkpoint_says_to_unpack_it(tmp_path: Path, packing: str) -> None:
    """A downloaded `model.pth.gz` or `ckpt.tar` read 'not a checkpoint torchplace recognises. Fix: check the path'."""
    import gzip
    import tarfile

    inner = tmp_path / "model.pth"
    torch.save({"w": torch.ones(2)}, inner)
    packed = tmp_path / ("model.pth.gz" if packing == "gzip" else "ckpt.tar")
    if packing == "gzip":
        packed.write_bytes(gzip.compress(inner.read_bytes()))
    else:
        with tarfile.open(packed, "w") as tar:
            tar.add(inner, arcname="model.pth")
    fix = "gunzip" if packing == "gzip" else "tar -xf"
    for read in (torchplace.load, inspect):
        with pytest.raises(torchplace.CheckpointError, match=rf"is .*{packing}.*, not a checkpoint itself. Fix: "
                                                             rf"unpack it first \({fix} "):
            read(packed)
