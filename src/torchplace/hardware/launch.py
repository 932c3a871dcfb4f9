"""What the launcher (torchrun, srun, mpirun, Lightning's launcher) told this process.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the
TORCHELASTIC_* variables; srun sets SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, ... . This
module turns any of them into one `LaunchEnv` record and checks that the numbers agree, so a wrong
LOCAL_RANK or a RANK past WORLD_SIZE is reported before any collective can hang on it.

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

Nothing here imports torch or starts CUDA. Every function takes the environment as an argument
(default: ``os.environ``), so each case is a one-line test.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..errors import DistributedError

#: Variables torchrun sets for each worker (the ones this module reads).
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
#: Variables srun sets for each task (the ones this module reads).
SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_NNODES",
              "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE",
              "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


#: torch.distributed keeps ranks, sizes and ports in C ints: a larger value cannot work.
C_INT_MAX = 2**31 - 1
#: The most processes a job may have: joining keeps one store key per rank on every rank (2**31 of them
#: took 5 GiB and more before failing), and the largest jobs run have some 10**5 ranks.
MAX_WORLD_SIZE = 2**20
_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() would also take '\u0661' or '1_0'


def _short(raw: str) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(raw)} characters)"


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    """Read ``name`` as a non-negative int; None when unset or empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if _INTEGER.fullmatch(text) and len(text) > 20:
        raise DistributedError(
            f"{name}={_short(raw)} has {len(text)} digits, far more than any rank, size or port. "
            f"Fix: unset {name} or set it to a non-negative integer.")
    if not _INTEGER.fullmatch(text):
        raise DistributedError(
            f"{name}={_short(raw)} is not an integer (ASCII digits 0-9). The launcher (torchrun, srun) "
            f"sets it to a whole number. Fix: unset {name} or set it to a non-negative integer.")
    value = int(text)
    if value < 0:
        raise DistributedError(
            f"{name}={raw!r} is negative. Fix: unset {name} or set it to a non-negative integer.")
    return value


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its node: LOCAL_RANK (torchrun), else SLURM_LOCALID, else None.

    The device resolver uses it to pick ``cuda:<local_rank>`` by default.
    """
    e = _env(env)
    value = _int_var(e, "LOCAL_RANK")
    if value is not None:
        return value
    if e.get("RANK") is not None:  # torchrun-style launch without LOCAL_RANK: do not mix in SLURM
        return None
    mpi = read_mpi(e)  # mpirun in an sbatch script: SLURM_LOCALID is the batch step's
    return mpi.local_rank if mpi is not None else _int_var(e, "SLURM_LOCALID")


@dataclass(frozen=True)
class LaunchEnv:
    """One process's place in a distributed job, as its launcher described it.

    `launcher` is "torchrun" (TORCHELASTIC_RUN_ID set), "env" (RANK/WORLD_SIZE set by hand or
    another launcher), "slurm" (srun's SLURM_PROCID/SLURM_NTASKS), "mpi" (mpirun's variables),
    "lightning" (a process Lightning's launcher started) or None (no launcher: a plain single
    process). `variables` holds the raw values that were read, for messages; `derived` says which
    values were computed rather than read (e.g. MASTER_ADDR from SLURM_JOB_NODELIST).
    """

    launcher: str | None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    nnodes: int | None = None
    run_id: str | None = None
    use_agent_store: bool = False
    variables: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)

    @property
    def launched(self) -> bool:
        """True when a launcher set this process's rank (False for a plain `python script.py`)."""
        return self.launcher is not None

    def describe(self) -> str:
        """The variables as `NAME=value` pairs, for error messages."""
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(self.variables.items()))
        return shown or "no launcher variables set"


