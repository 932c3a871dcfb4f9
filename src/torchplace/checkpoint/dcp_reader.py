"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it.

Safety: DCP keeps its metadata as a pickle and every non-tensor value as a torch.save pickle, and
torch's own reader unpickles both without limits. torchplace reads `.metadata` with an unpickler
that only builds DCP's own record classes, checks every record against the folder's real files,
and reads the other pickles with torch.load(weights_only=True) (`SafeLoadPlanner`): no code from
the files runs unless the caller passed trust_pickle=True.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import io
import pickle
import stat
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from .. import safeio
from ..errors import CheckpointError
from .codec import PICKLE_FIX
from .foreign import check_zip_stream
from .options import ReadOptions


class _Refused(pickle.UnpicklingError):
    """A class the metadata names that is not one of DCP's records (a truncated pickle is another error)."""


class _Malformed(pickle.UnpicklingError):
    """A record built with more than DCP writes (a state with unknown fields, a size of 10,000 dimensions)."""


_METADATA = "torch.distributed.checkpoint.metadata"
# exactly the classes DCP's writer puts in .metadata (torch 2.x): its records, one enum, the file records
_RECORDS = {(_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                           "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                           "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
MAX_RANK = 64  # dimensions of a tensor record: torch's kernels stop at 25


def _checked_record(cls: type) -> type:
    """CLS as the unpickler builds it: a subclass whose __setstate__ takes a state of about CLS's own
    fields only (the C unpickler copies a state dict into every object built from it, so a state
    shared through the memo with a million keys would be copied per record) and then turns the object
    into a plain CLS."""
    made = _CHECKED.get(cls)
    if made is not None:
        return made
    names = {f.name for f in dataclasses.fields(cls)}
    base_setstate = vars(cls).get("__setstate__")

    def __setstate__(self: Any, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
            state = state[0] if not state[1] else None  # (dict, slot state): DCP's records have no slots
        if base_setstate is not None and isinstance(state, tuple) and len(state) <= len(names):
            base_setstate(self, state)  # TensorProperties: a tuple of its fields
        elif isinstance(state, dict) and len(state) <= len(names) + _SPARE_FIELDS and all(
                type(k) is str for k in state):
            self.__dict__.update(state)
        else:
            raise _Malformed(f"a {cls.__name__} record with a state that is not its fields ({type(state).__name__} "
                             f"of {len(state) if hasattr(state, '__len__') else '?'} items)")
        object.__setattr__(self, "__class__", cls)

    made = type(cls.__name__, (cls,), {"__setstate__": __setstate__, "__slots__": (), "__module__": cls.__module__})
    _CHECKED[cls] = made
    return made


_CHECKED: dict[type, type] = {}
_SPARE_FIELDS = 8  # fields a newer torch may have added to a record (set as DCP itself would)


def _settle(root: Any) -> None:
    """Turn every record still of a `_checked_record` class (one the pickle built without a state, such as
    BytesStorageMetadata) into its plain DCP class, so it compares and pickles as DCP's own. Each object
    is visited once, however often the memo shares it."""
    plain = {made: cls for cls, made in _CHECKED.items()}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        cls = plain.get(type(obj))
        if cls is not None:
            object.__setattr__(obj, "__class__", cls)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(vars(obj).values())


class _SafeUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records, torch sizes/dtypes and paths; refuses anything else.

    Work stays in proportion to the file: a size or state shared through the pickle memo is built
    once (`_size`), not copied per record that refers to it."""

    _EXACT = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._sizes: dict[int, tuple[Any, torch.Size]] = {}

    def _size(self, dims: Any = ()) -> torch.Size:
        """torch.Size(DIMS), one object per DIMS object (the tuple is kept, so its id stays its own)."""
        known = self._sizes.get(id(dims))
        if known is not None:
            return known[1]
        if not isinstance(dims, (tuple, list)) or len(dims) > MAX_RANK:
            raise _Malformed(f"a tensor size of {len(dims) if hasattr(dims, '__len__') else '?'} dimensions "
                             f"(at most {MAX_RANK})")
        size = torch.Size(dims)
        self._sizes[id(dims)] = (dims, size)
        return size

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch", "Size"):
            return self._size
        if (module, name) == ("collections", "OrderedDict"):
            return _empty_ordered_dict
        if (module, name) in self._EXACT:
            return super().find_class(module, name)
        value = vars(torch).get(name) if module == "torch" else None  # getattr would import torch._dynamo
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        if (module, name) in _RECORDS:
            importlib.import_module("torch.distributed.checkpoint")  # imports both modules of _RECORDS
            obj = super().find_class(module, name)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                return obj
            if isinstance(obj, type) and dataclasses.is_dataclass(obj):
                return _checked_record(obj)
        raise _Refused(f"{module}.{name} is not a DCP metadata class")


def _empty_ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    """OrderedDict as pickle builds it (empty, then filled item by item); a copy of a list from the memo
    per call is refused."""
    if args:
        raise _Malformed("an OrderedDict built from an argument")
    return collections.OrderedDict()


def is_dcp_dir(path: Path) -> bool:
    """A folder with DCP's `.metadata` file (not one this user may not enter: a series beside it is still read)."""
    try:
        return path.is_dir() and (path / ".metadata").is_file()
    except PermissionError:
        return False


MAX_METADATA_BYTES = 2**31  # DCP's .metadata: tens of MiB for the largest sharded models
_RECOPY = "Fix: check that the checkpoint folder was copied completely."


def read_dcp_metadata(path: Path) -> Any:
    """DCP's metadata record of the checkpoint at PATH, read without running code and checked
    (`records_problem`) to be made of DCP's records as DCP writes them.

    The file is read into memory first (a regular file, at most MAX_METADATA_BYTES), so a length
    field in the pickle that claims more bytes than the file holds fails as truncated instead of
    allocating what it claims."""
    where = path / ".metadata"
    data = safeio.read_limited(where, MAX_METADATA_BYTES, CheckpointError, _RECOPY)
    try:
        metadata = _SafeUnpickler(io.BytesIO(data)).load()
        _settle(metadata)
    except _Refused as exc:
        raise CheckpointError(f"{where} needs more than DCP's own records to load ({exc}); torchplace does not "
                              f"run code from checkpoints. {PICKLE_FIX}") from None
    except (Exception, RecursionError) as exc:  # truncated or malformed: any error of the unpickler
        raise CheckpointError(f"{where} cannot be read as DCP metadata ({type(exc).__name__}: "
                              f"{_first_line(exc)}). {_RECOPY}") from None
    problem = records_problem(metadata)
    if problem is not None:
        raise CheckpointError(f"{where} is not DCP metadata as torch.distributed.checkpoint writes it: {problem}. "
                              f"{_RECOPY}")
    return metadata


def _dims(value: Any, rank: int | None = None) -> bool:
    """VALUE is a tuple or list (torch.Size is a tuple) of RANK non-negative ints."""
    return isinstance(value, (tuple, list)) and all(type(d) is int and d >= 0 for d in value) and (
        rank is None or len(value) == rank)


def records_problem(metadata: Any) -> str | None:
    """What is wrong with the shape of a DCP metadata record (None when nothing): its class, its
    tables, and every entry's fields. The restricted unpickler builds only DCP's record classes, but
    fills their fields with whatever the file holds: an int where a list of chunks belongs."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata record"
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict):
        return f"its entry table (state_dict_metadata) is a {type(entries).__name__}, not a map"
    if storage is not None and (not isinstance(storage, dict)
                                or not all(isinstance(k, MetadataIndex) and isinstance(getattr(k, "fqn", None), str)
                                           for k in storage)):
        return "its storage table (storage_data) is not a map from DCP's MetadataIndex records"
    # every chunk has a storage record of its own, which costs bytes of the file: a chunk list shared
    # through the pickle memo by a million entries would otherwise be walked a million times
    listed = sum(len(c) for c in (getattr(md, "chunks", None) for md in entries.values()) if isinstance(c, list))
    if listed > len(storage or ()):
        return (f"its entries list {listed} chunks, but it has {len(storage or ())} storage records (each chunk "
                "has its own)")
    for fqn, md in entries.items():
        if not isinstance(fqn, str):
            return f"an entry's name is a {type(fqn).__name__} ({fqn!r:.60}), not a string"
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            return f"the entry {fqn!r:.80} is a {type(md).__name__}, not a tensor or bytes record"
        size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
        if not isinstance(getattr(getattr(md, "properties", None), "dtype", None), torch.dtype) or not _dims(size):
            return f"the tensor {fqn!r:.80} has no dtype or a malformed size ({size!r:.80})"
        if not isinstance(chunks, list) or not all(
                isinstance(c, ChunkStorageMetadata) and _dims(getattr(c, "offsets", None), len(size))
                and _dims(getattr(c, "sizes", None), len(size))
                and all(o + n <= d for o, n, d in zip(c.offsets, c.sizes, size)) for c in chunks):
            return (f"the chunks of {fqn!r:.80} are not a list of chunk records within its size "
                    f"{list(size)!r:.80}")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _nbytes(sizes: Any, dtype: Any) -> int:
    numel = 1
    for d in sizes:
        numel *= int(d)
    return numel * dtype.itemsize


def compressed_budget(stored: int) -> int:
    """The most bytes an untrusted DCP folder whose records are compressed may unpack to (declare, and
    then really unpack) for STORED bytes of files: twice that, or 256 MiB, the bound of every input
    (docs/security.md); trust_pickle lifts it."""
    return max(2 * stored, 2**28)


def check_storage(root: Path, metadata: Any, trusted: bool = False) -> int:
    """Refuse DCP metadata whose records point outside ROOT, past the end of a file, or at fewer
    bytes than the tensors they declare; so reading costs no more memory than the files hold (for
    compressed records, than `compressed_budget` of them, unless TRUSTED). Returns that budget, which
    the reader holds the unpacking to (`_BoundedTransforms`)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = root / ".metadata"
    problem = records_problem(metadata)
    if problem is not None:
        raise CheckpointError(f"{where} is not DCP metadata as torch.distributed.checkpoint writes it: {problem}. "
                              f"{_RECOPY}")
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{where} lacks the entry and storage tables DCP writes. Fix: point at a folder "
                              "written by torch.distributed.checkpoint.save.")
    base = root.resolve()
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        rel, offset, length = (getattr(info, "relative_path", None), getattr(info, "offset", None),
                               getattr(info, "length", None))
        if not isinstance(rel, str) or not all(type(v) is int and v >= 0 for v in (offset, length)):
            raise CheckpointError(f"{where}: the storage record of {getattr(index, 'fqn', index)!r} is malformed "
                                  f"(file {rel!r}, offset {offset!r}, length {length!r}). Fix: re-save the checkpoint.")
        if rel not in sizes:
            file = root / rel
            try:  # a NUL byte in the name: ValueError from the system call
                outside = (Path(rel).is_absolute() or ".." in Path(rel).parts
                           or not file.resolve().is_relative_to(base))
                st = None if outside else file.stat()
            except (OSError, ValueError) as exc:
                why = exc.strerror if isinstance(exc, OSError) else _first_line(exc)
                raise CheckpointError(f"{where} names {rel!r:.200}, which cannot be opened ({why}). Fix: copy "
                                      "the whole checkpoint folder.") from None
            if st is None:
                raise CheckpointError(f"{where} names {rel!r:.200}, which is outside {root}; torchplace reads only "
                                      "the checkpoint's own files. Fix: use a checkpoint folder as DCP writes it.")
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{root / rel} is not a regular file. Fix: use a checkpoint folder as DCP "
                                      "writes it.")
            sizes[rel] = st.st_size
        if offset + length > sizes[rel]:
            raise CheckpointError(f"{root / rel} has {sizes[rel]} bytes, but {where} places "
                                  f"{getattr(index, 'fqn', index)!r} at bytes {offset}..{offset + length}. "
                                  "Fix: the file is truncated or the metadata is not its own; copy the folder again.")
    total = 0
    for fqn, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(md.size, torch.Size) or any(d < 0 for d in md.size):
            raise CheckpointError(f"{where}: {fqn!r} declares a malformed tensor (dtype {dtype!r}, size "
                                  f"{md.size!r}). Fix: re-save the checkpoint.")
        total += _nbytes(md.size, dtype)
        declared = sum(_nbytes(c.sizes, dtype) for c in md.chunks)
        if declared < _nbytes(md.size, dtype):
            raise CheckpointError(f"{where}: the chunks of {fqn!r} cover {declared} bytes of its "
                                  f"{_nbytes(md.size, dtype)}. Fix: re-save the checkpoint.")
        for chunk in md.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{where}: a chunk of {fqn!r} (at {list(chunk.offsets)}) has no storage record. "
                                      "Fix: copy the whole checkpoint folder.")
            if not info.transform_descriptors and info.length < _nbytes(chunk.sizes, dtype):
                raise CheckpointError(f"{root / info.relative_path}: {fqn!r} declares "
                                      f"{_nbytes(chunk.sizes, dtype)} bytes but stores {info.length}. Fix: the "
                                      "metadata is not this folder's own; copy the folder again.")
    compressed = any(getattr(info, "transform_descriptors", None) for info in storage.values())
    stored = sum(sizes.values())
    if compressed and not trusted and total > compressed_budget(stored):
        raise CheckpointError(f"{where} declares {total} bytes of tensors stored compressed in {stored} bytes; "
                              f"torchplace unpacks at most {compressed_budget(stored)} from a folder this size "
                              "unless it is trusted (a record marked compressed is not checked against its file). "
                              "Fix: if you trust whoever made the folder, load it with trust_pickle=True.")
    if not compressed and total > stored:
        raise CheckpointError(f"{where} declares {total} bytes of tensors, but its files hold {sum(sizes.values())}. "
                              "Fix: the metadata is not this folder's own; copy the folder again.")
    return compressed_budget(stored)


