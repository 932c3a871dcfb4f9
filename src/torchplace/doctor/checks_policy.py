"""Doctor checks about run-time policies: emulated bf16, thread oversubscription, NUMA placement.

They read facts only (no torch import, no CUDA) and reuse the pure policy functions, so what
doctor says and what `precision_for` / `configure_threads` decide cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PrecisionError
from ..policy.precision import bf16_native, normalize_dtype
from ..policy.threads import cpu_span, env_local_world_size, oversubscription
from .registry import Finding, check

if TYPE_CHECKING:
    from ..hardware.facts import Facts
    from ..hardware.topology import GpuRecord

# environment variables through which a run asks for a precision
PRECISION_ENV = ("TORCHPLACE_PRECISION", "ACCELERATE_MIXED_PRECISION")


def _requested_precision(env: dict[str, str]) -> tuple[str, str] | None:
    """(variable, normalized dtype) of the first precision request in the environment."""
    for name in PRECISION_ENV:
        raw = env.get(name)
        if raw:
            try:
                dtype = normalize_dtype(raw)
            except PrecisionError:  # 'no', 'fp8', ...: not a bf16/fp16/fp32 request
                continue
            if dtype:
                return name, dtype
    return None


def _cc(gpu: GpuRecord) -> str:
    cc = gpu.compute_capability
    return f"{cc[0]}.{cc[1]}" if cc else "?"


@check
def check_bf16_emulated(facts: Facts) -> list[Finding]:
    """bf16 requested (or merely reported as supported) on visible GPUs that only emulate it."""
    by_index = {g.physical_index: g for g in facts.topology.gpus}
    slow = []
    for dev in facts.visible.visible if facts.visible else []:
        gpu = by_index.get(dev.physical_index)
        if gpu is not None and gpu.compute_capability and not bf16_native(gpu.compute_capability):
            slow.append(f"cuda:{dev.logical} = physical {gpu.physical_index} ({gpu.name or '?'}, "
                        f"compute capability {_cc(gpu)})")
    if not slow:
        return []
    request = _requested_precision(facts.env)
    listed = "; ".join(slow)
    if request and request[1] == "bfloat16":
        name, _ = request
        return [Finding("policy.bf16_emulated", "warning", "bf16 is requested on GPUs that only emulate it",
                        f"{name}={facts.env[name]!r} asks for bf16, but these GPUs have no native bf16 (it needs "
                        f"compute capability 8.0 or later): {listed}. torch emulates bf16 there, often slower than "
                        "fp32, and torch.cuda.is_bf16_supported() still says True because it counts emulation.",
                        f"Use fp16 with a GradScaler ({name}=fp16), or unset {name} and let "
                        "torchplace.precision_for(device) choose from the capability.")]
    return [Finding("policy.bf16_emulated_gpus", "info", "Some GPUs only emulate bf16",
                    f"No native bf16 on: {listed}. torch.cuda.is_bf16_supported() says True there (it counts "
                    "emulation), so code that trusts it runs slow bf16.",
                    "torchplace.precision_for(device) picks fp16 with a GradScaler on these GPUs.")]


@check
def check_thread_oversubscription(facts: Facts) -> list[Finding]:
    """More CPU threads than usable CPUs, across the processes of this node."""
    host = facts.host
    usable = host.usable_cpus
    seen = len(host.affinity) if host.affinity else host.cpu_count
    procs = env_local_world_size(facts.env)
    raw = facts.env.get("OMP_NUM_THREADS")
    if raw is not None:
        try:
            threads = int(raw)
        except ValueError:
            return []  # host.omp_invalid reports it
        if threads > usable:
            return []  # host.omp_oversubscribed reports it
        source = f"OMP_NUM_THREADS={threads}"
    elif seen:
        threads = seen
        source = (f"OMP_NUM_THREADS is unset, so torch starts one thread per CPU it sees ({seen})"
                  + (f", not per CPU the cgroup quota ({host.cgroup_cpu_limit:g}) allows"
                     if host.cgroup_cpu_limit is not None and host.cgroup_cpu_limit < seen else ""))
    else:
        return []
    problem = oversubscription(threads, procs, usable)
    if problem is None:
        return []
    share = max(1, usable // procs)
    who = f"{procs} process(es) on this node (LOCAL_WORLD_SIZE)" if procs > 1 else "this process"
    return [Finding("policy.threads_oversubscribed", "warning", "More CPU threads than usable CPUs",
                    f"{source}; with {who}: {problem}. CPU inference and data loading then run slower than "
                    "with fewer threads.",
                    f"Call torchplace.configure_threads() at start-up, or export OMP_NUM_THREADS={share} "
                    f"({usable} usable CPU(s) / {procs} process(es)).")]


@check
def check_numa_placement(facts: Facts) -> list[Finding]:
    """The CPUs this process may run on, against the CPUs NVML says are nearest its GPU."""
    affinity = facts.host.affinity
    vis = facts.visible
    if not affinity or vis is None or not vis.visible:
        return []
    try:
        logical = int(facts.env.get("LOCAL_RANK") or facts.env.get("SLURM_LOCALID") or 0)
    except ValueError:
        return []
    dev = vis.physical(logical)
    gpu = next((g for g in facts.topology.gpus if dev is not None and g.physical_index == dev.physical_index), None)
    if gpu is None or not gpu.cpu_affinity:
        return []
    near, mine = set(gpu.cpu_affinity), set(affinity)
    label = f"cuda:{logical} = physical {gpu.physical_index} ({gpu.name or '?'})"
    node = f" (NUMA node {gpu.numa_node})" if gpu.numa_node is not None else ""
    if not near & mine:
        return [Finding("policy.numa_mismatch", "warning", "This process runs on CPUs far from its GPU",
                        f"This process may only use CPUs {cpu_span(affinity)}, none of which are near {label}, whose "
                        f"nearest CPUs are {cpu_span(gpu.cpu_affinity)}{node}. Every host<->device copy and pinned "
                        "buffer crosses the inter-socket link.",
                        "Start it on the GPU's CPUs (numactl --cpunodebind / "
                        f"taskset -c {cpu_span(gpu.cpu_affinity)}), "
                        "or use a GPU near its CPUs (CUDA_VISIBLE_DEVICES).")]
    if mine - near:
        return [Finding("policy.numa_unbound", "info", "This process is not bound to its GPU's CPUs",
                        f"It may run on CPUs {cpu_span(affinity)}; {label} is nearest CPUs {cpu_span(gpu.cpu_affinity)}"
                        f"{node}. Threads and memory on the far CPUs pay the inter-socket hop.",
                        "torchplace.configure_threads(gpu=device, bind=True) binds to the GPU's CPUs.")]
    return []