# MPI and Lightning: their variables, and which launcher wins when several set some.

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
                f"{chosen.world_size} (RANK={e.get('RANK')}, WORLD_SIZE={e.get('WORLD_SIZE')}): several "
                "processes would take the same rank and each train alone.\n"
                "Fix: unset RANK/WORLD_SIZE/LOCAL_RANK left over in the job script (torchplace then reads the "
                "launcher's own variables).\n"
                "Or: let the outer launcher start one process per node that starts the ranks "
                "(srun --ntasks-per-node=1 torchplace run ..., or torchrun with --nnodes).\n"
                f"Read: {chosen.describe()}.")
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


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read what torchrun, another env:// launcher, or srun set for this process. Never validates
    consistency (see `check`); raises DistributedError only for values that are not integers."""
    e = _env(env)
    if e.get("RANK") is not None or e.get("WORLD_SIZE") is not None:
        return settle(_read_torchrun(e), e)
    mpi = read_mpi(e)
    if mpi is not None:
        return settle(mpi, e)
    if e.get("SLURM_PROCID") is not None and e.get("SLURM_NTASKS") is not None:
        return settle(_read_slurm(e), e)
    return LaunchEnv(launcher=None, local_rank=local_rank(e),
                     variables={k: e[k] for k in ("LOCAL_RANK", "SLURM_LOCALID") if k in e})


def _read_torchrun(e: Mapping[str, str]) -> LaunchEnv:
    variables = {k: e[k] for k in TORCHRUN_VARS if k in e}
    port = _int_var(e, "MASTER_PORT")
    return LaunchEnv(
        launcher="torchrun" if e.get("TORCHELASTIC_RUN_ID") else "env",
        rank=_int_var(e, "RANK"),
        world_size=_int_var(e, "WORLD_SIZE"),
        local_rank=_int_var(e, "LOCAL_RANK"),
        local_world_size=_int_var(e, "LOCAL_WORLD_SIZE"),
        node_rank=_int_var(e, "GROUP_RANK"),
        master_addr=e.get("MASTER_ADDR") or None,
        master_port=port,
        restart_count=_int_var(e, "TORCHELASTIC_RESTART_COUNT") or 0,
        nnodes=_int_var(e, "GROUP_WORLD_SIZE"),
        run_id=e.get("TORCHELASTIC_RUN_ID") or None,
        use_agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        variables=variables,
    )


def _read_slurm(e: Mapping[str, str]) -> LaunchEnv:
    variables = {k: e[k] for k in (*SLURM_VARS, "MASTER_ADDR", "MASTER_PORT") if k in e}
    derived: dict[str, str] = {}
    node = _int_var(e, "SLURM_NODEID")
    per_node_raw = e.get("SLURM_STEP_TASKS_PER_NODE") or e.get("SLURM_TASKS_PER_NODE")
    local_world = None
    if per_node_raw:
        counts = parse_tasks_per_node(per_node_raw)
        if counts and node is not None and node < len(counts):
            local_world = counts[node]
        elif len(set(counts)) == 1:
            local_world = counts[0]
    addr, port = _slurm_rendezvous(e, derived)
    return LaunchEnv(
        launcher="slurm",
        rank=_int_var(e, "SLURM_PROCID"),
        world_size=_int_var(e, "SLURM_NTASKS"),
        local_rank=_int_var(e, "SLURM_LOCALID"),
        local_world_size=local_world,
        node_rank=node,
        nnodes=slurm_nnodes(e),
        master_addr=addr,
        master_port=port,
        variables=variables,
        derived=derived,
    )


def _slurm_rendezvous(e: Mapping[str, str], derived: dict[str, str]) -> tuple[str | None, int | None]:
    """MASTER_ADDR and MASTER_PORT for a SLURM job: as set, else the node list's first host and a
    port from the job id (the same on every task, so no task has to tell the others)."""
    addr = e.get("MASTER_ADDR") or None
    if addr is None:
        nodelist = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
        if nodelist:
            addr = first_host(nodelist)
            derived["MASTER_ADDR"] = f"first host of the SLURM node list {nodelist!r}"
    port = _int_var(e, "MASTER_PORT")
    job = _int_var(e, "SLURM_JOB_ID")
    if port is None and job is not None:
        port = 15000 + job % 20000  # the same on every task of the job, away from 29500
        derived["MASTER_PORT"] = f"15000 + SLURM_JOB_ID % 20000 (SLURM_JOB_ID={job})"
    return addr, port


def slurm_nnodes(env: Mapping[str, str] | None = None) -> int | None:
    """The nodes of this SLURM step (SLURM_STEP_NUM_NODES, else SLURM_NNODES / SLURM_JOB_NUM_NODES,
    else the length of the node list), or None outside SLURM."""
    e = _env(env)
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        value = _int_var(e, name)
        if value is not None:
            return value
    nodelist = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
    return len(expand_nodelist(nodelist)) if nodelist else None


def torchrun_options_from_slurm(env: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """torchrun's multi-node options for a program that srun started once per node.

    `srun --ntasks-per-node=1 torchplace run --gpus 4 -- python train.py` runs one launcher per
    node; each needs the same --nnodes, a c10d rendezvous on one host and the same --rdzv-id.
    Returns (options by torchrun's name, where each came from); ({}, {}) outside a SLURM job, on
    one node, or when srun started more tasks than nodes (then each task is a rank of its own,
    which `torchplace.dist.init()` reads from SLURM_PROCID).
    """
    e = _env(env)
    if e.get("SLURM_JOB_ID") is None or e.get("SLURM_PROCID") is None:
        return {}, {}
    nnodes = slurm_nnodes(e)
    ntasks = _int_var(e, "SLURM_NTASKS")
    if nnodes is None or nnodes <= 1:
        return {}, {}
    if ntasks is not None and ntasks != nnodes:
        return {}, {}  # srun started every rank itself (or one per GPU): each task is a rank, not a launcher
    derived: dict[str, str] = {}
    addr, port = _slurm_rendezvous(e, derived)
    if addr is None or port is None:
        raise DistributedError(
            f"This SLURM job spans {nnodes} nodes, but neither MASTER_ADDR nor a node list "
            "(SLURM_STEP_NODELIST / SLURM_JOB_NODELIST) names a host for the rendezvous, or SLURM_JOB_ID "
            "is missing for its port. Fix: export MASTER_ADDR=$(scontrol show hostnames | head -n1) and "
            "MASTER_PORT in the sbatch script.")
    options = {"nnodes": str(nnodes), "rdzv_backend": "c10d", "rdzv_endpoint": f"{addr}:{port}",
               "rdzv_id": f"slurm-{e['SLURM_JOB_ID']}"}
    sources = {"nnodes": "SLURM_NNODES", "rdzv_backend": "c10d: elastic, survives restarts",
               "rdzv_endpoint": f"{derived.get('MASTER_ADDR', 'MASTER_ADDR')}; port: "
                                f"{derived.get('MASTER_PORT', 'MASTER_PORT')}",
               "rdzv_id": "SLURM_JOB_ID"}
    return options, sources


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's compressed task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in value.split(","):
        m = _TASKS_RE.match(part.strip())
        if not m:
            raise DistributedError(
                f"SLURM tasks-per-node value {value!r} has an unreadable part {part!r}; expected "
                f"counts like '2(x3),1'. Fix: set LOCAL_WORLD_SIZE explicitly.")
        repeat = int(m.group(2) or 1)
        if len(out) + repeat > MAX_WORLD_SIZE:  # '2(x999999999)' would be a list of a billion counts
            raise DistributedError(
                f"SLURM tasks-per-node value {value!r:.80} describes more than {MAX_WORLD_SIZE} nodes. Fix: set "
                "LOCAL_WORLD_SIZE explicitly.")
        out.extend([int(m.group(1))] * repeat)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: ``"node[01-03,07],gpu5"`` -> ``["node01", "node02",
    "node03", "node07", "gpu5"]``. Zero padding follows each range's start; several bracket groups
    in one name (``"r[1-2]n[1-2]"``) expand like scontrol show hostnames does. The work is bounded
    by what comes out, at most MAX_WORLD_SIZE hosts and _MAX_NODELIST_CHARS characters."""
    hosts: list[str] = []
    chars = 0
    for item in _split_top(nodelist.strip()):
        if not item:
            continue
        literals, groups = _name_parts(item, nodelist)
        count = 1
        for numbers in groups:
            count *= len(numbers)  # bracket groups multiply: 'r[0-99999]n[0-99999]' is 10**10 names
            if len(hosts) + count > MAX_WORLD_SIZE:
                raise _too_many_hosts(nodelist)
        chars += count * (sum(map(len, literals)) + sum(len(g[0]) for g in groups))
        if chars > _MAX_NODELIST_CHARS:
            raise DistributedError(f"SLURM node list {nodelist!r:.80} expands to more than {_MAX_NODELIST_CHARS} "
                                   "characters of host names. Fix: set MASTER_ADDR to the first node's host name.")
        for combo in itertools.product(*groups):
            hosts.append("".join(itertools.chain.from_iterable(zip(literals, (*combo, "")))))
    return hosts


def _too_many_hosts(nodelist: str) -> DistributedError:
    return DistributedError(f"SLURM node list {nodelist!r:.80} names more than {MAX_WORLD_SIZE} hosts. Fix: set "
                            "MASTER_ADDR to the first node's host name.")


_MAX_NODELIST_CHARS = 2**26  # a million hosts of 64 characters
_MAX_NODE_DIGITS = 18  # a node number of SLURM's is an unsigned 32-bit int


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        depth += (ch == "[") - (ch == "]")
        current.append(ch)
    parts.append("".join(current).strip())
    return parts


def _name_parts(item: str, whole: str) -> tuple[list[str], list[list[str]]]:
    """One name of a node list as its literal pieces and, between them, each bracket group's numbers:
    ``"r[1-2]n[7]"`` -> ``(["r", "n", ""], [["1", "2"], ["7"]])``."""
    literals: list[str] = []
    groups: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\[\]]*)\]", item):
        literals.append(item[pos:m.start()])
        groups.append(_range_numbers(m.group(1), whole))
        pos = m.end()
    literals.append(item[pos:])
    if any("[" in lit or "]" in lit for lit in literals):
        raise DistributedError(f"SLURM node list {whole!r:.80} has an unbalanced bracket in {item!r:.80}. Fix: set "
                               "MASTER_ADDR to the first node's host name.")
    return literals, groups


