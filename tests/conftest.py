"""Shared fixtures: GPU skipping, env hygiene, thread settings, a private lease directory and the CLI
in a subprocess (used by the distributed and bench tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture
def lease_dir(tmp_path, monkeypatch) -> Path:
    """A private lease directory for this test, also set as $TORCHPLACE_LEASE_DIR."""
    path = tmp_path / "leases"
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(path))
    yield path
    from torchplace.distributed.lease import release_all

    release_all()


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a subprocess, without launcher or GPU variables from outside, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "CUDA_VISIBLE_DEVICES") and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(extra)
    return env


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
    """`python -m torchplace ARGS` in a subprocess; `timeout` only guards against a hang."""
    return subprocess.run([sys.executable, "-m", "torchplace", *args], capture_output=True, text=True,
                          env=env if env is not None else child_env(), timeout=timeout, **kwargs)


@pytest.fixture(name="child_env")
def _child_env_fixture():
    """The `child_env` helper, for tests (conftest functions are not importable by name)."""
    return child_env


@pytest.fixture(name="run_cli")
def _run_cli_fixture():
    """The `run_cli` helper."""
    return run_cli


@pytest.fixture
def strict_leaves_nothing_behind():
    """Every test must leave torch as it found it: no patches, hooks or default device left over."""
    from torchplace.checks import deferred, strict_config

    yield
    leftovers = []
    if "to" in vars(torch.Tensor) or "cuda" in vars(torch.Tensor):
        leftovers.append("torch.Tensor.to/cuda still wrapped")
    if torch.nn.Module.__call__ is not torch.nn.Module._wrapped_call_impl:
        leftovers.append("nn.Module.__call__ still wrapped")
    if deferred.pending() or torch.nn.modules.module._global_forward_pre_hooks:
        leftovers.append("a module hook is still registered")
    if strict_config.active() is not None:
        leftovers.append("strict mode still active")
    if torch.get_default_device() != torch.device("cpu"):
        torch.set_default_device(None)
        leftovers.append("the default device was left changed")
    if leftovers:
        pytest.fail("; ".join(leftovers))
