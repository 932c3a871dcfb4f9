"""Craft hostile checkpoint files the way an attacker would, for the adversarial tests.

CRC-32 detects damage, not tampering: anyone can recompute it. So every crafted torchplace file
here has valid framing and RECOMPUTED checksums (header and data), and only its content is
hostile: declared sizes far beyond the file, shapes that are negative, bool or overflow, JSON of
the wrong type at every level of the header, JSON nested 100,000 deep, unknown state tags,
missing keys, non-string keys. Foreign files: torch.save zips whose storages are deflated and
expand hugely, Lightning files whose state_dict is an int or a string, training dicts with int
model keys. Non-regular files: /dev/zero, /dev/urandom, a FIFO, a directory.

`CASES` maps a case name to a function that writes the case under a folder and returns its path.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import torchplace
from torchplace.checkpoint import format as fmt

Craft = Callable[[Path], Path]
CASES: dict[str, Craft] = {}


class Payload:
    """A pickled object whose unpickling calls os.mkdir(marker): if the marker exists, code from the
    file ran (the checkpoint tests plant it wherever a reader might unpickle)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def case(name: str) -> Callable[[Craft], Craft]:
    def register(fn: Craft) -> Craft:
        CASES[name] = fn
        return fn
    return register


# --------------------------------------------------------------------------- torchplace files

def genuine(folder: Path) -> Path:
    """A real checkpoint: a small model, an Adam optimizer with state, RNG states and extras."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = folder / "genuine.tpck"
    torchplace.save(path, model=model, optimizer=opt, extra={"step": 7, "name": "run"})
    return path


def parts(path: Path) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """(tensor index as in the header, torchplace metadata, data bytes) of a genuine file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = json.loads(header.pop("__metadata__")[fmt.META_KEY])
    return header, meta, raw[8 + n:]


def _entries(index: dict[str, Any], meta: Any) -> list[fmt.TensorEntry]:
    """The index as the reader sees it (best effort: invalid entries are refused before any checksum)."""
    raw = meta.get("raw_dtypes", {}) if isinstance(meta, dict) else {}
    try:
        out = []
        for key, info in index.items():
            dtype = fmt._CODES[info["dtype"]]
            shape = info["shape"]
            if isinstance(raw, dict) and key in raw:
                dtype, shape = getattr(torch, raw[key][0]), raw[key][1]
            start, end = info["data_offsets"]
            out.append(fmt.TensorEntry(key, dtype, tuple(shape), int(start), int(end)))
        return sorted(out, key=lambda e: (e.start, e.end))
    except Exception:  # noqa: BLE001 - the reader refuses such an index before it checks a checksum
        return []


def write(path: Path, index: dict[str, Any], meta: Any, data: bytes, *, meta_text: str | None = None,
          metadata: Any = None, fix_data_crc: bool = True) -> Path:
    """Write a torchplace-framed file with every checksum recomputed over the hostile content."""
    if isinstance(meta, dict) and meta_text is None:
        meta = dict(meta)
        chunk = meta.get("chunk_bytes")
        if fix_data_crc and type(chunk) is int and chunk > 0:
            meta["crc32"] = [f"{zlib.crc32(data[i:i + chunk]):08x}" for i in range(0, len(data), chunk)]
        meta_text = fmt.dump_meta(meta, fmt._header_crc(_entries(index, meta), fmt.dump_meta(meta),
                                                        fmt.OTHER_METADATA))
    if metadata is None:
        metadata = {fmt.META_KEY: meta_text if meta_text is not None else json.dumps(meta), **fmt.OTHER_METADATA}
    body = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def tamper(name: str, change: Callable[[dict[str, Any], dict[str, Any], bytes], Any]) -> None:
    """Register a case: a genuine file whose tensor index and metadata CHANGE edits in place."""
    def craft(folder: Path) -> Path:
        index, meta, data = parts(genuine(folder))
        crcs = meta.get("crc32")
        change(index, meta, data)
        return write(folder / f"{name}.pt", index, meta, data, fix_data_crc=meta.get("crc32") == crcs)
    CASES[name] = craft


def _first_key(index: dict[str, Any]) -> str:
    return next(iter(index))


def _set(field: str, value: Any) -> Callable[[dict[str, Any], dict[str, Any], bytes], None]:
    return lambda index, meta, data: meta.__setitem__(field, value)


def _drop(field: str) -> Callable[[dict[str, Any], dict[str, Any], bytes], None]:
    return lambda index, meta, data: meta.pop(field, None)


def _entry(field: str, value: Any) -> Callable[[dict[str, Any], dict[str, Any], bytes], None]:
    return lambda index, meta, data: index[_first_key(index)].__setitem__(field, value)


def _state(tree: Any) -> Callable[[dict[str, Any], dict[str, Any], bytes], None]:
    return _set("state", tree)


