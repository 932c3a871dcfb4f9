"""Physical GPUs as NVML reports them, as typed records that serialize to a JSON snapshot.

`read_topology()` asks NVML (never CUDA). `Topology.from_dict` / `load_snapshot` rebuild the
same records from a snapshot captured on another machine, so every layer above runs on either.
Indices here are *physical* (NVML's, which is nvidia-smi's and PCI bus order).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import safeio
from ..errors import SnapshotError
from . import nvml
from .snapshot import GPU_KEYS, SNAPSHOT_FIX, load_snapshot, upgrade, with_old_keys

SCHEMA_VERSION = 1


@dataclass
class MigInstance:
    """One MIG instance (a slice of a physical GPU) that CUDA can see as a device."""

    uuid: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    memory_total_bytes: int | None = None
    name: str | None = None


@dataclass
class GpuProcess:
    """A compute process on a GPU; `user` is None when the OS will not say."""

    pid: int
    used_memory_bytes: int | None = None
    user: str | None = None
    name: str | None = None


@dataclass
class GpuRecord:
    """Everything NVML says about one physical GPU. None means unknown; `unknown` says why.

    `physical_index` is NVML's index (nvidia-smi's), not a cuda:N ordinal: see visible.py."""

    physical_index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    compute_capability: list[int] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization: int | None = None
    compute_mode: str | None = None  # "default", "exclusive_process", "prohibited", ...
    mig_mode: str | None = None  # "enabled", "disabled", or None when unknown/unsupported
    mig: list[MigInstance] = field(default_factory=list)
    processes: list[GpuProcess] | None = None
    cores: int | None = None
    max_sm_clock_mhz: int | None = None
    numa_node: int | None = None
    cpu_affinity: list[int] | None = None
    unknown: dict[str, str] = field(default_factory=dict)

    # the names before the unit-bearing ones, for code written against them
    index = property(lambda self: self.physical_index)
    memory_total = property(lambda self: self.memory_total_bytes)
    memory_used = property(lambda self: self.memory_used_bytes)
    memory_free = property(lambda self: self.memory_free_bytes)

    def speed_key(self) -> tuple[int, str]:
        """Sort key approximating CUDA's FASTEST_FIRST: more cores x clock first, then bus id."""
        speed = (self.cores or 0) * (self.max_sm_clock_mhz or 0)
        cc = tuple(self.compute_capability or (0, 0))
        return (-(speed or cc[0] * 100 + cc[1]), self.pci_bus_id or "")

    def describe(self) -> str:
        return f"{self.name or 'unknown GPU'}, {self.uuid}"


@dataclass
class Link:
    """How two physical GPUs reach each other."""

    a: int
    b: int
    p2p: str | None = None  # "ok", "not supported", ... or None
    nvlinks: int | None = None
    path: str | None = None  # NVML common ancestor: "internal", "single", "multiple", "hostbridge", "node", "system"
    unknown: dict[str, str] = field(default_factory=dict)

    def label(self) -> str:
        if self.nvlinks:
            return f"NV{self.nvlinks}"
        return {"internal": "SELF", "single": "PIX", "multiple": "PXB", "hostbridge": "PHB",
                "node": "NODE", "system": "SYS"}.get(self.path or "", "?")


@dataclass
class Topology:
    """The physical GPUs of one machine plus what NVML reports about the driver."""

    gpus: list[GpuRecord] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_error: str | None = None
    captured_at: str | None = None
    hostname: str | None = None
    source: str = "live"  # "live" or the snapshot path

    @property
    def nvml_available(self) -> bool:
        return self.nvml_error is None

    def link(self, a: int, b: int) -> Link | None:
        for item in self.links:
            if {item.a, item.b} == {a, b}:
                return item
        return None

    def heterogeneous(self) -> bool:
        """True when the GPUs differ in name or capability (orderings may then disagree)."""
        kinds = {(g.name, tuple(g.compute_capability or ())) for g in self.gpus}
        return len(kinds) > 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("source")
        data["gpus"] = [with_old_keys(gpu, GPU_KEYS) for gpu in data["gpus"]]
        return {"schema": SCHEMA_VERSION, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "snapshot") -> Topology:
        """The topology a snapshot describes; SnapshotError naming the field for any value of the wrong type."""
        if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
            raise SnapshotError(f"{source}: a snapshot needs a top-level object with a 'gpus' list. "
                                f"{SNAPSHOT_FIX}")
        schema = data.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION or type(schema) is not int:
            raise SnapshotError(f"{source}: snapshot schema {schema!r:.40} is not supported "
                                f"(this torchplace reads schema {SCHEMA_VERSION}). {SNAPSHOT_FIX}")
        try:
            raw_links = _list(data.get("links"), "links")
            count, pairs = len(data["gpus"]), len(data["gpus"]) * (len(data["gpus"]) - 1) // 2
            if count > MAX_SNAPSHOT_GPUS or len(raw_links) > pairs:
                raise ValueError(f"it lists {count} GPUs and {len(raw_links)} links; a snapshot describes one host: "
                                 f"at most {MAX_SNAPSHOT_GPUS} GPUs, and one link per pair of them ({pairs} here)")
            gpus = [safeio.build(GpuRecord, upgrade(raw, GPU_KEYS), f"gpus[{i}]")
                    for i, raw in enumerate(data["gpus"])]
            links = [safeio.build(Link, item, f"links[{i}]") for i, item in enumerate(raw_links)]
            fields_ = {k: safeio.build(_Strings, {"value": data.get(k)}, k).value
                       for k in ("driver_version", "cuda_driver_version", "nvml_error", "captured_at", "hostname")}
        except ValueError as exc:
            raise SnapshotError(f"{source}: malformed snapshot ({exc}). {SNAPSHOT_FIX}") from None
        return cls(gpus=gpus, links=links, source=source, **fields_)


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where} is a {type(value).__name__}, not a list")
    return value


