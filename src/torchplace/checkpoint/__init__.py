"""Checkpoints that load anywhere and never tear: `save`, `load`, rotation, inspect and convert.

Modules, bottom up: `format` (the on-disk layout and its checks), `codec` (non-tensor state as
tagged JSON), `stream` (fast, checksummed tensor I/O), `atomic` (temp file, fsync, rename),
`fileio` (one file), `state` (wrappers, prefixes, devices), `rng`, `rotation` (keep_last and
`latest`), `distributed` (rank 0 writes; sharded models through torch.distributed.checkpoint),
`foreign` (torch.save, Lightning, accelerate), `inspection`, `conversion`, and `api` (save, load).
"""

from __future__ import annotations

from .api import Checkpoint, load, save
from .conversion import Converted, convert
from .inspection import CheckpointInfo, TensorInfo, inspect
from .rotation import complete_checkpoints, latest

__all__ = ["Checkpoint", "CheckpointInfo", "Converted", "TensorInfo", "complete_checkpoints", "convert", "inspect",
           "latest", "load", "save"]
