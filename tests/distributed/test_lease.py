"""Leases: one flock per GPU in a shared directory; exclusive, gone with the holder, tamper-checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from torchplace.distributed.leases import LeaseDir, held_by_this_process
from torchplace.errors import LeaseError

UUID = "GPU-7fbb5c6b-5000-1564-ecb5-3c1b2da34bf7"


@pytest.fixture
def holder(lease_dir, scripts, child_env):
    """A separate process holding the lease on UUID; killed at the end."""
    proc = subprocess.Popen([sys.executable, str(scripts / "hold_lease.py"), UUID], stdout=subprocess.PIPE,
                            text=True, env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert proc.stdout.readline().strip() == "HELD"
    yield proc
    proc.kill()
    proc.wait()


def test_acquire_release_and_status(lease_dir):
    leases = LeaseDir()
    lease = leases.try_acquire(UUID, command="train.py --lr 1")
    assert lease is not None and lease.active
    assert oct(os.stat(lease_dir).st_mode & 0o7777) == "0o1777"  # shared like /tmp
    status = leases.status(UUID)
    assert status.held and status.mine and status.holder.pid == os.getpid()
    assert status.holder.command == "train.py --lr 1"
    assert leases.try_acquire(UUID) is None  # this process already holds it
    assert lease in held_by_this_process()
    lease.release()
    lease.release()  # idempotent
    assert not leases.status(UUID).held
    assert not any(name.startswith(UUID + ".holder") for name in os.listdir(lease_dir))


def test_another_process_cannot_take_a_held_lease(holder, lease_dir):
    leases = LeaseDir()
    assert leases.try_acquire(UUID) is None
    status = leases.status(UUID)
    assert status.held and not status.mine
    assert status.holder.pid == holder.pid
    assert status.holder.command == "hold_lease.py test holder"
    assert [s.uuid for s in leases.list()] == [UUID]


def test_lease_vanishes_when_holder_is_sigkilled(holder, lease_dir):
    leases = LeaseDir()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert not leases.status(UUID).held
    lease = leases.try_acquire(UUID)
    assert lease is not None
    lease.release()


def test_forged_holder_note_is_not_trusted(holder, lease_dir):
    # a note claiming another uid, but owned by us: its owner does not match its name
    other_uid = os.getuid() + 1
    (lease_dir / f"{UUID}.holder.{other_uid}").write_text(json.dumps(
        {"pid": 1, "uid": other_uid, "user": "mallory", "command": "forged", "since_epoch": 9e12}))
    status = LeaseDir().status(UUID)
    assert status.holder.pid == holder.pid and status.holder.user != "mallory"


def test_a_dead_holders_note_does_not_block_when_its_inode_is_locked_anew(lease_dir, tmp_path, child_env):
    """A note of a holder gone after its lock file was unlinked names a freed inode; once another file gets
    that inode number and someone locks it (any process, anywhere on the disk), the GPU is still free."""
    other = tmp_path / "someone-elses.lock"
    locker = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('LOCKED', flush=True); sys.stdin.read()",
                               str(other)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "LOCKED"
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True, env=child_env())
        st = os.stat(other)
        LeaseDir().try_acquire(UUID).release()  # the folder and the GPU's lock file, as a first job leaves them
        (lease_dir / f"{UUID}.holder.{os.getuid()}.{'0' * 16}").write_text(json.dumps(
            {"pid": int(gone.stdout), "uid": os.getuid(), "command": "killed holder", "since_epoch": 1.0,
             "lock_dev": st.st_dev, "lock_ino": st.st_ino}))
        lease = LeaseDir().try_acquire(UUID)
        assert lease is not None, "a stale note of a dead holder kept the GPU held"
        lease.release()
    finally:
        locker.kill()
        locker.wait()


def test_symlinked_directory_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "leases"
    link.symlink_to(real)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(link))
    with pytest.raises(LeaseError, match="symbolic link or a file"):
        LeaseDir().try_acquire(UUID)


def test_world_writable_directory_without_sticky_bit_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "leases"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(shared))
    with pytest.raises(LeaseError, match=r"mode 777.*lacks the sticky bit.*chmod 1777"):
        LeaseDir().try_acquire(UUID)


def test_symlinked_lease_file_is_not_followed(lease_dir):
    victim = lease_dir.parent / "victim.txt"
    victim.write_text("precious")
    os.mkdir(lease_dir, 0o700)
    os.symlink(victim, lease_dir / f"{UUID}.lock")
    with pytest.raises(LeaseError, match="is a symbolic link"):
        LeaseDir().try_acquire(UUID)
    assert victim.read_text() == "precious"


def test_fifo_lease_file_is_refused_without_blocking(lease_dir):
    os.mkdir(lease_dir, 0o700)
    os.mkfifo(lease_dir / f"{UUID}.lock")
    with pytest.raises(LeaseError, match="not a regular file"):
        LeaseDir().try_acquire(UUID)


def test_hard_linked_lease_file_is_refused(lease_dir):
    victim = lease_dir.parent / "victim.txt"
    victim.write_text("precious")
    os.mkdir(lease_dir, 0o700)
    os.link(victim, lease_dir / f"{UUID}.lock")
    with pytest.raises(LeaseError, match="other hard links"):
        LeaseDir().try_acquire(UUID)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_private_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    other = tmp_path / "leases"
    other.mkdir(mode=0o755)
    os.chown(other, 65534, 65534)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(other))
    with pytest.raises(LeaseError, match="only they can add leases"):
        LeaseDir().try_acquire(UUID)


def test_check_notices_a_removed_lease_file(lease_dir):
    lease = LeaseDir().try_acquire(UUID)
    lease.check()
    os.unlink(lease.path)
    with pytest.raises(LeaseError, match="was removed or replaced"):
        lease.check()
    lease.release()


@pytest.mark.parametrize("bad", ["../etc/passwd", "GPU-1/../../x", "", ".hidden"])
def test_uuid_cannot_escape_the_directory(lease_dir, bad):
    with pytest.raises(LeaseError, match="cannot name a lease file"):
        LeaseDir().try_acquire(bad)
