"""Who holds a lease: the holder notes written next to the lock files, and the kernel's /proc/locks.

A note, ``<uuid>.holder.<uid>.<random>``, is trusted only when its owner is the uid its name claims,
and names the holder only when the kernel's /proc/locks shows its pid locking the file it names.
A note also records the (device, inode) its writer locked, which is how a lock file unlinked
under a live holder is still seen as held (`orphan_holder`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import LeaseError
from ..hardware.host import pid_exists
from .lease_folder import LEASE_DIR_ENV, LOCK_SUFFIX, user_name

HOLDER_INFIX = ".holder."
_NOTE_TAIL = re.compile(r"^([0-9]{1,10})(?:\.[0-9a-f]{16})?$")  # "<uid>" or "<uid>.<random>"


@dataclass(frozen=True)
class Holder:
    """Who holds a lease. Fields are None when unknown (another PID namespace, no holder file)."""

    pid: int | None
    user: str | None = None
    uid: int | None = None
    hostname: str | None = None
    since: str | None = None
    command: str | None = None
    source: str = "holder file"  # or "/proc/locks" when only the kernel could say

    def describe(self) -> str:
        parts = [f"pid {self.pid}" if self.pid else "an unknown process"]
        if self.user:
            parts.append(f"user {self.user}")
        if self.since:
            parts.append(f"since {self.since}")
        text = ", ".join(parts)
        return f"{text} ({self.command})" if self.command else text


Note = tuple[float, Holder, tuple[int, int] | None]  # (since, who, the (device, inode) it locked)


def now_iso() -> str:
    """The local time as ISO 8601 with the offset written +00:00."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return f"{stamp[:-2]}:{stamp[-2:]}"  # +0000 -> +00:00, as ISO 8601 writes it


# --------------------------------------------------------------------------- notes


def write_note(dirfd: int, folder: Path, uuid: str, holder: Holder, locked: tuple[int, int]) -> str:
    """Write the holder note into a new file of a name no one can guess, ``<uuid>.holder.<uid>.<random>``
    (O_EXCL, O_NOFOLLOW: nothing planted under a name can take its place), and return that name.

    A lease is granted only with its note: the note is what shows the GPU held once its lock file is
    unlinked (`orphan_holder`), so a note that cannot be written (a full file system, a quota) raises
    LeaseError naming the folder and the fix instead."""
    data = json.dumps({**asdict(holder), "since_epoch": time.time(),
                       "lock_dev": locked[0], "lock_ino": locked[1]}).encode()
    problem: OSError | None = None
    for _ in range(8):  # a taken name is someone's file or folder: draw another
        name = f"{uuid}{HOLDER_INFIX}{os.getuid()}.{secrets.token_hex(8)}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dirfd)
        except OSError as exc:
            problem = exc
            if exc.errno in (errno.EEXIST, errno.EISDIR, errno.ELOOP):
                continue
            break
        try:
            os.fchmod(fd, 0o644)
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)  # file systems that report a full disk only when the data goes out
            return name
        except OSError as exc:
            problem = exc
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dirfd)
            break
        finally:
            os.close(fd)
    why = problem.strerror if problem is not None and problem.strerror else str(problem)
    raise LeaseError(
        f"Cannot write the holder note of GPU {uuid} in the lease directory {folder} ({why}), so the GPU "
        "is not leased: without its note a lease cannot be told apart from a free GPU once someone removes "
        f"its lock file. Fix: free space in the file system of {folder} (`df {folder}`), or set "
        f"{LEASE_DIR_ENV} to a directory on a file system with room.")


def clear_stale(dirfd: int, uuid: str, locked: tuple[int, int], keep: str) -> None:
    """Remove this user's older notes of the lock file `locked`, which we now hold: their writers
    are gone (a SIGKILLed holder leaves its note, and each note has a name of its own)."""
    prefix = f"{uuid}{HOLDER_INFIX}{os.getuid()}."
    for name in os.listdir(dirfd):
        if name.startswith(prefix) and name != keep:
            note = _read_note(dirfd, name, str(os.getuid()))
            if note is not None and note[2] == locked:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dirfd)


def notes(dirfd: int, uuid: str) -> list[Note]:
    """The trusted holder notes of GPU `uuid` in the folder open as `dirfd`."""
    found = []
    prefix = uuid + HOLDER_INFIX
    for name in os.listdir(dirfd):
        tail = _NOTE_TAIL.match(name[len(prefix):]) if name.startswith(prefix) else None
        note = _read_note(dirfd, name, tail.group(1)) if tail else None
        if note is not None:
            found.append(note)
    return found


