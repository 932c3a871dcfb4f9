"""Shared fixtures: real snapshots captured on H200 machines, GPU skipping, env hygiene."""

from __future__ import annotations

import os

import pytest
import torch


# set by pytest, or by torch itself on a lazy import (torch._dynamo sets the inductor cache dir)
_NOT_OURS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _no_env_leaks():
    """Fail a test that leaks an environment variable change (Lightning's habit, kept)."""
    before = {k: v for k, v in os.environ.items() if k not in _NOT_OURS}
    yield
    after = {k: v for k, v in os.environ.items() if k not in _NOT_OURS}
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(f"test leaked environment changes: {changed}")


def pytest_collection_modifyitems(config, items):
    """Skip gpu-marked tests cleanly when run on a machine without CUDA."""
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if has_cuda else 0
    except Exception:
        has_cuda, count = False, 0
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture
def restore_threads():
    """Give torch and the environment back their thread settings after the test."""
    env = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
