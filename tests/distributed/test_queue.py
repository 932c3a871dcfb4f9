"""The GPU queue's file protocol with many processes, as three local users when run as root (setpriv),
killed with SIGKILL at random points, on the real h200x1 snapshot (one H200, 140.4 GiB):

- whole GPU: served FIFO within a user and round robin across users, exactly in `serve_order`'s order;
  a waiter killed leaves the queue, a holder killed lets the head in; every survivor is served;
- memory reservations mixed with whole-GPU requests: at no moment do the held reservations exceed the
  GPU's memory, and a whole-GPU lease never overlaps anything;
- a waiter is refused when its --wait runs out, and leaves the queue.
Counts are small (CI on two cores); the only time bounds are hang guards (>= 120 s).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from snapshots import load_snapshot_dict, snapshot_path

from torchplace.distributed.leases import LeaseDir
from torchplace.distributed.queue import last_served, waiters
from torchplace.errors import LeaseError
from torchplace.hardware.topology import Topology
from torchplace.policy.fairness import serve_order

SNAPSHOT = str(snapshot_path("h200x1"))
CAPACITY = Topology.from_dict(load_snapshot_dict("h200x1")).gpus[0].memory_total_bytes  # no processes in it
GIB = 2**30
HANG_S = 150
AS_USERS = os.geteuid() == 0 and shutil.which("setpriv") is not None
USERS = [65531, 65532, 65533] if AS_USERS else [os.getuid()] * 3


@pytest.fixture
def world():
    """A lease folder and a log that three users can reach: under a root-owned 1777 folder in /tmp."""
    base = Path(tempfile.mkdtemp(prefix="torchplace-queue-", dir="/tmp"))
    os.chmod(base, 0o1777)
    (base / "leases").mkdir()
    os.chmod(base / "leases", 0o1777)  # what the admin makes: `sudo install -d -m 1777 -o root -g root DIR`
    log = base / "log"
    log.touch()
    os.chmod(log, 0o666)
    yield base / "leases", log
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def spawn(world, scripts, child_env):
    """Start queue_worker.py as `uid` (setpriv when it is another user); every process is killed at the end."""
    folder, log = world
    env = child_env(TORCHPLACE_LEASE_DIR=str(folder))
    procs: list[subprocess.Popen] = []

    def start(uid: int, tag: str, *, hold: float = 0.2, wait: float = HANG_S, memory: str = "whole"):
        argv = [sys.executable, str(scripts / "queue_worker.py"), SNAPSHOT, str(log), str(hold), str(wait), memory, tag]
        if uid != os.getuid():
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=HANG_S)


def until(what, bound: float = HANG_S):
    """Poll `what()` until it is true; a hang guard, not a timing."""
    end = time.monotonic() + bound
    while not (value := what()):
        assert time.monotonic() < end, f"gave up after {bound} s waiting for {what.__doc__ or what}"
        time.sleep(0.02)
    return value


def lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()]


def test_whole_gpu_queue_is_fifo_within_a_user_and_round_robin_across_users(world, spawn):
    folder, log = world
    leases = LeaseDir(folder)
    blocker = spawn(os.getuid(), "blocker", hold=600, wait=0)
    until(lambda: any(x[0] == "ACQ" for x in lines(log)))
    a, b, c = USERS
    plan = [(a, "a0"), (a, "a1"), (b, "b0"), (a, "a2"), (c, "c0"), (b, "b1"), (c, "c1"), (a, "a3")]
    tags = {}
    for uid, tag in plan:  # one at a time, so that the order of joining is known
        proc = spawn(uid, tag)
        tags[proc.pid] = (tag, proc)
        until(lambda proc=proc: proc.pid in {w.pid for w in waiters(leases)})
    victims = random.Random(36).sample(sorted(tags), 2)
    for pid in victims:
        tags[pid][1].send_signal(signal.SIGKILL)
        tags[pid][1].wait(timeout=HANG_S)
    until(lambda: not {w.pid for w in waiters(leases)} & set(victims))  # gone at once: their lock went with them
    queued = waiters(leases)
    tag_of = {w.name: tags[w.pid][0] for w in queued}
    expected = [tag_of[ask.key] for ask in serve_order([w.ask() for w in queued], last_served(leases))]
    shown = json.loads(subprocess.run([sys.executable, "-m", "torchplace", "queue", "--json", "--dir", str(folder)],
                                      capture_output=True, text=True, timeout=HANG_S, check=True).stdout)
    assert [tags[r["pid"]][0] for r in shown["queue"]] == expected
    assert [r["position"] for r in shown["queue"]] == list(range(1, len(expected) + 1))

    blocker.send_signal(signal.SIGKILL)  # a holder killed: the head is served
    for pid, (tag, proc) in tags.items():
        if pid not in victims:
            assert proc.wait(timeout=HANG_S) == 0, proc.stderr.read()[-800:] if proc.stderr else tag
    served = [x[1] for x in lines(log) if x[0] == "ACQ" and x[1] != "blocker"]
    assert served == expected
    for uid in set(USERS):  # FIFO within each user, in the order they joined
        mine = [t for u, t in plan if u == uid and t in served]
        assert [t for t in served if t in mine] == mine
    if AS_USERS:  # round robin: a, b, c each once before anyone's second job
        assert {served[0][0], served[1][0], served[2][0]} == {"a", "b", "c"}
    # the files the killed waiters left are gone too: removed by a live reader once their flock was free
    assert waiters(leases) == [] and not [n for n in os.listdir(folder) if n.startswith("queue.")]


def test_memory_reservations_never_exceed_the_gpu_and_whole_leases_never_overlap(world, spawn):
    folder, log = world
    rng = random.Random(7)
    sizes = ["30GiB", "45GiB", "60GiB", "whole"]
    procs = {}
    for i in range(12):
        proc = spawn(USERS[i % 3], f"j{i}", hold=0.3, memory=sizes[i % 4])
        procs[proc.pid] = proc
    killed_at: dict[int, float] = {}

    def kill(pid: int) -> None:
        killed_at[pid] = time.monotonic()  # a lock can only go after this instant
        procs[pid].kill()

    leases = LeaseDir(folder)
    kill(rng.choice(sorted(procs)))  # at a random point: most likely before it joined
    # one while holding, one while waiting in the queue
    holding = until(lambda: [int(x[3]) for x in lines(log) if x[0] == "ACQ" and int(x[3]) not in killed_at])
    kill(rng.choice(holding))
    queued = until(lambda: [w.pid for w in waiters(leases) if w.pid in procs and w.pid not in killed_at]
                   or all(p.poll() is not None for p in procs.values()) and [0])
    if queued != [0]:  # (all done already: nobody left to kill while waiting)
        kill(rng.choice(queued))
    for pid, proc in procs.items():
        code = proc.wait(timeout=HANG_S)
        if pid not in killed_at:
            assert code == 0, proc.stderr.read()[-800:] if proc.stderr else pid
    held: dict[int, tuple[float, int]] = {}
    intervals = []
    for x in lines(log):
        assert x[0] != "REFUSED", x
        pid, nbytes, t = int(x[3]), int(x[4]), float(x[5])
        if x[0] == "ACQ":
            held[pid] = (t, nbytes)
        else:
            intervals.append((*held.pop(pid), t))
    for pid, (start, nbytes) in held.items():
        assert pid in killed_at
        intervals.append((start, nbytes, killed_at[pid]))
    assert len(intervals) >= 9 and any(n == 0 for _, n, _ in intervals) and any(n for _, n, _ in intervals)
    for start, _, _ in intervals:  # at each moment a hold began, what was held
        now = [(n, e) for s, n, e in intervals if s <= start < e]
        whole = [n for n, _ in now if n == 0]
        assert not whole or len(now) == 1, f"a whole-GPU lease overlapped another hold at {start}: {now}"
        assert sum(n for n, _ in now) <= CAPACITY, f"{sum(n for n, _ in now) / GIB:.1f} GiB reserved at {start}"


def test_a_waiter_is_refused_when_its_wait_runs_out_and_leaves_the_queue(world, spawn, child_env):
    folder, log = world
    spawn(os.getuid(), "blocker", hold=600, wait=0)
    until(lambda: any(x[0] == "ACQ" for x in lines(log)))
    env = child_env(TORCHPLACE_LEASE_DIR=str(folder))
    out = subprocess.run([sys.executable, "-m", "torchplace", "run", "--gpus", "1", "--wait", "1", "--snapshot",
                          SNAPSHOT, "--", "true"], capture_output=True, text=True, timeout=HANG_S, env=env)
    assert out.returncode != 0
    assert "Cannot pick 1 GPU after waiting 1 s" in out.stderr and "position 1 of 1 in the queue" in out.stderr
    assert "leased by pid" in out.stderr and "Traceback" not in out.stderr
    assert waiters(LeaseDir(folder)) == [] and not [n for n in os.listdir(folder) if n.startswith("queue.")]


def test_run_memory_hands_the_reservation_to_the_job_and_leases_lists_it(world, child_env):
    folder, _ = world
    env = child_env(TORCHPLACE_LEASE_DIR=str(folder))
    plan = subprocess.run([sys.executable, "-m", "torchplace", "run", "--gpus", "1", "--memory", "20GiB",
                           "--snapshot", SNAPSHOT, "--dry-run", "--json", "--", "true"],
                          capture_output=True, text=True, timeout=HANG_S, env=env, check=True)
    assert json.loads(plan.stdout)["env"]["TORCHPLACE_MEMORY_RESERVATION"] == str(20 * GIB)
    code = ("import os, subprocess, sys; print(os.environ['TORCHPLACE_MEMORY_RESERVATION']); sys.stdout.flush(); "
            "print(subprocess.run([sys.executable, '-m', 'torchplace', 'leases', '--json', '--snapshot', "
            f"{SNAPSHOT!r}], capture_output=True, text=True).stdout)")
    job = subprocess.run([sys.executable, "-m", "torchplace", "run", "--gpus", "1", "--memory", "20GiB", "--snapshot",
                          SNAPSHOT, "--", sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=HANG_S, env=env)
    assert job.returncode == 0, job.stderr
    reservation, listing = job.stdout.split("\n", 1)
    assert reservation == str(20 * GIB)
    (lease,) = json.loads(listing)["leases"]
    assert lease["held"] and lease["holder"] is None
    assert [r["memory_bytes"] for r in lease["reservations"]] == [20 * GIB]


def test_setup_says_a_reservation_is_not_applied_on_cpu(monkeypatch):
    import torchplace as tp

    monkeypatch.setenv("TORCHPLACE_MEMORY_RESERVATION", str(20 * GIB))
    rt = tp.setup("cpu", threads=None, verbose=False)
    assert any(d.startswith("memory reservation: 20.0 GiB reserved by torchplace run, not applied: the device is cpu")
               for d in rt.decisions), rt.decisions


def test_gpus_used_without_a_lease_are_named_and_their_memory_taken_constructed_snapshot(tmp_path, lease_dir,
                                                                                         scripts, child_env):
    from torchplace.distributed.pick import pick

    data = load_snapshot_dict("h200x2")
    gpu0, gpu1 = (g["uuid"] for g in data["gpus"])
    holder = subprocess.Popen([sys.executable, str(scripts / "hold_lease.py"), gpu0], stdout=subprocess.PIPE,
                              text=True, env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    try:
        assert holder.stdout.readline().strip() == "HELD"
        # CONSTRUCTED: processes added to the captured h200x2 snapshot (it has none). GPU 0: its lease holder
        # (covered) and a stranger; GPU 1: the same holder, which holds no lease of GPU 1, and a stranger.
        data["gpus"][0]["processes"] = [{"pid": holder.pid, "used_memory_bytes": 30 * GIB, "user": "root"},
                                        {"pid": 999_999_01, "used_memory_bytes": 50 * GIB, "user": "mallory"}]
        data["gpus"][1]["processes"] = [{"pid": holder.pid, "used_memory_bytes": 1 * GIB, "user": "root"},
                                        {"pid": 999_999_02, "used_memory_bytes": 95 * GIB, "user": "eve"}]
        snap = tmp_path / "constructed.json"
        snap.write_text(json.dumps(data))
        env = child_env(TORCHPLACE_LEASE_DIR=str(lease_dir))
        listing = json.loads(subprocess.run([sys.executable, "-m", "torchplace", "leases", "--json", "--snapshot",
                                             str(snap)], capture_output=True, text=True, timeout=HANG_S, env=env,
                                            check=True).stdout)
        assert {(u["physical_index"], u["pid"]) for u in listing["unleased"]} == {
            (0, 999_999_01), (1, holder.pid), (1, 999_999_02)}
        doctor = json.loads(subprocess.run([sys.executable, "-m", "torchplace", "doctor", "--json", "--snapshot",
                                            str(snap)], capture_output=True, text=True, timeout=HANG_S, env=env).stdout)
        said = [f for f in doctor["findings"] if f["id"] == "gpu.unleased"]
        assert [f["title"] for f in said] == ["GPU 0 is used without a lease", "GPU 1 is used without a lease"]
        assert "pid 99999901 (mallory, 50.0 GiB)" in said[0]["detail"]
        # GPU 1 has 140.4 - 96 = 44.4 GiB for reservations, GPU 0 none (leased whole)
        with pytest.raises(LeaseError, match=r"GPU 0 .*leased whole.*GPU 1 .*96.0 GiB used without a lease"):
            pick(1, memory="60GiB", snapshot=str(snap), seed=0)
        with pick(1, memory="40GiB", snapshot=str(snap), seed=0) as picked:
            assert picked.uuids == [gpu1] and picked.memory_bytes == 40 * GIB
    finally:
        holder.kill()
        holder.wait(timeout=HANG_S)


def test_a_job_does_not_queue_for_the_gpus_its_launcher_leased_for_it(world, child_env):
    """`torchplace run` leased the GPU (whole, then a reservation); the job's own pick(wait=...) takes it
    at once, even with another job waiting in the queue for that GPU (else each would wait for the other)."""
    folder, _ = world
    env = child_env(TORCHPLACE_LEASE_DIR=str(folder))
    code = ("import sys, time; from torchplace.distributed.leases import LeaseDir; "
            "from torchplace.distributed.queue import waiters; from torchplace.distributed.pick import pick; "
            "end = time.monotonic() + 120\n"
            "while not waiters(LeaseDir()) and time.monotonic() < end: time.sleep(0.05)\n"
            "p = pick(1, wait=60, snapshot=sys.argv[1], memory=sys.argv[2] if len(sys.argv) > 2 else None)\n"
            "print('INHERITED', p.gpus[0].inherited, p.memory_bytes, len(LeaseDir().list()[0].reservations))")
    for memory in ([], ["--memory", "20GiB"]):
        job = subprocess.Popen([sys.executable, "-m", "torchplace", "run", "--gpus", "1", *memory, "--snapshot",
                                SNAPSHOT, "--", sys.executable, "-c", code, SNAPSHOT, *memory[1:]], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        until(lambda: LeaseDir(folder).list() and LeaseDir(folder).list()[0].held)
        other = subprocess.Popen([sys.executable, "-m", "torchplace", "run", "--gpus", "1", "--wait", "120",
                                  "--snapshot", SNAPSHOT, "--", "true"], env=env, stderr=subprocess.PIPE, text=True)
        out, err = job.communicate(timeout=HANG_S)
        assert job.returncode == 0, err
        expected = f"INHERITED True {20 * GIB} 1" if memory else "INHERITED True None 0"
        assert out.strip() == expected
        assert other.wait(timeout=HANG_S) == 0, other.stderr.read()  # served once the job ended


def test_a_lock_file_removed_under_reservations_hands_out_neither_the_gpu_nor_its_memory_again(lease_dir, child_env):
    """The owner of a lock file may unlink it while others' reservations hold it (what the folder's sticky bit
    cannot stop): the reservations still count, on the new file too, and no whole lease is granted."""
    uuid = load_snapshot_dict("h200x1")["gpus"][0]["uuid"]
    code = ("import sys, time; from torchplace.distributed.leases import LeaseDir; "
            f"r = LeaseDir().try_reserve({uuid!r}, {100 * GIB}, {CAPACITY}); print('HELD' if r else 'NO', flush=True); "
            "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    try:
        assert holder.stdout.readline().strip() == "HELD"
        os.unlink(lease_dir / f"{uuid}.lock")
        leases = LeaseDir(lease_dir)
        assert leases.try_reserve(uuid, 100 * GIB, CAPACITY) is None  # 200 GiB > 140.4 GiB
        assert leases.try_acquire(uuid) is None
        with leases.try_reserve(uuid, 30 * GIB, CAPACITY) as fits:  # 130 GiB in all: fits
            assert fits is not None and fits.memory_bytes == 30 * GIB
    finally:
        holder.kill()
        holder.wait(timeout=HANG_S)
