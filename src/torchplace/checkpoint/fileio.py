"""Write one torchplace checkpoint file atomically, and read one back onto chosen devices.

`write_file` encodes the state tree, lays the tensors out, streams their bytes (with checksums)
into a temporary file behind a placeholder header, writes the final header in place, then lets
`atomic.atomic_write` fsync and rename it. `read_file` validates the header, refuses pickled
entries unless trusted, allocates every tensor on the device the caller picked for its path in
the tree, and reads the data with every chunk's checksum checked before anything is returned.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import CheckpointError
from . import codec
from .atomic import FileSink, atomic_write
from .format import (
    CHUNK_BYTES,
    FORMAT_VERSION,
    ZERO_CRC,
    Header,
    TensorEntry,
    dtype_name,
    dump_meta,
    encode_header,
    open_for_read,
    plan_layout,
    read_header,
    seal,
)
from .options import PLAIN, ReadOptions
from .stream import allocate, read_data, write_data

DeviceFor = Callable[[tuple[Any, ...]], torch.device]


def _devices_summary(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """{'default': most common device, 'except': {device: [keys]}} (compact for big models)."""
    where = {k: str(t.device) for k, t in tensors.items()}
    if not where:
        return {"default": None, "except": {}}
    default = Counter(where.values()).most_common(1)[0][0]
    others: dict[str, list[str]] = {}
    for k, d in where.items():
        if d != default:
            others.setdefault(d, []).append(k)
    return {"default": default, "except": others}


@dataclass
class Planned:
    """A state tree encoded for writing: its JSON, the tensors' layout and where they lived.

    `tensors` holds the tensors to write; a background save empties it once it has copied their bytes
    (so the caller's tensors are not kept alive) and writes through its own DataWriter instead. `paths`:
    where in the state tree each tensor was found (a repeated background save finds them there again)."""

    tree: Any
    pickled: list[str]
    entries: list[TensorEntry]
    devices: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return self.entries[-1].end if self.entries else 0


# (sink, data offset, chunk bytes, workers) -> each chunk's CRC-32 as hex
DataWriter = Callable[[Any, int, int, "int | None"], list[str]]


def plan_file(tree: dict[str, Any], *, allow_pickle: bool = False, like: Planned | None = None) -> Planned:
    """Encode TREE (non-tensor state as JSON, tensors pulled out) and lay its tensors out.

    LIKE: an earlier plan whose tensors are known to have the dtypes, shapes and devices TREE's have at the
    same paths (a background save's repeated state); where TREE yields the same tensor keys in the same
    order, its layout is taken as it is instead of being laid out again."""
    enc = codec.encode(tree, allow_pickle=allow_pickle)
    if like is not None and list(enc.tensors) == list(like.paths):
        return Planned(enc.tree, enc.pickled, like.entries, like.devices, enc.tensors, enc.paths)
    return Planned(enc.tree, enc.pickled, plan_layout(enc.tensors), _devices_summary(enc.tensors), enc.tensors,
                   enc.paths)


def write_file(target: Path, tree: dict[str, Any], *, info: dict[str, Any], allow_pickle: bool = False,
               sink: Callable[[int], Any] = FileSink, chunk_bytes: int = CHUNK_BYTES,
               workers: int | None = None) -> Path:
    """Write TREE to TARGET as one checkpoint file; INFO adds to the metadata (world size, ...).

    SINK wraps the temporary file (tests inject faults); WORKERS overrides the thread count."""
    return write_planned(target, plan_file(tree, allow_pickle=allow_pickle), info=info, sink=sink,
                         chunk_bytes=chunk_bytes, workers=workers)


def write_planned(target: Path, planned: Planned, *, info: dict[str, Any], sink: Callable[[int], Any] = FileSink,
                  chunk_bytes: int = CHUNK_BYTES, workers: int | None = None,
                  data: DataWriter | None = None) -> Path:
    """Write PLANNED to TARGET atomically. DATA writes the data region (default: from planned.tensors)."""
    entries, data_bytes = planned.entries, planned.data_bytes
    now = time.time()
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "torchplace_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": now,
        "created_utc": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        **info,
        "devices": planned.devices,
        "raw_dtypes": {e.key: [dtype_name(e.dtype), list(e.shape)] for e in entries if e.code == "U8"
                       and e.dtype != torch.uint8},
        "pickled": planned.pickled,
        "state": planned.tree,
        "data_bytes": data_bytes,
        "chunk_bytes": chunk_bytes,
        "crc32": [ZERO_CRC] * math.ceil(data_bytes / chunk_bytes),
    }
    placeholder = encode_header(entries, dump_meta(meta))

    def from_tensors(out: Any, offset: int, chunk: int, n: int | None) -> list[str]:
        return write_data(out, offset, entries, planned.tensors, data_bytes, chunk, workers=n)

    writer = data or from_tensors

    def write(out: Any) -> None:
        meta["crc32"] = writer(out, len(placeholder), chunk_bytes, workers)
        final = encode_header(entries, seal(entries, meta))
        if len(final) != len(placeholder):  # cannot happen: every field that changes is fixed-width
            raise CheckpointError(f"internal error saving {target}: the header changed length. Please report it.")
        out.pwrite(final, 0)

    return atomic_write(target, write, sink=sink)


@dataclass
class FileState:
    """What `read_file` returns: the rebuilt tree and the validated header."""

    tree: dict[str, Any]
    header: Header

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta or {}


def read_file(path: Path, device_for: DeviceFor | None, opts: ReadOptions = PLAIN, *,
              placing: Callable[[Header], DeviceFor] | None = None) -> FileState:
    """Read PATH; DEVICE_FOR(path_in_tree) picks each tensor's device, or PLACING(header) gives that
    function where the choice depends on what the file holds (its header is read once); every checksum
    is checked."""
    fd = open_for_read(path)
    try:
        header = read_header(path, fd)
        device_for = placing(header) if placing is not None else device_for
        assert device_for is not None, "read_file needs device_for or placing"
        if header.meta is None:  # a safetensors file from another tool: its tensors are the model
            targets = {e.key: device_for(("model", e.key)) for e in header.entries}
            out = allocate(header, targets)
            read_data(fd, header, out, workers=opts.workers)
            return FileState({"model": out}, header)
        meta = header.meta
        if meta.get("pickled") and not opts.trust_pickle:
            raise CheckpointError(f"{path} holds entries that only pickle can rebuild ({', '.join(meta['pickled'])}; "
                                  "saved with allow_pickle=True), and a pickle runs code when loaded. "
                                  f"{codec.PICKLE_FIX}")
        paths = codec.tensor_keys_by_path(meta["state"])
        targets = {key: device_for(p) for p, key in paths.items()}
        out = allocate(header, targets)
        read_data(fd, header, out, workers=opts.workers)
    finally:
        os.close(fd)
    unpickle = (lambda key: codec.unpickle_bytes(out[key])) if opts.trust_pickle else None
    try:
        tree = codec.decode(meta["state"], out.__getitem__, unpickle=unpickle)
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: the saved state does not decode ({exc}); it was written by a newer or "
                              "different torchplace. Fix: upgrade torchplace.") from None
    return FileState(tree, header)
