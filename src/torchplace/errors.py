"""One exception hierarchy and one warning hierarchy for torchplace.

Every message says what was asked, what exists, and how to fix it. Each class lives here; the
modules that raise them re-export theirs (`torchplace.memory.MemoryLeakError`, ...).

    TorchplaceError
    ├── DeviceError (ValueError)            a device spec that cannot be satisfied here
    ├── DeviceMismatchError (RuntimeError)  an operation mixing devices, with the culprit named
    ├── MetaTensorError (NotImplementedError) a meta tensor (a shape, no data) used for its data, named
    ├── DeviceLeakError (RuntimeError)      code changed the current device and did not restore it
    ├── CheckpointError (RuntimeError)      a checkpoint that is torn, corrupt or unsafe to open
    │   └── CheckpointFormatError           a checkpoint written by a newer torchplace (a format it cannot read)
    ├── DistributedError (RuntimeError)     a launch environment or process group that cannot work
    ├── LeaseError (RuntimeError)           GPUs that could not be picked or leased in time
    ├── SnapshotError (ValueError)          a topology snapshot that cannot be read
    ├── PrecisionError (RuntimeError)       a precision the device cannot run, or autocast that did nothing
    ├── MemoryLeakError (RuntimeError)      memory that grew across steps (track_memory under strict mode)
    └── PackingError (RuntimeError)         a packed batch whose worker slot this process never received

    TorchplaceWarning (UserWarning)
    ├── StrictWarning                       a device mistake strict mode reports as a warning
    ├── DeviceLeakWarning                   a changed current device that torchplace restored
    ├── PrecisionWarning                    a precision that works but wastes speed or falls back
    ├── MemoryLeakWarning                   a probable leak found by track_memory
    └── PackingWarning                      tensors packed_collate left out of a batch's one buffer, or slots
                                            it could not use

`warnings.filterwarnings("error", category=TorchplaceWarning)` turns every one into an error.
"""

from __future__ import annotations


class TorchplaceError(Exception):
    """Root of every error torchplace raises on purpose.

    Every message says what was asked, what exists, and the fix, in one sentence or three. Each
    subclass also derives from the built-in exception a caller would expect (`DeviceError` is a
    `ValueError`, `CheckpointError` a `RuntimeError`), so existing `except` clauses keep working.

    Example:
        ```python
        import torchplace as tp

        try:
            tp.device("cuda:7")
        except tp.TorchplaceError as err:  # any error torchplace raised on purpose
            print(err)
        ```
    """


class DeviceError(TorchplaceError, ValueError):
    """A device was requested that does not exist or cannot be used here (also a `ValueError`).

    Raised by `torchplace.device`, `to_device`, `on`, `place`, `DeviceLoader` and `setup` for a
    spec that cannot be met: the message lists the devices that exist, with their physical ids.

    Example:
        ```python
        import torchplace as tp

        try:
            tp.device("cuda:7")
        except tp.DeviceError as err:
            print(err)  # cuda:7 requested, but ...: what is visible and the fix
        ```
    """


class DeviceMismatchError(TorchplaceError, RuntimeError):
    """An operation received tensors on different devices (also a `RuntimeError`).

    Raised inside `torchplace.strict()` and `torchplace.watch()` in place of PyTorch's "Expected
    all tensors to be on the same device": it names the module path, the parameter or input and
    the devices involved.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(4, 2)
        try:
            with tp.watch(model):
                model(torch.ones(1, 4, device="meta"))  # weights on cpu, input on meta
        except tp.DeviceMismatchError as err:
            print(err)
        ```
    """


class MetaTensorError(TorchplaceError, NotImplementedError):
    """A tensor on the meta device (a shape and a dtype, no data) was used for its data (also a
    `NotImplementedError`, as PyTorch's own, and so a `RuntimeError`).

    Raised inside `torchplace.strict()` and `torchplace.watch()` in place of PyTorch's "Cannot copy
    out of meta tensor; no data!" (`.to()`, `.cpu()`, `.tolist()`) or "Tensor.item() cannot be called
    on meta tensors": it names the meta tensors (`model.lm_head.weight is on meta`), the line, why they
    are on meta (a model built under `torch.device("meta")` or `init_empty_weights` whose weights were
    never loaded) and the fix (`torchplace.load(path, model=model)`).

    Example:
        ```python
        import torch
        import torchplace as tp

        with torch.device("meta"):
            model = torch.nn.Linear(4, 2)  # shapes only: the weights were never loaded
        try:
            with tp.watch(model):
                model.to("cpu")
        except tp.MetaTensorError as err:
            print(err)
        ```
    """


