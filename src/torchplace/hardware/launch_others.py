"""What launchers other than torchrun and srun tell a process, and which launcher wins when several did.

MPI (`mpirun`/`mpiexec` of Open MPI, MPICH, Intel MPI, MVAPICH; `srun --mpi=pmi2`) gives each process
its rank in variables of its own (OMPI_COMM_WORLD_RANK, PMI_RANK, MV2_COMM_WORLD_RANK, ...). Lightning's
process launcher (`Trainer(strategy="ddp")` started from `python train.py`) starts the other local
processes itself with WORLD_SIZE, NODE_RANK and LOCAL_RANK but no RANK, and makes the process group
later, in `fit`.

Precedence, innermost launcher first (it started this very process): RANK/WORLD_SIZE (torchrun,
`accelerate launch`, DeepSpeed, any env:// launcher), then MPI's variables, then SLURM's (an
`mpirun` inside an sbatch script inherits the batch step's SLURM_PROCID=0 in every process). An
outer launcher may start fewer processes than the inner one makes (one torchrun per node), never
more: a srun step or MPI world larger than WORLD_SIZE means every extra task takes a rank another
task already has (a RANK=0 WORLD_SIZE=1 left exported, `srun -n 4 torchrun --standalone`), and is
refused instead of running N copies of rank 0.

Nothing here imports torch; every function takes the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..errors import DistributedError
from .launch_env import LaunchEnv, _int_var

#: (rank, size, local rank, local size) variables of each MPI flavour, most specific first.
MPI_FLAVOURS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
#: Variables Lightning's process launcher sets for the processes it starts.
LIGHTNING_VARS = ("WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _flavour(e: Mapping[str, str]) -> tuple[str, str, str, str, str] | None:
    # empty counts as unset, as in _int_var: `export PMI_RANK=` left in a script is no MPI launch
    return next((f for f in MPI_FLAVOURS if (e.get(f[1]) or "").strip() and (e.get(f[2]) or "").strip()), None)


def _job_id(e: Mapping[str, str], name: str) -> int | None:
    """A job id as a number to derive a port from; None when it is not ASCII digits (then no port is derived
    and check() asks for MASTER_PORT). Its last 9 digits only: 10**9 is a multiple of 20000, so the port is
    the same as the whole number's, and a 4,000-digit id costs nothing."""
    text = (e.get(name) or "").strip()
    return int(text[-9:]) if text.isascii() and text.isdigit() else None


def mpi_local_rank(e: Mapping[str, str]) -> int | None:
    """This process's rank on its node as MPI says it (None outside MPI or when MPI does not say)."""
    flavour = _flavour(e)
    if flavour is None:
        return None
    value = _int_var(e, flavour[3])
    if value is None and e.get("SLURM_PROCID") == e.get(flavour[1]):  # srun --mpi=pmi2: SLURM's local id agrees
        value = _int_var(e, "SLURM_LOCALID")
    return value


def read_mpi(e: Mapping[str, str]) -> LaunchEnv | None:
    """What mpirun/mpiexec set, or None. MPI sets no rendezvous: MASTER_ADDR and MASTER_PORT come from
    the environment (`mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`); when every rank runs on this
    host, MASTER_ADDR defaults to 127.0.0.1 and the port to one derived from the MPI or SLURM job id."""
    flavour = _flavour(e)
    if flavour is None:
        return None
    _, rank_var, size_var, _, local_size_var = flavour
    variables = {k: e[k] for k in (*flavour[1:], "MASTER_ADDR", "MASTER_PORT") if k in e}  # names the flavour
    world, local_world = _int_var(e, size_var), _int_var(e, local_size_var)
    derived: dict[str, str] = {}
    addr = e.get("MASTER_ADDR") or None
    if addr is None and world is not None and local_world == world:
        addr = "127.0.0.1"
        derived["MASTER_ADDR"] = f"MPI world on this one host ({local_size_var} = {size_var} = {world}): 127.0.0.1"
    port = _int_var(e, "MASTER_PORT")
    job_var = next((v for v in ("OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID") if _job_id(e, v) is not None), None)
    if port is None and job_var is not None:
        port = 15000 + (_job_id(e, job_var) or 0) % 20000  # the same in every process of the job
        derived["MASTER_PORT"] = f"15000 + {job_var} % 20000 ({job_var}={e[job_var]!r:.40})"
    return LaunchEnv(launcher="mpi", rank=_int_var(e, rank_var), world_size=world, local_rank=mpi_local_rank(e),
                     local_world_size=local_world, master_addr=addr, master_port=port,
                     variables=variables, derived=derived)


