"""Checkpoints that load anywhere and never tear: `save`, `load`, rotation, inspect and convert.

Modules, bottom up: `codec` (non-tensor state as tagged JSON), `format` (the on-disk layout and its
checks), `stream` (fast, checksummed tensor I/O to and from any device), `atomic` (temp file, fsync,
rename), `fileio` (one file), `state_dicts` (wrappers, prefixes, versions, devices), `keymap`, `rng`,
`rotation` (keep_last, `latest`, the job's mark for resuming), `dcp_reader` (torch.distributed.checkpoint
folders read without running their pickles), `sharded` (rank 0 writes; sharded models through DCP),
`foreign` (torch.save, Lightning, accelerate), `options` (ReadOptions) and `reading` (`kind_of`: what a
path is, decided once; `read_any`), `inspection`, `conversion`, and `saving` (save), `staging` and
`background` (save_async, SaveFuture) and `loading` (load, Checkpoint).
"""

from __future__ import annotations

from .background import SaveFuture, save_async
from .conversion import Converted, convert
from .dcp_reader import read_dcp_metadata as read_dcp_metadata
from .fileio import write_file as write_file
from .format import read_header as read_header
from .inspection import CheckpointInfo, TensorInfo, inspect
from .loading import Checkpoint, load
from .rotation import complete_checkpoints, latest
from .rotation import series_lock as series_lock
from .saving import save
from .staging import HostStaging as HostStaging

__all__ = ["Checkpoint", "CheckpointInfo", "Converted", "SaveFuture", "TensorInfo", "complete_checkpoints", "convert",
           "inspect", "latest", "load", "save", "save_async"]
# re-exported above as `x as x`, outside __all__ (not the public API): the building blocks the tests use
