"""`torchplace.pick`: choose free GPUs from NVML facts (CUDA never starts) and lease them.

Jobs that each pick "the least used GPU" pile onto the same one, because they all read the
same numbers at the same moment. Here the choice is made in two steps:

1. `rank_gpus` (pure, runs on a snapshot): drop GPUs that fail the request (MIG mode, free
   memory below `min_free_memory`, utilization above `max_utilization`, hidden by an existing
   CUDA_VISIBLE_DEVICES allocation), then order the rest by other users' processes (fewer
   first), free memory (more first, in 4 GiB steps so near-equal GPUs tie), utilization (lower
   first, in 10% steps), and a random tie-break, so that idle GPUs are not handed out
   physical 0 first.
2. `pick` takes a flock lease on each chosen GPU (see `lease.py`); a GPU leased by anyone else
   is skipped, so concurrent pickers never share one. With `wait`, it retries until the
   deadline and says what it is waiting for.

The result names GPUs by UUID, which stays right whatever CUDA_DEVICE_ORDER says.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ..errors import LeaseError
from ..hardware.topology import GpuRecord, Topology, load_topology
from ..units import format_bytes, parse_duration, parse_size
from .lease import Holder, Lease, LeaseDir

FREE_MEMORY_STEP = 4 * 2**30  # free memory within one step counts as equal
UTILIZATION_STEP = 10  # percent


@dataclass(frozen=True)
class Rejection:
    """A GPU that was not picked, and why (a full sentence fragment for messages)."""

    physical_index: int
    uuid: str
    reason: str

    def describe(self) -> str:
        return f"GPU {self.physical_index} ({self.uuid}): {self.reason}"


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
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def apply(self, environ: Any = None) -> None:
        """Set CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER in this process (default os.environ).

        Raises LeaseError if this process has already started CUDA, since CUDA reads the
        variables only once, when it starts.
        """
        torch = sys.modules.get("torch")
        if environ is None and torch is not None and torch.cuda.is_initialized():
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

    def __enter__(self) -> "Picked":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def to_dict(self) -> dict[str, Any]:
        return {"cuda_visible_devices": self.cuda_visible_devices, "cuda_device_order": "PCI_BUS_ID",
                "gpus": [asdict(g) for g in self.gpus], "rejected": [asdict(r) for r in self.rejected],
                "leased": self.leased,
                "holder_pid": os.getpid() if any(lease.active for lease in self.leases) else None,
                "lease_dir": self.lease_dir, "source": self.source}


# --------------------------------------------------------------------------- facts


def _my_user() -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return None


def _other_users_processes(gpu: GpuRecord, me: str | None) -> int | None:
    if gpu.processes is None:
        return None
    return sum(1 for p in gpu.processes if p.user is None or p.user != me)


# --------------------------------------------------------------------------- deciding


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
    user = user if user is not None else _my_user()
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
        others = _other_users_processes(gpu, user) or 0
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
        if text.isdigit():
            gpu = by_index.get(int(text))
            if gpu is None:
                raise LeaseError(f"GPU {text} was requested, but this machine has {_inventory(topology)} "
                                 "(physical indices, as nvidia-smi numbers them). Fix: name one of those.")
        else:
            hits = [g for g in topology.gpus if g.uuid.startswith(text)] if text.startswith("GPU-") else []
            if len(hits) != 1:
                what = "matches no GPU" if not hits else f"matches {len(hits)} GPUs"
                raise LeaseError(f"GPU {text!r} {what}; this machine has {_inventory(topology)}. Fix: "
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
                     _other_users_processes(gpu, user), inherited)


def _describe_request(count: int | str, min_free: int | None, max_util: int | None,
                      only: Sequence[str] | None) -> str:
    what = f"GPUs {', '.join(only)}" if only else ("any free GPUs" if count == "auto" else
                                                    f"{count} GPU{'s' if count != 1 else ''}")
    conditions = []
    if min_free is not None:
        conditions.append(f">= {format_bytes(min_free, 'GiB')} free")
    if max_util is not None:
        conditions.append(f"<= {max_util}% utilization")
    return what + (f" with {' and '.join(conditions)}" if conditions else "")


def pick(count: int | str = 1, *, gpus: Sequence[int | str] | None = None,
         min_free_memory: int | str | None = None, max_utilization: int | None = None,
         wait: float | str | None = None, lease: bool = True, topology: Topology | None = None,
         snapshot: str | os.PathLike[str] | None = None, lease_dir: str | os.PathLike[str] | None = None,
         command: str | None = None, seed: int | None = None,
         on_wait: Callable[[str], None] | None = None) -> Picked:
    """Choose GPUs from NVML facts and lease them to this process; CUDA never starts.

    Args:
        count: how many GPUs (>= 1), or "auto" for every GPU that satisfies the request now.
        gpus: exactly these GPUs (physical indices or UUIDs) instead of choosing; `count` is
            then ignored.
        min_free_memory: bytes or a size such as "20GiB"; GPUs with less free are skipped.
        max_utilization: percent; busier GPUs are skipped.
        wait: seconds or a duration such as "10m" to wait for GPUs to become free; None or 0
            fails at once. While waiting, `on_wait` (default: a line on stderr) is told why.
        lease: hold a lease on each GPU (default). False only consults other processes' leases.
        topology / snapshot: decide on these facts instead of reading NVML.
        lease_dir: the shared lease directory (default $TORCHPLACE_LEASE_DIR or /tmp/torchplace-leases).
        command: what to record as the holder's command (default: this process's argv).
        seed: fixes the random tie-break (tests).

    Raises:
        LeaseError: the request cannot be met within `wait`; the message lists every GPU and why.
    """
    if count != "auto" and (not isinstance(count, int) or count < 1):
        raise LeaseError(f"count={count!r} must be a whole number >= 1 or 'auto'.")
    try:
        min_free = parse_size(min_free_memory) if min_free_memory is not None else None
        wait_s = parse_duration(wait) if wait is not None else 0.0
    except ValueError as exc:
        raise LeaseError(str(exc)) from None
    if max_utilization is not None and not 0 <= max_utilization <= 100:
        raise LeaseError(f"max_utilization={max_utilization} must be a percentage from 0 to 100.")
    deadline = time.monotonic() + wait_s
    rng = random.Random(seed)
    user = _my_user()
    leases_at = LeaseDir(lease_dir)
    notify = on_wait or (lambda text: print(f"torchplace: {text}", file=sys.stderr, flush=True))
    last_reasons, delay = None, 0.05
    while True:
        topo = topology if topology is not None else load_topology(snapshot, links=False, details=False)
        if not topo.gpus:
            why = f" ({topo.nvml_error})" if topo.nvml_error else ""
            raise LeaseError(f"No GPUs to pick from in {topo.source}{why}. Fix: check the driver with "
                             "`torchplace doctor`, or run on CPU (`torchplace run --gpus none`).")
        only = _resolve_explicit(topo, gpus) if gpus is not None else None
        need = len(only) if only is not None else count
        if need != "auto" and int(need) > len(topo.gpus):
            raise LeaseError(f"{need} GPUs were requested, but {topo.source} has {len(topo.gpus)}: "
                             f"{_inventory(topo)}. Fix: ask for at most {len(topo.gpus)}.")
        ordered, rejected = rank_gpus(topo, min_free_memory=min_free, max_utilization=max_utilization,
                                      only=only, user=user, rng=rng)
        result = _try_lease(ordered, need, leases_at, lease, command, user)
        if isinstance(result, Picked):
            result.rejected = rejected + result.rejected
            result.source, result.lease_dir = topo.source, str(leases_at.path)
            result.gpus.sort(key=lambda g: (g.pci_bus_id or "", g.physical_index))
            return result
        rejected = sorted(rejected + result, key=lambda r: r.physical_index)
        request = _describe_request(count, min_free, max_utilization, only)
        reasons = "; ".join(r.describe() for r in rejected) or "no GPU satisfies it"
        left = deadline - time.monotonic()
        if left <= 0:
            waited = f" after waiting {wait_s:.0f} s" if wait_s else ""
            raise LeaseError(
                f"Cannot pick {request}{waited} in {topo.source}: {reasons}. Fix: wait for one "
                "(--wait 10m / wait='10m'), relax --min-free-memory / --max-utilization, or ask "
                f"with fewer GPUs; `torchplace leases` lists who holds what.")
        if reasons != last_reasons:  # say it again only when the reasons change
            notify(f"waiting up to {left:.0f} s for {request}: {reasons}")
            last_reasons = reasons
        time.sleep(min(left, delay * (0.5 + rng.random())))
        delay = min(delay * 2, 1.0)


def _try_lease(ordered: list[GpuRecord], need: int | str, leases_at: LeaseDir, lease: bool,
               command: str | None, user: str | None) -> Picked | list[Rejection]:
    """Lease `need` GPUs from `ordered` (best first); the Picked, or why the rest were busy."""
    busy: list[Rejection] = []
    free: list[tuple[GpuRecord, Holder | None]] = []  # holder set: inherited from an ancestor
    family = _ancestors()
    handed = {e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")}
    for gpu in ordered:
        status = leases_at.status(gpu.uuid)
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
        taken = leases_at.try_acquire(gpu.uuid, command=command)
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
