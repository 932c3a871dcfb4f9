"""The on-disk layout of a torchplace checkpoint, and the checks that make a damaged file raise.

A checkpoint is a valid safetensors file, so any safetensors reader can open its tensors:

    [u64 little-endian N][N bytes of JSON header, space-padded to a multiple of 8][tensor bytes]

The header is safetensors' own: one entry per tensor (dtype, shape, data_offsets into the data
region, back to back with no holes) and a ``__metadata__`` map of strings. torchplace writes its
metadata as one JSON string under ``__metadata__["torchplace"]``, first, so every torchplace
header starts with the same bytes (``HEADER_PREFIX``). That metadata carries:

- ``state``: everything that is not a tensor (optimizer hyperparameters, scheduler counters, RNG
  tuples, user extras) as tagged JSON (see ``codec``), with references to the tensors by key;
- ``crc32``: one CRC-32 per ``chunk_bytes`` slice of the data region, so a flipped bit anywhere in
  the tensors is caught, and named by the tensors it falls in;
- ``header_crc32`` (last, fixed width): a CRC-32 of the metadata text as stored, the tensor index
  and the rest of ``__metadata__``, so a flipped bit in a shape, a key or a learning rate is caught;
- versions, creation time, world size and the device every tensor was saved from.

Checksums are fixed-width hex strings, so the header's length is known before the data is
written: the writer streams the data first and writes the final header last, in place.
Tensors whose dtype safetensors cannot name (complex128, ...) are stored as raw bytes (``U8``)
with the real dtype in the metadata, so the file stays a valid safetensors file.
"""

from __future__ import annotations

import json
import os
import string
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import safeio
from ..errors import CheckpointError, CheckpointFormatError
from .codec import dtype_by_name, skeleton
from .state_dicts import layout_problem

FORMAT_VERSION = 1
META_KEY = "torchplace"
HEADER_PREFIX = b'{"__metadata__":{"' + META_KEY.encode() + b'":"'
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
# Parsed JSON takes up to ~24x its text ("[{},{},...]"); a header may take 1/12 of its file, so
# parsing it costs at most 2x the file (or ~200 MiB for a header of up to SMALL_HEADER_BYTES).
SMALL_HEADER_BYTES = 8 * 2**20
MAX_DIM = 2**62  # a tensor dimension (and element count) beyond this is no real tensor
CHUNK_BYTES = 16 * 2**20
SMALL_TENSOR_BYTES = 2**20  # tensors under this are laid out together (plan_layout) and copied in one piece
ZERO_CRC = "00000000"
SIDE_FILE = "torchplace.safetensors"  # in a sharded checkpoint's DCP folder: everything but the shards
# the rest of __metadata__: "format": "pt" tells tools such as transformers that these are torch tensors
OTHER_METADATA = {"format": "pt"}

DAMAGED_FIX = ("Fix: load an older checkpoint (torchplace.load(DIRECTORY) picks the newest complete one) "
               "or copy the file again from where it was made.")

