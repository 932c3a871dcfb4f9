"""N ranks to M (issue 35): a checkpoint a 4-rank DDP job wrote (one unsharded file) resumes on 1 and on 3
ranks, and a sharded one (FSDP's DCP folder) written by 4 ranks resumes on 2: the weights and optimizer
state are the saved ones on every rank, and setup() says what could not be resharded (per-rank RNG: rank
0's generators on every rank) and where the loader continues (4 x 2 batches of the order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "reshard_worker.py"


def job(nproc: int, *args: str) -> None:
    """reshard_worker.py ARGS on NPROC CPU ranks (one process without torchrun)."""
    launch = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", str(nproc), "--"] \
        if nproc > 1 else []
    done = subprocess.run([*launch, sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("reshard")
    job(4, "save", str(folder))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "kind"), [(1, "ddp"), (3, "ddp"), (2, "fsdp")])
def test_a_4_rank_checkpoint_resumes_on_another_number_of_ranks(saved_by_4, nproc, kind):
    job(nproc, "load", str(saved_by_4), kind)
    ranks = [json.loads(p.read_text()) for p in saved_by_4.glob(f"{kind}-on-{nproc}-rank*.json")]
    assert sorted(r["rank"] for r in ranks) == list(range(nproc))
    for rank in ranks:
        assert rank["equal"] and rank["optimizer_steps"] == [2, 2, 2, 2], rank
        said = "\n".join(rank["decisions"])
        assert f"saved by 4 rank(s), this run has {nproc}: " + (
            "the model and optimizer shards are resharded by torch.distributed.checkpoint" if kind == "fsdp" else
            "the model and optimizer (one unsharded copy) load whole on every rank") in said
        assert "per-rank RNG cannot be resharded: every rank restores rank 0's generators" in said
        assert "step 2, epoch 0; the loader continues at batch" in said
        assert (f"saved by 4 rank(s) (2 batch(es) each) and this run has {nproc}: each rank skips {8 // nproc}"
                f" batch(es)") in said
        assert ("2 batch(es) of samples before the position are seen again" if nproc == 3 else "(exact)") in said
