"""Snapshot keys renamed to carry their unit (`memory_total` -> `memory_total_bytes`, `index` -> `physical_index`).

Snapshots and `doctor --json` from before the rename hold the old keys; `upgrade` reads either.
`with_old_keys` writes the old key beside the new one, so scripts reading `doctor --json` and older
torchplace versions (which require `index`) keep working with snapshots written now.
"""

from __future__ import annotations

from typing import Any

GPU = {"index": "physical_index", "memory_total": "memory_total_bytes", "memory_used": "memory_used_bytes",
       "memory_free": "memory_free_bytes"}
MIG = {"memory_total": "memory_total_bytes"}
PROCESS = {"used_memory": "used_memory_bytes"}
HOST = {"memory_total": "memory_total_bytes", "shm_total": "shm_total_bytes", "shm_free": "shm_free_bytes",
        "memlock_soft": "memlock_soft_bytes", "memlock_hard": "memlock_hard_bytes"}
_NESTED = {"mig": MIG, "processes": PROCESS}


def upgrade(data: Any, renames: dict[str, str]) -> Any:
    """A copy of DATA with each old key under its new name (the new key wins); anything not a dict as is."""
    if not isinstance(data, dict):
        return data
    out = {renames.get(k, k): v for k, v in data.items() if not (k in renames and renames[k] in data)}
    for key, nested in _NESTED.items():
        if renames is GPU and isinstance(out.get(key), list):
            out[key] = [upgrade(item, nested) for item in out[key]]
    return out


def with_old_keys(data: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """DATA (written with the new keys) with each old key added after its new one."""
    out: dict[str, Any] = {}
    old_of = {new: old for old, new in renames.items()}
    for key, value in data.items():
        if renames is GPU and key in _NESTED and isinstance(value, list):
            value = [with_old_keys(item, _NESTED[key]) for item in value]
        out[key] = value
        if key in old_of:
            out[old_of[key]] = value
    return out
