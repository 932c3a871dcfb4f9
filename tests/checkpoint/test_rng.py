"""RNG states: what makes sense here is restored, the rest is skipped with the reason."""

from __future__ import annotations

import random

import numpy as np
import torch

from torchplace.checkpoint import rng


def test_cpu_generators_are_restored_exactly() -> None:
    saved = rng.capture()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    restored, skipped = rng.restore(saved, torch.device("cpu"), "cpu")
    assert restored == ["python", "numpy", "cpu"] and skipped == {}
    assert random.random() == expected[0] and float(np.random.rand()) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_cuda_generators_are_skipped_with_the_reason_when_loading_to_the_cpu() -> None:
    state = {"cpu": torch.get_rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2}
    restored, skipped = rng.restore(state, torch.device("cpu"), "cuda:1")
    assert restored == ["cpu"] and set(skipped) == {"cuda:0", "cuda:1"}
    reason = skipped["cuda:1"]
    if torch.cuda.is_available():
        assert "loading onto cpu" in reason and "device='cuda:N'" in reason
    else:
        assert reason == "this machine has no usable CUDA device"


def test_capture_never_starts_cuda() -> None:
    before = torch.cuda.is_initialized()
    state = rng.capture()
    assert torch.cuda.is_initialized() == before
    assert ("cuda" in state) == before
