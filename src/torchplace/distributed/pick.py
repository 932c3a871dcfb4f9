"""`torchplace.pick`: choose free GPUs from NVML facts (CUDA never starts) and lease them.

Jobs that each pick "the least used GPU" pile onto the same one, because they all read the
same numbers at the same moment. Here the choice is made in two steps:

1. `policy.ranking.choose` (pure, runs on a snapshot) ranks the GPUs that satisfy the request,
   best first with a random tie-break, and says why the others do not.
2. `pick` takes a flock lease on each chosen GPU (see `leases.py`); a GPU leased by anyone else
   is skipped, so concurrent pickers never share one. With `wait`, it retries until the
   deadline and says what it is waiting for.

The result names GPUs by UUID, which stays right whatever CUDA_DEVICE_ORDER says.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import LeaseError
from ..hardware.topology import GpuRecord, Topology, load_topology
from ..policy.fairness import Ask, Room, admit, room, serve_order, unleased_bytes
from ..policy.ranking import PickRequest, Rejection, choose, my_user, other_users_processes
from .leases import MEMORY_ENV, Holder, Lease, LeaseDir, LeaseStatus, covered, lease_pids


@dataclass(frozen=True)
class PickedGpu:
    """One chosen GPU, with the readings it was chosen on."""

    physical_index: int
    uuid: str
    name: str | None
    pci_bus_id: str | None
    memory_free: int | None
    memory_total: int | None
    utilization: int | None
    processes: int | None
    other_users_processes: int | None
    inherited: bool = False  # already leased to this job by a parent (torchplace run)


@dataclass
class Picked:
    """GPUs chosen (and leased, unless lease=False) for this process.

    Use `cuda_visible_devices` / `env()` for a child process, or `apply()` to set this
    process's environment before anything starts CUDA. Leases last until `release()`, the
    end of a ``with`` block, or the end of the process.
    """

    gpus: list[PickedGpu]
    rejected: list[Rejection] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    leased: bool = True
    source: str = "live"
    lease_dir: str | None = None
    memory_bytes: int | None = None  # reserved on each GPU (shared); None: whole GPUs

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.gpus]

    @property
    def physical_indices(self) -> list[int]:
        return [g.physical_index for g in self.gpus]

    @property
    def cuda_visible_devices(self) -> str:
        """The CUDA_VISIBLE_DEVICES value: UUIDs in PCI bus order (cuda:0 is the first)."""
        return ",".join(self.uuids)

    def env(self) -> dict[str, str]:
        """Variables a child process needs to see exactly these GPUs, in this order."""
        env = {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if self.memory_bytes is not None:  # setup() limits each process to it
            env[MEMORY_ENV] = str(self.memory_bytes)
        return env

    def apply(self, environ: Any = None) -> None:
        """Set CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER in this process (default os.environ).

        Raises LeaseError if this process has already started CUDA, since CUDA reads the
        variables only once, when it starts.
        """
        torch = sys.modules.get("torch")
        # cuda-only: CUDA_VISIBLE_DEVICES is read once, when CUDA starts
        if environ is None and torch is not None and torch.cuda.is_initialized():  # cuda-only: see the line above
            raise LeaseError(
                f"CUDA already started in this process (pid {os.getpid()}), so setting "
                f"CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r} now has no effect. Fix: call "
                "torchplace.pick(...).apply() before the first CUDA call, or start the program with "
                "`torchplace run --gpus N -- CMD`.")
        target = os.environ if environ is None else environ
        target.update(self.env())

    def release(self) -> None:
        """Give the leased GPUs back (idempotent)."""
        for lease in self.leases:
            lease.release()

    def __enter__(self) -> Picked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def to_dict(self) -> dict[str, Any]:
        return {"cuda_visible_devices": self.cuda_visible_devices, "cuda_device_order": "PCI_BUS_ID",
                "gpus": [asdict(g) for g in self.gpus], "rejected": [asdict(r) for r in self.rejected],
                "leased": self.leased,
                "holder_pid": os.getpid() if any(lease.active for lease in self.leases) else None,
                "lease_dir": self.lease_dir, "source": self.source, "memory_bytes": self.memory_bytes}


# --------------------------------------------------------------------------- leasing


def _ancestors() -> set[int]:
    """This process and its ancestors (pids), read from /proc; used to accept a lease that a
    parent (torchplace run, torchrun) holds for this job."""
    pids, pid = set(), os.getpid()
    for _ in range(32):
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return pids


def _picked(gpu: GpuRecord, user: str | None, inherited: bool = False) -> PickedGpu:
    return PickedGpu(gpu.physical_index, gpu.uuid, gpu.name, gpu.pci_bus_id, gpu.memory_free_bytes,
                     gpu.memory_total_bytes, gpu.utilization, None if gpu.processes is None else len(gpu.processes),
                     other_users_processes(gpu, user), inherited)


def pick(count: int | str = 1, *, gpus: Sequence[int | str] | None = None,
         min_free_memory: int | str | None = None, max_utilization: int | None = None,
         wait: float | str | None = None, lease: bool = True, topology: Topology | None = None,
         snapshot: str | os.PathLike[str] | None = None, lease_dir: str | os.PathLike[str] | None = None,
         command: str | None = None, seed: int | None = None, memory: int | str | None = None,
         on_wait: Callable[[str], None] | None = None) -> Picked:
    """Choose GPUs from NVML facts and lease them to this process; CUDA never starts.

    GPUs are ranked by free memory, utilization and other users' processes; GPUs leased by other
    torchplace processes (on this machine, through the lease directory) are skipped. The leases end
    with the process, or with `Picked.release()`.

    Args:
        count: how many GPUs (>= 1), or "auto" for every GPU that satisfies the request now.
        gpus: exactly these GPUs (physical indices or UUIDs) instead of choosing; `count` is
            then ignored.
        min_free_memory: bytes or a size such as "20GiB"; GPUs with less free are skipped.
        max_utilization: percent; busier GPUs are skipped.
        wait: seconds or a duration such as "10m" to wait for GPUs in the queue of the lease
            directory (FIFO within a user, round robin across users); None or 0 fails at once.
            While waiting, `on_wait` (default: a line on stderr) is told the position and why.
        lease: hold a lease on each GPU (default). False only consults other processes' leases.
        topology: decide on these facts instead of reading NVML.
        snapshot: decide on a snapshot file (`torchplace doctor --json`), or a shipped one by name
            ("h200x2"), instead of reading NVML.
        lease_dir: the shared lease directory (default $TORCHPLACE_LEASE_DIR or /tmp/torchplace-leases).
        command: what to record as the holder's command (default: this process's argv).
        seed: fixes the random tie-break (tests).
        memory: bytes or a size such as "20GiB" to reserve on each GPU instead of taking it whole:
            several jobs share a GPU while their reservations fit in its memory less what
            processes without a lease use. `setup()` then limits the process to it.
        on_wait: called with a line saying why it still waits.

    Returns:
        A `Picked`: `gpus` (physical index, UUID, name, free memory ...), `rejected` with the
        reason for each GPU passed over, `uuids` and `physical_indices`, `leases`,
        `cuda_visible_devices` (the value for child processes), `apply()` to set it in this
        process's environment before CUDA starts, and `release()`; also a context manager.

    Raises:
        LeaseError: the request cannot be met within `wait`; the message lists every GPU and why.
        SnapshotError: the snapshot cannot be read.

    Example:
        ```python
        import torchplace as tp

        picked = tp.pick(1, snapshot="h200x2", lease=False)
        print(picked.physical_indices, picked.uuids)
        # on a shared server: tp.pick(2, min_free_memory="20GiB", wait="10m")
        ```
    """
    request = PickRequest.build(count, gpus=gpus, min_free_memory=min_free_memory,
                                max_utilization=max_utilization, wait=wait, lease=lease, snapshot=snapshot,
                                lease_dir=lease_dir, command=command, seed=seed, memory=memory)
    return pick_request(request, topology=topology, on_wait=on_wait)


def pick_request(request: PickRequest, *, topology: Topology | None = None,
                 on_wait: Callable[[str], None] | None = None) -> Picked:
    """`pick` for a built request: decide on the facts (`topology`, else the request's snapshot,
    else NVML), lease, and retry until the request's deadline. A leasing pick that waits joins the
    queue (`distributed.queue`) and tries only when its turn has come; one that does not wait goes
    after everyone queued."""
    from . import queue

    wait_s = request.wait_s
    deadline = time.monotonic() + wait_s
    rng = random.Random(request.seed)
    user = my_user()
    leases_at = LeaseDir(request.lease_dir)
    terminal = on_wait is None and sys.stderr is not None and sys.stderr.isatty()
    notify = on_wait or (_progress_line if terminal else
                         (lambda text: print(f"torchplace: {text}", file=sys.stderr, flush=True)))
    every = 5 if terminal else 30  # seconds between repeats of an unchanged line
    ticket: queue.Ticket | None = None
    last_said, said_at, delay = None, 0.0, 0.05
    restore = _sigterm_unwinds() if request.lease and wait_s > 0 else None
    try:
        while True:
            topo = topology if topology is not None else load_topology(request.snapshot, links=False, details=False)
            choice = choose(topo, request, user=user, rng=rng)
            count = int(choice.need) if choice.need != "auto" else 1
            rooms = _rooms(topo, leases_at)
            if request.lease and wait_s > 0 and ticket is None and not _handed_down(choice.ordered, rooms):
                ticket = queue.join(leases_at, count=count, memory_bytes=request.memory_bytes, wait_s=wait_s,
                                    command=request.command or " ".join(sys.argv))
            # a job that our launcher (torchplace run) leased for us does not queue for its own GPUs
            queued = request.lease and not _handed_down(choice.ordered, rooms)
            turn = _turn(leases_at, rooms, choice, count, request, ticket) if queued else None
            result: Picked | list[Rejection] = []
            if turn is None or turn[0] or turn[1] == 0:  # our turn, or first in line (it says why it waits)
                result = _try_lease(choice.ordered, choice.need, leases_at, request, user, rooms)
            if isinstance(result, Picked):
                if ticket is not None:
                    ticket.leave(served=True)
                result.rejected = choice.rejected + result.rejected
                result.source, result.lease_dir = topo.source, str(leases_at.path)
                result.gpus.sort(key=lambda g: (g.pci_bus_id or "", g.physical_index))
                return result
            rejected = sorted(choice.rejected + result, key=lambda r: r.physical_index)
            asked = choice.describe(request)
            reasons = "; ".join(r.describe() for r in rejected) or (
                "no GPU satisfies it" if turn is None or turn[1] == 0 else "")
            place = "" if turn is None or (ticket is None and turn[1] == 0) else (
                f"position {turn[1] + 1} of {turn[2]} in the queue" + (f", behind {turn[3]}" if turn[3] else ""))
            why = "; ".join(x for x in (place, reasons) if x)
            left = deadline - time.monotonic()
            if left <= 0:
                waited = f" after waiting {wait_s:.0f} s" if wait_s else ""
                raise LeaseError(
                    f"Cannot pick {asked}{waited} in {topo.source}: {why}. Fix: wait for one "
                    "(--wait 10m / wait='10m'), relax --min-free-memory / --max-utilization, or ask "
                    "with fewer GPUs; `torchplace leases` lists who holds what, `torchplace queue` who waits.")
            if why != last_said or time.monotonic() - said_at > every:  # again when it changes, or now and then
                notify(f"waiting up to {left:.0f} s for {asked}: {why}")
                last_said, said_at = why, time.monotonic()
            head = turn is None or turn[0] or turn[1] == 0
            time.sleep(min(left, delay * (0.5 + rng.random())))
            delay = min(delay * 2, 0.25 if head else 1.0)
    finally:
        if ticket is not None:
            ticket.leave()
        if terminal and last_said is not None:
            print(file=sys.stderr, flush=True)  # end the progress line
        if restore is not None:
            restore()


def _sigterm_unwinds() -> Callable[[], None] | None:
    """While a pick waits, SIGTERM (kill, scancel, a container stopping) and SIGHUP (its terminal closed) exit
    as SystemExit(128 + signal), so its queue entry is removed as on Ctrl-C; Python's default ends the process
    at once and leaves the entry behind. Only in the main thread, and only for signals the program left at
    their default; returns what puts the defaults back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    ours = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
            if s is not None and signal.getsignal(s) == signal.SIG_DFL]

    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def restore() -> None:
        for sig in ours:
            signal.signal(sig, signal.SIG_DFL)

    for sig in ours:
        signal.signal(sig, unwind)
    return restore


