"""Which GPUs a pick may take, best first, and why the others not: the pure half of `pick`.

`rank_gpus` drops GPUs that fail the request (MIG mode, free memory below the minimum,
utilization above the maximum, hidden by an existing CUDA_VISIBLE_DEVICES allocation), then
orders the rest by other users' processes (fewer first), free memory (more first, in 4 GiB
steps so near-equal GPUs tie), utilization (lower first, in 10% steps), and a random tie-break,
so that idle GPUs are not handed out physical 0 first. `choose` adds what the request names
(counts, explicit GPUs) and its errors. Nothing here reads NVML or touches a lease: everything
runs on a snapshot, and `distributed/pick.py` does the leasing and the waiting.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import LeaseError
from ..hardware.topology import GpuRecord, Topology
from ..units import format_bytes, parse_duration, parse_size

FREE_MEMORY_STEP = 4 * 2**30  # free memory within one step counts as equal
UTILIZATION_STEP = 10  # percent


@dataclass(frozen=True)
class PickRequest:
    """What a pick asks for, checked and in plain units (`build` parses sizes and durations).

    `named` picks exactly those GPUs (physical indices or UUIDs) and `count` is then ignored;
    `count` "auto" takes every GPU that satisfies the request now.
    """

    count: int | Literal["auto"] = 1
    named: tuple[int | str, ...] | None = None
    min_free_memory_bytes: int | None = None
    max_utilization: int | None = None  # percent
    wait_s: float = 0.0
    lease: bool = True
    snapshot: str | os.PathLike[str] | None = None
    lease_dir: str | os.PathLike[str] | None = None
    command: str | None = None  # recorded as the holder's command (default: this process's argv)
    seed: int | None = None  # fixes the random tie-break (tests)
    memory_bytes: int | None = None  # reserve this much of each GPU (shared); None: whole GPUs

    @classmethod
    def build(cls, count: int | str = 1, *, gpus: Sequence[int | str] | None = None,
              min_free_memory: int | str | None = None, max_utilization: int | None = None,
              wait: float | str | None = None, lease: bool = True,
              snapshot: str | os.PathLike[str] | None = None, lease_dir: str | os.PathLike[str] | None = None,
              command: str | None = None, seed: int | None = None,
              memory: int | str | None = None) -> PickRequest:
        """The request from `pick()`'s arguments; LeaseError for a value that cannot be one."""
        if count != "auto" and (not isinstance(count, int) or count < 1):
            raise LeaseError(f"count={count!r} must be a whole number >= 1 or 'auto'.")
        try:
            min_free = parse_size(min_free_memory) if min_free_memory is not None else None
            wait_s = parse_duration(wait) if wait is not None else 0.0
            memory_bytes = parse_size(memory) if memory is not None else None
        except ValueError as exc:
            raise LeaseError(str(exc)) from None
        if max_utilization is not None and not 0 <= max_utilization <= 100:
            raise LeaseError(f"max_utilization={max_utilization} must be a percentage from 0 to 100.")
        if memory_bytes is not None and memory_bytes < 1:
            raise LeaseError(f"memory={memory!r} reserves nothing. Fix: ask for e.g. '20GiB', or leave it out "
                             "for whole GPUs.")
        return cls(count, None if gpus is None else tuple(gpus), min_free, max_utilization, wait_s, lease,
                   snapshot, lease_dir, command, seed, memory_bytes)


@dataclass(frozen=True)
class Rejection:
    """A GPU that was not picked, and why (a full sentence fragment for messages)."""

    physical_index: int
    uuid: str
    reason: str

    def describe(self) -> str:
        return f"GPU {self.physical_index} ({self.uuid}): {self.reason}"


def my_user() -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return None


def other_users_processes(gpu: GpuRecord, me: str | None) -> int | None:
    if gpu.processes is None:
        return None
    return sum(1 for p in gpu.processes if p.user is None or p.user != me)


