"""Memory per device and the largest live tensors, with where they were made when known.

On CUDA the numbers are the caching allocator's (allocated by tensors, reserved by the
allocator) and the driver's (free, total). On the CPU torch keeps no counter, so "allocated" is
the sum of the live tensors found by the garbage collector, "reserved" is the process's
resident set, and the limit is the smaller of the cgroup memory limit and RLIMIT_AS.

Live tensors are found with `gc.get_objects()` and deduplicated by storage. Tensors kept only
inside an autograd graph (saved activations) have no Python object, so they are counted through
the graph of the live tensor that holds it (`graph_bytes`). Where a tensor was made is known on
CUDA when torch's memory history is being recorded (`track_memory(record_origins=True)` or
`torch.cuda.memory._record_memory_history()`); everywhere, the op that made a non-leaf tensor
(its `grad_fn`) and the variable or container that holds it are reported.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..hardware import host
from ..policy.devices import DeviceSpec
from ..units import format_bytes
from .holders import graph_saved, holder_of, storage_ptr


@dataclass
class LiveTensor:
    """One live tensor (by storage), described without keeping it alive."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int  # bytes of its storage
    requires_grad: bool = False
    grad_fn: str | None = None  # the op that made it, for non-leaf tensors
    graph_bytes: int | None = None  # saved tensors its autograd graph keeps alive
    held_by: str | None = None  # the variable or container that references it
    origin: str | None = None  # "file:line in function" where it was allocated (CUDA with history)

    def describe(self) -> str:
        parts = [f"{format_bytes(self.nbytes)} {self.dtype} {list(self.shape)} on {self.device}"]
        if self.grad_fn:
            graph = (f" holding a graph with {format_bytes(self.graph_bytes)} of saved tensors"
                     if self.graph_bytes else "")
            parts.append(f"made by {self.grad_fn}{graph}")
        if self.held_by:
            parts.append(f"held by {self.held_by}")
        if self.origin:
            parts.append(f"allocated at {self.origin}")
        return ", ".join(parts)


@dataclass
class DeviceMemory:
    """Memory of one device, in bytes; None where this device cannot say."""

    device: str
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    limit_bytes: int | None = None
    limit_kind: str | None = None  # what sets the limit, e.g. "RLIMIT_AS (address space)"
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        items = [f"allocated {format_bytes(self.allocated_bytes)}", f"reserved {format_bytes(self.reserved_bytes)}",
                 f"free {format_bytes(self.free_bytes)}", f"total {format_bytes(self.total_bytes)}"]
        if self.peak_allocated_bytes is not None:
            items.append(f"peak {format_bytes(self.peak_allocated_bytes)}")
        if self.limit_bytes is not None:
            items.append(f"limit {format_bytes(self.limit_bytes)} ({self.limit_kind})")
        return f"{self.device}: " + ", ".join(items)


@dataclass
class MemoryReport:
    """Memory per device plus the largest live tensors and the tensors that hold autograd graphs."""

    devices: list[DeviceMemory]
    largest: list[LiveTensor]
    graph_holders: list[LiveTensor] = field(default_factory=list)

    def text(self) -> str:
        lines = [d.describe() for d in self.devices]
        if self.largest:
            lines.append("largest live tensors:")
            lines += _grouped(self.largest)
        if self.graph_holders:
            lines.append("live tensors holding autograd graphs:")
            lines += _grouped(self.graph_holders)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _grouped(infos: list[LiveTensor]) -> list[str]:
    """One line per distinct description, with a count when it repeats."""
    counts: dict[str, int] = {}
    for info in infos:
        text = info.describe()
        counts[text] = counts.get(text, 0) + 1
    return [f"  {n} x {text}" if n > 1 else f"  {text}" for text, n in counts.items()]


def memory_report(device: DeviceSpec = None, *, top: int = 10) -> MemoryReport:
    """Memory of DEVICE and its largest live tensors, with the op that made them and what holds them.

    Args:
        device: any `torchplace.device` spec (default: the CPU and every CUDA device this process
            has used).
        top: how many of the largest live tensors to list.

    Returns:
        A `MemoryReport`: `devices` (in use, reserved, limit per device), `largest` and
        `graph_holders` (tensors that keep an autograd graph alive); `text()` renders it.

    Raises:
        DeviceError: the device does not exist here.

    Example:
        ```python
        import torch
        import torchplace as tp

        weights = torch.zeros(1024, 1024)  # 4 MiB, held by the name `weights`
        print(tp.memory_report("cpu", top=3).text())
        ```
    """
    devices = _devices(device)
    kinds = {d.type for d in devices}
    tensors = live_tensors(lambda t: t.device.type in kinds and (device is None or _same(t.device, devices)))
    try:
        stats = [device_memory(d, tensors) for d in devices]
        largest = describe_tensors(sorted(tensors, key=_storage_bytes, reverse=True)[:top], tensors)
        holders = describe_tensors(graph_holders(tensors)[:top], tensors)
    finally:
        tensors.clear()
    return MemoryReport(stats, largest, holders)


def _devices(device: Any) -> list[torch.device]:
    if device is not None:
        from ..policy.devices import device as resolve_device

        return [resolve_device(device)]
    out = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out += [torch.device("cuda", i) for i in range(torch.cuda.device_count())
                if torch.cuda.memory_reserved(i) or i == torch.cuda.current_device()]
    return out


