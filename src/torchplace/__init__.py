"""torchplace: know where every tensor lives.

Explicit, validated, fast and portable device handling for PyTorch. The public API is flat:
`torchplace.device("cuda:1")`, `torchplace.to_device(batch, dev)`, `torchplace.save(...)`.

Names load on first use (PEP 562), so `import torchplace` and the CLI's fact-reading commands
stay fast and never import torch or start CUDA until something needs it.
"""

import importlib as _importlib
import typing as _typing

from ._version import __version__ as __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # errors
    "TorchplaceError": "torchplace.errors",
    "DeviceError": "torchplace.errors",
    "DeviceMismatchError": "torchplace.errors",
    "DeviceLeakError": "torchplace.errors",
    "MetaTensorError": "torchplace.errors",
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
    "device": "torchplace.policy.devices",
    "on": "torchplace.placement.scope",
    "guard": "torchplace.placement.scope",
    # placement: moving data (issue 3)
    "to_device": "torchplace.placement.transfer",
    "DeviceLoader": "torchplace.placement.loader",
    "packed_collate": "torchplace.placement.collate",
    "place": "torchplace.placement.split",
    # checks (issue 4)
    "strict": "torchplace.checks.strict",
    "watch": "torchplace.checks.watch",
    "explain": "torchplace.checks.explain",
    # checkpoints (issue 5)
    "save": "torchplace.checkpoint.saving",
    "load": "torchplace.checkpoint.loading",
    # background saves (issue 17)
    "save_async": "torchplace.checkpoint.background",
    "SaveFuture": "torchplace.checkpoint.background",
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

# The same names, written out so that static tools read them (tests/test_public_api.py checks that
# this list, the run-time table above and the TYPE_CHECKING imports at the end agree).
__all__ = [
    "CheckpointError", "DeviceError", "DeviceLeakError", "DeviceLoader", "DeviceMismatchError", "DistributedError",
    "Facts", "LeaseError", "MetaTensorError", "Runtime", "SaveFuture", "SnapshotError", "TorchplaceError",
    "TorchplaceWarning", "configure_threads", "deterministic", "device", "diagnose_oom", "dist", "explain",
    "find_batch_size", "guard", "load", "memory_report", "on", "packed_collate", "pick", "place", "precision_for",
    "read_facts", "save", "save_async", "seed_everything", "setup", "strict", "to_device", "track_memory",
    "visible_devices", "watch",
]

if not _typing.TYPE_CHECKING:  # hidden from type checkers, so a misspelt name fails type-checking
    def __getattr__(name: str) -> object:
        if name in _SUBMODULES:
            value = _importlib.import_module(_SUBMODULES[name])
        elif name in _EXPORTS:
            value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        else:
            raise AttributeError(f"module 'torchplace' has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """Each public name once, plus the module's own dunders; not the helpers this file imports."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})


#: An error found while `import torchplace` ran for the `torchplace` command (a bad TORCHPLACE_STRICT): the
#: command reports it as one line (exit 2) instead of an import traceback.
_startup_error: Exception | None = None


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
            global _startup_error
            _startup_error = exc


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


if _typing.TYPE_CHECKING:  # static checkers see the real objects; at run time they load on first use
    from .amp import precision_for
    from .checkpoint.background import SaveFuture, save_async
    from .checkpoint.loading import load
    from .checkpoint.saving import save
    from .checks.explain import explain
    from .checks.strict import strict
    from .checks.watch import watch
    from .distributed import group as dist
    from .distributed.pick import pick
    from .errors import (
        CheckpointError,
        DeviceError,
        DeviceLeakError,
        DeviceMismatchError,
        DistributedError,
        LeaseError,
        MetaTensorError,
        SnapshotError,
        TorchplaceError,
        TorchplaceWarning,
    )
    from .hardware.facts import Facts, read_facts
    from .hardware.visible import visible_devices
    from .memory import diagnose_oom, find_batch_size, memory_report, track_memory
    from .placement.collate import packed_collate
    from .placement.loader import DeviceLoader
    from .placement.scope import guard, on
    from .placement.split import place
    from .placement.transfer import to_device
    from .policy.determinism import deterministic, seed_everything
    from .policy.devices import device
    from .policy.threads import configure_threads
    from .runtime import Runtime, setup
