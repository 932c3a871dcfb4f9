"""Makes the shared mistake programs (checks_programs.py) importable by the tests beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _strict_leaves_nothing_behind():
    """Every test must leave torch as it found it: no patches, hooks or default device left over."""
    import torch

    from torchplace.checks import checkpoint, state

    yield
    leftovers = []
    if "to" in vars(torch.Tensor) or "cuda" in vars(torch.Tensor):
        leftovers.append("torch.Tensor.to/cuda still wrapped")
    if torch.nn.Module.__call__ is not torch.nn.Module._wrapped_call_impl:
        leftovers.append("nn.Module.__call__ still wrapped")
    if checkpoint.pending() or torch.nn.modules.module._global_forward_pre_hooks:
        leftovers.append("a module hook is still registered")
    if state.active() is not None:
        leftovers.append("strict mode still active")
    if torch.get_default_device() != torch.device("cpu"):
        torch.set_default_device(None)
        leftovers.append("the default device was left changed")
    if leftovers:
        pytest.fail("; ".join(leftovers))


@pytest.fixture(autouse=True, scope="session")
def _torch_sets_its_cache_dir_once():
    """torch sets TORCHINDUCTOR_CACHE_DIR on its first meta-device op: let that happen before any test."""
    import torch

    torch.ones(1, device="meta") + torch.ones(1, device="meta")
