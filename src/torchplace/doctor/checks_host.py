"""Doctor checks about the host: shared memory, locked memory, CPU threads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..units import format_bytes
from .registry import Finding, check

if TYPE_CHECKING:
    from ..hardware.facts import Facts

SHM_MIN = 1 << 30  # DataLoader workers pass each batch through /dev/shm
MEMLOCK_MIN = 64 << 20


@check
def check_shm(facts: Facts) -> list[Finding]:
    total = facts.host.shm_total_bytes
    if total is None or total >= SHM_MIN:
        return []
    return [Finding("host.shm_small", "warning", "/dev/shm is too small for DataLoader workers",
                    f"/dev/shm holds {format_bytes(total, 'MiB', digits=0)}; workers put every batch there, "
                    "and a full /dev/shm kills them with 'bus error' or 'unable to write to file </torch_...>'.",
                    "Docker: --shm-size=16g or --ipc=host; Kubernetes: mount an emptyDir with medium: Memory; "
                    "or DataLoader(num_workers=0).")]


@check
def check_memlock(facts: Facts) -> list[Finding]:
    soft = facts.host.memlock_soft_bytes
    if soft is None or soft >= MEMLOCK_MIN or not facts.topology.gpus:
        return []
    return [Finding("host.memlock_low", "warning", "Locked-memory limit is low",
                    f"RLIMIT_MEMLOCK is {format_bytes(soft, 'MiB', digits=0)}. Host memory registered for the GPU "
                    "(cudaHostRegister, NCCL over InfiniBand/GPUDirect RDMA) must be locked; a low limit makes "
                    "registration fail or NCCL fall back to slower paths.",
                    "ulimit -l unlimited (docker: --ulimit memlock=-1; systemd: LimitMEMLOCK=infinity).")]


@check
def check_omp_threads(facts: Facts) -> list[Finding]:
    raw = facts.env.get("OMP_NUM_THREADS")
    if raw is None:
        return []
    usable = facts.host.usable_cpus
    try:
        value = int(raw)
    except ValueError:
        return [Finding("host.omp_invalid", "warning", "OMP_NUM_THREADS is not a number",
                        f"OMP_NUM_THREADS={raw!r} is ignored by OpenMP.", f"export OMP_NUM_THREADS={usable}")]
    if value <= usable:
        return []
    return [Finding("host.omp_oversubscribed", "warning", "OMP_NUM_THREADS exceeds the CPUs this process may use",
                    f"OMP_NUM_THREADS={value} but only {usable} CPU(s) are usable (affinity "
                    f"{len(facts.host.affinity or [])}, cgroup quota {facts.host.cgroup_cpu_limit or 'none'}); "
                    "threads then fight for cores and CPU work slows down.",
                    f"export OMP_NUM_THREADS={usable} (divided by the processes per node under torchrun), "
                    "or call torchplace.configure_threads().")]
