"""Doctor checks about the distributed job this process is in: the rendezvous, read from the
launcher's variables (torchrun's, SLURM's) through `hardware.launch`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DistributedError
from ..hardware.launch import LaunchEnv, read_launch_env
from ..hardware.launch import check as check_launch_env
from .registry import Finding, check

if TYPE_CHECKING:
    from ..hardware.facts import Facts

_LAUNCHERS = {"torchrun": "torchrun", "slurm": "srun (SLURM)", "env": "RANK/WORLD_SIZE set by hand or another launcher",
              "mpi": "mpirun (MPI)", "lightning": "Lightning's launcher (it makes the process group in fit)"}


def _where(launch: LaunchEnv) -> str:
    node = f"node {launch.node_rank}" + (f" of {launch.nnodes}" if launch.nnodes else "") \
        if launch.node_rank is not None else "node ?"
    local = (f"local rank {launch.local_rank}" + (f" of {launch.local_world_size}" if launch.local_world_size else "")
             if launch.local_rank is not None else "no local rank")
    return f"rank {launch.rank} of {launch.world_size}, {node}, {local}"


def _store(launch: LaunchEnv) -> str:
    addr = f"{launch.master_addr}:{launch.master_port}"
    derived = "; ".join(f"{name} from the {how}" for name, how in launch.derived.items())
    if launch.launcher == "torchrun":
        host = ("torchrun's agent hosts it and keeps it across restarts" if launch.use_agent_store
                else "rank 0 hosts it, a new one each time torchrun starts the workers")
        restarts = launch.variables.get("TORCHELASTIC_MAX_RESTARTS")
        return (f"rendezvous store {addr} ({host}); run id {launch.run_id}; restart {launch.restart_count}"
                + (f" of at most {restarts}" if restarts else ""))
    return f"rendezvous store {addr} (rank 0 hosts it)" + (f"; {derived}" if derived else "")


@check
def check_rendezvous(facts: Facts) -> list[Finding]:
    """Inside a job: where this process stands and where the ranks meet; an inconsistent launch is an error.
    (localhost as the rendezvous of several nodes is not flagged: it is right for nodes on one host.)"""
    try:
        launch = read_launch_env(facts.env)
    except DistributedError as exc:
        return [Finding("launch.unreadable", "error", "The launcher's variables cannot be read", str(exc))]
    if not launch.launched:
        return []
    try:
        if launch.launcher != "lightning":  # no RANK until Lightning's fit: not a mistake (launch.py)
            check_launch_env(launch)
    except DistributedError as exc:
        return [Finding("launch.inconsistent", "error", f"The {launch.launcher} launch environment is inconsistent",
                        str(exc))]
    title = f"Inside a distributed job started by {_LAUNCHERS.get(launch.launcher or '', launch.launcher)}: " \
            f"{_where(launch)}"
    rdzv = dict(item.split("=", 1) for item in facts.env.get("TORCHPLACE_RDZV", "").split() if "=" in item)
    found = [Finding("launch.rendezvous", "info", title, _store(launch) + (
        f"; the nodes met through the {rdzv.get('backend', 'static')} rendezvous at {rdzv.get('endpoint', '?')}"
        f" (nnodes {rdzv.get('nnodes', '?')}, rdzv id {rdzv.get('id', 'none')}; torchplace run)" if rdzv else "")
        + ".")]
    if launch.launcher == "torchrun" and launch.use_agent_store and (launch.nnodes or 1) > 1:
        found.append(Finding(
            "launch.shared_store", "warning",
            f"A node of these {launch.nnodes} that dies and is started again cannot rejoin the job",
            "torchrun's agents share one rendezvous store with the workers (TORCHELASTIC_USE_AGENT_STORE=True, "
            "torch's default since 2.5); a restarted agent waits for the store's address, which the agent of node "
            "0 publishes only in its first round, so the job fails instead of continuing. Fix: set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node (`torchplace run --nnodes ...` "
            "sets it)."))
    return found
