"""The process-wide record of the group torchplace.dist made (one per process, like torch's own):
`DistInfo`, the lock and state `init` and `teardown` share, and `require()`."""

from __future__ import annotations

import datetime as _dt
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..hardware.launch import LaunchEnv


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job; `torchplace.dist.init()` returns it.

    Attributes:
        rank: this process's global rank.
        world_size: how many processes the job has.
        local_rank: the rank on this node (None without a launcher that sets it).
        local_world_size: processes on this node.
        device: this rank's indexed torch.device (`cuda:LOCAL_RANK`, or cpu).
        backend: the process group's backend ("cpu:gloo,cuda:nccl", "gloo", ...).
        launcher: "torchrun", "slurm", ... or None for a plain `python script.py`.
        node_rank: this node's rank, where the launcher says.
        hostname: this host's name.
        adopted: the group was made by another library (Lightning Fabric, Accelerate);
            torchplace only uses it.
        attempt: how many earlier starts of the group this job's rendezvous store saw (0 on the
            first; torchrun's `--max-restarts` makes more), agreed by every rank.
        restarted: the launcher restarted the job's workers, on any node (TORCHELASTIC_RESTART_COUNT
            above 0 on some rank, or a later attempt): `setup()` resumes from a checkpoint then.

    `is_main` is True on rank 0 (log, save checkpoints, print).

    Example:
        ```python
        import torchplace as tp

        with tp.dist.session() as info:  # a group of one without a launcher
            print(info.rank, info.world_size, info.device, info.backend, info.is_main)
        ```
    """

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    device: torch.device
    backend: str
    launcher: str | None
    node_rank: int | None = None
    hostname: str = ""
    adopted: bool = False  # the group was made by another library; torchplace only uses it
    attempt: int = 0  # starts of the group on this rendezvous store before this one (torchrun restarts)
    restarted: bool = False  # the launcher restarted this job's workers (on any node): resume, don't start over

    @property
    def is_main(self) -> bool:
        """True on rank 0 (log, save checkpoints, print)."""
        return self.rank == 0


@dataclass
class _State:
    """What init made: the record, the launch env, torchplace's store namespace, the gloo group."""

    info: DistInfo | None = None
    launch: LaunchEnv | None = None
    store: Any = None  # PrefixStore for torchplace's own keys
    gloo: Any = None  # gloo group for the health check's monitored barrier
    checks: int = 0  # health checks and straggler reports so far (names their store keys)
    broken: bool = False  # a collective timed out: abort rather than destroy at teardown
    atexit_registered: bool = False


STATE = _State()
LOCK = threading.Lock()


def seconds(value: float | _dt.timedelta | None, default: float) -> float:
    """A timeout given as seconds or a timedelta, as seconds (`default` for None)."""
    if value is None:
        return default
    return value.total_seconds() if isinstance(value, _dt.timedelta) else float(value)


def require() -> DistInfo:
    """The current record; raises when torchplace.dist.init() has not made a group."""
    if STATE.info is None or not dist.is_initialized():
        raise DistributedError("No process group: call torchplace.dist.init() first (on every rank).")
    return STATE.info
