"""GPU twin of test_ddp.py: the full `torchplace bench ddp` on two GPUs (about 1-2 minutes).
Checks that every variant ran and the issue's targets were recorded; whether they were met is
the benchmark's result, not a test assertion."""

from __future__ import annotations

import json

import pytest


@pytest.mark.gpu
@pytest.mark.multigpu
def test_bench_ddp_on_two_gpus(run_cli, child_env, lease_dir, tmp_path):
    out = run_cli(["bench", "ddp", "--json", "--out", str(tmp_path)],
                  env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    variants = {row["variant"] for row in result["rows"]}
    assert variants == {"compute-bound: 1 GPU", "compute-bound: DataParallel x2",
                        "compute-bound: DDP x2 (torchplace run)",
                        "comm-bound: 1 GPU", "comm-bound: DataParallel x2", "comm-bound: DDP x2 (torchplace run)",
                        "comm-bound: DDP x2 (hand-written)"}
    assert all(row["extra"]["device"].startswith("cuda") for row in result["rows"])
    assert [t["name"] for t in result["targets"]] == ["DDP x2 via torchplace run / 1 GPU, compute-bound",
                                                     "DDP via torchplace run / hand-written DDP, comm-bound"]
