"""Everything that is not a tensor, as tagged JSON; tensors pulled out by key.

Training state is a tree: dicts with int keys (optimizer state), tuples (Adam's betas, Python's
RNG state), floats that may be inf (ReduceLROnPlateau), numpy arrays (numpy's RNG), dtypes.
JSON alone loses those types, and pickle runs code on load. So every non-JSON shape gets a tag:

    {"t": "dict", "v": [[key, value], ...]}   any dict (keys keep their types and order)
    {"t": "tuple", "v": [...]}                {"t": "float", "v": "inf"}
    {"t": "tensor", "k": KEY}                 a tensor stored in the data region under KEY
    {"t": "ndarray", "k": KEY}                a numpy array, stored as a tensor
    {"t": "dtype"|"device"|"size"|"bytes", "v": ...}
    {"t": "pickle", "k": KEY}                 only with save(allow_pickle=True); refused on load
                                              unless load(trust_pickle=True)
    {"t": "ref", "k": KEY}                    a tensor kept outside the file (DCP shards)

Lists are JSON lists and str/int/bool/None are themselves; a plain JSON object never appears.
The same tensor object reached twice (tied weights) is stored once and comes back shared.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError

PICKLE_FIX = ("Fix: if you trust whoever made this file, pass trust_pickle=True to torchplace.load "
              "(or --trust-pickle to `torchplace ckpt convert`, which writes a copy that needs no pickle).")


# Each container level becomes up to 3 JSON levels ({"t": "dict", "v": [[k, v]]}); 40 levels stay
# within the readers' JSON nesting limit (safeio.MAX_JSON_DEPTH).
MAX_NESTING = 40


@dataclass(frozen=True)
class TensorRef:
    """A placeholder for a tensor not read yet; `decode` replaces it through a lookup."""

    key: str


@dataclass
class Encoded:
    """The JSON tree, the tensors it references (and where in the tree each sits), and the paths of
    entries that need pickle."""

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    pickled: list[str] = field(default_factory=list)
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


def _visible_storage(t: torch.Tensor) -> bool:
    """True when T's storage is one torch can point at (not XLA's, nor a Python back end's wrapper)."""
    if not torch._C._has_storage(t):
        return False
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # "Attempted to access the data pointer on an invalid python storage"
        return False
    return True


_AS_IS = frozenset({int, str, bool, type(None)})  # leaves that are JSON as they are (a float may be inf or nan)


