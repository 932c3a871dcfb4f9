"""The join's attempts on a real store (torch's HashStore, ranks as threads): a restarted attempt
never reads the killed one's keys, and ranks agree on it even when their launchers' restart
counts differ (torchrun counts a membership change on the other nodes as no restart)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from torchplace.distributed.join import ATTEMPTS_KEY, join
from torchplace.errors import DistributedError
from torchplace.hardware.launch import LaunchEnv


def launch(rank: int, restarts: int = 0) -> LaunchEnv:
    return LaunchEnv(launcher="torchrun", rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                     master_addr="127.0.0.1", master_port=29500, restart_count=restarts)


def start(store, rank: int, results: dict, restarts: int = 0, timeout_s: float = 120.0) -> threading.Thread:
    def run() -> None:
        try:
            results[rank] = join(store, launch(rank, restarts), rank, 2, torch.device("cpu"), "gloo", timeout_s)
        except DistributedError as exc:
            results[rank] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_restarted_attempt_gets_its_own_keys_even_when_rank_1_comes_first():
    store = dist.HashStore()
    first: dict = {}
    for t in [start(store, 0, first), start(store, 1, first)]:
        t.join(120)
    assert [first[r].attempt for r in (0, 1)] == [1, 1] and not first[0].restarted
    first[0].store.set("group/0/addr", "the killed attempt's peer address")

    again: dict = {}
    early = start(store, 1, again)  # the restarted rank 1 comes before rank 0: attempt 1 is not its own
    early.join(0.5)
    assert early.is_alive()  # waits for rank 0's new attempt instead of joining the old one
    late = start(store, 0, again, restarts=1)  # only the node whose worker failed counts a restart
    for t in (early, late):
        t.join(120)
    assert [again[r].attempt for r in (0, 1)] == [2, 2]
    assert again[0].restarted and again[1].restarted  # rank 1's launcher counted none; rank 0's verdict says so
    assert not again[1].store.check(["group/0/addr"])  # nothing of attempt 1 is visible
    assert int(store.add(ATTEMPTS_KEY, 0)) == 2


def test_an_attempt_that_named_this_rank_missing_is_not_joined_later():
    store = dist.HashStore()
    lonely: dict = {}
    start(store, 0, lonely, timeout_s=0.3).join(120)
    assert "rank(s) 1" in str(lonely[0])  # attempt 1 failed: rank 1 never came
    results: dict = {}
    threads = [start(store, 1, results)]  # rank 1's restarted incarnation finds attempt 1 with a free slot
    threads[0].join(0.5)
    assert threads[0].is_alive()  # ... and the error naming it missing: it waits for the next attempt
    threads.append(start(store, 0, results))
    for t in threads:
        t.join(120)
    assert [results[r].attempt for r in (0, 1)] == [2, 2]


def test_a_rank_without_any_attempt_to_join_is_told_why():
    results: dict = {}
    start(dist.HashStore(), 1, results, timeout_s=0.2).join(120)
    with pytest.raises(DistributedError, match=r"Rank 1 of WORLD_SIZE=2 found no start of the group to join"):
        raise results[1]


def test_a_rank_that_loses_the_store_says_so_instead_of_a_traceback():
    """Rank 0's process hosts the store: when it is gone while rank 1 waits, rank 1 raises a
    DistributedError naming the store and rank 0, not torch's connection error."""
    import subprocess
    import sys
    from datetime import timedelta

    from ports import free_port

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", "import sys, time, datetime, torch.distributed as d; "
                             f"s = d.TCPStore('127.0.0.1', {port}, 2, True, datetime.timedelta(seconds=30), "
                             "wait_for_workers=False); print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=5))
        threading.Timer(0.5, host.kill).start()
        env = LaunchEnv(launcher="torchrun", rank=1, world_size=2, local_rank=1, local_world_size=2,
                        master_addr="127.0.0.1", master_port=port)
        with pytest.raises(DistributedError, match=f"lost the rendezvous store at 127.0.0.1:{port}"):
            join(client, env, 1, 2, torch.device("cpu"), "gloo", 20.0)
    finally:
        host.kill()
        host.wait()