class DeviceLeakError(TorchplaceError, RuntimeError):
    """A function changed the current device and did not restore it (also a `RuntimeError`).

    Raised by `torchplace.guard(action="raise")` (and by `strict()`'s leak check) after the previous
    device has been restored.

    Example:
        ```python
        import torchplace as tp

        @tp.guard(action="raise")
        def step(batch):
            ...  # a torch.cuda.set_device(1) here, never undone, raises DeviceLeakError

        step(None)
        ```
    """


class CheckpointError(TorchplaceError, RuntimeError):
    """A checkpoint is truncated, corrupted, or needs unsafe loading (also a `RuntimeError`).

    Raised by `torchplace.save` when a file cannot be written completely (the previous file is left
    untouched) and by `torchplace.load` for a torn or damaged file, a checksum mismatch, keys that
    do not fit the model, a missing path, or a file that needs pickle without `trust_pickle=True`.

    Example:
        ```python
        import torchplace as tp

        try:
            tp.load("no-such-checkpoint.safetensors")
        except tp.CheckpointError as err:
            print(err)  # ... does not exist. Fix: ...
        ```
    """


class CheckpointFormatError(CheckpointError):
    """A checkpoint whose format version is newer than this torchplace reads (a `CheckpointError`).

    Raised by `torchplace.load` for such a file, and for a directory holding one, since this
    torchplace cannot tell whether it is the newest checkpoint there. The fix is to upgrade torchplace.
    """


class DistributedError(TorchplaceError, RuntimeError):
    """The distributed environment is inconsistent or a collective failed (also a `RuntimeError`).

    Raised by `torchplace.dist.init` for a launch environment that cannot work (a rank outside the
    world size, ranks that never join), by `health_check` and `stragglers` naming the ranks that
    did not answer, and by `dist.explained()` for a known failure, rewritten with its fix.

    Example:
        ```python
        import torchplace as tp

        try:
            tp.dist.init(env={"RANK": "3", "WORLD_SIZE": "2"})  # rank 3 of a world of 2
        except tp.DistributedError as err:
            print(err)
        ```
    """


class LeaseError(TorchplaceError, RuntimeError):
    """GPUs could not be picked or leased (also a `RuntimeError`).

    Raised by `torchplace.pick` (and `torchplace run`) when the request cannot be met within its
    wait; the message lists every GPU and why it was passed over.

    Example:
        ```python
        import torchplace as tp

        try:
            tp.pick(4, snapshot="h200x2", lease=False)  # 2 GPUs there
        except tp.LeaseError as err:
            print(err)
        ```
    """


class SnapshotError(TorchplaceError, ValueError):
    """A topology snapshot file is missing, unreadable or of an unknown schema (also a `ValueError`).

    Raised wherever a snapshot is accepted: `read_facts(snapshot=...)`, `visible_devices`,
    `pick(snapshot=...)` and every `--snapshot` option of the CLI.

    Example:
        ```python
        import torchplace as tp

        try:
            tp.read_facts(snapshot="no-such-snapshot.json")
        except tp.SnapshotError as err:
            print(err)
        ```
    """


class PrecisionError(TorchplaceError, RuntimeError):
    """A precision was requested that the device cannot run natively, or autocast did nothing."""


class MemoryLeakError(TorchplaceError, RuntimeError):
    """Memory grew across steps beyond the tolerance, or graph-holding tensors piled up."""


class PackingError(TorchplaceError, RuntimeError):
    """A batch packed into a DataLoader worker's slot reached a process that never received that slot."""


class TorchplaceWarning(UserWarning):
    """Root of every warning torchplace issues (a `UserWarning`).

    Subclasses: `StrictWarning`, `DeviceLeakWarning`, `PrecisionWarning`, `MemoryLeakWarning`.
    Filter on this class to silence them all, or to turn them all into errors.

    Example:
        ```python
        import warnings
        import torchplace as tp

        warnings.filterwarnings("error", category=tp.TorchplaceWarning)  # every one an error
        ```
    """


class StrictWarning(TorchplaceWarning):
    """A device mistake that torchplace.strict() reports as a warning (action="warn")."""


class DeviceLeakWarning(TorchplaceWarning):
    """Code changed the current device and did not restore it (torchplace restored it)."""


class PrecisionWarning(TorchplaceWarning):
    """A precision choice that works but wastes speed or silently falls back to float32."""


class MemoryLeakWarning(TorchplaceWarning):
    """A probable leak found by `track_memory` (raised as MemoryLeakError under strict mode)."""


class PackingWarning(TorchplaceWarning):
    """Tensors `packed_collate` could not pack into a batch's buffer (they are copied one by one), or
    worker slots it could not use (batches are then copied into pinned memory, as without slots)."""