@dataclass
class _Strings:
    value: str | None = None


MAX_SNAPSHOT_GPUS = 256  # GPUs of one host: 8 or 16 on the largest boards (doctor's checks compare pairs)


def load_topology(snapshot: str | os.PathLike[str] | None = None, *, links: bool = True,
                  details: bool = True) -> Topology:
    """The GPUs of a snapshot file, or of this machine from NVML (`links`, `details`: see read_topology).

    The one way to get a topology from either source; never starts CUDA."""
    if snapshot is not None:
        return Topology.from_dict(load_snapshot(snapshot), source=str(snapshot))
    return read_topology(links=links, details=details)


# --------------------------------------------------------------------------- live reading

_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
_PATHS = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}
_P2P = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
        4: "disabled by registry key", 5: "not supported", 6: "unknown"}


def _record(index: int, handle: Any, unknown_reasons: dict[str, str], details: bool = True) -> GpuRecord:
    pynvml = nvml.start().value

    def read(name: str, fn: str, *args: Any) -> Any:
        reading = nvml.call(fn, handle, *args)
        if not reading.ok:
            unknown_reasons[name] = reading.reason or "unknown"
        return reading.value

    uuid = nvml.text(read("uuid", "nvmlDeviceGetUUID")) or f"unknown-{index}"
    gpu = GpuRecord(physical_index=index, uuid=uuid, unknown=unknown_reasons)
    gpu.name = nvml.text(read("name", "nvmlDeviceGetName"))
    pci = read("pci_bus_id", "nvmlDeviceGetPciInfo")
    if pci is not None:
        gpu.pci_bus_id = nvml.text(pci.busId)
    cc = read("compute_capability", "nvmlDeviceGetCudaComputeCapability")
    gpu.compute_capability = list(cc) if cc is not None else None
    mem = read("memory", "nvmlDeviceGetMemoryInfo")
    if mem is not None:
        gpu.memory_total_bytes, gpu.memory_used_bytes = int(mem.total), int(mem.used)
        gpu.memory_free_bytes = int(mem.free)
    util = read("utilization", "nvmlDeviceGetUtilizationRates")
    gpu.utilization = int(util.gpu) if util is not None else None
    mode = read("compute_mode", "nvmlDeviceGetComputeMode")
    gpu.compute_mode = _COMPUTE_MODES.get(mode, str(mode)) if mode is not None else None
    if details:
        gpu.cores = read("cores", "nvmlDeviceGetNumGpuCores")
        gpu.max_sm_clock_mhz = read("max_sm_clock_mhz", "nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_SM)
        gpu.numa_node = read("numa_node", "nvmlDeviceGetNumaNodeId")
        affinity = read("cpu_affinity", "nvmlDeviceGetCpuAffinity", max(1, (os.cpu_count() or 64) // 64 + 1))
        if affinity is not None:
            cpus = [w * 64 + bit for w, word in enumerate(affinity) for bit in range(64) if (int(word) >> bit) & 1]
            gpu.cpu_affinity = cpus or None
    mig = read("mig_mode", "nvmlDeviceGetMigMode")
    if mig is not None:
        gpu.mig_mode = "enabled" if mig[0] else "disabled"
        if mig[0]:
            gpu.mig = _mig_instances(handle, unknown_reasons)
    procs = read("processes", "nvmlDeviceGetComputeRunningProcesses")
    if procs is not None:
        gpu.processes = [_process(p) for p in procs]
    return gpu


def _mig_instances(handle: Any, unknown_reasons: dict[str, str]) -> list[MigInstance]:
    count = nvml.call("nvmlDeviceGetMaxMigDeviceCount", handle)
    if not count.ok:
        unknown_reasons["mig"] = count.reason or "unknown"
        return []
    out = []
    for i in range(count.value):
        mh = nvml.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, i)
        if not mh.ok:
            continue  # an empty slot, not an error
        mem = nvml.call("nvmlDeviceGetMemoryInfo", mh.value).value
        out.append(MigInstance(
            uuid=nvml.text(nvml.call("nvmlDeviceGetUUID", mh.value).value) or f"MIG-unknown-{i}",
            gpu_instance_id=nvml.call("nvmlDeviceGetGpuInstanceId", mh.value).value,
            compute_instance_id=nvml.call("nvmlDeviceGetComputeInstanceId", mh.value).value,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            name=nvml.text(nvml.call("nvmlDeviceGetName", mh.value).value)))
    return out


def _process(p: Any) -> GpuProcess:
    used = getattr(p, "usedGpuMemory", None)
    proc = GpuProcess(pid=int(p.pid), used_memory_bytes=int(used) if isinstance(used, int) else None)
    try:
        import psutil

        ps = psutil.Process(proc.pid)
        proc.user, proc.name = ps.username(), ps.name()
    except Exception:  # another PID namespace, or no permission: leave unknown
        pass
    return proc


def _bus(pci: Any) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of an NVML PCI record, comparable across formats."""
    try:
        return (int(pci.domain), int(pci.bus), int(pci.device), 0)
    except (AttributeError, TypeError, ValueError):
        return None


def _links(handles: list[Any]) -> list[Link]:
    pynvml = nvml.start().value
    max_links = nvml.constant("NVML_NVLINK_MAX_LINKS", 18)
    remote: dict[int, list[Any]] = {}
    link_errors: dict[int, str] = {}
    for i, h in enumerate(handles):
        peers = []
        for link in range(max_links):
            state = nvml.call("nvmlDeviceGetNvLinkState", h, link)
            if not state.ok:
                link_errors.setdefault(i, f"nvlink state: {state.reason}")
                continue
            if not state.value:
                continue
            pci = nvml.call("nvmlDeviceGetNvLinkRemotePciInfo_v2", h, link)
            if not pci.ok:
                pci = nvml.call("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            kind = nvml.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            if kind.ok and kind.value == nvml.constant("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                peers.append("switch")  # NVSwitch systems: every GPU on the fabric is a peer
            elif pci.ok:
                peers.append(_bus(pci.value))
            else:
                link_errors.setdefault(i, f"nvlink remote: {pci.reason}")
        remote[i] = peers
    buses = []
    for h in handles:
        pci = nvml.call("nvmlDeviceGetPciInfo", h)
        buses.append(_bus(pci.value) if pci.ok else None)
    read_caps = getattr(pynvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    if isinstance(read_caps, tuple):  # nvidia-ml-py 13 defines it as `0,` (a tuple)
        read_caps = read_caps[0]
    out = []
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            item = Link(a=i, b=j)
            p2p = nvml.call("nvmlDeviceGetP2PStatus", handles[i], handles[j], read_caps)
            item.p2p = _P2P.get(p2p.value, str(p2p.value)) if p2p.ok else None
            if not p2p.ok:
                item.unknown["p2p"] = p2p.reason or "?"
            path = nvml.call("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
            item.path = _PATHS.get(path.value) if path.ok else None
            if not path.ok:
                item.unknown["path"] = path.reason or "?"
            if remote[i] or remote[j]:
                direct = sum(1 for bus in remote[i] if bus is not None and bus == buses[j])
                switched = min(remote[i].count("switch"), remote[j].count("switch"))
                item.nvlinks = direct + switched
            elif i in link_errors:
                item.unknown["nvlinks"] = link_errors[i]
            else:
                item.nvlinks = 0
            out.append(item)
    return out


def read_topology(*, links: bool = True, details: bool = True) -> Topology:
    """Read this machine's GPUs from NVML. Never raises; a missing NVML is a fact, not a crash.

    `links=False` skips the pairwise NVLink/P2P queries (dozens of NVML calls per pair) for
    callers that only need the GPUs themselves. `details=False` also skips the per-GPU facts
    that choosing a GPU does not need (cores, max clock, NUMA node, CPU affinity): on the
    2 x H200 machine those took 37 of the 50 ms of a first reading (2026-11-29).
    """
    started = nvml.start()
    topo = Topology(captured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), hostname=os.uname().nodename)
    if not started.ok:
        topo.nvml_error = started.reason
        return topo
    topo.driver_version = nvml.text(nvml.call("nvmlSystemGetDriverVersion").value)
    cuda = nvml.call("nvmlSystemGetCudaDriverVersion_v2")
    if cuda.ok:
        topo.cuda_driver_version = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}"
    count = nvml.call("nvmlDeviceGetCount")
    if not count.ok:
        topo.nvml_error = f"nvmlDeviceGetCount failed: {count.reason}"
        return topo
    handles = []
    for i in range(count.value):
        h = nvml.call("nvmlDeviceGetHandleByIndex", i)
        if not h.ok:
            topo.gpus.append(GpuRecord(physical_index=i, uuid=f"unknown-{i}", unknown={"handle": h.reason or "?"}))
            continue
        handles.append(h.value)
        topo.gpus.append(_record(i, h.value, {}, details))
    if links and len(handles) == len(topo.gpus):
        topo.links = _links(handles)
    return topo
