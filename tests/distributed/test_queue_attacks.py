"""A hostile co-user's queue entries (another uid when run as root, through setpriv), written by hand and
locked by a live process of that user as a real waiter's are: the name it claims, the terminal escapes in
its texts and a request larger than any machine are not believed, shown raw, or allowed to crash
`torchplace queue` for everyone else."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from torchplace.distributed.leases import LeaseDir, user_name
from torchplace.distributed.queue import waiters

HANG_S = 150
AS_USERS = os.geteuid() == 0 and shutil.which("setpriv") is not None
OTHER = 65531 if AS_USERS else os.getuid()
THIRD = 65532  # neither the entry's user nor root (as root only)

# the entry writer: the queue's file protocol by hand (name, lock, content), then it waits, holding the lock
WRITER = """
import fcntl, json, os, secrets, sys, time
d, content = sys.argv[1], json.loads(sys.argv[2])
content = {"pid": os.getpid(), "uid": os.getuid(), **content}  # a pid of its own choosing, when given
fd = os.open(os.path.join(d, f"queue.{os.getuid()}.{secrets.token_hex(8)}"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps(content).encode())
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def folder():
    base = Path(tempfile.mkdtemp(prefix="torchplace-queue-attacks-", dir="/tmp"))
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def hostile(folder):
    procs = []

    def write(**content):
        argv = [sys.executable, "-c", WRITER, str(folder), json.dumps(content)]
        if OTHER != os.getuid():
            argv = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield write
    for proc in procs:
        proc.kill()
        proc.wait(timeout=HANG_S)


ENTRY = {"since": "2026-01-01T00:00:00+00:00", "since_ns": 1, "count": 1, "memory_bytes": None, "wait_s": 600.0}


def _queue(folder: Path, *more: str, uid: int | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torchplace", "queue", "--dir", str(folder), *more]
    if uid is not None and uid != os.getuid():
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S)


def _entries(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("queue."))


def test_a_killed_waiters_entry_is_removed_by_its_user_and_root_never_by_another_user(folder, hostile):
    """A SIGKILLed waiter's file stayed for ever unless its own user joined the queue again."""
    hostile(**ENTRY, pid=1, command="")  # alive: locked by a process that is not the pid it claims (another PID
    alive = _entries(folder)             # namespace shows another pid): not counted, and never removed
    dead = hostile(**ENTRY, command="")
    dead.kill()
    dead.wait(timeout=HANG_S)
    litter = [n for n in _entries(folder) if n not in alive]
    assert len(litter) == 1  # a process killed with SIGKILL cannot remove its file
    if AS_USERS:  # another user may not remove it (nor could, in the sticky folder)
        assert _queue(folder, uid=THIRD).returncode == 0 and _entries(folder) == sorted(alive + litter)
    assert _queue(folder, uid=OTHER).returncode == 0 and _entries(folder) == alive  # its own user does
    dead = hostile(**ENTRY, command="")
    dead.kill()
    dead.wait(timeout=HANG_S)
    assert len(_entries(folder)) == 2
    assert waiters(LeaseDir(folder)) == [] and _entries(folder) == alive  # root, the folder's owner, does too


def test_an_entry_that_claims_to_wait_since_long_ago_does_not_jump_the_queue(folder, hostile):
    """Entries were ordered by the since_ns they wrote: one claiming 1 ns after 1970 went first."""
    from torchplace.distributed.queue import join, last_served
    from torchplace.policy.fairness import serve_order

    with join(LeaseDir(folder), count=1, memory_bytes=None, wait_s=600) as mine:
        hostile(**ENTRY, user="x", command="")  # since_ns 1, since 2026-01-01: joined after us
        queued = waiters(LeaseDir(folder))
        theirs = next(w for w in queued if w.name != mine.name)
        assert [a.key for a in serve_order([w.ask() for w in queued], last_served(LeaseDir(folder)))] == [
            mine.name, theirs.name]
        assert theirs.since_ns > mine.waiter.since_ns and not theirs.since.startswith("2026-01-01")
        shown = _queue(folder, "--json")
        assert [r["pid"] for r in json.loads(shown.stdout)["queue"]] == [os.getpid(), theirs.pid]


def test_an_entry_is_shown_under_its_owners_name_with_its_escapes_visible(folder, hostile):
    hostile(**ENTRY, user="root\x1b]0;owned\x07", command="train.py\x1b[2J\x1b[H\u202eexe.txt")
    (entry,) = waiters(LeaseDir(folder))
    assert entry.user == user_name(OTHER)  # not the name the entry claims
    assert "\x1b" not in entry.command and "\u202e" not in entry.command and "train.py" in entry.command
    shown = _queue(folder)
    assert shown.returncode == 0 and "\x1b" not in shown.stdout + shown.stderr


@pytest.mark.parametrize("ask", [{"memory_bytes": 10**400}, {"count": 10**30}])
def test_an_entry_asking_for_more_than_any_machine_is_not_counted(folder, hostile, ask):
    hostile(**{**ENTRY, **ask}, user="x", command="")
    assert waiters(LeaseDir(folder)) == []
    shown = _queue(folder)
    assert shown.returncode == 0, shown.stderr
    assert "internal error" not in shown.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_waiter_stopped_by_a_signal_leaves_the_queue_without_a_traceback(folder, sig):
    from snapshots import load_snapshot_dict

    from torchplace.hardware.topology import Topology

    uuid = Topology.from_dict(load_snapshot_dict("h200x1")).gpus[0].uuid
    with LeaseDir(folder).try_acquire(uuid) as held:  # the one GPU is busy: the run waits in the queue
        assert held is not None
        env = {**os.environ, "TORCHPLACE_LEASE_DIR": str(folder)}
        proc = subprocess.Popen([sys.executable, "-m", "torchplace", "run", "--snapshot", "h200x1", "--wait", "600",
                                 "--", "true"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own session: SIGINT is not ignored as in a background job
        end = time.monotonic() + HANG_S
        while not waiters(LeaseDir(folder)):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert not [n for n in os.listdir(folder) if n.startswith("queue.")]  # the entry went with it


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_planted_lock_file_does_not_hide_every_lease_from_the_listing(folder, plant):
    from snapshots import load_snapshot_dict

    from torchplace.errors import TorchplaceWarning
    from torchplace.hardware.topology import Topology

    uuid = Topology.from_dict(load_snapshot_dict("h200x1")).gpus[0].uuid
    bad = folder / "GPU-planted.lock"
    bad.symlink_to("/etc/passwd") if plant == "symlink" else os.mkfifo(bad)
    with LeaseDir(folder).try_acquire(uuid) as held:
        assert held is not None
        with pytest.warns(TorchplaceWarning, match="GPU-planted.lock"):
            listed = LeaseDir(folder).list()
        assert [s.uuid for s in listed if s.held] == [uuid]
        shown = subprocess.run([sys.executable, "-m", "torchplace", "leases", "--dir", str(folder), "--snapshot",
                                "h200x1", "--json"], capture_output=True, text=True, timeout=HANG_S)
    assert shown.returncode == 0, shown.stderr
    assert [r["uuid"] for r in json.loads(shown.stdout)["leases"]] == [uuid]
    assert "GPU-planted.lock" in shown.stderr
