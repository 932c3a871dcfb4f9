"""Doctor checks about GPUs, the driver, and CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..hardware.visible import repeated_entries
from ..units import format_bytes
from .registry import Finding, check

if TYPE_CHECKING:
    from ..hardware.facts import Facts


@check
def check_nvml(facts: Facts) -> list[Finding]:
    """NVML or the driver missing: a fact on a CPU box, a problem where GPUs should be."""
    topo = facts.topology
    if topo.nvml_available:
        return []
    expects_gpu = bool(facts.versions.torch_cuda) or os.path.exists("/dev/nvidia0")
    return [Finding("nvml.unavailable", "warning" if expects_gpu else "info",
                    "No NVIDIA driver/NVML: GPU facts are unavailable",
                    f"{topo.nvml_error}. torchplace reports CPU facts only.",
                    "On a GPU machine, install the NVIDIA driver (nvidia-smi must work); in a container, "
                    "run with the NVIDIA container toolkit (--gpus all)." if expects_gpu else "")]


@check
def check_visible_devices(facts: Facts) -> list[Finding]:
    """CUDA_VISIBLE_DEVICES that ends early, names a device twice, or hides everything."""
    vis = facts.visible
    value = vis.cuda_visible_devices
    out: list[Finding] = []
    if value is None:
        return out
    # a repeat is a fault of the value itself: said where no GPU (or no NVML) is here too, for the GPU machine
    twice = vis.duplicates or ([] if facts.topology.gpus else repeated_entries(value))
    if twice:
        out.append(Finding("cvd.duplicate", "error", "CUDA_VISIBLE_DEVICES names a device twice",
                           f"CUDA_VISIBLE_DEVICES={value!r} repeats {', '.join(map(repr, twice))}; the driver "
                           "then refuses to initialize (cuInit error 101) and no GPU is usable.",
                           "List each GPU once, e.g. CUDA_VISIBLE_DEVICES=" + ",".join(dict.fromkeys(
                               e.strip() for e in value.split(",") if e.strip()))))
    elif not facts.topology.gpus:
        return out
    elif vis.stopped_at:
        kept = ",".join(str(d.physical_index) for d in vis.visible) or "nothing"
        out.append(Finding("cvd.truncated", "error", "CUDA_VISIBLE_DEVICES is cut short by an invalid entry",
                           f"CUDA_VISIBLE_DEVICES={value!r}: the driver stops at {vis.stopped_at}; visible: "
                           f"{kept} (physical), ignored after it: {vis.ignored or 'nothing'}.",
                           f"Use indices 0..{len(facts.topology.gpus) - 1} or full 'GPU-' UUIDs "
                           "(`torchplace map` lists them); `torchplace pick` prints a valid value."))
    elif value.strip() == "" and facts.topology.gpus:
        out.append(Finding("cvd.empty", "warning", "CUDA_VISIBLE_DEVICES is empty: every GPU is hidden",
                           f"{len(facts.topology.gpus)} GPU(s) exist but CUDA_VISIBLE_DEVICES=''.",
                           "Unset it (all GPUs) or list the GPUs this job should use."))
    return out


@check
def check_device_order(facts: Facts) -> list[Finding]:
    """Integer CUDA_VISIBLE_DEVICES + default FASTEST_FIRST on mixed GPUs: ids differ from nvidia-smi."""
    vis, topo = facts.visible, facts.topology
    value = vis.cuda_visible_devices
    if vis.cuda_device_order == "PCI_BUS_ID" or not topo.heterogeneous():
        return []
    uses_ints = value is None or (value.strip()[:1].isdigit() if value else False)
    if not uses_ints:
        return []
    return [Finding("cvd.order", "warning", "GPU numbers differ between nvidia-smi and CUDA on this machine",
                    "The GPUs differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA numbers them fastest "
                    "first while nvidia-smi uses PCI order; integer CUDA_VISIBLE_DEVICES values follow CUDA's order.",
                    "export CUDA_DEVICE_ORDER=PCI_BUS_ID before starting Python, or use GPU UUIDs.")]


@check
def check_torch_build(facts: Facts) -> list[Finding]:
    """A CPU-only torch on a machine that has GPUs."""
    if facts.topology.gpus and facts.versions.torch and not facts.versions.torch_cuda \
            and not facts.versions.torch_hip:
        return [Finding("torch.cpu_build", "error", "torch is a CPU-only build but this machine has GPUs",
                        f"torch {facts.versions.torch} has no CUDA support; {len(facts.topology.gpus)} GPU(s) "
                        f"with driver {facts.topology.driver_version} will go unused.",
                        "Install a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu130 "
                        "(pick the CUDA version your driver supports).")]
    return []


@check
def check_busy(facts: Facts) -> list[Finding]:
    """Visible GPUs that other processes already use (memory or compute)."""
    out = []
    me = os.getpid()
    for dev in facts.visible.visible:
        gpu = next((g for g in facts.topology.gpus if g.physical_index == dev.physical_index), None)
        if gpu is None:
            continue
        others = [p for p in (gpu.processes or []) if p.pid != me]
        busy_util = gpu.utilization is not None and gpu.utilization >= 50
        if not others and not busy_util:
            continue
        who = ", ".join(f"pid {p.pid}{f' ({p.user})' if p.user else ''} {format_bytes(p.used_memory_bytes, 'GiB')}"
                        for p in others[:5])
        out.append(Finding("gpu.busy", "warning", f"cuda:{dev.logical} (physical {gpu.physical_index}) is in use",
                           f"{len(others)} other process(es){': ' + who if who else ''}; utilization "
                           f"{gpu.utilization if gpu.utilization is not None else '?'}%, memory "
                           f"{format_bytes(gpu.memory_used_bytes, 'GiB')} of "
                           f"{format_bytes(gpu.memory_total_bytes, 'GiB')} used.",
                           "Pick idle GPUs with `torchplace pick` or run through `torchplace run --gpus N`."))
    return out


@check
def check_mig(facts: Facts) -> list[Finding]:
    """MIG-enabled GPUs: CUDA shows their slices, addressed by MIG UUID."""
    out = []
    for gpu in facts.topology.gpus:
        if gpu.mig_mode != "enabled":
            continue
        slices = ", ".join(m.uuid for m in gpu.mig) or "none created"
        out.append(Finding("gpu.mig", "info", f"physical GPU {gpu.physical_index} is in MIG mode",
                           f"CUDA sees its MIG instances, not the whole GPU: {slices}.",
                           "Select a slice with CUDA_VISIBLE_DEVICES=MIG-<uuid>; one process per slice."))
    return out


# what an unknown field costs, and the fix where there is one (fields absent here cost nothing torchplace uses)
_UNKNOWN_COSTS = {
    "numa_node": ("normal on a single-socket host or a VM; threads follow the GPU's CPU affinity instead", None),
    "cpu_affinity": ("no CPU affinity: threads are not placed near the GPU", None),
    "processes": ("the processes on the GPU are hidden, so pick and doctor cannot say who holds it",
                  "in a container NVML hides other PID namespaces: run doctor on the host (or with --pid=host)"),
    "memory": ("free memory is unknown, so pick cannot compare this GPU by it", None),
    "utilization": ("utilization is unknown, so pick cannot compare this GPU by it", None),
}


@check
def check_unknown_fields(facts: Facts) -> list[Finding]:
    """Fields NVML refused to report, each with what it costs (and its fix where one exists)."""
    denied: dict[tuple[str, str], list[int]] = {}
    for gpu in facts.topology.gpus:
        for name, why in gpu.unknown.items():
            denied.setdefault((name, why), []).append(gpu.physical_index)
    if not denied:
        return []
    parts, fixes = [], []
    for (name, why), gpus in sorted(denied.items()):
        cost, fix = _UNKNOWN_COSTS.get(name, ("torchplace does without it", None))
        parts.append(f"{name}: {why} (GPU {', '.join(map(str, gpus))}): {cost}")
        if fix and fix not in fixes:
            fixes.append(fix)
    return [Finding("nvml.unknown_fields", "info", "Some GPU fields are unknown", "; ".join(parts),
                    "; ".join(fixes) or "Nothing to do.")]


@check
def check_compute_mode(facts: Facts) -> list[Finding]:
    """Prohibited or exclusive compute modes: the cause of 'device(s) is/are busy or unavailable'."""
    out = []
    for dev in facts.visible.visible:
        gpu = next((g for g in facts.topology.gpus if g.physical_index == dev.physical_index), None)
        if gpu is None or gpu.compute_mode in (None, "default"):
            continue
        others = [p for p in (gpu.processes or []) if p.pid != os.getpid()]
        if gpu.compute_mode == "prohibited":
            out.append(Finding("gpu.compute_prohibited", "error", f"cuda:{dev.logical} (physical {gpu.physical_index}) "
                               "refuses CUDA contexts", "Its compute mode is Prohibited: every CUDA call fails with "
                               "'CUDA-capable device(s) is/are busy or unavailable'.",
                               "Use another GPU, or ask an administrator: nvidia-smi -i "
                               f"{gpu.physical_index} -c DEFAULT."))
        elif others:
            out.append(Finding("gpu.exclusive_busy", "error", f"cuda:{dev.logical} (physical {gpu.physical_index}) is "
                               "exclusive and already taken", f"Compute mode {gpu.compute_mode}: only one process may "
                               f"use it, and pid {others[0].pid} does; CUDA will fail with 'busy or unavailable'.",
                               "Pick a free GPU (`torchplace pick`) or wait for that process."))
        else:
            out.append(Finding("gpu.exclusive", "info", f"cuda:{dev.logical} (physical {gpu.physical_index}) is in "
                               f"{gpu.compute_mode} mode", "One process at a time: DataLoader workers and a second "
                               "job touching CUDA on it will fail.", "Keep CUDA work in one process per GPU."))
    return out


@check
def check_unleased(facts: Facts) -> list[Finding]:
    """Processes NVML shows on a GPU that no torchplace lease of that GPU covers: `pick` counts their
    memory as taken, and their owners may not know that others queue for the GPU."""
    from ..distributed import unleased_processes
    from ..errors import LeaseError

    try:
        found = unleased_processes(facts.topology)
    except LeaseError as exc:  # an untrusted lease folder: `torchplace leases` says why
        return [Finding("gpu.unleased", "info", "GPUs used without a lease: the lease folder cannot be read",
                        str(exc))]
    out = []
    for gpu in facts.topology.gpus:
        mine = [p for g, p in found if g.uuid == gpu.uuid]
        if not mine:
            continue
        who = ", ".join(f"pid {p.pid} ({p.user or 'user unknown'}, {format_bytes(p.used_memory_bytes, 'GiB')})"
                        for p in mine[:5]) + (f" and {len(mine) - 5} more" if len(mine) > 5 else "")
        total = sum(p.used_memory_bytes or 0 for p in mine)
        out.append(Finding("gpu.unleased", "warning",
                           f"GPU {gpu.physical_index} is used without a lease",
                           f"{who}: {format_bytes(total, 'GiB')} that `torchplace pick` and memory reservations "
                           "count as taken.",
                           "Start GPU jobs with `torchplace run` (it leases the GPUs; --memory SIZE shares one), "
                           "so that others see them in `torchplace leases` and queue behind them."))
    return out
