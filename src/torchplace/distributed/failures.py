"""Known distributed failures, turned into messages that say what happened and what to do.

torch reports a port in use, a rank that never connected, or a collective that timed out as
C++ exception text ("code: -98, name: EADDRINUSE", "Timed out after 30 seconds waiting for
clients. 1/2 clients joined.", "Watchdog caught collective operation timeout"). `explain`
matches those texts and returns a DistributedError naming the variables and values involved;
`explained()` applies it to a block of code.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

from ..errors import DistributedError
from ..hardware.launch import LaunchEnv


def _where(launch: LaunchEnv | None) -> str:
    if launch is None or launch.master_addr is None:
        return "the rendezvous address (MASTER_ADDR:MASTER_PORT)"
    return f"MASTER_ADDR={launch.master_addr!r} MASTER_PORT={launch.master_port}"


def _rank(launch: LaunchEnv | None) -> str:
    if launch is None or launch.rank is None:
        return "this process"
    return f"rank {launch.rank} (RANK={launch.rank}, WORLD_SIZE={launch.world_size})"


def port_user(port: int) -> str | None:
    """Which local process listens on `port` ("pid 123 (python)"), when the OS will say."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    name = psutil.Process(conn.pid).name()
                except psutil.Error:
                    name = "?"
                return f"pid {conn.pid} ({name})"
    except Exception:  # no permission, or psutil missing: the message goes without it
        return None
    return None


