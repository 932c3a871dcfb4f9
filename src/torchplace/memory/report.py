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
import types
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..hardware import host

_MAX_GRAPH_NODES = 20_000


@dataclass
class TensorInfo:
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
        parts = [f"{_fmt(self.nbytes)} {self.dtype} {list(self.shape)} on {self.device}"]
        if self.grad_fn:
            graph = f" holding a graph with {_fmt(self.graph_bytes)} of saved tensors" if self.graph_bytes else ""
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
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        items = [f"allocated {_fmt(self.allocated_bytes)}", f"reserved {_fmt(self.reserved_bytes)}",
                 f"free {_fmt(self.free_bytes)}", f"total {_fmt(self.total_bytes)}"]
        if self.peak_allocated_bytes is not None:
            items.append(f"peak {_fmt(self.peak_allocated_bytes)}")
        if self.limit_bytes is not None:
            items.append(f"limit {_fmt(self.limit_bytes)}")
        return f"{self.device}: " + ", ".join(items)


@dataclass
class MemoryReport:
    """Memory per device plus the largest live tensors and the tensors that hold autograd graphs."""

    devices: list[DeviceMemory]
    largest: list[TensorInfo]
    graph_holders: list[TensorInfo] = field(default_factory=list)

    def text(self) -> str:
        lines = [d.describe() for d in self.devices]
        if self.largest:
            lines.append("largest live tensors:")
            lines += [f"  {t.describe()}" for t in self.largest]
        if self.graph_holders:
            lines.append("live tensors holding autograd graphs:")
            lines += [f"  {t.describe()}" for t in self.graph_holders]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_report(device: Any = None, *, top: int = 10) -> MemoryReport:
    """Memory of DEVICE (default: the CPU and every CUDA device this process has used) and its
    TOP largest live tensors, with the op that made them and what holds them."""
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
        from ..placement.resolve import device as resolve_device

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
    limits = [v for v in (host.cgroup_memory_limit(), host.address_space_limit()) if v is not None]
    mem = DeviceMemory("cpu", allocated_bytes=live, reserved_bytes=int(psutil.Process().memory_info().rss),
                       free_bytes=int(vm.available), total_bytes=int(vm.total),
                       limit_bytes=min(limits) if limits else None)
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
            if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta" or obj.is_sparse:
                continue
            if keep is not None and not keep(obj):
                continue
            key = (str(obj.device), obj.untyped_storage().data_ptr())
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
    seen_nodes: set[int] = set()
    seen_storage: set[int] = set()
    total = 0
    stack = [t.grad_fn] if t.grad_fn is not None else []
    while stack and len(seen_nodes) < _MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by backward
                continue
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, torch.Tensor):
                    ptr = item.untyped_storage().data_ptr()
                    if ptr and ptr not in seen_storage:
                        seen_storage.add(ptr)
                        total += _storage_bytes(item)
        stack.extend(fn for fn, _ in node.next_functions)
    return total


def describe_tensors(chosen: list[torch.Tensor], *own_lists: list[torch.Tensor]) -> list[TensorInfo]:
    """TensorInfo for CHOSEN; OWN_LISTS (the caller's scan lists) are not reported as holders."""
    origins = _cuda_origins({t.device for t in chosen if t.device.type == "cuda"})
    own = {id(chosen), *map(id, own_lists)}
    return [tensor_info(t, holder_of(t, own), origins) for t in chosen]


def tensor_info(t: torch.Tensor, held_by: str | None = None, origins: dict[int, str] | None = None) -> TensorInfo:
    """Describe one tensor without keeping a reference to it."""
    info = TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), _storage_bytes(t),
                      t.requires_grad, type(t.grad_fn).__name__ if t.grad_fn is not None else None, held_by=held_by)
    if t.grad_fn is not None:
        info.graph_bytes = graph_saved_bytes(t)
    if origins and t.device.type == "cuda":
        info.origin = origins.get(t.untyped_storage().data_ptr())
    return info


def cuda_origins(tensors: Iterable[torch.Tensor]) -> dict[int, str]:
    """data_ptr -> allocation site for the CUDA tensors among TENSORS (empty without history)."""
    return _cuda_origins({t.device for t in tensors if t.device.type == "cuda"})


