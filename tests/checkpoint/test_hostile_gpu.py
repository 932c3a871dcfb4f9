"""Crafted RNG states restored onto a real GPU: skipped with the reason, never an exception from load.

The device generator is only restored where the device exists, so these run on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from torchplace.checkpoint import rng

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("saved_device", ["cuda:x", "cuda:" + "9" * 5000, "cuda:-1", "cuda:99", None])
def test_a_crafted_saved_device_restores_this_gpu_from_a_state_that_exists(saved_device: str | None) -> None:
    """'cuda:x' as the recorded device raised ValueError (int('x')) out of load on a CUDA machine."""
    state = torch.cuda.get_rng_state(0)
    restored, skipped = rng.restore({"cuda": [state]}, torch.device("cuda:0"), saved_device)
    assert restored and restored[0].startswith("cuda:0"), (restored, skipped)


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(5, dtype=torch.uint8)], ids=["float", "short"])
def test_a_crafted_generator_state_is_skipped_with_the_reason(bad: torch.Tensor) -> None:
    """A float tensor or a few bytes as the CUDA generator state: torch's RuntimeError escaped load."""
    before = torch.cuda.get_rng_state(0)
    restored, skipped = rng.restore({"cuda": [bad]}, torch.device("cuda:0"), "cuda:0")
    assert restored == [] and "not a CUDA generator state" in skipped["cuda:0"], (restored, skipped)
    assert torch.equal(torch.cuda.get_rng_state(0), before)