def explain(exc: BaseException | str, launch: LaunchEnv | None = None,
            timeout_s: float | None = None) -> DistributedError | None:
    """A `DistributedError` with the fix for a known failure in EXC, else None.

    Known failures: the rendezvous port already in use (naming the process that holds it), a
    master that refuses connections, a collective that timed out, a store whose peer went away,
    an invalid device ordinal, NCCL errors.

    Args:
        exc: an exception, or its text.
        launch: the launch environment, to name hosts and ports in the message (default: read it).
        timeout_s: the timeout that ran out, for the message.

    Returns:
        The better error, or None when the failure is not one torchplace knows.

    Example:
        ```python
        import torchplace as tp

        err = tp.dist.explain(RuntimeError("The server socket has failed to listen on any local "
                                           "network address. port: 29500, useIpv6: 0, code: -98, "
                                           "name: EADDRINUSE, message: address already in use"))
        print(err)
        ```
    """
    text = str(exc)
    port = launch.master_port if launch else None
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        m = re.search(r"port: (\d+)", text)
        port = int(m.group(1)) if m else port
        who = port_user(port) if port else None
        return DistributedError(
            f"Port {port} is already in use on this host{f' by {who}' if who else ''}, so rank 0 cannot "
            f"open the rendezvous store there ({_where(launch)}). Often an earlier job still runs or "
            "two jobs chose the default 29500, or two processes of this job both have RANK=0. "
            "Fix: stop that process, set MASTER_PORT to a free "
            "port, or launch with `torchplace run` / `torchrun --standalone`, which choose a free port.")
    m = re.search(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", text)
    if m:
        return DistributedError(
            f"Only {m.group(2)} of WORLD_SIZE={m.group(3)} processes connected to {_where(launch)} "
            f"within {m.group(1)} s. The others did not start, crashed before connecting, or were given "
            "another MASTER_ADDR/MASTER_PORT or WORLD_SIZE. Fix: check that every rank was launched "
            "with the same values (torchrun or `torchplace run` sets them together), and their logs.")
    m = re.search(r"connectFullMesh failed.*?remote=\[?([^\]\s]+)\]?:(\d+)", text, re.S)
    if m:  # gloo's peer-to-peer mesh, not the store: a peer's published address does not answer
        return DistributedError(
            f"{_rank(launch)} reached the rendezvous store, but could not connect to another rank's gloo "
            f"address {m.group(1)}:{m.group(2)} (connection refused or timed out). That rank died while the "
            "group formed, or its address is not reachable from here (another network interface, a "
            "firewall). Fix: read the other ranks' logs; across hosts set GLOO_SOCKET_IFNAME to the "
            "interface that reaches them.")
    m = re.search(r"client socket has timed out after (\d+)ms while trying to connect to \(([^,]+), (\d+)\)", text)
    if m or ("Connection refused" in text and "connect" in text):
        host, cport = (m.group(2), m.group(3)) if m else (launch.master_addr if launch else "?", port)
        return DistributedError(
            f"{_rank(launch)} could not reach the rendezvous store at {host}:{cport}"
            + (f" within {int(m.group(1)) / 1000:.0f} s" if m else "")
            + ". Rank 0 (which hosts it) has not started, died, or listens elsewhere. Fix: check that "
            "MASTER_ADDR names rank 0's host as seen from this one, that MASTER_PORT matches and no "
            "firewall blocks it, and rank 0's log.")
    if ("Watchdog caught collective operation timeout" in text or "before timing out" in text
            or re.search(r"Timed out waiting \d+ms for (send|recv) operation", text)
            or re.search(r"\bwait timeout after\b", text)):
        op = re.search(r"OpType=(\w+)", text)
        seq = re.search(r"SeqNum=(\d+)", text)
        what = f"{op.group(1)}" + (f" #{seq.group(1)}" if seq else "") if op else "A collective"
        after = f" within {timeout_s:.0f} s" if timeout_s else ""
        return DistributedError(
            f"{what} did not finish{after} on {_rank(launch)}: another rank is stuck (an endless loop, "
            "a deadlock, a slow data loader), died, or called a different collective or the same one "
            "with other shapes. Fix: call torchplace.dist.health_check(timeout=60) to name the rank, "
            "read that rank's log (NCCL_DEBUG=INFO for NCCL), and make every rank run the same "
            "collectives in the same order; raising the timeout only hides a stuck rank longer.")
    m = re.search(r"Duplicate GPU detected\s*:\s*rank (\d+) and rank (\d+) both on CUDA device (\w+)", text)
    if m:
        return DistributedError(
            f"Ranks {m.group(1)} and {m.group(2)} both use CUDA device {m.group(3)}; NCCL needs one GPU "
            "per rank. Fix: start one process per visible GPU (`torchplace run --gpus N`, or torchrun "
            "--nproc-per-node equal to the GPU count) and let torchplace.dist.init() choose "
            "cuda:LOCAL_RANK.")
    if "Ping failed" in text or "invalid value returned from server" in text or (
            type(exc).__name__ == "DistNetworkError" and ("Connection reset" in text or "EOF" in text
                                                          or "Broken pipe" in text)):
        return DistributedError(
            f"{_rank(launch)} reached {_where(launch)}, but what answers there is not a torch.distributed "
            f"rendezvous store ({text.splitlines()[0][:160]}). Another program (a web server, a database, "
            "an older job) holds that port. Fix: set MASTER_PORT to a port only this job uses, or launch "
            "with `torchplace run` / `torchrun --standalone`, which choose a free port.")
    if "invalid device ordinal" in text:
        return DistributedError(
            f"{_rank(launch)} asked for a CUDA device that is not visible (LOCAL_RANK="
            f"{launch.local_rank if launch else '?'}). Fix: start one process per visible GPU.")
    if "NCCL error" in text or "ncclSystemError" in text or "ncclInternalError" in text:
        return DistributedError(
            f"NCCL failed on {_rank(launch)}: {text.splitlines()[0][:300]}. Fix: rerun with "
            "NCCL_DEBUG=INFO to see the cause; common ones are a too small /dev/shm in containers "
            "(--shm-size / --ipc=host), the wrong network interface (NCCL_SOCKET_IFNAME), or a rank "
            "that died (see its log).")
    return None


@contextlib.contextmanager
def explained(launch: LaunchEnv | None = None) -> Iterator[None]:
    """Re-raise known distributed failures inside the block as `DistributedError` with the fix.

    Anything else passes through unchanged.

    Args:
        launch: the launch environment, for the messages (default: read it).

    Returns:
        A context manager.

    Raises:
        DistributedError: a known failure happened inside the block (the original is its cause).

    Example:
        ```python
        import torchplace as tp

        with tp.dist.explained():
            info = tp.dist.init()  # a busy port or a lost peer here says what to do
        tp.dist.teardown()
        ```
    """
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as exc:
        better = explain(exc, launch)
        if better is None:
            raise
        raise better from exc


def _node(addr: str, pid: int | None, rank: int | None) -> str:
    return f"{addr!r} (agent pid {pid}" + (f", node rank {rank})" if rank is not None else ")")


def rendezvous_timed_out(*, nnodes: str, timeout_s: float, endpoint: str | None,
                         this: tuple[str, int, int | None] | None,
                         lost: Sequence[tuple[str, int, int | None]]) -> DistributedError:
    """The error for a rendezvous of torchrun's agents that timed out (RendezvousTimeoutError).

    `this` and `lost` are (address, agent pid, node rank or None): this node, and the nodes whose
    heartbeats stopped (torch's dynamic rendezvous dropped them as dead) before the time ran out.
    """
    here = f" This node is {_node(*this)}." if this else ""
    waited = f"The rendezvous timed out: for {timeout_s:g} s (join_timeout) the job waited for its nodes " \
             f"(--nnodes {nnodes})"
    if lost:
        names = ", ".join(_node(*node) for node in lost)
        return DistributedError(
            f"{waited}, but node{'s' if len(lost) > 1 else ''} {names} stopped sending rendezvous heartbeats and did "
            f"not come back: it died, lost its network, or its torchplace run was stopped.{here} Fix: start "
            "`torchplace run` with the same options on that node again within the join timeout (it rejoins and the "
            "job starts again, from its newest checkpoint when it keeps some), or give --nnodes MIN:MAX (e.g. 1:2) "
            "so the job goes on with the nodes it has; --rdzv-conf join_timeout=SECONDS sets how long it waits.")
    return DistributedError(
        f"{waited}, and not enough joined{f' at {endpoint}' if endpoint else ''}.{here} The others were not "
        "started, cannot reach the rendezvous endpoint, or were given another --rdzv-id, --rdzv-endpoint or "
        "--nnodes. Fix: start `torchplace run` with the same rendezvous options on every node (read their output), "
        "or give --nnodes MIN:MAX so the job starts with fewer; --rdzv-conf join_timeout=SECONDS sets how long it "
        "waits.")
