"""The example training (the README's main job): runs on CPU, resumes bit for bit, runs under DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"


def train(tmp_path: Path, *args: str, log: str | None = None, env: dict | None = None,
          launcher: list[str] | None = None) -> dict:
    cmd = [*(launcher or [sys.executable]), str(EXAMPLE), "--quick", "--ckpt-dir", str(tmp_path / "ck"), *args]
    if log:
        cmd += ["--log", str(tmp_path / log)]
    full = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((tmp_path / log).read_text()) if log else {}


def test_quick_run_learns_on_cpu(tmp_path):
    result = train(tmp_path, "--device", "cpu", log="full.json")
    losses = result["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.6
    assert result["accuracy"] > 0.8 and result["device"] == "cpu"
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert kept == ["epoch001.tpck", "epoch002.tpck", "latest"]  # keep_last=2 and the pointer


def test_resume_after_a_process_restart_gives_the_same_losses_bit_for_bit(tmp_path):
    whole = tmp_path / "a"
    whole.mkdir()
    full = train(whole, "--device", "cpu", log="full.json")
    part = tmp_path / "b"
    part.mkdir()
    train(part, "--device", "cpu", "--stop-after", "0")
    resumed = train(part, "--device", "cpu", "--resume", log="resumed.json")
    assert resumed["losses"] == full["losses"]
    assert resumed["accuracy"] == full["accuracy"]


@pytest.mark.slow
def test_two_cpu_processes_through_torchplace_run(tmp_path):
    launcher = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", "2", "--", sys.executable]
    result = train(tmp_path, "--device", "cpu", log="ddp.json", launcher=launcher)
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]
