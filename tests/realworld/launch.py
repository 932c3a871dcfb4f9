"""Helpers for the ports of real training programs: start one under torchrun (gloo, on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"
HANG_BOUND_S = 240  # only a real hang reaches it (a run takes seconds)


def run_program(name: str, *args: str, cwd: Path, nproc: int = 1, max_restarts: int = 0,
                env: dict[str, str] | None = None, cli: bool = False) -> subprocess.CompletedProcess[str]:
    """Run programs/NAME with ARGS in CWD: under torchrun with NPROC ranks (gloo) when NPROC > 1 or
    MAX_RESTARTS (through `torchplace run --gpus none` when CLI), else as `python NAME`. Fails the test
    on a non-zero exit, with the output."""
    from ports import free_port

    script = str(PROGRAMS / name)
    if cli:
        cmd = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", str(nproc), "--max-restarts",
               str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--",
               sys.executable, script, *args]
    elif nproc > 1 or max_restarts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.2", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    import torchplace

    src = str(Path(torchplace.__file__).resolve().parents[1])  # this tree's torchplace, from any cwd
    path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}
    try:
        out = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=HANG_BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} hung (no exit within {HANG_BOUND_S} s):\n{exc.stdout}\n{exc.stderr}")
    assert out.returncode == 0, f"{name} exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out
