"""Decisions: which device a spec names, and the run-time policies for precision, CPU threads and determinism.

Each policy is computed by a pure function from facts (a compute capability, the CPUs this
process may use, the local world size) so it can be tested, and planned, without the hardware.
A decision takes what it needs as arguments (strict or not included); it never reads the state
of strict mode or of any other action. Applying a policy touches only torch's own global settings.

- `devices.py`: `torchplace.device(spec)`: a device spec -> an indexed torch.device, checked against
  a `Machine` (device counts, the visible map, LOCAL_RANK) read without starting CUDA.
- `precision.py`: the precision plan (dtype, GradScaler, TF32) from a capability; acting on it
  (`precision_for`, autocast, GradScaler) is `torchplace.amp`.
- `threads.py`: `configure_threads(...)` -> intra/inter-op threads, OMP/MKL variables, NUMA binding.
- `determinism.py`: `seed_everything(seed)` and `deterministic(True)`.
"""
