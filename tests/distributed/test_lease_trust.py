"""Who may own the lease directory, and what another local user can do to the leases in it.

The attacks run as real second and third local users: as root, `setpriv` drops to uid 65534
(nobody, the attacker) and 65533 (a victim job); the jobs pick on the real 1 x H200 snapshot, so
a second job that gets a GPU gets the one GPU the first job holds. Skipped where that cannot run.
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
from torchplace.distributed.pick import pick
from torchplace.errors import LeaseError

ATTACKER, VICTIM = 65534, 65533
SNAPSHOT = snapshot_path("h200x1")
UUID = load_snapshot_dict("h200x1")["gpus"][0]["uuid"]  # the only GPU: two holders means one GPU shared

needs_users = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as other local users needs root and setpriv (util-linux); run the suite as root")

# A job: pick the one GPU and hold it; on a line on stdin, check its lease and say what it found.
JOB = """
import sys
from torchplace.distributed.pick import pick
from torchplace.errors import LeaseError
try:
    picked = pick(1, snapshot=sys.argv[1], command="victim job")
except LeaseError as exc:
    print("REFUSED", " ".join(str(exc).splitlines()), flush=True)
    sys.exit(0)
print("HELD", picked.uuids[0], flush=True)
sys.stdin.readline()
try:
    picked.leases[0].check()
    print("INTACT", flush=True)
except LeaseError as exc:
    print("TAMPERED", exc, flush=True)
"""


def as_user(uid: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=120)


def python_as(uid: int, code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def world():
    """A /tmp of our own: root's, mode 1777 (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="torchplace-trust-", dir="/tmp"))
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def job(child_env):
    """Start JOB (as `uid`, or as root) with TORCHPLACE_LEASE_DIR=`folder`; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(folder: Path, uid: int | None = None) -> subprocess.Popen:
        prefix = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        proc = subprocess.Popen([*prefix, sys.executable, "-c", JOB, str(SNAPSHOT)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=child_env(TORCHPLACE_LEASE_DIR=str(folder)))
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def second_job_gets_the_gpu(folder: Path) -> bool:
    """Whether a new job (this process, root) is handed the GPU now."""
    try:
        picked = pick(1, snapshot=SNAPSHOT, lease_dir=folder)
    except LeaseError:
        return False
    picked.release()
    return True


def admin_folder(world: Path) -> Path:
    """The shared folder as an admin makes it: `install -d -m 1777 -o root -g root`."""
    folder = world / "leases"
    os.mkdir(folder)
    os.chmod(folder, 0o1777)
    return folder


# ------------------------------------------------------------------ the attacks


@needs_users
def test_a_user_who_made_the_folder_cannot_make_two_jobs_share_a_gpu(world, job):
    folder = world / "leases"
    assert as_user(ATTACKER, "mkdir", "-m", "1777", str(folder)).returncode == 0  # first to make it
    first = job(folder)
    word, _, rest = first.stdout.readline().partition(" ")
    if word == "HELD":  # before the fix: the owner deletes the running job's lock, a 2nd job comes
        removed = as_user(ATTACKER, "rm", "-f", str(folder / f"{UUID}.lock")).returncode == 0
        assert not (removed and second_job_gets_the_gpu(folder)), (
            "double lease: the folder's owner removed the running job's lock file and the next job "
            "was handed the same GPU")
    assert word == "REFUSED", f"{word} {rest}"
    assert "owned by nobody" in rest and "mode 1777" in rest
    assert f"sudo install -d -m 1777 -o root -g root {folder}" in rest


@needs_users
@pytest.mark.parametrize("note_blocked", [False, True], ids=["plain", "holder-note-name-taken"])
def test_the_owner_of_a_lock_file_cannot_free_a_gpu_another_job_holds(world, job, child_env, note_blocked):
    """In an admin's folder, the first user to lease a GPU owns its lock file for good, and may
    unlink it while another user's job holds the lock: the next job must still see the GPU held."""
    folder = admin_folder(world)
    env = child_env(TORCHPLACE_LEASE_DIR=str(folder))
    once = ("import sys; from torchplace.distributed.leases import LeaseDir; "
            "LeaseDir().try_acquire(sys.argv[1]).release()")
    assert python_as(ATTACKER, once, UUID, env=env).returncode == 0
    assert os.stat(folder / f"{UUID}.lock").st_uid == ATTACKER
    if note_blocked:  # take the name the victim's holder note would get, so it cannot write it
        assert as_user(ATTACKER, "touch", str(folder / f"{UUID}.holder.{VICTIM}")).returncode == 0
    victim = job(folder, uid=VICTIM)
    assert victim.stdout.readline().split() == ["HELD", UUID]

    assert as_user(ATTACKER, "rm", str(folder / f"{UUID}.lock")).returncode == 0
    status = LeaseDir(folder).status(UUID)
    assert status.held and status.holder is not None and status.holder.uid == VICTIM
    for _ in range(3):  # the first one re-creates the lock file; later ones find it unlocked
        assert not second_job_gets_the_gpu(folder), "double lease after the lock file was unlinked"
    assert not any(s.held for s in LeaseDir(folder).list() if s.holder and s.holder.uid == 0)

    victim.stdin.write("check\n")
    victim.stdin.flush()
    assert victim.stdout.readline().startswith("TAMPERED")  # the holder can tell, too

    victim.kill()
    victim.wait()
    assert second_job_gets_the_gpu(folder)  # once the holder is gone, the GPU is free again