def _range_numbers(ranges: str, whole: str) -> list[str]:
    """The numbers of one bracket group, ``"01-03,07"`` -> ``["01", "02", "03", "07"]``."""
    out: list[str] = []
    for part in ranges.split(","):
        bounds = part.strip().split("-")
        if (not all(b.isascii() and b.isdigit() and len(b) <= _MAX_NODE_DIGITS for b in bounds)
                or len(bounds) > 2):
            raise DistributedError(f"SLURM node list {whole!r:.80} has an unreadable range {part!r:.40}; expected "
                                   "ranges like node[01-03,07]. Fix: set MASTER_ADDR to the first node's host name.")
        low, high = int(bounds[0]), int(bounds[-1])
        if len(out) + high - low >= MAX_WORLD_SIZE:
            raise _too_many_hosts(whole)
        if high < low or high - low > 100_000:
            raise DistributedError(f"SLURM node list {whole!r:.80} has the range {part!r:.40}, which is empty or too "
                                   "long. Fix: set MASTER_ADDR to the first node's host name.")
        width = len(bounds[0])
        out.extend(str(number).zfill(width) for number in range(low, high + 1))
    return out


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise DistributedError(f"SLURM node list {nodelist!r} names no host. Fix: set MASTER_ADDR.")
    return hosts[0]


