"""All facts about this machine in one record, and the snapshot file format that holds them.

A snapshot is `Facts.to_dict()` as JSON: the topology's keys at top level (so the issue's
minimum schema `{"gpus": [...]}` is a valid snapshot) plus "host", "versions" and "env".
Reading from a snapshot keeps this process's environment variables, so a user can ask what
`CUDA_VISIBLE_DEVICES=...` would do on the captured machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .. import safeio
from ..errors import SnapshotError
from .host import HostFacts, read_host
from .snapshot import HOST_KEYS, SNAPSHOT_FIX, load_snapshot, upgrade
from .topology import Topology, read_topology
from .versions import Versions, read_versions
from .visible import VisibleMap, map_visible

# OMPI_/MV2_/PMI_/MPI_LOCAL and NODE_RANK: the launchers of launch.py (doctor reads the job from these)
ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "LOCAL_", "SLURM_", "OMPI_COMM_WORLD_",
                "OMPI_MCA_ess_base_jobid", "MV2_COMM_WORLD_", "PMI_", "MPI_LOCAL")
ENV_NAMES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ACCELERATE_MIXED_PRECISION", "NODE_RANK", "NVIDIA_VISIBLE_DEVICES")


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that decide device behaviour."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


@dataclass
class Facts:
    """Everything torchplace knows about a machine, read without starting CUDA.

    The record `read_facts` returns and `torchplace doctor` reports on: the GPU topology from NVML
    (`topology`), the host (CPUs, affinity, cgroup limits, memory, shared memory: `host`), library
    and driver versions (`versions`), the environment variables that matter (`env`) and the
    physical <-> `cuda:N` mapping under `CUDA_VISIBLE_DEVICES` (`visible`).

    Attributes:
        topology: GPUs (physical index, UUID, name, memory in bytes, MIG) and their links.
        host: CPU and memory facts of this process's view of the machine.
        versions: Python, torch, CUDA runtime and driver versions.
        env: the device-related environment variables that were set.
        visible: the visible-device map; built from `env` and `topology` when not given.

    Example:
        ```python
        import torchplace as tp

        facts = tp.read_facts(snapshot="h200x2")
        print(facts.source, len(facts.topology.gpus), "GPUs")
        data = facts.to_dict()  # what `torchplace doctor --json` prints; a valid snapshot
        ```
    """

    topology: Topology
    host: HostFacts
    versions: Versions
    env: dict[str, str] = field(default_factory=dict)
    visible: VisibleMap = None  # type: ignore[assignment]  # None only until __post_init__ builds it

    def __post_init__(self) -> None:
        if self.visible is None:
            self.visible = map_visible(self.env.get("CUDA_VISIBLE_DEVICES"), self.topology,
                                       self.env.get("CUDA_DEVICE_ORDER"))

    @property
    def source(self) -> str:
        return self.topology.source

    def to_dict(self) -> dict[str, Any]:
        return {**self.topology.to_dict(), "host": self.host.to_dict(), "versions": self.versions.to_dict(),
                "env": self.env}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "snapshot",
                  env: dict[str, str] | None = None) -> Facts:
        topology = Topology.from_dict(data, source=source)
        try:
            host = safeio.build(HostFacts, upgrade(data.get("host") or {}, HOST_KEYS), "host")
            versions = safeio.build(Versions, data.get("versions") or {}, "versions")
        except ValueError as exc:
            raise SnapshotError(f"{source}: malformed snapshot ({exc}). {SNAPSHOT_FIX}") from None
        return cls(topology, host, versions, relevant_env(env))


def read_facts(snapshot: str | os.PathLike[str] | None = None) -> Facts:
    """Read this machine's facts, or a snapshot's, without starting CUDA.

    NVML, /proc and the cgroup files are read; CUDA is never initialized, so this is safe before
    `CUDA_VISIBLE_DEVICES` is fixed and before a fork.

    Args:
        snapshot: a JSON file written by `torchplace doctor --json`, or the name of a reference
            snapshot shipped with torchplace ("h200x2"; an unknown name lists them); its hardware is read with this
            process's environment (so `CUDA_VISIBLE_DEVICES` can be tried against another
            machine). None reads this machine.

    Returns:
        The `Facts` record.

    Raises:
        SnapshotError: the snapshot is missing, unreadable or of an unknown schema.

    Example:
        ```python
        import torchplace as tp

        facts = tp.read_facts()  # this machine; GPUs are listed only where NVML answers
        print(facts.host.cpu_count, "CPUs,", len(facts.topology.gpus), "GPUs")
        ```
    """
    if snapshot is not None:
        return Facts.from_dict(load_snapshot(snapshot), source=str(snapshot))
    return Facts(read_topology(), read_host(), read_versions(), relevant_env())
