"""The example on H200s: GPU -> CPU and CPU -> GPU resume, and two GPUs through torchplace run."""

from __future__ import annotations

import sys

import pytest
from test_example import train

pytestmark = pytest.mark.gpu


def test_gpu_checkpoint_resumes_on_a_cpu_only_process_and_back(tmp_path):
    full = train(tmp_path, "--device", "cuda:0", log="gpu.json")
    part = tmp_path / "p"
    part.mkdir()
    train(part, "--device", "cuda:0", "--stop-after", "0")
    # the CPU-only resume sees no GPU at all
    on_cpu = train(part, "--resume", "--stop-after", "1", log="cpu.json", env={"CUDA_VISIBLE_DEVICES": ""})
    assert on_cpu["device"] == "cpu" and len(on_cpu["losses"]) == 2
    back = train(part, "--resume", "--device", "cuda:0", log="back.json")
    assert back["device"] == "cuda:0" and len(back["losses"]) == 3
    # the same loss curve: precision differs between devices (bf16 autocast on the H200), so close, not equal
    for a, b in zip(full["losses"], back["losses"]):
        assert abs(a - b) <= 0.05 * max(a, b), (full["losses"], back["losses"])
    assert back["accuracy"] > 0.8


@pytest.mark.multigpu
def test_two_gpus_through_torchplace_run(tmp_path):
    launcher = [sys.executable, "-m", "torchplace", "run", "--gpus", "2", "--", sys.executable]
    result = train(tmp_path, log="ddp.json", launcher=launcher)
    assert result["device"] == "cuda:0" and result["losses"][-1] < result["losses"][0]
