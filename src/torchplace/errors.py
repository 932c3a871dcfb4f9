"""One exception hierarchy and one warning hierarchy for torchplace.

Every message says what was asked, what exists, and how to fix it. Each class lives here; the
modules that raise them re-export theirs (`torchplace.memory.MemoryLeakError`, ...).

    TorchplaceError
    ├── DeviceError (ValueError)            a device spec that cannot be satisfied here
    ├── DeviceMismatchError (RuntimeError)  an operation mixing devices, with the culprit named
    ├── DeviceLeakError (RuntimeError)      code changed the current device and did not restore it
    ├── CheckpointError (RuntimeError)      a checkpoint that is torn, corrupt or unsafe to open
    ├── DistributedError (RuntimeError)     a launch environment or process group that cannot work
    ├── LeaseError (RuntimeError)           GPUs that could not be picked or leased in time
    ├── SnapshotError (ValueError)          a topology snapshot that cannot be read
    ├── PrecisionError (RuntimeError)       a precision the device cannot run, or autocast that did nothing
    └── MemoryLeakError (RuntimeError)      memory that grew across steps (track_memory under strict mode)

    TorchplaceWarning (UserWarning)
    ├── StrictWarning                       a device mistake strict mode reports as a warning
    ├── DeviceLeakWarning                   a changed current device that torchplace restored
    ├── PrecisionWarning                    a precision that works but wastes speed or falls back
    └── MemoryLeakWarning                   a probable leak found by track_memory

`warnings.filterwarnings("error", category=TorchplaceWarning)` turns every one into an error.
"""

from __future__ import annotations


class TorchplaceError(Exception):
    """Root of every error torchplace raises on purpose."""


class DeviceError(TorchplaceError, ValueError):
    """A device was requested that does not exist or cannot be used here."""


class DeviceMismatchError(TorchplaceError, RuntimeError):
    """An operation received tensors on different devices."""


class DeviceLeakError(TorchplaceError, RuntimeError):
    """A function changed the current device and did not restore it."""


class CheckpointError(TorchplaceError, RuntimeError):
    """A checkpoint is truncated, corrupted, or needs unsafe loading."""


class DistributedError(TorchplaceError, RuntimeError):
    """The distributed environment is inconsistent or a collective failed."""


class LeaseError(TorchplaceError, RuntimeError):
    """GPUs could not be picked or leased."""


class SnapshotError(TorchplaceError, ValueError):
    """A topology snapshot file is missing, unreadable or of an unknown schema."""


class PrecisionError(TorchplaceError, RuntimeError):
    """A precision was requested that the device cannot run natively, or autocast did nothing."""


class MemoryLeakError(TorchplaceError, RuntimeError):
    """Memory grew across steps beyond the tolerance, or graph-holding tensors piled up."""


class TorchplaceWarning(UserWarning):
    """Root of every warning torchplace issues."""


class StrictWarning(TorchplaceWarning):
    """A device mistake that torchplace.strict() reports as a warning (action="warn")."""


class DeviceLeakWarning(TorchplaceWarning):
    """Code changed the current device and did not restore it (torchplace restored it)."""


class PrecisionWarning(TorchplaceWarning):
    """A precision choice that works but wastes speed or silently falls back to float32."""


class MemoryLeakWarning(TorchplaceWarning):
    """A probable leak found by `track_memory` (raised as MemoryLeakError under strict mode)."""
