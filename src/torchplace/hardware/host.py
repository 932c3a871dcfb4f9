"""Host facts: the CPUs this process may use, shared memory, locked-memory limits.

Each reader takes its source (a path, a value) as an argument with the real one as default, so
tests pass recorded values instead of mocking the OS. Nothing here raises on a missing file:
a container without /proc or /sys access gives None, which callers report as unknown.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .container import container_kind
from .snapshot import HOST_KEYS, upgrade, with_old_keys

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def affinity_cpus() -> list[int] | None:
    """CPUs the scheduler lets this process run on (None where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def parse_cpu_max(text: str | None) -> float | None:
    """cgroup v2 'cpu.max' ("max 100000" or "200000 100000") -> CPUs allowed, None if unlimited."""
    if not text:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if period > 0 and quota > 0 else None


def parse_cfs(quota: str | None, period: str | None) -> float | None:
    """cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us -> CPUs allowed, None if unlimited (-1)."""
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup (v2, then v1), in CPUs; None when unlimited/unknown."""
    own = _read(proc_cgroup) or ""
    v2_paths = [line.split("::", 1)[1] for line in own.splitlines() if line.startswith("0::")]
    for rel in v2_paths + ["/"]:
        limit = parse_cpu_max(_read(root / rel.lstrip("/") / "cpu.max"))
        if limit is not None:
            return limit
    for base in (root / "cpu", root / "cpu,cpuacct"):
        limit = parse_cfs(_read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us"))
        if limit is not None:
            return limit
    return None


def usable_cpus(cpu_count: int | None, affinity: list[int] | None, quota: float | None) -> int:
    """How many CPUs this process can keep busy: the smallest of count, affinity and quota."""
    candidates = [c for c in (cpu_count, len(affinity) if affinity else None) if c]
    if quota is not None:
        candidates.append(max(1, math.ceil(quota)))
    return min(candidates) if candidates else 1


def shm_bytes(path: str = "/dev/shm") -> tuple[int | None, int | None]:
    """(total, free) bytes of the shared-memory file system DataLoader workers pass tensors through."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def memlock_limit() -> tuple[int | None, int | None]:
    """(soft, hard) RLIMIT_MEMLOCK in bytes, None meaning unlimited; it caps pinned memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    conv = lambda v: None if v == resource.RLIM_INFINITY else int(v)  # noqa: E731
    return conv(soft), conv(hard)


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid exists (psutil, imported on first use: it costs ~25 ms)."""
    import psutil

    return psutil.pid_exists(pid)


def memory_total() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # pragma: no cover - psutil is a dependency
        return None


@dataclass
class HostFacts:
    """What the host offers this process. None means unknown."""

    cpu_count: int | None = None
    affinity: list[int] | None = None
    cgroup_cpu_limit: float | None = None
    usable_cpus: int = 1
    memory_total_bytes: int | None = None
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None
    memlock_soft_bytes: int | None = None  # None: unlimited
    memlock_hard_bytes: int | None = None
    container: str | None = None  # "docker", "podman", "kubernetes", ... (hardware/container.py)
    extra: dict[str, Any] = field(default_factory=dict)

    # the names before the unit-bearing ones, for code written against them
    memory_total = property(lambda self: self.memory_total_bytes)
    shm_total = property(lambda self: self.shm_total_bytes)
    shm_free = property(lambda self: self.shm_free_bytes)
    memlock_soft = property(lambda self: self.memlock_soft_bytes)
    memlock_hard = property(lambda self: self.memlock_hard_bytes)

    def to_dict(self) -> dict[str, Any]:
        return with_old_keys(asdict(self), HOST_KEYS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostFacts:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in upgrade(data, HOST_KEYS).items() if k in known})


def read_host() -> HostFacts:
    """Read this host's facts; never raises."""
    cpus, aff, quota = os.cpu_count(), affinity_cpus(), cgroup_cpu_limit()
    shm_total, shm_free = shm_bytes()
    soft, hard = memlock_limit()
    return HostFacts(cpu_count=cpus, affinity=aff, cgroup_cpu_limit=quota,
                     usable_cpus=usable_cpus(cpus, aff, quota), memory_total_bytes=memory_total(),
                     shm_total_bytes=shm_total, shm_free_bytes=shm_free, memlock_soft_bytes=soft,
                     memlock_hard_bytes=hard, container=container_kind())


# --------------------------------------------------------------------------- NUMA and cores
# (added for the thread policy, issue 7)

NODE_ROOT = Path("/sys/devices/system/node")
CPU_ROOT = Path("/sys/devices/system/cpu")


def parse_cpulist(text: str | None) -> list[int]:
    """Kernel cpulist syntax ("0-3,8,10-11") -> sorted CPU ids; empty or malformed -> []."""
    cpus: set[int] = set()
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                cpus.update(range(int(lo), int(hi) + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            return []
    return sorted(cpus)


def numa_nodes(root: Path = NODE_ROOT) -> dict[int, list[int]] | None:
    """NUMA node -> its CPUs, from /sys/devices/system/node; None when the kernel does not say."""
    try:
        entries = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    except OSError:
        return None
    nodes = {int(p.name[4:]): parse_cpulist(_read(p / "cpulist")) for p in entries}
    return nodes or None


def cpu_cores(root: Path = CPU_ROOT) -> dict[int, tuple[int, int]] | None:
    """CPU id -> (package, core) from sysfs, so SMT siblings share a key; None when unknown."""
    out: dict[int, tuple[int, int]] = {}
    try:
        cpus = list(root.glob("cpu[0-9]*"))
    except OSError:
        return None
    for cpu in cpus:
        core, package = _read(cpu / "topology" / "core_id"), _read(cpu / "topology" / "physical_package_id")
        if core is None:
            continue
        try:
            out[int(cpu.name[3:])] = (int(package or 0), int(core))
        except ValueError:
            continue
    return out or None


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The memory limit of this process's cgroup in bytes (v2 memory.max, then v1); None if unlimited."""
    own = _read(proc_cgroup) or ""
    v2_paths = [line.split("::", 1)[1] for line in own.splitlines() if line.startswith("0::")]
    candidates = [root / rel.lstrip("/") / "memory.max" for rel in v2_paths + ["/"]]
    candidates.append(root / "memory" / "memory.limit_in_bytes")
    for path in candidates:
        text = _read(path)
        if text and text.isdigit() and int(text) < 2**60:  # v1 writes a huge number for "no limit"
            return int(text)
    return None


def address_space_limit() -> int | None:
    """RLIMIT_AS (soft) in bytes, None meaning unlimited: allocations beyond it fail at once."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)