def _same(dev: torch.device, devices: list[torch.device]) -> bool:
    return any(dev.type == d.type and (d.index is None or dev.index in (None, d.index)) for d in devices)


def device_memory(dev: torch.device, tensors: Iterable[torch.Tensor] = ()) -> DeviceMemory:
    """The memory numbers of one device (see module docstring for what they mean on the CPU)."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return DeviceMemory(str(dev), torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev),
                            int(free), int(total), torch.cuda.max_memory_allocated(dev))
    if dev.type == "cpu":
        return _cpu_memory(tensors)
    return DeviceMemory(str(dev), notes=[f"torchplace reads no memory counters for {dev.type} devices"])


def _cpu_memory(tensors: Iterable[torch.Tensor]) -> DeviceMemory:
    import psutil

    vm = psutil.virtual_memory()
    live = sum(_storage_bytes(t) for t in tensors if t.device.type == "cpu")
    limits = [(v, kind) for v, kind in ((host.cgroup_memory_limit(), "cgroup memory limit"),
                                        (host.address_space_limit(), "RLIMIT_AS, address space")) if v is not None]
    limit = min(limits) if limits else (None, None)
    mem = DeviceMemory("cpu", allocated_bytes=live, reserved_bytes=int(psutil.Process().memory_info().rss),
                       free_bytes=int(vm.available), total_bytes=int(vm.total), limit_bytes=limit[0],
                       limit_kind=limit[1])
    mem.notes.append("cpu: allocated = live tensors found by the garbage collector, reserved = resident set "
                     "of this process, limit = the smaller of the cgroup memory limit and RLIMIT_AS")
    return mem


# --------------------------------------------------------------------------- live tensors


def live_tensors(keep: Any = None) -> list[torch.Tensor]:
    """Live tensors with memory (one per storage), found by the garbage collector.

    The caller owns the returned list and should clear it when done, so that no tensor is kept
    alive by the report itself.
    """
    seen: set[tuple[str, int]] = set()
    out: list[torch.Tensor] = []
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): isinstance reads __class__, which some lazy proxies warn on
            if not issubclass(type(obj), torch.Tensor) or (keep is not None and not keep(obj)):
                continue
            key = (str(obj.device), storage_ptr(obj))
        except Exception:  # tensor subclasses and wrappers without a plain storage
            continue
        if key[1] == 0 or key in seen:
            continue
        seen.add(key)
        out.append(obj)
    return out


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return 0


def graph_holders(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The live tensors that are outputs of autograd graphs (non-leaf, with a grad_fn)."""
    return [t for t in tensors if t.grad_fn is not None]


def graph_saved_bytes(t: torch.Tensor) -> int:
    """Bytes of saved tensors still held by T's autograd graph (0 once backward has freed them)."""
    return sum(graph_saved(t).values())


def describe_tensors(chosen: list[torch.Tensor], *own_lists: list[torch.Tensor]) -> list[LiveTensor]:
    """LiveTensor for CHOSEN; OWN_LISTS (the caller's scan lists) are not reported as holders."""
    origins = _cuda_origins({t.device for t in chosen if t.device.type == "cuda"})
    own = {id(chosen), *map(id, own_lists)}
    grads = {id(p.grad): p for pool in own_lists for p in pool
             if p.is_leaf and p.requires_grad and p.grad is not None}
    return [tensor_info(t, _holder_or_grad(t, own, grads), origins) for t in chosen]


def _holder_or_grad(t: torch.Tensor, own: set[int], grads: dict[int, torch.Tensor]) -> str | None:
    """What holds T; a gradient is held by its parameter's `.grad`, which Python cannot see."""
    found = holder_of(t, own)
    if found is None and id(t) in grads:
        param = grads[id(t)]
        owner = holder_of(param, own | {id(grads)})
        return f".grad of {owner}" if owner else ".grad of a parameter"
    return found


def tensor_info(t: torch.Tensor, held_by: str | None = None, origins: dict[int, str] | None = None) -> LiveTensor:
    """Describe one tensor without keeping a reference to it."""
    info = LiveTensor(tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), _storage_bytes(t),
                      t.requires_grad, type(t.grad_fn).__name__ if t.grad_fn is not None else None, held_by=held_by)
    if t.grad_fn is not None:
        info.graph_bytes = graph_saved_bytes(t)
    if origins and t.device.type == "cuda":
        info.origin = origins.get(t.untyped_storage().data_ptr())
    return info


def cuda_origins(tensors: Iterable[torch.Tensor]) -> dict[int, str]:
    """data_ptr -> allocation site for the CUDA tensors among TENSORS (empty without history)."""
    return _cuda_origins({t.device for t in tensors if t.device.type == "cuda"})


def _cuda_origins(devices: set[torch.device]) -> dict[int, str]:
    """data_ptr -> 'file:line in fn' from torch's CUDA memory history, when it is being recorded."""
    if not devices:
        return {}
    try:
        snapshot = torch.cuda.memory._snapshot()
    except Exception:
        return {}
    libraries = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
    out: dict[int, str] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            frames = block.get("frames") or []  # innermost first: the first frame outside torch is the caller
            user = next((f for f in frames if f.get("filename", "").endswith(".py")
                         and not f.get("filename", "").startswith(libraries)), None)
            if user and block.get("state") == "active_allocated":
                out[int(block["address"])] = f"{user.get('filename')}:{user.get('line')} in {user.get('name')}"
    return out
