"""Many GPUs, many users: picking free GPUs with leases, launching jobs, and process groups.

- `pick`: choose GPUs from NVML facts (never CUDA) and lease them to this process; the choice
  itself (`PickRequest`, ranking) is the pure `torchplace.policy.ranking`.
- `leases`: flock-based leases in a directory shared by all users of the machine: the folder's
  trust checks, the holder notes, the leases.
- `run`: `torchplace run`, which picks, leases, sets CUDA_VISIBLE_DEVICES and hands over to
  the command or to torchrun (torch.distributed.run).
- `group`: `torchplace.dist`: init from torchrun/SLURM, health check, stragglers, teardown;
  `group_state` holds the record of the group it made, `join` the validated join and its
  attempts (each start of the group after a torchrun restart gets its own store keys).
- `flight_recorder`: torch's flight recorder turned on, its dumps read without unpickling code,
  and the rank that never entered a collective named.

Submodules load on use; importing this package imports neither torch nor NVML.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """The package's face for other packages: `unleased_processes` (GPUs used without a lease, for doctor)."""
    if name == "unleased_processes":
        from .leases import unleased_processes

        return unleased_processes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
