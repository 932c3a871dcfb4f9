"""CPU thread policy: as many threads as this process may really use, split among local ranks.

torch sizes its intra-op pool from the CPUs it sees in its affinity mask, but not from a cgroup
CPU quota: in a container limited to 16 CPUs on a 64-core host every process starts dozens of
threads that fight over 16 CPUs' worth of time. Several processes on one node (workers,
inference servers, ranks started without torchrun's OMP_NUM_THREADS=1) multiply that.

`plan_threads(host, ...)` is a pure function of host facts (affinity, cgroup quota, cores,
NUMA nodes, the CPUs near a GPU), so every case is a test with recorded values.
`configure_threads(...)` reads the facts, plans, and applies: `torch.set_num_threads`,
`torch.set_num_interop_threads`, OMP_NUM_THREADS/MKL_NUM_THREADS (for libraries initialized
later and for child processes), and optionally binds every thread of the process to the CPUs
nearest a GPU (first-touch allocation then keeps memory on that NUMA node as well).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import DeviceError
from ..hardware.host import HostFacts, cpu_cores, numa_nodes, read_host, usable_cpus

if TYPE_CHECKING:
    from .devices import DeviceSpec

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class ThreadPlan:
    """What to set, and why. `applied` is filled by `configure_threads` with what torch accepted."""

    usable_cpus: int  # the smallest of CPU count, affinity and cgroup quota
    physical_cores: int | None  # distinct cores among the allowed CPUs (SMT siblings count once)
    local_world_size: int
    intra_op: int
    inter_op: int
    env: dict[str, str]
    bind_cpus: list[int] | None = None
    numa: dict[int, list[int]] | None = None  # NUMA node -> the allowed CPUs on it
    gpu_numa_node: int | None = None
    notes: list[str] = field(default_factory=list)
    applied: dict[str, Any] = field(default_factory=dict)

    @property
    def process_numa_nodes(self) -> list[int]:
        """The NUMA nodes this process's CPUs (after binding, if any) lie on."""
        if not self.numa:
            return []
        cpus = set(self.bind_cpus) if self.bind_cpus else None
        return [n for n, on in self.numa.items() if on and (cpus is None or cpus & set(on))]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def env_local_world_size(env: Mapping[str, str] | None = None) -> int:
    """Processes on this node: LOCAL_WORLD_SIZE (torchrun), else SLURM_NTASKS_PER_NODE, else 1."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = (env.get(name) or "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def users_thread_count(env: Mapping[str, str], threads_now: int, threads_at_import: int,
                       launcher: str | None = None, local_world_size: int = 1) -> str | None:
    """Whose the thread count is, when someone set it before `setup()` planned one (None: nobody did).

    An OMP_NUM_THREADS in the environment (the user's, or torchrun's 1 for several processes per node),
    or a `torch.set_num_threads` call since torchplace was imported (THREADS_NOW differs from
    THREADS_AT_IMPORT): the program was tuned with it, and changing it changes its results."""
    raw = (env.get("OMP_NUM_THREADS") or "").strip()
    if raw:
        torchrun_one = launcher == "torchrun" and raw == "1" and local_world_size > 1
        whose = ("yours, or torchrun's default of 1 for several processes per node" if torchrun_one
                 else "set before the program started")
        return f"OMP_NUM_THREADS={raw[:20]} from the environment ({whose})"
    if threads_now != threads_at_import:
        return f"torch.set_num_threads({threads_now}) called before setup() (torch had {threads_at_import})"
    return None


def plan_threads(host: HostFacts, *, local_world_size: int = 1, intra_op: int | None = None,
                 inter_op: int | None = None, cores: Mapping[int, tuple[int, int]] | None = None,
                 numa: Mapping[int, list[int]] | None = None, gpu_cpus: list[int] | None = None,
                 gpu_numa_node: int | None = None, bind: bool = False) -> ThreadPlan:
    """Plan intra/inter-op threads for one process from host facts (pure; see module docstring).

    - budget: the usable CPUs (count, affinity, cgroup quota), at most one per physical core;
    - each of `local_world_size` processes on the node gets an equal share, at least 1;
    - inter-op threads: 1, since eager mode runs ops in order and the inter-op pool only serves
      `torch.jit.fork`, where each inter-op thread would start its own intra-op team;
    - `bind=True` with `gpu_cpus` (NVML's CPU affinity of the GPU) binds to those CPUs.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size} must be at least 1 (one process per node).")
    notes: list[str] = []
    allowed = list(host.affinity) if host.affinity else None
    usable = usable_cpus(host.cpu_count, allowed, host.cgroup_cpu_limit)
    if host.cgroup_cpu_limit is not None and allowed and host.cgroup_cpu_limit < len(allowed):
        notes.append(f"the cgroup CPU quota ({host.cgroup_cpu_limit:g} CPUs) is below the {len(allowed)} CPUs in "
                     f"this process's affinity; torch's default would start a thread per CPU it sees")
    physical = None
    if cores and allowed:
        physical = len({cores[c] for c in allowed if c in cores}) or None
    budget = min(usable, physical) if physical else usable
    if physical and physical < usable:
        notes.append(f"{usable} usable CPUs are {physical} physical cores (SMT); one thread per core")

    node_cpus = _numa_view(numa, allowed)
    bind_cpus = None
    if gpu_numa_node is None and gpu_cpus and node_cpus:
        gpu_numa_node = next((n for n, on in (numa or {}).items() if set(on) & set(gpu_cpus)), None)
    if bind:
        if not gpu_cpus:
            notes.append("bind=True, but the GPU's CPU affinity is unknown (NVML did not report it); not binding")
        else:
            near = sorted(set(gpu_cpus) & set(allowed)) if allowed else sorted(gpu_cpus)
            if not near:
                notes.append(f"bind=True, but none of the GPU's CPUs ({cpu_span(gpu_cpus)}) are in this process's "
                             f"affinity ({cpu_span(allowed or [])}); not binding. Fix: start the process with "
                             "those CPUs allowed (numactl/taskset/container cpuset)")
            else:
                bind_cpus = near
                near_cores = len({cores[c] for c in near if c in cores}) if cores else len(near)
                budget = min(budget, near_cores or len(near))

    share = max(1, budget // local_world_size)
    if budget < local_world_size:
        notes.append(f"{local_world_size} processes share {budget} CPU(s): even 1 thread each oversubscribes")
    if intra_op is not None and intra_op > share:
        notes.append(f"intra_op={intra_op} was requested; {share} is this process's share of {budget} CPU(s) "
                     f"among {local_world_size} process(es), so it will oversubscribe")
    intra = intra_op if intra_op is not None else share
    inter = inter_op if inter_op is not None else 1
    if intra < 1 or inter < 1:
        raise ValueError(f"intra_op={intra} and inter_op={inter} must be at least 1.")
    return ThreadPlan(usable_cpus=usable, physical_cores=physical, local_world_size=local_world_size,
                      intra_op=intra, inter_op=inter, env={name: str(intra) for name in THREAD_ENV},
                      bind_cpus=bind_cpus, numa=node_cpus, gpu_numa_node=gpu_numa_node, notes=notes)


def oversubscription(threads_per_process: int, processes: int, usable: int) -> str | None:
    """A sentence when PROCESSES x THREADS_PER_PROCESS exceeds USABLE CPUs, else None."""
    total = threads_per_process * processes
    if total <= usable:
        return None
    return (f"{processes} process(es) x {threads_per_process} thread(s) = {total} threads on {usable} usable "
            f"CPU(s): threads wait for each other at every parallel region")


def _numa_view(numa: Mapping[int, list[int]] | None, allowed: list[int] | None) -> dict[int, list[int]] | None:
    if not numa:
        return None
    allow = set(allowed) if allowed else None
    return {n: sorted(c for c in cpus if allow is None or c in allow) for n, cpus in sorted(numa.items())}


def cpu_span(cpus: list[int]) -> str:
    """[0,1,2,3,8] -> '0-3,8' (the kernel's cpulist form), for messages."""
    out: list[str] = []
    for cpu in sorted(set(cpus)):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == cpu - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        elif out and "-" not in out[-1] and int(out[-1]) == cpu - 1:
            out[-1] = f"{out[-1]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out) or "none"


# --------------------------------------------------------------------------- applying


def configure_threads(intra_op: int | None = None, inter_op: int | None = None, *,
                      local_world_size: int | None = None, gpu: DeviceSpec = None, bind: bool = False,
                      set_env: bool = True) -> ThreadPlan:
    """Plan CPU threads from this host's facts and apply the plan; return it.

    Usable CPUs are the smallest of the CPU count, this process's affinity and the cgroup quota
    (a container's `--cpus`), shared among the processes of this node. Call it early: before the
    first parallel op, so torch can still size its inter-op pool, and before large allocations,
    so they land on the bound NUMA node.

    Args:
        intra_op: threads per op (default: usable CPUs / local processes).
        inter_op: threads running independent ops (default: from the plan).
        local_world_size: processes on this node (default LOCAL_WORLD_SIZE from torchrun, or
            SLURM_NTASKS_PER_NODE, else 1).
        gpu: the GPU this process drives ("cuda:0" or an index); its NUMA node is read from NVML
            without starting CUDA.
        bind: pin every thread of this process to the CPUs nearest `gpu`.
        set_env: also set OMP_NUM_THREADS and MKL_NUM_THREADS for child processes.

    Returns:
        A `ThreadPlan` (usable CPUs, physical cores, intra-op and inter-op threads, the environment
        set, the CPUs bound, `notes`), with `applied` saying what was done.

    Raises:
        ValueError: a thread count or `local_world_size` below 1.
        DeviceError: `gpu` names a GPU that is not visible, or is not a CUDA device.

    Example:
        ```python
        import torchplace as tp

        plan = tp.configure_threads()  # e.g. 4 intra-op threads of 8 usable CPUs over 2 processes
        print(plan.intra_op, plan.inter_op, plan.usable_cpus)
        ```
    """
    host = read_host()
    gpu_cpus, gpu_node = _gpu_cpus(gpu) if gpu is not None else (None, None)
    plan = plan_threads(host, local_world_size=local_world_size or env_local_world_size(),
                        intra_op=intra_op, inter_op=inter_op, cores=cpu_cores(), numa=numa_nodes(),
                        gpu_cpus=gpu_cpus, gpu_numa_node=gpu_node, bind=bind)
    apply_plan(plan, set_env=set_env)
    return plan


def apply_plan(plan: ThreadPlan, *, set_env: bool = True) -> ThreadPlan:
    """Apply a plan to torch, the environment and (if it binds) every thread's affinity."""
    import torch

    torch.set_num_threads(plan.intra_op)
    if torch.get_num_interop_threads() != plan.inter_op:
        try:
            torch.set_num_interop_threads(plan.inter_op)
        except RuntimeError as exc:  # torch allows it once, before any inter-op work
            plan.notes.append(f"inter-op threads left at {torch.get_num_interop_threads()}: torch refused "
                              f"to change them ({str(exc).strip()}); call configure_threads at program start")
    if set_env:
        os.environ.update(plan.env)
    bound = _bind_all_threads(plan.bind_cpus) if plan.bind_cpus else None
    plan.applied = {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
                    "env": dict(plan.env) if set_env else {}, "bound_threads": bound}
    return plan


def _bind_all_threads(cpus: list[int]) -> int:
    """Set the affinity of every thread of this process (threads made later inherit it)."""
    tids = [0]
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        pass
    done = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except OSError:  # a thread that just ended
            continue
    return done


def _gpu_cpus(gpu: Any) -> tuple[list[int] | None, int | None]:
    """(CPU affinity, NUMA node) of a logical CUDA device from NVML, without starting CUDA."""
    from ..hardware.topology import read_topology
    from ..hardware.visible import map_visible

    index = _logical_index(gpu)
    topology = read_topology(links=False)
    visible = map_visible(topology=topology)
    entry = visible.physical(index)
    if entry is None:
        raise DeviceError(f"configure_threads(gpu={gpu!r}) names cuda:{index}, but {visible.summary()}. "
                          "Fix: pass one of the visible devices, or gpu=None.")
    record = next((g for g in topology.gpus if g.physical_index == entry.physical_index), None)
    if record is None:
        return None, None
    return record.cpu_affinity, record.numa_node


def _logical_index(gpu: Any) -> int:
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        return gpu
    text = str(gpu)
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise DeviceError(f"configure_threads(gpu={gpu!r}): a CUDA device is needed ('cuda:N' or N). "
                          "Fix: pass the GPU this process drives, e.g. torchplace.device().")
    if index:
        return int(index)
    from ..hardware.launch import local_rank

    return local_rank() or 0
