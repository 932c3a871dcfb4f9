"""`to_device`: move every tensor of any nested batch, non-blocking only where that is safe.

Every container is walked by `shared.tree.map_tensors`, which also serves pinning and
`record_stream` here. The one shortcut, `_move`, inlines `.to()` for plain dicts, lists and
tuples and hands every other container to that traversal.

A move never changes its input: every container that holds a moved tensor is rebuilt as a new
object (the input's own items, attributes and inner dicts are left alone). The exceptions are
objects with their own `.to()` (a PackedSequence, a TensorDict, a module, HF's BatchEncoding):
they are moved by calling it, as accelerate and Lightning do, so whether the original changes is
up to that method (`nn.Module.to` and `BatchEncoding.to` move in place and return the object).
"""

from __future__ import annotations

import copy
import re
from collections import UserDict
from typing import Any, TypeVar

import torch

from ..errors import DeviceError
from ..hardware.accelerator import accelerator_type, device_module, say_once
from ..policy.devices import DeviceSpec
from ..policy.devices import device as resolve_device
from ..shared.tree import ATOMIC, _Tensor, depth_error, map_tensors, unchanged, walk

T = TypeVar("T")

# device types whose copies must finish before the caller may read the result
_SYNC_TYPES = frozenset({"cpu", "mps"})
_CUDA_INDEXED = re.compile(r"^cuda:\d+$")
_MPS_BUILT = torch.backends.mps.is_built()  # no tensor can be on mps otherwise: skip the check


# ---------------------------------------------------------------------------------------------
# moving

_validated: dict[Any, torch.device] = {}


def target_device(spec: DeviceSpec) -> torch.device:
    """Resolve SPEC, remembering the specs whose answer can no longer change.

    "cpu" and "meta" never change; an indexed CUDA device cannot once CUDA is initialized (the
    device count is fixed from then on). Everything else ("auto", "cuda", ints) is resolved on
    every call, since LOCAL_RANK or CUDA_VISIBLE_DEVICES may still decide it.
    """
    key = spec if isinstance(spec, (str, torch.device)) else None
    if key is not None and key in _validated:
        return _validated[key]
    dev = resolve_device(spec)
    if key is not None and _stable(str(key).strip().lower()):
        _validated[key] = dev
    return dev


def _stable(text: str) -> bool:
    if text in ("cpu", "meta"):
        return True
    return bool(_CUDA_INDEXED.match(text)) and torch.cuda.is_initialized()  # cuda-only: count fixed at init


def to_device(obj: T, device: DeviceSpec, *, non_blocking: bool | None = None) -> T:
    """Move every tensor in OBJ to DEVICE and return the same structure.

    Walks dicts, lists, tuples, named tuples, sets, deques, dataclasses, attrs classes and objects
    with their own `.to()` (a module moves in place; HF's `BatchEncoding` is moved as a copy; if
    `.to()` returns None the original object is kept). OBJ itself is never changed: containers
    holding moved tensors are rebuilt. Strings, numbers, None and generators pass through; a batch
    that holds itself raises ValueError naming where.

    `non_blocking=None` (the default) copies asynchronously where it is safe: host to an
    accelerator other than MPS, and between accelerators (ordered on the current streams). Copies
    to the CPU and anything touching MPS are synchronous, so the caller can read the result at
    once. `non_blocking=True` is honoured; copies to the host are then issued together and
    synchronized once before returning (pinned destinations, one wait).

    Inside `torch.compile` (fullgraph too) a `torch.device`, "cpu" or "meta" is used as given:
    resolution reads the environment and takes a lock, which cannot be traced, so resolve other
    specs outside (`dev = torchplace.device("auto")`) and pass `dev`.

    Args:
        obj: a tensor, or any nesting of containers holding tensors.
        device: any `torchplace.device` spec.
        non_blocking: None (safe asynchronous copies), True or False.

    Returns:
        A structure of the same shape and types with every tensor on DEVICE.

    Raises:
        DeviceError: the device does not exist here.

    Example:
        ```python
        import torch
        import torchplace as tp

        batch = {"x": torch.randn(2, 3), "meta": {"ids": [torch.arange(2)], "name": "b0"}}
        moved = tp.to_device(batch, "meta")
        print(moved["x"].device, moved["meta"]["ids"][0].device, moved["meta"]["name"])
        ```
    """
    if isinstance(device, (torch.device, str)) and torch.compiler.is_compiling():
        return _move_compiled(obj, device, non_blocking)
    dev = target_device(device)
    try:
        return _to_device(obj, dev, non_blocking)
    except RecursionError:
        raise depth_error(obj, f"to_device(..., {str(dev)!r})") from None