@needs_users
def test_other_users_cannot_remove_a_lease_in_an_admin_folder(world, job):
    folder = admin_folder(world)
    victim = job(folder)  # root's job creates the lock file: only root may remove it
    assert victim.stdout.readline().split() == ["HELD", UUID]
    assert as_user(ATTACKER, "rm", "-f", str(folder / f"{UUID}.lock")).returncode != 0
    assert (folder / f"{UUID}.lock").exists()
    assert not second_job_gets_the_gpu(folder)


# ------------------------------------------------------------------ which folders are accepted


@needs_users
def test_shared_folder_owned_by_another_user_is_refused_with_the_fix(world, monkeypatch):
    folder = world / "leases"
    os.mkdir(folder)
    os.chmod(folder, 0o1777)
    os.chown(folder, ATTACKER, ATTACKER)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(folder))
    for attempt in (lambda: LeaseDir().try_acquire(UUID), lambda: LeaseDir().status(UUID), LeaseDir().list):
        with pytest.raises(LeaseError) as err:
            attempt()
        text = str(err.value)
        assert "owned by nobody" in text and "mode 1777" in text
        assert "unlink other users' lease files" in text  # why
        assert f"sudo install -d -m 1777 -o root -g root {folder}" in text  # the fix
    assert not os.listdir(folder)  # nothing was written there


@needs_users
def test_folder_inside_a_folder_another_user_controls_is_refused(world, monkeypatch):
    theirs = world / "alice"
    os.mkdir(theirs, 0o755)
    os.chown(theirs, ATTACKER, ATTACKER)  # alice may rename `leases` and put her own in its place
    folder = theirs / "leases"
    os.mkdir(folder)
    os.chmod(folder, 0o1777)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(folder))
    with pytest.raises(LeaseError, match=rf"inside {theirs} \(owner nobody, mode 755\).*Fix:"):
        LeaseDir().try_acquire(UUID)


def test_root_owned_sticky_folder_is_accepted(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("a root-owned folder can only be made by root")
    folder = admin_folder(tmp_path)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(folder))
    lease = LeaseDir().try_acquire(UUID)
    assert lease is not None and LeaseDir().status(UUID).mine
    lease.release()


def test_own_folder_is_accepted(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    os.mkdir(folder, 0o700)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(folder))
    lease = LeaseDir().try_acquire(UUID)
    assert lease is not None
    lease.check()
    lease.release()
    assert [s.uuid for s in LeaseDir().list()] == [UUID]


@needs_users
@pytest.mark.parametrize("command", [["leases"], ["leases", "--all", "--no-gpu-names"],
                                     ["pick", "--snapshot", str(SNAPSHOT)]])
def test_cli_on_a_refused_folder_prints_one_line(world, run_cli, child_env, command):
    folder = world / "leases"
    assert as_user(ATTACKER, "mkdir", "-m", "1777", str(folder)).returncode == 0
    out = run_cli(command, env=child_env(TORCHPLACE_LEASE_DIR=str(folder)))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "owned by nobody" in lines[0] and "sudo install -d" in lines[0], out.stderr
