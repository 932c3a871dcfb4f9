"""Makes the shared mistake programs (checks_programs.py) importable by the tests beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _strict_leaves_nothing_behind(strict_leaves_nothing_behind):
    """Every test here must leave torch as it found it (the check is in tests/conftest.py)."""


@pytest.fixture(autouse=True, scope="session")
def _torch_sets_its_cache_dir_once():
    """torch sets TORCHINDUCTOR_CACHE_DIR on its first meta-device op: let that happen before any test."""
    import torch

    torch.ones(1, device="meta") + torch.ones(1, device="meta")
