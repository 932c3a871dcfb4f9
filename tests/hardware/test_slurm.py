"""SLURM jobs: node lists, task environments and the torchrun options they map to.

The environments in tests/fixtures/slurm/ are constructed from SLURM's documentation (the
sbatch/srun man pages), not captured on a cluster; their README says so. The last test starts two
real processes with such an environment and makes a gloo group from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port  # tests/ports.py (pythonpath = tests)

from torchplace.errors import DistributedError
from torchplace.hardware.launch import (
    check,
    expand_nodelist,
    first_host,
    read_launch_env,
    slurm_nnodes,
    torchrun_options_from_slurm,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "slurm"


def slurm_env(name: str) -> dict[str, str]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    data.pop("_doc")
    return data


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[07-09,12],cpu1", ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1"]),
    ("cn-[1-4]", ["cn-1", "cn-2", "cn-3", "cn-4"]),
    ("node[8-10]", ["node8", "node9", "node10"]),  # no padding: the range start has none
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),  # two bracket groups, as scontrol expands them
    ("a1,b[2],c3", ["a1", "b2", "c3"]),
    ("solo", ["solo"]),
])
def test_node_lists_expand_like_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist,match", [("node[01-03", "unbalanced bracket"),
                                            ("node[a-b]", "unreadable range"), ("node[5-2]", "empty or too long")])
def test_unreadable_node_lists_are_named(nodelist, match):
    with pytest.raises(DistributedError, match=match):
        expand_nodelist(nodelist)


def test_srun_starting_every_rank_maps_onto_dist_init():
    env = slurm_env("srun_rank_per_task")
    launch = read_launch_env(env)
    check(launch)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size,
            launch.node_rank, launch.nnodes) == ("slurm", 3, 4, 1, 2, 1, 2)
    assert (launch.master_addr, launch.master_port) == ("gpu07", 15000 + 4242)
    assert "gpu[07-08]" in launch.derived["MASTER_ADDR"]
    assert torchrun_options_from_slurm(env) == ({}, {})  # each task is a rank: no launcher to configure


def test_srun_starting_a_launcher_per_node_maps_onto_torchrun_options():
    env = slurm_env("srun_launcher_per_node")
    options, sources = torchrun_options_from_slurm(env)
    assert options == {"nnodes": "4", "rdzv_backend": "c10d", "rdzv_endpoint": f"node01:{15000 + 918273 % 20000}",
                       "rdzv_id": "slurm-918273"}
    assert "node[01-03,07]" in sources["rdzv_endpoint"]
    assert slurm_nnodes(env) == 4
    pinned = {**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}
    assert torchrun_options_from_slurm(pinned)[0]["rdzv_endpoint"] == "10.0.0.5:29400"


def test_torchplace_run_under_srun_becomes_one_multinode_job(monkeypatch):
    from torchplace.distributed.run import plan

    for key, value in slurm_env("srun_launcher_per_node").items():
        monkeypatch.setenv(key, value)
    run = plan(["python", "train.py"], gpus="none", nproc=8, torchrun={"max_restarts": "3"})
    argv = " ".join(run.argv)
    assert "--standalone" not in argv
    assert "--nnodes 4 --rdzv-backend c10d --rdzv-endpoint node01:" in argv and "--rdzv-id slurm-918273" in argv
    assert "--max-restarts 3" in argv and any("SLURM job over several nodes" in n for n in run.notes)
    given = plan(["python", "train.py"], gpus="none", nproc=8, torchrun={"nnodes": "2", "rdzv_endpoint": "h:1"})
    assert "--nnodes 2 " in " ".join(given.argv)  # options given on the command line win


def test_uneven_tasks_per_node():
    launch = read_launch_env(slurm_env("srun_uneven_tasks"))
    check(launch)
    assert (launch.rank, launch.world_size, launch.local_world_size, launch.node_rank, launch.master_addr) == \
        (6, 7, 1, 3, "cn-1")


@pytest.mark.slow
def test_two_srun_tasks_form_a_gloo_group(child_env):
    """Two processes with the task environments srun would give them (one node, localhost) make one group."""
    script = ("import json, torchplace as tp; i = tp.dist.init(join_timeout=120); "
              "print(json.dumps([i.rank, i.world_size, i.local_rank, i.node_rank, i.launcher])); tp.dist.teardown()")
    base = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "SLURM_NTASKS": "2",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "MASTER_PORT": str(free_port()),
            "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(**base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
             for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    assert sorted(json.loads(out) for out, _ in outs) == [[0, 2, 0, 0, "slurm"], [1, 2, 1, 0, "slurm"]]
