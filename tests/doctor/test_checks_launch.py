"""doctor inside a distributed job: the rendezvous finding, on the H200 snapshot with launcher variables."""

from __future__ import annotations

import json
from pathlib import Path

from snapshots import load_snapshot_dict

from torchplace import Facts
from torchplace.doctor.checks_launch import check_rendezvous

SLURM = Path(__file__).parents[1] / "fixtures" / "slurm"
#: a torchrun worker on node 1 of 2 (rank 3 of 4), restarted once
TORCHRUN_WORKER = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400",
                   "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}


def findings(env: dict[str, str]):
    return check_rendezvous(Facts.from_dict(load_snapshot_dict("h200x2"), env=env))


def test_no_job_no_finding():
    assert findings({}) == []


def test_a_torchrun_worker_sees_its_place_and_the_store():
    [f, shared] = findings({**TORCHRUN_WORKER, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (f.id, f.severity) == ("launch.rendezvous", "info")
    assert f.title == "Inside a distributed job started by torchrun: rank 3 of 4, node 1 of 2, local rank 1 of 2"
    assert f.detail == ("rendezvous store node0:29400 (torchrun's agent hosts it and keeps it across restarts); "
                        "run id job7; restart 1 of at most 3.")
    # torch's shared store keeps a node that is started again out of the job (tests/test_example.py shows it)
    assert (shared.id, shared.severity) == ("launch.shared_store", "warning")
    assert shared.title == "A node of these 2 that dies and is started again cannot rejoin the job"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared.detail


def test_a_store_per_start_is_said_and_not_warned_about():
    """What `torchplace run --nnodes ...` gives its workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    [f] = findings({**TORCHRUN_WORKER, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert "(rank 0 hosts it, a new one each time torchrun starts the workers)" in f.detail


def test_one_node_sharing_the_store_is_fine():
    [f] = findings({**TORCHRUN_WORKER, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "RANK": "1", "WORLD_SIZE": "2",
                    "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert f.id == "launch.rendezvous"


def test_a_slurm_task_sees_the_derived_address():
    env = json.loads((SLURM / "srun_rank_per_task.json").read_text())
    env.pop("_doc")
    [f] = findings(env)
    assert f.title == "Inside a distributed job started by srun (SLURM): rank 3 of 4, node 1 of 2, local rank 1 of 2"
    assert f"gpu07:{15000 + 4242}" in f.detail and "first host of the SLURM node list 'gpu[07-08]'" in f.detail


def test_an_inconsistent_launch_is_an_error():
    [f] = findings({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (f.id, f.severity) == ("launch.inconsistent", "error") and "RANK=2 is not below WORLD_SIZE=2" in f.detail
