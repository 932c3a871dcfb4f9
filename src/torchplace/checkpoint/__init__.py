"""Checkpoints that load anywhere and never tear: `save`, `load`, rotation, inspect and convert.

Modules, bottom up: `format` (the on-disk layout and its checks), `codec` (non-tensor state as
tagged JSON), `stream` (fast, checksummed tensor I/O), `atomic` (temp file, fsync, rename),
`fileio` (one file), `state_dicts` (wrappers, prefixes, versions, devices), `keymap`, `rng`,
`rotation` (keep_last and `latest`), `dcp_reader` (torch.distributed.checkpoint folders read
without running their pickles), `distributed` (rank 0 writes; sharded models through DCP),
`foreign` (torch.save, Lightning, accelerate), `reading`, `inspection`, `conversion`, and
`saving` (save), `background` (save_async, SaveFuture) and `loading` (load, Checkpoint).
"""

from __future__ import annotations

from .background import SaveFuture, save_async
from .conversion import Converted, convert
from .inspection import CheckpointInfo, TensorInfo, inspect
from .loading import Checkpoint, load
from .rotation import complete_checkpoints, latest
from .saving import save

__all__ = ["Checkpoint", "CheckpointInfo", "Converted", "SaveFuture", "TensorInfo", "complete_checkpoints", "convert",
           "inspect", "latest", "load", "save", "save_async"]
