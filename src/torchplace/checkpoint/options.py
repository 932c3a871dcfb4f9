"""How one load, inspect or convert reads: one frozen record, made once, handed to the reader that takes the path."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReadOptions:
    """What every reader needs to know besides the path (see `reading.kind_of` for who picks the reader)."""

    device: torch.device | None = None  # where tensors go; None: the model's own devices, else the CPU
    trust_pickle: bool = False  # allow what only pickle rebuilds, which runs code from the file
    workers: int | None = None  # reader threads of a torchplace file; None: stream.load_workers decides

    @property
    def map_location(self) -> torch.device:
        """Where torch.load puts another tool's tensors: DEVICE, or the CPU."""
        return self.device or torch.device("cpu")


PLAIN = ReadOptions()  # the CPU, no pickle, threads as load_workers decides