def reader_classes() -> tuple[type, type]:
    """(SafeReader, SafeLoadPlanner), built on first use so importing torchplace does not import DCP."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader, except that `.metadata` goes through torchplace's restricted unpickler
        (unless trust_pickle) and its records are checked (`check_storage`) before anything is read.
        Tensor items are read by DCP itself with torch.load(weights_only=True): no code runs."""

        def __init__(self, root: Path, trust_pickle: bool) -> None:
            super().__init__(str(root))
            self.root, self.trust_pickle = root, trust_pickle
            if not trust_pickle:
                self.transforms = _BoundedTransforms(self.transforms, self)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.trust_pickle:
                metadata = super().read_metadata(*args, **kwargs)
            else:
                metadata = read_dcp_metadata(self.root)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
            self.unpack_budget = check_storage(self.root, metadata, trusted=self.trust_pickle)
            return metadata

        def set_up_storage_reader(self, metadata: Any, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, *args, **kwargs)
            if not hasattr(self, "unpack_budget"):  # a rank that was sent the metadata instead of reading it
                self.unpack_budget = check_storage(self.root, metadata, trusted=self.trust_pickle)

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner, except that non-tensor (BYTE_IO) items never run code.

        DCP stores each non-tensor value as a torch.save pickle, and DefaultLoadPlanner.load_bytes
        reads it with torch.load(weights_only=False): any callable named in the file runs. Here they
        are read with weights_only=True (torch's restricted unpickler: tensors, numbers, strings,
        containers, no imports), which is all that model and optimizer state hold (param groups,
        steps), so such folders still load; anything more is refused unless trust_pickle. A value
        arriving in a slot that holds a tensor must be a tensor of that shape. Keys are used as given
        (flatten_state_dict=False): callers pass flat DCP keys.
        """

        def __init__(self, root: Path, trust_pickle: bool) -> None:
            super().__init__(flatten_state_dict=False)
            self.root, self.trust_pickle = root, trust_pickle

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
            where = self.root / info.relative_path if info is not None else self.root
            if not self.trust_pickle and zipfile.is_zipfile(value):  # DCP writes items with torch.save: never
                size = value.seek(0, io.SEEK_END)                        # compressed, so never larger unpacked
                check_zip_stream(value, size, size, f"{where}: the item {fqn!r}")
            value.seek(0)
            try:
                obj = torch.load(value, map_location="cpu", weights_only=not self.trust_pickle)
            except pickle.UnpicklingError as exc:
                first = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln or "GLOBAL" in ln),
                             "")
                raise CheckpointError(f"{where}: the item {fqn!r} is a pickle that needs code from the file to load"
                                      f"{f' ({first})' if first else ''}; torchplace does not run code from "
                                      f"checkpoints by default. {PICKLE_FIX}") from None
            except Exception as exc:
                raise CheckpointError(f"{where}: the item {fqn!r} cannot be read ({_first_line(exc)}). Fix: check "
                                      "that the checkpoint folder was copied completely.") from None
            current = self.state_dict.get(fqn)
            if isinstance(current, torch.Tensor):
                if not isinstance(obj, torch.Tensor) or obj.shape != current.shape:
                    got = f"a tensor of shape {list(obj.shape)}" if isinstance(obj, torch.Tensor) else \
                        f"a {type(obj).__name__}"
                    raise CheckpointError(f"{where}: the item {fqn!r} holds {got} where the model has a tensor of "
                                          f"shape {list(current.shape)}. Fix: load it into the model it was saved "
                                          "from.")
                current.detach().copy_(obj)
                return
            self.state_dict[fqn] = obj
            if fqn in self.original_state_dict:
                self.original_state_dict[fqn] = obj

    _CLASSES = (SafeReader, SafeLoadPlanner)
    return _CLASSES


_CLASSES: tuple[type, type] | None = None


class _BoundedTransforms:
    """DCP's load-stream transforms, held to what the folder's files can hold: every item a compressed
    record unpacks to is read up to what is left of the folder's `compressed_budget` (DCP would read it
    whole), and every tensor item is a torch.save zip whose members unpack to at most the bytes it
    stores (torch.save never compresses; DCP's reader hands tensor items to torch.load unchecked, and a
    deflated member of 1 MB unpacks to 1 GiB there)."""

    def __init__(self, inner: Any, reader: Any) -> None:
        self.inner, self.reader = inner, reader

    def transform_load_stream(self, read_item: Any, descriptors: Any, raw_stream: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType

        out = self.inner.transform_load_stream(read_item, descriptors, raw_stream)
        info = self.reader.storage_data[read_item.storage_index]
        where = f"{self.reader.root / info.relative_path}: the item {read_item.storage_index.fqn!r}"
        if descriptors:
            left = getattr(self.reader, "unpack_budget", 0)
            data = out.read(left + 1)
            if len(data) > left:
                raise CheckpointError(f"{where} is stored compressed and unpacks to more than the {left} bytes left "
                                      "of what torchplace unpacks from this folder (twice its files, at least 256 "
                                      "MiB). Fix: if you trust whoever made the folder, load it with "
                                      "trust_pickle=True.")
            self.reader.unpack_budget = left - len(data)
            out = io.BytesIO(data)
        if read_item.type != LoadItemType.BYTE_IO:
            if descriptors:
                _check_tensor_zip(out, len(out.getvalue()), where)
            else:  # DCP's file view mis-seeks from the end (zipfile does that): a view of our own
                with open(self.reader.root / info.relative_path, "rb") as fh:
                    _check_tensor_zip(_Slice(fh, info.offset, info.length), info.length, where)
        out.seek(0)
        return out


def _check_tensor_zip(fh: Any, size: int, where: str) -> None:
    """A tensor item must be a torch.save zip whose members unpack to at most its SIZE stored bytes."""
    if not zipfile.is_zipfile(fh):  # torch.load of torch's legacy format allocates what it declares
        raise CheckpointError(f"{where} is not a torch.save zip archive, which DCP writes for every tensor. {_RECOPY}")
    check_zip_stream(fh, size, size, where)


class _Slice(io.RawIOBase):
    """LENGTH bytes of the open file FH from OFFSET, as a file of their own."""

    def __init__(self, fh: Any, offset: int, length: int) -> None:
        super().__init__()
        self.fh, self.offset, self.length, self.pos = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.length - self.pos)
        if want <= 0:
            return 0
        self.fh.seek(self.offset + self.pos)
        data = self.fh.read(want)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def dcp_load(root: Path, dest: dict[str, Any], opts: ReadOptions, single_process: bool) -> None:
    """torch.distributed.checkpoint.load of ROOT into the flat dict DEST, with our reader and planner;
    every failure becomes one CheckpointError (DCP wraps them in its own CheckpointException)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = reader_classes()
    trust_pickle = opts.trust_pickle
    reader_cls(root, trust_pickle).read_metadata()  # its refusals raised as they are (DCP would bury them)
    try:
        with warnings.catch_warnings():  # one process: torch warns that it assumes exactly that
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(dest, storage_reader=reader_cls(root, trust_pickle), planner=planner_cls(root, trust_pickle),
                     no_dist=single_process)
    except CheckpointError:
        raise
    except CheckpointException as exc:
        errors = [pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values()]
        ours = next((e for e in errors if isinstance(e, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        first = errors[0] if errors else exc
        raise CheckpointError(f"{root} could not be read through torch.distributed.checkpoint "
                              f"({type(first).__name__}: {_first_line(first)}). Fix: load it into the model (and "
                              "optimizer) it was saved from.") from None
    except (Exception, RecursionError) as exc:
        raise CheckpointError(f"{root} could not be read through torch.distributed.checkpoint "
                              f"({type(exc).__name__}: {_first_line(exc)}). Fix: load it into the model (and "
                              "optimizer) it was saved from.") from None
