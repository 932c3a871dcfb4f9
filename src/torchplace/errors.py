"""One exception hierarchy for torchplace.

Every message says what was asked, what exists, and how to fix it.

    TorchplaceError
    ├── DeviceError (ValueError)            a device spec that cannot be satisfied here
    ├── DeviceMismatchError (RuntimeError)  an operation mixing devices, with the culprit named
    ├── DeviceLeakError (RuntimeError)      code changed the current device and did not restore it
    ├── CheckpointError (RuntimeError)      a checkpoint that is torn, corrupt or unsafe to open
    ├── DistributedError (RuntimeError)     a launch environment or process group that cannot work
    ├── LeaseError (RuntimeError)           GPUs that could not be picked or leased in time
    └── SnapshotError (ValueError)          a topology snapshot that cannot be read
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
