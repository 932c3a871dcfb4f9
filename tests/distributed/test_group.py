"""torchplace.dist on CPU with gloo: real process groups, no mocks.

In-process tests make a group of one. Tests marked slow start real jobs: torchrun with 2 and
3 processes through `torchplace run`, two torchrun launchers joined by c10d rendezvous on
localhost, and ranks started by hand with broken environments.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from ports import free_port  # tests/ports.py (pythonpath = tests)

from torchplace import dist as tdist
from torchplace.errors import DistributedError


@pytest.fixture
def group():
    yield
    tdist.teardown()


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# --------------------------------------------------------------------------- in-process


def test_plain_process_gets_a_group_of_one(group):
    info = tdist.init(env={}, device="cpu")
    assert (info.rank, info.world_size, info.launcher, info.backend) == (0, 1, None, "gloo")
    assert info.device == torch.device("cpu") and info.is_main
    assert tdist.init(env={}, device="cpu") is info  # a second call returns the same record
    assert tdist.info() is info
    report = tdist.health_check(timeout=120)
    assert report.world_size == 1 and report.backend == "gloo"
    straggle = tdist.stragglers([0.2, 0.4])
    assert straggle.step_times_s == [pytest.approx(0.3)] and straggle.slow_ranks == []
    assert "No straggler" in straggle.describe()
    tdist.teardown()
    assert not torch.distributed.is_initialized()
    tdist.teardown()  # idempotent
    with pytest.raises(DistributedError, match="has not run"):
        tdist.info()


def test_session_always_tears_down():
    with pytest.raises(ValueError):
        with tdist.session(env={}, device="cpu") as info:
            assert info.world_size == 1
            raise ValueError("training failed")
    assert not torch.distributed.is_initialized()


def test_bad_environment_is_refused_before_any_network_call(group):
    env = {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(DistributedError, match=r"RANK=2 is not below WORLD_SIZE=2"):
        tdist.init(env=env)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("change,match", [
    ({"WORLD_SIZE": "3000000000"}, "larger than torch.distributed can count"),  # was a raw TypeError
    ({"MASTER_ADDR": "127.0.0.1\x00evil"}, "contains a NUL byte"),
])
def test_values_torch_cannot_take_are_our_error(group, change, match):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **change}
    with pytest.raises(DistributedError, match=match):
        tdist.init(env=env, join_timeout=2)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("reply", [b"", b"HTTP/1.0 400 Bad Request\r\n\r\n" * 4, None])
def test_a_service_that_is_not_a_store_at_the_master_address_is_named(group, reply):
    """A plain TCP server (closes at once, or answers garbage) where the rendezvous store should be."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if reply is None:  # accepts and stays silent: torch's client would wait forever
                held.append(conn)
                continue
            with conn:
                if reply:
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(server.getsockname()[1])}
    try:
        with pytest.raises(DistributedError,
                           match=r"(?s)is not a torch.distributed rendezvous store.*Fix: set MASTER_PORT"):
            tdist.init(env=env, join_timeout=1 if reply is None else 2)
    finally:
        stop.set()
        thread.join(120)
        for conn in held:
            conn.close()
        server.close()
    assert not torch.distributed.is_initialized()


def test_a_device_this_build_lacks_is_named(group):
    if torch.cuda.is_available():
        pytest.skip("this build has CUDA")
    with pytest.raises(DistributedError,
                       match=r"device='cuda:0' was asked for, but this torch build sees no accelerator"):
        tdist.init(env={}, device="cuda:0")


def test_health_check_needs_init():
    with pytest.raises(DistributedError, match=r"call torchplace.dist.init\(\) first"):
        tdist.health_check(timeout=1)


def test_straggler_threshold_is_checked(group):
    tdist.init(env={}, device="cpu")
    with pytest.raises(DistributedError, match="threshold=0.9 must be above 1.0"):
        tdist.stragglers(0.1, threshold=0.9)


# --------------------------------------------------------------------------- torchrun jobs