def _to_device(obj: Any, dev: torch.device, non_blocking: bool | None) -> Any:
    if not _MPS_BUILT and dev.type not in _SYNC_TYPES:  # nothing to track: copies inlined in the traversal
        nb = bool(non_blocking) or (non_blocking is None and dev.type != "meta")
        try:
            return _move(obj, dev, nb)
        except NotImplementedError:
            walk(obj, lambda t: _raise_if_meta(t, dev) if t.device != dev else t, None)
            raise
    mover = _Mover(dev, non_blocking)
    out = walk(obj, mover.tensor, mover.other)
    if mover.pending:
        mover.finish()
    return out


def _move(x: Any, dev: torch.device, nb: bool) -> Any:
    """`walk` with `t.to(dev, non_blocking=nb)` inlined for dicts, lists and tuples of tensors.

    Per tensor this costs what a hand-written comprehension costs: no call besides `.to()`.
    Only for destinations whose copies need no tracking (see `_Mover`).
    """
    if isinstance(x, _Tensor):
        return x.to(dev, non_blocking=nb)
    cls = type(x)
    if cls is dict:
        new = {k: v.to(dev, non_blocking=nb) if isinstance(v, _Tensor) else _move(v, dev, nb) for k, v in x.items()}
        return x if unchanged(x.values(), new.values()) else new
    if cls is list or cls is tuple:
        items = [v.to(dev, non_blocking=nb) if isinstance(v, _Tensor) else _move(v, dev, nb) for v in x]
        return x if unchanged(x, items) else cls(items)
    if cls in ATOMIC:
        return x
    return walk(x, lambda t: t.to(dev, non_blocking=nb), lambda o: _other_to(o, dev, nb))


def _move_compiled(obj: Any, device: torch.device | str, non_blocking: bool | None) -> Any:
    """`to_device` while torch.compile traces it: no resolution, no cache, no stream bookkeeping.

    The non-blocking policy is the eager one, except that a copy to the host is always
    synchronous (a compiled graph has no point at which to wait for it).
    """
    if isinstance(device, torch.device):
        dev = device
    elif device in ("cpu", "meta"):
        dev = torch.device(device)
    else:
        raise DeviceError(
            f"to_device(..., {device!r}) inside torch.compile: resolving {device!r} reads the "
            "environment and cannot be traced. Fix: resolve it before compiling, "
            f"dev = torchplace.device({device!r}), and pass dev.")
    nb = dev.type not in _SYNC_TYPES and dev.type != "meta" and non_blocking is not False
    return _move(obj, dev, nb)


class _Mover:
    """The per-call state of `to_device`: the copy flags and the devices left to synchronize."""

    __slots__ = ("dev", "nb_auto", "nb", "sync_dst", "simple", "pending", "tensor")

    def __init__(self, dev: torch.device, non_blocking: bool | None) -> None:
        self.dev = dev
        self.nb_auto = auto = non_blocking is None
        self.nb = nb = bool(non_blocking) or (auto and dev.type not in ("cpu", "mps", "meta"))
        self.sync_dst = sync_dst = dev.type in _SYNC_TYPES
        self.pending: set[torch.device] = set()
        pending = self.pending

        self.simple = simple = not (sync_dst or _MPS_BUILT)
        if simple:  # the common case (host or GPU to a GPU): nothing to track
            def tensor(t: torch.Tensor) -> torch.Tensor:  # closures: these run once per tensor
                try:
                    return t.to(dev, non_blocking=nb)
                except NotImplementedError:
                    _raise_if_meta(t, dev)
                    raise
        else:
            def tensor(t: torch.Tensor) -> torch.Tensor:
                n = nb
                src_mps = n and t.is_mps
                if src_mps and auto:
                    n = False
                try:
                    out = t.to(dev, non_blocking=n)
                except NotImplementedError:
                    _raise_if_meta(t, dev)
                    if not n:
                        raise
                    out, n = _without_pinned_memory(t, dev), False
                if n and (sync_dst or src_mps) and out is not t:
                    pending.add(t.device)
                return out

        self.tensor = tensor

    def other(self, x: Any) -> Any:
        return _other_to(x, self.dev, self.nb and self.dev.type not in _SYNC_TYPES)

    def finish(self) -> None:
        """Wait for the copies the caller must be able to read at once (device to host, MPS)."""
        for src in self.pending:
            if src.type == "mps" or self.dev.type == "mps":
                torch.mps.synchronize()
            elif src.type != "cpu":
                mod = device_module(src.type)
                if hasattr(mod, "current_stream"):
                    mod.current_stream(src).synchronize()
                else:  # a back end without streams: the whole device
                    mod.synchronize(src)