def containers_of(targets: list[torch.Tensor], *own_lists: Any, limit: int = 5) -> list[tuple[str, list[torch.Tensor]]]:
    """The Python containers (lists, tuples, sets, dicts) that reference TARGETS, most first, each
    described ('a list of 60 items (global 'history' in __main__)') with the targets it holds.

    One pass over the heap, so it stays cheap for many targets. Targets in no container are
    referenced only by local variables or by autograd graphs (saved activations).
    """
    wanted = {id(t): t for t in targets}
    heap = gc.get_objects()
    own = {id(targets), id(wanted), id(heap), *map(id, own_lists)}
    found: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for obj in heap:
        if id(obj) in own or type(obj) not in (list, tuple, set, dict):
            continue
        values = obj.values() if type(obj) is dict else obj
        try:
            hits = [wanted[id(v)] for v in values if id(v) in wanted]
        except RuntimeError:  # a container changed size while we read it
            continue
        if hits:
            found[id(obj)] = (obj, hits)
    heap.clear()
    ranked = sorted(found.values(), key=lambda item: len(item[1]), reverse=True)[:limit]
    ignore = own | {id(found), id(ranked)} | {id(item) for item in ranked} | {id(item) for item in found.values()}
    out = [(_describe_container(obj, hits[0], ignore), hits) for obj, hits in ranked]
    found.clear()
    ranked.clear()
    return out


def _describe_container(obj: Any, first: Any, ignore: set[int]) -> str:
    if type(obj) is dict:
        key = next((k for k, v in obj.items() if v is first), None)
        if "__builtins__" in obj and "__name__" in obj:
            return f"global {key!r} in {obj['__name__']}"
        owner = _dict_owner(obj, ignore | {id(obj)})
        return f"{key!r} of {owner}" if owner else f"key {key!r} of a dict of {len(obj)} items"
    what = f"a {type(obj).__name__} of {len(obj)} items"
    outer = holder_of(obj, ignore, depth=1)
    return f"{what} ({outer})" if outer else what


def holder_of(obj: Any, ignore: set[int], depth: int = 2) -> str | None:
    """Name what references OBJ: 'global x in m', 'attribute x of C', 'a list of N items in ...'."""
    refs = gc.get_referrers(obj)  # one heap scan per call: only for the few objects a report names
    ignore = ignore | {id(obj), id(refs)}
    for ref in refs:
        if id(ref) in ignore or isinstance(ref, (types.FrameType, types.CoroutineType, types.GeneratorType)):
            continue
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), None)
            if key is None:
                continue
            if "__builtins__" in ref and "__name__" in ref:
                return f"global {key!r} in {ref['__name__']}"
            owner = _dict_owner(ref, ignore | {id(ref)})
            return f"{key!r} of {owner}" if owner else f"key {key!r} of a dict"
        if isinstance(ref, (list, tuple, set)):
            what = f"a {type(ref).__name__} of {len(ref)} items"
            if depth > 1:
                outer = holder_of(ref, ignore | {id(ref)}, depth - 1)
                if outer:
                    return f"{what} ({outer})"
            return what
    return None


def _dict_owner(d: dict, ignore: set[int]) -> str | None:
    refs = gc.get_referrers(d)
    for ref in refs:
        if ref is refs or id(ref) in ignore or isinstance(ref, (dict, types.FrameType)):
            continue
        if getattr(ref, "__dict__", None) is d:
            return f"a {type(ref).__name__}"
        if isinstance(ref, torch.nn.Module):  # _parameters / _buffers dicts
            return f"a {type(ref).__name__} module"
    return None


def _cuda_origins(devices: set[torch.device]) -> dict[int, str]:
    """data_ptr -> 'file:line in fn' from torch's CUDA memory history, when it is being recorded."""
    if not devices:
        return {}
    try:
        snapshot = torch.cuda.memory._snapshot()
    except Exception:
        return {}
    out: dict[int, str] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            frames = block.get("frames") or []
            user = next((f for f in frames if "/torch/" not in f.get("filename", "")
                         and "/torchplace/" not in f.get("filename", "")), None)
            if user and block.get("state") == "active_allocated":
                out[int(block["address"])] = f"{user.get('filename')}:{user.get('line')} in {user.get('name')}"
    return out


def _fmt(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
