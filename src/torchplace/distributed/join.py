"""The validated join: every rank announces itself on the rendezvous store before the group exists.

Rank 0 compares the announcements (WORLD_SIZE, backend, GPU) and publishes a verdict, so a
mismatch or a missing rank is reported on every rank by name, within a deadline, instead of
as a hang inside init_process_group or the first collective.

Attempts. torchrun's agent store outlives the workers: when `--max-restarts` restarts them, the
new workers meet on the same store, where the killed attempt's keys (gloo's peer addresses, our
announcements) are still set. A restarted worker that reads them connects to a dead peer
("Gloo connectFullMesh failed ... Connection refused"). So every start of the group is an
*attempt* with its own key space, `torchplace/<attempt>/`, and the process group is made on that
prefix too. TORCHELASTIC_RESTART_COUNT cannot name the attempt: an agent whose worker failed
counts a restart, while the other nodes' agents restart theirs as a membership change, which
torchrun does not count, so the counts differ between nodes. The attempt is agreed through the
store instead: rank 0 opens the next one (an atomic counter); every other rank joins the newest
attempt in which its rank is still free (a taken slot means its own previous incarnation was
there) and moves on when a newer one opens.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..hardware.launch import LaunchEnv

#: the store key counting attempts (rank 0 of each start of the group adds one)
ATTEMPTS_KEY = "torchplace/attempts"
VERDICT_GRACE_S = 3.0  # rank 0 hosts the store: before leaving with an error, it waits this long for every
# rank that joined to read it, so each rank reports the group's error instead of a lost connection


def attempt_prefix(number: int) -> str:
    """The key space of attempt NUMBER (1 for the first start of the group on this store)."""
    return f"torchplace/{number}/"


@dataclass(frozen=True)
class Joined:
    """What the join agreed on: the attempt (1 = first on this store), whether any rank was
    restarted by its launcher, and the attempt's own store (a PrefixStore)."""

    attempt: int
    restarted: bool
    store: Any


def make_store(launch: LaunchEnv, rank: int, world: int, timeout_s: float) -> Any:
    """The rendezvous store: torchrun's agent store when it hosts one, else rank 0 hosts it.

    Rank 0 does not wait for the others here (`join` does, and names who is missing).
    """
    addr, port = launch.master_addr or "127.0.0.1", int(launch.master_port or 0)
    timeout = _dt.timedelta(seconds=timeout_s)
    if launch.use_agent_store:
        return dist.TCPStore(addr, port, world, False, timeout)
    return dist.TCPStore(addr, port, world, rank == 0, timeout, wait_for_workers=False, multi_tenant=True)


def join(base: Any, launch: LaunchEnv, rank: int, world: int, dev: torch.device, backend: str,
         timeout_s: float) -> Joined:
    """Every rank announces itself in this attempt; rank 0 compares them all and publishes a verdict.

    Catches, before any collective: ranks that disagree on WORLD_SIZE or backend, two ranks on
    one GPU, and ranks that never come (named). Returns the attempt everyone joined.
    """
    me = {"rank": rank, "world_size": world, "backend": backend, "host": socket.gethostname(),
          "pid": os.getpid(), "device": str(dev), "gpu": _device_uuid(dev), "local_rank": launch.local_rank,
          "restart_count": launch.restart_count}
    started = time.monotonic()
    keys = [f"rank/{r}" for r in range(world)]
    number, store = 0, None
    if rank == 0:
        number = int(base.add(ATTEMPTS_KEY, 1))
        store = dist.PrefixStore(attempt_prefix(number), base)
        store.set("rank/0", json.dumps(me))
    tried: set[int] = set()
    try:
        return _wait(base, launch, rank, world, me, keys, number, store, tried, started, timeout_s)
    except DistributedError:
        raise
    except RuntimeError as exc:  # the store went away (torch's DistNetworkError / DistStoreError are RuntimeErrors)
        where = f"{launch.master_addr or '127.0.0.1'}:{launch.master_port}"
        raise DistributedError(
            f"Rank {rank} lost the rendezvous store at {where} while joining ({str(exc).splitlines()[0][:200]}): "
            "rank 0, which hosts it, exited or became unreachable. Fix: read rank 0's log for its error; start "
            "every rank with the same launcher command.") from None


