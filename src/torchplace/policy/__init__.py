"""Run-time policies: decisions about precision, CPU threads and determinism.

Each policy is computed by a pure function from facts (a compute capability, the CPUs this
process may use, the local world size) so it can be tested, and planned, without the hardware.
Applying a policy touches only torch's own global settings; torchplace keeps no state of its own.

- `precision.py`: `precision_for(device)` -> dtype, GradScaler, TF32, and a checked autocast.
- `threads.py`: `configure_threads(...)` -> intra/inter-op threads, OMP/MKL variables, NUMA binding.
- `determinism.py`: `seed_everything(seed)` and `deterministic(True)`.
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}


def strict_enabled(explicit: bool | None = None) -> bool:
    """Strict mode: an explicit argument wins, else TORCHPLACE_STRICT=1 (or true/yes/on)."""
    if explicit is not None:
        return explicit
    return os.environ.get("TORCHPLACE_STRICT", "").strip().lower() in _TRUE