def _with_model(pairs: list[Any]) -> Callable[[dict[str, Any], dict[str, Any], bytes], None]:
    return _state({"t": "dict", "v": [["model", {"t": "dict", "v": pairs}]]})


tamper("genuine_resealed", lambda index, meta, data: None)  # control: must load
# declared sizes far beyond the file
tamper("chunk_8gib", _set("chunk_bytes", 8 * 2**30))
tamper("chunk_1gib", _set("chunk_bytes", 2**30))  # allowed: the buffer is bounded by the data
tamper("chunk_1", _set("chunk_bytes", 1))
for _name, _value in (("zero", 0), ("negative", -1), ("bool", True), ("str", "16"), ("float", 1.5), ("null", None)):
    tamper(f"chunk_{_name}", _set("chunk_bytes", _value))
tamper("data_bytes_8gib", _set("data_bytes", 8 * 2**30))
tamper("data_bytes_str", _set("data_bytes", "1"))
tamper("tensor_claims_8gib", lambda index, meta, data: index[_first_key(index)].update(
    dtype="F32", shape=[2**31], data_offsets=[0, 2**33]))
# checksum list
tamper("crc_list_str", lambda index, meta, data: meta.update(crc32="00000000", chunk_bytes="x"))
tamper("crc_not_hex", lambda index, meta, data: meta.update(crc32=["zzzzzzzz"]))
tamper("crc_too_many", lambda index, meta, data: meta.update(crc32=meta["crc32"] * 1000))
tamper("crc_int", lambda index, meta, data: meta.update(crc32=[0], chunk_bytes="skip"))
# versions and metadata fields of the wrong JSON type
for _field, _values in (("format_version", ("1", True, 2, None, 1.0)), ("pickled", (5, ["x", 1], {"a": 1})),
                        ("devices", ([], {"except": {"cpu": 5}}, {"default": 5}, {"except": []})),
                        ("module_versions", ({"a": 1}, [1])), ("world_size", ("x", [])),
                        ("primary_device", (5,)), ("raw_dtypes", (5, {"weight": ["float32"]}, {"weight": [1, [2]]},
                                                                {"weight": ["nosuch", [12]]},
                                                                {"weight": ["float32", [-3, -4]]}))):
    for _i, _value in enumerate(_values):
        tamper(f"meta_{_field}_{_i}", _set(_field, _value))
for _field in ("state", "format_version", "crc32", "chunk_bytes", "data_bytes", "header_crc32"):
    tamper(f"meta_missing_{_field}", _drop(_field))
# the state tree: unknown tags, wrong shapes, missing or non-string keys, deep nesting
for _name, _tree in {
    "state_int": 5, "state_list": [1, 2], "state_plain_object": {"a": 1}, "state_unknown_tag": {"t": "bogus"},
    "state_dict_v_int": {"t": "dict", "v": 5}, "state_dict_bad_pair": {"t": "dict", "v": [[1]]},
    "state_unhashable_key": {"t": "dict", "v": [[[1, 2], 3]]},
    "state_tensor_missing": {"t": "dict", "v": [["model", {"t": "dict", "v": [["w", {"t": "tensor", "k": "nope"}]]}]]},
    "state_tensor_no_k": {"t": "dict", "v": [["x", {"t": "tensor"}]]},
    "state_tensor_k_int": {"t": "dict", "v": [["x", {"t": "tensor", "k": 3}]]},
    "state_float_junk": {"t": "dict", "v": [["x", {"t": "float", "v": "abc"}]]},
    "state_float_int": {"t": "dict", "v": [["x", {"t": "float", "v": 3}]]},
    "state_dtype_junk": {"t": "dict", "v": [["x", {"t": "dtype", "v": "Tensor"}]]},
    "state_device_junk": {"t": "dict", "v": [["x", {"t": "device", "v": "warp:drive"}]]},
    "state_size_negative": {"t": "dict", "v": [["x", {"t": "size", "v": [-1]}]]},
    "state_size_bool": {"t": "dict", "v": [["x", {"t": "size", "v": [True]}]]},
    "state_bytes_junk": {"t": "dict", "v": [["x", {"t": "bytes", "v": "!!!"}]]},
    "state_tuple_v_str": {"t": "dict", "v": [["x", {"t": "tuple", "v": "ab"}]]},
    "state_ndarray_missing": {"t": "dict", "v": [["x", {"t": "ndarray", "k": "nope"}]]},
    "state_int_top_key": {"t": "dict", "v": [[1, 2]]},
    "state_model_int": {"t": "dict", "v": [["model", 5]]},
    "state_model_str": {"t": "dict", "v": [["model", "weights"]]},
    "state_optimizer_list": {"t": "dict", "v": [["optimizer", [1, 2]]]},
    "state_rng_int": {"t": "dict", "v": [["rng", 5]]},
    "state_rng_garbage": {"t": "dict", "v": [["rng", {"t": "dict", "v": [["python", 5], ["numpy", "x"],
                                                                        ["cpu", 3], ["cuda", 4]]}]]},
    "state_deep_500": {"t": "dict", "v": [["x", json.loads("[" * 500 + "]" * 500)]]},
}.items():
    tamper(_name, _state(_tree))