def read_holder(dirfd: int, uuid: str, kernel_pid: int | None, named: tuple[int, int]) -> Holder | None:
    """The holder of the lock file `named` (device, inode), held now: the note that the kernel's pid
    vouches for, else what the OS says about that pid; without a pid from the kernel (another PID
    namespace), the newest note of a live process that names this very file."""
    mine = [(t, h) for t, h, lock in notes(dirfd, uuid) if lock == named]
    if kernel_pid:
        return _vouched([h for _, h in mine], [kernel_pid])
    alive = [(t, h) for t, h in mine if h.pid and pid_exists(h.pid)]
    return max(alive, key=lambda item: item[0])[1] if alive else None


def orphan_holder(dirfd: int, uuid: str, named: tuple[int, int] | None) -> Holder | None:
    """A live holder of `uuid` whose lock file was unlinked under it: a note of it names a
    (device, inode) that is not the lock file `named` (nor any other lease file here) and
    that the kernel shows locked. None when there is none."""
    by_lock: dict[tuple[int, int], list[Holder]] = {}
    for _, holder, lock in notes(dirfd, uuid):
        if lock is not None and lock != named:
            by_lock.setdefault(lock, []).append(holder)
    if not by_lock:
        return None
    lease_files = set()
    for name in os.listdir(dirfd):
        if name.endswith(LOCK_SUFFIX):
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                lease_files.add((st.st_dev, st.st_ino))
    for (dev, ino), holders in by_lock.items():
        if (dev, ino) in lease_files:  # the inode now belongs to another GPU's lease file
            continue
        pids = proc_locks(dev, ino)
        if pids:
            return _vouched(holders, pids)
        alive = [h for h in holders if h.pid and pid_exists(h.pid)]
        if pids is None and alive:
            return alive[0]
    return None


def _vouched(holders: list[Holder], pids: list[int]) -> Holder:
    """Of the notes naming one locked file, the one whose pid the kernel shows locking it and whose
    writer is that process's user (a stale note, or one another user wrote naming our pid, is not);
    else what the OS says about the kernel's pid."""
    live = [p for p in pids if p > 0]
    for pid in live:
        try:
            uid: int | None = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            uid = None
        for holder in holders:
            if holder.pid == pid and (uid is None or holder.uid == uid):
                return holder
    return _holder_from_pid(live[0]) if live else Holder(pid=None, source="/proc/locks")


def _read_note(dirfd: int, name: str, uid_text: str) -> Note | None:
    """A holder note (when, who, the (device, inode) it locked), trusted only if the file's owner
    is the uid its name claims."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or str(st.st_uid) != uid_text or st.st_size > 65536:
            return None
        raw = json.loads(os.read(fd, 65536).decode())
        fields = {k: raw.get(k) for k in ("pid", "user", "uid", "hostname", "since", "command")}
        if fields["uid"] != st.st_uid or not isinstance(fields["pid"], int):
            return None
        dev, ino = raw.get("lock_dev"), raw.get("lock_ino")
        lock = (dev, ino) if type(dev) is int and type(ino) is int and dev >= 0 and ino > 0 else None
        return float(raw.get("since_epoch") or 0), Holder(**fields), lock
    except (OSError, ValueError, TypeError, AttributeError, RecursionError, OverflowError):
        return None
    finally:
        os.close(fd)


def _holder_from_pid(pid: int) -> Holder:
    """What the OS says about a pid, when the holder left no note."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300] or None
    except OSError:
        return Holder(pid=pid, source="/proc/locks")
    return Holder(pid=pid, user=user_name(uid), uid=uid, command=command, source="/proc/locks")


# --------------------------------------------------------------------------- the kernel's view


def proc_locks(dev: int, ino: int) -> list[int] | None:
    """Pids holding a flock on (dev, ino) per /proc/locks; None when it cannot be read."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    exact: list[int] = []
    same_inode: list[int] = []  # overlayfs reports the upper layer's device in /proc/locks
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":  # "->" marks a waiter, not a holder
            continue
        try:
            pid = int(parts[4])
        except ValueError:
            continue
        if parts[5] == want:
            exact.append(pid)
        elif parts[5].rsplit(":", 1)[-1] == str(ino):
            same_inode.append(pid)
    return exact or same_inode


def is_locked(fd: int) -> tuple[bool, int | None]:
    """(held, pid of the holder if the kernel says). Uses /proc/locks so that reading never
    disturbs a concurrent acquirer; falls back to a shared-lock probe where it is unreadable."""
    st = os.fstat(fd)
    pids = proc_locks(st.st_dev, st.st_ino)
    if pids is not None:
        return (bool(pids), next((p for p in pids if p > 0), None))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True, None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False, None
