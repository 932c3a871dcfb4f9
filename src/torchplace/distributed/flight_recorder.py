"""torch's flight recorder, read: which rank never entered which collective, by sequence number.

With `TORCH_NCCL_TRACE_BUFFER_SIZE` (NCCL; `TORCH_FR_BUFFER_SIZE` for every backend) above 0,
each process group records its last collectives (op, sequence number, sizes, state, Python
frames). With `TORCH_NCCL_DUMP_ON_TIMEOUT=1`, when NCCL's watchdog sees a collective time out,
every rank writes its record to `<TORCH_FR_DUMP_TEMP_FILE><rank>` (the stuck rank too: a
background thread writes it). `recorder_env` sets those variables; `read_traces` reads the
files and `summarize` compares the ranks: the collective the others entered and a rank never
reached is named with its sequence number.

The files are pickles written by torch. torch's own reader (torch.distributed.flight_recorder)
loads them with an unrestricted `pickle.load`, which runs any code a crafted file names. Here
they are read by `load_dump`, an unpickler that refuses every global: torch writes the record
from plain dicts, lists, tuples, strings, numbers, booleans and None only (checked on torch 2.13's
dumps), so a file that names any class or function is refused instead of run.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import safeio
from ..errors import DistributedError

#: the default number of collectives each group keeps (torch's recommendation for production jobs)
DEFAULT_ENTRIES = 2000
#: the largest dump read (a 2000-entry record with frames is a few MB)
MAX_DUMP_BYTES = 256 << 20
DUMP_PREFIX = "fr_rank_"


def recorder_env(folder: str | os.PathLike[str], entries: int = DEFAULT_ENTRIES) -> dict[str, str]:
    """The variables that turn the recorder on and make every rank dump into FOLDER on a timeout.

    Both spellings are set: torch >= 2.7 reads TORCH_FR_*, older NCCL builds TORCH_NCCL_*."""
    prefix = str(Path(folder) / DUMP_PREFIX)
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries), "TORCH_FR_BUFFER_SIZE": str(entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}; a flight recorder dump holds plain data only")


def load_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One rank's dump as a dict, read without running code from the file (no globals allowed)."""
    path = Path(path)
    # a regular file within the limit: a FIFO named like a dump would block the read, /dev/zero never end it
    raw = safeio.read_limited(path, MAX_DUMP_BYTES, DistributedError,
                              "Fix: point at the files TORCH_FR_DUMP_TEMP_FILE names.")
    try:
        data = _NoGlobals(io.BytesIO(raw)).load()
    except Exception as exc:  # any malformed pickle: one message
        raise DistributedError(f"{path} is not a flight recorder dump torchplace can read safely ({exc}). Fix: "
                               "point at the files TORCH_FR_DUMP_TEMP_FILE names (one per rank).") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
        raise DistributedError(f"{path} holds {type(data).__name__}, not a flight recorder dump (a dict with "
                               "'entries'). Fix: point at the files TORCH_FR_DUMP_TEMP_FILE names.")
    return data


@dataclass(frozen=True)
class Collective:
    """One recorded collective of one rank."""

    seq: int  # collective_seq_id within its process group (p2p ops: p2p_seq_id)
    op: str  # "all_reduce", "broadcast", ... (profiling name without the backend)
    group: str  # process group id
    state: str  # "scheduled", "started", "completed"
    sizes: list[Any] = field(default_factory=list)
    where: str = ""  # the innermost frame outside torch, "file:line in function"


@dataclass
class RankTrace:
    """What one rank's dump says: its collectives and, per group, the last one enqueued and completed."""

    rank: int
    path: Path
    collectives: list[Collective]
    last_enqueued: dict[str, int]
    last_completed: dict[str, int]