def _wait(base: Any, launch: LaunchEnv, rank: int, world: int, me: dict[str, Any], keys: list[str], number: int,
          store: Any, tried: set[int], started: float, timeout_s: float) -> Joined:
    """join()'s polling loop: follow rank 0's newest attempt until it decides."""
    deadline = started + timeout_s
    delay, next_notice = 0.01, started + 30.0
    while True:
        if rank != 0:
            newest = int(base.add(ATTEMPTS_KEY, 0))
            if newest > number and newest not in tried:  # rank 0 of a newer attempt started: go there
                tried.add(newest)
                candidate = dist.PrefixStore(attempt_prefix(newest), base)
                if int(candidate.add(f"claims/{rank}", 1)) == 1:
                    number, store = newest, candidate
                    store.set(f"rank/{rank}", json.dumps(me))
        if store is not None and rank != 0 and store.check(["missing"]) and \
                rank in json.loads(store.get("missing")):
            store = None  # a failed earlier attempt that named this rank missing: wait for the next one
        if store is not None:
            done = _step(store, rank, keys, me)
            if done is not None:
                return Joined(attempt=number, restarted=done, store=store)
        now = time.monotonic()
        grace = 0.0 if rank == 0 else 3.0  # let rank 0's own verdict arrive first
        if now > deadline + grace:
            raise DistributedError(_missing_message(store, launch, world, timeout_s, rank, tried))
        if rank == 0 and launch.local_rank in (0, None) and now > next_notice:
            missing = [r for r in range(world) if not store.check([f"rank/{r}"])]
            print(f"torchplace.dist.init: waiting for rank(s) {missing[:32]} to join "
                  f"({now - started:.0f} s of {timeout_s:.0f} s)", file=sys.stderr, flush=True)
            next_notice = now + 30.0
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def _step(store: Any, rank: int, keys: list[str], me: dict[str, Any]) -> bool | None:
    """One look at the attempt: None while undecided, else whether any rank was restarted.
    Raises the verdict or an error another rank published (rank 0 first lets the others read it)."""
    if store.check(["error"]):
        _leave(store, rank, keys, store.get("error").decode())
    if rank == 0:
        if not store.check(keys):
            return None
        entries = [json.loads(store.get(k)) for k in keys]
        problem = _compare(entries, me)
        restarted = any(int(e.get("restart_count") or 0) > 0 for e in entries)
        store.set("verdict", json.dumps({"error": problem, "restarted": restarted}))
        if problem:
            _leave(store, rank, keys, problem)
        return restarted
    if store.check(["verdict"]):
        verdict = json.loads(store.get("verdict"))
        if verdict["error"]:
            _leave(store, rank, keys, verdict["error"])
        return bool(verdict["restarted"])
    if store.check(["rank/0"]):
        problem = _compare_pair(json.loads(store.get("rank/0")), me)
        if problem:
            store.set("error", problem)
            _leave(store, rank, keys, problem)
    return None


def _leave(store: Any, rank: int, keys: list[str], problem: str) -> NoReturn:
    """Raise the group's error PROBLEM. Other ranks say they read it; rank 0, whose process hosts the store,
    first waits up to VERDICT_GRACE_S for every rank that joined to read it."""
    if rank != 0:
        store.set(f"read/{rank}", "1")
    else:
        others = [k.split("/")[1] for k in keys[1:] if store.check([k])]
        end = time.monotonic() + VERDICT_GRACE_S
        while others and time.monotonic() < end and not store.check([f"read/{r}" for r in others]):
            time.sleep(0.02)
    raise DistributedError(problem)


def _missing_message(store: Any, launch: LaunchEnv, world: int, timeout_s: float, rank: int,
                     tried: set[int]) -> str:
    where = f"rendezvous {launch.master_addr}:{launch.master_port}"
    if store is None:
        seen = (f"attempt(s) {sorted(tried)} had this rank's slot taken already (by this rank's previous "
                "incarnation, or by another process with the same RANK)" if tried else "no attempt opened")
        return (f"Rank {rank} of WORLD_SIZE={world} found no start of the group to join within {timeout_s:.0f} s "
                f"({where}: {seen}); rank 0 did not start, crashed before init(), or uses another "
                "MASTER_ADDR/MASTER_PORT. Fix: read rank 0's log; start every rank with the same launcher command.")
    missing = [r for r in range(world) if not store.check([f"rank/{r}"])]
    named = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
    message = (f"{len(missing)} of WORLD_SIZE={world} ranks did not join within {timeout_s:.0f} s: "
               f"rank(s) {named} ({where}). They did not start, crashed before init(), or were launched "
               "with another MASTER_ADDR/MASTER_PORT or WORLD_SIZE. Fix: read their logs; start every rank "
               "with the same launcher command.")
    if launch.launcher == "env":  # RANK/WORLD_SIZE from the environment, no launcher known to have started others
        message += (" No launcher started this process (RANK and WORLD_SIZE were set by hand, not by torchrun or "
                    "srun): if they are left over in the shell, unset them to run alone.")
    if rank == 0:
        store.set("missing", json.dumps(missing))
        store.set("error", message)
    return message


def _device_uuid(dev: torch.device) -> str | None:
    if dev.type != "cuda":
        return None
    try:
        # cuda-only: GPU UUIDs match NVML's records of NVIDIA GPUs
        return str(torch.cuda.get_device_properties(dev).uuid)  # cuda-only: NVML's UUIDs of NVIDIA GPUs
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