tamper("model_int_keys", lambda index, meta, data: meta.update(state={"t": "dict", "v": [["model", {"t": "dict", "v": [
    [i, {"t": "tensor", "k": k}] for i, k in enumerate(index)]}]]}))
# the tensor index
for _name, _field, _value in (("shape_negative", "shape", [-3, -4]), ("shape_bool", "shape", [True, 12]),
                              ("shape_overflow", "shape", [2**64, 0]), ("shape_huge_empty", "shape", [2**62, 2**3, 0]),
                              ("shape_str", "shape", "12"), ("shape_float", "shape", [3.0, 4.0]),
                              ("dtype_unknown", "dtype", "X99"), ("dtype_int", "dtype", 5),
                              ("offsets_bool", "data_offsets", [False, True]),
                              ("offsets_huge", "data_offsets", [0, 2**70]),
                              ("offsets_negative", "data_offsets", [-48, 0]), ("offsets_str", "data_offsets", "0-48")):
    tamper(f"index_{_name}", _entry(_field, _value))
tamper("index_entry_int", lambda index, meta, data: index.__setitem__(_first_key(index), 5))
tamper("index_extra_field", _entry("evil", 1))


@case("header_deep_json")
def _deep_header(folder: Path) -> Path:
    body = b"[" * 100_000 + b"]" * 100_000
    return _framed(folder / "deep.pt", body)


@case("meta_deep_json")
def _deep_meta(folder: Path) -> Path:
    return write(folder / "deepmeta.pt", {}, None, b"", meta_text="[" * 100_000 + "]" * 100_000)


@case("meta_not_object")
def _meta_list(folder: Path) -> Path:
    return write(folder / "metalist.pt", {}, None, b"", meta_text="[1, 2]")


@case("metadata_int")
def _metadata_int(folder: Path) -> Path:
    return write(folder / "metadata.pt", {}, None, b"", metadata=5)


@case("metadata_torchplace_int")
def _metadata_tp_int(folder: Path) -> Path:
    return write(folder / "metadatatp.pt", {}, None, b"", metadata={"torchplace": 5})


@case("header_list")
def _header_list(folder: Path) -> Path:
    return _framed(folder / "list.pt", b"[1,2,3]")


@case("header_not_utf8")
def _header_bytes(folder: Path) -> Path:
    return _framed(folder / "bytes.pt", b'{"a":"\xff\xfe"}')


@case("header_nan")
def _header_nan(folder: Path) -> Path:
    return _framed(folder / "nan.pt", b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,0]}}')


@case("header_huge_int")
def _header_int(folder: Path) -> Path:
    return _framed(folder / "int.pt", b'{"w":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}')


@case("length_prefix_8eib")
def _prefix(folder: Path) -> Path:
    path = folder / "prefix.pt"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}" + b" " * 630)  # 640 bytes declaring 8 EiB
    return path


@case("header_bigger_than_budget")
def _big_header(folder: Path) -> Path:
    return _framed(folder / "bighdr.pt", b"{" + b" " * (9 * 2**20) + b"}")  # beyond format.SMALL_HEADER_BYTES


@case("truncated_stub")
def _stub(folder: Path) -> Path:
    path = folder / "stub.pt"
    path.write_bytes(b"\x10\x00")
    return path


def _framed(path: Path, body: bytes) -> Path:
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    return path


# --------------------------------------------------------------------------- torch.save files

def _torch_save(folder: Path, name: str, obj: Any) -> Path:
    path = folder / name
    torch.save(obj, path)
    return path


_W = {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}
for _name, _obj in {
    "torch_model_int_keys": {"model": {0: torch.ones(2), 1: torch.zeros(2)}},
    "torch_state_dict_int_keys": {0: torch.ones(2)},
    "torch_lightning_state_dict_int": {"state_dict": 5, "pytorch-lightning_version": "2.1.0", "global_step": 3},
    "torch_lightning_state_dict_str": {"state_dict": "weights", "pytorch-lightning_version": "2.1.0"},
    "torch_lightning_state_dict_int_keys": {"state_dict": {7: torch.ones(1)}, "global_step": 1},
    "torch_lightning_optimizer_int": {"state_dict": _W, "global_step": 1, "optimizer_states": 5},
    "torch_lightning_optimizer_bad": {"state_dict": _W, "global_step": 1,
                                      "optimizer_states": [{"state": [1], "param_groups": 3}]},
    "torch_lightning_optimizer_tensor": {"state_dict": _W, "global_step": 1, "optimizer_states": torch.ones(3)},
    "torch_training_dict_bad_optimizer": {"model": _W, "optimizer": {"state": [1, 2], "param_groups": [5]}},
    "torch_training_dict_optimizer_groups_dicts": {"model": _W, "optimizer": {"state": {0: 5},
                                                                             "param_groups": [{"params": [0, 1]}]}},
    "torch_plain_tensor": torch.ones(3),
    "torch_int": 5,
    "torch_wrong_shapes": {"model": {"weight": torch.ones(7), "bias": "x"}},
}.items():
    CASES[_name] = (lambda obj, name: lambda folder: _torch_save(folder, f"{name}.pt", obj))(_obj, _name)

