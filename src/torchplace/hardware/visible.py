"""Logical CUDA ordinals -> physical GPUs, read the way the CUDA driver reads them.

`map_visible(value, topology, order)` is a pure function of the CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER values (the sentinel ENV reads the environment), so every case is a one-line
test. The rules below were measured against the driver (580.159.04, 2 x H200, 2026-11-29;
tests/fixtures/driver_visible_devices_h200x2.json holds every answer):

- unset: every device; empty (or only whitespace/commas): none.
- entries are split on ',' and stripped of surrounding whitespace.
- the first entry decides the kind: 'GPU-' UUIDs, 'MIG-' UUIDs, or integers; an entry of
  another kind ends the list ('GPU-...,0' is only the UUID's GPU).
- integers parse like strtoul: '+1', '01', '1abc' and '1.0' mean 1; '0x1' means 0; no leading
  digit ('abc', '') or a negative number ends the list; so does an ordinal out of range.
- UUIDs are case-sensitive, need the 'GPU-' prefix, and may be shortened to a unique prefix;
  an unknown or ambiguous one ends the list, and so does a bare 'GPU-' (even with one GPU).
- a device named twice anywhere in the accepted list makes CUDA refuse to start (cuInit error
  101, CUDA_ERROR_INVALID_DEVICE): no device is visible at all.
- integers index the driver's enumeration: FASTEST_FIRST (the default) or PCI_BUS_ID
  (nvidia-smi's order).

PyTorch's own parser (torch.cuda._parse_visible_devices, used only for NVML-based counts) differs:
it keeps out-of-range ordinals ('0,2' -> [0, 2]), reads a UUID without 'GPU-' as an ordinal
('7fbb...' -> [7]) and keeps unknown UUIDs. torch.cuda.device_count() asks the driver, so it
agrees with this module, not with that parser.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .topology import GpuRecord, MigInstance, Topology

ENV = object()  # sentinel: read the value from os.environ
ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
_STRTOUL = re.compile(r"^([+-]?)(\d+)")


@dataclass(frozen=True)
class VisibleDevice:
    """One device CUDA will show as cuda:<logical>."""

    logical: int
    physical_index: int
    uuid: str
    name: str | None
    mig_uuid: str | None = None

    def describe(self) -> str:
        what = f"{self.name or 'unknown GPU'}, {self.mig_uuid or self.uuid}"
        mig = " MIG slice" if self.mig_uuid else ""
        return f"cuda:{self.logical} = physical {self.physical_index}{mig} ({what})"


@dataclass
class VisibleMap:
    """The result of reading CUDA_VISIBLE_DEVICES against a topology."""

    cuda_visible_devices: str | None
    cuda_device_order: str | None
    order: str
    visible: list[VisibleDevice] = field(default_factory=list)
    stopped_at: str | None = None  # the entry that ended the list, with the reason
    ignored: list[str] = field(default_factory=list)  # entries after the one that ended the list
    duplicates: list[str] = field(default_factory=list)  # entries naming a device twice
    notes: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.visible)

    def physical(self, logical: int) -> VisibleDevice | None:
        return self.visible[logical] if 0 <= logical < len(self.visible) else None

    def logical_of(self, physical_index: int) -> int | None:
        return next((d.logical for d in self.visible if d.physical_index == physical_index), None)

    def summary(self) -> str:
        """A sentence listing what is visible, for error messages."""
        env = "unset" if self.cuda_visible_devices is None else repr(self.cuda_visible_devices)
        if not self.visible:
            return f"no GPU is visible (CUDA_VISIBLE_DEVICES={env})"
        n = len(self.visible)
        items = "; ".join(d.describe() for d in self.visible)
        return f"CUDA_VISIBLE_DEVICES={env} makes {n} GPU{'s' if n != 1 else ''} visible: {items}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["count"] = self.count
        return data


def _enumeration(topology: Topology, order: str) -> list[tuple[GpuRecord, MigInstance | None]]:
    """Devices in the driver's enumeration order; a MIG-enabled GPU shows its MIG slices."""
    if order == "PCI_BUS_ID":
        gpus = sorted(topology.gpus, key=lambda g: (g.pci_bus_id or "", g.index))
    else:
        gpus = sorted(topology.gpus, key=lambda g: (g.speed_key(), g.index))
    out: list[tuple[GpuRecord, MigInstance | None]] = []
    for gpu in gpus:
        if gpu.mig_mode == "enabled" and gpu.mig:
            out.extend((gpu, m) for m in gpu.mig)
        else:
            out.append((gpu, None))
    return out


