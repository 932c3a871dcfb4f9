"""`torchplace.dist`: a process group from torchrun's (or SLURM's) environment that never hangs silently.

    info = torchplace.dist.init()            # validated env, device set, group made
    torchplace.dist.health_check(timeout=60) # names ranks that do not answer
    ...
    report = torchplace.dist.stragglers(step_seconds)   # slow ranks, for load balancing
    torchplace.dist.teardown()               # also runs at exit

What `init` does, in order, and why:
1. Reads RANK/WORLD_SIZE/LOCAL_RANK/... (`hardware.launch`) and checks them before any
   network call: a RANK past WORLD_SIZE would otherwise wait for a peer that never comes.
2. Chooses this rank's device (cuda:LOCAL_RANK when GPUs are visible), checks LOCAL_RANK
   against the visible GPUs, and sets it as the current device explicitly.
3. Joins a rendezvous store (rank 0 hosts it, or torchrun's agent does) and, through it,
   compares every rank's WORLD_SIZE, backend and GPU before creating the group (`join`). A
   missing rank is named within `join_timeout`, a mismatch at once, on every rank. Each start of
   the group (torchrun restarts workers on the same store) is an attempt with its own keys, so
   restarted workers never read the killed attempt's peer addresses (`join`'s docstring says how
   the ranks agree on it).
4. Creates the group with a backend that serves CPU and CUDA tensors ("cpu:gloo,cuda:nccl")
   and passes the device as `device_id`, so NCCL connects now rather than at the first
   collective, plus a small gloo group for the health check's monitored barrier.
Health checks and straggler reports live in `health`; known failures in `failures`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import gc
import os
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..hardware.accelerator import accelerator
from ..hardware.launch import LaunchEnv, check, read_launch_env
from .failures import explain, explained
from .group_state import LOCK, STATE, DistInfo, seconds
from .health import HealthReport, StragglerReport, health_check, stragglers
from .join import Joined, attempt_prefix, join, make_store

__all__ = ["DistInfo", "HealthReport", "StragglerReport", "init", "health_check", "stragglers",
           "teardown", "session", "explain", "explained", "info"]

_ACCELERATOR_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}


def info() -> DistInfo:
    """The record `init` returned in this process.

    Returns:
        This process's `DistInfo`.

    Raises:
        DistributedError: `torchplace.dist.init()` has not run in this process.

    Example:
        ```python
        import torchplace as tp

        tp.dist.init()
        print(tp.dist.info().rank)
        tp.dist.teardown()
        ```
    """
    if STATE.info is None:
        raise DistributedError("torchplace.dist.init() has not run in this process. Fix: call it first.")
    if not dist.is_initialized():
        how = "adopted from another library" if STATE.info.adopted else "made by torchplace.dist.init()"
        raise DistributedError(
            f"The process group torchplace recorded (rank {STATE.info.rank} of {STATE.info.world_size}, {how}) "
            "was destroyed outside torchplace (torch.distributed.destroy_process_group, e.g. by Lightning's or "
            "accelerate's teardown).\n"
            "Fix: call torchplace.dist.init() again to make or adopt a group.\n"
            "Or: leave teardown to torchplace.dist.teardown().")
    return STATE.info


def init(*, backend: str | None = None, device: str | torch.device | None = None,
         timeout: float | _dt.timedelta | None = None, join_timeout: float | _dt.timedelta = 300.0,
         env: Mapping[str, str] | None = None) -> DistInfo:
    """Create the default process group from the launcher's environment, validated first.

    RANK, WORLD_SIZE, LOCAL_RANK and the rest are checked before any network call; every rank's
    world size, backend and GPU are compared through the rendezvous store before the group is
    made, so a missing or mismatched rank is named instead of hanging. Without a launcher (a plain
    `python script.py`), makes a group of one process. When another library already made the
    default group (Lightning Fabric, Accelerate), adopts it instead (`info.adopted`), so
    `health_check()` and `stragglers()` work on it. A second call returns the same record.

    Args:
        backend: default "cpu:gloo,cuda:nccl" on a GPU (CPU and CUDA tensors both work),
            "gloo" on CPU.
        device: default cuda:LOCAL_RANK when GPUs are visible, else cpu.
        timeout: how long a collective may take before it fails (torch's default if None).
        join_timeout: how long to wait for every rank to join before naming the missing ones.
        env: the environment to read (default os.environ).

    Returns:
        This process's `DistInfo`.

    Raises:
        DistributedError: an inconsistent launch environment (a RANK past WORLD_SIZE, a
            LOCAL_RANK without a GPU), ranks that do not join within `join_timeout`, or ranks that
            disagree; the message names the ranks and the fix.
        DeviceError: `device` does not exist here.

    Example:
        ```python
        import torchplace as tp

        info = tp.dist.init()  # under torchrun: this rank's GPU and group; alone: a group of one
        print(f"rank {info.rank} of {info.world_size} on {info.device}")
        tp.dist.teardown()
        ```
    """
    with LOCK:
        if STATE.info is not None and dist.is_initialized():
            return STATE.info
        environ = os.environ if env is None else env
        if dist.is_initialized():
            return _adopt(device, environ)
        launch = read_launch_env(environ)
        check(launch)
        single = not launch.launched
        rank = 0 if single else int(launch.rank or 0)
        world = 1 if single else int(launch.world_size or 1)
        local_rank = launch.local_rank if launch.local_rank is not None else (0 if world == 1 else None)
        dev = _choose_device(device, launch, local_rank, environ)
        chosen = backend or ("cpu:gloo,cuda:nccl" if dev.type == "cuda" else
                             f"cpu:gloo,{dev.type}:{_ACCELERATOR_BACKENDS[dev.type]}"
                             if dev.type in _ACCELERATOR_BACKENDS else "gloo")
        join_s = seconds(join_timeout, 300.0)
        with explained(launch):
            store = dist.HashStore() if single else _connect_store(launch, rank, world, join_s)
        if single:
            joined = Joined(attempt=1, restarted=launch.restart_count > 0,
                            store=dist.PrefixStore(attempt_prefix(1), store))
        else:
            joined = join(store, launch, rank, world, dev, chosen, join_s)
        own = joined.store
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = _dt.timedelta(seconds=seconds(timeout, 0))
        if dev.type != "cpu":
            kwargs["device_id"] = dev
        with explained(launch):
            # on the attempt's own keys: a restarted attempt must not read the killed one's peer addresses
            dist.init_process_group(chosen, store=dist.PrefixStore("group/", own), rank=rank, world_size=world,
                                    **kwargs)
            try:
                gloo = dist.group.WORLD if chosen == "gloo" else dist.new_group(backend="gloo")
            except BaseException:
                dist.destroy_process_group()  # no half-made group left behind
                raise
        STATE.info = DistInfo(rank=rank, world_size=world, local_rank=local_rank,
                               local_world_size=launch.local_world_size if not single else 1,
                               device=dev, backend=chosen, launcher=launch.launcher,
                               node_rank=launch.node_rank, hostname=socket.gethostname(),
                               attempt=joined.attempt - 1, restarted=joined.restarted or joined.attempt > 1)
        STATE.launch, STATE.store, STATE.gloo = launch, own, gloo
        STATE.checks, STATE.broken = 0, False
        if not STATE.atexit_registered:
            atexit.register(teardown)
            STATE.atexit_registered = True
        return STATE.info


def _connect_store(launch: LaunchEnv, rank: int, world: int, join_s: float) -> Any:
    """`make_store` with a deadline. torch's store client, once its TCP connection is accepted,
    waits for the server's answer with no time limit, so a program at MASTER_ADDR:MASTER_PORT
    that accepts and stays silent would hang init forever; here it is named after join_s + 2 s.
    (The waiting thread is left behind, blocked; it holds no lock of ours.)"""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = make_store(launch, rank, world, join_s)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=connect, name="torchplace-store-connect", daemon=True)
    thread.start()
    thread.join(join_s + 2.0)
    if thread.is_alive():
        raise DistributedError(
            f"rank {rank} (RANK={launch.rank}, WORLD_SIZE={world}) connected to MASTER_ADDR={launch.master_addr!r} "
            f"MASTER_PORT={launch.master_port}, but nothing answered there within {join_s + 2.0:.0f} s: what "
            "listens on that port is not a torch.distributed rendezvous store, or it is stuck.\n"
            "Fix: set MASTER_PORT to a port only this job uses.\n"
            "Or: launch with `torchplace run` / `torchrun --standalone`, which choose a free port.")
    if "error" in box:
        raise box["error"]
    return box["store"]


def _adopt(device: str | torch.device | None, environ: Mapping[str, str]) -> DistInfo:
    """Take on the default group another library made (Lightning Fabric, Accelerate, plain torch).

    Its rank, size and backend are read from the group itself; the device is the one asked for,
    else this rank's current accelerator device (those libraries set it), else cpu. A small gloo
    group is added for the health check (a collective: every rank calls init, as it would anyway).
    teardown() later leaves the adopted group alone: its maker destroys it.
    """
    launch = read_launch_env(environ)
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    kind, count = accelerator()
    if device is not None:
        dev = torch.device(device)
    elif kind is not None and count and any(name in backend for name in _ACCELERATOR_BACKENDS.values()):
        dev = torch.device(kind, getattr(torch, kind).current_device())
    else:
        dev = torch.device("cpu")
    if dev.type != "cpu" and launch.local_rank is not None and dev.index not in (None, launch.local_rank):
        raise DistributedError(
            f"The existing process group's rank {rank} uses {dev}, but LOCAL_RANK={launch.local_rank}, "
            f"so this rank would use another rank's GPU. Fix: call torch.{dev.type}.set_device("
            f"{launch.local_rank}) before making the group, or pass device='{dev.type}:{launch.local_rank}'.")
    gloo = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    local_rank, local_world = launch.local_rank, launch.local_world_size
    if local_world is None and world > 1:  # mp.spawn (imagenet's --multiprocessing-distributed): no launcher said
        hosts: list[Any] = [None] * world  # how many ranks share this host, so count them (for the threads' plan)
        dist.all_gather_object(hosts, socket.gethostname(), group=gloo)
        mine = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        local_world, local_rank = len(mine), mine.index(rank) if local_rank is None else local_rank
    store = dist.distributed_c10d._get_default_store()  # the group's own store; torch has no public getter
    STATE.info = DistInfo(rank=rank, world_size=world, local_rank=local_rank,
                          local_world_size=local_world, device=dev, backend=backend,
                          launcher=launch.launcher, node_rank=launch.node_rank,
                          hostname=socket.gethostname(), adopted=True)
    STATE.launch, STATE.store, STATE.gloo = launch, dist.PrefixStore("torchplace/adopted/", store), gloo
    STATE.checks, STATE.broken = 0, False
    return STATE.info


def _visible_summary(environ: Mapping[str, str]) -> str:
    try:
        from ..hardware.visible import map_visible

        return map_visible(environ.get("CUDA_VISIBLE_DEVICES"), None, environ.get("CUDA_DEVICE_ORDER")).summary()
    except Exception:  # NVML missing: fall back to the raw variable
        return f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES')!r}"


def _choose_device(device: str | torch.device | None, launch: LaunchEnv, local_rank: int | None,
                   environ: Mapping[str, str]) -> torch.device:
    """This rank's device, checked against what is visible, and made current."""
    lrank_var = "SLURM_LOCALID" if launch.launcher == "slurm" else "LOCAL_RANK"
    if device is None:
        kind, count = accelerator()
        if kind is None or count == 0:
            return torch.device("cpu")
        if local_rank is None:
            raise DistributedError(
                f"{lrank_var} is not set, so torchplace cannot tell which of the {count} visible "
                f"{kind} devices belongs to this rank ({launch.describe()}). Fix: launch with torchrun "
                "or `torchplace run`, which set LOCAL_RANK, or pass device='cuda:K' to init().")
        if launch.local_world_size is not None and launch.local_world_size > count:
            raise DistributedError(
                f"LOCAL_WORLD_SIZE={launch.local_world_size} processes run on this node but only {count} "
                f"{kind} device(s) are visible ({_visible_summary(environ)}), so ranks would share a GPU, "
                "which NCCL refuses. Fix: start one process per GPU (torchrun --nproc-per-node "
                f"{count}, or `torchplace run --gpus {launch.local_world_size}` on a machine with that many).")
        dev = torch.device(kind, local_rank)
    else:
        dev = torch.device(device)
        if dev.type == "cpu":
            return torch.device("cpu")
        kind, count = accelerator()
        if kind != dev.type:
            raise DistributedError(f"device={str(device)!r} was asked for, but this torch build sees "
                                   f"{'no accelerator' if kind is None else kind + ' devices'}. Fix: "
                                   "pass device='cpu' or one of the visible devices.")
        if dev.index is None:
            if local_rank is None:
                raise DistributedError(f"device={str(device)!r} has no index and {lrank_var} is not set. "
                                       f"Fix: pass an indexed device such as '{dev.type}:0'.")
            dev = torch.device(dev.type, local_rank)
    if dev.index is not None and dev.index >= count:
        raise DistributedError(
            f"{lrank_var}={local_rank} selects {dev}, but only {count} {dev.type} device(s) are visible "
            f"({_visible_summary(environ)}; LOCAL_WORLD_SIZE={launch.local_world_size}). Fix: start at "
            f"most {count} process(es) per node (torchrun --nproc-per-node {count}), or make more GPUs "
            "visible (`torchplace run --gpus N` sets CUDA_VISIBLE_DEVICES for you).")
    getattr(torch, dev.type).set_device(dev)
    return dev


def teardown(timeout: float = 30.0) -> None:
    """Destroy every process group torchplace made (idempotent; also runs at exit).

    A group whose collectives timed out (a failed health check) is aborted rather than destroyed,
    and destruction has a deadline when called from the program, so a stuck peer cannot keep this
    process from exiting. A group adopted from another library is left to it.

    Args:
        timeout: seconds to wait for the groups to be destroyed before giving up on them.

    Example:
        ```python
        import torchplace as tp

        tp.dist.init()
        try:
            pass  # train
        finally:
            tp.dist.teardown()
        ```
    """
    with LOCK:
        was_ours = STATE.info is not None and not STATE.info.adopted  # an adopted group is its maker's
        broken = STATE.broken
        STATE.info, STATE.store, STATE.gloo, STATE.launch = None, None, None, None
        STATE.broken = False
    if not was_ours or not dist.is_initialized():
        return
    if broken and _abort():
        return
    done = threading.Event()

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # destroy_process_group only unregisters the groups: gloo's worker threads, its transport loop and the
        # store's server live on until the last reference goes (no shutdown() or abort() stops them). Groups held
        # by garbage (a DDP model in a reference cycle) go now, their threads joined while the interpreter is
        # whole, rather than in interpreter shutdown, where a worker freeing a Python tensor aborts the process.
        gc.collect()
        done.set()

    try:
        threading.Thread(target=destroy, name="torchplace-teardown", daemon=True).start()
    except RuntimeError:  # Python >= 3.12 starts no thread at interpreter exit (atexit): no deadline
        destroy()
    if not done.wait(timeout) and not _abort():
        print(f"torchplace.dist.teardown: the process group did not shut down within {timeout:.0f} s "
              "(a collective is still stuck); exiting without it.", file=sys.stderr, flush=True)


def _abort() -> bool:
    """Abort all groups (NCCL communicators included) without waiting for peers."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return False
    try:
        abort()
    except Exception:
        return False
    return True


@contextlib.contextmanager
def session(**kwargs: Any) -> Iterator[DistInfo]:
    """`init(**kwargs)` for the block, then `teardown()` however it ends.

    Args:
        **kwargs: passed to `init` (`backend`, `device`, `timeout`, `join_timeout`, `env`).

    Returns:
        A context manager that yields the `DistInfo`.

    Raises:
        DistributedError: as `init`.

    Example:
        ```python
        import torchplace as tp

        with tp.dist.session(timeout=120) as info:
            print(info.rank, info.world_size)
        ```
    """
    record = init(**kwargs)
    try:
        yield record
    finally:
        teardown()
