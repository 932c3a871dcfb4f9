"""The GPU queue: one file per waiting job in the lease folder, no daemon, the leases' trust rules.

A waiter (`torchplace run --wait`, `pick(wait=...)`) writes ``queue.<uid>.<random>`` (its request:
how many GPUs, whole or how much memory each, until when) and holds an exclusive flock on it while it
waits. As with the leases, the kernel is the witness: an entry counts only while /proc/locks shows its
pid locking it and its owner is the uid its name and content claim, so a waiter killed with SIGKILL
leaves the queue at once, and nobody can queue in another user's name. Its place in line is when the
kernel last changed the file (its ctime: the entry's write, once it was locked), never a time the entry
claims: utime sets a ctime to now, so no writer can date itself earlier, and a skewed clock on one host
does not matter when the folder is shared (the file system stamps it). The file a killed waiter leaves
is removed by the next reader that may (its user; anyone's for the folder's owner and root, as the
sticky bit allows) once it proves the writer gone: the flock is free, granted to the reader itself.
The folder's checks (root's or ours, sticky, no symbolic links) are `leases.open_folder`'s.

Each waiter reads the queue, orders it (`policy.fairness.serve_order`: FIFO within a user, round
robin across users) and tries to lease only when `admit` says its turn has come and its request
fits. A served job touches ``served.<uid>``, whose time is what round robin reads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import LeaseError
from ..hardware.host import pid_exists
from ..policy.fairness import Ask
from .leases import LEASE_DIR_ENV, LeaseDir, new_file, now_iso, open_folder, plain, proc_locks, read_owned, user_name

QUEUE_PREFIX = "queue."
SERVED_PREFIX = "served."
_ENTRY = re.compile(r"^queue\.([0-9]{1,10})\.[0-9a-f]{16}$")
_SERVED = re.compile(r"^served\.([0-9]{1,10})$")
_MOST, _MOST_BYTES = 2**20, 2**60  # GPUs and bytes per GPU: an entry asking for more is written by hand


@dataclass(frozen=True)
class Waiter:
    """One job in the queue: who, what it asks for, since when, and until when it waits."""

    name: str
    pid: int
    uid: int
    user: str
    since: str
    since_ns: int
    count: int
    memory_bytes: int | None
    wait_s: float
    command: str

    def ask(self) -> Ask:
        return Ask(self.name, str(self.uid), self.since_ns, self.count, self.memory_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Ticket:
    """This process's place in the queue: the entry file, locked, until `leave()`."""

    def __init__(self, folder: LeaseDir, name: str, fd: int, waiter: Waiter):
        self.folder, self.name, self.waiter = folder, name, waiter
        self._fd: int | None = fd

    def leave(self, served: bool = False) -> None:
        """Leave the queue (idempotent); `served`: record this user's serve for round robin."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with open_folder(self.folder.path, create=False) as dirfd:
            if dirfd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.name, dir_fd=dirfd)
                if served:
                    _touch_served(dirfd)
        os.close(fd)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


def join(folder: LeaseDir, *, count: int, memory_bytes: int | None, wait_s: float,
         command: str = "") -> Ticket:
    """Join the queue in `folder` with a request for `count` GPUs (whole, or `memory_bytes` each)."""
    uid = os.getuid()
    waiter = Waiter("", os.getpid(), uid, user_name(uid), now_iso(), time.time_ns(), int(count),
                    memory_bytes, float(wait_s), command[:300])
    with open_folder(folder.path, create=True) as dirfd:
        assert dirfd is not None
        _clear_dead(dirfd, os.listdir(dirfd))
        try:
            name, fd = new_file(dirfd, f"{QUEUE_PREFIX}{uid}.")
        except OSError as exc:
            problem = exc
        else:
            mine = replace(waiter, name=name)
            data = json.dumps(mine.to_dict()).encode()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel's witness that we wait
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return Ticket(folder, name, fd, _arrived(mine, os.fstat(fd)))
            except OSError as exc:
                problem = exc
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dirfd)
                os.close(fd)
    why = problem.strerror or str(problem)
    raise LeaseError(f"Cannot join the GPU queue in {folder.path} ({why}). Fix: free space there "
                     f"(`df {folder.path}`), or set {LEASE_DIR_ENV} to a directory on a file system with room.")


def waiters(folder: LeaseDir) -> list[Waiter]:
    """The jobs waiting now (entries whose writer is alive and locks them), in no order; the entries
    of waiters proven gone are removed on the way (`_clear_dead`)."""
    with open_folder(folder.path, create=False) as dirfd:
        if dirfd is None:
            return []
        found = {n: _read(dirfd, n) for n in os.listdir(dirfd) if _ENTRY.match(n)}
        _clear_dead(dirfd, [n for n, w in found.items() if w is None])
        return [w for w in found.values() if w is not None]


def last_served(folder: LeaseDir) -> dict[str, int]:
    """uid (as text) -> when a job of that user was last served from the queue (ns)."""
    out: dict[str, int] = {}
    with open_folder(folder.path, create=False) as dirfd:
        if dirfd is None:
            return out
        for name in os.listdir(dirfd):
            m = _SERVED.match(name)
            if not m:
                continue
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and str(st.st_uid) == m.group(1):
                    out[m.group(1)] = st.st_mtime_ns
    return out


def _touch_served(dirfd: int) -> None:
    name = f"{SERVED_PREFIX}{os.getuid()}"
    with contextlib.suppress(OSError):
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o644, dir_fd=dirfd)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.utime(fd)
        finally:
            os.close(fd)


def _read(dirfd: int, name: str) -> Waiter | None:
    """A queue entry, trusted only when its owner is the uid its name and content claim, and counted
    only while the kernel shows its pid (of that user) locking it."""
    m = _ENTRY.match(name)
    if not m:
        return None
    if (owned := read_owned(dirfd, name, m.group(1))) is None:
        return None
    raw, st = owned
    try:
        # the user is the file's owner, whatever the entry claims; its texts are shown to other users
        w = _arrived(Waiter(name, raw["pid"], raw["uid"], user_name(st.st_uid), "", 0, raw["count"],
                            raw.get("memory_bytes"), float(raw["wait_s"]), plain(str(raw.get("command", "")))), st)
        if (type(w.pid) is not int or w.uid != st.st_uid
                or type(w.count) is not int or not 1 <= w.count <= _MOST
                or not (w.memory_bytes is None or (type(w.memory_bytes) is int and 0 < w.memory_bytes <= _MOST_BYTES))):
            return None
        pids = proc_locks(st.st_dev, st.st_ino)
        alive = pid_exists(w.pid) if pids is None else w.pid in pids
        return w if alive else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return None


def _arrived(waiter: Waiter, st: os.stat_result) -> Waiter:
    """WAITER placed by its entry's ctime (ST), which the kernel records, not by a time it could claim."""
    return replace(waiter, since=now_iso(st.st_ctime_ns / 1e9), since_ns=st.st_ctime_ns)


def _clear_dead(dirfd: int, names: list[str]) -> None:
    """Remove the entries among NAMES whose writer is gone, proven as the leases prove it: their flock is
    free, granted to us (pids are not compared: a waiter in another PID namespace shows another pid).
    A waiter locks its entry before its first byte, so an empty one may be a waiter starting: kept.
    Only this user's entries, or anyone's for the folder's owner and root (whom the sticky bit lets)."""
    me, euid = os.getuid(), os.geteuid()
    anyone = euid == 0 or os.fstat(dirfd).st_uid == euid
    for name in names:
        m = _ENTRY.match(name)
        if not m or not (anyone or m.group(1) == str(me)):
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or not (anyone or st.st_uid == me):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its writer (or a copy of it) lives
            named = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(name, dir_fd=dirfd)
        except OSError:
            continue
        finally:
            os.close(fd)