# safetensors dtype codes -> torch dtypes; what is not here is stored as raw bytes (U8)
_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _code, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("C64", "complex64"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        _CODES[_code] = getattr(torch, _name)
_DTYPE_CODE: dict[torch.dtype, str] = {v: k for k, v in _CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name used in metadata and by `torchplace ckpt inspect`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, path: Path | str) -> torch.dtype:
    value = dtype_by_name(name)
    if value is None:
        raise CheckpointError(f"{path}: the metadata names dtype {name!r}, which this torch "
                              f"({torch.__version__}) does not have. Fix: load it with a newer torch.")
    return value


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the data region, and what it is."""

    key: str
    dtype: torch.dtype  # the real dtype (the header may say U8 for raw-stored ones)
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def code(self) -> str:
        """The safetensors dtype code written in the header."""
        return _DTYPE_CODE.get(self.dtype, "U8")

    @property
    def header_shape(self) -> list[int]:
        return list(self.shape) if self.dtype in _DTYPE_CODE else [self.nbytes]


@dataclass
class Header:
    """A parsed, validated header. `meta` is None for a safetensors file not made by torchplace."""

    path: Path
    entries: list[TensorEntry]  # in data-offset order
    meta: dict[str, Any] | None
    foreign_metadata: dict[str, str]
    data_offset: int
    data_bytes: int
    skeleton: Any = None  # torchplace's saved tree with a TensorRef for each tensor, as validated (None: foreign)

    @property
    def by_key(self) -> dict[str, TensorEntry]:
        return {e.key: e for e in self.entries}


def plan_layout(tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    """Lay tensors out back to back, widest element first, so every offset stays aligned. Within a width,
    tensors under SMALL_TENSOR_BYTES come after the larger ones, together (by device): a copy of the state
    (save_async's) takes each such run in one piece instead of one call per bias or norm."""
    runs: dict[tuple[int, bool, torch.device | None], list[tuple[str, torch.Tensor, int]]] = {}
    for key, t in tensors.items():
        width = t.element_size()
        nbytes = t.numel() * width
        small = nbytes < SMALL_TENSOR_BYTES
        runs.setdefault((width, small, t.device if small else None), []).append((key, t, nbytes))
    entries, offset = [], 0
    for run in sorted(runs, key=lambda r: (-r[0], r[1])):  # stable: key order within a run, devices as first seen
        for key, t, nbytes in runs[run]:
            entries.append(TensorEntry(key, t.dtype, tuple(t.shape), offset, offset + nbytes))
            offset += nbytes
    return entries


_CRC_TAIL = '"header_crc32":"'


def dump_meta(meta: dict[str, Any], header_crc: str = ZERO_CRC) -> str:
    """META as the JSON string stored in the header; header_crc32 always comes last."""
    body = {k: v for k, v in meta.items() if k != "header_crc32"}
    text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    return text[:-1] + ("," if body else "") + f'{_CRC_TAIL}{header_crc}"}}'


def _header_crc(entries: list[TensorEntry], meta_text: str, other: dict[str, str]) -> str:
    """CRC-32 of the metadata text exactly as stored (its own crc zeroed), the index and the rest of
    __metadata__: any changed byte changes it, even one that decodes to the same value."""
    zeroed = meta_text[:-10] + ZERO_CRC + meta_text[-2:]
    index = [[e.key, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in entries]
    rest = json.dumps({"index": index, "other": other}, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32((zeroed + rest).encode()):08x}"


def seal(entries: list[TensorEntry], meta: dict[str, Any]) -> str:
    """META's stored JSON text, with header_crc32 set over itself, the index and OTHER_METADATA."""
    return dump_meta(meta, _header_crc(entries, dump_meta(meta), OTHER_METADATA))


def encode_header(entries: list[TensorEntry], meta_text: str) -> bytes:
    """The length prefix and the padded JSON header for ENTRIES and the metadata text (`dump_meta`)."""
    header: dict[str, Any] = {"__metadata__": {META_KEY: meta_text, **OTHER_METADATA}}
    for e in entries:
        header[e.key] = {"dtype": e.code, "shape": e.header_shape, "data_offsets": [e.start, e.end]}
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is damaged: {what}. {DAMAGED_FIX}")


def _near_prefix(raw: bytes) -> bool:
    """True when RAW starts with torchplace's prefix but for a few flipped bytes."""
    head = raw[:len(HEADER_PREFIX)]
    return len(head) == len(HEADER_PREFIX) and sum(a != b for a, b in zip(head, HEADER_PREFIX)) <= 4


def open_for_read(path: Path) -> int:
    """A read-only file descriptor for the regular file PATH, or a CheckpointError that says how to find one."""
    fd, _ = safeio.open_regular(path, CheckpointError, "Fix: check the path; torchplace.load(DIRECTORY) finds "
                                                       "the newest checkpoint in a directory.")
    return fd


def header_limit(file_size: int) -> int:
    """The longest header read from a file of FILE_SIZE bytes (see SMALL_HEADER_BYTES)."""
    return min(MAX_HEADER_BYTES, max(SMALL_HEADER_BYTES, file_size // 12))


def read_header(path: str | os.PathLike[str], fd: int | None = None) -> Header:
    """Read and validate the header of PATH (or of the open FD); raise CheckpointError if damaged.

    Checks the length prefix, the JSON, every tensor entry, that the entries tile the data region
    with no holes, that the file is exactly as long as the header says (a truncated file fails
    here) and, for torchplace files, the header checksum and every metadata field. Tensor data is
    not read.
    """
    path = Path(path)
    own = fd is None
    if fd is None:
        fd = open_for_read(path)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(f"{path} is {size} bytes long: too short to be a checkpoint of any kind (it is "
                                  "empty, cut short, or another kind of file). Fix: check the path; if it is a "
                                  "checkpoint cut short, load an older one (torchplace.load(DIRECTORY) picks the "
                                  "newest complete one).")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > size - 8:
            raise _damaged(path, f"the header length prefix says {n} bytes but the file holds only "
                                 f"{size - 8} after it (truncated, or not a safetensors/torchplace file)")
        if n > header_limit(size):
            raise _damaged(path, f"the header length prefix says {n} bytes; a file of {size} bytes may have a "
                                 f"header of at most {header_limit(size)} (not a safetensors/torchplace file)")
        raw = os.pread(fd, n, 8)
        if len(raw) != n:
            raise _damaged(path, f"could read only {len(raw)} of the {n} header bytes")
    finally:
        if own:
            os.close(fd)
    return parse_header(path, raw, size)


def cut_short(path: Path) -> str | None:
    """How the .safetensors file PATH falls short of the length its own header gives (a copy cut short by a
    full disk), or None: it is not cut, not a regular .safetensors file, or cannot be read. Never raises."""
    try:
        if path.suffix != ".safetensors" or not path.is_file():  # a FIFO would block the open
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                return f"it is {size} bytes long, shorter than a header's length prefix"
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if n > size - 8:
                return f"its header alone is {n} bytes long, and only {size - 8} bytes follow its length prefix"
            header = safeio.loads(os.pread(fd, n, 8)) if n <= header_limit(size) else None
        finally:
            os.close(fd)
        ends = [info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"]
        expected = 8 + n + max(ends, default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None
    return f"its header describes {expected} bytes, the file has {size}" if size < expected else None


def parse_header(path: Path, raw: bytes, file_size: int) -> Header:
    """Validate RAW (the header bytes after the length prefix) of a file of FILE_SIZE bytes."""
    ours = raw.startswith(HEADER_PREFIX)
    if not ours and _near_prefix(raw):
        raise _damaged(path, "the header's opening bytes differ from torchplace's by a few bytes")
    try:
        header = safeio.loads(raw)
    except ValueError as exc:
        raise _damaged(path, f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _damaged(path, "__metadata__ is not a map of strings")
    meta = None
    if ours:
        try:
            meta_text = metadata[META_KEY]
            meta = safeio.loads(meta_text)
        except (KeyError, ValueError) as exc:
            raise _damaged(path, f"torchplace's metadata is not valid JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise _damaged(path, "torchplace's metadata is not a JSON object")
    raw_dtypes = (meta or {}).get("raw_dtypes", {})
    if not isinstance(raw_dtypes, dict) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) for v in raw_dtypes.values()):
        raise _damaged(path, "the metadata's raw_dtypes is not a map of [dtype name, shape]")
    entries = []
    for key, info in header.items():
        entries.append(_entry(path, key, info, raw_dtypes))
    entries.sort(key=lambda e: (e.start, e.end))
    offset = 0
    for e in entries:
        if e.start != offset:
            raise _damaged(path, f"tensor {e.key!r} starts at data byte {e.start}, expected {offset} "
                                 "(the tensor index has a hole or an overlap)")
        offset = e.end
    data_offset = 8 + len(raw)
    expected = data_offset + offset
    if file_size < expected:
        raise _damaged(path, f"the file is truncated: the header describes {expected} bytes, the file "
                             f"has {file_size} ({expected - file_size} missing)")
    if file_size > expected:
        raise _damaged(path, f"the file has {file_size - expected} unexpected bytes after the last tensor "
                             f"(expected {expected} bytes in all)")
    foreign = {k: v for k, v in metadata.items() if k != META_KEY}
    tree = _check_meta(path, entries, meta_text, meta, foreign, offset) if meta is not None else None
    return Header(path, entries, meta, foreign, data_offset, offset, tree)


def _shape_numel(shape: Any) -> int | None:
    """The element count of SHAPE, or None unless it is a list of non-negative ints (not bools) whose
    non-zero dimensions multiply to less than MAX_DIM (torch refuses larger shapes, even empty ones)."""
    if not isinstance(shape, list):
        return None
    numel = nonzero = 1
    for d in shape:  # one pass (every header entry goes through here on every load)
        if type(d) is not int or not 0 <= d < MAX_DIM:
            return None
        numel *= d
        if d:
            nonzero *= d
            if nonzero >= MAX_DIM:
                return None
    return numel


_ENTRY_FIELDS = frozenset(("dtype", "shape", "data_offsets"))


def _entry(path: Path, key: str, info: Any, raw_dtypes: dict[str, list[Any]]) -> TensorEntry:
    if not isinstance(info, dict) or not info.keys() <= _ENTRY_FIELDS:
        raise _damaged(path, f"the entry for tensor {key!r} is malformed")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or code not in _CODES:
        raise _damaged(path, f"tensor {key!r} has dtype code {code!r}, which torchplace does not know "
                             f"(known: {', '.join(_CODES)})")
    numel = _shape_numel(shape)
    if (numel is None or not isinstance(offsets, list) or len(offsets) != 2
            or type(offsets[0]) is not int or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
        raise _damaged(path, f"tensor {key!r} has an invalid shape or data_offsets (shape {shape!r:.80}, "
                             f"data_offsets {offsets!r:.80}; each must be a list of non-negative integers)")
    dtype = _CODES[code]
    if numel * dtype.itemsize != offsets[1] - offsets[0]:
        raise _damaged(path, f"tensor {key!r} is {code}{shape} ({numel * dtype.itemsize} bytes) but its "
                             f"data_offsets span {offsets[1] - offsets[0]} bytes")
    if key in raw_dtypes:  # stored as raw bytes; the metadata holds the real dtype and shape
        real_name, real_shape = raw_dtypes[key]
        dtype, numel = dtype_from_name(real_name, path), _shape_numel(real_shape)
        if code != "U8" or numel is None or numel * dtype.itemsize != offsets[1] - offsets[0]:
            raise _damaged(path, f"raw tensor {key!r} does not match its recorded dtype and shape")
        shape = real_shape
    return TensorEntry(key, dtype, tuple(shape), offsets[0], offsets[1])


_HEX = frozenset(string.hexdigits.lower())
MAX_CHUNK_BYTES = 2**30


def _is_crc(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 8 and set(value) <= _HEX


def _check_meta(path: Path, entries: list[TensorEntry], meta_text: str, meta: dict[str, Any],
                other: dict[str, str], data_bytes: int) -> Any:
    """Raise for torchplace metadata that is altered or malformed; return its state's skeleton (`codec.skeleton`)."""
    found = meta.get("header_crc32")
    if not isinstance(found, str) or not meta_text.endswith(f'{_CRC_TAIL}{found}"}}') or len(found) != 8:
        raise _damaged(path, "the metadata has no header checksum where torchplace writes it")
    want = _header_crc(entries, meta_text, other)
    if found != want:
        raise _damaged(path, f"the header checksum does not match (recorded {found}, computed {want}): "
                             "a shape, key or metadata value was altered")
    version = meta.get("format_version")
    if type(version) is not int or version < 1:  # no torchplace, older or newer, writes another: not "upgrade"
        raise _damaged(path, f"its format_version is {version!r:.40}, not a whole number from 1 up as every "
                             "torchplace writes")
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(f"{path} uses torchplace checkpoint format {version!r:.40}; this torchplace "
                              f"reads up to {FORMAT_VERSION}. Fix: upgrade torchplace.")
    chunk, crcs = meta.get("chunk_bytes"), meta.get("crc32")
    if type(meta.get("data_bytes")) is not int or meta["data_bytes"] != data_bytes or type(chunk) is not int \
            or not 0 < chunk <= MAX_CHUNK_BYTES or not isinstance(crcs, list) \
            or len(crcs) != -(-data_bytes // chunk) or not all(_is_crc(c) for c in crcs):
        raise _damaged(path, "the data size, the chunk size or the checksum list does not match the tensor index "
                             f"(chunks are 1 byte to {MAX_CHUNK_BYTES} bytes, one 8-digit hex CRC-32 each)")
    problem, tree = _meta_problem(meta, {e.key for e in entries})
    if problem:
        raise _damaged(path, f"the metadata is malformed: {problem}")
    return tree


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _meta_problem(meta: dict[str, Any], keys: set[str]) -> tuple[str | None, Any]:
    """(what is wrong with the metadata fields readers use, None when nothing: their JSON types, and the
    state tree (see `codec.skeleton`); the state's skeleton once it decodes). The checksum says a file is
    intact, not that it is well-formed."""
    devices = meta.get("devices", {})
    if not isinstance(devices, dict) or not isinstance(devices.get("default"), (str, type(None))) \
            or not isinstance(devices.get("except", {}), dict) \
            or not all(_is_str_list(v) for v in devices.get("except", {}).values()):
        return "'devices' is not {'default': device, 'except': {device: [keys]}}", None
    if not _is_str_list(meta.get("pickled", [])):
        return "'pickled' is not a list of strings", None
    versions = meta.get("module_versions", {})
    if not isinstance(versions, dict) or not all(isinstance(v, dict) for v in versions.values()):
        return "'module_versions' is not a map of maps", None
    for name, kind in (("world_size", int), ("primary_device", str), ("objects", dict)):
        if name in meta and meta[name] is not None and not isinstance(meta[name], kind):
            return f"{name!r} is a {type(meta[name]).__name__}, not a {kind.__name__}", None
    if "state" not in meta:
        return "there is no 'state' (the saved tree)", None
    try:
        tree = skeleton(meta["state"], keys)
    except ValueError as exc:
        return f"the saved state does not decode ({exc})", None
    return layout_problem(tree), tree