def _bad_host(addr: str) -> str | None:
    """Why `addr` cannot be a host name or address, or None."""
    if "\x00" in addr:
        return "contains a NUL byte"
    if any(ch.isspace() or not ch.isprintable() for ch in addr):
        return "contains whitespace or a control character"
    if len(addr) > 253:
        return f"is {len(addr)} characters long (a host name has at most 253)"
    return None


def check(launch: LaunchEnv) -> None:
    """Raise DistributedError listing every inconsistency in `launch`, before any collective runs.

    Checks: RANK and WORLD_SIZE both set, 0 <= RANK < WORLD_SIZE, LOCAL_RANK < LOCAL_WORLD_SIZE,
    LOCAL_WORLD_SIZE <= WORLD_SIZE, and a rendezvous address (MASTER_ADDR, MASTER_PORT in
    1..65535) when there is more than one process; sizes and ranks that fit torch's C ints, and a
    MASTER_ADDR without NUL bytes, whitespace or control characters. Device checks (LOCAL_RANK within the visible
    GPUs) need torch and live in `torchplace.dist.init`.
    """
    if launch.launcher is None:
        return
    if launch.launcher == "lightning":
        raise DistributedError(lightning_problem(launch))
    rank_var, world_var, lrank_var, fix = variable_names(launch)
    problems: list[str] = []
    if launch.rank is None:
        problems.append(f"{rank_var} is not set (this process's global rank)")
    if launch.world_size is None:
        problems.append(f"{world_var} is not set (the number of processes in the job)")
    elif launch.world_size < 1:
        problems.append(f"{world_var}={launch.world_size} must be at least 1")
    elif launch.world_size > C_INT_MAX:
        problems.append(f"{world_var}={launch.world_size} is larger than torch.distributed can count "
                        f"({C_INT_MAX}, a C int)")
    elif launch.world_size > MAX_WORLD_SIZE:
        problems.append(f"{world_var}={launch.world_size} is more processes than any job has (torchplace joins "
                        f"at most {MAX_WORLD_SIZE}, keeping a store key per rank)")
    if launch.rank is not None and launch.world_size and launch.rank >= launch.world_size:
        problems.append(f"{rank_var}={launch.rank} is not below {world_var}={launch.world_size} "
                        f"(ranks run 0..{launch.world_size - 1})")
    lws = launch.local_world_size
    if launch.local_rank is not None and launch.local_rank > C_INT_MAX:
        problems.append(f"{lrank_var}={launch.local_rank} is larger than a device index can be ({C_INT_MAX})")
    if launch.local_rank is not None and lws is not None and launch.local_rank >= lws:
        problems.append(f"{lrank_var}={launch.local_rank} is not below LOCAL_WORLD_SIZE={lws}")
    if lws is not None and launch.world_size and lws > launch.world_size:
        problems.append(f"LOCAL_WORLD_SIZE={lws} is larger than {world_var}={launch.world_size}")
    if launch.world_size and launch.world_size > 1:
        if not launch.master_addr:
            problems.append("MASTER_ADDR is not set (the host of rank 0's rendezvous store)")
        elif _bad_host(launch.master_addr):
            problems.append(f"MASTER_ADDR={_short(launch.master_addr)} {_bad_host(launch.master_addr)}; it "
                            "must be a host name or IP address of rank 0's host")
        if launch.master_port is None:
            problems.append("MASTER_PORT is not set (the rendezvous port)")
        elif not 1 <= launch.master_port <= 65535:
            problems.append(f"MASTER_PORT={launch.master_port} is not a usable port (1..65535)")
    if problems:
        raise DistributedError(
            f"The {launch.launcher} launch environment is inconsistent: " + "; ".join(problems)
            + f". Read: {launch.describe()}. Fix: {fix}")
