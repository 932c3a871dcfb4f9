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


def job(folder: Path, nproc: int, *args: str) -> tuple[subprocess.Popen, Path]:
    """reshard_worker.py ARGS started on NPROC CPU ranks (one process without torchrun); its output file."""
    launch = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", str(nproc), "--"] \
        if nproc > 1 else []
    log = folder / f"{args[0]}-{args[-1] if len(args) > 2 else 'all'}-on-{nproc}.log"
    with log.open("w") as out:
        return subprocess.Popen([*launch, sys.executable, str(SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}), log


def ended(run: tuple[subprocess.Popen, Path]) -> tuple[int | None, str]:
    """Wait for a job of `job` to end (hang bound 300 s): its exit code and output."""
    try:
        run[0].wait(timeout=300)
    finally:
        if run[0].poll() is None:
            run[0].kill()
            run[0].wait()
    return run[0].returncode, run[1].read_text()


LOADS = [(1, "ddp"), (3, "ddp"), (2, "fsdp")]


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory) -> tuple[Path, dict]:
    """The checkpoints a 4-rank job saved, and how the load jobs of all the tests ended: started at once, as they
    only read the checkpoints and each writes files of its own."""
    folder = tmp_path_factory.mktemp("reshard")
    code, out = ended(job(folder, 4, "save", str(folder)))
    assert code == 0, out[-4000:]
    loads = {(nproc, kind): job(folder, nproc, "load", str(folder), kind) for nproc, kind in LOADS}
    return folder, {key: ended(run) for key, run in loads.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "kind"), LOADS)
def test_a_4_rank_checkpoint_resumes_on_another_number_of_ranks(saved_by_4, nproc, kind):
    folder, loads = saved_by_4
    code, out = loads[nproc, kind]
    assert code == 0, out[-4000:]
    ranks = [json.loads(p.read_text()) for p in folder.glob(f"{kind}-on-{nproc}-rank*.json")]
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
