"""How many helper threads a job starts: the core count and the rule the checkpoint streams and the
loader's packing copies share (each caps it by what its job measured best)."""

from __future__ import annotations

import os


def cores() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def helper_threads(nbytes: int, most: int, *, least_bytes: int) -> int:
    """Threads for a job of NBYTES: one below LEAST_BYTES (starting threads would cost more than they
    save), else one a core, at most MOST."""
    return 1 if nbytes < least_bytes else max(1, min(most, cores()))
