"""Run-time policies: decisions about precision, CPU threads and determinism.

Each policy is computed by a pure function from facts (a compute capability, the CPUs this
process may use, the local world size) so it can be tested, and planned, without the hardware.
Applying a policy touches only torch's own global settings; torchplace keeps no state of its own.

- `precision.py`: `precision_for(device)` -> dtype, GradScaler, TF32, and a checked autocast.
- `threads.py`: `configure_threads(...)` -> intra/inter-op threads, OMP/MKL variables, NUMA binding.
- `determinism.py`: `seed_everything(seed)` and `deterministic(True)`.
"""

from __future__ import annotations



def strict_enabled(explicit: bool | None = None) -> bool:
    """Should a policy problem raise? An explicit argument wins; else strict mode decides.

    Strict mode is whatever `torchplace.strict` / `setup(strict=...)` / TORCHPLACE_STRICT turned
    on (one parser, in checks.strict): problems raise when its action is "error", warn otherwise.
    """
    if explicit is not None:
        return explicit
    from ..checks.strict_config import active

    config = active()
    return config is not None and config.autocast == "error"