def _visible_allocation(topology: Topology, environ: Any) -> tuple[set[str] | None, str | None]:
    """UUIDs an existing CUDA_VISIBLE_DEVICES (a scheduler's allocation) allows, or None for all."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None, None
    from ..hardware.visible import map_visible

    vis = map_visible(value, topology, environ.get("CUDA_DEVICE_ORDER"))
    return {d.uuid for d in vis.visible}, f"hidden by CUDA_VISIBLE_DEVICES={value!r} in this environment"


def rank_gpus(topology: Topology, *, min_free_memory: int | None = None,
              max_utilization: int | None = None, only: Sequence[str] | None = None,
              user: str | None = None, rng: random.Random | None = None,
              environ: Any = None) -> tuple[list[GpuRecord], list[Rejection]]:
    """Order the GPUs that satisfy the request, best first, and say why the others do not.

    Pure: reads only `topology` (and `environ`'s CUDA_VISIBLE_DEVICES, default os.environ), so
    it runs the same on a snapshot. `only` restricts to those UUIDs (an explicit request).
    """
    rng = rng or random.Random()
    user = user if user is not None else my_user()
    allowed, hidden_reason = _visible_allocation(topology, os.environ if environ is None else environ)
    accepted: list[tuple[tuple[float, ...], GpuRecord]] = []
    rejected: list[Rejection] = []
    for gpu in sorted(topology.gpus, key=lambda g: g.physical_index):
        if only is not None and gpu.uuid not in only:
            continue
        reason = _reject_reason(gpu, min_free_memory, max_utilization)
        if reason is None and allowed is not None and gpu.uuid not in allowed:
            reason = hidden_reason
        if reason is not None:
            rejected.append(Rejection(gpu.physical_index, gpu.uuid, reason))
            continue
        others = other_users_processes(gpu, user) or 0
        free = gpu.memory_free_bytes if gpu.memory_free_bytes is not None else 0
        util = gpu.utilization if gpu.utilization is not None else 100
        key = (others, -(free // FREE_MEMORY_STEP), util // UTILIZATION_STEP, rng.random())
        accepted.append((key, gpu))
    accepted.sort(key=lambda item: item[0])
    return [gpu for _, gpu in accepted], rejected


def _reject_reason(gpu: GpuRecord, min_free: int | None, max_util: int | None) -> str | None:
    if gpu.uuid.startswith("unknown"):
        return f"NVML could not read its UUID ({gpu.unknown.get('uuid', 'no reason given')})"
    if gpu.mig_mode == "enabled":
        return ("MIG mode is enabled, so CUDA sees its MIG slices rather than the GPU; pick does "
                "not hand out MIG slices (set CUDA_VISIBLE_DEVICES=MIG-... yourself)")
    if min_free is not None:
        if gpu.memory_free_bytes is None:
            return f"free memory is unknown ({gpu.unknown.get('memory', 'NVML gave no reading')})"
        if gpu.memory_free_bytes < min_free:
            return f"{format_bytes(gpu.memory_free_bytes, 'GiB')} free < {format_bytes(min_free, 'GiB')} required"
    if max_util is not None:
        if gpu.utilization is None:
            return f"utilization is unknown ({gpu.unknown.get('utilization', 'NVML gave no reading')})"
        if gpu.utilization > max_util:
            return f"{gpu.utilization}% utilization > {max_util}% allowed"
    return None


def _resolve_explicit(topology: Topology, requested: Sequence[int | str]) -> list[str]:
    """UUIDs of GPUs named by physical index or UUID (prefix allowed), with errors that list
    what exists."""
    by_index = {g.physical_index: g for g in topology.gpus}
    out: list[str] = []
    for item in requested:
        text = str(item).strip()
        if text.isascii() and text.isdigit():  # int() also reads '²' and has a limit of digits
            gpu = by_index.get(int(text)) if len(text) <= 12 else None
            if gpu is None:
                raise LeaseError(f"GPU {text:.40} was requested, but this machine has {_inventory(topology)} "
                                 "(physical indices, as nvidia-smi numbers them). Fix: name one of those.")
        else:
            hits = [g for g in topology.gpus if g.uuid.startswith(text)] if text.startswith("GPU-") else []
            if len(hits) != 1:
                what = "matches no GPU" if not hits else f"matches {len(hits)} GPUs"
                raise LeaseError(f"GPU {text!r:.60} {what}; this machine has {_inventory(topology)}. Fix: "
                                 "pass a physical index or a unique 'GPU-' UUID prefix.")
            gpu = hits[0]
        if gpu.uuid in out:
            raise LeaseError(f"GPU {text!r} was requested twice ({list(requested)}). Fix: name each GPU once.")
        out.append(gpu.uuid)
    return out


def _inventory(topology: Topology) -> str:
    if not topology.gpus:
        return "no GPUs"
    gpus = sorted(topology.gpus, key=lambda g: g.physical_index)
    return ", ".join(f"GPU {g.physical_index} ({g.name or '?'}, {g.uuid})" for g in gpus)


def _describe_request(count: int | str, min_free: int | None, max_util: int | None,
                      only: Sequence[str] | None, memory: int | None = None) -> str:
    what = f"GPUs {', '.join(only)}" if only else ("any free GPUs" if count == "auto" else
                                                    f"{count} GPU{'s' if count != 1 else ''}")
    conditions = []
    if min_free is not None:
        conditions.append(f">= {format_bytes(min_free, 'GiB')} free")
    if max_util is not None:
        conditions.append(f"<= {max_util}% utilization")
    if memory is not None:
        conditions.append(f"{format_bytes(memory, 'GiB')} reserved on each")
    return what + (f" with {' and '.join(conditions)}" if conditions else "")


@dataclass(frozen=True)
class Choice:
    """One decision on one reading of the facts: the GPUs in order of preference, those ruled
    out and why, how many to take ("auto": all of `ordered`) and the UUIDs the request named."""

    ordered: list[GpuRecord]
    rejected: list[Rejection]
    need: int | Literal["auto"]
    named: list[str] | None

    def describe(self, request: PickRequest) -> str:
        """The request in words, for messages: "2 GPUs with >= 20.0 GiB free"."""
        return _describe_request(request.count, request.min_free_memory_bytes, request.max_utilization,
                                 self.named, request.memory_bytes)


def choose(topology: Topology, request: PickRequest, *, user: str | None, rng: random.Random,
           environ: Any = None) -> Choice:
    """Decide on `topology` what `request` may take; LeaseError when no reading could satisfy it
    (no GPUs at all, an unknown GPU named, more GPUs asked for than exist)."""
    if not topology.gpus:
        why = f" ({topology.nvml_error})" if topology.nvml_error else ""
        where = "on this machine" if topology.source == "live" else f"in the snapshot {topology.source}"
        raise LeaseError(f"No GPUs to pick from {where}{why}. Fix: check the driver with "
                         "`torchplace doctor`, or run on CPU (`torchplace run --gpus none`).")
    named = _resolve_explicit(topology, request.named) if request.named is not None else None
    need = len(named) if named is not None else request.count
    if need != "auto" and int(need) > len(topology.gpus):
        raise LeaseError(f"{need} GPUs were requested, but {topology.source} has {len(topology.gpus)}: "
                         f"{_inventory(topology)}. Fix: ask for at most {len(topology.gpus)}.")
    ordered, rejected = rank_gpus(topology, min_free_memory=request.min_free_memory_bytes,
                                  max_utilization=request.max_utilization, only=named, user=user, rng=rng,
                                  environ=environ)
    if request.memory_bytes is not None:  # a reservation larger than a GPU can never fit there
        small = [g for g in ordered if g.memory_total_bytes is not None and g.memory_total_bytes < request.memory_bytes]
        ordered = [g for g in ordered if g not in small]
        rejected += [Rejection(g.physical_index, g.uuid, f"{format_bytes(g.memory_total_bytes or 0, 'GiB')} in all "
                               f"< {format_bytes(request.memory_bytes, 'GiB')} to reserve") for g in small]
        if need != "auto" and len(ordered) < int(need) and small:
            raise LeaseError(f"Cannot reserve {format_bytes(request.memory_bytes, 'GiB')} on {need} GPU(s) in "
                             f"{topology.source}: {'; '.join(r.describe() for r in rejected)}. Fix: ask for less "
                             "memory (--memory), or for fewer GPUs.")
    return Choice(ordered, rejected, need, named)