DEFLATED_STORAGE_BYTES = 160 * 2**20  # beyond foreign.zip_budget for a small file (128 MiB)


@case("torch_zip_deflated_bomb")
def _zip_bomb(folder: Path) -> Path:
    """A torch.save zip re-packed with deflate: ~160 KiB on disk, 160 MiB of storage when loaded."""
    plain = _torch_save(folder, "plain.pt", {"model": {"weight": torch.zeros(DEFLATED_STORAGE_BYTES // 4)}})
    path = folder / "bomb.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst:
        for info in src.infolist():
            with src.open(info) as fin, dst.open(info.filename, "w", force_zip64=True) as fout:
                while chunk := fin.read(16 * 2**20):
                    fout.write(chunk)
    plain.unlink()
    return path


@case("torch_zip_small_deflated")
def _zip_small(folder: Path) -> Path:
    """A re-packed zip within the budget: loads (compression alone is no attack)."""
    plain = _torch_save(folder, "plain2.pt", {"model": dict(_W)})
    path = folder / "small_deflated.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    plain.unlink()
    return path


@case("torch_zip_truncated")
def _zip_trunc(folder: Path) -> Path:
    path = _torch_save(folder, "trunc.pt", {"model": dict(_W)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@case("torch_zip_garbage_pickle")
def _zip_garbage(folder: Path) -> Path:
    plain = _torch_save(folder, "plain3.pt", {"model": dict(_W)})
    path = folder / "garbage_pickle.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, b"\x80\x02}q\x00(X\x01\x00\x00\x00a" if info.filename.endswith("data.pkl")
                         else src.read(info))
    plain.unlink()
    return path


@case("pickle_garbage")
def _pickle_garbage(folder: Path) -> Path:
    path = folder / "garbage.pkl"
    path.write_bytes(b"\x80\x02" + os.urandom(600))
    return path


@case("pickle_deep_list")
def _pickle_deep(folder: Path) -> Path:
    path = folder / "deep.pkl"
    path.write_bytes(pickle.dumps(5, protocol=2)[:2] + b"]" * 50_000 + b"a" * 49_999 + b".")
    return path


# --------------------------------------------------------------------------- folders and non-regular files

@case("dir_empty")
def _dir(folder: Path) -> Path:
    path = folder / "empty_dir"
    path.mkdir()
    return path


@case("accelerate_index_traversal")
def _acc_traversal(folder: Path) -> Path:
    path = folder / "acc"
    path.mkdir()
    (path / "optimizer.bin").write_bytes(b"")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    return path


@case("accelerate_index_wrong_type")
def _acc_type(folder: Path) -> Path:
    path = folder / "acc2"
    path.mkdir()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1, 2]}))
    (path / "model-00001.safetensors").write_bytes(b"")
    return path


@case("accelerate_index_deep")
def _acc_deep(folder: Path) -> Path:
    path = folder / "acc3"
    path.mkdir()
    (path / "pytorch_model.bin.index.json").write_text("[" * 100_000 + "]" * 100_000)
    return path


@case("fifo")
def _fifo(folder: Path) -> Path:
    path = folder / "fifo.pt"
    os.mkfifo(path)
    return path


@case("dev_zero")
def _zero(folder: Path) -> Path:
    return Path("/dev/zero")


@case("dev_urandom")
def _urandom(folder: Path) -> Path:
    return Path("/dev/urandom")


@case("missing")
def _missing(folder: Path) -> Path:
    return folder / "no-such-file.pt"


# Cases whose crafted content is harmless and must load (the rest may load or be refused).
MUST_LOAD = {"genuine_resealed", "chunk_1gib", "chunk_1", "torch_zip_small_deflated"}
# Cases the memory test runs in a child process: the ones that once took gigabytes.
MEMORY_CASES = ("chunk_8gib", "chunk_1gib", "tensor_claims_8gib", "data_bytes_8gib", "length_prefix_8eib",
                "torch_zip_deflated_bomb", "dev_zero", "header_deep_json", "index_shape_huge_empty",
                "header_bigger_than_budget")
