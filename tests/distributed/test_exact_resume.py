"""Exact mid-epoch resume (issue 35): a rank SIGKILLed at a random step under `torchplace run --max-restarts 1`
resumes at the batch after its newest checkpoint, skipping the batches before by index (none is loaded),
and ends with the weights of a run never interrupted, bit for bit; every batch trained exactly once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "resume_worker.py"
EVERY, STEPS, BATCH, SAMPLES = 3, 18, 4, 48  # resume_worker.py: a checkpoint every 3 steps, 3 epochs of 6 steps


def job(folder: Path, nproc: int = 2, **env: str) -> subprocess.CompletedProcess:
    """resume_worker.py under `torchplace run --gpus none --nproc NPROC --max-restarts 1` into FOLDER."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", str(nproc), "--max-restarts", "1",
           "--", sys.executable, str(SCRIPT), str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def rows(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("exact") / "whole"
    job(folder)
    return folder


@pytest.mark.slow
def test_a_rank_killed_at_a_random_step_resumes_at_the_next_batch_bit_for_bit(tmp_path, uninterrupted):
    kill_at = random.randint(EVERY + 1, STEPS - 1)  # after the first checkpoint, before the end
    why = f"(rank 1 killed after step {kill_at})"
    done = job(tmp_path, KILL_AT_STEP=str(kill_at))
    resumed_at = kill_at // EVERY * EVERY  # the newest checkpoint complete when it died
    assert f"step{resumed_at:04d}.tpck, the newest complete checkpoint" in done.stderr, why + done.stderr[-3000:]
    for rank in (0, 1):
        whole = [r for r in rows(uninterrupted, rank) if "ids" in r]
        assert [r["step"] for r in whole] == list(range(1, STEPS + 1))
        got = rows(tmp_path, rank)
        first = [r for r in got if r.get("attempt") == 0 and "ids" in r]
        again = [r for r in got if r.get("attempt") == 1 and "ids" in r]
        assert first[-1]["step"] >= kill_at - 1, why  # rank 0 may be one step behind when rank 1 dies
        # the restart trained from the step after the checkpoint: not the epoch's start, nothing skipped
        assert again[0]["step"] == resumed_at + 1, why
        kept = [r for r in first if r["step"] <= resumed_at]  # the updates the checkpoint holds
        assert [(r["step"], r["ids"]) for r in kept + again] == [(r["step"], r["ids"]) for r in whole], why
        loads = [r["loads"] for r in got if r.get("attempt") == 1 and "loads" in r]
        assert loads == [BATCH * len(again)], why  # the batches skipped were not loaded
    for epoch in range(3):  # each epoch: every sample once over both ranks
        ids = [i for rank in (0, 1) for r in rows(uninterrupted, rank) if r.get("epoch") == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES))
    final, reference = torch.load(tmp_path / "final.pt"), torch.load(uninterrupted / "final.pt")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in final), why
