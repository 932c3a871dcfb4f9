"""setup() and dist.init() under the variables other launchers set (mpirun, Lightning's own launcher,
srun around torchrun, accelerate launch), and when several launchers' variables disagree: a documented
precedence or a clear error, never N processes that all think they are rank 0 of 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from ports import free_port  # tests/ports.py (pythonpath = tests)

import torchplace as tp
from torchplace.errors import DistributedError
from torchplace.hardware.launch import check, local_rank, read_launch_env

OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
SRUN_STEP = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
             "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}
# Lightning's _SubprocessScriptLauncher gives the processes it starts these (no RANK)
LIGHTNING_CHILD = {"WORLD_SIZE": "2", "NODE_RANK": "0", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "41000"}


@pytest.mark.parametrize("flavour", [
    {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
    {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
     "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
])
def test_mpirun_ranks_are_read(flavour: dict[str, str]) -> None:
    """Ported in our terms from Lightning-AI/pytorch-lightning tests/tests_fabric/plugins/environments/
    test_mpi.py and accelerate's utils/environment.py (the rank read from OMPI_/PMI_/MV2_ variables):
    `mpirun -np 4 python train.py` used to give every process launcher=None, rank 0 of 1, each
    training alone and writing rank 0's checkpoints."""
    launch = read_launch_env({**flavour, "MASTER_ADDR": "node01", "MASTER_PORT": "29500"})
    check(launch)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == \
        ("mpi", 3, 4, 1, 2)
    assert local_rank(flavour) == 1  # tp.device("auto") picks cuda:1 on this node


def test_mpirun_without_a_rendezvous_says_how_to_pass_one() -> None:
    env = {k: v for k, v in OMPI.items() if not k.startswith("MASTER")}
    with pytest.raises(DistributedError, match=r"OMPI_COMM_WORLD_RANK.*mpirun -x MASTER_ADDR=<host>"):
        check(read_launch_env(env))


def test_mpirun_on_one_host_needs_no_address() -> None:
    """Every rank local (LOCAL_SIZE = SIZE): 127.0.0.1, and a port from the job id, the same on every rank."""
    one_host = {**OMPI, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_ess_base_jobid": "123456"}
    del one_host["MASTER_ADDR"], one_host["MASTER_PORT"]
    launch = read_launch_env(one_host)
    check(launch)
    assert (launch.master_addr, launch.master_port) == ("127.0.0.1", 15000 + 123456 % 20000)


def test_mpirun_inside_an_sbatch_script_wins_over_the_batch_steps_slurm_variables() -> None:
    """mpirun started from an sbatch script: every process inherits the batch step's SLURM_PROCID=0 and
    SLURM_LOCALID=0; the rank and the local GPU come from MPI (documented precedence)."""
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
             "SLURM_JOB_NODELIST": "node[01-02]"}
    launch = read_launch_env({**batch, **OMPI})
    assert (launch.launcher, launch.rank, launch.local_rank) == ("mpi", 1, 1)
    assert local_rank({**batch, **OMPI}) == 1