@pytest.mark.slow
def test_two_ranks_through_torchplace_run(run_cli, scripts, child_env):
    out = run_cli(["run", "--gpus", "none", "--nproc", "2", "--", sys.executable,
                   str(scripts / "dist_worker.py"), "ok", "1", "3"], env=child_env())
    ranks = sorted(jsonl(out.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], out.stderr[-2000:]
    for r in ranks:
        assert (r["world_size"], r["device"], r["backend"], r["launcher"]) == (2, "cpu", "gloo", "torchrun")
        assert r["local_rank"] == r["rank"] and r["cuda_visible_devices"] == ""
        assert r["all_reduce"] == 3.0 and r["health_world"] == 2
        assert r["slow_ranks"] == [1] and r["step_times"] == [pytest.approx(0.1), pytest.approx(0.4)]
    assert out.returncode == 3  # rank 1's exit code, not torchrun's generic 1
    assert "rank 1 (local rank 1" in out.stderr and "with exit code 3" in out.stderr


@pytest.mark.slow
def test_health_check_names_a_rank_that_sleeps_forever(run_cli, scripts, child_env):
    out = run_cli(["run", "--gpus", "none", "--nproc", "3", "--", sys.executable,
                   str(scripts / "dist_worker.py"), "sleep", "1"], env=child_env(), timeout=180)
    lines = jsonl(out.stdout)
    assert sorted(r["rank"] for r in lines if r.get("phase") == "joined") == [0, 1, 2]
    errors = {r["rank"]: r["error"] for r in lines if "error" in r}
    assert sorted(errors) == [0, 2], out.stderr[-2000:]
    for rank, text in errors.items():
        assert f"Health check failed on rank {rank}: rank 1 did not answer within 4 s" in text
    assert out.returncode == 3  # the healthy ranks exit non-zero; torchrun then stops the sleeper


@pytest.mark.slow
def test_health_check_names_rank_0_when_it_is_the_one_stuck(run_cli, scripts, child_env):
    out = run_cli(["run", "--gpus", "none", "--nproc", "2", "--", sys.executable,
                   str(scripts / "dist_worker.py"), "sleep", "0"], env=child_env(), timeout=180)
    errors = [r for r in jsonl(out.stdout) if "error" in r]
    assert [r["rank"] for r in errors] == [1], out.stderr[-2000:]
    assert "rank 0 did not answer within 4 s" in errors[0]["error"]
    assert out.returncode == 3


@pytest.mark.slow
def test_two_launchers_join_by_c10d_rendezvous(scripts, child_env):
    """Two `torchplace run` launchers on one machine act as two nodes of one job."""
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", "1", "--nnodes", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "torchplace-test",
           "--", sys.executable, str(scripts / "dist_worker.py"), "ok"]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
             for _ in range(2)]
    results = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-1500:] for _, err in results]
    ranks = sorted((rec for out, _ in results for rec in jsonl(out)), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    assert all(r["world_size"] == 2 and r["local_rank"] == 0 and r["all_reduce"] == 3.0 for r in ranks)
    assert all((r["attempt"], r["restarted"]) == (0, False) for r in ranks)
    for r in ranks:  # doctor inside the job shows where this rank stands and where the ranks meet
        [finding] = r["doctor"]
        assert finding["title"] == (f"Inside a distributed job started by torchrun: rank {r['rank']} of 2, "
                                    f"node {r['node_rank']} of 2, local rank 0 of 1")
        # torchplace run gives a job over several nodes a store per start, so a restarted node can rejoin
        assert "rank 0 hosts it, a new one each time torchrun starts the workers" in finding["detail"]


# --------------------------------------------------------------------------- ranks started by hand


def start_rank(scripts, child_env, join_s: float = 120, **env: str) -> subprocess.Popen:
    """One rank of a job started by hand; it gives up on ranks that have not joined after JOIN_S."""
    return subprocess.Popen([sys.executable, str(scripts / "dist_worker.py"), "init", str(join_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(MASTER_ADDR="127.0.0.1", CUDA_VISIBLE_DEVICES="", **env))


@pytest.mark.slow
def test_mismatched_world_sizes_are_named_on_both_ranks(scripts, child_env):
    port = str(free_port())
    procs = [start_rank(scripts, child_env, RANK="0", WORLD_SIZE="2", MASTER_PORT=port),
             start_rank(scripts, child_env, RANK="1", WORLD_SIZE="3", MASTER_PORT=port)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for out in outs:
        [rec] = jsonl(out)
        assert "WORLD_SIZE differs between ranks" in rec["error"]
        assert "has WORLD_SIZE=2" in rec["error"] and "has WORLD_SIZE=3" in rec["error"]
    assert [p.returncode for p in procs] == [4, 4]


@pytest.mark.slow
def test_busy_port_and_missing_ranks(scripts, child_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start_rank(scripts, child_env, join_s=3, RANK="0", WORLD_SIZE="2", MASTER_PORT=str(port))
        [rec] = jsonl(proc.communicate(timeout=120)[0])
    assert f"Port {port} is already in use on this host" in rec["error"] and "MASTER_PORT" in rec["error"]
    lonely = start_rank(scripts, child_env, join_s=3, RANK="0", WORLD_SIZE="3", MASTER_PORT=str(free_port()))
    [rec] = jsonl(lonely.communicate(timeout=120)[0])
    assert "2 of WORLD_SIZE=3 ranks did not join within 3 s: rank(s) 1, 2" in rec["error"]


def _gloo_threads() -> list[str]:
    """This process's threads that gloo's process groups run (workers, transport loop)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if n.startswith(("pt_gloo", "gloo_"))]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc (Linux)")
def test_teardown_destroys_groups_that_only_garbage_still_holds(group):
    """destroy_process_group unregisters a group but its threads live while anything holds it (issue 28:
    alive into interpreter shutdown, where a gloo worker freeing a Python tensor aborts the process)."""
    tdist.init(env={}, device="cpu")
    held = weakref.ref(torch.distributed.group.WORLD)
    gc.disable()  # the cycle must still be there at teardown
    try:
        cycle: list = [torch.distributed.group.WORLD]
        cycle.append(cycle)
        del cycle
        started = time.monotonic()  # a thread names itself once it runs: wait for gloo's (hang bound only)
        while not _gloo_threads() and time.monotonic() - started < 120:
            time.sleep(0.05)
        assert _gloo_threads()
        tdist.teardown()
        assert held() is None and _gloo_threads() == []
    finally:
        gc.enable()