def _kind(entry: str) -> str:
    return "GPU" if entry.startswith("GPU-") else "MIG" if entry.startswith("MIG-") else "int"


def _match_prefix(entry: str, candidates: list[str]) -> tuple[int | None, str | None]:
    hits = [i for i, uuid in enumerate(candidates) if uuid.startswith(entry)]
    if len(hits) == 1:
        return hits[0], None
    return None, ("matches no device" if not hits else f"is ambiguous: it prefixes {len(hits)} devices")


def map_visible(value: Any = ENV, topology: Topology | None = None, order: Any = ENV) -> VisibleMap:
    """Map CUDA_VISIBLE_DEVICES to physical GPUs as the driver does. Never raises."""
    if value is ENV:
        value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if order is ENV:
        order = os.environ.get("CUDA_DEVICE_ORDER")
    if topology is None:
        from .topology import read_topology

        topology = read_topology(links=False)
    effective = order if order in ORDERS else "FASTEST_FIRST"
    result = VisibleMap(cuda_visible_devices=value, cuda_device_order=order, order=effective)
    if order is not None and order not in ORDERS:
        result.notes.append(f"CUDA_DEVICE_ORDER={order!r} is not one of {', '.join(ORDERS)}; "
                            "the driver uses FASTEST_FIRST.")
    devices = _enumeration(topology, effective)

    def add(pos: int) -> None:
        gpu, mig = devices[pos]
        result.visible.append(VisibleDevice(len(result.visible), gpu.index, gpu.uuid, gpu.name,
                                            mig.uuid if mig else None))

    if value is None:
        for pos in range(len(devices)):
            add(pos)
        return result
    entries = [e.strip() for e in value.split(",")]
    if entries == [""] or all(e == "" for e in entries):
        return result
    kind = _kind(entries[0])
    chosen: list[int] = []
    for i, entry in enumerate(entries):
        pos, why = _resolve_entry(entry, kind, devices)
        if pos is None:
            result.stopped_at = f"{entry!r} {why}"
            result.ignored = [e for e in entries[i + 1:]]
            break
        if pos in chosen:
            result.duplicates.append(entry)
        chosen.append(pos)
    if result.duplicates:
        result.notes.append(f"CUDA_VISIBLE_DEVICES={value!r} names a device twice "
                            f"({', '.join(map(repr, result.duplicates))}); CUDA then refuses to start "
                            "(cuInit error 101) and no GPU is visible.")
        return result
    for pos in chosen:
        add(pos)
    if result.stopped_at:
        result.notes.append(f"CUDA_VISIBLE_DEVICES={value!r} stops at {result.stopped_at}; "
                            f"{len(chosen)} device(s) before it are visible"
                            + (f" and {result.ignored} after it are ignored." if result.ignored else "."))
    return result


def _resolve_entry(entry: str, kind: str, devices: list[tuple[GpuRecord, MigInstance | None]]
                   ) -> tuple[int | None, str | None]:
    """Position in the enumeration that one entry names, or None and why it ends the list."""
    if not entry:
        return None, "is empty"
    if _kind(entry) != kind:
        return None, f"is a {_kind(entry)} entry in a list of {kind} entries"
    if kind == "int":
        match = _STRTOUL.match(entry)
        if not match:
            return None, "is not a number"
        number = int(match.group(1) + match.group(2))
        if number < 0:
            return None, "is negative"
        if number >= len(devices):
            return None, f"is out of range ({len(devices)} device(s) exist: 0..{len(devices) - 1})"
        return number, None
    if entry in ("GPU-", "MIG-"):
        return None, "has no UUID after its prefix"
    if kind == "GPU":
        return _match_prefix(entry, [gpu.uuid if mig is None else "" for gpu, mig in devices])
    return _match_prefix(entry, [mig.uuid if mig else "" for _, mig in devices])


def visible_devices(value: Any = ENV, snapshot: str | None = None) -> VisibleMap:
    """Public helper: the visible map for this machine (or a snapshot file), never starting CUDA."""
    topology = None
    if snapshot is not None:
        from .topology import load_snapshot

        topology = Topology.from_dict(load_snapshot(snapshot), source=str(snapshot))
    return map_visible(value, topology)
