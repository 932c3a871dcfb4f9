"""Doctor checks for a process inside a container: which host GPUs it was given, how NVIDIA_VISIBLE_DEVICES
and CUDA_VISIBLE_DEVICES combine, and the two classic faults (no GPU given; a host's value applied inside)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import Finding, check

if TYPE_CHECKING:
    from ..hardware.facts import Facts

_GIVE_GPUS = ("Start the container with --gpus all (or --gpus '\"device=0,1\"'; Kubernetes: a "
              "nvidia.com/gpu limit), with the NVIDIA Container Toolkit set up on the host")


def _where(facts: Facts) -> str | None:
    kind, given = facts.host.container, facts.env.get("NVIDIA_VISIBLE_DEVICES")
    if kind is None and given is None:
        return None
    return f"a {kind} container" if kind else "a container (NVIDIA_VISIBLE_DEVICES is set)"


@check
def check_container(facts: Facts) -> list[Finding]:
    """In a container: the GPUs it was given by their host ids, or why it has none."""
    where = _where(facts)
    if where is None:
        return []
    given = facts.env.get("NVIDIA_VISIBLE_DEVICES")
    gpus = facts.topology.gpus
    if not gpus:
        if given is not None and given.strip().lower() in ("", "none", "void"):
            return [Finding("container.no_gpu", "warning", f"This runs in {where} that was given no GPU",
                            f"NVIDIA_VISIBLE_DEVICES={given!r} tells the NVIDIA Container Toolkit to give it none.",
                            f"{_GIVE_GPUS}.")]
        why = facts.topology.nvml_error or "NVML lists no GPU"
        wants_gpu = facts.versions.torch_cuda is not None  # with a CPU-only torch, a GPU-less container is the plan
        # seen in a real docker container: `docker run -e NVIDIA_VISIBLE_DEVICES=0` without --gpus gives nothing
        unread = (f" NVIDIA_VISIBLE_DEVICES={given!r} is set, but only the NVIDIA Container Toolkit reads it, on the "
                  "host, as the container starts: passed with `docker run -e` and no --gpus (or set inside), it "
                  "gives no GPU.") if given else ""
        return [Finding("container.no_gpu", "warning" if wants_gpu else "info",
                        f"This runs in {where}, and no GPU is visible in it",
                        f"{why}. A container sees GPUs only when its engine was told to give them.{unread}",
                        f"{_GIVE_GPUS}; `nvidia-smi` inside the container should then list them.")]
    ids = "; ".join(f"GPU {g.physical_index} = {g.uuid} at {g.pci_bus_id or '?'}" for g in gpus)
    chose = f"NVIDIA_VISIBLE_DEVICES={given!r} chose them on the host; " if given is not None else ""
    return [Finding("container.gpus", "info", f"This runs in {where}: GPU numbers are the container's",
                    f"NVML numbers the {len(gpus)} GPU(s) the container was given from 0, which need not be the "
                    f"host's numbers; UUID and bus id mean the same on both sides: {ids}. {chose}"
                    f"CUDA_VISIBLE_DEVICES then picks among the container's numbers (0..{len(gpus) - 1}).",
                    "Nothing to do; to name a GPU the same inside and outside, use its UUID.")]


@check
def check_host_value_inside(facts: Facts) -> list[Finding]:
    """A CUDA_VISIBLE_DEVICES that names more GPUs than the container has: a value meant for the host."""
    vis, gpus = facts.visible, facts.topology.gpus
    if _where(facts) is None or not gpus or vis.cuda_visible_devices is None or not vis.stopped_at:
        return []
    if "out of range" not in vis.stopped_at:  # an ordinal past the container's GPUs, not a typo
        return []
    return [Finding("container.host_cvd", "warning", "CUDA_VISIBLE_DEVICES looks written for the host",
                    f"CUDA_VISIBLE_DEVICES={vis.cuda_visible_devices!r} in a container of {len(gpus)} GPU(s) "
                    f"stops at {vis.stopped_at}: inside, the given GPUs are numbered 0..{len(gpus) - 1}.",
                    "Give the host's GPUs with NVIDIA_VISIBLE_DEVICES (docker --gpus '\"device=N\"') and "
                    "leave CUDA_VISIBLE_DEVICES unset inside, or use UUIDs.")]