def test_srun_pmi2_local_rank_comes_from_slurm_when_mpi_has_none() -> None:
    env = {**SRUN_STEP, "PMI_RANK": "1", "PMI_SIZE": "4", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    launch = read_launch_env(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("mpi", 1, 4, 1)


@pytest.mark.parametrize("outer", [SRUN_STEP, OMPI], ids=["srun", "mpirun"])
def test_a_stale_rank_under_a_larger_launch_is_refused(outer: dict[str, str]) -> None:
    """RANK=0 WORLD_SIZE=1 left exported in a job script, then srun -n 4 / mpirun -np 4: every task used to
    read rank 0 of 1 and train alone. Refused, naming both launchers' numbers."""
    with pytest.raises(DistributedError, match=r"(?s)started 4 processes.*say the job has 1 .*RANK=0.*unset RANK"):
        read_launch_env({**outer, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def test_srun_of_standalone_torchruns_is_refused() -> None:
    """`srun -n 4 torchrun --standalone --nproc-per-node 1`: four separate one-rank jobs."""
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(DistributedError, match="srun \\(SLURM_STEP_NUM_TASKS=4"):
        read_launch_env({**SRUN_STEP, **torchrun})


def test_torchrun_per_node_under_srun_and_mpirun_is_read_from_torchrun() -> None:
    """srun --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 4 (and mpirun -npernode 1 the same):
    the outer launcher started fewer processes than the job has ranks; RANK wins, no error."""
    step = {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    torchrun = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                "TORCHELASTIC_RUN_ID": "slurm-77", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    for outer in (step, {**OMPI, "OMPI_COMM_WORLD_SIZE": "2"}):
        launch = read_launch_env({**outer, **torchrun})
        assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torchrun", 6, 8, 2)


def test_accelerate_launch_variables_are_torchruns() -> None:
    """accelerate launch --multi_gpu runs torchrun and adds ACCELERATE_* settings: ranks from RANK."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "n",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ACCELERATE_MIXED_PRECISION": "bf16",
           "ACCELERATE_USE_CPU": "False", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    launch = read_launch_env(env)
    check(launch)
    assert (launch.launcher, launch.rank, launch.local_rank) == ("torchrun", 1, 1)


def test_lightning_child_process_gets_a_clear_error_from_init() -> None:
    """Lightning's launcher starts the other local processes with WORLD_SIZE, NODE_RANK, LOCAL_RANK and no
    RANK; dist.init() there used to say only 'RANK is not set' and point at torchrun."""
    launch = read_launch_env(LIGHTNING_CHILD)
    assert (launch.launcher, launch.local_rank, launch.node_rank) == ("lightning", 1, 0)
    with pytest.raises(DistributedError, match=r"started by Lightning's launcher.*Trainer.fit.*adopts it"):
        tp.dist.init(env=LIGHTNING_CHILD)


def test_setup_in_a_lightning_child_leaves_the_group_to_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp.setup() at the top of a script Lightning re-runs in its child processes: no group made (rank 0,
    the parent, has none yet either), the decision says why, and no error."""
    for name, value in LIGHTNING_CHILD.items():
        monkeypatch.setenv(name, value)
    rt = tp.setup("cpu", threads=None, verbose=False)
    assert rt.dist is None and any("Lightning's launcher started this process" in d for d in rt.decisions)


def test_setup_inside_lightning_fit_adopts_lightnings_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning-AI/pytorch-lightning tests/tests_pytorch/strategies/test_ddp.py runs the ddp strategy on
    the CPU: its group (gloo, one process here) is made in fit. setup() called from a hook adopts it, reads
    rank and size from it, and leaves it to Lightning's teardown."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
    # LOCAL_RANK set: the process is "launched externally", so Lightning starts no observer thread;
    # the variables its strategy writes are put back after
    for name, value in {"MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0",
                        "NODE_RANK": "0", "OMP_NUM_THREADS": ""}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_NUM_THREADS")
    L = pytest.importorskip("lightning")
    import torch
    import torch.distributed as dist

    seen: dict[str, Any] = {}

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def on_fit_start(self) -> None:
            group = dist.group.WORLD
            rt = tp.setup(threads=None, verbose=False)
            seen.update(adopted=rt.dist.adopted, rank=rt.rank, size=rt.world_size, same=dist.group.WORLD is group)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Lit(), data)
    finally:
        tp.dist.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == {"adopted": True, "rank": 0, "size": 1, "same": True}


@pytest.mark.slow
def test_two_mpirun_processes_form_a_gloo_group(child_env: Any) -> None:
    """Two processes with the variables Open MPI's mpirun gives them (one host) make one group, each with
    its own rank; before, each made a group of one."""
    script = ("import json, torchplace as tp; i = tp.dist.init(join_timeout=120); "
              "print(json.dumps([i.rank, i.world_size, i.local_rank, i.launcher])); tp.dist.teardown()")
    base = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": str(free_port()),
            "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(**base, OMPI_COMM_WORLD_RANK=str(r),
                                                       OMPI_COMM_WORLD_LOCAL_RANK=str(r)))
             for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    assert sorted(json.loads(out) for out, _ in outs) == [[0, 2, 0, "mpi"], [1, 2, 1, "mpi"]]
