"""Placement: device scopes, moving data and modules, and the DeviceLoader.

- `scope.py`: `on(device)` makes a device current for a block; `guard` catches leaked changes;
- `transfer.py`: `to_device` (any nested batch), `pin`, `record_stream`;
- `split.py`: `place` puts submodules on named devices;
- `loader.py`: `DeviceLoader`, batches already on the device; its engine is private: `collate.py`
  (`packed_collate`, `pack`) with `_pack`, `_build`, `_slots`, `_inline`, `_stage`, `_hostcopy`, `_fork`.

Names load on first use (PEP 562), so importing one module of the package does not import them all.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "on": "scope", "guard": "scope", "Guard": "scope",
    "to_device": "transfer", "target_device": "transfer", "pin": "transfer", "pin_tensor": "transfer",
    "record_stream": "transfer",
    "place": "split", "Placement": "split",
    "DeviceLoader": "loader", "image_transform": "loader",
    "packed_collate": "collate", "PackedBatch": "collate", "PackedCollate": "collate", "pack": "collate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchplace.placement' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

