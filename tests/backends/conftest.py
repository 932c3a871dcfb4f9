"""The `npu` fixture: the test accelerator of tests/backends/npu.py, registered once per process.

Registering a PrivateUse1 back end cannot be undone, and from then on torch.accelerator reports
npu for every later test of the process (on a CUDA machine too). So the tests that use it live in
tests/backends/on_npu_*.py, which the main session does not collect (pytest collects test_*.py);
test_npu_session.py runs them in a pytest session of their own, where TORCHPLACE_NPU_SESSION=1
allows the registration. Anywhere else the fixture fails and says how to run them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SESSION_ENV = "TORCHPLACE_NPU_SESSION"
HERE = Path(__file__).resolve().parent


def npu_session_command(*extra: str) -> list[str]:
    """The pytest command that runs the npu suite in a session of its own."""
    return [sys.executable, "-m", "pytest", "-q", "-o", "python_files=on_npu_*.py",
            str(HERE), *extra]


@pytest.fixture(scope="session")
def npu():
    """The npu test back end's module (tests/backends/npu.py), registered in this process."""
    if os.environ.get(SESSION_ENV) != "1":
        pytest.fail(f"the npu back end is process-global; run its tests in their own session: "
                    f"{SESSION_ENV}=1 {' '.join(npu_session_command())}")
    from backends import npu as backend

    backend.register()
    return backend
