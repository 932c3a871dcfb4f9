"""torchplace: know where every tensor lives.

Explicit, validated, fast and portable device handling for PyTorch. The public API is flat:
`torchplace.device("cuda:1")`, `torchplace.to_device(batch, dev)`, `torchplace.save(...)`.

Names load on first use (PEP 562), so `import torchplace` and the CLI's fact-reading commands
stay fast and never import torch or start CUDA until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # errors
    "TorchplaceError": "torchplace.errors",
    "DeviceError": "torchplace.errors",
    "DeviceMismatchError": "torchplace.errors",
    "DeviceLeakError": "torchplace.errors",
    "CheckpointError": "torchplace.errors",
    "DistributedError": "torchplace.errors",
    "LeaseError": "torchplace.errors",
    "SnapshotError": "torchplace.errors",
    "TorchplaceWarning": "torchplace.errors",
    # facts
    "Facts": "torchplace.hardware.facts",
    "read_facts": "torchplace.hardware.facts",
    "visible_devices": "torchplace.hardware.visible",
    # placement: resolve and scope (issue 2)
    "device": "torchplace.placement.resolve",
    "on": "torchplace.placement.scope",
    "guard": "torchplace.placement.scope",
    # placement: moving data (issue 3)
    "to_device": "torchplace.placement.transfer",
    "DeviceLoader": "torchplace.placement.loader",
    "place": "torchplace.placement.split",
    # checks (issue 4)
    "strict": "torchplace.checks.strict",
    "watch": "torchplace.checks.watch",
    "explain": "torchplace.checks.explain",
    # checkpoints (issue 5)
    "save": "torchplace.checkpoint.saving",
    "load": "torchplace.checkpoint.loading",
    # many GPUs (issue 6)
    "pick": "torchplace.distributed.pick",
    # policies (issue 7)
    "precision_for": "torchplace.amp",
    "configure_threads": "torchplace.policy.threads",
    "seed_everything": "torchplace.policy.determinism",
    "deterministic": "torchplace.policy.determinism",
    "memory_report": "torchplace.memory",
    "track_memory": "torchplace.memory",
    "diagnose_oom": "torchplace.memory",
    "find_batch_size": "torchplace.memory",
    # the program's entry (issue 8)
    "setup": "torchplace.runtime",
    "Runtime": "torchplace.runtime",
}
# public submodules reachable as attributes
_SUBMODULES = {"dist": "torchplace.distributed.group"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(_SUBMODULES[name])
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'torchplace' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


def _strict_from_env() -> None:
    """TORCHPLACE_STRICT=1|warn|error[,factories][,syncs] turns strict mode on for the whole program."""
    import os

    if os.environ.get("TORCHPLACE_STRICT", "").strip() not in ("", "0"):
        from .checks.strict import enable_from_env
        from .errors import TorchplaceError

        try:
            enable_from_env()
        except TorchplaceError as exc:
            if not _started_as_cli():
                raise
            from . import cli  # the command reports it as one line (exit 2) instead of an import traceback

            cli.STARTUP_ERROR = exc


def _started_as_cli() -> bool:
    """True when this import is the `torchplace` command's (console script or `python -m torchplace`)."""
    import os
    import sys

    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchplace":
        return True
    return any(a == "-mtorchplace" or (a == "-m" and argv[i + 1:i + 2] == ["torchplace"])
               for i, a in enumerate(argv))


_strict_from_env()


if TYPE_CHECKING:  # static checkers see the real objects
    from .errors import (CheckpointError, DeviceError, DeviceLeakError, DeviceMismatchError,  # noqa: F401
                         DistributedError, LeaseError, SnapshotError, TorchplaceError, TorchplaceWarning)
    from .placement.resolve import device  # noqa: F401
    from .placement.scope import guard, on  # noqa: F401
