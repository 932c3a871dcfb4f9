"""Attacks on the holder note, end to end with two `torchplace run` jobs on the one GPU of the real
1 x H200 snapshot, the attacker a second local user (uid 65534 through setpriv).

The first user to lease a GPU owns its lock file for good and may unlink it while another job holds
the lock; what then shows the GPU held is the holder's note. So the attacker makes the next
holder's note fail (a folder planted at the name it would get, a full file system), unlinks the
lock file, and starts a second job: it must not be handed the same GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from snapshots import load_snapshot_dict, snapshot_path  # tests/snapshots.py (pythonpath = tests)

from torchplace.distributed.leases import LeaseDir

ATTACKER = 65534
SNAPSHOT = snapshot_path("h200x1")
UUID = load_snapshot_dict("h200x1")["gpus"][0]["uuid"]

needs_users = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as another local user needs root and setpriv (util-linux); run the suite as root")

# lease the GPU and die without giving the note back (as a SIGKILLed job does): its note stays
LEASE_AND_DIE = ("import os, sys; from torchplace.distributed.leases import LeaseDir; "
                 "assert LeaseDir().try_acquire(sys.argv[1]) is not None; os._exit(0)")
# the job: print the GPU it was given, then wait for a line on stdin
JOB = ["sh", "-c", 'echo "GPU=$CUDA_VISIBLE_DEVICES"; read line']


def as_attacker(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def folder():
    """An admin's lease folder (root's, mode 1777) in a /tmp folder of our own."""
    base = Path(tempfile.mkdtemp(prefix="torchplace-attack-", dir="/tmp"))
    os.chmod(base, 0o755)
    leases = base / "leases"
    os.mkdir(leases)
    os.chmod(leases, 0o1777)
    yield leases
    subprocess.run(["umount", str(leases)], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def run_job(child_env):
    """Start `torchplace run --gpus 1 -- JOB` as root with the lease folder; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(leases: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "torchplace", "run", "--gpus", "1", "--snapshot",
                                 str(SNAPSHOT), "--", *JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=child_env(TORCHPLACE_LEASE_DIR=str(leases)))
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def first_line(proc: subprocess.Popen) -> str:
    """The job's first line, or what `torchplace run` said when it did not start it."""
    line = proc.stdout.readline().strip()
    if line:
        return line
    proc.wait(timeout=120)
    return f"EXIT {proc.returncode} {proc.stderr.read().strip()}"


def attacker_owns_the_lock_file(leases: Path, child_env) -> None:
    """The attacker leases the GPU once and dies: it owns the lock file, its stale note stays."""
    done = as_attacker(sys.executable, "-c", LEASE_AND_DIE, UUID, env=child_env(TORCHPLACE_LEASE_DIR=str(leases)))
    assert done.returncode == 0, done.stderr
    assert os.stat(leases / f"{UUID}.lock").st_uid == ATTACKER


@needs_users
def test_a_folder_planted_at_the_note_name_does_not_hand_the_gpu_out_twice(folder, run_job, child_env):
    attacker_owns_the_lock_file(folder, child_env)
    for uid in (0, 65533):  # the names a root victim's and another user's note would get
        assert as_attacker("mkdir", str(folder / f"{UUID}.holder.{uid}")).returncode == 0
    victim = run_job(folder)
    assert first_line(victim) == f"GPU={UUID}"

    assert as_attacker("rm", str(folder / f"{UUID}.lock")).returncode == 0
    status = LeaseDir(folder).status(UUID)
    assert status.held, "the GPU the victim holds shows free once its lock file is gone"
    # the holder named is the victim, not the attacker's stale note of the same lock file
    assert status.holder is not None and (status.holder.uid, status.holder.pid) == (0, victim.pid), status.holder
    assert [(s.holder.uid, s.holder.pid) for s in LeaseDir(folder).list() if s.holder] == [(0, victim.pid)]

    second = run_job(folder)
    line = first_line(second)
    assert line != f"GPU={UUID}", "double lease: two `torchplace run` jobs were given the same GPU"
    assert line.startswith("EXIT") and "Traceback" not in line


