"""Who is served next from the GPU queue, and what fits: the pure half of `torchplace run --wait`.

`serve_order` puts the waiting requests in the order they are served: first come first served
within a user, round robin across users (the user served longest ago goes first, so one user's
hundred queued jobs do not starve another's one). `admit` walks that order over what the GPUs have
room for now (whole GPUs free, bytes left for memory reservations) and says who may take what; the
first request that does not fit holds back everyone behind it, so a large request is never passed
over for ever by small ones. `room` says what one GPU has room for, from NVML's reading and the
leases on it. Nothing here reads a file, NVML or the clock: everything runs on snapshots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..hardware.topology import GpuRecord


@dataclass(frozen=True)
class Ask:
    """One waiting request: `count` GPUs, each whole (`memory_bytes` None) or with that much reserved."""

    key: str  # unique: the queue entry's name
    user: str
    since_ns: int  # when it joined the queue
    count: int = 1
    memory_bytes: int | None = None

    def describe(self) -> str:
        each = "whole" if self.memory_bytes is None else f"{self.memory_bytes / 2**30:.1f} GiB reserved on each"
        return f"{self.count} GPU{'s' if self.count != 1 else ''} ({each})"


@dataclass(frozen=True)
class Room:
    """What one GPU has room for now: whole (no lease and no reservation on it), and the bytes
    left for memory reservations (0 when it is leased whole)."""

    uuid: str
    whole_free: bool
    reservable_bytes: int
    total_bytes: int | None = None  # the GPU's memory; None: unknown


def serve_order(asks: Iterable[Ask], last_served: Mapping[str, int] | None = None) -> list[Ask]:
    """The asks in the order they are served: FIFO within a user; across users, round robin: the
    user whose last serve is oldest (`last_served`: user -> time in ns, absent: never) goes next,
    ties broken by who waits longest."""
    queues: dict[str, list[Ask]] = {}
    for ask in sorted(asks, key=lambda a: (a.since_ns, a.key)):
        queues.setdefault(ask.user, []).append(ask)
    clock = {u: (last_served or {}).get(u, 0) for u in queues}
    tick = max(clock.values(), default=0)
    order: list[Ask] = []
    while queues:
        user = min(queues, key=lambda u: (clock[u], queues[u][0].since_ns, u))
        order.append(queues[user].pop(0))
        tick += 1
        clock[user] = tick  # as if served now: the other users' turns come first
        if not queues[user]:
            del queues[user]
    return order


def fits(ask: Ask, rooms: Sequence[Room]) -> list[str] | None:
    """The UUIDs `ask` would take from `rooms` (in their order of preference), or None when it does not fit."""
    if ask.memory_bytes is None:
        chosen = [r.uuid for r in rooms if r.whole_free]
    else:
        chosen = [r.uuid for r in rooms if r.reservable_bytes >= ask.memory_bytes]
    return chosen[:ask.count] if len(chosen) >= ask.count else None


def admit(order: Sequence[Ask], rooms: Sequence[Room]) -> dict[str, list[str]]:
    """Who may take which GPUs now (ask key -> UUIDs), walking `order`: each ask that fits takes its
    GPUs out of the room left; the first that does not fit stops the walk (it holds back the rest).
    An ask that could not fit even on idle GPUs (more GPUs than there are, more memory than they
    have: an entry written by hand) holds back no one."""
    left = {r.uuid: r for r in rooms}
    granted: dict[str, list[str]] = {}
    for ask in order:
        if not possible(ask, rooms):
            continue
        took = fits(ask, [left[r.uuid] for r in rooms])
        if took is None:
            break
        granted[ask.key] = took
        for uuid in took:
            r = left[uuid]
            left[uuid] = Room(uuid, False, 0 if ask.memory_bytes is None else r.reservable_bytes - ask.memory_bytes,
                              r.total_bytes)
    return granted


def possible(ask: Ask, rooms: Sequence[Room]) -> bool:
    """Whether `ask` could fit on these GPUs were they idle."""
    if ask.memory_bytes is None:
        return ask.count <= len(rooms)
    return sum(1 for r in rooms if r.total_bytes is None or r.total_bytes >= ask.memory_bytes) >= ask.count


def unleased_bytes(gpu: GpuRecord, leased: Iterable[int]) -> int:
    """Memory NVML shows used on `gpu` by processes that no lease covers (`leased`: the pids that
    a lease covers); processes without a reading count as nothing."""
    covered = set(leased)
    return sum(p.used_memory_bytes or 0 for p in gpu.processes or [] if p.pid not in covered)


def room(gpu: GpuRecord, *, whole_leased: bool, reserved_bytes: int, unleased: int) -> Room:
    """What `gpu` has room for: whole when nobody leased or reserved any of it, and for
    reservations its memory (NVML's total) less what processes without a lease use and what is
    reserved already; nothing when it is leased whole or its memory is unknown."""
    total = gpu.memory_total_bytes
    if whole_leased or total is None:
        return Room(gpu.uuid, False, 0, total)
    return Room(gpu.uuid, reserved_bytes == 0, max(0, total - unleased - reserved_bytes), total)