class _Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.out = Encoded(None)
        self._seen: dict[tuple[Any, ...], str] = {}

    def _key(self, path: tuple[Any, ...]) -> str:
        base = _path_str(path) or "value"
        key, n = base, 1
        while key in self.out.tensors:
            n += 1
            key = f"{base}~{n}"
        return key

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> str:
        t = t.detach()
        device = t.device
        if device.type not in ("cpu", "meta", "cuda") and not _visible_storage(t):
            # a back end that keeps no storage torch can see (XLA, a PrivateUse1 back end written in
            # Python): its data is read through the host, as torch.save does for such tensors
            t, device = t.cpu(), torch.device("cpu")
        if t.layout != torch.strided or t.is_quantized or t.is_nested \
                or type(t) is not torch.Tensor:  # subclasses (DTensor, ...) and exotic layouts
            raise TypeError("not a plain dense tensor")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                 t.dtype, device) if t.numel() else None
        if ident is not None and ident in self._seen:
            return self._seen[ident]
        key = self._key(path)
        self.out.tensors[key] = t.resolve_conj().resolve_neg()
        self.out.paths[key] = path
        if ident is not None:
            self._seen[ident] = key
        return key

    def encode(self, value: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_NESTING:
            raise CheckpointError(f"{_path_str(path[:8])}/... nests containers more than {MAX_NESTING} levels deep, "
                                  "deeper than a checkpoint may (readers refuse deeper JSON). Fix: store it "
                                  "flatter, e.g. as a dict keyed by path strings.")
        if isinstance(value, torch.Tensor):  # first: most of a state's leaves
            if value.device.type == "meta":
                raise CheckpointError(f"{_path_str(path)} is on the meta device and has no data to save. Fix: "
                                      "materialize it first (module.to_empty(device=...) and initialize, or load "
                                      "weights).")
            try:
                return {"t": "tensor", "k": self.tensor(value, path)}
            except TypeError:
                kind = ("quantized " if value.is_quantized else "nested " if value.is_nested else
                        "" if value.layout == torch.strided else f"{value.layout} ")
                return self._pickle(value, path, f"a {kind}{type(value).__name__} ({value.dtype}) on {value.device}")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
        if isinstance(value, TensorRef):  # a tensor kept elsewhere (DCP shards)
            return {"t": "ref", "k": value.key}
        if isinstance(value, np.ndarray):
            as_tensor = array_tensor(value)
            if as_tensor is None:
                return self._pickle(value, path, f"a numpy array of {value.dtype}")
            return {"t": "ndarray", "k": self.tensor(as_tensor, path)}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            return self.encode(value.item(), path)
        if isinstance(value, dict):
            return {"t": "dict", "v": [[self.encode(k, path + ("<key>",)), self.encode(v, path + (k,))]
                                       for k, v in value.items()]}
        if isinstance(value, list):
            return self._items(value, path)
        if type(value) is tuple:
            return {"t": "tuple", "v": self._items(value, path)}
        if isinstance(value, torch.Size):
            return {"t": "size", "v": list(value)}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if isinstance(value, (bytes, bytearray)):
            return {"t": "bytes", "v": base64.b64encode(bytes(value)).decode()}
        return self._pickle(value, path, f"a {type(value).__module__}.{type(value).__qualname__}")

    def _items(self, items: list[Any] | tuple[Any, ...], path: tuple[Any, ...]) -> list[Any]:
        """ITEMS encoded; at once when each is JSON as it is (Python's RNG state: 625 ints, saved every time)."""
        if len(path) < MAX_NESTING and all(type(v) in _AS_IS for v in items):
            return list(items)
        return [self.encode(v, path + (i,)) for i, v in enumerate(items)]

    def _pickle(self, value: Any, path: tuple[Any, ...], what: str) -> Any:
        where = _path_str(path)
        if not self.allow_pickle:
            raise CheckpointError(
                f"{where} is {what}, which cannot be stored without pickle (and a pickle runs code when "
                "it is loaded). Fix: store plain data there (dicts, lists, numbers, strings, dense "
                "tensors), or pass allow_pickle=True to torchplace.save; loading will then need "
                "trust_pickle=True." + (" Or: save under a .pt name, a torch.save file whose torch.load "
                                        "(weights_only=True) reads quantized and sparse tensors without pickle."
                                        if isinstance(value, torch.Tensor) and (value.is_quantized or value.layout
                                                                                != torch.strided) else ""))
        buf = io.BytesIO()
        torch.save(value, buf)
        key = self._key(path)
        self.out.tensors[key] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self.out.pickled.append(where)
        return {"t": "pickle", "k": key}


def array_tensor(value: np.ndarray) -> torch.Tensor | None:
    """The tensor a numpy array is stored as (sharing its memory when contiguous), or None for arrays torch
    cannot hold (object, datetime, big-endian, ...: those need pickle)."""
    try:
        return torch.from_numpy(np.ascontiguousarray(value))
    except (TypeError, ValueError):
        return None


def encode(tree: Any, *, allow_pickle: bool = False) -> Encoded:
    """Split TREE into tagged JSON and the tensors it holds; raise CheckpointError on what needs pickle."""
    enc = _Encoder(allow_pickle)
    enc.out.tree = enc.encode(tree, ())
    return enc.out


class StateError(ValueError):
    """The tagged JSON is not what `encode` writes (only a crafted or foreign file gets here)."""


def _shaped(node: dict[str, Any], tag: str, field_: str, kind: type) -> Any:
    value = node.get(field_)
    if not isinstance(value, kind):
        raise StateError(f"a {tag!r} entry has {field_}={value!r:.60}, not a {kind.__name__}")
    return value


def dtype_by_name(name: str) -> torch.dtype | None:
    """torch.NAME when it is a dtype, else None. Looked up in torch's namespace, never with getattr:
    torch imports some submodules on first access (`torch._dynamo`, `torch._inductor`: hundreds of
    modules), which a name from a file must not trigger."""
    value = vars(torch).get(name)
    return value if isinstance(value, torch.dtype) else None


def _dtype(name: str) -> torch.dtype:
    value = dtype_by_name(name)
    if value is None:
        raise StateError(f"{name!r:.60} is not a dtype of this torch ({torch.__version__})")
    return value


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise StateError(f"{name!r:.60} is not a device torch can name") from None


def _size(dims: list[Any]) -> torch.Size:
    if not all(type(d) is int and 0 <= d < 2**62 for d in dims):
        raise StateError(f"a 'size' entry has dimensions {dims!r:.60}, not non-negative integers")
    return torch.Size(dims)


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise StateError(f"a dict key decodes to a {type(key).__name__}, which cannot be a key") from None
    return key


def decode(tree: Any, lookup: Callable[[str], Any], *, unpickle: Callable[[str], Any] | None = None) -> Any:
    """Rebuild the tree; LOOKUP(key) gives each tensor (or a TensorRef, for a skeleton).

    Raises StateError (a ValueError) for anything `encode` does not write: an unknown tag, a field
    of the wrong type, a dict entry that is not a [key, value] pair, a dtype or device torch lacks.
    """
    return _decoded(tree, lookup, unpickle)


def _decoded(node: Any, lookup: Callable[[str], Any], unpickle: Callable[[str], Any] | None) -> Any:
    """`decode` of one node. A module function, not a recursive closure: a closure that calls itself is a
    reference cycle, and it would keep LOOKUP's tensors (on the device) alive until a garbage collection."""
    if isinstance(node, list):
        return [_decoded(v, lookup, unpickle) for v in node]
    if not isinstance(node, dict):
        return node
    tag = node.get("t")
    if tag == "dict":
        pairs = _shaped(node, tag, "v", list)
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise StateError("a 'dict' entry holds something other than [key, value] pairs")
        return {_hashable(_decoded(k, lookup, unpickle)): _decoded(val, lookup, unpickle) for k, val in pairs}
    if tag == "tuple":
        return tuple(_decoded(x, lookup, unpickle) for x in _shaped(node, tag, "v", list))
    if tag == "tensor":
        return lookup(_shaped(node, tag, "k", str))
    if tag == "ndarray":
        t = lookup(_shaped(node, tag, "k", str))
        return t if isinstance(t, TensorRef) else t.cpu().numpy()
    if tag == "float":
        text = _shaped(node, tag, "v", str)
        try:
            return float(text)
        except ValueError:
            raise StateError(f"a 'float' entry holds {text!r:.60}, not a number") from None
    if tag == "size":
        return _size(_shaped(node, tag, "v", list))
    if tag == "dtype":
        return _dtype(_shaped(node, tag, "v", str))
    if tag == "device":
        return _device(_shaped(node, tag, "v", str))
    if tag == "bytes":
        try:
            return base64.b64decode(_shaped(node, tag, "v", str), validate=True)
        except ValueError:
            raise StateError("a 'bytes' entry is not base64") from None
    if tag == "ref":
        return TensorRef(_shaped(node, tag, "k", str))
    if tag == "pickle":
        key = _shaped(node, tag, "k", str)
        return TensorRef(key) if unpickle is None else unpickle(key)
    raise StateError(f"unknown tag {tag!r:.60} (this torchplace knows dict, tuple, tensor, ndarray, float, "
                     "size, dtype, device, bytes, ref, pickle)")


def skeleton(tree: Any, keys: set[str] | frozenset[str]) -> Any:
    """The decoded tree with a TensorRef for every tensor and pickled entry, each checked to be among
    KEYS (the tensors the file holds); StateError for anything malformed. Reads no tensor data."""

    def lookup(key: str) -> TensorRef:
        if key not in keys:
            raise StateError(f"the state refers to tensor {key!r:.80}, which the file does not hold")
        return TensorRef(key)

    return decode(tree, lookup, unpickle=lookup)


def unpickle_bytes(data: torch.Tensor) -> Any:
    """Run a pickled entry (only ever called after the caller passed trust_pickle=True)."""
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def tensor_keys_by_path(tree: Any) -> dict[tuple[Any, ...], str]:
    """Map each tensor's path in the tree (tuple of keys) to its tensor key."""
    out: dict[tuple[Any, ...], str] = {}
    _collect_paths(tree, (), out)
    return out


def _collect_paths(node: Any, path: tuple[Any, ...], out: dict[tuple[Any, ...], str]) -> None:
    """Add NODE's tensor keys to OUT by path (a module function: a recursive closure is a reference cycle)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _collect_paths(item, path + (i,), out)
    elif isinstance(node, dict):
        tag = node.get("t")
        v: Any = node.get("v")
        if tag == "dict":
            for k, val in v:
                _collect_paths(val, path + (decode(k, _same),), out)
        elif tag == "tuple":
            for i, x in enumerate(v):
                _collect_paths(x, path + (i,), out)
        elif tag in ("tensor", "ndarray"):
            out[path] = node["k"]


def _same(key: str) -> str:
    return key