def is_lightning_child(e: Mapping[str, str]) -> bool:
    """WORLD_SIZE, NODE_RANK and LOCAL_RANK without RANK: a process Lightning's launcher started."""
    return (e.get("RANK") is None and e.get("TORCHELASTIC_RUN_ID") is None
            and all(e.get(k) is not None for k in ("WORLD_SIZE", "NODE_RANK", "LOCAL_RANK")))


def settle(chosen: LaunchEnv, e: Mapping[str, str]) -> LaunchEnv:
    """CHOSEN (the innermost launcher's record), checked against the outer launchers' worlds."""
    if chosen.launcher in ("torchrun", "env") and is_lightning_child(e):
        chosen = replace(chosen, launcher="lightning", node_rank=_int_var(e, "NODE_RANK"), variables={
            **chosen.variables, **{k: e[k] for k in LIGHTNING_VARS if k in e}})
    outer: list[tuple[str, int]] = []
    if chosen.launcher != "mpi":
        mpi = read_mpi(e)
        flavour = _flavour(e)
        if mpi is not None and mpi.world_size is not None and flavour is not None:
            outer.append((f"{flavour[0]}'s mpirun ({flavour[2]}={mpi.world_size})", mpi.world_size))
    step_tasks = _int_var(e, "SLURM_STEP_NUM_TASKS")  # set by srun only: not in an sbatch script itself
    if chosen.launcher != "slurm" and step_tasks is not None:
        outer.append((f"srun (SLURM_STEP_NUM_TASKS={step_tasks}, SLURM_PROCID={e.get('SLURM_PROCID')})",
                      step_tasks))
    for who, tasks in outer:
        if chosen.world_size is not None and tasks > chosen.world_size:
            inner = {"mpi": "MPI's", "lightning": "Lightning's"}.get(chosen.launcher or "", "RANK/WORLD_SIZE")
            raise DistributedError(
                f"{who} started {tasks} processes, but this one's {inner} variables say the job has "
                f"{chosen.world_size} (RANK={e.get('RANK')}, WORLD_SIZE={e.get('WORLD_SIZE')}), so several "
                f"processes would take the same rank and each train alone. Read: {chosen.describe()}. Fix: "
                "unset RANK/WORLD_SIZE/LOCAL_RANK left over in the job script (torchplace reads the launcher's "
                f"own variables then), or let the outer launcher start one process per node that starts the "
                "ranks (srun --ntasks-per-node=1 torchplace run ..., or torchrun with --nnodes).")
    return chosen


def variable_names(launch: LaunchEnv) -> tuple[str, str, str, str]:
    """The rank, world size and local rank variables LAUNCH was read from, and how to fix them."""
    fix = ("start the job with `torchplace run --gpus N -- CMD` or torchrun, which set all of these together, "
           "or correct the variables named.")
    if launch.launcher == "slurm":
        return "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", fix
    flavour = next((f for f in MPI_FLAVOURS if launch.launcher == "mpi" and f[1] in launch.variables), None)
    if flavour is None:
        return "RANK", "WORLD_SIZE", "LOCAL_RANK", fix
    return flavour[1], flavour[2], flavour[3], (
        "mpirun sets no rendezvous address: pass rank 0's host and a free port to every rank (Open MPI: mpirun "
        "-x MASTER_ADDR=<host> -x MASTER_PORT=<port>; MPICH/Intel MPI: -genv MASTER_ADDR <host> -genv "
        "MASTER_PORT <port>), or start the job with torchrun or `torchplace run`.")


def lightning_problem(launch: LaunchEnv) -> str:
    """Why `torchplace.dist.init()` does not make a group in a process Lightning's launcher started."""
    return (f"This process was started by Lightning's launcher ({launch.describe()}: WORLD_SIZE, NODE_RANK and "
            "LOCAL_RANK without RANK), and Lightning makes the process group itself, in Trainer.fit / "
            "Fabric.launch; a group made here first would wait for a rank 0 that never joins it. Fix: call "
            "torchplace.setup() (it leaves the group to Lightning here) or torchplace.dist.init() after "
            "Lightning made the group (in a LightningModule hook or after fabric.launch(): it adopts it), "
            "or launch with torchrun, which sets RANK.")
