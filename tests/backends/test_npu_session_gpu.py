"""The npu tests that also need CUDA (tests/backends/on_npu_*_gpu.py), in a session of their own."""

from __future__ import annotations

import pytest
from backends.test_npu_session import _run


@pytest.mark.gpu
def test_npu_suite_gpu_parts(child_env):
    """A checkpoint saved from npu:1 loads onto cuda:0, with npu registered beside CUDA."""
    done = _run(child_env, "-m", "gpu")
    assert done.returncode == 0, f"npu suite (gpu) failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
