"""Fixtures for the checkpoint tests: small real models, file systems that fail on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

HELPERS = Path(__file__).parent / "helpers"


def run_helper(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run tests/checkpoint/helpers/NAME with this interpreter; return stdout, fail with stderr."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, str(HELPERS / name), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="session", autouse=True)
def _torch_lazy_setup():
    """Take one optimizer step before any test: torch sets TORCHINDUCTOR_CACHE_DIR on the first one,
    which the repository's env-leak check would otherwise blame on whichever test came first."""
    p = nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    torch.optim.AdamW([p]).step()


@pytest.fixture
def helper():
    return run_helper


class Net(nn.Module):
    """A small model with a parameter, a buffer-holding BatchNorm and dropout (RNG matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


@pytest.fixture
def make_net():
    def make(seed: int = 0) -> Net:
        torch.manual_seed(seed)
        return Net()
    return make


def _mount_tmpfs(path: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


@pytest.fixture
def tiny_tmpfs():
    """A 1 MiB tmpfs (a real full disk); skipped where mounting is not allowed."""
    path = Path(tempfile.mkdtemp(prefix="tp-tmpfs-"))
    if not _mount_tmpfs(path, "size=1m"):
        path.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root); the fault-injecting sink covers ENOSPC")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
        path.rmdir()


@pytest.fixture
def readonly_dir():
    """A directory this process cannot write in: a read-only tmpfs as root, else mode 0555."""
    path = Path(tempfile.mkdtemp(prefix="tp-ro-"))
    mounted = _mount_tmpfs(path, "ro,size=1m")
    if not mounted:
        if os.geteuid() == 0:
            path.rmdir()
            pytest.skip("running as root without permission to mount: no directory is read-only to root")
        path.chmod(0o555)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)
        path.chmod(0o755)
        path.rmdir()


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """Where a planted payload (adversarial.crafting.Payload) would make a directory if it ran."""
    return tmp_path / "PAYLOAD-RAN"