def _other_to(x: Any, dev: torch.device, nb: bool) -> Any:
    """Move an object with its own `.to()`; one that returns None moved in place and is kept.

    A UserDict (HF's BatchEncoding and BatchFeature) is moved as a copy: its `.to()` replaces
    its own items and returns itself, which would move the caller's batch too. The copy has its
    own item dict and shares every attribute (a BatchEncoding's encodings) with the original.
    """
    if isinstance(x, UserDict):
        x = copy.copy(x)
    try:
        out = x.to(dev, non_blocking=nb)
    except TypeError:  # a .to() without a non_blocking keyword
        out = x.to(dev)
    return x if out is None else out


def _without_pinned_memory(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """The copy again, synchronously: torch made a non-blocking copy to the host through pinned memory,
    which this back end does not have (a PrivateUse1 back end without a pinned allocator)."""
    kind = t.device.type if dev.type == "cpu" else dev.type
    say_once(kind, "pinned memory", f"{kind} has no pinned host memory in this torch, so torchplace copies "
             f"between {kind} and the host synchronously (non_blocking has no effect there).")
    return t.to(dev)


def _raise_if_meta(t: torch.Tensor, dev: torch.device) -> None:
    """Raise what a failed move of T to DEV means, when it is one torch cannot make: T is on "meta",
    or DEV is "meta" and T is a nested tensor of the strided layout or a quantized tensor (torch has
    no meta kernels for them). Otherwise return, and the caller raises torch's own error."""
    if dev.type == "meta" and ((t.is_nested and t.layout is torch.strided) or t.is_quantized):
        kind, fix = (("nested tensor of the strided layout", "build it with torch.nested.nested_tensor(..., "
                      "layout=torch.jagged), which torch can move to meta") if t.is_nested else
                     ("quantized tensor", "dequantize it first (t.dequantize()), or leave it out of the batch"))
        raise DeviceError(f"cannot move a {kind} ({t.dtype}) to meta: torch has no meta kernels for it. "
                          f"Fix: {fix}.") from None
    if t.is_meta:
        raise DeviceError(
            f"cannot move a meta tensor (shape {tuple(t.shape)}, {t.dtype}) to {dev}: meta tensors have a "
            "shape but no data. Fix: create it on the target device, or for a module call "
            "module.to_empty(device=...) and then load real weights.") from None


# ---------------------------------------------------------------------------------------------
# pinning and stream bookkeeping (used by DeviceLoader)

def pin_tensor(t: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of host tensor T (T itself if already pinned or not on the host).

    Dense layouts keep their strides (channels_last stays channels_last, as with `.to()`);
    expanded or gappy views are pinned contiguous, so only their own elements are copied. A
    tensor subclass (torchvision's tv_tensors keep their class and metadata), a sparse, nested or
    quantized tensor is pinned by its own `pin_memory()`: an empty strided block would lose what
    it is.
    """
    if t.device.type != "cpu" or t.is_pinned():
        return t
    try:
        if type(t) is not _Tensor or t.layout is not torch.strided or t.is_nested or t.is_quantized:
            return t.pin_memory()
        if _dense(t):
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
        else:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    except NotImplementedError:  # the accelerator's back end has no pinned memory allocator
        kind = accelerator_type() or "this accelerator"
        say_once(kind, "pinned memory", f"{kind} has no pinned host memory in this torch, so host tensors stay "
                 "pageable and their copies to the device are synchronous.")
        return t
    return out.copy_(t)


def pin(obj: T) -> T:
    """Pin every host tensor in OBJ (objects with a `pin_memory()` method use it).

    An object with its own `.to()` but no `pin_memory()` (a module, a dataclass with a `.to`)
    is walked into instead, so the tensors its containers hold are pinned all the same.
    """
    def other(x: Any) -> Any:
        method = getattr(x, "pin_memory", None)
        return method() if callable(method) else walk(x, pin_tensor, None)

    return map_tensors(obj, pin_tensor, other)


def record_stream(obj: Any, stream: Any) -> None:
    """Mark every device tensor in OBJ as used on STREAM, so its memory outlives that work."""
    def fn(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            t.record_stream(stream)
        return t

    map_tensors(obj, fn)


def _dense(t: torch.Tensor) -> bool:
    """True when T's elements fill their memory without gaps or overlap (any dimension order)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
