"""The validated join: every rank announces itself on the rendezvous store before the group exists.

Rank 0 compares the announcements (WORLD_SIZE, backend, GPU) and publishes a verdict, so a
mismatch or a missing rank is reported on every rank by name, within a deadline, instead of
as a hang inside init_process_group or the first collective.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..hardware.launch_env import LaunchEnv


def make_store(launch: LaunchEnv, rank: int, world: int, timeout_s: float) -> Any:
    """The rendezvous store: torchrun's agent store when it hosts one, else rank 0 hosts it.

    Rank 0 does not wait for the others here (`join` does, and names who is missing).
    """
    addr, port = launch.master_addr or "127.0.0.1", int(launch.master_port or 0)
    timeout = _dt.timedelta(seconds=timeout_s)
    if launch.use_agent_store:
        return dist.TCPStore(addr, port, world, False, timeout)
    return dist.TCPStore(addr, port, world, rank == 0, timeout, wait_for_workers=False, multi_tenant=True)


def join(store: Any, launch: LaunchEnv, rank: int, world: int, dev: torch.device, backend: str,
          timeout_s: float) -> None:
    """Every rank announces itself; rank 0 compares them all and publishes a verdict.

    Catches, before any collective: two processes with the same RANK, ranks that disagree on
    WORLD_SIZE or backend, two ranks on one GPU, and ranks that never come (named).
    """
    me = {"rank": rank, "world_size": world, "backend": backend, "host": socket.gethostname(),
          "pid": os.getpid(), "device": str(dev), "gpu": _device_uuid(dev), "local_rank": launch.local_rank}
    if store.add(f"claims/{rank}", 1) > 1:
        message = (f"Two processes claim RANK={rank} (one is pid {os.getpid()} on {me['host']}). Each "
                   f"process needs its own RANK in 0..{world - 1}. Fix: let torchrun or `torchplace run` "
                   "assign ranks, or check the RANK values your launcher passes.")
        store.set("error", message)
        raise DistributedError(message)
    store.set(f"rank/{rank}", json.dumps(me))
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    delay, next_notice = 0.01, started + 30.0
    keys = [f"rank/{r}" for r in range(world)]
    while True:
        if store.check(["error"]):
            raise DistributedError(store.get("error").decode())
        if rank == 0:
            if store.check(keys):
                verdict = _compare([json.loads(store.get(k)) for k in keys], me)
                store.set("verdict", verdict)
                if verdict:
                    raise DistributedError(verdict)
                return
        else:
            if store.check(["verdict"]):
                verdict = store.get("verdict").decode()
                if verdict:
                    raise DistributedError(verdict)
                return
            if store.check(["rank/0"]):
                problem = _compare_pair(json.loads(store.get("rank/0")), me)
                if problem:
                    store.set("error", problem)
                    raise DistributedError(problem)
        now = time.monotonic()
        grace = 0.0 if rank == 0 else 3.0  # let rank 0's own verdict arrive first
        if now > deadline + grace:
            missing = [r for r in range(world) if not store.check([f"rank/{r}"])]
            named = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
            message = (f"{len(missing)} of WORLD_SIZE={world} ranks did not join within {timeout_s:.0f} s: "
                       f"rank(s) {named} (rendezvous {launch.master_addr}:{launch.master_port}). They did "
                       "not start, crashed before init(), or were launched with another MASTER_ADDR/"
                       "MASTER_PORT or WORLD_SIZE. Fix: read their logs; start every rank with the same "
                       "launcher command.")
            if rank == 0:
                store.set("error", message)
            raise DistributedError(message)
        if rank == 0 and launch.local_rank in (0, None) and now > next_notice:
            missing = [r for r in range(world) if not store.check([f"rank/{r}"])]
            print(f"torchplace.dist.init: waiting for rank(s) {missing[:32]} to join "
                  f"({now - started:.0f} s of {timeout_s:.0f} s)", file=sys.stderr, flush=True)
            next_notice = now + 30.0
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def _device_uuid(dev: torch.device) -> str | None:
    if dev.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_properties(dev).uuid)
    except (AttributeError, RuntimeError):
        return None


def _compare_pair(ref: dict[str, Any], me: dict[str, Any]) -> str:
    """A mismatch between rank 0 (`ref`) and this rank that would hang or break the group."""
    if ref["world_size"] != me["world_size"]:
        return (f"WORLD_SIZE differs between ranks: rank {ref['rank']} (pid {ref['pid']} on {ref['host']}) "
                f"has WORLD_SIZE={ref['world_size']}, rank {me['rank']} (pid {me['pid']} on {me['host']}) "
                f"has WORLD_SIZE={me['world_size']}. Collectives would wait for ranks that do not exist. "
                "Fix: launch every rank with the same WORLD_SIZE (torchrun's --nnodes x --nproc-per-node).")
    if ref["backend"] != me["backend"]:
        return (f"The backend differs between ranks: rank {ref['rank']} uses {ref['backend']!r}, rank "
                f"{me['rank']} uses {me['backend']!r} (one has GPUs visible, the other not?). Fix: make the "
                "same devices visible to every rank, or pass the same backend= to init().")
    return ""


def _compare(entries: list[dict[str, Any]], me: dict[str, Any]) -> str:
    """Rank 0's verdict over every rank's announcement: "" when all agree."""
    for entry in entries:
        problem = _compare_pair(me, entry)
        if problem:
            return problem
    seen: dict[tuple[str, str], int] = {}
    for entry in entries:
        if entry.get("gpu"):
            key = (entry["host"], entry["gpu"])
            if key in seen:
                return (f"Ranks {seen[key]} and {entry['rank']} both use GPU {entry['gpu']} on {entry['host']} "
                        f"(as {entry['device']}); NCCL needs one GPU per rank. Fix: give each process its "
                        "own LOCAL_RANK and CUDA_VISIBLE_DEVICES (`torchplace run --gpus N` does).")
            seen[key] = entry["rank"]
    return ""