def _progress_line(text: str) -> None:
    """The waiting line on a terminal: one line, rewritten in place, cut to the terminal's width."""
    import shutil

    width = shutil.get_terminal_size().columns
    print(f"\r\x1b[2Ktorchplace: {text}"[:width + 5], end="", file=sys.stderr, flush=True)


def _family_holds(status: LeaseStatus, uuid: str, family: set[int]) -> Holder | None:
    """The lease of an ancestor of this process (torchplace run, torchrun) on a GPU it made visible to
    us, whole or a reservation: ours to use without leasing again; else None."""
    handed = {e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")}
    if status.mine or uuid not in handed:
        return None
    return next((h for h in ((status.holder,) if status.holder else ()) + status.reservations
                 if h.pid in family), None)


def _handed_down(ordered: list[GpuRecord], rooms: dict[str, tuple[LeaseStatus, Room, int]]) -> bool:
    family = _ancestors()
    return any(_family_holds(rooms[g.uuid][0], g.uuid, family) is not None for g in ordered)


def _rooms(topo: Topology, leases_at: LeaseDir) -> dict[str, tuple[LeaseStatus, Room, int]]:
    """Per GPU: its lease status, its room (policy.fairness.room) and the bytes NVML shows used by
    processes that no lease covers."""
    statuses = {g.uuid: leases_at.status(g.uuid) for g in topo.gpus}
    out = {}
    for gpu in topo.gpus:
        s = statuses[gpu.uuid]
        mine = {p.pid for p in gpu.processes or [] if covered(p.pid, lease_pids(s))}
        unleased = unleased_bytes(gpu, mine)
        out[gpu.uuid] = (s, room(gpu, whole_leased=s.held and not s.reservations,
                                 reserved_bytes=s.reserved_bytes, unleased=unleased), unleased)
    return out


def _turn(leases_at: LeaseDir, rooms: dict[str, tuple[LeaseStatus, Room, int]], choice: Any, count: int,
          request: PickRequest, ticket: Any) -> tuple[bool, int, int, str]:
    """(whether the queue lets this request take GPUs now, its position from 0, the queue's length,
    who is ahead in words)."""
    from . import queue

    waiting = queue.waiters(leases_at)
    asks = [w.ask() for w in waiting]
    if ticket is not None:
        me = ticket.waiter.ask()
        if me.key not in {a.key for a in asks}:
            asks.append(me)
        order = serve_order(asks, queue.last_served(leases_at))
    else:  # not waiting: after everyone queued
        me = Ask("(this request)", str(os.getuid()), time.time_ns(), count, request.memory_bytes)
        order = [*serve_order(asks, queue.last_served(leases_at)), me]
    preferred = [g.uuid for g in choice.ordered]
    ranked = preferred + [u for u in rooms if u not in preferred]
    granted = admit(order, [rooms[u][1] for u in ranked])
    position = next(i for i, a in enumerate(order) if a.key == me.key)
    by_key = {w.name: w for w in waiting}
    ahead = [by_key[a.key] for a in order[:position] if a.key in by_key]
    shown = ", ".join(f"{w.user} (pid {w.pid}, {w.ask().describe()})" for w in ahead[:3])
    return (me.key in granted, position, len(order),
            shown + (f" and {len(ahead) - 3} more" if len(ahead) > 3 else ""))


def _try_lease(ordered: list[GpuRecord], need: int | str, leases_at: LeaseDir, request: PickRequest,
               user: str | None, rooms: dict[str, tuple[LeaseStatus, Room, int]]) -> Picked | list[Rejection]:
    """Lease `need` GPUs from `ordered` (best first); the Picked, or why the rest were busy."""
    lease, command = request.lease, request.command
    if request.memory_bytes is not None:
        return _try_reserve(ordered, need, leases_at, request, user, rooms)
    busy: list[Rejection] = []
    free: list[tuple[GpuRecord, Holder | None]] = []  # holder set: inherited from an ancestor
    family = _ancestors()
    handed = {e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")}
    for gpu in ordered:
        status = leases_at.status(gpu.uuid)
        if status.reservations:
            busy.append(Rejection(gpu.physical_index, gpu.uuid, _shared(status)))
            continue
        if not status.held:
            free.append((gpu, None))
        elif (not status.mine and gpu.uuid in handed and status.holder is not None
              and status.holder.pid in family):
            # leased by our launcher (torchplace run) and made visible to us: ours to use
            free.append((gpu, status.holder))
        else:
            who = "this process" if status.mine else (status.holder.describe() if status.holder
                                                       else "another process")
            busy.append(Rejection(gpu.physical_index, gpu.uuid, f"leased by {who}"))
    want = len(free) if need == "auto" else int(need)
    if want == 0 or len(free) < want:
        return busy
    got: list[Lease] = []
    chosen: list[PickedGpu] = []
    for gpu, inherited in free:
        if len(chosen) == want:
            break
        if inherited is not None or not lease:
            chosen.append(_picked(gpu, user, inherited=inherited is not None))
            continue
        try:
            taken = leases_at.try_acquire(gpu.uuid, command=command)
        except BaseException:  # its note cannot be written (a full disk): give back the GPUs taken so far
            for item in got:
                item.release()
            raise
        if taken is None:  # lost a race since the status read
            holder = leases_at.status(gpu.uuid).holder
            busy.append(Rejection(gpu.physical_index, gpu.uuid,
                                  f"leased by {holder.describe() if holder else 'another process'}"))
            continue
        got.append(taken)
        chosen.append(_picked(gpu, user))
    if not chosen or (need != "auto" and len(chosen) < want):
        for item in got:
            item.release()
        return busy
    for item in got:
        item.check()
    return Picked(gpus=chosen, leases=got, leased=lease)


def _shared(status: LeaseStatus) -> str:
    who = ", ".join(h.describe() for h in status.reservations[:3])
    return (f"shared by {len(status.reservations)} memory reservation(s) of "
            f"{status.reserved_bytes / 2**30:.1f} GiB ({who})")


def _try_reserve(ordered: list[GpuRecord], need: int | str, leases_at: LeaseDir, request: PickRequest,
                 user: str | None, rooms: dict[str, tuple[LeaseStatus, Room, int]]) -> Picked | list[Rejection]:
    """Reserve `request.memory_bytes` on `need` GPUs of `ordered`; the Picked, or why the others had no room."""
    nbytes = int(request.memory_bytes or 0)
    busy: list[Rejection] = []
    fitting: list[tuple[GpuRecord, int]] = []
    inherited: list[tuple[GpuRecord, int]] = []  # with the bytes our launcher reserved there
    family = _ancestors()
    for gpu in ordered:
        status, space, unleased = rooms[gpu.uuid]
        capacity = (gpu.memory_total_bytes or 0) - unleased
        parent = _family_holds(status, gpu.uuid, family)
        if parent is not None:  # reserved (or leased) for this job by our launcher: not reserved twice
            inherited.append((gpu, parent.memory_bytes or capacity))
        elif status.held and not status.reservations:
            who = status.holder.describe() if status.holder else "another process"
            busy.append(Rejection(gpu.physical_index, gpu.uuid, f"leased whole by {who}"))
        elif space.reservable_bytes < nbytes:
            busy.append(Rejection(gpu.physical_index, gpu.uuid, (
                f"{status.reserved_bytes / 2**30:.1f} GiB reserved and {unleased / 2**30:.1f} GiB used without a "
                f"lease of {(gpu.memory_total_bytes or 0) / 2**30:.1f} GiB: "
                f"{space.reservable_bytes / 2**30:.1f} GiB left < {nbytes / 2**30:.1f} GiB")))
        else:
            fitting.append((gpu, capacity))
    want = len(fitting) if need == "auto" else int(need)
    if inherited and (need == "auto" or len(inherited) >= want):
        taken = inherited[:None if need == "auto" else want]
        return Picked(gpus=[_picked(g, user, inherited=True) for g, _ in taken], leased=request.lease,
                      memory_bytes=min(n for _, n in taken))
    if want == 0 or len(fitting) < want:
        return busy
    if not request.lease:
        return Picked(gpus=[_picked(g, user) for g, _ in fitting[:want]], leased=False, memory_bytes=nbytes)
    got: list[Lease] = []
    chosen: list[PickedGpu] = []
    for gpu, capacity in fitting:
        if len(chosen) == want:
            break
        try:
            reserved = leases_at.try_reserve(gpu.uuid, nbytes, capacity, command=request.command)
        except BaseException:
            for item in got:
                item.release()
            raise
        if reserved is None:  # lost a race since the reading
            busy.append(Rejection(gpu.physical_index, gpu.uuid, "its room was reserved by another job meanwhile"))
            continue
        got.append(reserved)
        chosen.append(_picked(gpu, user))
    if len(chosen) < want:
        for item in got:
            item.release()
        return busy
    for item in got:
        item.check()
    return Picked(gpus=chosen, leases=got, leased=True, memory_bytes=nbytes)
