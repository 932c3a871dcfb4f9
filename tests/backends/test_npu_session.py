"""Run the device-generic tests on the npu test back end (tests/backends/on_npu_*.py), in a pytest
session of their own: registering the back end is process-global (see conftest.py)."""

from __future__ import annotations

import subprocess

from backends.conftest import SESSION_ENV, npu_session_command


def _run(child_env, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(npu_session_command(*extra), capture_output=True, text=True, timeout=280,
                          env=child_env(**{SESSION_ENV: "1"}))


def test_device_generic_suite_passes_on_npu(child_env):
    done = _run(child_env)
    assert done.returncode == 0, f"npu suite failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout and "error" not in done.stdout.splitlines()[-1]
