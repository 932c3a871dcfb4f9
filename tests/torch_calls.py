"""Watch which tensors torch is asked to `record_stream`, through torch's own function-mode hook.

Shared by the CPU and GPU tests of `torchplace.placement.transfer.record_stream` (tests/ is on
pythonpath). Every other torch call runs as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class RecordStreamCalls(TorchFunctionMode):
    """Inside `with RecordStreamCalls() as calls:`, `calls.marked` lists (tensor, stream) per call.

    With run=False the call itself is left out: a CPU machine has no stream to mark, so tests
    there use meta tensors (a device other than the host) and only watch what would be marked.
    """

    def __init__(self, run: bool = True) -> None:
        super().__init__()
        self.run = run
        self.marked: list[tuple[torch.Tensor, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.record_stream:
            self.marked.append((args[0], args[1] if len(args) > 1 else kwargs.get("s")))
            if not self.run:
                return None
        return func(*args, **kwargs)
