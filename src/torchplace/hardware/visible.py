"""Logical CUDA ordinals -> physical GPUs, read the way the CUDA driver reads them.

`map_visible(value, topology, order)` is a pure function of the CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER values (the sentinel ENV reads the environment), so every case is a one-line
test. The rules below were measured against the driver (580.159.04, 2 x H200, 2026-11-29 and
2026-12-01; tests/fixtures/driver_visible_devices_h200x2*.json hold every answer):

- unset: every device; empty (or only whitespace/commas): none. A value longer than 2,624
  bytes is ignored as if unset (2,624 is read, 2,625 is not; found by bisection).
- entries are split on ',' and are not stripped: whitespace counts only where strtoul skips it.
- the first entry decides the kind: 'GPU-' UUIDs, 'MIG-' UUIDs, or integers; an entry of
  another kind ends the list ('GPU-...,0' is only the UUID's GPU; ' GPU-...' is an integer
  entry, so a space before a UUID hides every GPU).
- integers parse like C's strtoul: leading ASCII whitespace (' ', '\\t', '\\n', ...) is skipped,
  then an optional sign and ASCII digits: ' 1', '+1', '01', '1abc' and '1.0' mean 1; '0x1' means 0.
  No ASCII digit ('abc', '', '\\u00a01', or Unicode digits such as fullwidth '\\uff11',
  Arabic-Indic '\\u0661' and '\\u00b2') ends the list. The number is then kept
  as a C int: its low 32 bits ('4294967297' is 1, '-4294967295' is 1, an overflow is
  ULONG_MAX, i.e. -1); a negative int or an ordinal out of range ends the list.
- UUIDs need the 'GPU-' prefix exactly ('gpu-' is not one); after it, hex digits in either
  case with '-' skipped anywhere are read until 32 are found (the rest is ignored, so
  'GPU-<uuid> ' and 'GPU-<uuid>x' match); another character before that ends the list. A UUID
  may be shortened to a unique prefix; an unknown or ambiguous one ends the list, and so does a
  bare 'GPU-' (even with one GPU). 'MIG-' entries are read the same way and, with MIG off, name
  GPUs too ('MIG-0' is the GPU whose UUID starts with 0); old-style 'MIG-GPU-<uuid>/1/0' names
  are matched as plain prefixes (not measured).
- a device named twice anywhere in the accepted list makes CUDA refuse to start (cuInit error
  101, CUDA_ERROR_INVALID_DEVICE): no device is visible at all.
- integers index the driver's enumeration: FASTEST_FIRST (the default) or PCI_BUS_ID
  (nvidia-smi's order).

PyTorch's own parser (torch.cuda._parse_visible_devices, behind the NVML-based
torch.cuda.device_count()) differs: it keeps out-of-range ordinals ('0,2' -> [0, 2]), reads a
UUID without 'GPU-' as an ordinal ('7fbb...' -> [7]), keeps unknown UUIDs, reads Unicode digits
('\\uff11' -> 1), does not wrap large numbers, compares UUIDs case-sensitively and fails on a number
of more than 4,300 digits. For such values torch's count can differ from what CUDA then shows;
map_visible adds a note saying so.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .topology import GpuRecord, MigInstance, Topology

ENV = object()  # sentinel: read the value from os.environ
ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
_STRTOUL = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", re.ASCII)  # C isspace, then ASCII digits
_C_SPACE = " \t\n\v\f\r"
_HEX = frozenset("0123456789abcdefABCDEF")
MAX_VALUE_BYTES = 2624  # longer values are ignored by the driver (measured, see above)
_ULONG_MAX = 2**64 - 1


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
        gpus = sorted(topology.gpus, key=lambda g: (g.pci_bus_id or "", g.physical_index))
    else:
        gpus = sorted(topology.gpus, key=lambda g: (g.speed_key(), g.physical_index))
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
        result.visible.append(VisibleDevice(len(result.visible), gpu.physical_index, gpu.uuid, gpu.name,
                                            mig.uuid if mig else None))

    if value is None:
        for pos in range(len(devices)):
            add(pos)
        return result
    if len(value.encode("utf-8", "surrogateescape")) > MAX_VALUE_BYTES:
        result.notes.append(f"CUDA_VISIBLE_DEVICES is {len(value)} characters long; the driver ignores a value "
                            f"longer than {MAX_VALUE_BYTES} bytes and shows every GPU, as if it were unset.")
        for pos in range(len(devices)):
            add(pos)
        return result
    entries = value.split(",")
    if all(e.strip(_C_SPACE) == "" for e in entries):
        return result
    kind = _kind(entries[0])
    chosen: list[int] = []
    for i, entry in enumerate(entries):
        pos, why = _resolve_entry(entry, kind, devices)
        if pos is None:
            result.stopped_at = f"{entry!r} {why}"
            result.ignored = [e for e in entries[i + 1:]]
            break
        if why:  # read, but not as written
            result.notes.append(f"CUDA_VISIBLE_DEVICES entry {entry!r} {why}.")
        if pos in chosen:
            result.duplicates.append(entry)
        chosen.append(pos)
    if _torch_reads_differently(value):
        result.notes.append(f"PyTorch's own parser reads CUDA_VISIBLE_DEVICES={value!r} differently from the "
                            "driver (Unicode digits, upper-case or undashed UUIDs, numbers of 2**31 or more), "
                            "so torch.cuda.device_count() may disagree with the GPUs CUDA shows. Fix: write "
                            "plain ASCII ordinals or the UUIDs exactly as nvidia-smi -L prints them.")
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


def repeated_entries(value: str) -> list[str]:
    """Entries of a CUDA_VISIBLE_DEVICES value that repeat an earlier one (an ordinal as the driver reads it, or a
    UUID): a fault of the value itself, which the driver refuses (cuInit error 101) whatever GPUs exist."""
    seen: set[object] = set()
    twice: list[str] = []
    for entry in value.split(","):
        number, _ = _strtoul_int(entry)
        key: object = number if number is not None else entry.strip(_C_SPACE).lower()
        if number is None and not str(key).startswith(("gpu-", "mig-")):
            break  # the driver stops reading here
        if key in seen:
            twice.append(entry)
        seen.add(key)
    return twice


def _strtoul_int(entry: str) -> tuple[int | None, int]:
    """(C int the driver keeps, strtoul's unsigned value), or (None, 0) without an ASCII digit."""
    match = _STRTOUL.match(entry)
    if not match:
        return None, 0
    sign, digits = match.groups()
    digits = digits.lstrip("0") or "0"
    value = int(digits) if len(digits) <= 20 else _ULONG_MAX + 1  # no int() of 4,300+ digits
    if value > _ULONG_MAX:
        value = _ULONG_MAX  # strtoul saturates on overflow, sign or not
    elif sign == "-":
        value = -value % 2**64
    low = value & 0xFFFFFFFF
    return (low - 2**32 if low >= 2**31 else low), value


def _uuid_hex(rest: str) -> tuple[str | None, str | None]:
    """The hex digits the driver reads after 'GPU-' (lower case), or None and why."""
    digits: list[str] = []
    for ch in rest:
        if len(digits) == 32:
            break
        if ch == "-":
            continue
        if ch not in _HEX:
            return None, f"is not a UUID ({ch!r} is not a hex digit)"
        digits.append(ch.lower())
    if not digits:
        return None, "has no UUID after its prefix"
    return "".join(digits), None


def _torch_reads_differently(value: str) -> bool:
    if not value.isascii():
        return True
    for entry in value.split(","):
        if entry.startswith("GPU-") and (entry != entry.lower().replace("gpu-", "GPU-", 1)):
            return True
        number = _STRTOUL.match(entry)
        if number and len(number.group(2).lstrip("0")) >= 10 and _strtoul_int(entry)[1] >= 2**31:
            return True
    return False


def _resolve_entry(entry: str, kind: str, devices: list[tuple[GpuRecord, MigInstance | None]]
                   ) -> tuple[int | None, str | None]:
    """Position in the enumeration that one entry names and None, or None and why it ends the list.

    A position with a reason means the entry was read, but not as written (a wrapped number).
    """
    if not entry.strip(_C_SPACE):
        return None, "is empty"
    if _kind(entry) != kind:
        return None, f"is a {_kind(entry)} entry in a list of {kind} entries"
    if kind == "int":
        number, unsigned = _strtoul_int(entry)
        if number is None:
            return None, "is not a number (the driver reads ASCII digits only)"
        wrapped = f"is read as {number} (the driver keeps the low 32 bits of {unsigned})" \
            if unsigned >= 2**31 and not entry.lstrip(_C_SPACE).startswith("-") else None
        if number < 0:
            return None, "is negative" + (f" ({wrapped[3:]})" if wrapped else "")
        if number >= len(devices):
            exist = f"{len(devices)} device(s) exist: 0..{len(devices) - 1}" if devices else "no device exists"
            return None, f"is out of range ({exist})" + (f"; it {wrapped}" if wrapped else "")
        return number, wrapped
    if entry in ("GPU-", "MIG-"):
        return None, "has no UUID after its prefix"
    wanted, why = _uuid_hex(entry[4:])
    if kind == "GPU":
        if wanted is None:
            return None, why
        return _match_prefix(wanted, ["" if mig is not None else _hex_of(gpu.uuid) for gpu, mig in devices])
    if wanted is None:  # an old-style 'MIG-GPU-<uuid>/1/0' name: a plain prefix (not measured)
        return _match_prefix(entry, [mig.uuid if mig else "" for _, mig in devices])
    # measured: with MIG off, 'MIG-0' names the GPU whose UUID starts with 0
    return _match_prefix(wanted, [_hex_of(mig.uuid if mig else gpu.uuid) for gpu, mig in devices])


def _hex_of(uuid: str) -> str:
    return uuid[4:].replace("-", "").lower()


def visible_devices(value: Any = ENV, snapshot: str | None = None) -> VisibleMap:
    """Which physical GPU each `cuda:N` is, without starting CUDA.

    Reads the GPUs from NVML (or a snapshot) and applies the driver's rules for
    `CUDA_VISIBLE_DEVICES` (indices, UUID prefixes, MIG ids, the first bad entry ending the list)
    and `CUDA_DEVICE_ORDER`.

    Args:
        value: the `CUDA_VISIBLE_DEVICES` value to apply; by default it is read from the
            environment. None means the variable is unset (every GPU visible).
        snapshot: a JSON file written by `torchplace doctor --json`, or a shipped one by name
            ("h200x2"), instead of this machine.

    Returns:
        A `VisibleMap`: `visible` lists each logical device with its physical index, UUID and name;
        `count`, `physical(logical)`, and `notes` on entries that were ignored or ended the list.

    Raises:
        SnapshotError: the snapshot cannot be read.

    Example:
        ```python
        import torchplace as tp

        vis = tp.visible_devices("1", snapshot="h200x2")
        for d in vis.visible:
            print(f"cuda:{d.logical} = physical {d.physical_index} ({d.name})")
        ```
    """
    from .topology import load_topology

    return map_visible(value, load_topology(snapshot, links=False))
