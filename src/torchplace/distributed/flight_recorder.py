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


class _Bad(Exception):
    """A field of a dump that is not what torch writes there."""


_FIX = "Fix: point at the files TORCH_FR_DUMP_TEMP_FILE names (one per rank)."
_MAX_SHOWN = 16  # input sizes kept per collective, dimensions per size: what a message shows


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):  # str() of a crafted [x, x] tree 40 deep would never end
        raise _Bad(f"{what} is a {type(value).__name__}, not a string")
    return value[:300]


def _count(value: Any, what: str) -> int:
    """A sequence number: an int of at most 64 bits, -1 when absent."""
    if value is None:
        return -1
    if type(value) is not int or not -1 <= value < 2**63:
        raise _Bad(f"{what} is {value!r:.40}, not a sequence number")
    return value


class _Reader:
    """Reads the fields of one dump, each object once however often the pickle memo shares it: a list
    of frames or sizes shared by every entry is checked and converted one time, and an entry listed
    twice counts once (torch writes a new dict per entry)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.kept: list[Any] = []  # what `seen` names stays alive, so no id is reused
        self.cache: dict[int, Any] = {}

    def once(self, obj: Any) -> bool:
        if id(obj) in self.seen:
            return False
        self.seen.add(id(obj))
        self.kept.append(obj)
        return True

    def shared(self, obj: Any, convert: Any) -> Any:
        if id(obj) not in self.cache:
            self.kept.append(obj)
            self.cache[id(obj)] = convert(obj)
        return self.cache[id(obj)]

    def sizes(self, value: Any) -> list[list[int]]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise _Bad(f"input_sizes is a {type(value).__name__}, not a list")
        return self.shared(value, lambda v: [self.shared(d, _dims) for d in v[:_MAX_SHOWN]])

    def where(self, frames: Any) -> str:
        """The innermost frame outside torch, "file:line in function"."""
        if frames is None:
            return ""
        if not isinstance(frames, list):
            raise _Bad(f"frames is a {type(frames).__name__}, not a list")
        return self.shared(frames, _first_user_frame)


def _dims(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(type(d) is int for d in value[:_MAX_SHOWN]):
        raise _Bad(f"an input size is {value!r:.60}, not a list of integers")
    return list(value[:_MAX_SHOWN])


def _first_user_frame(frames: list[Any]) -> str:
    for frame in frames:  # each distinct list once (_Reader.where)
        if not isinstance(frame, dict):
            raise _Bad(f"a frame is a {type(frame).__name__}, not a dict")
        name = _text(frame.get("filename", ""), "a frame's filename")
        if name and "/torch/" not in name:
            line = frame.get("line")
            if type(line) is not int:
                raise _Bad(f"the line of frame {name!r:.80} is {line!r:.40}, not a number")
            return f"{name}:{line} in {_text(frame.get('name', '?'), 'a frame name')}"
    return ""


def _group_id(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    first = group[0] if isinstance(group, (list, tuple)) and group else entry.get("pg_id", "0")
    if type(first) is int:
        return str(_count(first, "a process group id"))
    return _text(first, "a process group id")


def parse_dump(data: dict[str, Any], rank: int, path: Path) -> RankTrace:
    """The parts of a dump `summarize` compares; DistributedError for a field torch does not write
    that way. The work is one pass over the dump's distinct objects."""
    reader = _Reader()
    collectives = []
    enqueued: dict[str, int] = {}
    completed: dict[str, int] = {}
    try:
        for index, entry in enumerate(data.get("entries", [])):
            if not isinstance(entry, dict) or not reader.once(entry):
                continue
            p2p = entry.get("is_p2p") is True
            op = _text(entry.get("profiling_name", "?"), f"entries[{index}].profiling_name").split(":", 1)[-1]
            seq = _count(entry.get("p2p_seq_id" if p2p else "collective_seq_id"), f"entries[{index}]'s sequence id")
            collectives.append(Collective(seq=seq, op=op, group=_group_id(entry),
                                          state=_text(entry.get("state", "?"), f"entries[{index}].state"),
                                          sizes=reader.sizes(entry.get("input_sizes")),
                                          where=reader.where(entry.get("frames"))))
        status_table = data.get("pg_status") or {}
        if not isinstance(status_table, dict):
            raise _Bad(f"pg_status is a {type(status_table).__name__}, not a dict")
        for group_id, status in status_table.items():
            if isinstance(status, dict):
                key = str(_count(group_id, "a pg_status key")) if type(group_id) is int else \
                    _text(group_id, "a pg_status key")
                enqueued[key] = _count(status.get("last_enqueued_collective"), f"pg_status[{key!r}]")
                completed[key] = _count(status.get("last_completed_collective"), f"pg_status[{key!r}]")
    except _Bad as exc:
        raise DistributedError(f"{path} is not a flight recorder dump as torch writes it: {exc}. {_FIX}") from None
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
        for s in self.stuck[:_MAX_SHOWN]:
            behind = ", ".join(f"rank {r} (last entered #{seq})" for r, seq in sorted(s["behind"].items()))
            where = f", called at {s['where']}" if s.get("where") else ""
            lines.append(f"{behind} never entered {s['op']} #{s['seq']} of process group {s['group']} "
                         f"(input sizes {s['sizes']}{where}), which rank(s) {s['entered']} entered and waited in.")
        if len(self.stuck) > _MAX_SHOWN:
            lines.append(f"({len(self.stuck) - _MAX_SHOWN} more process groups have a rank behind.)")
        return " ".join(lines) + " Fix: look at what those ranks were doing instead (their log; py-spy dump " \
                                 "--pid); every rank must call the same collectives in the same order."


def summarize(traces: list[RankTrace]) -> HangSummary:
    """Compare the ranks' dumps: per group, the first collective some rank entered and another never did."""
    stuck = []
    index: dict[int, dict[tuple[str, int], Collective]] = {}
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
        if ahead.rank not in index:  # by (group, seq), built once per rank: one scan, not one per group
            index[ahead.rank] = {}
            for c in ahead.collectives:
                index[ahead.rank].setdefault((c.group, c.seq), c)
        op = index[ahead.rank].get((group, missed))
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
