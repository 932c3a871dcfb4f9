"""OOM diagnosis, and the largest batch that fits.

`diagnose_oom()` (a context manager and a decorator) turns an out-of-memory failure into a
report of what held memory at that moment and what to try, raised as `OutOfMemoryDiagnosis`,
a subclass of `torch.OutOfMemoryError` (so existing `except torch.OutOfMemoryError` still
works) chained to the original. It also recognizes the CPU's form, which torch raises as a
plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), and Python's MemoryError.

`find_batch_size(fn, start)` doubles the batch until `fn(batch)` runs out of memory, then
bisects between the last size that fit and the first that did not.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from ..errors import TorchplaceError
from ..policy.devices import DeviceSpec
from ..units import format_bytes, parse_size
from .usage import MemoryReport, describe_tensors, device_memory, graph_holders, live_tensors

RESERVE_BYTES = 32 * 2**20
_CPU_OOM = "DefaultCPUAllocator: can't allocate memory"


def is_oom(exc: BaseException) -> bool:
    """True for torch.OutOfMemoryError, the CPU allocator's RuntimeError, and MemoryError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and _CPU_OOM in str(exc)


def requested_bytes(message: str) -> int | None:
    """The size of the failed allocation, from torch's CUDA or CPU message."""
    match = re.search(r"[Tt]ried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    if match:
        return parse_size(match.group(1) + match.group(2))
    match = re.search(r"you tried to allocate (\d+) bytes", message)
    return int(match.group(1)) if match else None


def failed_device(message: str, exc: BaseException) -> torch.device | None:
    """The device that ran out, from the message ('GPU 0' is the CUDA ordinal), else None."""
    if _CPU_OOM in message or isinstance(exc, MemoryError):
        return torch.device("cpu")
    match = re.search(r"GPU (\d+)", message)
    if match:
        return torch.device("cuda", int(match.group(1)))
    if "MPS" in message:
        return torch.device("mps")
    return None


@dataclass
class OomReport:
    """What held memory when an allocation failed, and what to try."""

    device: str | None
    requested_bytes: int | None
    original: str  # the first line of torch's message
    memory: MemoryReport | None = None
    other_processes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    def text(self) -> str:
        asked = f" allocating {format_bytes(self.requested_bytes)}" if self.requested_bytes else ""
        lines = [f"Out of memory on {self.device or 'an unknown device'}{asked}: {self.original}"]
        if self.memory is not None:
            lines.append(self.memory.text())
        if self.other_processes:
            lines.append("other processes on this GPU: " + "; ".join(self.other_processes))
        lines.append("what to try:")
        lines += [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)


class OutOfMemoryDiagnosis(torch.OutOfMemoryError, TorchplaceError):
    """An out-of-memory failure with its report (`.report`); the original is its __cause__."""

    def __init__(self, report: OomReport) -> None:
        super().__init__(report.text())
        self.report = report


def diagnose(exc: BaseException, device: Any = None, top: int = 5) -> OomReport:
    """Build the report for an out-of-memory exception, at the moment it was raised."""
    message = str(exc)
    dev = torch.device(device) if device is not None else failed_device(message, exc)
    report = OomReport(str(dev) if dev else None, requested_bytes(message),
                       message.strip().splitlines()[0] if message.strip() else type(exc).__name__)
    if dev is not None:
        same = lambda t: t.device.type == dev.type and dev.index in (None, t.device.index)  # noqa: E731
        tensors = live_tensors(same)
        try:
            ranked = sorted(tensors, key=lambda t: t.untyped_storage().nbytes(), reverse=True)[:top]
            holders = graph_holders(tensors)[:top]
            report.memory = MemoryReport([device_memory(dev, tensors)], describe_tensors(ranked, tensors),
                                         describe_tensors(holders, tensors))
            del ranked, holders
        finally:
            tensors.clear()
        if dev.type == "cuda":
            report.other_processes = _other_processes(dev)
    report.suggestions = _suggestions(report, dev)
    return report


def _suggestions(r: OomReport, dev: torch.device | None) -> list[str]:
    out = []
    mem = r.memory.devices[0] if r.memory else None
    if mem and mem.reserved_bytes and mem.allocated_bytes is not None and dev is not None and dev.type == "cuda":
        slack = mem.reserved_bytes - mem.allocated_bytes
        if r.requested_bytes and slack >= r.requested_bytes:
            out.append(f"{format_bytes(slack)} is reserved by the caching allocator but unallocated, more than the "
                       f"{format_bytes(r.requested_bytes)} asked for: fragmentation. Set "
                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts.")
    if r.memory and any(t.held_by for t in r.memory.graph_holders):  # the failing step's own are expected
        out.append("tensors kept in variables or containers hold autograd graphs (listed above): keep "
                   "loss.item() or .detach() instead of the tensor, and run evaluation under torch.no_grad() "
                   "or torch.inference_mode().")
    if r.other_processes:
        out.append("other processes use this GPU (listed above): pick a free one with torchplace.pick(), "
                   "or stop them.")
    if mem and mem.limit_bytes is not None and dev is not None and dev.type == "cpu":
        out.append(f"this process is limited to {format_bytes(mem.limit_bytes)} ({mem.limit_kind}): raise the limit, "
                   "or use less memory as below.")
    out.append("use a smaller batch: torchplace.find_batch_size(fn, start) finds the largest that fits.")
    if dev is not None and dev.type == "cuda":
        out.append("compute in bf16/fp16 (torchplace.precision_for(device).autocast()) to halve activations, "
                   "and use activation checkpointing (torch.utils.checkpoint) to trade compute for memory.")
    return out


def _other_processes(dev: torch.device) -> list[str]:
    """Other processes NVML sees on the physical GPU behind DEV (never starts anything new)."""
    import os

    try:
        from ..hardware.topology import read_topology
        from ..hardware.visible import map_visible

        topology = read_topology(links=False)
        entry = map_visible(topology=topology).physical(dev.index or 0)
        gpu = next((g for g in topology.gpus if entry and g.physical_index == entry.physical_index), None)
    except Exception:  # no NVML: nothing to add
        return []
    if gpu is None or not gpu.processes:
        return []
    return [f"pid {p.pid} ({p.name or '?'}, user {p.user or '?'}) uses {format_bytes(p.used_memory_bytes)}"
            for p in gpu.processes if p.pid != os.getpid()]


class diagnose_oom(contextlib.ContextDecorator):  # noqa: N801 - used like a function
    """Turn an out-of-memory failure inside the block (or decorated function) into a diagnosis.

    The report says what held memory at that moment (largest tensors, other processes on the GPU,
    the process's limits) and what to try. Other exceptions pass through untouched. On entry it
    maps `reserve_bytes` of address space that it unmaps on a failure, so that under RLIMIT_AS or
    strict overcommit the report itself still has room to be built.

    Args:
        device: the device to report on (default: the one that ran out).
        top: how many of the largest live tensors to list.
        reserve_bytes: address space kept for building the report (0: none).

    Raises:
        OutOfMemoryDiagnosis: a `torch.OutOfMemoryError` (so existing `except` clauses work)
            whose message is the report, kept on `.report`; the original is its `__cause__`.

    Example:
        ```python
        import torch
        import torchplace as tp

        @tp.diagnose_oom()
        def step(n):
            return torch.empty(n, dtype=torch.uint8)

        try:
            step(1 << 62)  # far more than any machine has
        except torch.OutOfMemoryError as err:
            print(str(err).splitlines()[0])
        ```
    """

    def __init__(self, device: DeviceSpec = None, *, top: int = 5, reserve_bytes: int = RESERVE_BYTES) -> None:
        self.device = device
        self.top = top
        self.reserve_bytes = reserve_bytes
        self.report: OomReport | None = None
        self._reserve: mmap.mmap | None = None

    def __enter__(self) -> diagnose_oom:
        if self.reserve_bytes and self._reserve is None:
            try:  # address space (and commit charge) only; untouched pages use no RAM
                self._reserve = mmap.mmap(-1, self.reserve_bytes)
            except (OSError, ValueError):
                self._reserve = None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._reserve is not None:  # give the reserve back, so the report has room to be built
            self._reserve.close()
            self._reserve = None
        if exc is None or isinstance(exc, OutOfMemoryDiagnosis) or not is_oom(exc):
            return None
        self.report = diagnose(exc, self.device, self.top)
        raise OutOfMemoryDiagnosis(self.report) from exc


# --------------------------------------------------------------------------- batch size search


def find_batch_size(fn: Callable[[int], Any], start: int = 1, *, max_size: int | None = None,
                    device: DeviceSpec = None) -> int:
    """The largest batch size for which `fn(batch_size)` runs without running out of memory.

    Doubling from START finds a size that fails, bisection the boundary; each failure is followed
    by a garbage collection and (on CUDA) `torch.cuda.empty_cache()`. The answer leaves no headroom
    for fragmentation or longer inputs: take a margin below it.

    Args:
        fn: runs one full step (forward, backward, optimizer) at the batch size it is given.
        start: the first size tried.
        max_size: never try more than this.
        device: the device whose out-of-memory errors count (default: any).

    Returns:
        The largest size that ran.

    Raises:
        OutOfMemoryDiagnosis: even START does not fit.
        ValueError: not 1 <= START <= MAX_SIZE.

    Example:
        ```python
        import torch
        import torchplace as tp

        def step(batch_size):
            if batch_size > 48:  # stands in for a real step running out of memory
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            torch.randn(batch_size, 8).sum()

        print(tp.find_batch_size(step, start=4, max_size=256))  # 48
        ```
    """
    if start < 1 or (max_size is not None and max_size < start):
        raise ValueError(f"start={start} and max_size={max_size}: need 1 <= start <= max_size.")
    good, bad = 0, None
    size = start
    while True:  # grow (or shrink) until the boundary is bracketed
        fits = _fits(fn, size, device)
        if fits:
            good = size
            if max_size is not None and size >= max_size:
                return size
            if bad is not None:
                break
            size = size * 2 if max_size is None else min(size * 2, max_size)
        else:
            bad = size
            if good:
                break
            if size == 1:
                with diagnose_oom(device):
                    fn(1)  # fails again, now with a diagnosis
                return 1  # pragma: no cover - it fit after all
            size //= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if _fits(fn, mid, device):
            good = mid
        else:
            bad = mid
    return good


def _fits(fn: Callable[[int], Any], size: int, device: Any) -> bool:
    try:
        fn(size)
        return True
    except Exception as exc:  # noqa: BLE001 - only out-of-memory failures are swallowed
        if not is_oom(exc):
            raise
    # outside the except block: the exception, its traceback and their tensors are gone
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return False
