"""Leak detector: memory that grows step after step, and the live tensors that keep graphs alive.

    with torchplace.track_memory() as tracker:
        for batch in loader:
            train_step(batch)
            tracker.step()

Each `step()` reads one cheap number (CUDA: bytes allocated by tensors; CPU: bytes in use on the C
heap from glibc's mallinfo2, else the resident set).
After `warmup_steps` (optimizer state and allocator caches appear in the first steps) it also
notes which live tensors hold autograd graphs. On exit it flags a leak when memory grew beyond
a tolerance in both halves of the run (steady growth, not a one-off cache), or when new
graph-holding tensors piled up (the classic `losses.append(loss)`), and names them and what
holds them. When memory grew, it also compares what each holder (dict, list, deque, object
attribute) held at the baseline with what it holds at the end (two heap walks, never in
`step()`), and names those that grew by the user's name: "dict `seen` (train.py:42) grew by
224.0 MiB: 28 tensor(s) of 8.0 MiB added (cpu)". A leak warns (`MemoryLeakWarning`) or, under
strict mode, raises `MemoryLeakError`.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from ..errors import MemoryLeakError, MemoryLeakWarning
from ..policy.devices import DeviceSpec
from ..shared.strict_switch import should_raise
from ..units import format_bytes
from .holders import (
    Growth,
    Holding,
    containers_of,
    graph_roots,
    group_by_holder,
    grown,
    holdings,
    name_holder,
    name_root,
    user_frames,
)
from .usage import LiveTensor, cuda_origins, graph_holders, live_tensors, tensor_info

CPU_TOLERANCE = 16 * 2**20  # heap noise (glibc arenas, thread caches); the resident set is noisier still
CUDA_TOLERANCE = 2**20  # the caching allocator's counter is exact
_DESCRIBED = 20


@dataclass
class LeakReport:
    """What grew, by how much, and the new live tensors that hold autograd graphs."""

    device: str
    steps: int
    growth_bytes: int
    tolerance_bytes: int
    samples: list[int]
    new_graph_holders: int
    holders: list[LiveTensor] = field(default_factory=list)
    kept_by: list[str] = field(default_factory=list)  # "28 x float32 [] made by MeanBackward0 in ..."
    grew: list[Growth] = field(default_factory=list)  # holders holding more tensor memory than at the start
    message: str = ""


class MemoryTracker:
    """Created by `track_memory`; call `step()` once per training or evaluation step."""

    def __init__(self, device: torch.device, tolerance_bytes: int | None, warmup_steps: int,
                 strict: bool | None, record_origins: bool) -> None:
        self.device = device
        self.tolerance_bytes = tolerance_bytes if tolerance_bytes is not None else (
            CUDA_TOLERANCE if device.type == "cuda" else CPU_TOLERANCE)
        self.warmup_steps = warmup_steps
        self.strict = strict
        self.record_origins = record_origins and device.type == "cuda"
        self.samples: list[int] = []  # one per step after warmup; samples[0] is the baseline
        self.steps = 0
        self.report: LeakReport | None = None
        self._baseline_holders: set[int] = set()
        self._baseline_graphs: set[tuple[int, int]] = set()
        self._holdings: dict[int, Holding] = {}
        self._frame: Any = None  # the frame of the `with` block: its variables name the holders

    def __enter__(self) -> MemoryTracker:
        self._frame = sys._getframe(1)
        if self.record_origins:
            # Python frames only: origins are user lines, and C++ stacks are symbolised by a pool of
            # addr2line processes that torch keeps for the rest of the program
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)
        if self.warmup_steps == 0:
            self._baseline()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc is None:
                self.report = self.check()
        finally:
            self._frame = None
            if self.record_origins:
                torch.cuda.memory._record_memory_history(enabled=None)
        if self.report is not None:
            if should_raise(self.strict):
                raise MemoryLeakError(self.report.message)
            warnings.warn(self.report.message, MemoryLeakWarning, stacklevel=2)

    def step(self) -> None:
        """Record the end of one step."""
        self.steps += 1
        if self.steps == self.warmup_steps:
            self._baseline()
        elif self.steps > self.warmup_steps:
            self.samples.append(self._reading())

    def _baseline(self) -> None:
        self.samples = [self._reading()]
        tensors = live_tensors(self._on_device)
        self._baseline_holders = {id(t) for t in graph_holders(tensors)}
        # graphs alive before the baseline (a traceback's, an earlier loop's) are not this loop's growth; an
        # in-place update (`total += loss`) gives the same tensor a new grad_fn, so the pair marks one graph
        self._baseline_graphs = {(id(t), id(t.grad_fn)) for t in tensors if t.grad_fn is not None}
        tensors.clear()
        self._holdings = holdings(self._on_device, own={id(self._holdings)})

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and (self.device.index is None or t.device.index == self.device.index)

    def _reading(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        in_use = _heap_in_use()
        if in_use is not None:
            return in_use
        import psutil

        return int(psutil.Process().memory_info().rss)

    def check(self) -> LeakReport | None:
        """The leak report for the steps so far, or None when memory stayed flat."""
        tracked = len(self.samples) - 1
        if tracked < 1:
            return None
        s = self.samples
        growth = s[-1] - s[0]
        mid = s[len(s) // 2]
        steady = tracked >= 3 and growth > self.tolerance_bytes and mid > s[0] and s[-1] > mid
        tensors = live_tensors(self._on_device)
        try:
            current = graph_holders(tensors)
            added = len(current) - len(self._baseline_holders)  # a clean loop holds as many as at the start
            piled = added >= max(2, tracked // 2)
            if not (steady or piled):
                return None
            new = [t for t in current if id(t) not in self._baseline_holders]
            holders, kept_by = _describe_holders(new, tensors, current)
            del current, new
        finally:
            tensors.clear()
        report = LeakReport(str(self.device), tracked, growth, self.tolerance_bytes, list(s), max(0, added),
                            holders, kept_by)
        if steady:  # memory grew: compare what each holder holds now with the baseline
            report.grew = self._grown_holders(max(self.tolerance_bytes // 4, growth // 20, 1))
        report.message = _message(report, steady)
        return report

    def _grown_holders(self, min_bytes: int, top: int = 3) -> list[Growth]:
        """The TOP holders that hold MIN_BYTES more than at the baseline, named (the slow path)."""
        objects: dict[int, Any] = {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # attributes read while naming: some lazy proxies warn
                now = holdings(self._on_device, own={id(self._holdings), id(objects)}, objects=objects)
                frames = user_frames(self._frame if self._frame is not None else sys._getframe(2))
                out = []
                for key, growth, added in grown(self._holdings, now, min_bytes)[:top]:
                    name, where = name_holder(objects[key], frames, {id(objects), id(now), id(frames)})
                    out.append(Growth(name, where, str(self.device), growth, added, now[key].tensors, now[key].nbytes))
                if not out:  # held by no Python object: saved in the autograd graphs of tensors the user keeps
                    roots = [root for root in graph_roots(self._on_device, 1, own={id(objects)}, top=10_000)
                             if (id(root[0]), id(root[0].grad_fn)) not in self._baseline_graphs]
                    groups = [g for g in group_by_holder(roots, objects) if sum(g[2].values()) >= min_bytes][:top]
                    ignore = {id(objects), id(now), id(frames), id(roots), id(groups)}
                    for holder, kept, saved in groups:  # not measured at the start: all they save now is growth
                        name, where = (name_holder(holder, frames, ignore) if holder is not None
                                       else name_root(kept[0], frames, ignore))
                        size = sum(saved.values())
                        out.append(Growth(name, where, str(self.device), size, len(saved), len(saved), size))
                    roots.clear()
                    groups.clear()
                frames.clear()
                return out
        finally:
            objects.clear()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> Any:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    except (AttributeError, OSError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def _heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc's mallinfo2, under a
    microsecond): unlike the resident set, it grows even while freed memory is being reused."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _describe_holders(new: list[torch.Tensor], *own_lists: list[torch.Tensor]) -> tuple[list[LiveTensor], list[str]]:
    """Describe the new graph holders, those kept in Python containers first (the culprits), and
    count them per container; the rest are referenced by local variables, or only by those
    graphs (saved activations)."""
    origins = cuda_origins(new[:_DESCRIBED])
    described: list[LiveTensor] = []
    kept_by: list[str] = []
    seen: set[int] = set()
    for where, hits in containers_of(new, *own_lists):
        kinds = Counter(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} made by {type(t.grad_fn).__name__}"
                        for t in hits)
        kept_by += [f"{n} x {kind} in {where}" for kind, n in kinds.most_common(3)]
        for t in hits:
            if id(t) not in seen and len(described) < _DESCRIBED:
                seen.add(id(t))
                described.append(tensor_info(t, where, origins))
    for t in new:
        if id(t) not in seen and len(described) < _DESCRIBED:
            seen.add(id(t))
            described.append(tensor_info(t, None, origins))
    return described, kept_by


def _message(r: LeakReport, steady: bool) -> str:
    parts = []
    what = "bytes allocated by tensors" if r.device.startswith("cuda") else (
        "bytes in use on the C heap" if _MALLINFO2 is not None else "the process's resident memory")
    if steady:
        parts.append(f"Memory on {r.device} ({what}) grew by {format_bytes(r.growth_bytes)} over {r.steps} steps "
                     f"(about {format_bytes(r.growth_bytes // r.steps)} per step, from {format_bytes(r.samples[0])} to "
                     f"{format_bytes(r.samples[-1])}), beyond the tolerance of {format_bytes(r.tolerance_bytes)}.")
    else:
        parts.append(f"Memory on {r.device} grew by {format_bytes(r.growth_bytes)} over {r.steps} steps, within the "
                     f"tolerance of {format_bytes(r.tolerance_bytes)}, but live tensors holding autograd graphs "
                     "piled up.")
    if r.new_graph_holders:
        listed = "; ".join(r.kept_by[:5]) or "none is kept in a list, dict or attribute (look at local variables)"
        parts.append(f"{r.new_graph_holders} more live tensor(s) hold autograd graphs than at the start: {listed}.")
        parts.append("Fix: keep loss.item() or loss.detach() instead of the tensor, and run evaluation "
                     "under torch.no_grad() or torch.inference_mode().")
    if r.grew:
        parts.append("Holders of tensors that grew: " + "; ".join(g.describe() for g in r.grew) + ".")
        if not r.new_graph_holders:
            parts.append("Fix: bound what they keep (drop old entries, collections.deque(maxlen=...), an LRU "
                         "cache), or keep what you need from each tensor (.item(), a summary) instead of the tensor.")
    elif not r.new_graph_holders:
        parts.append("No new tensor holds an autograd graph, and no list, dict or attribute holds more tensor "
                     "memory than at the start: look for tensors kept by local variables, or memory outside "
                     "torch (torchplace.memory_report() lists the largest live tensors).")
    return " ".join(parts)


def track_memory(device: DeviceSpec = None, *, tolerance_bytes: int | None = None, warmup_steps: int = 2,
                 strict: bool | None = None, record_origins: bool = False) -> MemoryTracker:
    """A leak detector for a loop over steps (see the module docstring).

    Call `tracker.step()` once per step; each step reads one cheap number. On exit it flags memory
    that grew in both halves of the run beyond the tolerance, and new tensors holding autograd
    graphs (the classic `losses.append(loss)`), naming what holds them.

    Args:
        device: any `torchplace.device` spec (default: this process's device, `torchplace.device()`).
        tolerance_bytes: growth allowed over the whole run (default 1 MiB on CUDA, 16 MiB on the
            CPU, whose resident set is noisier).
        warmup_steps: steps before the baseline (optimizer state and caches appear in the first).
        strict: raise `MemoryLeakError` instead of warning (default: follow strict mode).
        record_origins: record CUDA allocation stacks while tracking, so the report says where
            leaked tensors were made (slows allocations).

    Returns:
        A `MemoryTracker` context manager: `step()`, and `check()` for the report so far.

    Raises:
        MemoryLeakError: on exit, a leak was found under strict mode (otherwise a
            `MemoryLeakWarning` is issued).
        DeviceError: the device does not exist here.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(8, 1)
        with tp.track_memory("cpu") as tracker:
            for _ in range(6):
                model(torch.randn(4, 8)).sum().backward()
                tracker.step()
        print(tracker.check())  # None: memory stayed flat
        ```
    """
    from ..policy.devices import device as resolve_device

    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be 0 or more.")
    return MemoryTracker(resolve_device("auto" if device is None else device), tolerance_bytes,
                         warmup_steps, strict, record_origins)
