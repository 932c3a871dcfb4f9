"""The example training (the README's main job): runs on CPU, resumes bit for bit, runs under DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def _torchrun_job(tmp_path: Path, name: str) -> list[str]:
    folder = tmp_path / name
    folder.mkdir()
    return [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", "2", "--max-restarts", "1",
            "--", sys.executable, str(EXAMPLE), "--device", "cpu", "--epochs", "3", "--batch-size", "32",
            "--ckpt-dir", str(folder / "ck"), "--log", str(folder / "log.json")]


def _final_weights(folder: Path) -> dict:
    import torchplace as tp

    return tp.load(folder / "ck")["model"]


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_is_restarted_and_the_job_resumes_bit_for_bit(tmp_path):
    """torchrun restarts both workers after one is SIGKILLed; setup() sees the restart and the run
    continues from the newest checkpoint: exit 0, at most one epoch redone, the same final weights."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = subprocess.run(_torchrun_job(tmp_path, "whole"), capture_output=True, text=True, env=env, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    job = subprocess.Popen(_torchrun_job(tmp_path, "killed"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    ck = tmp_path / "killed" / "ck"
    try:
        while job.poll() is None and not (ck / "epoch000.tpck").exists():
            time.sleep(0.005)
        time.sleep(0.2)  # into epoch 1
        saved_before = sorted(p.name for p in ck.glob("epoch*.tpck"))
        victim = next(c for c in psutil.Process(job.pid).children(recursive=True)
                      if "train.py" in " ".join(c.cmdline()) and c.environ().get("RANK") == "1")
        victim.send_signal(signal.SIGKILL)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err[-3000:]
    assert "epoch002.tpck" not in saved_before  # the kill came before the run's end
    newest = saved_before[-1]
    # it continued from the newest checkpoint there was when the worker died: at most one epoch redone
    assert f"resumed {newest} (saved on cpu) at epoch {int(newest[5:8]) + 1}" in out, out[-2000:]
    assert "restarted by the launcher: continuing from" in err
    a, b = (json.loads((tmp_path / name / "log.json").read_text()) for name in ("whole", "killed"))
    assert a["losses"] == b["losses"] and a["accuracy"] == b["accuracy"]
    final_a, final_b = _final_weights(tmp_path / "whole"), _final_weights(tmp_path / "killed")
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