def _where(frames: Any) -> str:
    for frame in frames or []:
        name = str(frame.get("filename", "")) if isinstance(frame, dict) else ""
        if name and "/torch/" not in name:
            return f"{name}:{frame.get('line')} in {frame.get('name')}"
    return ""


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def parse_dump(data: dict[str, Any], rank: int, path: Path) -> RankTrace:
    """The parts of a dump `summarize` compares."""
    collectives = []
    for entry in data.get("entries", []):
        if not isinstance(entry, dict):
            continue
        group = entry.get("process_group")
        group_id = str(group[0]) if isinstance(group, (list, tuple)) and group else str(entry.get("pg_id", "0"))
        p2p = bool(entry.get("is_p2p"))
        op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        collectives.append(Collective(seq=_int(entry.get("p2p_seq_id" if p2p else "collective_seq_id")), op=op,
                                      group=group_id, state=str(entry.get("state", "?")),
                                      sizes=list(entry.get("input_sizes") or []), where=_where(entry.get("frames"))))
    enqueued, completed = {}, {}
    for group_id, status in (data.get("pg_status") or {}).items():
        if isinstance(status, dict):
            enqueued[str(group_id)] = _int(status.get("last_enqueued_collective"))
            completed[str(group_id)] = _int(status.get("last_completed_collective"))
    for c in collectives:  # dumps without pg_status: from the entries
        if c.seq >= 0:
            enqueued[c.group] = max(enqueued.get(c.group, -1), c.seq)
            if c.state == "completed":
                completed[c.group] = max(completed.get(c.group, -1), c.seq)
    return RankTrace(rank, path, collectives, enqueued, completed)


def read_traces(folder: str | os.PathLike[str], prefix: str = DUMP_PREFIX) -> list[RankTrace]:
    """Every rank's dump in FOLDER (files named PREFIX<rank>), by rank."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    traces = []
    for entry in sorted(Path(folder).iterdir()):
        m = pattern.match(entry.name)
        if m and entry.is_file():
            traces.append(parse_dump(load_dump(entry), int(m.group(1)), entry))
    return sorted(traces, key=lambda t: t.rank)


@dataclass
class HangSummary:
    """Which ranks stopped short of the collective the others entered, per process group."""

    ranks: list[int]
    stuck: list[dict[str, Any]]  # {"group", "seq", "op", "sizes", "behind": {rank: last enqueued}, "entered": [...]}

    def describe(self) -> str:
        if not self.ranks:
            return "No flight recorder dump was found."
        if not self.stuck:
            return (f"Flight recorder dumps of rank(s) {self.ranks}: every rank enqueued the same collectives; no "
                    "rank is behind (a collective that hangs on every rank points at the network or NCCL: rerun "
                    "with NCCL_DEBUG=INFO).")
        lines = []
        for s in self.stuck:
            behind = ", ".join(f"rank {r} (last entered #{seq})" for r, seq in sorted(s["behind"].items()))
            where = f", called at {s['where']}" if s.get("where") else ""
            lines.append(f"{behind} never entered {s['op']} #{s['seq']} of process group {s['group']} "
                         f"(input sizes {s['sizes']}{where}), which rank(s) {s['entered']} entered and waited in.")
        return " ".join(lines) + " Fix: look at what those ranks were doing instead (their log; py-spy dump " \
                                 "--pid); every rank must call the same collectives in the same order."


def summarize(traces: list[RankTrace]) -> HangSummary:
    """Compare the ranks' dumps: per group, the first collective some rank entered and another never did."""
    stuck = []
    groups = sorted({g for t in traces for g in t.last_enqueued})
    for group in groups:
        seqs = {t.rank: t.last_enqueued.get(group, -1) for t in traces}
        newest = max(seqs.values())
        behind = {r: s for r, s in seqs.items() if s < newest}
        if not behind:
            continue
        missed = min(behind.values()) + 1  # the first collective a rank behind never entered
        entered = [r for r, s in seqs.items() if s >= missed]
        ahead = next(t for t in traces if t.rank == entered[0])
        op = next((c for c in ahead.collectives if c.group == group and c.seq == missed), None)
        stuck.append({"group": group, "seq": missed, "op": op.op if op else "?", "sizes": op.sizes if op else [],
                      "where": op.where if op else "", "behind": behind, "entered": entered})
    return HangSummary(ranks=[t.rank for t in traces], stuck=stuck)


def dump_here(folder: str | os.PathLike[str], rank: int) -> Path | None:
    """Write this process's flight record to FOLDER/fr_rank_<rank> (None when torch records nothing)."""
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        data = dump()
    except RuntimeError:
        return None
    path = Path(folder) / f"{DUMP_PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