def fill(mount: Path) -> None:
    """Fill the file system as the attacker (dd stops at ENOSPC)."""
    as_attacker("dd", "if=/dev/zero", f"of={mount / 'fill'}", "bs=4k")
    probe = mount / "probe"
    with pytest.raises(OSError, match="No space"):
        with open(probe, "wb") as fh:  # root has no reserved blocks on tmpfs either
            fh.write(b"x" * 8192)
            fh.flush()
            os.fsync(fh.fileno())
    probe.unlink(missing_ok=True)


@needs_users
def test_a_full_file_system_refuses_the_lease_with_the_fix(folder, run_job, child_env):
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    attacker_owns_the_lock_file(folder, child_env)
    fill(folder)
    victim = run_job(folder)
    line = first_line(victim)
    if line == f"GPU={UUID}":  # before the fix: granted without a note; unlink, and a second job comes
        as_attacker("rm", str(folder / f"{UUID}.lock"))
        (folder / "fill").unlink()
        second = run_job(folder)
        assert first_line(second) != f"GPU={UUID}", "double lease: two jobs were given the same GPU"
        pytest.fail("the lease was granted without its holder note")
    assert line.startswith("EXIT 1 ") or line.startswith("EXIT 2 "), line
    assert "Traceback" not in line
    assert f"Cannot write the holder note of GPU {UUID} in the lease directory {folder}" in line
    assert "No space left on device" in line and f"df {folder}" in line  # what happened and the fix
    assert not [n for n in os.listdir(folder) if ".holder." in n and os.stat(folder / n).st_uid == 0]

    (folder / "fill").unlink()  # room again: the GPU is free and leased as usual
    again = run_job(folder)
    assert first_line(again) == f"GPU={UUID}"


def test_notes_of_killed_holders_do_not_pile_up(tmp_path: Path, child_env) -> None:
    """Each note has a name of its own: the next holder of the same lock file removes the ones its user
    left behind (SIGKILLed jobs), so the folder does not grow with every killed job."""
    env = child_env(TORCHPLACE_LEASE_DIR=str(tmp_path))
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", LEASE_AND_DIE, UUID], env=env, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr
    lease = LeaseDir(tmp_path).try_acquire(UUID)
    assert lease is not None
    try:
        assert len([n for n in os.listdir(tmp_path) if ".holder." in n]) == 1
        assert LeaseDir(tmp_path).status(UUID).holder.pid == os.getpid()
    finally:
        lease.release()
    assert not [n for n in os.listdir(tmp_path) if ".holder." in n]


@needs_users
def test_a_note_that_fails_on_the_second_gpu_gives_the_first_back(folder, child_env) -> None:
    """pick(2) on a file system with one inode left: the first GPU's note takes it, the second's
    cannot be written; the refusal must not keep the first GPU leased."""
    from torchplace.distributed.leases import held_by_this_process
    from torchplace.distributed.pick import pick
    from torchplace.errors import LeaseError

    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=64,mode=1777", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    snapshot = snapshot_path("h200x2")
    uuids = [g["uuid"] for g in load_snapshot_dict("h200x2")["gpus"]]
    for uuid in uuids:  # both lock files exist, so only the notes need inodes
        (folder / f"{uuid}.lock").touch(mode=0o644)
    filler = 0
    while True:
        try:
            (folder / f"fill{filler}").touch()
        except OSError:
            break
        filler += 1
    (folder / "fill0").unlink()  # one inode left: one note
    with pytest.raises(LeaseError, match=r"Cannot write the holder note of GPU .*\(No space left on device\)"):
        pick(2, snapshot=snapshot, lease_dir=folder)
    assert held_by_this_process() == []
    assert not any(LeaseDir(folder).status(u).held for u in uuids)
