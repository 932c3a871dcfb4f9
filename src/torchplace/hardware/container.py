"""Whether this process runs in a container: the marker files the engines leave, the `container`
variable some set, and the cgroup of PID 1. Pure reads under ROOT (tests give a constructed tree).

Inside a container NVML numbers the GPUs the container was given from 0 (its own numbering, not the
host's); NVIDIA_VISIBLE_DEVICES, read by the NVIDIA Container Toolkit on the host, chose them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_MARKERS = ((".dockerenv", "docker"), ("run/.containerenv", "podman"))
_CGROUP_WORDS = (("kubepods", "kubernetes"), ("docker", "docker"), ("containerd", "containerd"), ("lxc", "lxc"),
                 ("libpod", "podman"))


def container_kind(root: str | os.PathLike[str] = "/", environ: Mapping[str, str] | None = None) -> str | None:
    """'docker', 'podman', 'kubernetes', ... when this process runs in a container, else None; never raises."""
    base = Path(root)
    for marker, kind in _MARKERS:
        try:
            if (base / marker).exists():
                return kind
        except OSError:
            continue
    env = os.environ if environ is None else environ
    if env.get("container"):  # systemd-nspawn, podman and LXC set it for PID 1 and its children
        return env["container"][:40]
    try:
        cgroup = (base / "proc/1/cgroup").read_text(errors="replace")[:65536]
    except OSError:
        return None
    return next((kind for word, kind in _CGROUP_WORDS if word in cgroup), None)
