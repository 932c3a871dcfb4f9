"""Many GPUs, many users: picking free GPUs with leases, launching jobs, and process groups.

- `pick`: choose GPUs from NVML facts (never CUDA) and lease them to this process.
- `lease`: flock-based leases in a directory shared by all users of the machine.
- `run`: `torchplace run`, which picks, leases, sets CUDA_VISIBLE_DEVICES and hands over to
  the command or to torchrun (torch.distributed.run).
- `group`: `torchplace.dist`: init from torchrun/SLURM, health check, stragglers, teardown.

Submodules load on use; importing this package imports neither torch nor NVML.
"""
